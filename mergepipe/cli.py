"""mergepipe command line (typer + rich). Heavy modules (torch, numpy) load inside commands so
``mergepipe --help`` stays fast.

Every user error exits with code 2 and one message naming the file/field and the fix; with
``--json`` stdout holds only the JSON result and progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer

from mergepipe.methods.registry import method_names

#: when this module was imported (the fallback origin of ``total_s`` where /proc is absent)
_T_IMPORT = time.perf_counter()


def _since_process_start() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat`` start time against
    ``/proc/uptime``, 10 ms resolution), so ``--json``'s ``total_s`` includes the interpreter's
    start and every import (``import torch`` alone is seconds cold); elsewhere, since this
    module was imported."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        age = up - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0.0 <= age < 10 * 365 * 86400:
            return age
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter() - _T_IMPORT


if TYPE_CHECKING:
    from rich.progress import TaskID

app = typer.Typer(
    name="mergepipe",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _flags_take_no_value() -> None:
    """Render boolean flags as flags in ``--help`` (``--json``, never ``--json <bool>``).

    typer 0.29's rich help asks every option for its value's type, flags included, and so prints
    ``--json <bool>``: users then try ``--json true``, which is refused. A flag takes no value, so
    its type column is left empty (what click's plain help and typer before 0.29 print). Applied
    once, at import; a typer without ``TyperOption.display_type_rich`` is left alone.
    """
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - every typer the project allows has it
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_mergepipe_flags", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        return shown(self, ctx)

    display_type_rich._mergepipe_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()


def _version(value: bool) -> None:
    """``mergepipe --version``: the installed version, then exit."""
    if value:
        from mergepipe import __version__

        print(f"mergepipe {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Budget-aware LLM merging: catalog expert task vectors once, plan which blocks to read under an
    expert-I/O budget, stream the merge, commit an immutable snapshot with a manifest."""


CatalogOpt = Annotated[
    Optional[str],
    typer.Option(
        "--catalog",
        help="SQLite catalog file, or an s3:// prefix of index objects (the cluster catalog) "
        "[default: $MERGEPIPE_HOME/catalog.sqlite, ~/.mergepipe]",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (progress on stderr).")]
ExpertOpt = Annotated[
    list[str],
    typer.Option(
        "--expert", "-e", help="Expert checkpoint: URI or NAME=URI (repeat). Name defaults to the last path component."
    ),
]
ParamOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--param",
        "-p",
        help="Method parameter NAME=VALUE (all experts / the merge) or EXPERT:NAME=VALUE (one expert, by name or "
        "1-based index), e.g. -p density=0.5 -p math:weight=0.3. Names follow mergekit: weight, density, "
        "normalize, rescale, lambda, gamma, epsilon, t, filter_wise, ... VALUE may be a JSON list: a gradient "
        'over layers (-p \'density=[0.2,0.8]\') or filters (-p \'weight=[{"filter":"mlp","value":0.5},{"value":1}]\').',
    ),
]
BudgetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--budget",
        "-b",
        help="Expert-I/O budget: bytes with a unit (512MiB, 1.5GB, 1073741824B), a % of the experts' size (25%), or 'unlimited'; a bare number is refused.",
    ),
]


def _finite(value: Optional[float]) -> Optional[float]:
    """Option callback: typer accepts ``inf``/``nan`` as floats; no option of mergepipe means them."""
    import math

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


FidelityOpt = Annotated[
    Optional[float],
    typer.Option(
        "--fidelity",
        callback=_finite,
        help="Read just enough blocks to retain this fraction (0-1] of the full-budget task-vector energy.",
    ),
]


def _err_console():
    from rich.console import Console

    return Console(stderr=True)


#: Environment variable naming a file that receives the one-line error of a failed run (the
#: operator's Jobs set it to the container's terminationMessagePath, so the Kubernetes Job's
#: failure explains itself).
TERMINATION_LOG_ENV = "MERGEPIPE_TERMINATION_LOG"


def _termination_message(msg: str) -> None:
    """Write ``msg`` as one line (at most 4096 bytes, the kubelet's limit) to the file
    ``$MERGEPIPE_TERMINATION_LOG`` names, if it is set; best effort (an unwritable path is ignored:
    the message is on stderr anyway)."""
    import os

    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    line = " ".join(str(msg).split()).encode()[:4096].decode(errors="ignore")
    from mergepipe.errors import InputError
    from mergepipe.storage.local import open_for_write

    try:
        fd = open_for_write(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="termination log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except (OSError, InputError):
        pass


def _print_error(msg: str) -> None:
    """``error: MSG`` on stderr, one line. ``msg`` is escaped: it quotes names from input files,
    which must print as written (``model[kube]``) and never be taken for rich markup (a name
    holding ``[/]`` made rich raise MarkupError, a traceback)."""
    _err_console().print(f"[bold red]error:[/] {_esc(msg)}", highlight=False, soft_wrap=True)


def _esc(text) -> str:
    """``text`` escaped for rich markup (it may quote names from input files)."""
    from rich.markup import escape

    return escape(str(text))


def _fail(msg: str, code: int = 2) -> NoReturn:
    _print_error(msg)
    _termination_message(f"error: {msg}")
    raise typer.Exit(code)


def _catalog(location: Optional[str]):
    from mergepipe.catalog.objectstore import open_catalog

    return open_catalog(location)


def _storage():
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    return LocalStorage(IOCounters())


def _storage_for(uri: str):
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    return open_storage(uri, IOCounters())


class _Progress:
    """A rich progress bar on stderr for byte-counted stages."""

    def __init__(self, enabled: bool = True) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self.p = Progress(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=_err_console(),
            transient=True,
            disable=not enabled,
        )
        self.tasks: dict[str, TaskID] = {}
        self.totals: dict[str, int] = {}
        self.started = False

    def __enter__(self):
        return self  # the display starts with the first byte reported: a refusal prints one line only

    def __exit__(self, *a):
        if self.started:  # transient: the bar is erased, so a result or an error line stands alone
            self.p.__exit__(*a)

    def __call__(self, stage: str, advance: int, total: int | None) -> None:
        """Report ``advance`` more bytes of ``stage`` (of ``total``, when known). Nothing is
        drawn until a stage has moved a byte: an error found before that prints alone."""
        if total is not None:
            self.totals[stage] = total
            if stage in self.tasks:
                self.p.update(self.tasks[stage], total=total)
        if not advance:
            return
        if not self.started:
            self.p.__enter__()
            self.started = True
        if stage not in self.tasks:
            self.tasks[stage] = self.p.add_task(stage, total=self.totals.get(stage))
        self.p.advance(self.tasks[stage], advance)


def _human(n: int | float | None) -> str:
    if n is None:
        return "unlimited"
    n = float(n)
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
        n /= 1024
    return str(n)


@app.command("init-db")
def init_db(catalog: CatalogOpt = None, json_out: JsonOpt = False):
    """Create the catalog (idempotent)."""
    c = _catalog(catalog)
    if json_out:
        print(json.dumps({"catalog": str(c.path)}))
    else:
        _err_console().print(f"catalog ready at {c.path}")


@app.command()
def register(
    uris: Annotated[
        list[str], typer.Argument(help="Checkpoint folders or s3:// prefixes (lora:PATH: a PEFT LoRA adapter)")
    ],
    catalog: CatalogOpt = None,
    json_out: JsonOpt = False,
):
    """Register checkpoints: read their shard headers and record layout and identity digest."""
    from mergepipe.lora import split_kind

    c = _catalog(catalog)
    out = []
    for u0 in uris:
        kind, u = split_kind(u0)
        st = _storage_for(u)
        r = c.register(st, u, kind=kind)
        out.append(
            {
                "uri": r.uri,
                "identity": r.identity,
                "tensors": len(r.layout.tensors),
                "shards": len(r.layout.shards),
                "total_bytes": r.total_bytes,
                "header_bytes_read": st.counters.snapshot()["read"]["catalog"],
                **({"adapter": r.adapter.summary()} if r.adapter is not None else {}),
            }
        )
    if json_out:
        print(json.dumps(out if len(out) > 1 else out[0]))
    else:
        for o in out:
            _err_console().print(
                f"{_esc(o['uri'])}: identity {o['identity'][:16]}, {o['tensors']} tensors in "
                f"{o['shards']} shard(s), {_human(o['total_bytes'])}"
            )


@app.command()
def analyze(
    base: Annotated[str, typer.Option("--base", help="Base checkpoint (the experts' common ancestor)")],
    expert: ExpertOpt,
    block_size: Annotated[str, typer.Option("--block-size", help="Target block size (whole rows)")] = "128KiB",
    pairs: Annotated[
        bool,
        typer.Option(
            "--pairs",
            help="Also record the pair statistics <delta_i, delta_j> of every two experts, which model_stock "
            "and nuslerp plan with (needs at least 2 experts; cached pairs are not recomputed).",
        ),
    ] = False,
    calibration: Annotated[
        Optional[str],
        typer.Option(
            "--calibration",
            help='JSON-lines file of {"text": ...} documents: also record the base\'s per-block '
            "Fisher sensitivity on it (for plans with --value fisher; cached by base and calibration identity)",
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="torch device for the Fisher sensitivity (--calibration): cpu, cuda, cuda:N")
    ] = "cpu",
    work_memory: Annotated[
        Optional[str],
        typer.Option(
            "--work-memory",
            help="Memory target of the analysis: row chunks sized so their float32/float64 temporaries "
            "(~96 bytes per element) fit, and an eighth of it for each expert's sketch planes before they "
            "spill to a temporary file [default: 16MiB chunks of base bytes, ~0.7 GB peak for bf16]",
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Analyze again even when the catalog has the statistics (replaces them and the sketch blobs; "
            "for a damaged catalog entry)",
        ),
    ] = False,
    catalog: CatalogOpt = None,
    json_out: JsonOpt = False,
):
    """Analyze experts against the base once: per-block task-vector statistics (cached by identity);
    with --pairs also the per-tensor dot products of every two experts' task vectors."""
    _analyze(base, expert, block_size, pairs, calibration, device, work_memory, force, catalog, json_out)


def _analyze(
    base: str,
    expert: list[str],
    block_size: str,
    pairs: bool,
    calibration: str | None,
    device: str,
    work_memory: str | None,
    force: bool,
    catalog: str | None,
    json_out: bool,
) -> None:
    """The body of ``mergepipe analyze`` (its options as given): analyze, then report on stderr
    (or as one JSON line on stdout). Exits 2 on bad input (:func:`_fail`)."""
    from dataclasses import asdict

    from mergepipe import api
    from mergepipe.pipeline import parse_expert

    c = _catalog(catalog)
    st = _storage_for(base)
    bb = _block_bytes(block_size)
    wb = _work_bytes(work_memory) if work_memory is not None else None
    uris = [parse_expert(e)[1] for e in expert]
    if pairs and len({u.rstrip("/") for u in uris}) < 2:
        _fail("--pairs needs at least two distinct --expert checkpoints (pair statistics relate two experts).")
    t0 = time.perf_counter()
    with _Progress(True) as prog:
        a = api.analyze(
            base,
            uris,
            block_size=bb,
            pairs=pairs,
            calibration=calibration,
            device=device,
            work_memory=wb,
            force=force,
            catalog=c,
            storage=st,
            progress=lambda n: prog("analyze", n, None),
        )
    rd = a.bytes_read
    res: dict[str, Any] = {k: v for k, v in asdict(a).items() if v is not None}
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    if json_out:
        print(json.dumps(res))
    else:
        extra = f" and {len(res['pairs'])} pair(s)" if pairs else ""
        _err_console().print(
            f"analyzed {len(a.experts)} expert(s){extra}; read base {_human(rd['base'])}, experts "
            f"{_human(rd['expert'])} (0 means cached)"
        )


def _block_bytes(text: str) -> int:
    """``--block-size`` of analyze, plan and merge: one rule (:func:`mergepipe.pipeline.parse_block_size`)."""
    from mergepipe.pipeline import parse_block_size

    return parse_block_size(text)


def _work_bytes(text: str) -> int:
    from mergepipe.pipeline import parse_bytes

    wb = parse_bytes(text, what="--work-memory")
    if not wb or wb < (1 << 20):
        _fail("--work-memory must be at least 1MiB, e.g. 256MiB.")
    return wb


def _merge_request(config, base, expert, method, param, budget, fidelity, seed, out=None, *, planning, run):
    """The :class:`mergepipe.request.MergeRequest` of ``plan``/``merge`` and how its fields are
    named in messages: from a mergekit config (``--config``; ``--budget/--fidelity/--seed``
    override its keys, fields named as the config's keys) or from the command line (``--param``
    strings parsed here, fields named as options); ``planning`` and ``run`` (the request's
    :class:`mergepipe.request.PlanningOptions` and :class:`mergepipe.request.RunOptions`) come
    from options either way and are named as options. Exits 2 when both or neither are given."""
    from mergepipe.pipeline import parse_expert
    from mergepipe.request import cli_where, request_from_args

    if config is not None:
        from mergepipe.config import load_config

        given = [f for f, v in (("--base", base), ("--expert", expert), ("--method", method), ("--param", param)) if v]
        if given:
            _fail(
                f"--config {config} defines the models, method and parameters; drop {', '.join(given)} "
                "(--budget, --fidelity and --seed override the config's keys)."
            )
        c = load_config(config)
        req = c.with_overrides(output=out, budget=budget, fidelity=fidelity, seed=seed)
        cfg_where, opt_where = c.where, cli_where(req.names)

        def where(loc):
            return opt_where(loc) if loc and loc[0] in ("planning", "run") else cfg_where(loc)

        return req.model_copy(update={"planning": planning, "run": run}), where
    if not base or (not expert and (method or "ties") != "passthrough"):
        _fail("--base and --expert are required (or give a mergekit config with --config merge.yml).")
    req = request_from_args(
        base,
        [parse_expert(e) for e in expert or []],
        method or "ties",
        param or [],
        budget=budget,
        fidelity=fidelity,
        seed=seed or 0,
        output=out,
        planning=planning,
        run=run,
    )
    return req, None


METHODS_HELP = ", ".join(method_names())
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed of the DARE/DELLA random streams [default: 0]")]
# plan and merge: models and method from the command line, or from --config
OptBaseOpt = Annotated[Optional[str], typer.Option("--base", help="Base checkpoint folder or s3:// prefix")]
OptExpertOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--expert", "-e", help="Expert checkpoint: URI or NAME=URI (repeat). Name defaults to the last path component."
    ),
]
OptMethodOpt = Annotated[
    Optional[str],
    typer.Option("--method", "-m", help=f"Merge method, by mergekit's name: {METHODS_HELP} [default: ties]"),
]
ConfigOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        help="A mergekit YAML config (models, base_model, merge_method, parameters, dtype, out_dtype; "
        "plus budget, fidelity, seed) instead of --base/--expert/--method/--param",
    ),
]
BlockOpt = Annotated[str, typer.Option("--block-size", help="Catalog block size (whole rows)")]
ValueOpt = Annotated[
    Optional[str],
    typer.Option(
        "--value",
        help="Block value the budgeted selection maximises per byte: energy (task-vector energy the method "
        "keeps) or fisher (that energy weighted by the base's per-block Fisher on --calibration) "
        "[default: fisher with --calibration, else energy]",
    ),
]
CalibrationOpt = Annotated[
    Optional[str],
    typer.Option(
        "--calibration",
        help='JSON-lines file of {"text": ...} documents (local or s3://): the base\'s per-block '
        "Fisher sensitivity is measured on it once and kept in the catalog (causal LMs and encoders)",
    ),
]
SketchOpt = Annotated[
    Optional[str],
    typer.Option(
        "--sketch",
        help="Fidelity tiers under a budget: signK lets the planner merge a block from the first k <= K "
        "(1-3) sign planes of its sketch (recorded by analyze; their bytes count against the budget) "
        "instead of reading it exactly or skipping it; sign3+r1 adds a rank-1 tier (the block's rank-1 "
        "factors + one sign plane of the rest); none: read exactly or skip [default: sign3+r1]",
    ),
]
DeadlineOpt = Annotated[
    Optional[str],
    typer.Option(
        "--deadline",
        help="Time target with a unit (60s, 2m, 1.5h): plan the largest budget (at most --budget) whose "
        "predicted time fits, from this machine's measured throughput (`mergepipe calibrate`; measured on "
        "first use); a bare number is refused",
    ),
]
MemOpt = Annotated[
    str,
    typer.Option(
        "--work-memory", help="Engine memory target: float32 working set per chunk, and bytes prefetched ahead"
    ),
]


@app.command()
def plan(
    base: OptBaseOpt = None,
    expert: OptExpertOpt = None,
    config: ConfigOpt = None,
    method: OptMethodOpt = None,
    param: ParamOpt = None,
    budget: BudgetOpt = None,
    fidelity: FidelityOpt = None,
    seed: SeedOpt = None,
    block_size: BlockOpt = "128KiB",
    work_memory: MemOpt = "256MiB",
    value: ValueOpt = None,
    calibration: CalibrationOpt = None,
    sketch: SketchOpt = None,
    deadline: DeadlineOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the plan JSON here")] = None,
    catalog: CatalogOpt = None,
    json_out: JsonOpt = False,
):
    """Plan a merge (registers and analyzes as needed) and print its summary; --out saves the plan.
    Takes the same inputs as `merge`: --base/--expert/--method/--param or a mergekit --config."""
    from mergepipe import api
    from mergepipe.request import PlanningOptions, RunOptions

    req, where = _merge_request(
        config,
        base,
        expert,
        method,
        param,
        budget,
        fidelity,
        seed,
        planning=PlanningOptions(
            value=value,
            calibration=calibration,
            sketch=sketch,
            block_bytes=_block_bytes(block_size),
            deadline=deadline,
        ),
        run=RunOptions(work_bytes=_work_bytes(work_memory)),
    )
    p = api.plan(req, where=where, catalog=_catalog(catalog), storage=_storage_for(req.base))
    if out:
        from mergepipe.storage.local import replace_file

        out.parent.mkdir(parents=True, exist_ok=True)
        replace_file(out, p.to_json().encode(), what="plan file")
    summary = {
        "plan_digest": p.digest,
        "method": p.method,
        "io": p.io.model_dump(),
        "expert_budget_bytes": p.budget_bytes,
        "expert_bytes_total": p.expert_bytes_total,
        "retained_energy": p.retained_energy,
        "predicted_seconds": p.predicted_seconds,
        "plan": str(out) if out else None,
    }
    if json_out:
        print(json.dumps(summary))
    else:
        _print_explain(p, per_tensor=False)


def _print_explain(p, per_tensor: bool = False, manifest: dict | None = None):
    """Text ``explain``: the plain-words summary, its terms defined once, bytes per role, blocks
    per layer; per tensor only with ``per_tensor`` (``--tensors``)."""
    from rich.console import Console
    from rich.table import Table

    from mergepipe.planner.report import block_grid, io_rows, summary, terms

    con = Console(stderr=False)
    con.print(f"[bold]plan {p.digest[:16]}[/]", highlight=False)
    con.print(_esc(summary(p, manifest)), highlight=False)
    if p.explain:
        con.print(f"[dim]planner:[/] {_esc(p.explain)}", highlight=False)
    if p.predicted_seconds is not None:
        from mergepipe.planner.cost import describe

        con.print(_esc(describe(p.predicted_seconds)) + " on the calibrated machine", highlight=False)
    con.print()
    for word, meaning in terms(p):
        con.print(f"  [bold]{_esc(word)}[/]: {_esc(meaning)}", highlight=False)
    t = Table("role", "estimated", *(["realized"] if manifest else []), title="bytes")
    for role, est, real in io_rows(p, manifest):
        t.add_row(role, _human(est), *([_human(real)] if manifest else []))
    con.print(t)
    from mergepipe.slices import bytes_by_source

    views, by_src = bytes_by_source(p)  # slices / merged vocabularies: where the bytes come from
    if views:
        for v in views:
            con.print(f"  view: {_esc(v)}", highlight=False)
        st = Table("source model", "copied", "merged: base rows", "merged: expert blocks", title="bytes by source")
        for name, copied, mb, me in by_src:
            st.add_row(_esc(name), _human(copied), _human(mb), _human(me))
        con.print(st)
    g = block_grid(p)
    lt = Table("layer", *g.experts, "expert bytes", title="blocks per layer: exact / sketch / skipped")
    for r in g.rows:
        lt.add_row(r, *[f"{c.exact}/{c.sketch}/{c.skipped}" for c in g.cells[r]], _human(g.row_total(r).bytes))
    con.print(lt)
    if per_tensor:
        tt = Table("tensor", "blocks read", "explanation", title="per tensor")
        for tp in p.tensors:
            n = sum(b1 - b0 for te in tp.experts for b0, b1 in te.blocks)
            tt.add_row(_esc(tp.name), f"{n}/{tp.n_blocks * len(p.experts)}", _esc(tp.explain))
        con.print(tt)
    else:
        con.print(f"{len(p.tensors)} tensors: `mergepipe explain PLAN --tensors` explains each.", highlight=False)


def _manifest_for(plan, plan_file: Path, manifest: Optional[Path]) -> dict | None:
    """The manifest of ``plan``'s snapshot: ``--manifest`` (a manifest.json or a snapshot folder),
    else a ``manifest.json`` beside the plan file when it is this plan's; None without one.
    Exits 2 when the one given is unreadable or belongs to another plan."""
    auto = manifest is None
    path: Path = (plan_file.parent / "manifest.json") if manifest is None else manifest
    if path.is_dir():
        path = path / "manifest.json"
    try:
        m = json.loads(path.read_text())
        digest = m["plan_digest"]
        m["io"]["estimated"], m["io"]["realized"]  # noqa: B018 (the fields the report reads)
    except FileNotFoundError:
        if auto:
            return None
        _fail(f"--manifest {manifest}: no manifest.json there; give a snapshot folder or its manifest.json.")
    except (OSError, ValueError, KeyError, TypeError) as e:
        if auto:
            return None
        _fail(f"--manifest {manifest}: not a mergepipe manifest ({type(e).__name__}: {e}).")
    if digest != plan.digest:
        if auto:
            return None
        _fail(
            f"--manifest {manifest}: made from plan {str(digest)[:16]}, not {plan.digest[:16]}; give the manifest "
            "of a snapshot of this plan."
        )
    return m


@app.command()
def explain(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON (from `plan --out`)", metavar="PLAN")],
    tensors: Annotated[
        bool, typer.Option("--tensors", "--verbose", "-v", help="Also explain every tensor (one line each).")
    ] = False,
    html_out: Annotated[
        Optional[Path],
        typer.Option(
            "--html",
            help="Write a self-contained page (inline SVG, no script): blocks per layer and expert, bytes per "
            "layer and per expert against the budget, estimated vs realized bytes, the summary.",
        ),
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot", help="Write the heat map and bytes per layer as a PNG (needs matplotlib: the bench extra)."
        ),
    ] = None,
    manifest: Annotated[
        Optional[Path],
        typer.Option(
            "--manifest",
            help="The manifest (or snapshot folder) of a merge of this plan, for realized bytes [default: "
            "manifest.json beside PLAN when it is this plan's]",
        ),
    ] = None,
    json_out: JsonOpt = False,
):
    """Explain a saved plan in plain words: what it reads, skips and sketches, where the bytes go per
    layer and expert, and (with the snapshot's manifest) what the merge realized."""
    from mergepipe.planner.plan import Plan
    from mergepipe.planner.report import render_html, render_png, summary

    try:
        text = plan_file.read_text()
    except OSError as e:
        _fail(f"{plan_file}: cannot read ({e.strerror}).")
    p = Plan.from_json(text, str(plan_file))
    m = _manifest_for(p, plan_file, manifest)
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install 'mergepipe[bench]' (or use --html, which needs nothing).")
    written = []
    for path, render in (
        (html_out, lambda q: q.write_text(render_html(p, m))),
        (plot, lambda q: render_png(p, str(q), m)),
    ):
        if path is None:
            continue
        tmp = path.with_name(path.name + ".tmp")
        try:
            render(tmp)
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            _fail(f"{path}: cannot write ({e.strerror}).")
        written.append(str(path))
    if json_out:
        print(
            json.dumps(
                {
                    "plan_digest": p.digest,
                    "summary": summary(p, m),
                    "explain": p.explain,
                    "tensors": {t.name: t.explain for t in p.tensors},
                    "written": written,
                }
            )
        )
    else:
        _print_explain(p, per_tensor=tensors, manifest=m)
        for w in written:
            _err_console().print(f"wrote {_esc(w)}", highlight=False)


def _emit_merge(res, json_out: bool):
    s = res.summary()
    if json_out:
        print(json.dumps(s))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    verb = "already committed" if res.already_committed else "committed"
    con.print(f"[bold green]{verb}[/] {_esc(s['snapshot_id'])} at {_esc(s['out'])}", highlight=False)
    t = Table("", "estimated", "realized")
    m = res.manifest["io"]
    for k, lab in (
        ("base_read_bytes", "base read"),
        ("expert_read_bytes", "expert read"),
        ("output_write_bytes", "output write"),
    ):
        t.add_row(lab, _human(m["estimated"][k]), _human(m["realized"][k]))
    con.print(t)
    con.print(
        f"expert budget {_human(s['io']['expert_budget_bytes'])}; retained energy {s['retained_energy']:.2%}; "
        f"wall {s['wall_s']:.2f} s; manifest {s['manifest_hash'][:16]}; plan {s['plan_digest'][:16]}",
        highlight=False,
    )


@app.command("extract-lora")
def extract_lora_cmd(
    snapshot: Annotated[str, typer.Argument(help="Checkpoint whose task vector is extracted (e.g. a merged snapshot)")],
    base: Annotated[str, typer.Option("--base", help="The base checkpoint the adapter applies to")],
    rank: Annotated[
        int, typer.Option("--rank", "-r", help="LoRA rank r (modules narrower than r get their full rank)")
    ],
    out: Annotated[str, typer.Option("--out", "-o", help="Adapter folder to create (must not exist)")],
    dtype: Annotated[str, typer.Option("--dtype", help="Factor dtype: float32, bfloat16, float16")] = "float32",
    json_out: JsonOpt = False,
):
    """Write a PEFT LoRA adapter approximating SNAPSHOT − BASE per linear module (truncated SVD, one
    module at a time), with the explained energy per module in extract_report.json."""
    from rich.console import Console
    from rich.table import Table

    from mergepipe.extract import extract_lora

    if rank < 1:
        _fail(f"--rank {rank}: must be a positive integer, e.g. 16.")
    storage = _storage_for(base)
    rep = extract_lora(storage, snapshot.rstrip("/"), base.rstrip("/"), rank, out, dtype=dtype)
    if json_out:
        print(json.dumps(rep))
        return
    con = Console(stderr=False)
    t = Table(title=f"extract-lora r={rank}: {out}")
    for c in ("module", "shape", "rank", "explained energy"):
        t.add_column(c)
    for m in rep["modules"]:
        t.add_row(_esc(m["module"]), "x".join(map(str, m["shape"])), str(m["rank"]), f"{m['explained_energy']:.2%}")
    con.print(t)
    con.print(
        f"{len(rep['modules'])} modules, {_human(rep['adapter_bytes'])}; explained energy {rep['explained_energy_linear']:.2%} "
        f"of the linear modules' task vector, {rep['explained_energy_total']:.2%} of the whole "
        f"({len(rep['skipped'])} changed tensors that are not linear weights are not in the adapter)",
        highlight=False,
    )


DeviceOpt = Annotated[str, typer.Option("--device", help="torch device for the merge arithmetic: cpu, cuda, cuda:N")]


@app.command()
def merge(
    out: Annotated[str, typer.Option("--out", "-o", help="Snapshot folder to create (must not exist or be empty)")],
    base: OptBaseOpt = None,
    expert: OptExpertOpt = None,
    config: ConfigOpt = None,
    method: OptMethodOpt = None,
    param: ParamOpt = None,
    budget: BudgetOpt = None,
    fidelity: FidelityOpt = None,
    seed: SeedOpt = None,
    device: DeviceOpt = "cpu",
    block_size: BlockOpt = "128KiB",
    work_memory: MemOpt = "256MiB",
    value: ValueOpt = None,
    calibration: CalibrationOpt = None,
    sketch: SketchOpt = None,
    deadline: DeadlineOpt = None,
    workers: Annotated[
        Optional[int],
        typer.Option(
            "--workers",
            min=1,
            max=256,
            help="Execute as N parts in parallel processes, then commit "
            "(a rerun after a failure resumes); default one process",
        ),
    ] = None,
    resume: Annotated[
        Optional[bool],
        typer.Option(
            "--resume/--no-resume",
            help="In one process, run resumably: a rerun after a crash keeps the files the interrupted "
            "run finished (digests checked) and merges only the rest [default: resume when an "
            "interrupted resumable run of --out is there, else a plain run, which a crash makes start over]",
            show_default=False,
        ),
    ] = None,
    catalog: CatalogOpt = None,
    json_out: JsonOpt = False,
):
    """register → analyze → plan → execute → commit, in one go (or from a mergekit config: --config)."""
    from mergepipe import api
    from mergepipe.request import PlanningOptions, RunOptions

    planning = PlanningOptions(
        value=value, calibration=calibration, sketch=sketch, block_bytes=_block_bytes(block_size), deadline=deadline
    )
    run = RunOptions(
        work_bytes=_work_bytes(work_memory),
        workers=workers,
        resume=_resume_default(out, resume, workers),
        device=device,
    )
    req, where = _merge_request(
        config, base, expert, method, param, budget, fidelity, seed, out=out, planning=planning, run=run
    )
    with _Progress(True) as prog:
        res = api.merge(req, where=where, catalog=_catalog(catalog), storage=_storage_for(req.base), progress=prog)
    res.total_s = max(res.total_s or 0.0, _since_process_start())  # from process start, imports included
    _emit_merge(res, json_out)


@app.command()
def calibrate(json_out: JsonOpt = False):
    """Measure this machine's throughput (local read/write bytes/s, seconds per request, sketch decode
    and merge bytes/s; a few seconds) and cache it at $MERGEPIPE_HOME/throughput.json: the planner's
    predicted seconds and --deadline use it."""
    from mergepipe.planner.cost import calibrate as measure, save_throughput

    tp = measure()
    path = save_throughput(tp)
    if json_out:
        print(json.dumps({**tp.model_dump(), "path": str(path)}))
        return
    print(
        f"read {tp.read_bytes_per_s / 1e9:.2f} GB/s, {tp.request_s * 1e6:.0f} µs/request, write "
        f"{tp.write_bytes_per_s / 1e9:.2f} GB/s, decode {tp.decode_bytes_per_s / 1e9:.2f} GB/s, merge "
        + ", ".join(f"{fam} {bps / 1e9:.2f}" for fam, bps in tp.merge_bytes_per_s.items())
        + f" GB/s ({tp.device}, {tp.threads} threads) -> {path}"
    )


@app.command("multi-merge")
def multi_merge(
    config: Annotated[Path, typer.Argument(help="A mergekit-multi config: YAML documents, each a merge with a name")],
    intermediate_dir: Annotated[
        Path, typer.Option("--intermediate-dir", "-I", help="Folder of the named stages' snapshots (<dir>/<name>)")
    ],
    out: Annotated[
        Optional[str], typer.Option("--out", "-o", help="Snapshot folder of the unnamed final merge (if any)")
    ] = None,
    device: DeviceOpt = "cpu",
    catalog: CatalogOpt = None,
    json_out: JsonOpt = False,
):
    """Run a multi-stage mergekit config (mergekit-multi's format) in dependency order; a stage
    whose snapshot of the same plan is already committed is not recomputed."""
    from mergepipe.multistage import merge_multi

    with _Progress(True) as prog:
        results = merge_multi(config, intermediate_dir, out, device=device, catalog=_catalog(catalog), progress=prog)
    if json_out:
        print(json.dumps({"stages": [{"name": n, **r.summary()} for n, r in results]}))
        return
    for n, r in results:
        print(f"stage {n or 'final'}:", end=" ")
        _emit_merge(r, False)


def _interrupted_runs(out: str, plan_digest: str | None = None) -> tuple[list[tuple[Path, int, int]], tuple[int, int]]:
    """What interrupted runs left beside a local ``out`` (cheap: directory listings and record
    files, no digest is recomputed here).

    Returns:
        (resumable, staged): ``resumable`` lists the run folders ``.<name>.run-plan-<hex>`` (only
        the one of ``plan_digest`` when given) whose file records name finished files, as
        ``(folder, files, bytes)``; ``staged`` is ``(files, bytes)`` in a dead plain run's staging
        folder ``.<name>.staging`` (no records: a plain rerun cannot keep them). Empty on S3.
    """
    from mergepipe.commit.manifest import lock_is_free, lock_path
    from mergepipe.storage.base import local_path

    if local_path(out) is None or not lock_is_free(lock_path(out)):  # a live writer's run is not interrupted
        return [], (0, 0)
    p = Path(out)
    if plan_digest is not None:
        from mergepipe.commit.runs import default_run_id

        folders = [p.parent / f".{p.name}.run-{default_run_id(plan_digest)}"]
    else:
        folders = sorted(q for q in p.parent.glob(f".{p.name}.run-plan-*") if not q.name.endswith(".records"))
    resumable = []
    for f in folders:
        recs = f.parent / (f.name + ".records") / "files"
        n = size = 0
        if f.is_dir() and recs.is_dir():
            for r in recs.glob("*.json"):
                try:
                    rec = json.loads(r.read_text())
                    st = (f / rec["name"]).stat()
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if plan_digest is None or rec.get("plan_digest") == plan_digest:
                    n, size = n + 1, size + st.st_size
        if n:
            resumable.append((f, n, size))
    staged = (0, 0)
    stg = p.parent / f".{p.name}.staging"  # (left by versions before runs of one part)
    if stg.is_dir() and not stg.is_symlink():
        files = [q for q in stg.rglob("*") if q.is_file() and not q.is_symlink()]
        staged = (len(files), sum(q.stat().st_size for q in files))
    return resumable, staged


def _resume_default(out: str, resume: bool | None, workers: int | None = None, plan_digest: str | None = None) -> bool:
    """Whether a plain ``merge``/``execute`` (no ``--part``/``--workers``) runs resumably, and one
    line on stderr saying why when it matters.

    ``--resume``/``--no-resume`` decide when given. Unset: resume when an interrupted resumable
    run of this ``out`` (of ``plan_digest`` when known) holds finished files, since resuming
    it is safe (every kept file is read back and checked against its recorded digest) and saves
    their bytes; otherwise run plainly, and when a crashed plain run's staging folder is there,
    say how many bytes it had written that this run redoes and that ``--resume`` makes a run
    resumable (a plain run keeps no per-file records, so its files cannot be checked and kept).
    """
    if resume is not None or workers:
        return bool(resume)
    try:
        resumable, (n, size) = _interrupted_runs(out, plan_digest)
    except (OSError, ValueError):  # an unusable --out: the merge refuses it with its own message
        return False
    con = _err_console()
    if resumable:
        f, k, b = resumable[-1]
        which = "this plan's" if plan_digest else "an"
        con.print(
            f"resuming {which} interrupted run {_esc(f.name)}: {k} finished file(s), {_human(b)}, kept if their "
            "digests check (--no-resume starts over)",
            highlight=False,
            soft_wrap=True,
        )
        return True
    if n:
        con.print(
            f"note: a crashed run had written {n} file(s), {_human(size)}, in {_esc(_staging_name(out))}; a plain run "
            "keeps no records, so this run redoes them. Pass --resume to make a run resumable after a crash.",
            highlight=False,
            soft_wrap=True,
        )
    return False


def _staging_name(out: str) -> str:
    """The name of ``out``'s staging folder (``.<name>.staging``), for messages."""
    return f".{Path(out).name}.staging"


def _read_plan(plan_file: str):
    """The plan at ``plan_file`` (path or s3:// URI) and a storage for it; exits 2 when missing."""
    from mergepipe.planner.plan import Plan
    from mergepipe.storage.base import NotFoundError

    st = _storage_for(plan_file)
    try:
        text = st.read_object(plan_file, "other").decode()
    except NotFoundError:
        _fail(f"{plan_file}: plan not found; write one with `mergepipe plan ... --out`.")
    return Plan.from_json(text, str(plan_file)), st


RunOpt = Annotated[
    Optional[str],
    typer.Option(
        "--run", help="Run id shared by the parts of one merge (default: derived from the plan, so a rerun resumes)"
    ),
]
UnsafeOpt = Annotated[
    bool, typer.Option("--unsafe-single-writer", help="Commit even on an object store that ignores If-None-Match")
]


@app.command()
def execute(
    plan_file: Annotated[str, typer.Argument(help="Plan JSON (from `plan --out`): a path or an s3:// URI")],
    out: Annotated[str, typer.Option("--out", "-o", help="Snapshot folder or s3:// prefix")],
    device: DeviceOpt = "cpu",
    part: Annotated[
        Optional[str],
        typer.Option(
            "--part",
            help="Execute only part I of N (I/N, 0-based) into the run, without committing; then `mergepipe commit`",
        ),
    ] = None,
    run: RunOpt = None,
    resume: Annotated[
        Optional[bool],
        typer.Option(
            "--resume/--no-resume",
            help="Keep files an earlier attempt of this plan finished (digests checked) and merge only the "
            "rest [default: with --part, --resume; without, resume when an interrupted resumable run of this "
            "plan is at --out, else a plain run, which a crash makes start over]",
            show_default=False,
        ),
    ] = None,
    unsafe_single_writer: UnsafeOpt = False,
    json_out: JsonOpt = False,
):
    """Execute a saved plan and commit the snapshot (no catalog needed: the plan is self-contained).
    This is the worker command of the Kubernetes merge Job. With --part I/N it executes one part
    of a partitioned merge (an Indexed Job's pod: --part $JOB_COMPLETION_INDEX/N)."""
    from mergepipe.pipeline import execute_and_commit

    p, st = _read_plan(plan_file)
    if part is not None:
        _execute_part(p, st, out, part, run, device, resume, json_out)
        return
    resume = _resume_default(out, resume, plan_digest=p.digest)
    with _Progress(True) as prog:
        prog("merge", 0, p.io.output_write_bytes)
        if resume:
            from mergepipe.parts import execute_resumable

            res = execute_resumable(
                p,
                st,
                out,
                run=run,
                device=device,
                progress=lambda n: prog("merge", n, None),
                unsafe_single_writer=unsafe_single_writer,
            )
        else:
            res = execute_and_commit(
                p,
                st,
                out,
                device=device,
                progress=lambda n: prog("merge", n, None),
                unsafe_single_writer=unsafe_single_writer,
            )
    _emit_merge(res, json_out)


def _execute_part(
    p: Any, st: Any, out: str, part: str, run: str | None, device: str, resume: bool | None, json_out: bool
) -> None:
    """``mergepipe execute --part I/N``: execute part I of N of plan ``p`` (storage ``st``) into the
    run at ``out`` without committing (``resume`` ``None``: resume), then report it (one JSON line
    with ``json_out``). Exits 2 on a bad ``--part``."""
    from mergepipe.engine.partition import parse_part
    from mergepipe.parts import execute_part

    spec = parse_part(part)
    with _Progress(not json_out) as prog:
        prog("merge", 0, None)
        rec = execute_part(
            p,
            st,
            out,
            spec,
            run=run,
            device=device,
            resume=resume is not False,
            progress=lambda n: prog("merge", n, None),
        )
    if rec is None:
        s = {"out": out, "part": str(spec), "already_committed": True}
    else:
        s = {
            "out": out,
            "part": str(spec),
            "run": rec["run"],
            "already_committed": False,
            "files": sorted(rec["files"]),
            "kept": rec["kept"],
            "realized": rec["realized"],
            "wall_s": rec["wall_s"],
        }
    if json_out:
        print(json.dumps(s))
    elif rec is None:
        print(f"{out} already holds this plan's snapshot; nothing to do")
    else:
        print(
            f"part {spec} of run {rec['run']}: {len(rec['files'])} files "
            f"({len(rec['kept'])} kept from an earlier attempt), "
            f"{_human(rec['realized']['base_read_bytes'] + rec['realized']['expert_read_bytes'])} read, "
            f"{rec['wall_s']:.2f} s"
        )


@app.command()
def commit(
    plan_file: Annotated[str, typer.Argument(help="Plan JSON the parts were executed from")],
    out: Annotated[str, typer.Option("--out", "-o", help="Snapshot folder or s3:// prefix")],
    run: RunOpt = None,
    parts: Annotated[
        Optional[int],
        typer.Option(
            "--parts",
            min=1,
            max=10_000,  # mergepipe.engine.partition.MAX_PARTS, checked before the parts are computed
            help="N of the parts (default: from the run's part records)",
        ),
    ] = None,
    unsafe_single_writer: UnsafeOpt = False,
    json_out: JsonOpt = False,
):
    """Commit a partitioned run: check every part record against the plan and the stored files,
    compose the manifest and publish it (the same atomic commit as `execute`)."""
    from mergepipe.parts import commit_run

    p, st = _read_plan(plan_file)
    res = commit_run(p, st, out, run=run, parts=parts, unsafe_single_writer=unsafe_single_writer)
    _emit_merge(res, json_out)


@app.command()
def verify(snapshot: Annotated[str, typer.Argument(help="Snapshot folder or s3:// URI")], json_out: JsonOpt = False):
    """Re-hash a snapshot's files against its manifest. Exit 1 when anything differs."""
    from dataclasses import asdict

    from mergepipe import api

    v = api.verify(snapshot, storage=_storage_for(snapshot))
    if json_out:
        print(json.dumps(asdict(v)))
    elif v.ok:
        _err_console().print(
            f"[green]ok[/] {_esc(v.snapshot_id)}: {v.files} files match; manifest {(v.manifest_hash or '')[:16]}"
        )
    else:
        for pr in v.problems:
            _err_console().print(f"[red]{_esc(pr)}[/]")
    if not v.ok:
        raise typer.Exit(1)


class ZooSize(str, Enum):
    """``mergepipe demo --size``: which zoo configuration (:mod:`mergepipe_zoo`) the demo builds."""

    tiny = "tiny"
    demo = "demo"


@app.command()
def demo(
    zoo_root: Annotated[
        Optional[Path], typer.Option("--zoo", help="Zoo cache folder [default: $MERGEPIPE_HOME/zoo]")
    ] = None,
    out_root: Annotated[
        Optional[Path], typer.Option("--out", help="Where the demo snapshots go [default: $MERGEPIPE_HOME/demo]")
    ] = None,
    size: Annotated[
        ZooSize,
        typer.Option(
            "--size",
            help="Zoo size: tiny (0.2 M parameters, passes the zoo's build gates, ~35 s of CPU "
            "to build) or demo (5.3 M parameters, 820 training steps; measured at seed 0 it fails "
            "its build gates after 1114 s of training, publishing nothing: see docs/QUALITY.md)",
        ),
    ] = ZooSize.tiny,
    json_out: JsonOpt = False,
):
    """Build (once) a zoo of real trained experts (needs the zoo extra), merge them with task_arithmetic at
    full budget and at 50/25/10%, and print cost, retained energy, per-domain eval loss and normalised gain."""
    from mergepipe.errors import InputError
    from mergepipe.plugins import PluginMissing, load_plugin

    try:
        run_demo = load_plugin("mergepipe.demos", "zoo")
    except PluginMissing as e:
        raise InputError(
            f"mergepipe demo needs the model zoo ({e}): install mergepipe with its zoo extra "
            "(torch, transformers, tokenizers)."
        ) from None
    rows = run_demo(
        zoo_root,
        out_root,
        tiny=size is ZooSize.tiny,
        table_to_stderr=json_out,
        log=lambda m: _err_console().print(m, highlight=False),
    )
    if json_out:
        print(json.dumps(rows))


@app.command("eval")
def eval_(
    snapshot: Annotated[
        Path, typer.Argument(help="Checkpoint or snapshot folder to score (config.json + safetensors)")
    ],
    testbed: Annotated[
        Path,
        typer.Option(
            "--testbed",
            help="Testbed folder with testbed.json: a built zoo "
            "(mergepipe_zoo), MiniLM or vision testbed, or your own probe sets",
        ),
    ],
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated task names [default: all]")] = None,
    max_batches: Annotated[
        Optional[int], typer.Option("--max-batches", help="Score only the first N batches per task (faster, noisier)")
    ] = None,
):
    """Per-task quality of a checkpoint on a testbed's probe sets, as JSON on stdout: causal-LM
    loss (nats/token), or classification accuracy and loss with each task's own head (text or,
    through the mergepipe.testbed_kinds plugins, images)."""
    from mergepipe.evaluate import KINDS, evaluate_checkpoint, load_testbed, testbed_kind

    kind = testbed_kind(testbed)
    tb = load_testbed(testbed) if kind in KINDS else testbed
    names = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    res = evaluate_checkpoint(snapshot, tb, names, max_batches=max_batches)
    print(json.dumps({"snapshot": str(snapshot), "testbed": str(testbed), "kind": kind, "tasks": res}, indent=1))


# --- mergepipe search (layer-wise multi-objective merge search; mergepipe.search) -----------------
@app.command()
def search(
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            help="Search folder: state.json, snapshots/, results.json; or an "
            "s3:// prefix (state kept there too, so --resume works from any machine)",
        ),
    ],
    base: Annotated[Optional[str], typer.Option("--base", help="Base checkpoint folder")] = None,
    expert: Annotated[
        Optional[list[str]], typer.Option("--expert", "-e", help="Expert checkpoint: URI or NAME=URI (repeat).")
    ] = None,
    method: Annotated[
        str, typer.Option("--method", "-m", help=f"Merge method, by mergekit's name: {METHODS_HELP}")
    ] = "task_arithmetic",
    param: ParamOpt = None,
    vary: Annotated[
        Optional[list[str]],
        typer.Option(
            "--vary",
            help="[EXPERT:]NAME=LO:HI: a parameter that takes one value per layer block in [LO, HI] "
            "(per expert unless EXPERT is given; e.g. --vary weight=0:1). Repeat for several.",
        ),
    ] = None,
    layer_blocks: Annotated[
        int,
        typer.Option(
            "--layer-blocks",
            help="Contiguous blocks of decoder layers; one value per block and varied parameter "
            "[default: 1, model-level: chosen on development seeds, tested on pre-registered fresh seeds, "
            "docs/SEARCH.md]",
        ),
    ] = 1,
    objective: Annotated[
        Optional[list[str]],
        typer.Option(
            "--objective",
            help="Metric to optimise (repeat): NAME (minimised), NAME@max. The zoo evaluator gives "
            "loss:python, loss:prose, loss:arithmetic, loss:json.",
        ),
    ] = None,
    eval_command: Annotated[
        Optional[str],
        typer.Option(
            "--eval-command",
            help="Evaluate each candidate with this command ({checkpoint} = the snapshot folder, "
            "else appended); it prints a JSON object of metrics on stdout. Default: the demo zoo's eval losses.",
        ),
    ] = None,
    eval_timeout: Annotated[
        Optional[float],
        typer.Option(
            "--eval-timeout", callback=_finite, help="Seconds per evaluation; slower candidates are recorded failed"
        ),
    ] = None,
    zoo_tiny: Annotated[bool, typer.Option("--zoo-tiny", help="Zoo evaluator: the tiny zoo (tests)")] = False,
    eval_batches: Annotated[
        Optional[int],
        typer.Option("--eval-batches", help="Zoo evaluator: score only the first N batches per domain (faster)"),
    ] = None,
    evaluations: Annotated[
        Optional[int],
        typer.Option("--evaluations", "-n", help="Candidates in total (merge + evaluation each) [default: 24]"),
    ] = None,
    initial: Annotated[int, typer.Option("--initial", help="Sobol design points before the optimizer")] = 8,
    workers: Annotated[Optional[int], typer.Option("--workers", "-w", help="Parallel workers [default: 1]")] = None,
    budget: BudgetOpt = None,
    sketch: SketchOpt = None,
    value: ValueOpt = None,
    calibration: CalibrationOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the design, proposals and merges")] = 0,
    strategy: Annotated[
        str,
        typer.Option("--strategy", help="async (prior-guided, pending-aware), sync (batch qNEHVI, no prior) or random"),
    ] = "async",
    no_prior: Annotated[
        bool, typer.Option("--no-prior", help="No discrepancy prior (and no reranking unless --rerank)")
    ] = False,
    prior_kind: Annotated[
        str,
        typer.Option(
            "--prior",
            help="How the discrepancy prior sets the lengthscales: scaled (multipliers on botorch's "
            "default prior) or rank (AP-BMM: rank quartile -> initial lengthscale 0.5/1/2/5)",
        ),
    ] = "scaled",
    rerank: Annotated[
        Optional[bool],
        typer.Option(
            "--rerank/--no-rerank",
            help="Frontier-coverage reranking of async proposals [default: on with the prior]",
        ),
    ] = None,
    search_outer: Annotated[
        bool,
        typer.Option(
            "--search-outer",
            help="Give the embeddings and lm_head coordinates of their own (per varied parameter and "
            "expert) instead of the mean of the layer blocks",
        ),
    ] = False,
    probe: Annotated[
        Optional[Path],
        typer.Option(
            "--probe",
            help="Text file (or .jsonl with a text field) run through base and experts for the "
            "activation part of the prior; default: parameter discrepancy from the catalog only",
        ),
    ] = None,
    ref_point: Annotated[
        Optional[str],
        typer.Option(
            "--ref-point",
            help="Hypervolume reference point, one value per objective (comma-separated, in the "
            "metric's own units) [default: from the first observations]",
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the search in --out (its state holds the "
            "configuration; --workers and --evaluations may change)",
        ),
    ] = False,
    catalog: CatalogOpt = None,
    resume_existing: Annotated[
        bool,
        typer.Option(
            "--resume-existing",
            help="Resume the search in --out if it holds one, else start it (a restarted "
            "driver pod runs the same command)",
        ),
    ] = False,
    worker_backend: Annotated[
        str,
        typer.Option(
            "--worker-backend",
            help="local (merge in this process) or kubernetes (each candidate a child ModelMerge "
            "of the MergeSearch --search-name; needs an s3:// --out)",
        ),
    ] = "local",
    namespace: Annotated[
        Optional[str], typer.Option("--namespace", help="kubernetes backend: the search's namespace")
    ] = None,
    search_name: Annotated[
        Optional[str], typer.Option("--search-name", help="kubernetes backend: the MergeSearch")
    ] = None,
    search_uid: Annotated[
        Optional[str], typer.Option("--search-uid", help="kubernetes backend: its uid (owner of the candidates)")
    ] = None,
    json_out: JsonOpt = False,
):
    """Search layer-wise merge parameters with multi-objective Bayesian optimisation (asynchronous,
    prior-guided; after AP-BMM). Every candidate is a committed merge followed by an evaluation; the
    result is a Pareto set of snapshots (results.json)."""
    from mergepipe.request import PlanningOptions
    from mergepipe.search import driver

    log = lambda m: _err_console().print(m, highlight=False)  # noqa: E731
    place = driver.SearchPlace(out)
    kube = _search_workers(place, worker_backend, namespace, search_name, search_uid, calibration)
    resuming = place.resumes(resume, resume_existing)
    cfg = ev = None
    if resuming:
        _refuse_new_inputs(out, resume_existing, base, expert, vary, param, objective, eval_command)
    else:
        if not base or not expert or not vary or not objective:
            _fail(
                "a search needs --base, --expert (one or more), --vary and --objective "
                "(e.g. --vary weight=0:1 --objective loss:python --objective loss:json)."
            )
        cfg, ev = _search_config(
            base=base,
            expert=expert,
            method=method,
            param=param,
            vary=vary,
            objective=objective,
            ref_point=ref_point,
            probe=probe,
            eval_command=eval_command,
            eval_timeout=eval_timeout,
            zoo=None if kube is not None and kube.eval_job_template else (zoo_tiny, eval_batches),
            evaluations=evaluations,
            initial=initial,
            workers=workers,
            layer_blocks=layer_blocks,
            budget=budget,
            planning=PlanningOptions(value=value, calibration=calibration, sketch=sketch),
            seed=seed,
            strategy=strategy,
            prior=not no_prior,
            prior_kind=prior_kind,
            rerank=rerank,
            outer=search_outer,
            catalog=catalog,
        )
    res = driver.run(
        place,
        cfg,
        ev,
        resume=resuming,
        workers=workers,
        evaluations=evaluations,
        kubernetes=kube,
        log=log,
    )
    _report_search(res, out, json_out, log)


def _search_workers(
    place: Any,
    worker_backend: str,
    namespace: str | None,
    search_name: str | None,
    search_uid: str | None,
    calibration: str | None,
) -> Any:
    """``mergepipe search --worker-backend``: ``None`` (local workers) or the
    :class:`~mergepipe.search.driver.KubernetesWorkers` of MergeSearch ``search_name`` (the search
    at ``place``, an s3:// ``--out``). Exits 2 on a bad backend or a missing kubernetes option."""
    from mergepipe.search import driver

    if worker_backend not in ("local", "kubernetes"):
        _fail(f"--worker-backend {worker_backend!r}: use local or kubernetes.")
    if worker_backend == "kubernetes":
        if place.mirror is None or not (namespace and search_name and search_uid):
            _fail("--worker-backend kubernetes needs an s3:// --out, --namespace, --search-name and --search-uid.")
        if calibration and not calibration.startswith("s3://"):
            _fail(
                f"--calibration {calibration}: the kubernetes backend's candidates read it as their ModelMerge "
                "spec.calibration.uri; give an s3:// URI."
            )
        return driver.KubernetesWorkers.from_environment(namespace, search_name, search_uid)
    return None


def _refuse_new_inputs(
    out: str,
    resume_existing: bool,
    base: str | None,
    expert: list[str] | None,
    vary: list[str] | None,
    param: list[str] | None,
    objective: list[str] | None,
    eval_command: str | None,
) -> None:
    """``mergepipe search --resume``: the search's inputs are the recorded ones; exits 2 naming
    the inputs given anyway (``--resume-existing`` ignores them)."""
    given = [
        f
        for f, v in (
            ("--base", base),
            ("--expert", expert),
            ("--vary", vary),
            ("--param", param),
            ("--objective", objective),
            ("--eval-command", eval_command),
        )
        if v
    ]
    if given and not resume_existing:
        _fail(f"--resume continues the search recorded in {out}/state.json; drop {', '.join(given)}.")


def _report_search(res: dict, out: str, json_out: bool, log: Callable[[str], None]) -> None:
    """Print a finished search's results: one JSON line without the trace (``json_out``), else the
    Pareto set as a table on stdout and the hypervolume and wall time via ``log``."""
    if json_out:
        print(json.dumps({k: v for k, v in res.items() if k != "trace"}))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(
        "candidate",
        *res["objectives"],
        "snapshot",
        title=f"Pareto set ({len(res['pareto'])} of {res['evaluations']} evaluated, {res['failed']} failed)",
    )
    for p in res["pareto"]:
        t.add_row(str(p["id"]), *[f"{v:.4f}" for v in p["objectives"].values()], p["snapshot"])
    Console().print(t)
    hv = res["hypervolume"][-1]["hv"] if res["hypervolume"] else 0.0
    log(
        f"hypervolume {hv:.5g} (reference {res['ref_point']}); wall {res['wall_s']:.1f} s; results in "
        f"{out.rstrip('/')}/results.json"
    )


def _search_config(
    *, base, expert, method, param, vary, objective, ref_point, probe, eval_command, eval_timeout, zoo, **settings
):
    """``mergepipe search``'s options as a :class:`~mergepipe.search.runner.SearchConfig` and its
    evaluator: ``--eval-command``'s, else the demo zoo's (``zoo`` = ``(tiny, max_batches)``; None
    when the evaluations run as Kubernetes Jobs, which need a command)."""
    from mergepipe.pipeline import parse_expert
    from mergepipe.search.evaluators import CommandEvaluator, Evaluator, Objective, zoo_evaluator
    from mergepipe.search.runner import SearchConfig
    from mergepipe.search.space import params_from_args

    objs = [Objective.parse(o) for o in objective]
    refs = None
    if ref_point is not None:
        try:
            refs = [o.to_min(float(v)) for o, v in zip(objs, ref_point.split(","), strict=True)]
        except ValueError:
            _fail(f"--ref-point {ref_point!r}: give one number per objective ({len(objs)}), comma-separated.")
    texts = None
    if probe is not None:
        try:
            raw = probe.read_text()
        except OSError as e:
            _fail(f"--probe {probe}: cannot read ({e.strerror}).")
        if probe.suffix == ".jsonl":
            texts = [json.loads(ln)["text"] for ln in raw.splitlines() if ln.strip()]
        else:
            texts = [raw]
    ev: Evaluator | None = None
    if eval_command:
        ev = CommandEvaluator(eval_command, eval_timeout)
    elif zoo is not None:
        domains = sorted({o.metric.split(":", 1)[1] for o in objs if o.metric.startswith("loss:")})
        ev = zoo_evaluator(domains or None, tiny=zoo[0], max_batches=zoo[1], timeout=eval_timeout)
    experts = [list(parse_expert(e)) for e in expert]
    fixed = params_from_args(param or [], method, [n for n, _ in experts])  # --param strings end here
    cfg = SearchConfig(
        base=base,
        experts=experts,
        method=method,
        vary=list(vary),
        objectives=list(objective),
        evaluations=settings.pop("evaluations") or 24,
        workers=settings.pop("workers") or 1,
        fixed=fixed,
        probe=texts,
        ref_point=refs,
        **settings,
    )
    return cfg, ev


@app.command("search-eval")
def search_eval(
    command: Annotated[
        str,
        typer.Option(
            "--command",
            help="Evaluator command ({checkpoint} = --checkpoint, else "
            "appended); prints a JSON object of metrics on stdout",
        ),
    ],
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="The candidate's snapshot (folder or s3:// URI)")],
    metrics_out: Annotated[str, typer.Option("--metrics-out", help="Where to write the outcome (s3:// URI or file)")],
    timeout: Annotated[
        Optional[float], typer.Option("--timeout", callback=_finite, help="Seconds before the command is killed")
    ] = None,
):
    """Evaluate one search candidate (the evaluation Job of a MergeSearch): run the command and
    write {"metrics": {...}} or, when it crashed, timed out or printed no metrics, {"error": "..."}
    to --metrics-out (exit 0 either way: a failed evaluation is the candidate's result, not a reason
    to retry the Job)."""
    from mergepipe.search.evaluators import CommandEvaluator, EvaluationFailed
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    ev = CommandEvaluator(command, timeout)
    try:
        doc: dict[str, Any] = {"metrics": ev.metrics(checkpoint)}
    except EvaluationFailed as e:
        doc = {"error": str(e)}
    open_storage(None, IOCounters()).put_object(metrics_out, json.dumps(doc).encode(), role="other")
    print(json.dumps(doc))


def parse_duration(text: str, what: str = "--grace") -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``24h`` or ``7d`` (finite, non-negative).

    Raises:
        InputError: anything else.
    """
    import math
    import re

    from mergepipe.errors import InputError
    from mergepipe.limits import short_repr

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", str(text))
    n = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] if m else math.nan
    if not math.isfinite(n) or n > 100 * 365 * 86400:
        raise InputError(f"{what} {short_repr(text)}: not a duration; use e.g. 3600, 90m, 24h or 7d.")
    return n


@app.command()
def gc(
    roots: Annotated[list[str], typer.Argument(help="A snapshot's --out, or a folder / s3:// prefix holding several")],
    grace: Annotated[
        str,
        typer.Option(
            "--grace", help="Keep debris younger than this (it may belong to a running merge): 3600, 90m, 24h, 7d"
        ),
    ] = "24h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be removed")] = False,
    json_out: JsonOpt = False,
):
    """Remove what failed or killed merges left, and only what carries proof that it is mergepipe's
    garbage: areas whose ownership record names an --out under the root, not committed, not in use
    (staging of dead writers; runs older than --grace), their lock files and stale multipart
    uploads. Debris without a record is listed as unproven and kept; committed snapshots never
    change. --dry-run changes nothing."""
    from mergepipe.commit.gc import collect

    g = parse_duration(grace)
    reps = []
    for r in roots:
        rep = collect(
            _storage_for(r),
            r.rstrip("/") if r.startswith("s3://") else r,
            grace_s=g,
            dry_run=dry_run,
            log=None if json_out else (lambda m: _err_console().print(m, highlight=False)),
        )
        reps.append(rep.as_dict())
    if json_out:
        print(json.dumps(reps if len(reps) > 1 else reps[0]))
    else:
        for d in reps:
            verb = "would remove" if dry_run else "removed"
            for u in d["unproven"]:
                _err_console().print(f"unproven, kept: {u}", highlight=False, markup=False)
            _err_console().print(
                f"{d['root']}: {verb} {len(d['deleted_runs'])} run(s), {len(d['aborted_uploads'])} multipart "
                f"upload(s), {len(d['removed_staging'])} staging folder(s), {len(d['removed_locks'])} lock file(s); "
                f"kept {len(d['kept_in_use'])} in use, {len(d['kept_young'])} younger than {grace}, "
                f"{len(d['kept_committed'])} committed and {len(d['unproven'])} unproven",
                highlight=False,
            )


def _help_paragraphs(doc: str | None) -> str | None:
    """A command's docstring as ``--help`` shows it: each paragraph (blank-line separated) one
    line of text, so rich wraps it at the terminal's width instead of breaking it where the
    source line ended ("... (truncated SVD, one" / "module at a time) ...")."""
    if not doc:
        return doc
    import inspect

    paras = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n")]
    return "\n\n".join(p for p in paras if p)


def _normalise_help() -> None:
    """Apply :func:`_help_paragraphs` to every command's help (docstrings stay readable in the
    source; ``--help`` reads as sentences)."""
    import typing

    from rich.markup import escape

    seen: set[int] = set()
    for info in app.registered_commands:
        info.help = _help_paragraphs(info.help or (info.callback.__doc__ if info.callback else None))
        if info.callback is None:
            continue
        # typer renders help as rich markup: "[default: sign3]" in an option's help is a style tag
        # to rich and vanished. Escape the brackets (once per shared Annotated option) in the
        # evaluated annotations, and keep those as the function's annotations: this module's
        # annotations are strings (PEP 563), which typer would evaluate again into fresh objects.
        hints = typing.get_type_hints(info.callback, include_extras=True)
        for hint in hints.values():
            for meta in getattr(hint, "__metadata__", ()):
                if getattr(meta, "help", None) and id(meta) not in seen:
                    seen.add(id(meta))
                    meta.help = escape(meta.help)
        info.callback.__annotations__ = hints
    if app.registered_callback is not None and app.registered_callback.callback is not None:
        app.registered_callback.help = _help_paragraphs(app.registered_callback.callback.__doc__)


def _click_errors() -> tuple[tuple[type[Exception], ...], tuple[type[BaseException], ...]]:
    """(usage/click error types, abort types) of the click typer runs on (typer >= 0.26 vendors
    its own copy as ``typer._click``; older typer uses ``click``)."""
    errs: list[type[Exception]] = [c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"]
    aborts: list[type[BaseException]] = [typer.Abort]
    try:
        import click

        errs.append(click.exceptions.ClickException)
        aborts.append(click.exceptions.Abort)
    except ImportError:
        pass
    return tuple(errs), tuple(aborts)


def _usage_message(text: str, command_path: str | None) -> str:
    """click's usage error as one sentence-punctuated line pointing at the right ``--help``:
    ``No such command 'mrege'. Did you mean 'merge' or 'register'? See `mergepipe --help`.``
    (click's "Did you mean 'a', 'b'?" and "(Possible options: --x, --y)" read as one question)."""
    import re

    msg = " ".join(str(text).split())

    def either(names: str) -> str:
        parts = [n.strip() for n in names.split(",") if n.strip()]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]

    msg = re.sub(r"Did you mean (.+)\?$", lambda m: f"Did you mean {either(m.group(1))}?", msg)
    msg = re.sub(r"\s*\(Possible options: (.+)\)$", lambda m: f". Did you mean {either(m.group(1))}?", msg)
    if not msg.endswith((".", "?", "!")):
        msg += "."
    return f"{msg} See `{command_path} --help`." if command_path else msg


def main() -> None:
    """Console entry point: every user error (bad input, a mistyped command or option) is one
    line on stderr and exit code 2, never a traceback; other mergepipe failures exit 1."""
    from mergepipe.errors import CommitConflict, InputError, MergepipeError
    from mergepipe.storage.base import StorageError

    click_errors, aborts = _click_errors()
    try:
        rc = app(prog_name="mergepipe", standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except (InputError, CommitConflict, StorageError) as e:
        _print_error(str(e))
        _termination_message(f"error: {e}")
        sys.exit(2)
    except MergepipeError as e:  # e.g. a part process of `merge --workers` failed
        _print_error(str(e))
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _err_console().print("interrupted; nothing was committed")
        sys.exit(130)
    except click_errors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `mergepipe` alone: the help was printed
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        fmt = getattr(e, "format_message", None)  # ClickException's (its class is only known at run time)
        msg = _usage_message(fmt() if fmt else str(e), ctx.command_path if ctx is not None else None)
        _print_error(msg)
        _termination_message(f"error: {msg}")
        sys.exit(2)
    except aborts:
        sys.exit(1)
    except Exception as e:
        _termination_message(f"{type(e).__name__}: {e}")
        raise


_normalise_help()

if __name__ == "__main__":
    main()
