"""Range coalescing (the cost model) and the local filesystem storage."""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mergepipe.storage.base import (
    DEFAULT_MAX_REQUEST,
    ROLES,
    IOCounters,
    NotFoundError,
    PreconditionFailed,
    StorageError,
    coalesce,
    coalesced_cost,
    slice_from_requests,
)
from mergepipe.storage.local import LocalStorage
from mergepipe.storage.routing import open_storage
from testkit.harness import fail_folder_fsync

# --------------------------------------------------------------------------------------------
# coalesce: properties
# --------------------------------------------------------------------------------------------

range_st = st.tuples(st.integers(0, 400), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1]))
ranges_st = st.lists(range_st, max_size=25)


def union(ranges):
    """Sorted, disjoint, non-adjacent components of the union of non-empty ranges."""
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


@settings(max_examples=300, deadline=None)
@given(ranges=ranges_st, max_gap=st.integers(0, 50), max_request=st.integers(1, 120))
def test_coalesce_properties(ranges, max_gap, max_request):
    out = coalesce(ranges, max_gap, max_request)
    # sorted, non-empty, non-overlapping, bounded
    for s, e in out:
        assert 0 <= s < e
        assert e - s <= max_request
    for (s0, e0), (s1, _e1) in zip(out, out[1:]):
        assert e0 <= s1
        gap = s1 - e0
        # consecutive requests are either separated by more than max_gap, or are pieces of one
        # merged span split at exactly max_request
        assert gap > max_gap or (gap == 0 and e0 - s0 == max_request)
    # every requested byte is covered
    covered = set()
    for s, e in out:
        covered.update(range(s, e))
    for s, e in ranges:
        assert covered.issuperset(range(s, e))
    # every fetched byte is requested or lies in a gap <= max_gap that was bridged
    comps = union(ranges)
    bridged = [(e0, s1) for (_, e0), (s1, _) in zip(comps, comps[1:]) if s1 - e0 <= max_gap]
    allowed = set()
    for s, e in comps + bridged:
        allowed.update(range(s, e))
    assert covered == allowed
    cost = sum(e - s for s, e in out)
    bridged_bytes = sum(e - s for s, e in bridged)
    assert cost == sum(e - s for s, e in comps) + bridged_bytes
    assert cost <= sum(e - s for s, e in ranges) + bridged_bytes
    assert coalesced_cost(ranges, max_gap, max_request) == cost
    # the minimal number of requests: each merged span costs ceil(len / max_request)
    spans = union(comps + bridged)
    assert len(out) == sum(-(-(e - s) // max_request) for s, e in spans)
    # idempotent and order-independent
    assert coalesce(out, max_gap, max_request) == out
    assert coalesce(list(reversed(ranges)), max_gap, max_request) == out


def test_coalesce_examples():
    assert coalesce([]) == []
    assert coalesce([(5, 5), (9, 9)]) == []
    assert coalesce([(10, 20), (0, 10)]) == [(0, 20)]  # adjacent merge at max_gap=0
    assert coalesce([(0, 10), (11, 20)]) == [(0, 10), (11, 20)]
    assert coalesce([(0, 10), (11, 20)], max_gap=1) == [(0, 20)]
    assert coalesce([(0, 10), (2, 5), (8, 30)]) == [(0, 30)]
    assert coalesce([(0, 25)], max_request=10) == [(0, 10), (10, 20), (20, 25)]
    assert coalesce([(0, 10), (15, 25)], max_gap=5, max_request=10) == [(0, 10), (10, 20), (20, 25)]
    assert coalesce([(0, 3 * DEFAULT_MAX_REQUEST + 1)]) == [
        (0, DEFAULT_MAX_REQUEST),
        (DEFAULT_MAX_REQUEST, 2 * DEFAULT_MAX_REQUEST),
        (2 * DEFAULT_MAX_REQUEST, 3 * DEFAULT_MAX_REQUEST),
        (3 * DEFAULT_MAX_REQUEST, 3 * DEFAULT_MAX_REQUEST + 1),
    ]


@pytest.mark.parametrize("bad", [[(5, 4)], [(-1, 3)], [(0, 4), (10, 2)]])
def test_coalesce_rejects_invalid_ranges(bad):
    with pytest.raises(ValueError, match="invalid byte range"):
        coalesce(bad)


@pytest.mark.timeout(10)
def test_coalesce_rejects_non_positive_max_request():
    for mr in (0, -1):
        with pytest.raises(ValueError):
            coalesce([(0, 10)], 0, mr)


def test_coalesce_negative_max_gap_still_merges_overlaps():
    # the contract: overlapping and adjacent ranges always merge; output never overlaps
    for gap in (-1, -5, -100):
        assert coalesce([(0, 10), (5, 15)], gap) == [(0, 15)]
        assert coalesce([(0, 10), (10, 15)], gap) == [(0, 15)]


# --------------------------------------------------------------------------------------------
# slice_from_requests
# --------------------------------------------------------------------------------------------

DATA = bytes(np.random.default_rng(0).integers(0, 256, 600, dtype=np.uint8))


@settings(max_examples=300, deadline=None)
@given(
    ranges=st.lists(
        st.tuples(st.integers(0, 500), st.integers(0, 99)).map(lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=12
    ),
    max_gap=st.integers(0, 40),
    max_request=st.integers(1, 64),
)
def test_slice_from_requests_returns_requested_bytes(ranges, max_gap, max_request):
    reqs = coalesce(ranges, max_gap, max_request)
    bufs = [DATA[s:e] for s, e in reqs]
    for s, e in ranges:
        got = slice_from_requests(reqs, bufs, s, e)
        assert bytes(got) == DATA[s:e]


def test_slice_from_requests_spanning_split_requests():
    reqs = [(0, 4), (4, 8), (8, 12), (20, 30)]
    bufs = [DATA[s:e] for s, e in reqs]
    assert bytes(slice_from_requests(reqs, bufs, 2, 11)) == DATA[2:11]
    assert bytes(slice_from_requests(reqs, bufs, 0, 12)) == DATA[0:12]
    assert bytes(slice_from_requests(reqs, bufs, 4, 8)) == DATA[4:8]
    assert bytes(slice_from_requests(reqs, bufs, 21, 29)) == DATA[21:29]
    # zero-copy when a range lies inside one request
    assert isinstance(slice_from_requests(reqs, bufs, 5, 7), memoryview)
    for s, e in [(10, 21), (12, 13), (30, 31), (25, 35)]:
        with pytest.raises(ValueError, match="not covered"):
            slice_from_requests(reqs, bufs, s, e)
    with pytest.raises(ValueError, match="not covered"):
        slice_from_requests([(10, 20)], [DATA[10:20]], 5, 15)


def test_slice_from_requests_empty_range():
    reqs = [(10, 20)]
    bufs = [DATA[10:20]]
    for s in (0, 10, 15, 20, 50):
        assert bytes(slice_from_requests(reqs, bufs, s, s)) == b""
    assert bytes(slice_from_requests([], [], 7, 7)) == b""


# --------------------------------------------------------------------------------------------
# LocalStorage reads
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    content=st.binary(min_size=0, max_size=3000),
    storage_gap=st.integers(0, 64),
    max_request=st.sampled_from([1, 7, 64, 512, DEFAULT_MAX_REQUEST]),
    role=st.sampled_from(ROLES),
)
def test_read_ranges_exact_bytes_and_accounting(data, content, storage_gap, max_request, role):
    size = len(content)
    rng = st.tuples(st.integers(0, size), st.integers(0, size)).map(lambda t: (min(t), max(t)))
    ranges = data.draw(st.lists(rng, min_size=1, max_size=10))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "blob.bin")
        with open(path, "wb") as fh:
            fh.write(content)
        counters = IOCounters()
        storage = LocalStorage(counters, max_gap=storage_gap)
        storage.max_request = max_request
        before = counters.snapshot()
        bufs = storage.read_ranges(path, ranges, role)
        assert len(bufs) == len(ranges)
        for (s, e), b in zip(ranges, bufs):
            assert bytes(b) == content[s:e]
        reqs = coalesce(ranges, storage_gap, max_request)
        after = counters.snapshot()
        assert after["read"][role] - before["read"][role] == sum(e - s for s, e in reqs)
        assert after["requests"][role] - before["requests"][role] == len(reqs)
        for r in ROLES:
            if r != role:
                assert after["read"][r] == 0 and after["requests"][r] == 0
        assert after["written"] == before["written"]


@pytest.fixture
def blob(tmp_path):
    content = bytes(np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8))
    p = tmp_path / "blob.bin"
    p.write_bytes(content)
    return str(p), content


def test_read_ranges_max_gap_override_uses_the_smaller(blob):
    path, content = blob
    ranges = [(0, 100), (150, 250)]  # gap of 50
    far = [(0, 100), (250, 350)]  # gap of 150

    def run(storage_gap, given_gap, rngs):
        c = IOCounters()
        s = LocalStorage(c, max_gap=storage_gap)
        out = s.read_ranges(path, rngs, "expert", max_gap=given_gap)
        assert [bytes(b) for b in out] == [content[a:b] for a, b in rngs]
        return c.bytes_read["expert"], c.requests["expert"]

    assert run(100, None, ranges) == (250, 1)  # storage's gap bridges 50
    assert run(100, 10, ranges) == (200, 2)  # smaller given gap wins
    assert run(100, 1000, ranges) == (250, 1)
    assert run(100, 1000, far) == (200, 2)  # larger given gap is capped at the storage's 100
    assert run(0, 1000, ranges) == (200, 2)
    assert run(100, 50, ranges) == (250, 1)
    assert run(100, 49, ranges) == (200, 2)


def test_read_ranges_order_and_duplicates(blob):
    path, content = blob
    storage = LocalStorage()
    storage.max_request = 128
    rngs = [(5000, 5300), (0, 10), (5100, 5200), (0, 10), (9990, 10_000), (300, 301)]
    out = storage.read_ranges(path, rngs, "base")
    assert [bytes(b) for b in out] == [content[s:e] for s, e in rngs]
    assert storage.counters.bytes_read["base"] == 300 + 10 + 10 + 1
    assert storage.counters.requests["base"] == 3 + 1 + 1 + 1  # 300 bytes split at 128
    assert storage.read_ranges(path, [], "base") == []


def test_read_range_and_read_object(blob, tmp_path):
    path, content = blob
    c = IOCounters()
    storage = LocalStorage(c)
    assert storage.read_range(path, 10, 20, "other") == content[10:20]
    assert isinstance(storage.read_range(path, 10, 20, "other"), bytes)
    assert storage.read_object(path, "catalog") == content
    assert c.bytes_read["catalog"] == len(content)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert storage.read_object(str(empty), "other") == b""
    assert storage.read_range(path, 7, 7, "other") == b""
    assert storage.read_range(path, len(content), len(content), "other") == b""
    # file:// URIs
    assert storage.read_range("file://" + path, 0, 5, "other") == content[:5]


def test_stat_and_not_found(blob, tmp_path):
    path, content = blob
    storage = LocalStorage()
    stt = storage.stat(path)
    assert stt.size == len(content)
    st = os.stat(path)
    assert stt.version == f"{st.st_mtime_ns}.{st.st_dev}.{st.st_ino}"  # mtime, and which file (inode)
    assert storage.exists(path)
    missing = str(tmp_path / "nope")
    for call in (
        lambda: storage.stat(missing),
        lambda: storage.read_range(missing, 0, 1, "base"),
        lambda: storage.read_object(missing, "base"),
    ):
        with pytest.raises(NotFoundError) as ei:
            call()
        assert missing in str(ei.value)
        assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, StorageError)
    assert not storage.exists(missing)
    # a directory is not an object
    with pytest.raises(NotFoundError):
        storage.stat(str(tmp_path))
    assert not storage.exists(str(tmp_path))
    assert storage.counters.bytes_read["base"] == 0


@pytest.mark.parametrize("max_request", [DEFAULT_MAX_REQUEST, 1000])
def test_short_read_raises_storage_error(blob, max_request):
    path, content = blob
    c = IOCounters()
    storage = LocalStorage(c)
    storage.max_request = max_request
    size = storage.stat(path).size
    os.truncate(path, 4000)  # the file changes between stat and read
    with pytest.raises(StorageError) as ei:
        storage.read_range(path, 0, size, "base")
    assert path in str(ei.value) and "short read" in str(ei.value)
    assert not isinstance(ei.value, NotFoundError)
    assert c.bytes_read["base"] == 0 and c.requests["base"] == 0
    with pytest.raises(StorageError):
        storage.read_ranges(path, [(0, 10), (3990, 4010)], "base")
    # reads inside the remaining bytes still work
    assert storage.read_range(path, 3000, 4000, "base") == content[3000:4000]


def test_concurrent_reads_share_counters(blob):
    path, content = blob
    c = IOCounters()
    storage = LocalStorage(c, threads=3)
    storage.max_request = 100
    errors = []

    def worker(k):
        try:
            for i in range(20):
                s = (k * 997 + i * 131) % 9000
                out = storage.read_ranges(path, [(s, s + 250), (s + 500, s + 700)], "expert")
                assert bytes(out[0]) == content[s : s + 250] and bytes(out[1]) == content[s + 500 : s + 700]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert c.bytes_read["expert"] == 6 * 20 * 450
    assert c.requests["expert"] == 6 * 20 * (3 + 2)


# --------------------------------------------------------------------------------------------
# LocalStorage writes
# --------------------------------------------------------------------------------------------


def test_put_object_and_conditional_create(tmp_path):
    c = IOCounters()
    storage = LocalStorage(c)
    uri = str(tmp_path / "a" / "b" / "obj.json")
    storage.put_object(uri, b"first version", "catalog", if_none_match=True)
    assert open(uri, "rb").read() == b"first version"
    assert c.bytes_written["catalog"] == 13 and c.requests["catalog"] == 1
    with pytest.raises(PreconditionFailed) as ei:
        storage.put_object(uri, b"second", "catalog", if_none_match=True)
    assert uri in str(ei.value) and isinstance(ei.value, StorageError)
    assert open(uri, "rb").read() == b"first version"
    assert c.bytes_written["catalog"] == 13 and c.requests["catalog"] == 1
    storage.put_object(uri, b"short", "catalog")  # unconditional overwrite truncates
    assert open(uri, "rb").read() == b"short"
    assert c.bytes_written["catalog"] == 18 and c.requests["catalog"] == 2
    storage.put_object(str(tmp_path / "default"), b"xyz")
    assert c.bytes_written["output"] == 3


def test_put_object_fsyncs(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    LocalStorage().put_object(str(tmp_path / "x"), b"12345")
    assert synced[0] == 5, "the object's bytes are durable before it is published"
    assert len(synced) == 2, "then the folder holding the new name"


def test_fsync_folder_strict_raises_best_effort_does_not(tmp_path, monkeypatch):
    from mergepipe.storage.local import fsync_folder

    fsync_folder(tmp_path, strict=True)  # a real folder on a real file system: no error
    with pytest.raises(FileNotFoundError):
        fsync_folder(tmp_path / "missing", strict=True)
    fsync_folder(tmp_path / "missing", strict=False)
    tried = fail_folder_fsync(monkeypatch)
    with pytest.raises(OSError, match="folder fsync refused"):
        fsync_folder(str(tmp_path), strict=True)
    fsync_folder(str(tmp_path), strict=False)
    assert tried == [str(tmp_path)] * 2


def test_folder_fsync_callers_keep_their_strictness(tmp_path, monkeypatch):
    """put_object is best effort; a local commit and a search state fail when their folder
    cannot be made durable, and a failed commit publishes nothing."""
    from mergepipe.commit.manifest import publish_local, staging_path
    from mergepipe.search.state import save_state

    tried = fail_folder_fsync(monkeypatch)
    LocalStorage().put_object(str(tmp_path / "obj"), b"abc")
    assert (tmp_path / "obj").read_bytes() == b"abc" and tried == [str(tmp_path)]

    out = tmp_path / "merged"
    staging = staging_path(out)
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"x" * 7)
    with pytest.raises(OSError, match="folder fsync refused"):
        publish_local(staging, out, {"outputs": {"model.safetensors": {"size": 7}}})
    assert not out.exists() and tried[-1] == str(staging)

    with pytest.raises(OSError, match="folder fsync refused"):
        save_state(tmp_path / "state.json", {"format": "x"})
    assert tried[-1] == str(tmp_path)


def test_sync_prefix_fsyncs_the_tree_and_its_parents(tmp_path, monkeypatch):
    st_ = LocalStorage()
    (tmp_path / "out" / "runs" / "r1" / "sub").mkdir(parents=True)
    tried = fail_folder_fsync(monkeypatch)
    with pytest.raises(OSError, match="folder fsync refused"):
        st_.sync_prefix(str(tmp_path / "out" / "runs" / "r1"), through=str(tmp_path / "out"))
    monkeypatch.undo()
    seen = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    st_.sync_prefix(str(tmp_path / "out" / "runs" / "r1"), through=str(tmp_path / "out"))
    run = tmp_path / "out" / "runs" / "r1"
    assert seen == [str(p) for p in (run / "sub", run, run.parent, run.parent.parent, tmp_path)]
    assert len(tried) == 1
    with pytest.raises(ValueError, match="not"):
        st_.sync_prefix(str(tmp_path / "out"), through=str(tmp_path / "other"))


@pytest.mark.parametrize("fail_at", [1, 2])
def test_durable_put_object_fails_and_leaves_nothing(tmp_path, monkeypatch, fail_at):
    """``durable=True`` (a commit's manifest): a folder fsync that fails before the name is
    published (``fail_at=1``) or after it (``fail_at=2``) fails the write, and a conditional
    create leaves no object and no temporary file behind."""
    import errno
    import stat as stat_

    real, calls = os.fsync, []

    def fsync(fd):
        if stat_.S_ISDIR(os.fstat(fd).st_mode):
            calls.append(fd)
            if len(calls) == fail_at:
                raise OSError(errno.EIO, "folder fsync refused")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "manifest.json"
    with pytest.raises(OSError, match="folder fsync refused"):
        LocalStorage().put_object(str(target), b"{}", if_none_match=True, durable=True)
    assert list(tmp_path.iterdir()) == []
    calls.clear()  # the default stays best effort: the same refusal does not fail the write
    LocalStorage().put_object(str(target), b"{}", if_none_match=True)
    assert target.read_bytes() == b"{}" and len(calls) == 1


@pytest.mark.parametrize("if_none_match", [True, False])
def test_put_object_never_visible_partially(tmp_path, monkeypatch, if_none_match):
    """A reader sees no object or the whole object: the name appears only after the bytes are
    written and synced (a reader racing an O_EXCL create once saw an empty manifest)."""
    target = tmp_path / "manifest.json"
    if not if_none_match:
        target.write_bytes(b'{"old": 1}')
    seen = []
    real = os.fsync

    def spy(fd):
        if os.path.isfile(os.readlink(f"/proc/self/fd/{fd}")):
            seen.append(target.read_bytes() if target.exists() else None)
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    data = b'{"new": ' + b"1" * 100_000 + b"}"
    LocalStorage().put_object(str(target), data, if_none_match=if_none_match)
    assert seen == [None if if_none_match else b'{"old": 1}']
    assert target.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"], "no temporary file left"


def test_put_object_if_none_match_refuses_and_keeps_existing(tmp_path):
    target = tmp_path / "m.json"
    LocalStorage().put_object(str(target), b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed, match="already exists"):
        LocalStorage().put_object(str(target), b"second", if_none_match=True)
    assert target.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_writer_writes_fsyncs_and_counts(tmp_path, monkeypatch):
    c = IOCounters()
    storage = LocalStorage(c)
    uri = str(tmp_path / "out" / "shard.safetensors")
    storage.make_prefix(str(tmp_path / "out"))  # writers never create folders
    w = storage.open_writer(uri, "output")
    arr = np.arange(10, dtype=np.float32)
    chunks = [b"hello ", memoryview(b"world"), memoryview(arr), b""]
    for ch in chunks:
        w.write(ch)
    expect = b"hello world" + arr.tobytes()
    fd = w._f.fileno()
    synced = []
    real = os.fsync

    def spy(f):
        synced.append((f, os.fstat(f).st_size))
        return real(f)

    monkeypatch.setattr(os, "fsync", spy)
    size = w.close()
    assert size == len(expect) == 51
    assert synced == [(fd, len(expect))]  # fsync'd with everything flushed
    assert open(uri, "rb").read() == expect
    assert c.bytes_written["output"] == len(expect)
    assert c.requests["output"] == len(chunks)
    assert all(c.bytes_written[r] == 0 for r in ROLES if r != "output")


def test_writer_abort_removes_file(tmp_path):
    c = IOCounters()
    storage = LocalStorage(c)
    uri = str(tmp_path / "part")
    w = storage.open_writer(uri, "expert")
    w.write(b"abc")
    assert os.path.exists(uri)
    w.abort()
    assert not os.path.exists(uri)
    w.abort()  # never raises
    assert c.bytes_written["expert"] == 3

    uri2 = str(tmp_path / "ctx")
    with pytest.raises(RuntimeError):
        with storage.open_writer(uri2) as w2:
            w2.write(b"data")
            raise RuntimeError("boom")
    assert not os.path.exists(uri2)

    uri3 = str(tmp_path / "ok")
    with storage.open_writer(uri3) as w3:
        w3.write(b"kept")
        assert w3.close() == 4
    assert open(uri3, "rb").read() == b"kept"


def test_writer_copy_range(blob, tmp_path):
    path, content = blob
    c = IOCounters()
    storage = LocalStorage(c)
    uri = str(tmp_path / "copy")
    w = storage.open_writer(uri, "output")
    w.write(b"HDR")
    w.copy_range(path, 100, 600)
    w.copy_range(path, 9000, 10_000)
    assert w.close() == 3 + 500 + 1000
    assert open(uri, "rb").read() == b"HDR" + content[100:600] + content[9000:10_000]
    assert c.bytes_read["base"] == 1500
    assert c.bytes_written["output"] == 1503


def test_delete_file_and_folder(tmp_path):
    storage = LocalStorage()
    f = tmp_path / "f.bin"
    f.write_bytes(b"x")
    storage.delete(str(f))
    assert not f.exists()
    storage.delete(str(f))  # missing is not an error
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "x").write_bytes(b"1")
    (tree / "y").write_bytes(b"2")
    keep = tmp_path / "keep"
    keep.write_bytes(b"k")
    storage.delete(str(tree))
    assert not tree.exists()
    assert keep.read_bytes() == b"k"
    storage.delete(str(tmp_path / "never-existed"))


def test_list_recursive_sorted(tmp_path):
    storage = LocalStorage()
    root = tmp_path / "root"
    names = ["z.txt", "a/2.bin", "a/10.bin", "b/c/d.json", "B.txt", "a.txt"]
    for n in names:
        p = root / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(n.encode())
    (root / "emptydir").mkdir()
    got = list(storage.list(str(root)))
    assert got == sorted(str(root / n) for n in names)
    assert got == sorted(got) and len(got) == len(names)
    assert list(storage.list(str(tmp_path / "missing"))) == []


def test_join_and_open_storage(tmp_path):
    assert LocalStorage.join("/a/b", "c", "d.json") == "/a/b/c/d.json"
    assert LocalStorage.join("file:///a/b/", "c") == "/a/b/c"
    c = IOCounters()
    s = open_storage(str(tmp_path), counters=c)
    assert isinstance(s.backend(str(tmp_path)), LocalStorage) and s.counters is c and s.local.counters is c
    (tmp_path / "f").write_bytes(b"0123456789")
    assert s.read_range(str(tmp_path / "f"), 2, 5, "base") == b"234" and c.bytes_read["base"] == 3
    assert isinstance(open_storage(str(tmp_path)).counters, IOCounters)


def test_io_counters_snapshot_is_a_copy():
    c = IOCounters()
    c.add_read("base", 10, 2)
    c.add_write("output", 5)
    c.add_copy("output", 7)
    snap = c.snapshot()
    assert snap["read"]["base"] == 10 and snap["requests"]["base"] == 2
    assert snap["written"]["output"] == 5 and snap["copied"]["output"] == 7 and snap["requests"]["output"] == 2
    c.add_read("base", 1)
    assert snap["read"]["base"] == 10 and c.snapshot()["read"]["base"] == 11
