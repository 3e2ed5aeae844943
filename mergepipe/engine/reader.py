"""The engine's reader: fetches the work list's input bytes ahead of the merge, bounded in bytes.

A pool of ``threads`` fetches items in work-list order: the base rows of a chunk (role
``base``) and, for merges, each contributing expert's selected rows (role ``expert``, with
the plan's coalescing gap, so realized expert bytes equal the planned bytes). An item's bytes
count against ``limit`` from its submission until the executor :meth:`Prefetcher.release`\\ s
it after merging, so the inputs in memory (fetched, in flight or being merged) stay within
``limit`` (one item larger than the bound still runs, alone).
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergepipe.engine.checks import check_expert_runs, check_sketch_plane
from mergepipe.engine.worklist import WorkItem, base_byte_range, expert_runs, n_rows, row_bytes
from mergepipe.formats.safetensors import DTYPES
from mergepipe.planner.plan import Plan, TensorExpert, TensorPlan, sketch_location
from mergepipe.storage.base import Storage

if TYPE_CHECKING:
    from mergepipe.engine.sketchkernel import SketchRun

Buffer = bytes | memoryview


@dataclass(slots=True)
class LoraBytes:
    """A LoRA expert's input for a run of rows: all of A and the run's rows of B (raw bytes;
    the engine computes ``δ = scale·B·A`` from them, :func:`mergepipe.lora.delta_rows`)."""

    a: Buffer
    b: Buffer


#: one run of an expert's input rows: ``((row0, row1), bytes)``; a LoRA expert's
#: :class:`LoraBytes`; a sketched run's :class:`~mergepipe.engine.sketchkernel.SketchRun`
ExpertRun = tuple[tuple[int, int], "Buffer | LoraBytes | SketchRun"]


@dataclass(slots=True)
class ChunkInputs:
    """The input bytes of one work item.

    Attributes:
        base: the base's bytes of rows ``[r0, r1)`` (empty for server-side copies).
        experts: for merges, per contributing expert (in ``tp.experts`` order) a list of
            ``((row0, row1), bytes)`` runs of its selected rows (a LoRA expert:
            ``((row0, row1), LoraBytes)``; a sketched run: ``((row0, row1), SketchRun)``);
            None for copies.
    """

    base: Buffer
    experts: list[list[ExpertRun]] | None


def fetch_inputs(plan: Plan, storage: Storage, it: WorkItem) -> ChunkInputs:
    """Read the input bytes of ``it`` (see :class:`ChunkInputs`), counted by role."""
    if it.kind == "cow":
        return ChunkInputs(b"", None)
    tp = it.tp
    rb = row_bytes(tp)
    s, e = base_byte_range(tp, it.r0, it.r1)
    base = storage.read_ranges(storage.join(plan.base.uri, tp.file), [(s, e)], "base")[0] if e > s else b""
    if it.kind in ("copy", "convert"):
        return ChunkInputs(base, None)
    experts: list[list[ExpertRun]] = []
    for te in tp.experts:
        runs = expert_runs(te, tp.rows_per_block, it.r0, it.r1, n_rows(tp))
        if te.lora is not None:  # A (whole) and the runs' rows of B, exactly as planned (no gap)
            if not runs:
                experts.append([])
                continue
            lf = te.lora
            brow = DTYPES[lf.b_dtype][0] * lf.rank
            lrng = [(lf.a_start, lf.a_end)] + [(te.start + a * brow, te.start + b * brow) for a, b in runs]
            bufs = storage.read_ranges(storage.join(plan.experts[te.expert].uri, te.file), lrng, "expert", max_gap=0)
            experts.append([(run, LoraBytes(bufs[0], buf)) for run, buf in zip(runs, bufs[1:], strict=True)])
            continue
        rngs = [(te.start + a * rb, te.start + b * rb) for a, b in runs]
        uri = storage.join(plan.experts[te.expert].uri, te.file)
        bufs = storage.read_ranges(uri, rngs, "expert", max_gap=plan.coalesce_gap)
        check_expert_runs(te, tp.name, plan.experts[te.expert].name, uri, tp.rows_per_block, rb, runs, bufs)
        parts: list = list(zip(runs, bufs, strict=True))
        if te.sketch_blocks:
            parts = sorted(parts + sketch_parts(plan, storage, tp, te, it.r0, it.r1), key=lambda p: p[0][0])
        experts.append(parts)
    return ChunkInputs(base, experts)


def sketch_parts(
    plan: Plan, storage: Storage, tp: TensorPlan, te: TensorExpert, r0: int, r1: int
) -> list[tuple[tuple[int, int], SketchRun]]:
    """The rows of ``te``'s sketched blocks inside ``[r0, r1)`` as ``((row0, row1), SketchRun)``
    runs: the run's first ``k`` sign planes, undecoded (:class:`mergepipe.engine.sketchkernel.
    SketchRun`; the merge decodes a tile's rows at a time, on its device). A tensor's sketch is
    section-major, so level ``k`` of a run is one byte range per section it reads
    (:func:`mergepipe.catalog.sketch.level_sections`: ``k`` sign planes, or the rank-1 factors
    and the residual plane), read through ``storage`` with role
    ``expert``: they are derived from the expert and count against the same budget (the planner
    charged them). ``r0`` is a block boundary.

    Raises:
        ValueError: a plane's bytes do not match the run's blocks.
    """
    from mergepipe.catalog.sketch import R1_LEVEL, level_sections, section_offsets
    from mergepipe.engine.sketchkernel import SketchRun

    rpb, rows = tp.rows_per_block, n_rows(tp)
    row_numel = max(1, math.prod(tp.shape[1:]))
    offs = section_offsets(rows, row_numel, rpb, tp.n_blocks)  # (sections, n_blocks + 1), from sketch_start
    runs, rngs = [], []
    for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels, strict=True):
        a, z = max(r0, b0 * rpb), min(r1, b1 * rpb, rows)
        if z <= a:
            continue
        runs.append(((a, z), k))
        lo, hi = a // rpb, -(-z // rpb)
        rngs += [(te.sketch_start + int(offs[s, lo]), te.sketch_start + int(offs[s, hi])) for s in level_sections(k)]
    if not runs:
        return []
    root, name = sketch_location(plan, te.expert, f"plan: experts[{te.expert}].sketch.uri")
    uri = storage.join(root, name)
    bufs = storage.read_ranges(uri, rngs, "expert", max_gap=0)
    q = 0
    for (a, z), k in runs:  # every section's bytes checked before any is decoded
        for p, s in enumerate(level_sections(k)):
            blocks = range(a // rpb, -(-z // rpb))
            check_sketch_plane(te, tp.name, plan.experts[te.expert].name, uri, blocks, p, bufs[q], offs[s] - offs[s, 0])
            q += 1
    if storage.counters is not None:
        storage.counters.add_detail("sketch", sum(memoryview(b).nbytes for b in bufs))
    out, q = [], 0
    for (a, z), k in runs:
        n = len(level_sections(k))
        if k == R1_LEVEL:  # the rank-1 tier: factors, then the residual plane
            run = SketchRun(z - a, row_numel, rpb, [bufs[q + 1]], factors=bufs[q])
        else:
            run = SketchRun(z - a, row_numel, rpb, list(bufs[q : q + n]))
        out.append(((a, z), run))
        q += n
    return out


class Prefetcher:
    """Fetches ``items``' inputs in order on ``threads`` threads, at most ``limit`` bytes ahead.

    Use: ``inputs = next_inputs()`` for each item in order, then ``release(item)`` once its
    bytes are no longer needed; ``close()`` at the end (it cancels what was not fetched).
    """

    def __init__(self, plan: Plan, storage: Storage, items: list[WorkItem], limit: int, threads: int = 4) -> None:
        self.plan, self.storage, self.items, self.limit = plan, storage, items, limit
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mergepipe-fetch")
        self._pending: deque[Future] = deque()
        self._next = 0  # next item to submit
        self._taken = 0  # next item to hand out
        self.inflight = 0  # bytes of submitted, not yet released items

    def next_inputs(self) -> ChunkInputs:
        """The inputs of the next item (waits for its fetch), after submitting every further item
        that fits within the byte bound. Raises what the fetch raised (storage errors)."""
        items = self.items
        while self._next < len(items) and (
            self._next <= self._taken or self.inflight + items[self._next].nbytes <= self.limit
        ):
            self._pending.append(self._pool.submit(fetch_inputs, self.plan, self.storage, items[self._next]))
            self.inflight += items[self._next].nbytes
            self._next += 1
        self._taken += 1
        fut = self._pending[0]
        out = fut.result()
        self._pending.popleft()
        return out

    def release(self, it: WorkItem) -> None:
        """``it``'s input bytes are no longer held: later items may be fetched in their place."""
        self.inflight -= it.nbytes

    def close(self) -> None:
        """Cancel fetches not started and wait for running ones."""
        for f in self._pending:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
