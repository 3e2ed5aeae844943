"""safetensors layout: header parsing and validation, shard indexes, byte ranges of row blocks.

Format (huggingface/safetensors README): 8 bytes little-endian u64 ``N``; ``N`` bytes of UTF-8
JSON mapping tensor name -> ``{"dtype", "shape", "data_offsets": [begin, end)}`` plus an
optional ``"__metadata__"`` string map; then the raw little-endian, C-order data. Offsets are
relative to byte ``8 + N``. The header is capped at 100 MB (as in the reference loader).

Everything here works on bytes and :class:`~mergepipe.storage.base.Storage` URIs, never loads
tensors, and needs no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from mergepipe.errors import InputError
from mergepipe.limits import MAX_INDEX_BYTES, loads_json, short_repr
from mergepipe.paths import check_name
from mergepipe.storage.base import NotFoundError

#: largest header the reference implementation accepts (bytes)
MAX_HEADER_BYTES = 100_000_000
#: deepest JSON nesting of a header (it needs 3: object -> entry -> shape list)
MAX_HEADER_DEPTH = 4
#: most dimensions of a tensor (torch's limit is 64)
MAX_RANK = 64
#: largest tensor (bytes) a shape may describe, its empty dimensions counted as 1
MAX_TENSOR_BYTES = 2**63 - 1
#: longest tensor name (characters)
MAX_TENSOR_NAME = 1024

#: dtype name -> (itemsize in bytes, torch dtype attribute name, numpy dtype string or None)
DTYPES: dict[str, tuple[int, str, str | None]] = {
    "F64": (8, "float64", "<f8"),
    "F32": (4, "float32", "<f4"),
    "F16": (2, "float16", "<f2"),
    "BF16": (2, "bfloat16", None),
    "I64": (8, "int64", "<i8"),
    "I32": (4, "int32", "<i4"),
    "I16": (2, "int16", "<i2"),
    "I8": (1, "int8", "i1"),
    "U8": (1, "uint8", "u1"),
    "BOOL": (1, "bool", "?"),
    "F8_E4M3": (1, "float8_e4m3fn", None),
    "F8_E5M2": (1, "float8_e5m2", None),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one shard file.

    Attributes:
        name: tensor name.
        dtype: safetensors dtype name (a key of :data:`DTYPES`).
        shape: tensor shape.
        file: shard file name relative to the checkpoint root.
        start: absolute byte offset of the first data byte in the file.
        end: absolute byte offset one past the last data byte.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def rows(self) -> int:
        """Rows along the first dimension; a 1-D tensor has one row per element, a scalar 1."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes per row (``prod(shape[1:]) * itemsize``; the itemsize for 1-D tensors)."""
        return (math.prod(self.shape[1:]) if len(self.shape) > 1 else 1) * self.itemsize

    def row_range(self, r0: int, r1: int) -> tuple[int, int]:
        """Absolute byte range ``[start, end)`` of rows ``[r0, r1)``."""
        if not 0 <= r0 <= r1 <= self.rows:
            raise ValueError(f"{self.name}: rows [{r0}, {r1}) outside [0, {self.rows})")
        return self.start + r0 * self.row_bytes, self.start + r1 * self.row_bytes


@dataclass(frozen=True)
class Block:
    """A row block: rows ``[row0, row1)`` of one tensor, the unit of cataloguing and planning."""

    tensor: str
    index: int
    row0: int
    row1: int


def rows_per_block(info: TensorInfo, block_bytes: int) -> int:
    """Rows per block so that a block is at most ``block_bytes`` bytes (at least one row)."""
    return max(1, block_bytes // max(1, info.row_bytes))


def iter_blocks(info: TensorInfo, block_bytes: int) -> Iterator[Block]:
    """Split a tensor into row blocks of at most ``block_bytes`` bytes (whole rows; a row longer
    than ``block_bytes`` is one block). The last block may be shorter."""
    rpb = rows_per_block(info, block_bytes)
    for i, r0 in enumerate(range(0, info.rows, rpb)):
        yield Block(info.name, i, r0, min(info.rows, r0 + rpb))


def n_blocks(info: TensorInfo, block_bytes: int) -> int:
    rpb = rows_per_block(info, block_bytes)
    return max(1, -(-info.rows // rpb)) if info.rows else 1


@dataclass
class ShardHeader:
    """A parsed, validated safetensors header of one shard file.

    Attributes:
        file: shard file name relative to the checkpoint root.
        header_len: ``N``, the JSON header length in bytes.
        data_start: ``8 + N``, absolute offset of the data section.
        file_size: size of the file in bytes.
        tensors: name -> :class:`TensorInfo` in file (offset) order.
        metadata: the ``__metadata__`` map (may be empty).
        header_sha256: SHA-256 hex digest of the raw header bytes (identity input).
    """

    file: str
    header_len: int
    data_start: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_sha256: str


def header_length(prefix: bytes, source: str, file_size: int) -> int:
    """Read ``N`` from the first 8 bytes and check it against the file size and the 100 MB cap.

    Raises:
        InputError: file shorter than 8 bytes, header past end of file, or header too large.
    """
    if len(prefix) < 8 or file_size < 8:
        raise InputError(
            f"{source}: file is {file_size} bytes, shorter than the 8-byte safetensors length "
            "prefix; the file is truncated or not a safetensors file. Re-export or re-download it."
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise InputError(
            f"{source}: header length {n} bytes exceeds the 100 MB safetensors limit; the file is "
            "corrupt or not a safetensors file."
        )
    if 8 + n > file_size:
        raise InputError(
            f"{source}: header length {n} bytes runs past the end of the file ({file_size} bytes); "
            "the file is truncated. Re-export or re-download it."
        )
    return n


def parse_header(raw: bytes, file: str, file_size: int, source: str | None = None) -> ShardHeader:
    """Parse and validate a safetensors header.

    Args:
        raw: at least the first ``8 + N`` bytes of the file.
        file: shard name relative to the checkpoint root (recorded in :class:`TensorInfo`).
        file_size: total file size in bytes (for bounds checks).
        source: how to name the file in errors (defaults to ``file``).

    Validation: JSON object; every entry has a known dtype, a shape of non-negative ints and
    ``data_offsets`` ``[begin, end]`` with ``end - begin == numel * itemsize``; offsets in
    bounds of the data section; tensors non-overlapping and contiguous (no gaps, as the
    reference writer produces and the reference loader requires); the data section ends
    exactly at the end of the file.

    Raises:
        InputError: naming the file, the tensor and the fix.
    """
    src = source or file
    n = header_length(raw[:8], src, file_size)
    if len(raw) < 8 + n:
        raise InputError(f"{src}: expected {8 + n} header bytes, got {len(raw)}; file truncated.")
    hbytes = bytes(raw[8 : 8 + n])
    obj = loads_json(hbytes, src, max_depth=MAX_HEADER_DEPTH, what="header")
    if not isinstance(obj, dict):
        raise InputError(f"{src}: header JSON is {type(obj).__name__}, expected an object.")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InputError(f"{src}: __metadata__ must be a string map.")
    data_start = 8 + n
    data_len = file_size - data_start
    entries = sorted(_header_entry(src, name, ent, data_len) for name, ent in obj.items())
    tensors = _contiguous_tensors(src, entries, file, data_start, data_len)
    return ShardHeader(
        file=file,
        header_len=n,
        data_start=data_start,
        file_size=file_size,
        tensors=tensors,
        metadata={str(k): str(v) for k, v in meta.items()},
        header_sha256=hashlib.sha256(raw[: 8 + n]).hexdigest(),
    )


def _header_entry(src: str, name: str, ent: object, data_len: int) -> tuple[int, int, str, str, tuple[int, ...]]:
    """One header entry, validated: ``(begin, end, name, dtype, shape)`` (offsets relative to
    the data section of ``data_len`` bytes).

    Raises:
        InputError: not an object, a bad name, an unknown dtype, a bad or impossible shape,
            malformed offsets, a span that is not the shape's size, an end past the data section.
    """
    if not isinstance(ent, dict):
        raise InputError(f"{src}: tensor {short_repr(name)}: entry is not an object.")
    if not name or len(name) > MAX_TENSOR_NAME:
        raise InputError(f"{src}: tensor name {short_repr(name)} is empty or longer than {MAX_TENSOR_NAME} characters.")
    dtype = ent.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InputError(
            f"{src}: tensor {name!r} has unknown dtype {short_repr(dtype)}; supported: {', '.join(DTYPES)}."
        )
    shape = ent.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InputError(f"{src}: tensor {name!r}: shape {short_repr(shape)} is not a list of non-negative ints.")
    if len(shape) > MAX_RANK or math.prod(max(d, 1) for d in shape) * DTYPES[dtype][0] > MAX_TENSOR_BYTES:
        raise InputError(
            f"{src}: tensor {name!r}: shape {short_repr(shape)} is not a tensor any framework can hold (more "
            f"than {MAX_RANK} dimensions, or over 2^63 bytes even without its empty dimensions); the header "
            "is corrupt."
        )
    offs = ent.get("data_offsets")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and o >= 0 for o in offs)
        or offs[1] < offs[0]
    ):
        raise InputError(
            f"{src}: tensor {name!r}: data_offsets {short_repr(offs)} must be [begin, end] with begin <= end."
        )
    expect = math.prod(shape) * DTYPES[dtype][0]
    if offs[1] - offs[0] != expect:
        raise InputError(
            f"{src}: tensor {name!r}: data_offsets span {offs[1] - offs[0]} bytes but shape "
            f"{shape} of {dtype} needs {expect}; the header is corrupt."
        )
    if offs[1] > data_len:
        raise InputError(
            f"{src}: tensor {name!r}: data_offsets end {offs[1]} is past the data section "
            f"({data_len} bytes); the file is truncated. Re-export or re-download it."
        )
    return (offs[0], offs[1], name, dtype, tuple(shape))


def _contiguous_tensors(
    src: str, entries: list[tuple[int, int, str, str, tuple[int, ...]]], file: str, data_start: int, data_len: int
) -> dict[str, TensorInfo]:
    """The entries (sorted by offset) as :class:`TensorInfo` (absolute offsets), checked to
    tile the data section exactly.

    Raises:
        InputError: an overlap, a gap, or a data section longer or shorter than the tensors.
    """
    pos = 0
    tensors: dict[str, TensorInfo] = {}
    for b, e, name, dtype, shape in entries:
        if b < pos:
            raise InputError(f"{src}: tensor {name!r} overlaps the previous tensor (offset {b} < {pos}).")
        if b > pos:
            raise InputError(f"{src}: gap of {b - pos} bytes before tensor {name!r}; offsets must be contiguous.")
        pos = e
        tensors[name] = TensorInfo(name, dtype, shape, file, data_start + b, data_start + e)
    if pos != data_len:
        raise InputError(
            f"{src}: data section is {data_len} bytes but tensors cover {pos}; "
            + ("the file is truncated." if pos > data_len else "trailing bytes after the last tensor.")
        )
    return tensors


def build_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> bytes:
    """Serialize a safetensors header for tensors ``(name, dtype, shape)`` laid out contiguously in
    the given order. The JSON is padded with spaces so the data section starts 8-byte aligned
    (as the reference writer does). Returns ``8 + N`` bytes."""
    obj: dict = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    pos = 0
    for name, dtype, shape in tensors:
        nb = math.prod(shape) * DTYPES[dtype][0]
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nb]}
        pos += nb
    js = json.dumps(obj, separators=(",", ":")).encode()
    js += b" " * ((8 - (len(js) + 8) % 8) % 8)
    return struct.pack("<Q", len(js)) + js


def needs_index_file(files: set[str] | frozenset[str], index_metadata: dict) -> bool:
    """A checkpoint with shard files ``files`` gets a ``model.safetensors.index.json``: several
    shards, a shard not named ``model.safetensors``, or index ``metadata`` to carry over."""
    return len(files) > 1 or bool(index_metadata) or any(f != SINGLE_NAME for f in files)


def index_json(weight_map: dict[str, str], total_size: int) -> bytes:
    """The bytes of the ``model.safetensors.index.json`` the engine writes: ``weight_map``
    (tensor name -> shard file) sorted by name and ``metadata.total_size`` (bytes of tensor data,
    headers excluded), indented JSON with a final newline. The planner sizes the output with it."""
    idx = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(idx, indent=2, sort_keys=True) + "\n").encode()


def config_with_dtype(data: bytes, dtype: str) -> bytes:
    """``config.json`` bytes with ``torch_dtype`` (and ``dtype``, newer transformers) set to the
    safetensors dtype ``dtype``'s torch name (``BF16`` -> ``bfloat16``), as mergekit writes a
    merged model's config; unparseable configs (or not a JSON object) are returned unchanged."""
    try:
        cfg = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to parse
        return data
    if not isinstance(cfg, dict):
        return data
    name = DTYPES[dtype][1]
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


@dataclass
class CheckpointLayout:
    """Where every tensor of a Hugging Face checkpoint lives.

    Attributes:
        root: checkpoint URI (folder path or ``s3://`` prefix).
        shards: shard file name -> :class:`ShardHeader`, in index order.
        tensors: tensor name -> :class:`TensorInfo`, in checkpoint order (shard, then offset).
        index_metadata: ``metadata`` of ``model.safetensors.index.json`` (``{}`` if single file).
        sharded: True when the checkpoint uses an index.
    """

    root: str
    shards: dict[str, ShardHeader]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    index_metadata: dict = field(default_factory=dict)
    sharded: bool = False

    def identity_material(self) -> dict:
        """The inputs of a checkpoint identity digest: per shard its size and header hash."""
        return {
            name: {"size": sh.file_size, "header_sha256": sh.header_sha256} for name, sh in sorted(self.shards.items())
        }

    @property
    def total_bytes(self) -> int:
        return sum(sh.file_size for sh in self.shards.values())


def read_shard_header(storage, uri: str, file: str, role: str, size: int | None = None) -> ShardHeader:
    """Read and parse one shard's header through ``storage`` (a speculative 64 KiB read first,
    more only when the header is larger). Bytes are counted under ``role``."""
    try:
        size = storage.stat(uri).size if size is None else size
    except NotFoundError:
        raise InputError(f"{uri}: shard file not found; check the path or the index's weight_map.") from None
    first = storage.read_range(uri, 0, min(size, 65536), role) if size else b""
    n = header_length(first[:8], uri, size)
    raw = first if 8 + n <= len(first) else first + storage.read_range(uri, len(first), 8 + n, role)
    return parse_header(raw, file, size, source=uri)


def load_layout(storage, root: str, role: str = "other") -> CheckpointLayout:  # noqa: C901 - untrusted index + headers: one check per refusal, each naming the file and the fix
    """Read a checkpoint's shard index (if any) and every shard header.

    Raises:
        InputError: no ``model.safetensors`` nor index; invalid index JSON; index naming a
            missing shard; a tensor listed in the index missing from its shard; any header error.
    """
    idx_uri = storage.join(root, INDEX_NAME)
    try:
        idx_raw = storage.read_object(idx_uri, role, MAX_INDEX_BYTES)
    except NotFoundError:
        idx_raw = None
    if idx_raw is None:
        single = storage.join(root, SINGLE_NAME)
        if not storage.exists(single):
            raise InputError(
                f"{root}: no {SINGLE_NAME} and no {INDEX_NAME}; point at a Hugging Face checkpoint "
                "folder saved with safetensors (save_pretrained(..., safe_serialization=True))."
            )
        sh = read_shard_header(storage, single, SINGLE_NAME, role)
        return CheckpointLayout(root=root, shards={SINGLE_NAME: sh}, tensors=dict(sh.tensors))
    idx = loads_json(idx_raw, idx_uri, max_depth=8, what="shard index")
    weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InputError(
            f"{idx_uri}: not a valid shard index (needs a JSON object with a 'weight_map' map of "
            "tensor names to shard file names)."
        )
    if not weight_map:
        raise InputError(
            f"{idx_uri}: weight_map is empty; the checkpoint lists no tensors, so there is nothing "
            "to merge. Fix or regenerate the index."
        )
    if not isinstance(idx.get("metadata") or {}, dict):
        raise InputError(f"{idx_uri}: metadata must be an object.")
    files: list[str] = []
    seen: set[str] = set()
    for name, f in weight_map.items():
        if f not in seen:
            check_name(f, f"{idx_uri}: weight_map[{short_repr(name)}]", flat=True)
            seen.add(f)
            files.append(f)
    shards: dict[str, ShardHeader] = {}
    for f in sorted(files):
        uri = storage.join(root, f)
        try:
            size = storage.stat(uri).size
        except NotFoundError:
            raise InputError(
                f"{idx_uri}: weight_map names shard {f!r}, which does not exist at {uri}; "
                "the checkpoint is incomplete: copy the missing shard or fix the index."
            ) from None
        shards[f] = read_shard_header(storage, uri, f, role, size=size)
    tensors: dict[str, TensorInfo] = {}
    for f, sh in shards.items():
        for name, ti in sh.tensors.items():
            if name in tensors:
                raise InputError(f"{root}: tensor {name!r} appears in two shards ({tensors[name].file}, {f}).")
            tensors[name] = ti
    for name, f in weight_map.items():
        if name not in tensors or tensors[name].file != f:
            raise InputError(f"{idx_uri}: weight_map maps {name!r} to {f!r} but that shard does not hold it.")
    return CheckpointLayout(
        root=root, shards=shards, tensors=tensors, index_metadata=idx.get("metadata") or {}, sharded=True
    )


def layout_to_dict(layout: CheckpointLayout) -> dict:
    """JSON-able form of a layout (stored in the catalog so merges need not re-read headers)."""
    return {
        "root": layout.root,
        "sharded": layout.sharded,
        "index_metadata": layout.index_metadata,
        "shards": {
            f: {
                "header_len": sh.header_len,
                "file_size": sh.file_size,
                "metadata": sh.metadata,
                "header_sha256": sh.header_sha256,
                "tensors": [[t.name, t.dtype, list(t.shape), t.start, t.end] for t in sh.tensors.values()],
            }
            for f, sh in layout.shards.items()
        },
    }


def layout_from_dict(d: dict, root: str | None = None) -> CheckpointLayout:
    """Inverse of :func:`layout_to_dict`; ``root`` overrides the stored root URI."""
    shards: dict[str, ShardHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for f, s in d["shards"].items():
        check_name(f, "catalog layout: shard", flat=True)
        ts = {n: TensorInfo(n, dt, tuple(shape), f, b, e) for n, dt, shape, b, e in s["tensors"]}
        shards[f] = ShardHeader(
            file=f,
            header_len=s["header_len"],
            data_start=8 + s["header_len"],
            file_size=s["file_size"],
            tensors=ts,
            metadata=s["metadata"],
            header_sha256=s["header_sha256"],
        )
        tensors.update(ts)
    return CheckpointLayout(
        root=root or d["root"],
        shards=shards,
        tensors=tensors,
        index_metadata=d.get("index_metadata") or {},
        sharded=d["sharded"],
    )
