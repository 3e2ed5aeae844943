"""The engine's work list: what to read, merge and write, in output order, built from a plan.

A plan says *how* each output tensor is made; the work list says *in which steps*: every
tensor becomes one or more :class:`WorkItem` (a row chunk to merge, a pre-pass over a chunk
for L1 statistics, a range of base bytes to copy or convert, or one server-side copy), in the
plan's tensor order, so that output shards are written front to back. Each item carries the
input bytes it holds while in flight (``nbytes``, for the prefetch bound) and the shard
boundaries the writer needs (``opens_shard``, ``ends_tensor``, ``closes_shard``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from mergepipe.formats.safetensors import DTYPES, build_header
from mergepipe.methods.kernels import row_numel_of
from mergepipe.planner.plan import Plan, TensorExpert, TensorPlan
from mergepipe.storage.base import Storage

#: base bytes copied per work item (bytes): bounds the memory of a copied tensor
COPY_CHUNK = 16 * 1024 * 1024
#: tensors at least this large (bytes) are copied server-side when input and output share an
#: object store; S3 parts are >= 5 MiB: a smaller copy would mostly be re-read to top up a part
COW_MIN_BYTES = 16 * 1024 * 1024

#: ``merge``: merge a row chunk; ``stats``: a pre-pass over a tensor (L1 sums only, no
#: output); ``threshold``: a pre-pass gathering the threshold key groups of bf16/float16/float32 TIES
#: and breadcrumbs task vectors (no output); ``convert``: decode base rows and encode them in the output dtype; ``copy``: base
#: bytes written unchanged; ``cow``: the whole tensor copied by the store (nothing read here).
Kind = Literal["merge", "stats", "threshold", "convert", "copy", "cow"]


@dataclass(eq=False, slots=True)
class WorkItem:
    """One step of the work list: rows ``[r0, r1)`` of tensor ``tp``.

    Attributes:
        kind: what to do (see :data:`Kind`).
        tp: the tensor's plan.
        r0, r1: the row range (rows of ``tp.shape[0]``; a 0-d tensor has one row).
        nbytes: input bytes this item holds from its fetch until it is merged (base rows plus
            one copy per contributing expert for merges; 0 for server-side copies).
        opens_shard: the first item of its output shard (the shard's header goes first).
        ends_tensor: the last item of its tensor (the tensor's digest is final after it).
        closes_shard: the last item of its output shard.
        fused: on the first ``merge`` item of a multi-pass tensor, the kind of the last
            pre-pass (``"stats"`` or ``"threshold"``), which skipped these rows: the item adds
            them to that pre-pass's statistic, then merges them, so they are read once for both.
            None otherwise.
    """

    kind: Kind
    tp: TensorPlan
    r0: int
    r1: int
    nbytes: int
    opens_shard: bool = False
    ends_tensor: bool = False
    closes_shard: bool = False
    fused: Kind | None = None


def row_bytes(tp: TensorPlan) -> int:
    """Bytes of one row of ``tp`` in its input dtype."""
    return row_numel_of(tp.shape) * DTYPES[tp.dtype][0]


def n_rows(tp: TensorPlan) -> int:
    """Rows of ``tp`` (a 0-d tensor has one row)."""
    return tp.shape[0] if tp.shape else 1


def base_byte_range(tp: TensorPlan, r0: int, r1: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of rows ``[r0, r1)`` of ``tp`` in the base shard ``tp.file``."""
    rb = row_bytes(tp)
    return tp.start + r0 * rb, tp.start + r1 * rb


def expert_runs(te: TensorExpert, rows_per_block: int, r0: int, r1: int, rows: int) -> list[tuple[int, int]]:
    """Row ranges of an expert's selected blocks inside rows ``[r0, r1)``."""
    out = []
    for b0, b1 in te.blocks:
        a, b = max(r0, b0 * rows_per_block), min(r1, b1 * rows_per_block, rows)
        if b > a:
            out.append((a, b))
    return out


def server_side_copy(storage: Storage, out_storage: Storage, base_uri: str, out_prefix: str) -> bool:
    """True when unchanged base bytes can be copied by the store itself (S3 UploadPartCopy):
    base and output on the same S3 endpoint."""
    if not (storage.capabilities(base_uri).server_side_copy and out_storage.capabilities(out_prefix).server_side_copy):
        return False
    src, dst = storage.backend(base_uri), out_storage.backend(out_prefix)
    return src is dst or getattr(src, "endpoint_url", 0) == getattr(dst, "endpoint_url", 1)


def _tensor_items(tp: TensorPlan, cow: bool) -> list[WorkItem]:
    rows = n_rows(tp)
    rb = row_bytes(tp)
    items: list[WorkItem] = []
    if tp.copy_base and tp.out_dtype and tp.out_dtype != tp.dtype:
        for r0 in range(0, rows, tp.chunk_rows):  # same values, another dtype: decode + encode
            r1 = min(rows, r0 + tp.chunk_rows)
            items.append(WorkItem("convert", tp, r0, r1, (r1 - r0) * rb))
        return items
    if tp.copy_base and cow and tp.base_sha256 and rows * rb >= COW_MIN_BYTES:
        return [WorkItem("cow", tp, 0, rows, 0)]  # server-side copy: nothing read here
    if tp.copy_base:
        step = max(1, COPY_CHUNK // max(1, rb))
        for r0 in range(0, max(rows, 1), step):
            r1 = min(rows, r0 + step)
            items.append(WorkItem("copy", tp, r0, r1, r1 * rb - r0 * rb))
        if not tp.shape or rows * rb == 0:
            items[-1].r1 = rows
        return items
    chunks = [(r0, min(rows, r0 + tp.chunk_rows)) for r0 in range(0, rows, tp.chunk_rows)]
    *pre, _ = pass_kinds(tp)
    per_row = rb * (1 + len(tp.experts))
    for k, kind in enumerate(pre):  # the last pre-pass skips the first chunk: its merge item adds it
        skip = 1 if k == len(pre) - 1 else 0
        items += [WorkItem(kind, tp, r0, r1, (r1 - r0) * per_row) for r0, r1 in chunks[skip:]]
    for j, (r0, r1) in enumerate(chunks):
        items.append(WorkItem("merge", tp, r0, r1, (r1 - r0) * per_row, fused=pre[-1] if pre and j == 0 else None))
    return items


def pass_kinds(tp: TensorPlan) -> tuple[Kind, ...]:
    """The passes over a merged tensor, ``tp.passes`` of them: an exact-threshold pre-pass when
    the plan asks for one (``derived["threshold_pass"]``: bf16/float16/float32 TIES or breadcrumbs over
    several chunks), an L1 pre-pass for a rescale over several chunks, then the merge. The last
    pre-pass visits the chunks after the first, then the first chunk's merge item completes it
    (:attr:`WorkItem.fused`; :func:`mergepipe.planner.plan.block_reads` counts the reads)."""
    pre: list[Kind] = ["threshold"] if tp.derived.get("threshold_pass") else []
    pre += ["stats"] * (tp.passes - 1 - len(pre))
    return (*pre, "merge")


def build_work_list(plan: Plan, *, cow: bool = False, shards: Collection[str] | None = None) -> list[WorkItem]:
    """The work list of ``plan``: items in the plan's tensor order, shard boundaries marked.

    Args:
        cow: unchanged base tensors of at least :data:`COW_MIN_BYTES` are copied server-side
            (see :func:`server_side_copy`).
        shards: only the tensors of these output shards (file names); default all.

    The tensors of one shard must be contiguous in ``plan.tensors`` (the planner lists them in
    the base's file order), since the writer writes one shard at a time.
    """
    items: list[WorkItem] = []
    for tp in plan.tensors:
        if shards is None or tp.file in shards:
            items.extend(_tensor_items(tp, cow))
    seen: set[str] = set()
    for i, it in enumerate(items):
        if it.tp.file not in seen:
            seen.add(it.tp.file)
            it.opens_shard = True
        nxt = items[i + 1] if i + 1 < len(items) else None
        it.ends_tensor = nxt is None or nxt.tp is not it.tp
    last: dict[str, WorkItem] = {}
    for it in items:
        last[it.tp.file] = it
    for it in last.values():
        it.closes_shard = True
    return items


def shard_header(plan: Plan, file: str) -> bytes:
    """The safetensors header (length prefix included) of output shard ``file``: the base's
    tensor names, order and metadata, with each tensor's output dtype."""
    return build_header(
        [(t.name, t.out_dtype or t.dtype, tuple(t.shape)) for t in plan.tensors if t.file == file],
        plan.shard_metadata.get(file, {}),
    )
