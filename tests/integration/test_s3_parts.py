"""Partitioned execution and resume on a real S3 server (SeaweedFS): N parts written by
separate storages (as pods would) commit the single-process snapshot bit for bit; a part
killed part-way resumes, rereading only what is missing."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit import runs
from mergepipe.commit.objectstore import read_manifest_obj, verify_obj
from mergepipe.engine.partition import PartSpec, partition
from mergepipe.errors import CommitConflict
from mergepipe.parts import commit_run, execute_part, run_workers
from mergepipe.pipeline import build_plan, execute_and_commit
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.synth import llama_like_shapes, make_family
from tests.integration.test_parts import KILL_SCRIPT

pytestmark = pytest.mark.s3


@pytest.fixture()
def s3_fam4(s3_env, tmp_path):
    base, experts = make_family(tmp_path / "fam", 3, seed=3, n_shards=4, shapes=llama_like_shapes(64, 160, 4, 256))
    c = s3_env.client()
    bucket = s3_env.make_bucket("parts")
    uris = []
    for folder, prefix in [(base, "models/base"), *[(e, f"models/{e.name}") for e in experts]]:
        for f in sorted(os.listdir(folder)):
            c.upload_file(os.path.join(folder, f), bucket, f"{prefix}/{f}")
        uris.append(f"s3://{bucket}/{prefix}")
    st = open_storage(None, IOCounters())
    plan = build_plan(
        Catalog(tmp_path / "c.sqlite"),
        st,
        request_from_args(
            uris[0], [(u.rsplit("/", 1)[-1], u) for u in uris[1:]], "ties", ["density=0.5"], budget="40%", seed=2
        ).with_run(work_bytes=16 << 10),
    )
    return bucket, plan


def _objects(st, prefix):
    out = {}
    for uri in st.list(prefix):
        out[uri[len(prefix) :]] = st.read_object(uri, "other")
    return out


def test_n_parts_equal_one_process_on_s3(s3_fam4):
    bucket, plan = s3_fam4
    one_out = f"s3://{bucket}/snap/one"
    one = execute_and_commit(plan, open_storage(None, IOCounters()), one_out)
    st = open_storage(None, IOCounters())
    for n in (2, 3):
        out = f"s3://{bucket}/snap/p{n}"
        for i in range(n):  # each part with its own storage and counters, as separate pods
            execute_part(plan, open_storage(None, IOCounters()), out, PartSpec(i, n))
        res = commit_run(plan, open_storage(None, IOCounters()), out)
        m1, m2 = one.manifest, res.manifest
        assert m2["snapshot_id"] == m1["snapshot_id"]
        assert {k for k in m1.keys() | m2.keys() if m1.get(k) != m2.get(k)} <= {"time", "parts", "files_prefix"}
        assert m2["files_prefix"] == f"runs/{runs.default_run_id(plan.digest)}"
        a = _objects(st, f"{one_out}/{m1['files_prefix']}/")
        b = _objects(st, f"{out}/{m2['files_prefix']}/")
        assert a == b  # the same objects, byte for byte
        assert verify_obj(st, out)["ok"]
        assert not list(st.list(f"{out}/runs/{runs.default_run_id(plan.digest)}.records"))
        # a second commit of the same run finds it committed and keeps its files
        again = commit_run(plan, open_storage(None, IOCounters()), out)
        assert again.already_committed and verify_obj(st, out)["ok"]


def test_commit_refuses_a_missing_part_on_s3(s3_fam4):
    bucket, plan = s3_fam4
    out = f"s3://{bucket}/snap/miss"
    execute_part(plan, open_storage(None, IOCounters()), out, PartSpec(1, 2))
    with pytest.raises(CommitConflict, match="part 0/2 has no record"):
        commit_run(plan, open_storage(None, IOCounters()), out, parts=2)
    assert read_manifest_obj(open_storage(None, IOCounters()), out) is None


def test_resume_after_kill_on_s3(s3_fam4, tmp_path):
    bucket, plan = s3_fam4
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    out = f"s3://{bucket}/snap/resume"
    p = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(plan_file), out, "0", "2", "1"],
        capture_output=True,
        cwd=Path(__file__).parents[2],
        env=dict(os.environ),
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    st = open_storage(None, IOCounters())
    rec = execute_part(plan, st, out, PartSpec(0, 2))
    shards0 = partition(plan, 2)[0]
    assert len(rec["kept"]) == 1 and rec["kept"][0] in shards0
    # the rerun read no base or expert byte of the kept shard: it costs what a part without it costs
    alone = open_storage(None, IOCounters())
    ref = execute_part(plan, alone, f"s3://{bucket}/snap/ref", PartSpec(0, 2))
    kept_tensors = [t for t in plan.tensors if t.file == rec["kept"][0]]
    assert all(t.passes == 1 for t in kept_tensors)  # (two-pass tensors read their base rows twice)
    kept_base = sum(_tensor_bytes(t) for t in kept_tensors)
    assert rec["realized"]["base_read_bytes"] == ref["realized"]["base_read_bytes"] - kept_base
    assert rec["realized"]["expert_read_bytes"] < ref["realized"]["expert_read_bytes"]
    execute_part(plan, open_storage(None, IOCounters()), out, PartSpec(1, 2))
    res = commit_run(plan, open_storage(None, IOCounters()), out)
    one = execute_and_commit(plan, open_storage(None, IOCounters()), f"s3://{bucket}/snap/one")
    assert res.manifest["snapshot_id"] == one.manifest["snapshot_id"]
    assert verify_obj(st, out)["ok"]


def _tensor_bytes(t):
    import math

    from mergepipe.formats.safetensors import DTYPES

    return math.prod(t.shape) * DTYPES[t.dtype][0]


def test_merge_workers_on_s3(s3_fam4):
    bucket, plan = s3_fam4
    res = run_workers(plan, open_storage(None, IOCounters()), f"s3://{bucket}/snap/w", 2)
    one = execute_and_commit(plan, open_storage(None, IOCounters()), f"s3://{bucket}/snap/w1")
    assert res.manifest["snapshot_id"] == one.manifest["snapshot_id"]
    assert res.manifest["io"]["realized"] == one.manifest["io"]["realized"]


@pytest.mark.parametrize("kill_after", [1, 3])
def test_plain_execute_resume_on_s3(s3_fam4, tmp_path, monkeypatch, capsys, kill_after):
    """`execute --resume` to S3 killed after its k-th object, rerun: only the missing shards are
    read and written again, and the objects equal a single-process merge's byte for byte."""
    from testkit.harness import run_cli
    from tests.integration.test_parts import KILL_PRELUDE

    bucket, plan = s3_fam4
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    out = f"s3://{bucket}/snap/plain-{kill_after}"
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            KILL_PRELUDE.format(after=kill_after),
            "execute",
            str(plan_file),
            "--out",
            out,
            "--resume",
        ],
        capture_output=True,
        cwd=Path(__file__).parents[2],
        env=dict(os.environ),
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    st = open_storage(None, IOCounters())
    assert read_manifest_obj(st, out) is None
    rc, so, err = run_cli(["execute", str(plan_file), "--out", out, "--resume", "--json"], monkeypatch, capsys)
    assert rc == 0, err
    m = read_manifest_obj(st, out)[0]
    (part,) = m["parts"]
    assert len(part["kept"]) == kill_after
    shards = partition(plan, 1)[0]
    kept_shards = [s for s in part["kept"] if s in shards]
    kept_base = sum(_tensor_bytes(t) for t in plan.tensors if t.file in kept_shards)
    one = execute_and_commit(plan, open_storage(None, IOCounters()), f"s3://{bucket}/snap/plain-one-{kill_after}")
    full = one.manifest["io"]["realized"]
    assert m["io"]["realized"]["base_read_bytes"] <= full["base_read_bytes"] - kept_base
    assert m["io"]["realized"]["output_write_bytes"] < full["output_write_bytes"]
    assert m["io"]["earlier_attempts"]["output_write_bytes"] > 0
    assert m["snapshot_id"] == one.manifest["snapshot_id"]
    a = _objects(st, f"s3://{bucket}/snap/plain-one-{kill_after}/{one.manifest['files_prefix']}/")
    b = _objects(st, f"{out}/{m['files_prefix']}/")
    assert a == b
