"""``mergepipe demo``: real trained experts, merged under shrinking expert-I/O budgets.

Builds (once, cached) the zoo of :mod:`mergepipe_zoo` — a small Llama-architecture model
pre-trained offline and experts fine-tuned on distinct domains, checked at build time to be a
zoo where merging helps (its gates) — then merges all experts with task_arithmetic (the zoo's
recommended weight) at full budget and at 50%, 25% and 10% of the experts' bytes, and evaluates
every merged model on every domain beside the base and each expert. Each merge row shows the
normalised gain per domain (:func:`mergepipe.metrics.normalised_gain`: 1 = as good as the
domain's expert, 0 = as good as the base) and, for budgeted rows, the share of the full merge's
gain kept on the worst domain. Budgeted merges use the planner's default fidelity tiers (a block
is read exactly, merged from 1-3 sign planes of its sketch, or skipped; sketch bytes count against the budget
and are shown beside the bytes read).

Lives with the zoo (needs the ``zoo`` extra, ``pip install 'mergepipe[zoo]'``): the core finds
:func:`run_demo` through the entry point ``mergepipe.demos`` / ``zoo`` (:mod:`mergepipe.plugins`)
and never imports this package.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_BUDGETS = ("unlimited", "50%", "25%", "10%")


def run_demo(
    zoo_root: Path | None = None,
    out_root: Path | None = None,
    *,
    tiny: bool = False,
    log: Callable[[str], None] = print,
    method: str = "task_arithmetic",
    params: tuple[str, ...] | None = None,
    table_to_stderr: bool = False,
) -> list[dict]:
    """Run the demo; returns one row per model (base, experts, merges) and prints a table.

    ``tiny`` selects ``ZooConfig.tiny()`` (the CLI's default ``--size tiny``: it passes the zoo's
    build gates) instead of ``ZooConfig()`` (``--size demo``, which fails its gates with the
    current recipe at seed 0, see docs/QUALITY.md; a gate failure raises
    :class:`~mergepipe.errors.MergepipeError`, exit 1, and publishes nothing).

    Each merge row: budget, expert bytes read (from the storage counters), wall time of the merge
    (plan + execute + commit; analysis is cached after the first merge), retained energy, and
    per-domain eval loss. The first merge also pays the one-time analysis (shown separately).
    The table goes to stdout, or to stderr with ``table_to_stderr`` (``--json``: stdout is JSON only).
    """
    from rich.console import Console

    from mergepipe.catalog.catalog import Catalog, default_home

    zm = _zoo_module()
    t0 = time.perf_counter()
    zoo = _ready_zoo(zm, zoo_root, tiny, log)
    log(f"zoo ready in {time.perf_counter() - t0:.1f} s at {zoo.root}")
    out_root = Path(out_root) if out_root else default_home() / "demo" / zoo.config.key()
    cat = Catalog(out_root / "catalog.sqlite")
    evals = _EvalCache(out_root / "evals.json", zoo)
    rows = _reference_rows(zoo, evals)
    experts = [(n, str(p)) for n, p in zoo.experts.items()]
    if params is None:
        rec = zoo.testbed.raw.get("recommended_params", {}).get(method, {})
        params = tuple(f"{k}={v:g}" for k, v in rec.items())
    base_l = {d: rows[0][f"loss.{d}"] for d in zoo.eval_sets}
    own: dict[str, float] = {}  # domain -> the loss of its (first) expert on it
    for n in zoo.experts:
        d = zoo.expert_domain(n)
        own.setdefault(d, next(r for r in rows if r["model"] == f"expert {n}")[f"loss.{d}"])
    full_ng: dict | None = None
    for b in DEMO_BUDGETS:
        row = _merge_row(zoo, experts, method, params, b, out_root, cat, evals)
        rows.append(row)
        full_ng = _add_gains(row, b, base_l, own, full_ng)
    table = _demo_table(rows, list(zoo.eval_sets), method, params, len(experts))
    Console(width=max(150, Console().width), stderr=table_to_stderr).print(table)
    log(f"demo finished in {time.perf_counter() - t0:.1f} s; snapshots under {out_root}")
    return rows


def _zoo_module() -> Any:
    """:mod:`mergepipe_zoo.zoo`, with transformers' progress bars off (one "Loading weights" bar per
    evaluated model otherwise).

    Raises:
        InputError: the zoo's dependencies (torch, transformers, tokenizers) are not installed.
    """
    from mergepipe.errors import InputError

    try:
        import transformers

        import mergepipe_zoo.zoo as zm
    except ImportError as e:
        raise InputError(
            f"mergepipe demo needs the model zoo ({e}): install mergepipe with its zoo extra "
            "(torch, transformers, tokenizers)."
        ) from None
    transformers.utils.logging.disable_progress_bar()
    return zm


def _ready_zoo(zm: Any, zoo_root: Path | None, tiny: bool, log: Callable[[str], None]) -> Any:
    """The zoo (built once, cached under ``zoo_root``; ``zm`` is :func:`_zoo_module`).

    Raises:
        MergepipeError: the zoo failed its build gates (nothing published).
    """
    from mergepipe.errors import MergepipeError

    try:
        return zm.build_zoo(zoo_root, zm.ZooConfig.tiny() if tiny else zm.ZooConfig(), log=log)
    except zm.ZooGateError as e:
        raise MergepipeError(
            f"{e}; nothing was published. `mergepipe demo --size tiny` builds a zoo that "
            "passes its gates (docs/QUALITY.md)."
        ) from None


class _EvalCache:
    """Per-domain eval losses of the demo's models, cached in the JSON file ``path`` by model
    identity (zoo key + name, or snapshot id) and written (atomically) after each new evaluation."""

    def __init__(self, path: Path, zoo: Any):
        self.path, self.zoo = path, zoo
        self.cache: dict = json.loads(path.read_text()) if path.exists() else {}

    def losses(self, key: str, model: Path) -> dict:
        """``{domain: mean eval loss (nats/token)}`` of the model in folder ``model``."""
        if key not in self.cache:
            from mergepipe.storage.local import replace_file
            from mergepipe_zoo.zoo import evaluate

            self.cache[key] = evaluate(model, self.zoo)
            replace_file(self.path, json.dumps(self.cache, indent=1, sort_keys=True).encode(), what="eval cache")
        return self.cache[key]


def _reference_rows(zoo: Any, evals: _EvalCache) -> list[dict]:
    """The base's row, then one per expert: ``{model, loss.<domain>...}``."""
    key = zoo.config.key()
    rows = [{"model": "base", **{f"loss.{d}": v for d, v in evals.losses(f"zoo:{key}:base", zoo.base).items()}}]
    for name, p in zoo.experts.items():
        rows.append(
            {"model": f"expert {name}", **{f"loss.{d}": v for d, v in evals.losses(f"zoo:{key}:{name}", p).items()}}
        )
    return rows


def _merge_row(
    zoo: Any,
    experts: list[tuple[str, str]],
    method: str,
    params: tuple[str, ...],
    budget: str,
    out_root: Path,
    cat: Any,
    evals: _EvalCache,
) -> dict:
    """Merge all ``experts`` under ``budget`` into ``<out_root>/<method>-<tag>`` (committed; a repeat
    finds it committed) and evaluate it: the row of the table with its bytes, times and losses."""
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    tag = "full" if budget == "unlimited" else budget.replace("%", "pct")
    out = out_root / f"{method}-{tag}"
    st = LocalStorage(IOCounters())
    t = time.perf_counter()
    res = merge(str(zoo.base), experts, method, str(out), list(params), budget=budget, catalog=cat, storage=st)
    wall = time.perf_counter() - t
    s = res.summary()
    ev = evals.losses(s["snapshot_id"], Path(res.out))
    return {
        "model": f"{method} budget {budget}",
        "budget": s["io"]["expert_budget_bytes"],
        "expert_read_bytes": s["io"]["expert_read_bytes"],
        "sketch_read_bytes": s["io"].get("planned_sketch_read_bytes", 0),
        "expert_bytes_total": s["io"]["expert_bytes_total"],
        "wall_s": round(s["wall_s"] if res.already_committed else wall, 2),
        "analyze_s": round(res.analyze_s, 2),
        "retained_energy": s["retained_energy"],
        "snapshot_id": s["snapshot_id"],
        "already_committed": s["already_committed"],
        **{f"loss.{d}": v for d, v in ev.items()},
    }


def _add_gains(
    row: dict, budget: str, base_l: dict[str, float], own: dict[str, float], full_ng: dict | None
) -> dict | None:
    """Add ``normalised_gain`` (per domain; ``None`` when undefined) to a merge ``row`` and, for a
    budgeted merge, ``kept_share`` of the full merge's gains ``full_ng``; returns the full merge's
    gains (this row's for the unlimited budget, else ``full_ng``)."""
    from mergepipe.metrics import kept_share, normalised_gain

    ev = {k.split(".", 1)[1]: v for k, v in row.items() if k.startswith("loss.")}
    try:
        ng = normalised_gain(ev, base_l, own)
    except ValueError:
        ng = None
    row["normalised_gain"] = ng
    if budget == "unlimited":
        return ng
    if ng and full_ng and all(v > 0 for v in full_ng.values()):
        row["kept_share"] = kept_share(ng, full_ng)
    return full_ng


def _demo_table(rows: list[dict], domains: list[str], method: str, params: tuple[str, ...], n_experts: int) -> Any:
    """The demo's table (a :class:`rich.table.Table`): one line per row, losses with normalised gains."""
    from rich.table import Table

    table = Table(
        "model",
        "expert budget",
        "expert bytes read",
        "merge wall s",
        "retained energy",
        *[f"loss {d} (NG)" for d in domains],
        "mean loss",
        "lowest NG (domain)",
        "lowest kept/full NG (domain)",
        caption="lowest NG: the domain where this model's normalised gain is lowest. lowest kept/full NG: the "
        "domain where a budgeted merge keeps the smallest share of the full merge's gain on it. Each column "
        "names its own worst domain, so the two can differ (a domain the full merge helps little can keep a "
        "small share of that little gain).",
        title=f"mergepipe demo: {method} {' '.join(params)}, {n_experts} experts; NG = (L_base − L)/(L_base − "
        "L_expert) per domain (1 = the domain's expert, 0 = the base)",
    )
    for r in rows:
        table.add_row(*_table_cells(r, domains))
    return table


def _table_cells(r: dict, domains: list[str]) -> list[str]:
    """The cells of one row of :func:`_demo_table` (``-`` where the row has no such value)."""
    from mergepipe.metrics import worst

    ng, ks = r.get("normalised_gain"), r.get("kept_share")
    merged = "expert_read_bytes" in r

    def cell(d: str) -> str:
        return f"{r[f'loss.{d}']:.3f}" + (f" ({ng[d]:+.2f})" if ng else "")

    return [
        r["model"],
        "-" if not merged else ("unlimited" if r["budget"] is None else f"{r['budget'] / 2**20:.2f} MiB"),
        "-"
        if not merged
        else f"{r['expert_read_bytes'] / 2**20:.2f} MiB of {r['expert_bytes_total'] / 2**20:.2f}"
        + (f" (sketches {r['sketch_read_bytes'] / 2**20:.2f})" if r.get("sketch_read_bytes") else ""),
        "-" if "wall_s" not in r else f"{r['wall_s']:.2f}" + (" (committed earlier)" if r["already_committed"] else ""),
        "-" if "retained_energy" not in r else f"{r['retained_energy']:.1%}",
        *[cell(d) for d in domains],
        f"{sum(r[f'loss.{d}'] for d in domains) / len(domains):.4f}",
        "-" if not ng else "{} {:+.2f}".format(*worst(ng)),
        "-" if not ks else "{} {:.0%}".format(*worst(ks)),
    ]
