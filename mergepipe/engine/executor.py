"""Streaming executor: prefetch → merge on a torch device → write, one row chunk at a time.

Three stages overlap: a reader pool fetches the next chunks' byte ranges (base rows, selected
expert blocks) while the main thread merges the current chunk on ``device`` and a writer thread
hashes and writes finished bytes. Bytes in flight are bounded (``prefetch_bytes``), and a chunk's
float32 working set is bounded by the plan's ``work_bytes``, so peak memory does not grow with
model size or tensor size.

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
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import INDEX_NAME, build_header
from mergepipe.methods.kernels import (
    ExpertTensorParams,
    combine,
    elementwise_merge,
    filter_width,
    l1_row_sums,
    l1_rows,
    model_stock_merge,
    nuslerp_merge,
    rescale_factor,
    row_numel_of,
    slerp_merge,
    sparsify,
)
from mergepipe.methods.registry import get_method
from mergepipe.numerics import decode
from mergepipe.planner.plan import Plan, TensorPlan
from mergepipe.storage.base import NotFoundError, Storage, Writer

DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024
COPY_CHUNK = 16 * 1024 * 1024


@dataclass
class ExecResult:
    """What an execution produced.

    Attributes:
        files: output file name -> ``{"size": bytes, "sha256": hex}``.
        touched_blocks: expert name -> number of blocks read.
        wall_s: seconds from start to the last byte written.
        counters: the storage counters' snapshot (bytes per role).
    """

    files: dict[str, dict] = field(default_factory=dict)
    touched_blocks: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    counters: dict = field(default_factory=dict)
    base_tensor_sha256: dict[str, str] = field(default_factory=dict)

    def base_content_digest(self) -> str:
        """SHA-256 over the base's per-tensor SHA-256s (every base byte is read once)."""
        return hashlib.sha256(json.dumps(self.base_tensor_sha256, sort_keys=True).encode()).hexdigest()


class HashingWriter:
    """Wraps a :class:`Writer`, hashing (SHA-256, unless ``hash=False``) and counting what passes
    through."""

    def __init__(self, inner: Writer, hash: bool = True) -> None:
        self.inner = inner
        self.sha = hashlib.sha256() if hash else None
        self.size = 0

    def write(self, data) -> None:
        if self.sha is not None:
            self.sha.update(data)
        self.size += len(data) if not isinstance(data, memoryview) else data.nbytes
        self.inner.write(data)


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
                raise InputError(f"{uri}: missing; it was present when the plan was made. Restore it or re-plan.") from None
            if st.size != size or st.version != version:
                raise InputError(
                    f"{uri}: changed since it was analyzed (size {size} -> {st.size}); the catalog is "
                    "stale. Re-run `mergepipe merge` (or analyze + plan) to re-analyze it."
                )


def _torch_dtype(name: str):
    import torch

    from mergepipe.formats.safetensors import DTYPES

    return getattr(torch, DTYPES[name][1])


def _encode(t, dtype: str) -> bytes:
    """float32 torch tensor -> little-endian bytes of ``dtype`` (round to nearest even)."""
    import torch

    out = t.to(_torch_dtype(dtype)).contiguous().cpu()
    return out.view(torch.uint8).numpy().tobytes()


#: tensors at least this large are copied server-side when input and output share an object store;
COW_MIN_BYTES = 16 * 1024 * 1024  # S3 parts are >= 5 MiB: a smaller copy would mostly be re-read to top up a part


class _KnownHash:
    """A finished hash known in advance (a base tensor's SHA-256 from the catalog)."""

    def __init__(self, hexdigest: str) -> None:
        self._h = hexdigest

    def hexdigest(self) -> str:
        return self._h


def tree_digest(tree: dict) -> str:
    """The *tree digest* of a safetensors shard: SHA-256 of the canonical JSON
    ``{"header_sha256": …, "tensors": [[name, sha256 of its bytes], …]}`` in file order. Unlike a
    whole-file SHA-256 it can be computed for shards whose unchanged tensors were copied
    server-side (from the base tensors' digests), and it identifies the same bytes."""
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def server_side_copy(storage: Storage, out_storage: Storage, base_uri: str, out_prefix: str) -> bool:
    """True when unchanged base bytes can be copied by the store itself (S3 UploadPartCopy):
    base and output on the same S3 endpoint."""
    from mergepipe.storage.base import is_s3

    if not (is_s3(base_uri) and is_s3(out_prefix)):
        return False
    src = storage.backend(base_uri) if hasattr(storage, "backend") else storage
    dst = out_storage.backend(out_prefix) if hasattr(out_storage, "backend") else out_storage
    return src is dst or getattr(src, "endpoint_url", 0) == getattr(dst, "endpoint_url", 1)


class _ByteQueue:
    """A FIFO of ``(message, nbytes)`` bounded by the bytes it holds (a message counts from
    :meth:`put` until the consumer calls :meth:`done`). One message larger than the bound is
    let through when the queue is empty. :meth:`fail` (consumer died or producer gave up)
    releases every waiter: puts return at once, :meth:`get` returns ``(None, 0)``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.items: deque = deque()
        self.cv = threading.Condition()
        self.failed = False

    def put(self, msg, nbytes: int = 0) -> None:
        with self.cv:
            while not self.failed and self.used > 0 and self.used + nbytes > self.limit:
                self.cv.wait()
            if self.failed:
                return
            self.used += nbytes
            self.items.append((msg, nbytes))
            self.cv.notify_all()

    def get(self):
        with self.cv:
            while not self.items and not self.failed:
                self.cv.wait()
            if self.failed:
                return None, 0
            return self.items.popleft()

    def done(self, nbytes: int) -> None:
        with self.cv:
            self.used -= nbytes
            self.cv.notify_all()

    def fail(self) -> None:
        with self.cv:
            self.failed = True
            self.items.clear()
            self.cv.notify_all()


class _Item:
    """One unit of work: a row chunk of a tensor (``kind`` merge or stats) or a copy range."""

    __slots__ = ("kind", "tp", "r0", "r1", "future", "nbytes")

    def __init__(self, kind: str, tp: TensorPlan, r0: int, r1: int, nbytes: int) -> None:
        self.kind, self.tp, self.r0, self.r1, self.nbytes = kind, tp, r0, r1, nbytes
        self.future = None


def _nbytes(buf) -> int:
    return memoryview(buf).nbytes


def _row_bytes(tp: TensorPlan, itemsize: int) -> int:
    return row_numel_of(tp.shape) * itemsize


def _chunk_runs(te, rpb: int, r0: int, r1: int, rows: int) -> list[tuple[int, int]]:
    """Row ranges of an expert's selected blocks inside rows ``[r0, r1)``."""
    out = []
    for b0, b1 in te.blocks:
        a, b = max(r0, b0 * rpb), min(r1, b1 * rpb, rows)
        if b > a:
            out.append((a, b))
    return out


def default_compute_threads() -> int:
    """torch intra-op threads for the merge arithmetic: one core is left to the reader and
    writer threads (decoding, hashing, syscalls). On 2 cores this is 1: measured, two OpenMP
    threads spinning against the I/O threads made a 3-expert merge 2.6x slower
    (docs/BENCHMARKS.md). ``MERGEPIPE_COMPUTE_THREADS`` overrides it."""
    env = os.environ.get("MERGEPIPE_COMPUTE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def execute(plan: Plan, storage: Storage, out_storage: Storage, out_prefix: str, *,
            compute_threads: int | None = None, **kw) -> ExecResult:
    """Execute ``plan`` (see :func:`_execute` for the arguments) with ``compute_threads`` torch
    intra-op threads (default :func:`default_compute_threads`), restoring the setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(compute_threads or default_compute_threads())
    try:
        return _execute(plan, storage, out_storage, out_prefix, **kw)
    finally:
        torch.set_num_threads(before)


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
) -> ExecResult:
    """Execute ``plan``, writing the output shards and index under ``out_prefix``.

    Args:
        storage: where the base and experts are read (bytes counted by role).
        out_storage: where outputs are written (``out_prefix`` is a staging location: the
            commit step makes it visible).
        device: torch device for the merge arithmetic (``cpu``, ``cuda``, ``cuda:1``...).
        prefetch_bytes: bound on bytes fetched ahead of the merge.
        progress: called with the output bytes produced after each chunk.

    Raises:
        InputError: inputs changed since planning; unusable device.
        RuntimeError: realized expert bytes exceeded the plan (a bug; nothing is committed).
    """
    import torch

    t0 = time.perf_counter()
    spec = get_method(plan.method)
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine; use --device cpu.")
    except RuntimeError as e:
        raise InputError(f"--device {device}: {e}") from None
    verify_inputs(plan, storage)
    read_before = storage.counters.snapshot()["read"]
    res = ExecResult()
    expert_uri = {i: e.uri for i, e in enumerate(plan.experts)}

    # ---- work list ------------------------------------------------------------------------
    from mergepipe.formats.safetensors import DTYPES

    cow = server_side_copy(storage, out_storage, plan.base.uri, out_prefix)
    items: list[_Item] = []
    for tp in plan.tensors:
        itemsize = DTYPES[tp.dtype][0]
        rows = tp.shape[0] if tp.shape else 1
        rb = _row_bytes(tp, itemsize)
        if tp.copy_base and tp.out_dtype and tp.out_dtype != tp.dtype:
            for r0 in range(0, rows, tp.chunk_rows):  # same values, another dtype: decode + encode
                r1 = min(rows, r0 + tp.chunk_rows)
                items.append(_Item("convert", tp, r0, r1, (r1 - r0) * rb))
            continue
        if tp.copy_base and cow and tp.base_sha256 and rows * rb >= COW_MIN_BYTES:
            items.append(_Item("cow", tp, 0, rows, 0))  # server-side copy: nothing read here
            continue
        if tp.copy_base:
            nbytes = rows * rb
            step = max(1, COPY_CHUNK // max(1, rb))
            for r0 in range(0, max(rows, 1), step):
                items.append(_Item("copy", tp, r0, min(rows, r0 + step), min(rows, r0 + step) * rb - r0 * rb))
            if not tp.shape or nbytes == 0:
                items[-1].r1 = rows
            continue
        kinds = ["stats", "merge"] if tp.passes == 2 else ["merge"]
        for kind in kinds:
            for r0 in range(0, rows, tp.chunk_rows):
                r1 = min(rows, r0 + tp.chunk_rows)
                items.append(_Item(kind, tp, r0, r1, (r1 - r0) * rb * (1 + len(tp.experts))))

    def fetch(it: _Item):
        if it.kind == "cow":
            return b"", None
        tp = it.tp
        itemsize = DTYPES[tp.dtype][0]
        rb = _row_bytes(tp, itemsize)
        rows = tp.shape[0] if tp.shape else 1
        base_uri = storage.join(plan.base.uri, tp.file)
        s, e = tp.start + it.r0 * rb, tp.start + it.r1 * rb
        base_raw = storage.read_ranges(base_uri, [(s, e)], "base")[0] if e > s else b""
        if it.kind in ("copy", "convert"):
            return base_raw, None
        exp = []
        for te in tp.experts:
            runs = _chunk_runs(te, tp.rows_per_block, it.r0, it.r1, rows)
            rngs = [(te.start + a * rb, te.start + b * rb) for a, b in runs]
            bufs = storage.read_ranges(storage.join(expert_uri[te.expert], te.file), rngs, "expert",
                                       max_gap=plan.coalesce_gap)
            exp.append(list(zip(runs, bufs)))
        return base_raw, exp

    # ---- writer thread ---------------------------------------------------------------------
    # The writer thread does all hashing (hashlib releases the GIL, so on a multi-core machine it
    # runs beside the merge arithmetic): the base tensors' SHA-256 (checked against the catalog)
    # and each output tensor's SHA-256 (the shard's tree digest). Every output byte is hashed
    # once, and a copied tensor's bytes once for both its base and output digests.
    wq = _ByteQueue(max(COPY_CHUNK, prefetch_bytes // 4))
    werr: list[BaseException] = []
    writers: dict[str, HashingWriter] = {}
    base_sha: dict[str, hashlib._Hash] = {}
    out_sha: dict[str, object] = {}
    tree: dict[str, dict] = {}

    def writer_loop():
        cur = None
        try:
            while True:
                msg, nb = wq.get()
                if msg is None:
                    break
                op, arg = msg
                if op == "open":
                    name, hdr = arg
                    # shards are identified by their tree digest (header + per-tensor SHA-256s), which
                    # hashes each output byte once; a whole-file SHA-256 would be a second pass
                    cur = HashingWriter(out_storage.open_writer(out_storage.join(out_prefix, name), "output"), hash=False)
                    writers[name] = cur
                    tree[name] = {"header_sha256": hashlib.sha256(hdr).hexdigest(), "tensors": []}
                    cur.write(hdr)
                elif op == "base":
                    name, data = arg
                    base_sha.setdefault(name, hashlib.sha256()).update(data)
                elif op == "data":
                    name, data = arg
                    out_sha.setdefault(name, hashlib.sha256()).update(data)
                    cur.write(data)
                elif op == "copy":
                    name, known, (src, s0, s1) = arg
                    out_sha[name] = _KnownHash(known)
                    cur.inner.copy_range(src, s0, s1)
                    cur.size += s1 - s0
                    cur.copied = True
                elif op == "tensor_end":
                    tp, copied = arg
                    h = out_sha[tp.name]
                    if copied:  # the output bytes are the base bytes
                        base_sha[tp.name] = h
                    if tp.base_sha256 and tp.name in base_sha and base_sha[tp.name].hexdigest() != tp.base_sha256:
                        raise InputError(
                            f"{storage.join(plan.base.uri, tp.file)}: tensor {tp.name!r} of the base changed since it "
                            "was analyzed (content hash differs); re-run the merge to re-analyze it."
                        )
                    tree[tp.file]["tensors"].append([tp.name, h.hexdigest()])
                elif op == "close":
                    name = arg
                    w = writers[name]
                    size = w.inner.close()
                    res.files[name] = {"size": size, "tree_sha256": tree_digest(tree[name])}
                wq.done(nb)
        except BaseException as e:  # surfaced to the main thread
            werr.append(e)
            wq.fail()  # the producer never blocks on a dead consumer

    wt = threading.Thread(target=writer_loop, name="mergepipe-writer", daemon=True)
    wt.start()

    def put(msg, nbytes: int = 0):
        if werr:
            raise werr[0]
        wq.put(msg, nbytes)
        if werr:
            raise werr[0]

    # ---- main loop -------------------------------------------------------------------------
    shard_tensors: dict[str, list[TensorPlan]] = {}
    for tp in plan.tensors:
        shard_tensors.setdefault(tp.file, []).append(tp)
    last_item_of_shard = {}
    for i, it in enumerate(items):
        last_item_of_shard[it.tp.file] = i
    first_item_of_shard = {}
    for i, it in enumerate(items):
        first_item_of_shard.setdefault(it.tp.file, i)

    l1_all: dict[tuple[str, int], list[float]] = {}
    l1_kept: dict[tuple[str, int], list[float]] = {}
    pool = ThreadPoolExecutor(read_threads, thread_name_prefix="mergepipe-fetch")
    pending: deque[_Item] = deque()
    nxt = 0
    inflight = 0
    try:
        for i, it in enumerate(items):
            while nxt < len(items) and (nxt <= i or inflight + items[nxt].nbytes <= prefetch_bytes):
                items[nxt].future = pool.submit(fetch, items[nxt])
                inflight += items[nxt].nbytes
                pending.append(items[nxt])
                nxt += 1
            base_raw, exp = it.future.result()
            pending.popleft()
            it.future = None
            tp = it.tp
            if i == first_item_of_shard.get(tp.file):
                hdr = build_header(
                    [(t.name, t.out_dtype or t.dtype, tuple(t.shape)) for t in shard_tensors[tp.file]],
                    plan.shard_metadata.get(tp.file, {}),
                )
                put(("open", (tp.file, hdr)), len(hdr))
            copied = it.kind in ("copy", "cow")
            if it.kind == "cow":
                rb = _row_bytes(tp, DTYPES[tp.dtype][0])
                rows = tp.shape[0] if tp.shape else 1
                put(("copy", (tp.name, tp.base_sha256, (storage.join(plan.base.uri, tp.file), tp.start,
                                                         tp.start + rows * rb))))
                if progress:
                    progress(rows * rb)
            elif it.kind == "copy":
                put(("data", (tp.name, base_raw)), _nbytes(base_raw))
                if progress:
                    progress(_nbytes(base_raw))
            else:
                if it.kind != "stats":
                    put(("base", (tp.name, base_raw)), _nbytes(base_raw))
                out = _merge_chunk(it, base_raw, exp, plan, spec, dev, l1_all, l1_kept)
                if out is not None:
                    put(("data", (tp.name, out)), _nbytes(out))
                    if progress:
                        progress(_nbytes(out))
            # the chunk's input bytes are released now (not when its fetch finished), so inputs
            # in memory, in flight or being merged, stay within prefetch_bytes
            inflight -= it.nbytes
            base_raw = exp = out = None
            last_of_tensor = i + 1 == len(items) or items[i + 1].tp is not tp
            if last_of_tensor:
                put(("tensor_end", (tp, copied)))
            if i == last_item_of_shard.get(tp.file):
                put(("close", tp.file))
        put(None)
        wt.join()
        if werr:
            raise werr[0]
    except BaseException:
        wq.fail()
        wt.join(timeout=60)
        for f, w in writers.items():
            if f not in res.files:
                w.inner.abort()
        for p in pending:
            if p.future is not None:
                p.future.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    # ---- index ------------------------------------------------------------------------------
    if len(shard_tensors) > 1 or plan.index_metadata or any(f != "model.safetensors" for f in shard_tensors):
        from mergepipe.formats.safetensors import DTYPES as _D

        total = sum(int(np.prod(t.shape)) * _D[t.out_dtype or t.dtype][0] for t in plan.tensors)
        idx = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: t.file for t in sorted(plan.tensors, key=lambda t: t.name)},
        }
        data = (json.dumps(idx, indent=2, sort_keys=True) + "\n").encode()
        w = HashingWriter(out_storage.open_writer(out_storage.join(out_prefix, INDEX_NAME), "output"))
        w.write(data)
        res.files[INDEX_NAME] = {"size": w.inner.close(), "sha256": w.sha.hexdigest()}

    # ---- non-weight files (config, tokenizer) from the base ------------------------------------
    for f in plan.extra_files:
        src = storage.join(plan.base.uri, f)
        try:
            data = storage.read_object(src, "base")
        except NotFoundError:
            continue
        if f == "config.json" and plan.out_dtype:
            data = _config_with_dtype(data, plan.out_dtype)
        w = HashingWriter(out_storage.open_writer(out_storage.join(out_prefix, f), "output"))
        w.write(data)
        res.files[f] = {"size": w.inner.close(), "sha256": w.sha.hexdigest()}

    res.counters = storage.counters.snapshot() if storage.counters is out_storage.counters else {
        "read": storage.counters.snapshot()["read"], "written": out_storage.counters.snapshot()["written"],
        "copied": out_storage.counters.snapshot()["copied"],
    }
    realized = res.counters["read"].get("expert", 0) - read_before.get("expert", 0)
    if realized > plan.io.expert_read_bytes:
        raise RuntimeError(
            f"realized expert bytes {realized} exceed the planned {plan.io.expert_read_bytes}: refusing to "
            "commit (this is a mergepipe bug; please report it with the plan)."
        )
    for tp in plan.tensors:
        for te in tp.experts:
            nm = plan.experts[te.expert].name
            res.touched_blocks[nm] = res.touched_blocks.get(nm, 0) + sum(b - a for a, b in te.blocks)
    res.base_tensor_sha256 = {k: v.hexdigest() for k, v in base_sha.items()}
    for it in items:
        if it.kind == "cow":
            res.base_tensor_sha256[it.tp.name] = it.tp.base_sha256
    res.wall_s = time.perf_counter() - t0
    return res


def _config_with_dtype(data: bytes, out_dtype: str) -> bytes:
    """``config.json`` with ``torch_dtype`` (and ``dtype``, newer transformers) set to the output
    dtype, as mergekit writes it; unparseable configs are copied unchanged."""
    from mergepipe.formats.safetensors import DTYPES

    try:
        cfg = json.loads(data)
    except ValueError:
        return data
    if not isinstance(cfg, dict):
        return data
    name = DTYPES[out_dtype][1]
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


#: elements per tile of the tiled elementwise path: the float32 temporaries of one tile (~K + 6
#: arrays of 256 KiB) stay in the CPU caches, and each torch call is still long enough that its
#: dispatch overhead (~µs) is small next to its work. Measured on the 2-core Xeon (CPU time per
#: element of a TIES chunk, docs/BENCHMARKS.md): 64Ki elements beat 32Ki, 128Ki and 256Ki at K = 2
#: and 8 (K = 8: 27, 24, 34, 36 ns).
TILE_ELEMS = 1 << 16


def _elementwise(tp, spec) -> bool:
    """The merge of this tensor runs tile by tile (:func:`mergepipe.methods.kernels.elementwise_merge`)."""
    return elementwise_merge(spec, tp.params, [te.density for te in tp.experts], tp.dtype)


def _raw_tensor(raw, dtype: str):
    """Zero-copy torch view of little-endian safetensors bytes (BF16, F16, F32)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # read-only buffers: the view is only read
        warnings.simplefilter("ignore")
        return torch.frombuffer(raw, dtype=_torch_dtype(dtype))


def _merge_chunk_tiled(it, base_raw, exp, plan, spec, dev):
    """Elementwise merge of one row chunk, ``TILE_ELEMS`` elements at a time (see
    :func:`_elementwise`). Inputs stay in their storage dtype until a tile is widened to
    float32, so the chunk holds its raw bytes, the output and one tile's temporaries instead of
    K + 1 float32 copies of the chunk. Same arithmetic per element as :func:`_merge_chunk`
    (every operation is elementwise), hence the same bytes. Returns the output bytes (a
    ``memoryview`` of the encoded tensor)."""
    import torch

    tp = it.tp
    from mergepipe.formats.safetensors import DTYPES

    n = memoryview(base_raw).nbytes // DTYPES[tp.dtype][0]
    row_numel = row_numel_of(tp.shape)
    offset = it.r0 * row_numel
    base_t = _raw_tensor(base_raw, tp.dtype).to(dev)
    eparts = []  # per expert: (params, [(elem0, elem1, raw view)])
    for te, parts in zip(tp.experts, exp):
        ep = ExpertTensorParams(weight=te.weight, density=te.density, min_key=te.min_key, stream_key=te.stream_key,
                                max_key=te.max_key, epsilon=te.epsilon)
        runs = [((a - it.r0) * row_numel, (z - it.r0) * row_numel, _raw_tensor(buf, tp.dtype).to(dev))
                for (a, z), buf in parts if z > a]
        eparts.append((ep, runs))
    out = torch.empty(n, dtype=_torch_dtype(tp.out_dtype or tp.dtype), device=dev)
    ws = [ep.weight for ep, _ in eparts]
    for s in range(0, n, TILE_ELEMS):
        e = min(n, s + TILE_ELEMS)
        b = base_t[s:e].float()  # (F32: a read-only view; nothing below writes into the base)
        deltas = []
        for ep, runs in eparts:
            d = None
            for a, z, x in runs:
                lo, hi = max(a, s), min(z, e)
                if hi <= lo:
                    continue
                if lo == s and hi == e:
                    d = torch.sub(x[lo - a:hi - a], b)  # widened exactly to float32, then subtracted
                    break
                if d is None:
                    d = torch.zeros_like(b)
                d[lo - s:hi - s] = torch.sub(x[lo - a:hi - a], b[lo - s:hi - s])
            if d is None:
                d = torch.zeros_like(b)
            deltas.append(sparsify(d, spec, ep, offset + s, tp.shape))
        out[s:e].copy_(combine(b, deltas, ws, spec, tp.params, weight_sum=tp.weight_sum, consume=True))
    return memoryview(out.cpu().view(torch.uint8).numpy()) if n else b""



def _merge_chunk(it, base_raw, exp, plan, spec, dev, l1_all, l1_kept):
    """Merge one row chunk; for ``stats`` items only accumulate L1 sums and return None. Uses
    only the plan's per-tensor parameters (``tp.params``, ``TensorExpert`` fields, ``tp.derived``)."""
    import math

    import torch

    tp = it.tp
    if it.kind == "merge" and _elementwise(tp, spec) and len(base_raw):
        return _merge_chunk_tiled(it, base_raw, exp, plan, spec, dev)
    b = torch.from_numpy(decode(base_raw, tp.dtype)).to(dev)
    if b.dtype != torch.float32:
        b = b.float()
    out_dtype = tp.out_dtype or tp.dtype
    if it.kind == "convert":
        return _encode(b, out_dtype)
    row_numel = row_numel_of(tp.shape)
    offset = it.r0 * row_numel
    keep_x = spec.kind == "slerp"
    present = {}
    for te, parts in zip(tp.experts, exp):
        d = torch.zeros_like(b)
        xf = b.clone() if keep_x else None
        for (a, z), buf in parts:
            x = torch.from_numpy(decode(buf, tp.dtype)).to(dev).float()
            sl = slice((a - it.r0) * row_numel, (z - it.r0) * row_numel)
            d[sl] = x - b[sl]
            if xf is not None:
                xf[sl] = x
        present[te.expert] = (te, d, xf)
    K = len(plan.experts)
    if spec.kind == "model_stock":
        ds = [present[i][1] if i in present else torch.zeros_like(b) for i in range(K)]
        t = None if tp.params.get("filter_wise") else tp.derived["t"]
        return _encode(model_stock_merge(b, ds, t, filter_width(tp.shape)), out_dtype)
    if spec.kind == "slerp":
        e = present[0][2] if 0 in present else b
        return _encode(slerp_merge(b, e, tp.derived["c_base"], tp.derived["c_expert"]), out_dtype)
    if spec.kind == "nuslerp":
        d0, d1 = (present[i][1] if i in present else torch.zeros_like(b) for i in range(2))
        dv = tp.derived
        coef = (dv["a"], dv["b"], dv["s"]) if "a" in dv else None
        return _encode(nuslerp_merge(b, d0, d1, coef, filter_width(tp.shape), t=dv["t"]), out_dtype)
    rescale = bool(tp.params.get("rescale")) and spec.kind == "gta" and spec.sparsify != "none"
    deltas, ws = [], []
    for te, d, _ in present.values():
        ep = ExpertTensorParams(weight=te.weight, density=te.density, min_key=te.min_key, stream_key=te.stream_key,
                                max_key=te.max_key, epsilon=te.epsilon)
        kept = sparsify(d, spec, ep, offset, tp.shape)
        key = (tp.name, te.expert)
        if rescale and ep.density < 1.0:
            if it.kind == "stats":
                l1_all.setdefault(key, []).extend(l1_row_sums(d, row_numel))
                l1_kept.setdefault(key, []).extend(l1_row_sums(kept, row_numel))
                continue
            if tp.passes == 2:
                f = rescale_factor(math.fsum(l1_all[key]), math.fsum(l1_kept[key]))
            else:
                f = rescale_factor(l1_rows(d, row_numel), l1_rows(kept, row_numel))
            if f != 1.0:
                kept = kept * f
        deltas.append(kept)
        ws.append(ep.weight)
    if it.kind == "stats":
        return None
    out = combine(b, deltas, ws, spec, tp.params, weight_sum=tp.weight_sum)
    return _encode(out, out_dtype)
