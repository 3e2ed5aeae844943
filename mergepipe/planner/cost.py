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
    decode = sketch bytes / decode_bytes_per_s
    merge  = (base + expert exact + sketch bytes) / merge_bytes_per_s
    write  = output bytes / write_bytes_per_s

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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergepipe.errors import InputError
from mergepipe.planner.plan import Plan

THROUGHPUT_FORMAT = "mergepipe.throughput/v1"
#: the throughput cache's size cap (a real file is ~500 bytes)
MAX_THROUGHPUT_BYTES = 64 * 1024


class Throughput(BaseModel):
    """What one machine measured (:func:`calibrate`); every rate positive and finite.

    Attributes:
        read_bytes_per_s: local storage sequential read, bytes/s (warm page cache: a calibration
            cannot drop the OS cache without privileges).
        write_bytes_per_s: local storage write including fsync, bytes/s.
        request_s: seconds per small random read request (4 KiB ``pread``).
        decode_bytes_per_s: sketch decode, sketch bytes/s (a gather of per-row value tables by a
            one-byte code per entry, the form of :mod:`mergepipe.engine.sketchkernel`).
        merge_bytes_per_s: merge arithmetic, input bytes/s (a TIES-like float32 trim + sign
            election + disjoint mean over 4 bf16 experts; one rate for every method family).
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
    merge_bytes_per_s: float = Field(gt=0, allow_inf_nan=False)
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
    rows, cols = 2048, 1024
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8, (rows, cols), generator=g, dtype=torch.uint8)
    table = torch.randn(rows, 8, generator=g)
    t0 = time.perf_counter()
    for _ in range(3):
        torch.gather(table, 1, codes.long())
    decode_bps = 3 * codes.numel() * 3 / 8 / max(time.perf_counter() - t0, 1e-9)  # 3 sign planes: 3 bits/entry
    base = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    experts = [torch.randn(rows, cols, generator=g).to(torch.bfloat16) for _ in range(4)]
    t0 = time.perf_counter()
    for _ in range(2):
        b = base.float()
        deltas = torch.stack([e.float() - b for e in experts])
        k = int(0.3 * deltas[0].numel())
        for i in range(len(experts)):
            thr = deltas[i].abs().flatten().kthvalue(deltas[i].numel() - k + 1).values
            deltas[i] *= deltas[i].abs() >= thr
        sign = torch.sign(deltas.sum(0))
        agree = torch.sign(deltas) == sign
        merged = (deltas * agree).sum(0) / agree.sum(0).clamp(min=1)
        (b + merged).to(torch.bfloat16)
    merge_bps = 2 * (1 + len(experts)) * base.numel() * 2 / max(time.perf_counter() - t0, 1e-9)
    return Throughput(
        read_bytes_per_s=read_bps,
        write_bytes_per_s=write_bps,
        request_s=request_s,
        decode_bytes_per_s=decode_bps,
        merge_bytes_per_s=merge_bps,
        host=platform.node(),
        device="cpu",
        threads=torch.get_num_threads(),
        measured_at=time.time(),
    )


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
    decode = io.sketch_read_bytes / tp.decode_bytes_per_s
    merge = (exact + io.sketch_read_bytes) / tp.merge_bytes_per_s
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
