"""A cost model in seconds beside the one in bytes (issue 23, item 2).

The planner's budget is in bytes; a user often thinks in seconds. :class:`Throughput` records what
this machine measured once (``mergepipe calibrate``): local storage read and write bandwidth in
bytes/s, the seconds one read request costs, sketch decode and merge throughput in bytes/s. It is
cached as JSON at ``$MERGEPIPE_HOME/throughput.json`` with the host and device it was measured on,
and validated when read back (untrusted input). :func:`predict_seconds` turns a plan's byte
estimates into seconds; :func:`budget_for_deadline` searches the largest byte budget whose plan's
predicted time fits a deadline (predicted time grows with the budget: more expert bytes read,
decoded and merged).

The model (all terms additive, one process, no overlap assumed, so it is an upper-side estimate
for a pipelined engine)::

    read   = (base + expert exact bytes) / read_bytes_per_s + requests * request_s
    decode = sketched entry bytes / decode_bytes_per_s
    merge  = (base + expert exact + sketched entry bytes) / merge_bytes_per_s[family of the method]
    write  = output bytes / write_bytes_per_s

"Sketched entry bytes" are what the sketched rows would be in the tensor's dtype
(:func:`sketched_entry_bytes`): a sketched entry is decoded, then merged like an exact one. The
decode and merge rates are the engine's own kernels timed on a small synthetic tensor
(:func:`engine_rates`), one merge rate per method family (:data:`FAMILIES`).

``requests`` counts, per tensor and pass, one base range plus one per selected block run and per
sketch run of each expert (before coalescing: an upper bound). Only local storage is calibrated
here; a plan reading ``s3://`` gets no prediction (``None``) rather than a guess.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergepipe.errors import InputError
from mergepipe.planner.plan import Plan

THROUGHPUT_FORMAT = "mergepipe.throughput/v2"
#: a method family of the cost model (:data:`FAMILIES`)
Family = Literal["consensus", "sum", "whole"]
#: the throughput cache's size cap (a real file is ~500 bytes)
MAX_THROUGHPUT_BYTES = 64 * 1024


class Throughput(BaseModel):
    """What one machine measured (:func:`calibrate`); every rate positive and finite.

    Attributes:
        read_bytes_per_s: local storage sequential read, bytes/s (warm page cache: a calibration
            cannot drop the OS cache without privileges).
        write_bytes_per_s: local storage write including fsync, bytes/s.
        request_s: seconds per small random read request (4 KiB ``pread``).
        decode_bytes_per_s: sketch decode, in bf16-equivalent bytes of the sketched entries
            (2 per entry) per second: the engine's own decoder
            (:class:`~mergepipe.engine.sketchkernel.SketchRun`, 3 planes: codes and value tables,
            then every tile's trimmed gather; :func:`engine_rates`).
        merge_bytes_per_s: per method family (:data:`FAMILIES`), the engine's merge of one
            chunk (:func:`mergepipe.engine.chunk.merge_chunk` on a synthetic bf16 tensor), input
            bytes (base plus experts) per second.
        host, device, threads: where it was measured (``platform.node()``, ``"cpu"``,
            ``torch.get_num_threads()``).
        measured_at: UNIX seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = THROUGHPUT_FORMAT
    read_bytes_per_s: float = Field(gt=0, allow_inf_nan=False)
    write_bytes_per_s: float = Field(gt=0, allow_inf_nan=False)
    request_s: float = Field(ge=0, allow_inf_nan=False)
    decode_bytes_per_s: float = Field(gt=0, allow_inf_nan=False)
    merge_bytes_per_s: dict[Family, Annotated[float, Field(gt=0, allow_inf_nan=False)]]
    host: str = ""
    device: str = "cpu"
    threads: int = Field(default=1, ge=1)
    measured_at: float = 0.0


def throughput_path() -> Path:
    """``$MERGEPIPE_HOME/throughput.json`` (``~/.mergepipe``)."""
    from mergepipe.catalog.catalog import default_home

    return default_home() / "throughput.json"


def load_throughput(path: str | os.PathLike[str] | None = None) -> Throughput | None:
    """The cached throughput, or None when there is no cache file.

    Raises:
        InputError: the file is too large, not JSON, of another format, or has a missing,
            non-positive or non-finite rate (names the file and the fix: rerun calibrate).
    """
    p = Path(path) if path is not None else throughput_path()
    try:
        data = p.read_bytes()[: MAX_THROUGHPUT_BYTES + 1]
    except FileNotFoundError:
        return None
    fix = "run `mergepipe calibrate` to measure it again"
    if len(data) > MAX_THROUGHPUT_BYTES:
        raise InputError(f"{p}: larger than {MAX_THROUGHPUT_BYTES} bytes, not a throughput record; {fix}.")
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.get("format") != THROUGHPUT_FORMAT:
            raise ValueError(f"format is not {THROUGHPUT_FORMAT}")
        return Throughput.model_validate(obj)
    except (ValueError, ValidationError) as e:
        why = str(e).splitlines()[0] if not isinstance(e, ValidationError) else _first_error(e)
        raise InputError(f"{p}: not a valid throughput record ({why}); {fix}.") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(map(str, err['loc'])) or 'record'}: {err['msg']}"


def save_throughput(t: Throughput, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``t`` atomically (:func:`mergepipe.storage.local.replace_file`); returns the path."""
    from mergepipe.storage.local import replace_file

    p = Path(path) if path is not None else throughput_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    replace_file(p, t.model_dump_json(indent=1).encode(), what="throughput cache")
    return p


def calibrate(folder: str | os.PathLike[str] | None = None, *, mib: int = 64) -> Throughput:
    """Measure this machine in a few seconds: write ``mib`` MiB to a scratch file in ``folder``
    (default ``$MERGEPIPE_HOME``) with fsync, read it back in 4 MiB reads, time 2,000 random 4 KiB
    reads, a sketch-decode gather and a TIES-like merge in torch (``device`` ``cpu``). The scratch
    file is removed. Wall-clock timings: on a loaded machine they measure the load too."""
    import torch

    d = Path(folder) if folder is not None else throughput_path().parent
    d.mkdir(parents=True, exist_ok=True)
    scratch = d / f".calibrate-{os.getpid()}.bin"
    n = mib << 20
    buf = os.urandom(1 << 20) * mib
    try:
        t0 = time.perf_counter()
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_bps = n / max(time.perf_counter() - t0, 1e-9)
        fd = os.open(scratch, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            for off in range(0, n, 4 << 20):
                os.pread(fd, 4 << 20, off)
            read_bps = n / max(time.perf_counter() - t0, 1e-9)
            g = torch.Generator().manual_seed(0)
            offs = torch.randint(0, n - 4096, (2000,), generator=g).tolist()
            t0 = time.perf_counter()
            for off in offs:
                os.pread(fd, 4096, off)
            request_s = (time.perf_counter() - t0) / len(offs)
        finally:
            os.close(fd)
    finally:
        scratch.unlink(missing_ok=True)
    decode_bps, merge_bps = engine_rates()
    return Throughput(
        read_bytes_per_s=read_bps,
        write_bytes_per_s=write_bps,
        request_s=request_s,
        decode_bytes_per_s=decode_bps,
        merge_bytes_per_s=merge_bps,
        host=platform.node(),
        device="cpu",
        threads=_compute_threads(),
        measured_at=time.time(),
    )


#: the method families of the cost model, one measured merge rate each, by the engine path a
#: method's tensors take: tile by tile with TIES sign election (``consensus``: ties, dare_ties,
#: breadcrumbs_ties), tile by tile without it (``sum``: task_arithmetic, linear, dare_linear,
#: breadcrumbs), or whole chunks in float32 (``whole``: della and the methods with row or tensor
#: statistics). Each is timed on the method named here.
FAMILIES: dict[Family, str] = {"consensus": "ties", "sum": "task_arithmetic", "whole": "della"}

#: the synthetic tensor the engine is timed on: rows x cols bf16 (2 MiB per model), K experts
_CAL_ROWS, _CAL_COLS, _CAL_K, _CAL_RPB = 512, 1024, 4, 64


def method_family(method: str) -> Family:
    """The cost-model family of a merge method (:data:`FAMILIES`).

    Raises:
        KeyError: an unknown method name."""
    from mergepipe.methods.registry import get_method

    spec = get_method(method)
    if spec.elementwise("BF16"):
        return "consensus" if spec.consensus else "sum"
    return "whole"


def _compute_threads() -> int:
    from mergepipe.engine.executor import default_compute_threads

    return default_compute_threads()


def _synthetic_chunk(method: str, sketched: bool, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(item, inputs, spec)``: one whole-tensor ``merge`` work item of :data:`_CAL_K` bf16
    experts over a bf16 base (``_CAL_ROWS x _CAL_COLS``, task vectors ~1% of the base's scale),
    with the plan fields the engine reads for ``method`` (density 0.3; TIES's exact threshold
    rank from the chunk's key histogram, so the timing includes the engine's threshold
    histogram). ``sketched``: every expert arrives as a 3-plane sign sketch (random sign bits,
    bf16 scales of the task vector's size) instead of exact rows."""
    import numpy as np
    import torch

    from mergepipe.engine.reader import ChunkInputs
    from mergepipe.engine.sketchkernel import SketchRun
    from mergepipe.engine.worklist import WorkItem
    from mergepipe.methods.registry import get_method
    from mergepipe.numerics import histogram, magnitude_keys, trim_rank
    from mergepipe.planner.plan import TensorExpert, TensorPlan

    rows, cols, k, rpb = _CAL_ROWS, _CAL_COLS, _CAL_K, _CAL_RPB
    spec = get_method(method)
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    tes: list[TensorExpert] = []
    exps: list[list[Any]] = []
    for i in range(k):
        x = (base.float() + torch.randn(rows, cols, generator=g) * 0.002).to(torch.bfloat16)
        d = (x.float() - base.float()).numpy().reshape(-1)
        keys, counts = histogram(magnitude_keys(d))
        tau, rank, _ = trim_rank(keys, counts, d.size, 0.3)
        exact = spec.consensus is not None and spec.sparsify == "magnitude"
        tes.append(
            TensorExpert(
                expert=i, file="x", start=0, density=0.3, epsilon=0.1, min_key=tau, exact_rank=rank if exact else 0,
                stream_key=i + 1, blocks=[(0, -(-rows // rpb))], bytes=x.numel() * 2, kept_energy=1.0, full_energy=1.0,
            )
        )  # fmt: skip
        if sketched:
            planes: list[Any] = []
            rng = np.random.default_rng(seed + i)
            for _p in range(3):
                blocks = []
                for r0 in range(0, rows, rpb):
                    r = min(rpb, rows - r0)
                    bits = rng.integers(0, 256, (r * cols + 7) // 8, dtype=np.uint8).tobytes()
                    scale = torch.full((r,), 0.002, dtype=torch.bfloat16).view(torch.int16).numpy().astype("<u2")
                    blocks.append(bits + scale.tobytes())
                planes.append(b"".join(blocks))
            exps.append([((0, rows), SketchRun(rows, cols, rpb, planes))])
        else:
            exps.append([((0, rows), x.view(torch.uint8).numpy().tobytes())])
    params = {p.name: p.default for p in spec.params if p.scope == "global" and p.default is not None}
    tp = TensorPlan(
        name="calibration", dtype="BF16", shape=[rows, cols], file="x", start=0, rows_per_block=rpb,
        n_blocks=-(-rows // rpb), chunk_rows=rows, params=params, weight_sum=float(k), experts=tes,
    )  # fmt: skip
    return WorkItem("merge", tp, 0, rows, 0), ChunkInputs(base.view(torch.uint8).numpy().tobytes(), exps), spec


def _best_seconds(fn: Callable[[], object], repeat: int, clock: Callable[[], float]) -> float:
    """The fastest of ``repeat`` runs of ``fn`` on ``clock`` (after one untimed warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


def engine_rates(repeat: int = 3) -> tuple[float, dict[Family, float]]:
    """Time the engine's own kernels on a small synthetic tensor (:func:`_synthetic_chunk`, ~10 MiB
    of bf16 inputs) with the engine's compute threads, on the CPU.

    Returns:
        ``(decode, merge)``: ``decode`` the sketch decode rate in bf16-equivalent bytes of
        sketched entries per second (:class:`~mergepipe.engine.sketchkernel.SketchRun`: sign
        codes and value tables, then every tile's trimmed gather, 3 planes); ``merge`` per
        family of :data:`FAMILIES`, input bytes (base plus experts) per second of
        :func:`mergepipe.engine.chunk.merge_chunk` on exact inputs. The fastest of ``repeat``
        runs, in CPU seconds when the engine computes on one thread (its default on 2 cores),
        so a shared machine's load does not enter the rates; wall seconds otherwise.
    """
    import torch

    from mergepipe.engine.chunk import TILE_ELEMS, L1Sums, merge_chunk

    before = torch.get_num_threads()
    threads = _compute_threads()
    # one compute thread (the engine's default on 2 cores): its CPU seconds, which a shared
    # machine's load does not inflate as it does wall seconds; several: wall seconds
    clock = time.process_time if threads == 1 else time.perf_counter
    torch.set_num_threads(threads)
    try:
        dev = torch.device("cpu")
        merge: dict[Family, float] = {}
        for fam, method in FAMILIES.items():
            it, inputs, spec = _synthetic_chunk(method, sketched=False)
            nbytes = memoryview(inputs.base).nbytes * (1 + _CAL_K)

            def merged(it: Any = it, inputs: Any = inputs, spec: Any = spec) -> object:
                return merge_chunk(it, inputs, None, spec, dev, L1Sums())  # type: ignore[arg-type]

            merge[fam] = nbytes / _best_seconds(merged, repeat, clock)
        it, inputs, _spec = _synthetic_chunk("ties", sketched=True)
        n = _CAL_ROWS * _CAL_COLS
        runs = [parts[0][1] for parts in inputs.experts or []]
        b = torch.zeros(n)

        def decode() -> None:
            for run in runs:
                run._dev.clear()  # codes and tables are built once per run: time that too
                for s in range(0, n, TILE_ELEMS):
                    run.delta(s, min(n, s + TILE_ELEMS), b[s : min(n, s + TILE_ELEMS)], 1e-3)

        decode_bps = 2 * n * len(runs) / _best_seconds(decode, repeat, clock)
    finally:
        torch.set_num_threads(before)
    return decode_bps, merge


def plan_requests(plan: Plan) -> int:
    """Read requests the plan issues, before coalescing (an upper bound): per tensor and pass,
    one base range plus one per selected block run and per sketch run of each expert."""
    n = 0
    for t in plan.tensors:
        if t.copy_base:
            n += 1
            continue
        n += t.passes * (1 + sum(len(e.blocks) + len(e.sketch_blocks) for e in t.experts))
    return n


def sketched_entry_bytes(plan: Plan) -> int:
    """Bytes the plan's sketched entries stand for in their tensors' dtype (what the decoder
    produces and the merge then combines like exact entries): rows of every ``sketch_blocks``
    run times the row's entries times the dtype's size."""
    from mergepipe.formats.safetensors import DTYPES
    from mergepipe.methods.kernels import row_numel_of

    total = 0
    for t in plan.tensors:
        n_rows = int(t.shape[0]) if t.shape else 1
        per_row = row_numel_of(t.shape) * DTYPES[t.dtype][0]
        for e in t.experts:
            for b0, b1 in e.sketch_blocks:
                total += (min(b1 * t.rows_per_block, n_rows) - b0 * t.rows_per_block) * per_row
    return total


def predict_seconds(plan: Plan, tp: Throughput) -> dict[str, float] | None:
    """The plan's predicted wall time in seconds, by term (module docstring), with ``total``.

    Args:
        plan: a plan; its ``io`` byte estimates and block runs are used.
        tp: the measured throughput.

    Returns:
        ``{"read", "decode", "merge", "write", "total"}`` seconds, or None when the plan reads or
        writes ``s3://`` (not calibrated).
    """
    if any(r.uri.startswith("s3://") for r in [plan.base, *plan.experts]):
        return None
    io = plan.io
    exact = io.base_read_bytes + io.expert_read_bytes - io.sketch_read_bytes
    read = exact / tp.read_bytes_per_s + plan_requests(plan) * tp.request_s
    sketched = sketched_entry_bytes(plan)
    decode = sketched / tp.decode_bytes_per_s
    fam = method_family(plan.method)
    rate = tp.merge_bytes_per_s.get(fam) or min(tp.merge_bytes_per_s.values())
    merge = (exact + sketched) / rate
    write = io.output_write_bytes / tp.write_bytes_per_s
    return {"read": read, "decode": decode, "merge": merge, "write": write, "total": read + decode + merge + write}


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)\s*$", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, what: str = "--deadline") -> float:
    """Seconds from ``"60s"``, ``"2m"``, ``"1.5h"``, ``"500ms"``; a bare number is refused (is
    ``60`` seconds or minutes?), as are zero and negative durations.

    Raises:
        InputError: naming ``what`` and the accepted forms.
    """
    m = _DURATION.match(str(text))
    if not m:
        bare = re.fullmatch(r"\s*[\d.]+\s*", str(text)) is not None
        why = "a bare number has no unit" if bare else "not a duration"
        raise InputError(f"{what} {text!r}: {why}; give seconds or minutes with a unit, e.g. 60s, 2m, 1.5h.")
    s = float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    if s <= 0:
        raise InputError(f"{what} {text!r}: must be longer than zero, e.g. 60s.")
    return s


def budget_for_deadline(
    plan_at: Callable[[int | None], Plan], total_bytes: int, deadline_s: float, tp: Throughput, *, steps: int = 12
) -> Plan:
    """The plan of the largest byte budget whose predicted time fits ``deadline_s``.

    Algorithm: the unlimited plan first (returned when it fits); else bisection on the budget
    in ``[0, total_bytes]`` for ``steps`` rounds (resolution ``total_bytes / 2**steps``), keeping
    the largest budget whose plan fits. Predicted time is monotone in the budget up to request
    counts, and every returned plan is checked, so the result always fits.

    Args:
        plan_at: the plan for a budget in bytes (None: unlimited).
        total_bytes: the experts' total size in bytes (the search's upper end).
        deadline_s: seconds, positive.
        tp: the measured throughput.

    Raises:
        InputError: even the cheapest plan (budget 0: base only) is predicted slower than the
            deadline, or the plan cannot be predicted (``s3://``).
    """

    def fits(p: Plan) -> float:
        pr = predict_seconds(p, tp)
        if pr is None:
            raise InputError("--deadline: the plan reads s3://, whose throughput is not calibrated; give --budget.")
        return pr["total"]

    full = plan_at(None)
    if fits(full) <= deadline_s:
        return full
    cheapest = plan_at(0)
    t0 = fits(cheapest)
    if t0 > deadline_s:
        raise InputError(
            f"--deadline {deadline_s:g}s: even the cheapest plan (base only, no expert bytes) is predicted to take "
            f"{t0:.1f}s on this machine; give a longer deadline."
        )
    lo, hi, best = 0, total_bytes, cheapest
    for _ in range(steps):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        p = plan_at(mid)
        if fits(p) <= deadline_s:
            lo, best = mid, p
        else:
            hi = mid
    return best


def describe(pred: dict[str, Any] | None) -> str:
    """One line for ``explain``/summaries: ``predicted 12.3 s (read 1.2, decode 0.4, merge 9.9, write 0.8)``."""
    if pred is None:
        return "predicted time: not calibrated for this storage"
    return (
        "predicted {total:.1f} s (read {read:.1f}, decode {decode:.1f}, merge {merge:.1f}, write {write:.1f})".format(
            **pred
        )
    )
