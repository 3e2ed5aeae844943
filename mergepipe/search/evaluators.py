"""Evaluators of a merge search: checkpoint folder in, ``{metric: float}`` out.

* the zoo evaluator (:func:`zoo_evaluator`, the default of ``mergepipe search``): per-domain
  eval loss (mean next-token cross-entropy, nats/token) on the demo zoo's held-out sets, metrics
  ``loss:<domain>``; it lives with the zoo (``mergepipe_zoo.evaluator.ZooEvaluator``) and is
  found through the entry-point group ``mergepipe.evaluators`` (:mod:`mergepipe.plugins`), so the
  core does not import the zoo.
* :class:`CommandEvaluator` — any command: ``{checkpoint}`` in the command is replaced by the
  checkpoint folder (appended as the last argument when absent); the command prints a JSON object
  of metrics on stdout (the last line that parses as a JSON object is used). Non-zero exit,
  timeout (the process group is killed), or no JSON object: the candidate fails with that reason.
* :class:`CallableEvaluator` — a Python function (library use, tests).

Objectives name metrics; ``NAME`` or ``NAME@min`` is minimised, ``NAME@max`` maximised.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import InputError


class EvaluationFailed(Exception):
    """One candidate's evaluation failed (crash, timeout, unreadable output): it is recorded as
    failed and the search goes on."""


class MissingObjective(InputError):
    """The evaluator's metrics lack an objective: every candidate would fail the same way, so the
    search stops (exit 2) with the metrics it did print."""


@dataclass(frozen=True)
class Objective:
    """A metric to optimise: ``metric`` name and ``sense`` (``min`` or ``max``)."""

    metric: str
    sense: str = "min"

    @classmethod
    def parse(cls, text: str) -> Objective:
        """``NAME``, ``NAME@min`` or ``NAME@max``.

        Raises:
            InputError: empty name or another suffix.
        """
        name, _, sense = text.strip().partition("@")
        sense = sense or "min"
        if not name or sense not in ("min", "max"):
            raise InputError(
                f"--objective {text!r}: expected a metric name, optionally with @min or @max "
                "(e.g. loss:python, accuracy@max)."
            )
        return cls(name, sense)

    def to_min(self, v: float) -> float:
        """The value in minimised form (negated for ``max``)."""
        return float(v) if self.sense == "min" else -float(v)

    def __str__(self) -> str:
        return self.metric if self.sense == "min" else f"{self.metric}@max"


def objective_values(objectives: Sequence[Objective], metrics: dict) -> list[float]:
    """Minimised objective values from a metrics dict.

    Raises:
        MissingObjective: an objective is not among the metrics.
        EvaluationFailed: a value is not a finite number.
    """
    out = []
    for o in objectives:
        if o.metric not in metrics:
            raise MissingObjective(
                f"--objective {o}: the evaluator did not produce metric {o.metric!r}; it printed "
                f"{sorted(metrics)}. Name one of those, or fix the evaluator."
            )
        try:
            v = float(metrics[o.metric])
        except (TypeError, ValueError):
            raise EvaluationFailed(f"metric {o.metric!r} is {metrics[o.metric]!r}, not a number") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise EvaluationFailed(f"metric {o.metric!r} is {v} (the merged model is broken?)")
        out.append(o.to_min(v))
    return out


class Evaluator:
    """Base class. ``timeout`` in seconds (None: none); ``in_process``: True when the work runs in
    the calling process (a timeout then abandons the thread instead of killing a process)."""

    timeout: float | None = None
    in_process = True

    def metrics(self, checkpoint: str | Path) -> dict[str, float]:  # pragma: no cover - interface
        raise NotImplementedError

    def known_metrics(self) -> list[str] | None:
        """Metric names known before running (None: unknown until the first result)."""
        return None

    def spec(self) -> dict | None:
        """JSON description to rebuild it on ``--resume`` (None: not rebuildable); its ``kind``
        names the class: ``command``, or an entry point of ``mergepipe.evaluators``."""
        return None

    @classmethod
    def from_spec(cls, spec: dict) -> Evaluator:
        """The evaluator :meth:`spec` described (plugins override it).

        Raises:
            InputError: this class cannot be rebuilt from a spec.
        """
        raise InputError(f"evaluator kind {spec.get('kind')!r} cannot be rebuilt from the search state.")


class CommandEvaluator(Evaluator):
    """Run a command per checkpoint and read its JSON metrics from stdout.

    Args:
        command: shell-style command line; ``{checkpoint}`` is replaced by the checkpoint folder
            (quoted), else the folder is appended as the last argument.
        timeout: seconds before the command's process group is killed (None: no limit).
    """

    in_process = False

    def __init__(self, command: str, timeout: float | None = None) -> None:
        if not command.strip():
            raise InputError("--eval-command: empty command; give e.g. --eval-command 'python eval.py {checkpoint}'.")
        try:
            shlex.split(command)
        except ValueError as e:
            raise InputError(f"--eval-command {command!r}: cannot parse it ({e}).") from None
        if timeout is not None and timeout <= 0:
            raise InputError(f"--eval-timeout {timeout}: must be a positive number of seconds.")
        self.command, self.timeout = command, timeout

    def argv(self, checkpoint: str | Path) -> list[str]:
        q = shlex.quote(str(checkpoint))
        line = self.command.replace("{checkpoint}", q) if "{checkpoint}" in self.command else f"{self.command} {q}"
        return shlex.split(line)

    def metrics(self, checkpoint: str | Path) -> dict[str, float]:
        argv = self.argv(checkpoint)
        try:
            p = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
        except OSError as e:
            raise EvaluationFailed(f"cannot start {argv[0]!r}: {e.strerror}") from None
        try:
            out, err = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            raise EvaluationFailed(
                f"timeout: the evaluator ran longer than {self.timeout:g} s and was killed"
            ) from None
        if p.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-3:])
            raise EvaluationFailed(f"the evaluator exited with code {p.returncode}: {tail}")
        for line in reversed(out.strip().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    return obj
        raise EvaluationFailed(
            f"the evaluator printed no JSON object of metrics on stdout (last output: {out.strip()[-200:]!r})"
        )

    def spec(self) -> dict:
        return {"kind": "command", "command": self.command, "timeout": self.timeout}


class CallableEvaluator(Evaluator):
    """A Python function ``fn(checkpoint: Path) -> {metric: value}`` (in-process)."""

    def __init__(
        self, fn: Callable[[Path], dict], timeout: float | None = None, known: Sequence[str] | None = None
    ) -> None:
        self.fn, self.timeout, self._known = fn, timeout, list(known) if known else None

    def metrics(self, checkpoint: str | Path) -> dict[str, float]:
        return self.fn(Path(checkpoint))

    def known_metrics(self) -> list[str] | None:
        return self._known


def _evaluator_plugin(kind: str) -> type[Evaluator]:
    """The evaluator class registered as ``kind`` in the entry-point group ``mergepipe.evaluators``.

    Raises:
        InputError: none is installed (the ``zoo`` kind needs the ``zoo`` extra).
    """
    from mergepipe.plugins import PluginMissing, load_plugin

    try:
        return load_plugin("mergepipe.evaluators", kind)
    except PluginMissing as e:
        raise InputError(
            f"evaluator {kind!r} is not installed ({e}): install mergepipe with its zoo extra "
            "(pip install 'mergepipe[zoo]'), or evaluate with --eval-command."
        ) from None


def zoo_evaluator(
    domains: Sequence[str] | None = None,
    *,
    tiny: bool = False,
    zoo_root: str | None = None,
    max_batches: int | None = None,
    timeout: float | None = None,
) -> Evaluator:
    """The demo zoo's evaluator (``mergepipe_zoo.evaluator.ZooEvaluator``, through the entry point
    ``mergepipe.evaluators`` / ``zoo``): metrics ``loss:<domain>``, the mean next-token
    cross-entropy in nats/token on each domain's held-out set of the zoo (built once and cached).

    Args:
        domains: domains to score (default: all four of the zoo).
        tiny: the tiny zoo (``ZooConfig.tiny()``) instead of the demo size.
        zoo_root: zoo cache root (default ``$MERGEPIPE_HOME/zoo``).
        max_batches: score only the first ``max_batches`` batches per domain (faster, noisier).
        timeout: seconds per evaluation (in process: the evaluation is abandoned, not killed).

    Raises:
        InputError: an unknown domain, or the zoo is not installed.
    """
    return _evaluator_plugin("zoo").from_spec(
        {
            "kind": "zoo",
            "domains": list(domains) if domains else None,
            "tiny": tiny,
            "zoo_root": zoo_root,
            "max_batches": max_batches,
            "timeout": timeout,
        }
    )


def evaluator_from_spec(spec: dict | None) -> Evaluator:
    """Rebuild an evaluator recorded in a search state.

    Raises:
        InputError: the state records none (a Python-function evaluator: pass it again).
    """
    if not spec:
        raise InputError(
            "the search state records no rebuildable evaluator (it was a Python function); "
            "pass the evaluator again to resume."
        )
    if spec.get("kind") != "command":
        return _evaluator_plugin(str(spec.get("kind"))).from_spec(spec)
    return CommandEvaluator(spec["command"], spec.get("timeout"))


def call_with_timeout(fn: Callable[[], dict], timeout: float | None) -> dict:
    """Run an in-process evaluation with a time limit: on timeout the helper thread is abandoned
    (its result ignored; Python threads cannot be killed) and :class:`EvaluationFailed` raised."""
    if timeout is None:
        return fn()

    box: dict = {}

    def run():
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise EvaluationFailed(
            f"timeout: the evaluation ran longer than {timeout:g} s (abandoned after {time.monotonic() - t0:.1f} s)"
        )
    if "e" in box:
        raise box["e"]
    return box["r"]
