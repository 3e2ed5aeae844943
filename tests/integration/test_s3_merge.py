"""End-to-end merges against a real S3 server (SeaweedFS): s3 -> s3 bit-identical to local,
catalog index objects in S3, faults on the wire, concurrent commits, stale inputs, refusals."""

import json
import os
import subprocess
import sys
import threading

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.catalog.objectstore import ObjectCatalog
from mergepipe.commit.objectstore import read_manifest_obj, verify_obj
from mergepipe.errors import InputError
from mergepipe.pipeline import build_plan, execute_and_commit, merge
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.s3support import FaultProxy

pytestmark = pytest.mark.s3


def _upload(client, bucket, folder, prefix):
    for f in sorted(os.listdir(folder)):
        client.upload_file(os.path.join(folder, f), bucket, f"{prefix}/{f}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture()
def s3_family(s3_env, family):
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("fam")
    b = _upload(c, bucket, base, "models/base")
    es = [_upload(c, bucket, e, f"models/{e.name}") for e in experts]
    return bucket, b, es, base, experts


def _names(es):
    return [(u.rsplit("/", 1)[-1], u) for u in es]


def test_s3_to_s3_merge_is_bit_identical_to_local(s3_family, tmp_path):
    bucket, b, es, base, experts = s3_family
    for budget in (None, "10%"):
        local = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            "ties",
            str(tmp_path / f"local-{budget}"),
            ["density=0.5"],
            budget=budget,
            catalog=Catalog(tmp_path / "l.sqlite"),
        )
        st = open_storage(None, IOCounters())
        cat = ObjectCatalog(st, f"s3://{bucket}/catalog")
        remote = merge(
            b,
            _names(es),
            "ties",
            f"s3://{bucket}/snapshots/m-{budget}",
            ["density=0.5"],
            budget=budget,
            catalog=cat,
            storage=st,
        )
        if budget is None:  # same selection: same bytes
            assert remote.manifest["outputs"] == local.manifest["outputs"]
        # under a budget the S3 plan may close gaps (1 MiB rule) and so select other blocks
        assert remote.manifest["snapshot_id"] != "" and remote.manifest["files_prefix"].startswith("runs/")
        io = remote.manifest["io"]
        assert io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"]
        if budget:
            assert io["estimated"]["expert_read_bytes"] <= io["expert_budget_bytes"]
        assert verify_obj(st, f"s3://{bucket}/snapshots/m-{budget}")["ok"]
        assert 0 <= remote.plan.coalesce_gap <= st.s3.max_gap  # at most S3's coalescing gap
        assert io["realized"]["expert_read_bytes"] == io["estimated"]["expert_read_bytes"]


def test_merge_through_faulty_network_is_identical(s3_family, seaweed, tmp_path):
    bucket, b, es, base, experts = s3_family
    ref = merge(
        b,
        _names(es),
        "dare_ties",
        f"s3://{bucket}/snap/ref",
        ["density=0.4"],
        budget="50%",
        catalog=Catalog(tmp_path / "a.sqlite"),
        storage=open_storage(None, IOCounters()),
    )
    with FaultProxy(seaweed.host, seaweed.port, seed=7) as proxy:
        proxy.set_random(drop=0.1, error503=0.1, cut=0.15, methods=("GET",))
        st = open_storage(None, IOCounters(), endpoint_url=proxy.endpoint_url, backoff=0.01)
        got = merge(
            b,
            _names(es),
            "dare_ties",
            f"s3://{bucket}/snap/faulty",
            ["density=0.4"],
            budget="50%",
            catalog=Catalog(tmp_path / "b.sqlite"),
            storage=st,
        )
        assert len(proxy.faults()) >= 3, "faults must actually have been injected"
    assert got.manifest["outputs"] == ref.manifest["outputs"]
    io = got.manifest["io"]
    assert io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"]


def test_two_workers_commit_one_snapshot(s3_family, tmp_path):
    bucket, b, es, *_ = s3_family
    st0 = open_storage(None, IOCounters())
    plan = build_plan(
        Catalog(tmp_path / "c.sqlite"), st0, request_from_args(b, _names(es), "ties", ["density=0.5"], budget="40%")
    )
    out = f"s3://{bucket}/snap/race"
    results, errors = [], []

    def worker():
        try:
            results.append(execute_and_commit(plan, open_storage(None, IOCounters()), out))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    assert sum(not r.already_committed for r in results) == 1
    assert len({r.manifest["snapshot_id"] for r in results}) == 1
    runs = {u.split("/runs/")[1].split("/")[0] for u in st0.list(out + "/runs/")}
    m, _ = read_manifest_obj(st0, out)
    assert runs == {m["files_prefix"].split("/")[1]}, "losers' uploads are deleted"
    assert verify_obj(st0, out)["ok"]
    c = st0.s3.client
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_stale_catalog_changed_shard_is_refused(s3_family, s3_env, tmp_path):
    bucket, b, es, base, experts = s3_family
    st = open_storage(None, IOCounters())
    plan = build_plan(Catalog(tmp_path / "c.sqlite"), st, request_from_args(b, _names(es), "ties", ["density=0.5"]))
    # replace one expert shard after analysis
    shard = sorted(os.listdir(experts[0]))
    shard = [f for f in shard if f.endswith(".safetensors")][0]
    data = (experts[0] / shard).read_bytes()
    s3_env.client().put_object(Bucket=bucket, Key=f"models/{experts[0].name}/{shard}", Body=data + b"\0" * 8)
    with pytest.raises(InputError, match="changed since it was analyzed"):
        execute_and_commit(plan, st, f"s3://{bucket}/snap/stale")
    assert read_manifest_obj(st, f"s3://{bucket}/snap/stale") is None
    assert st.s3.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_store_ignoring_conditional_writes_is_refused(s3_family, tmp_path):
    bucket, b, es, *_ = s3_family
    st = open_storage(None, IOCounters())

    def strip(request, **kw):  # make the real server see plain PUTs, like rclone/s3rver gateways
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    st.s3.client.meta.events.register("before-sign.s3.PutObject", strip)
    with pytest.raises(InputError, match="ignores conditional writes"):
        merge(
            b,
            _names(es),
            "linear",
            f"s3://{bucket}/snap/nocond",
            [],
            catalog=Catalog(tmp_path / "c.sqlite"),
            storage=st,
        )
    assert read_manifest_obj(st, f"s3://{bucket}/snap/nocond") is None
    res = execute_and_commit(
        build_plan(Catalog(tmp_path / "c.sqlite"), st, request_from_args(b, _names(es), "linear")),
        st,
        f"s3://{bucket}/snap/nocond",
        unsafe_single_writer=True,
    )
    assert res.manifest["snapshot_id"]


def test_cli_s3_merge_json_and_no_credentials_anywhere(s3_family, s3_env, tmp_path):
    bucket, b, es, *_ = s3_family
    env = {**os.environ, **s3_env.env(), "MERGEPIPE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "mergepipe.cli", "merge", "--base", b]
    for u in es:
        cmd += ["--expert", u]
    cmd += [
        "--out",
        f"s3://{bucket}/snap/cli",
        "--method",
        "ties",
        "--param",
        "density=0.5",
        "--budget",
        "25%",
        "--catalog",
        f"s3://{bucket}/catalog",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["io"]["expert_read_bytes"] <= res["io"]["expert_budget_bytes"]
    st = open_storage(None, IOCounters())
    manifest_text = st.read_object(f"s3://{bucket}/snap/cli/manifest.json", "other").decode()
    for secret in (s3_env.secret_key, s3_env.access_key):
        assert secret not in r.stdout and secret not in r.stderr and secret not in manifest_text
    v = subprocess.run(
        [sys.executable, "-m", "mergepipe.cli", "verify", f"s3://{bucket}/snap/cli", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert v.returncode == 0 and json.loads(v.stdout)["ok"]
    # the catalog's index objects exist, and a missing bucket is a clear exit-2 error
    assert any("/catalog/analyses/" in u for u in st.list(f"s3://{bucket}/catalog/"))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mergepipe.cli",
            "merge",
            "--base",
            "s3://no-such-bucket-x/base",
            "--expert",
            "s3://no-such-bucket-x/e",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "no-such-bucket-x" in bad.stderr
    assert s3_env.secret_key not in bad.stderr


def test_unchanged_tensors_are_copied_server_side(s3_env, tmp_path):
    """Tensors the plan leaves unchanged (>= 16 MiB) are written with UploadPartCopy from the base:
    neither read nor uploaded by the worker; the snapshot's content (tree digests) equals the
    local merge's."""
    from testkit.synth import llama_like_shapes, make_family

    base, experts = make_family(tmp_path / "m", 2, seed=4, shapes=llama_like_shapes(512, 1024, 2, 20480), n_shards=2)
    c = s3_env.client()
    bucket = s3_env.make_bucket("cow")
    b = _upload(c, bucket, base, "models/base")
    es = [_upload(c, bucket, e, f"models/{e.name}") for e in experts]
    # weight 0 on the embeddings and the LM head: they stay the base's, byte for byte
    params = [
        "density=0.5",
        'weight=[{"filter": "embed_tokens", "value": 0}, {"filter": "lm_head", "value": 0}, {"value": 1}]',
    ]
    local = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(tmp_path / "local"),
        params,
        catalog=Catalog(tmp_path / "l.sqlite"),
    )
    st = open_storage(None, IOCounters())
    remote = merge(
        b, _names(es), "ties", f"s3://{bucket}/snap/cow", params, catalog=Catalog(tmp_path / "r.sqlite"), storage=st
    )
    big = 20480 * 512 * 2
    io = remote.manifest["io"]["realized"]
    # each copy may first top up a pending part to S3's 5 MiB minimum with bytes read from the base
    assert io["output_copied_bytes"] >= 2 * (big - 5 * 2**20)
    assert io["base_read_bytes"] <= local.manifest["io"]["realized"]["base_read_bytes"] - io["output_copied_bytes"]
    for name, info in remote.manifest["outputs"].items():
        assert info.get("tree_sha256", info.get("sha256")) == local.manifest["outputs"][name].get(
            "tree_sha256", local.manifest["outputs"][name].get("sha256")
        )
    assert verify_obj(st, f"s3://{bucket}/snap/cow")["ok"]


@pytest.mark.slow
def test_object_catalog_streams_sketch_blobs_as_multipart_uploads(s3_env, tmp_path):
    """analyze into an S3 catalog writes an expert's sketch blob as a multipart upload while it
    streams (a ~40 MB bf16 expert: its blob fills several parts of S3's 5 MiB minimum), byte-identical
    to the local catalog's blob, and leaves no upload open."""
    from testkit.synth import llama_like_shapes, make_family

    base, experts = make_family(tmp_path / "fam", 1, seed=5, shapes=llama_like_shapes(512, 1376, 4, 8192))
    c = s3_env.client()
    bucket = s3_env.make_bucket("mp")
    b, e = _upload(c, bucket, base, "models/base"), _upload(c, bucket, experts[0], "models/e0")
    st = open_storage(None, IOCounters(), part_size=5 << 20)
    cat = ObjectCatalog(st, f"s3://{bucket}/catalog")
    r = cat.analyze(st, cat.register(st, b), [cat.register(st, e)], block_bytes=64 * 1024)[0]
    lcat, lst = Catalog(tmp_path / "l.sqlite"), open_storage(None, IOCounters())
    loc = lcat.analyze(lst, lcat.register(lst, str(base)), [lcat.register(lst, str(experts[0]))], 64 * 1024)[0]
    key = r.sketch["uri"].split("/", 3)[3]
    data = c.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert data == open(loc.sketch["uri"], "rb").read() and len(data) > st.s3.part_size
    assert {k: v for k, v in r.sketch.items() if k != "uri"} == {k: v for k, v in loc.sketch.items() if k != "uri"}
    parts = -(-len(data) // st.s3.part_size)  # the blob's size in whole parts (3 with the sign3+r1 tier's sections)
    assert parts >= 2 and c.head_object(Bucket=bucket, Key=key)["ETag"].strip('"').endswith(f"-{parts}")
    assert not c.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert all(r.tensors[n].to_bytes() == loc.tensors[n].to_bytes() for n in loc.tensors)
