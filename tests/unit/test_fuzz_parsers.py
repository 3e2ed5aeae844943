"""Property-based fuzzing (hypothesis) of the parsers that read untrusted bytes (issue 12 item 7):
safetensors headers, shard indexes, mergekit YAML configs, JSON/byte-quantity parameters and the
path policy. Each parser either returns a valid result or raises ``InputError``; nothing else
(no RecursionError, OverflowError, KeyError, TypeError, MemoryError).

Time bound: ``MERGEPIPE_FUZZ_EXAMPLES`` examples per property (default 150; about 10 s for the
file in total on the 2-core CI machine; raise it for a longer local campaign) and no per-example
deadline (the machine is shared)."""

import json
import math
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mergepipe.errors import InputError
from mergepipe.storage.base import NotFoundError, ObjectStat, Storage

N = int(os.environ.get("MERGEPIPE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=30,
)

dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F12", "", "f32"])
shapes = st.lists(st.integers(min_value=-2, max_value=2**70), max_size=5) | json_values
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": dtypes | json_values,
        "shape": shapes,
        "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**66), max_size=3) | json_values,
    },
)
headers = st.dictionaries(st.text(max_size=12), entries | json_values, max_size=6)


class DictStorage(Storage):
    """Objects in a dict: enough of the storage protocol for ``load_layout``."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__()
        self.objects = objects

    def stat(self, uri):
        if uri not in self.objects:
            raise NotFoundError(uri)
        return ObjectStat(len(self.objects[uri]), "1")

    def _fetch(self, uri, requests):
        if uri not in self.objects:
            raise NotFoundError(uri)
        return [self.objects[uri][s:e] for s, e in requests]

    def list(self, prefix):
        return iter(sorted(u for u in self.objects if u.startswith(prefix)))

    def open_writer(self, uri, role="output"):
        raise NotImplementedError

    def put_object(self, uri, data, role="output", *, if_none_match=False):
        raise NotImplementedError

    def delete(self, uri):
        raise NotImplementedError


def _shard(header_obj, data_len: int = 64) -> bytes:
    h = json.dumps(header_obj).encode()
    return struct.pack("<Q", len(h)) + h + b"\0" * data_len


@FUZZ
@given(header=headers, data_len=st.integers(min_value=0, max_value=256))
def test_parse_header_structured(header, data_len):
    from mergepipe.formats.safetensors import DTYPES, parse_header

    raw = _shard(header, data_len)
    try:
        h = parse_header(raw, "x.safetensors", len(raw))
    except InputError:
        return
    pos = h.data_start
    for t in sorted(h.tensors.values(), key=lambda t: t.start):  # an accepted header is sound
        assert t.start == pos and t.end - t.start == math.prod(t.shape) * DTYPES[t.dtype][0]
        pos = t.end
    assert pos == len(raw)


@FUZZ
@given(raw=st.binary(max_size=300), n=st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)))
def test_parse_header_bytes(raw, n):
    from mergepipe.formats.safetensors import parse_header

    if n is not None:
        raw = struct.pack("<Q", n) + raw
    try:
        parse_header(raw, "x.safetensors", len(raw))
    except InputError:
        pass


@FUZZ
@given(
    index=json_values
    | st.fixed_dictionaries(
        {
            "weight_map": st.dictionaries(
                st.text(max_size=8),
                st.sampled_from(["a.safetensors", "../a.safetensors", "/a", "a/b", "", "."]) | json_values,
                max_size=4,
            )
        },
        optional={"metadata": json_values},
    )
)
def test_load_layout_index(index):
    from mergepipe.formats.safetensors import INDEX_NAME, load_layout

    shard = _shard({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8)
    s = DictStorage({f"s3://b/m/{INDEX_NAME}": json.dumps(index).encode(), "s3://b/m/a.safetensors": shard})
    try:
        lay = load_layout(s, "s3://b/m")
    except InputError:
        return
    assert lay.tensors and all(f == "a.safetensors" for f in lay.shards)


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_loads_json_never_crashes(raw):
    from mergepipe.limits import loads_json

    try:
        loads_json(raw, "f.json")
    except InputError:
        pass


yaml_texts = st.text(alphabet=st.sampled_from(list("ab:&*-[]{},'\"\n #!|>?%@`0.")), max_size=120) | json_values.map(
    lambda v: json.dumps({"merge_method": "ties", "base_model": v, "models": [{"model": v}]})
)


@FUZZ
@given(text=yaml_texts)
def test_load_config_never_crashes(text, tmp_path_factory):
    from mergepipe.config import load_config

    p = tmp_path_factory.mktemp("cfg") / "merge.yml"
    p.write_text(text)
    try:
        load_config(p)
    except InputError:
        pass


@FUZZ
@given(text=st.text(max_size=30) | st.integers().map(str) | st.floats().map(str))
def test_parse_bytes(text):
    from mergepipe.pipeline import parse_block_size, parse_bytes

    try:
        v = parse_bytes(text, total=10**12)
    except InputError:
        v = "refused"
    assert v is None or v == "refused" or (isinstance(v, int) and 0 <= v < 2**63)
    try:
        b = parse_block_size(text)
    except InputError:
        return
    assert 1 <= b <= 1 << 30


@FUZZ
@given(
    name=st.text(max_size=40)
    | st.lists(st.sampled_from(["..", ".", "", "a", "b.c", "/", "\\"]), max_size=5).map("/".join)
)
def test_check_name_keeps_joins_under_the_root(name):
    import posixpath

    from mergepipe.paths import check_name

    try:
        check_name(name, "fuzz")
    except InputError:
        return
    joined = posixpath.normpath(posixpath.join("/data/prefix", name))
    assert joined.startswith("/data/prefix/") and joined == "/data/prefix/" + name


@FUZZ
@given(value=json_values.map(json.dumps))
def test_param_values_never_crash(value):
    from mergepipe.methods.params import resolve_params

    try:
        resolve_params("ties", {"density": value}, [{}])
    except InputError:
        pass


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deep_nesting_is_refused_not_recursed(depth):
    from mergepipe.formats.safetensors import parse_header
    from mergepipe.limits import loads_json

    doc = "[" * depth + "]" * depth
    with pytest.raises(InputError, match="nested"):
        loads_json(doc, "f.json")
    raw = struct.pack("<Q", len(doc)) + doc.encode()
    with pytest.raises(InputError, match="nested"):
        parse_header(raw, "x.safetensors", len(raw))
