"""Streaming executor: prefetch → merge on a torch device → write, one row chunk at a time.

The engine is four parts joined by typed values:

- the work list (:mod:`mergepipe.engine.worklist`): the plan as :class:`WorkItem` steps in
  output order (row chunks to merge, base ranges to copy or convert, server-side copies);
- the reader (:mod:`mergepipe.engine.reader`): a pool fetching the next items' byte ranges
  (base rows, selected expert blocks) while the current item is merged;
- the merge arithmetic of one item on ``device`` (:mod:`mergepipe.engine.chunk`);
- the writer (:mod:`mergepipe.engine.writer`): a thread that hashes and writes finished bytes,
  driven by typed messages (:class:`OpenShard`, :class:`TensorBytes`, ...).

:func:`execute` runs the loop that joins them. Bytes in flight are bounded (``prefetch_bytes``),
and a chunk's float32 working set is bounded by the plan's ``work_bytes``, so peak memory does
not grow with model size or tensor size.

The executor reads only byte ranges the plan lists (and with the plan's coalescing gap), so
realized expert bytes <= planned; it checks this at the end and refuses to finish otherwise.
Output shards have the base's names, tensor order and header metadata,
and the base's dtypes unless the plan sets ``out_dtype`` (then floating tensors, their headers,
the index's ``total_size`` and ``config.json``'s ``torch_dtype`` say so), so the same plan and
inputs give bit-identical shards. Every parameter the kernels use is the plan's per-tensor value.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mergepipe.engine.chunk import L1Sums, merge_chunk
from mergepipe.engine.reader import Prefetcher
from mergepipe.engine.worklist import (
    COPY_CHUNK,
    WorkItem,
    base_byte_range,
    build_work_list,
    server_side_copy,
    shard_header,
)
from mergepipe.engine.writer import (
    BaseBytes,
    CloseShard,
    CopyRange,
    EndTensor,
    OpenShard,
    ShardWriter,
    TensorBytes,
)
from mergepipe.errors import InputError
from mergepipe.formats.safetensors import DTYPES, INDEX_NAME, config_with_dtype, index_json, needs_index_file
from mergepipe.methods.registry import get_method
from mergepipe.planner.plan import Plan, sketch_location
from mergepipe.storage.base import NotFoundError, Storage

if TYPE_CHECKING:
    import torch

    from mergepipe.engine.reader import Buffer

DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024

#: ``on_file(name, info, base_tensor_sha256)``: an output file is complete (see :func:`_execute`)
FileDone = Callable[[str, dict, dict[str, str]], None]


@dataclass
class ExecResult:
    """What an execution produced.

    Attributes:
        files: output file name -> ``{"size": bytes, "tree_sha256": hex}`` for shards (see
            :func:`mergepipe.engine.writer.tree_digest`), ``{"size", "sha256": hex}`` for the
            index and config files.
        touched_blocks: expert name -> number of blocks read.
        wall_s: seconds from start to the last byte written.
        counters: the storage counters' snapshot (bytes per role).
        base_tensor_sha256: base tensor name -> SHA-256 of its bytes.
    """

    files: dict[str, dict] = field(default_factory=dict)
    touched_blocks: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    counters: dict = field(default_factory=dict)
    base_tensor_sha256: dict[str, str] = field(default_factory=dict)

    def base_content_digest(self) -> str:
        """SHA-256 over the base's per-tensor SHA-256s (every base byte is read once)."""
        return hashlib.sha256(json.dumps(self.base_tensor_sha256, sort_keys=True).encode()).hexdigest()


def verify_inputs(plan: Plan, storage: Storage) -> None:
    """Check every input file still has the size and version the plan was made from.

    Raises:
        InputError: a file is missing or changed since it was registered (stale catalog).
    """
    for ref in [plan.base, *plan.experts]:
        for f, (size, version) in ref.signature.items():
            uri = storage.join(ref.uri, f)
            try:
                st = storage.stat(uri)
            except NotFoundError:
                raise InputError(
                    f"{uri}: missing; it was present when the plan was made. Restore it or re-plan."
                ) from None
            if st.size != size or st.version != version:
                raise InputError(
                    f"{uri}: changed since it was analyzed (size {size} -> {st.size}); the catalog is "
                    "stale. Re-run `mergepipe merge` (or analyze + plan) to re-analyze it."
                )
    for i, ref in enumerate(plan.experts):  # block sketches the plan reads (size here; content as read)
        if not ref.sketch:
            continue
        uri = storage.join(*sketch_location(plan, i, f"plan: experts[{i}].sketch.uri"))
        try:
            size = storage.stat(uri).size
        except NotFoundError:
            size = None
        if size != ref.sketch["bytes"]:
            raise InputError(
                f"{uri}: the block sketches of expert {ref.name!r} are "
                + ("missing" if size is None else f"{size} bytes, the plan expects {ref.sketch['bytes']}")
                + "; re-run `mergepipe analyze --force` for it and re-plan (or re-run `mergepipe merge`, which "
                "re-creates missing sketches), or plan with --sketch none."
            )


def default_compute_threads() -> int:
    """torch intra-op threads for the merge arithmetic: one core is left to the reader and
    writer threads (decoding, hashing, syscalls). On 2 cores this is 1: measured, two OpenMP
    threads spinning against the I/O threads made a 3-expert merge 2.6x slower
    (docs/BENCHMARKS.md). ``MERGEPIPE_COMPUTE_THREADS`` overrides it."""
    env = os.environ.get("MERGEPIPE_COMPUTE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def execute(
    plan: Plan,
    storage: Storage,
    out_storage: Storage,
    out_prefix: str,
    *,
    compute_threads: int | None = None,
    **kw: Any,
) -> ExecResult:
    """Execute ``plan`` (see :func:`_execute` for the arguments) with ``compute_threads`` torch
    intra-op threads (default :func:`default_compute_threads`), restoring the setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(compute_threads or default_compute_threads())
    try:
        return _execute(plan, storage, out_storage, out_prefix, **kw)
    finally:
        torch.set_num_threads(before)


def _device(device: str) -> torch.device:
    """The torch device named ``device``. Raises InputError when it is unknown or unusable."""
    import torch

    try:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine; use --device cpu.")
    except RuntimeError as e:
        raise InputError(f"--device {device}: {e}") from None
    return dev


def _nbytes(buf: Buffer) -> int:
    """Bytes in ``buf``."""
    return memoryview(buf).nbytes


def _execute(
    plan: Plan,
    storage: Storage,
    out_storage: Storage,
    out_prefix: str,
    *,
    device: str = "cpu",
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
    progress: Callable[[int], None] | None = None,
    read_threads: int = 4,
    shards: Collection[str] | None = None,
    side_files: bool = True,
    on_file: FileDone | None = None,
) -> ExecResult:
    """Execute ``plan``, writing the output shards and index under ``out_prefix``.

    Args:
        storage: where the base and experts are read (bytes counted by role).
        out_storage: where outputs are written (``out_prefix`` is a staging location: the
            commit step makes it visible).
        device: torch device for the merge arithmetic (``cpu``, ``cuda``, ``cuda:1``...).
        prefetch_bytes: bound on bytes fetched ahead of the merge.
        progress: called with the output bytes produced (each shard header, each chunk, the
            index and each side file), adding up to the plan's ``output_write_bytes``.
        read_threads: threads fetching inputs ahead.
        shards: write only these output shards (a part of a partitioned run, or the shards
            a resumed run still lacks); default all.
        side_files: also write the index and the base's config/tokenizer files.
        on_file: called as each output file is complete and durable, with its name, its
            ``{"size", "tree_sha256" | "sha256"}`` and the SHA-256 of the base tensors it
            holds (from the writer thread; an exception fails the execution).

    Raises:
        InputError: inputs changed since planning; unusable device.
        RuntimeError: realized expert bytes exceeded the plan (a bug; nothing is committed).
    """
    t0 = time.perf_counter()
    dev = _device(device)
    verify_inputs(plan, storage)
    read_before = storage.counters.snapshot()["read"]
    res = ExecResult()
    items = build_work_list(plan, cow=server_side_copy(storage, out_storage, plan.base.uri, out_prefix), shards=shards)
    res.files.update(
        _write_shards(
            plan,
            items,
            storage,
            out_storage,
            out_prefix,
            dev,
            prefetch_bytes,
            progress,
            read_threads,
            res.base_tensor_sha256,
            on_file,
        )
    )
    if side_files:
        _write_side_files(plan, storage, out_storage, out_prefix, res.files, progress, on_file)
    res.counters = _counters(storage, out_storage)
    _check_realized(plan, res.counters["read"].get("expert", 0) - read_before.get("expert", 0))
    res.touched_blocks.update(_touched_blocks(plan))
    res.wall_s = time.perf_counter() - t0
    return res


def _write_side_files(
    plan: Plan,
    storage: Storage,
    out_storage: Storage,
    out_prefix: str,
    files: dict[str, dict],
    progress: Callable[[int], None] | None,
    on_file: FileDone | None,
) -> None:
    """Write the index (when the output needs one) and the base's extra files under
    ``out_prefix``, adding each to ``files`` and reporting it to ``on_file`` and ``progress``."""
    index = _write_index(plan, out_storage, out_prefix)
    if index is not None:
        files[INDEX_NAME] = index
        if on_file:
            on_file(INDEX_NAME, index, {})
        if progress:
            progress(index["size"])
    for name, info in _write_extra_files(plan, storage, out_storage, out_prefix).items():
        files[name] = info
        if on_file:
            on_file(name, info, {})
        if progress:
            progress(info["size"])


def _counters(storage: Storage, out_storage: Storage) -> dict:
    """The storage counters' snapshot: bytes read from ``storage``, written and copied to
    ``out_storage`` (one snapshot when they share counters)."""
    if storage.counters is out_storage.counters:
        return storage.counters.snapshot()
    return {
        "read": storage.counters.snapshot()["read"],
        "written": out_storage.counters.snapshot()["written"],
        "copied": out_storage.counters.snapshot()["copied"],
    }


def _check_realized(plan: Plan, realized: int) -> None:
    """Refuse to finish when the expert bytes read exceed the plan's estimate.

    Raises:
        RuntimeError: ``realized`` > ``plan.io.expert_read_bytes`` (a bug; nothing is committed).
    """
    if realized > plan.io.expert_read_bytes:
        raise RuntimeError(
            f"realized expert bytes {realized} exceed the planned {plan.io.expert_read_bytes}: refusing to "
            "commit (this is a mergepipe bug; please report it with the plan)."
        )


def _touched_blocks(plan: Plan) -> dict[str, int]:
    """Expert name -> number of its blocks the plan reads exactly, for every expert some tensor
    of the plan lists (sketched blocks are counted in the manifest's ``sketch`` entry)."""
    out: dict[str, int] = {}
    for tp in plan.tensors:
        for te in tp.experts:
            nm = plan.experts[te.expert].name
            out[nm] = out.get(nm, 0) + sum(b - a for a, b in te.blocks)
    return out


def _write_shards(  # noqa: C901, PLR0912 - not split yet: the shard writer loop (order, resume skips, rollover, counters)
    plan: Plan,
    items: list[WorkItem],
    storage: Storage,
    out_storage: Storage,
    out_prefix: str,
    dev: torch.device,
    prefetch_bytes: int,
    progress: Callable[[int], None] | None,
    read_threads: int,
    base_sha256: dict[str, str],
    on_file: FileDone | None = None,
) -> dict[str, dict]:
    """The executor loop: each work item's inputs from the reader, merged, sent to the writer.

    Returns the shards written (name -> ``{"size", "tree_sha256"}``) and fills ``base_sha256``
    with the SHA-256 of every base tensor (hashed as it passed, or the catalog's for
    server-side copies). On any error every unfinished shard is discarded.
    """
    spec = get_method(plan.method)
    writer = ShardWriter(
        out_storage,
        out_prefix,
        max(COPY_CHUNK, prefetch_bytes // 4),
        base_file_uri=lambda f: storage.join(plan.base.uri, f),
        on_close=on_file,
    )
    reader = Prefetcher(plan, storage, items, prefetch_bytes, read_threads)
    l1 = L1Sums()
    try:
        for it in items:
            inputs = reader.next_inputs()
            tp = it.tp
            if it.opens_shard:
                hdr = shard_header(plan, tp.file)
                writer.send(OpenShard(tp.file, hdr), len(hdr))
                if progress:
                    progress(len(hdr))
            if it.kind == "cow":
                s, e = base_byte_range(tp, it.r0, it.r1)
                writer.send(CopyRange(tp.name, tp.base_sha256, storage.join(plan.base.uri, tp.file), s, e))
                if progress:
                    progress(e - s)
            elif it.kind == "copy":
                writer.send(TensorBytes(tp.name, inputs.base), _nbytes(inputs.base))
                if progress:
                    progress(_nbytes(inputs.base))
            else:
                if it.kind not in ("stats", "threshold"):
                    writer.send(BaseBytes(tp.name, inputs.base), _nbytes(inputs.base))
                out = merge_chunk(it, inputs, plan, spec, dev, l1)
                if out is not None:
                    writer.send(TensorBytes(tp.name, out), _nbytes(out))
                    if progress:
                        progress(_nbytes(out))
                out = None
            # the item's input bytes are released now (not when its fetch finished), so inputs
            # in memory, in flight or being merged, stay within prefetch_bytes
            reader.release(it)
            del inputs
            if it.ends_tensor:
                writer.send(EndTensor(tp, copied=it.kind in ("copy", "cow")))
            if it.closes_shard:
                writer.send(CloseShard(tp.file))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    base_sha256.update(writer.base_tensor_sha256())
    for it in items:
        if it.kind == "cow":
            base_sha256[it.tp.name] = it.tp.base_sha256
    return writer.files


def needs_index(plan: Plan) -> bool:
    """The output has a ``model.safetensors.index.json``: several shards, a shard not named
    ``model.safetensors``, or a base that had an index with metadata."""
    return needs_index_file({t.file for t in plan.tensors}, plan.index_metadata)


def _write_index(plan: Plan, out_storage: Storage, out_prefix: str) -> dict | None:
    """Write ``model.safetensors.index.json`` when the output is sharded (or the base had an
    index); returns its ``{"size", "sha256"}`` or None."""
    if not needs_index(plan):
        return None
    total = sum(math.prod(t.shape) * DTYPES[t.out_dtype or t.dtype][0] for t in plan.tensors)
    return _write_small(
        out_storage,
        out_storage.join(out_prefix, INDEX_NAME),
        index_json({t.name: t.file for t in plan.tensors}, total),
    )


def _write_extra_files(plan: Plan, storage: Storage, out_storage: Storage, out_prefix: str) -> dict[str, dict]:
    """Copy the base's non-weight files (config, tokenizer) present; ``config.json`` gets the
    output dtype. Returns name -> ``{"size", "sha256"}``."""
    out = {}
    for f in plan.extra_files:
        try:
            data = storage.read_object(storage.join(plan.base.uri, f), "base")
        except NotFoundError:
            continue
        if f == "config.json" and plan.out_dtype:
            data = config_with_dtype(data, plan.out_dtype)
        out[f] = _write_small(out_storage, out_storage.join(out_prefix, f), data)
    return out


def _write_small(out_storage: Storage, uri: str, data: bytes) -> dict:
    w = out_storage.open_writer(uri, "output")
    w.write(data)
    return {"size": w.close(), "sha256": hashlib.sha256(data).hexdigest()}
