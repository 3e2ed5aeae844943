"""The demo zoo as a search evaluator: per-domain eval loss of a candidate checkpoint.

Registered as the entry point ``mergepipe.evaluators`` / ``zoo`` (``pyproject.toml``), which
:func:`mergepipe.search.evaluators.zoo_evaluator` and
:func:`mergepipe.search.evaluators.evaluator_from_spec` load: the core does not import this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mergepipe.errors import InputError
from mergepipe.search.evaluators import Evaluator

__all__ = ["ZooEvaluator"]


class ZooEvaluator(Evaluator):
    """Per-domain eval loss on the demo zoo's held-out sets.

    Args:
        domains: domains to score (default: all four).
        tiny: the tiny zoo (tests) instead of the demo size.
        zoo_root: zoo cache root (default ``$MERGEPIPE_HOME/zoo``).
        max_batches: score only the first ``max_batches`` batches per domain (faster).
    """

    def __init__(
        self,
        domains: Sequence[str] | None = None,
        *,
        tiny: bool = False,
        zoo_root: str | None = None,
        max_batches: int | None = None,
        timeout: float | None = None,
    ) -> None:
        from mergepipe_zoo.zoo import DOMAINS

        self.domains = list(domains or DOMAINS)
        bad = [d for d in self.domains if d not in DOMAINS]
        if bad:
            raise InputError(f"--evaluator zoo: unknown domain(s) {bad}; the zoo's domains are {list(DOMAINS)}.")
        self.tiny, self.zoo_root, self.max_batches, self.timeout = tiny, zoo_root, max_batches, timeout
        self._zoo = None

    @property
    def zoo(self):
        if self._zoo is None:
            from mergepipe_zoo.zoo import ZooConfig, build_zoo

            self._zoo = build_zoo(
                Path(self.zoo_root) if self.zoo_root else None, ZooConfig.tiny() if self.tiny else ZooConfig()
            )
        return self._zoo

    def metrics(self, checkpoint: str | Path) -> dict[str, float]:
        from mergepipe_zoo.zoo import evaluate

        r = evaluate(Path(checkpoint), self.zoo, max_batches=self.max_batches, domains=self.domains)
        return {f"loss:{d}": v for d, v in r.items()}

    def known_metrics(self) -> list[str]:
        return [f"loss:{d}" for d in self.domains]

    @classmethod
    def from_spec(cls, spec: dict) -> ZooEvaluator:
        """The evaluator :meth:`spec` recorded (``mergepipe search --resume``)."""
        return cls(
            spec["domains"],
            tiny=spec["tiny"],
            zoo_root=spec["zoo_root"],
            max_batches=spec["max_batches"],
            timeout=spec.get("timeout"),
        )

    def spec(self) -> dict:
        return {
            "kind": "zoo",
            "domains": self.domains,
            "tiny": self.tiny,
            "zoo_root": self.zoo_root,
            "max_batches": self.max_batches,
            "timeout": self.timeout,
        }
