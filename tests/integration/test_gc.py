"""``mergepipe gc`` deletes only what carries proof that it is mergepipe's garbage (issue 22 item 1):
areas created with an ownership record naming their owner --out exactly, not committed, not in use.
Debris of killed merges (real processes killed with SIGKILL) is removed locally and on a real S3
server (SeaweedFS); committed snapshots whose path looks like a run, foreign objects shaped like
runs, a sibling's debris, a run whose id ends in ``.staging`` and a commit in progress are kept;
``--dry-run`` leaves the tree byte-identical; ``gc .`` equals ``gc /abs/path``."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit import manifest as manifest_mod, objectstore, ownership
from mergepipe.commit.gc import collect
from mergepipe.commit.manifest import OutputLock, lock_path, staging_path, verify_snapshot
from mergepipe.commit.objectstore import verify_obj
from mergepipe.engine.partition import PartSpec
from mergepipe.errors import CommitConflict
from mergepipe.parts import commit_run, execute_part
from mergepipe.pipeline import build_plan, merge
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]
WEEK = 7 * 86400


def _keys(client, bucket, prefix=""):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def _uploads(client, bucket):
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _merge(family, out, catalog, **kw):
    base, experts = family
    return merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(out),
        ["density=0.5"],
        catalog=Catalog(catalog),
        **kw,
    )


def _plan(family, catalog):
    base, experts = family
    st = open_storage(None, IOCounters())
    req = request_from_args(str(base), [(e.name, str(e)) for e in experts], "ties", ["density=0.5"])
    return build_plan(Catalog(catalog), st, req), st


#: a `mergepipe merge` killed with SIGKILL right before it publishes (everything staged or uploaded)
_KILLED = textwrap.dedent("""
    import os, signal, sys
    from mergepipe.commit import manifest, objectstore
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    manifest.publish_local = die
    objectstore.publish_obj = die
    import mergepipe.commit.target as t
    t.publish_local = die
    from mergepipe.cli import main
    sys.argv = ["mergepipe", "merge", "--base", sys.argv[1], "--out", sys.argv[2], "--method", "ties",
                "-p", "density=0.5"] + sum([["-e", e] for e in sys.argv[3:]], [])
    main()
""")


def _killed_merge(family, out, home):
    base, experts = family
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(base), str(out), *[str(e) for e in experts]],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "MERGEPIPE_HOME": str(home)},
        timeout=600,
    )
    assert p.returncode == -9, p.stderr


def _run_of(out: Path) -> Path:
    """The run folder a killed single-process merge left beside ``out`` (a run of one part)."""
    (f,) = [q for q in out.parent.glob(f".{out.name}.run-plan-*") if q.is_dir() and q.suffix != ".records"]
    return f


def _legacy_staging(out: Path) -> None:
    """What a single-process merge killed before publishing left in versions before runs of one
    part: a staging folder with its ownership record (and a free lock)."""
    ownership.write_record(
        open_storage(None, IOCounters()),
        str(staging_path(out)),
        ownership.make_record("staging", str(out), None, "0" * 64),
    )
    staging_path(out).mkdir()
    (staging_path(out) / "model.safetensors").write_bytes(b"half")


def _tree(root: Path) -> dict:
    """Every entry under ``root`` (and its hidden siblings) with type, mode, size, mtime and content
    hash: what a dry run must leave identical."""
    out = {}
    tops = [root, *(p for p in root.parent.iterdir() if p.name.startswith(f".{root.name}."))]
    for top in tops:
        for dp, dns, fns in os.walk(top):
            for n in [".", *dns, *fns]:
                p = os.path.join(dp, n)
                st = os.lstat(p)
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest() if os.path.isfile(p) else None
                out[os.path.normpath(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def _age(*paths, by=WEEK):
    t = time.time() - by
    for top in paths:
        for dp, dns, fns in os.walk(top):
            for n in [*dns, *fns]:
                os.utime(os.path.join(dp, n), (t, t), follow_symlinks=False)
        if os.path.lexists(top):
            os.utime(top, (t, t), follow_symlinks=False)


def test_gc_local_removes_proven_debris_only(family, tmp_path, monkeypatch, capsys):
    """Killed writers' runs (with records) and an earlier version's staging go; a committed
    --out whose path contains runs/<16 hex>/, a sibling's debris, a run whose id ends in
    `.staging` and debris without a record stay (the last listed as unproven)."""
    root = tmp_path / "snaps"
    root.mkdir()
    cat = tmp_path / "c.sqlite"
    trap = root / "a" / "runs" / "0123456789abcdef" / "x"  # a user's --out shaped like a run
    done = _merge(family, trap, cat)
    _killed_merge(family, root / "dead", tmp_path / "home")  # its run + records + record + free lock
    dead_run = _run_of(root / "dead")
    assert lock_path(root / "dead").exists() and list(dead_run.iterdir())
    _legacy_staging(root / "gone")
    plan, st = _plan(family, cat)
    execute_part(plan, st, str(root / "run"), PartSpec(0, 2))  # an abandoned partitioned run
    execute_part(plan, st, str(root / "r"), PartSpec(0, 2), run="w.staging")  # run id ending in .staging
    legacy = root / ".old.staging-0123456789ab"  # a pre-record version's staging: no record
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"x")
    _age(*root.iterdir(), root / "a")

    code, out, err = run_cli(["gc", str(root), "--grace", "1h", "--json"], monkeypatch, capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["removed_staging"] == [str(staging_path(root / "gone"))]
    assert sorted(rep["deleted_runs"]) == sorted(
        [str(root / ".r.run-w.staging"), str(root / ".run.run-") + plan_run(plan), str(dead_run)]
    )
    assert not staging_path(root / "gone").exists() and not dead_run.exists()
    assert not lock_path(root / "dead").exists() and not list(root.glob(".dead.run-*"))
    assert not list(root.glob(".run.run-*")) and not list(root.glob(".r.run-*"))
    assert legacy.exists() and any(str(legacy) in u for u in rep["unproven"])
    assert verify_snapshot(done.out)["ok"] and (trap / "manifest.json").exists()


def plan_run(plan):
    return "plan-" + plan.digest[:16]


def test_gc_of_one_out_spares_its_sibling_and_dot_equals_abs(family, tmp_path, monkeypatch, capsys):
    root = tmp_path / "snaps"
    root.mkdir()
    for name in ("a", "a.b"):
        _killed_merge(family, root / name, tmp_path / "home")
    (root / "a").mkdir()  # the --out of `gc snaps/a` exists (an empty folder)
    monkeypatch.chdir(root / "a")
    dot = collect(open_storage(None, IOCounters()), ".", grace_s=0, dry_run=True)
    ab = collect(open_storage(None, IOCounters()), str(root / "a"), grace_s=0, dry_run=True)
    assert dot.as_dict() == ab.as_dict()
    run_a, run_ab = _run_of(root / "a"), _run_of(root / "a.b")
    assert dot.deleted_runs == [str(run_a)]
    code, _out, err = run_cli(["gc", ".", "--grace", "0"], monkeypatch, capsys)
    assert code == 0, err
    assert not run_a.exists() and not list(root.glob(".a.run-*"))
    assert run_ab.is_dir() and lock_path(root / "a.b").exists()


def test_gc_dry_run_leaves_the_tree_byte_identical(family, tmp_path, monkeypatch, capsys):
    root = tmp_path / "snaps"
    root.mkdir()
    _killed_merge(family, root / "dead", tmp_path / "home")
    _legacy_staging(root / "old")
    plan, st = _plan(family, tmp_path / "c.sqlite")
    execute_part(plan, st, str(root / "run"), PartSpec(1, 2))
    _age(*root.iterdir())
    before = _tree(root)
    code, out, err = run_cli(["gc", str(root), "--grace", "0", "--dry-run", "--json"], monkeypatch, capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["removed_staging"] and len(rep["deleted_runs"]) == 2
    assert _tree(root) == before


def test_gc_waits_for_a_local_commit(family, tmp_path, monkeypatch):
    """gc (grace 0) runs between the commit's staged-file check and its rename: the commit holds
    the output lock, gc keeps the run, the snapshot commits and verifies."""
    plan, st = _plan(family, tmp_path / "c.sqlite")
    out = tmp_path / "snaps" / "snap"
    execute_part(plan, st, str(out), PartSpec(0, 1))
    seen = {}
    real = manifest_mod.check_staged_files

    def check_then_gc(staging, outputs):
        real(staging, outputs)
        seen["gc"] = collect(open_storage(None, IOCounters()), str(out.parent), grace_s=0)

    monkeypatch.setattr(manifest_mod, "check_staged_files", check_then_gc)
    r = commit_run(plan, st, str(out))
    assert seen["gc"].deleted_runs == [] and seen["gc"].kept_in_use, seen["gc"]
    assert verify_snapshot(out)["ok"] and r.manifest["plan_digest"] == plan.digest


def test_gc_keeps_a_live_writer_and_unrecorded_locks(family, tmp_path):
    root = tmp_path / "snaps"
    alive = root / "alive"
    root.mkdir()
    held = OutputLock(alive).acquire()
    try:
        ownership.write_record(
            open_storage(None, IOCounters()),
            str(staging_path(alive)),
            ownership.make_record("staging", str(alive), None, "0" * 64),
        )
        staging_path(alive).mkdir()
        old_lock = root / ".gone.lock"
        old_lock.write_text("gone pid 1\n")  # a lock file of a version before lock records
        _age(old_lock)
        rep = collect(open_storage(None, IOCounters()), str(root), grace_s=0)
    finally:
        held.release()
    assert rep.kept_in_use == [str(staging_path(alive))] and staging_path(alive).is_dir()
    assert old_lock.exists() and any(str(old_lock) in u for u in rep.unproven)


@pytest.mark.s3
def test_gc_on_s3_removes_proven_debris_only(s3_env, family, tmp_path, monkeypatch, capsys):
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("gc")
    st = open_storage(None, IOCounters())
    cat = tmp_path / "c.sqlite"
    snap = f"s3://{bucket}/snaps/a"
    r = _merge(family, snap, cat, storage=st)
    live_run = r.manifest["files_prefix"]
    trap = f"s3://{bucket}/snaps/a/runs/0123456789abcdef/x"  # a committed --out shaped like a run of a
    t = _merge(family, trap, cat, storage=st)
    _killed_merge(family, f"s3://{bucket}/snaps/b", tmp_path / "home")  # an orphan run with a record
    plan, _ = _plan(family, cat)
    execute_part(plan, st, f"s3://{bucket}/snaps/c", PartSpec(0, 2))  # abandoned part
    orphan = [k for k in _keys(c, bucket, "snaps/b/runs/") if k.endswith(".owner.json")]
    assert len(orphan) == 1
    orphan_run = orphan[0][: -len(".owner.json")]
    up1 = c.create_multipart_upload(Bucket=bucket, Key=f"{orphan_run}/model.safetensors")
    c.upload_part(
        Bucket=bucket, Key=f"{orphan_run}/model.safetensors", UploadId=up1["UploadId"], PartNumber=1, Body=b"z"
    )
    c.create_multipart_upload(Bucket=bucket, Key=f"snaps/a/{live_run}/model.safetensors")
    # not proven mergepipe's: objects and uploads with the old name shapes, and others
    c.put_object(Bucket=bucket, Key="snaps/a/runs/00000000000000aa/model.safetensors", Body=b"x")
    c.put_object(Bucket=bucket, Key="snaps/d/runs/plan-00000000000000dd.records/part-0-of-2.json", Body=b"{}")
    c.create_multipart_upload(Bucket=bucket, Key="snaps/e/runs/00000000000000cc/model.safetensors")
    c.put_object(Bucket=bucket, Key="snaps/other/data.bin", Body=b"keep")
    c.create_multipart_upload(Bucket=bucket, Key="snaps/other/big.bin")
    foreign = set(_keys(c, bucket, "snaps/"))

    young = collect(st, f"s3://{bucket}/snaps", grace_s=3600)
    assert young.deleted_runs == [] and young.aborted_uploads == [] and len(young.kept_young) == 4, young
    dry = collect(st, f"s3://{bucket}/snaps", grace_s=0, dry_run=True)
    assert set(_keys(c, bucket, "snaps/")) == foreign and len(dry.deleted_runs) == 2

    code, out, err = run_cli(["gc", f"s3://{bucket}/snaps", "--grace", "0", "--json"], monkeypatch, capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert sorted(rep["deleted_runs"]) == sorted(
        [f"s3://{bucket}/{orphan_run}", f"s3://{bucket}/snaps/c/runs/{plan_run(plan)}"]
    )
    assert len(rep["aborted_uploads"]) == 2
    assert sorted(_uploads(c, bucket)) == ["snaps/e/runs/00000000000000cc/model.safetensors", "snaps/other/big.bin"]
    keys = set(_keys(c, bucket, "snaps/"))
    assert not any(k.startswith(orphan_run) or k.startswith("snaps/c/") for k in keys)
    assert {
        "snaps/a/runs/00000000000000aa/model.safetensors",
        "snaps/d/runs/plan-00000000000000dd.records/part-0-of-2.json",
        "snaps/other/data.bin",
    } <= keys
    assert len([u for u in rep["unproven"] if "00000000000000" in u]) == 3, rep["unproven"]
    assert verify_obj(st, snap)["ok"] and verify_obj(st, trap)["ok"]
    assert t.manifest["snapshot_id"] == verify_obj(st, trap)["snapshot_id"]
    code, out, _ = run_cli(["gc", f"s3://{bucket}/snaps", "--grace", "0", "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["deleted_runs"] == [] and json.loads(out)["aborted_uploads"] == []


@pytest.mark.s3
def test_gc_and_an_s3_commit_exclude_each_other(s3_env, family, tmp_path, monkeypatch):
    """gc (grace 0) runs while a commit verifies its outputs: it sees the commit's intent and keeps
    the run; the snapshot commits. A run gc has claimed is refused by the commit (nothing published)."""
    bucket = s3_env.make_bucket("gcrace")
    st = open_storage(None, IOCounters())
    plan, _ = _plan(family, tmp_path / "c.sqlite")
    out = f"s3://{bucket}/snap"
    execute_part(plan, st, out, PartSpec(0, 1))
    seen = {}
    real = objectstore.verify_outputs_exist

    def verify_then_gc(*a, **kw):
        seen["gc"] = collect(st, f"s3://{bucket}", grace_s=0)
        return real(*a, **kw)

    monkeypatch.setattr(objectstore, "verify_outputs_exist", verify_then_gc)
    r = commit_run(plan, st, out)
    assert seen["gc"].deleted_runs == [] and seen["gc"].kept_in_use, seen["gc"]
    assert verify_obj(st, out)["ok"] and not r.already_committed
    monkeypatch.setattr(objectstore, "verify_outputs_exist", real)

    out2 = f"s3://{bucket}/snap2"
    execute_part(plan, st, out2, PartSpec(0, 1))
    area = f"{out2}/runs/{plan_run(plan)}"
    assert ownership.claim_for_gc(st, area, time.time())
    with pytest.raises(CommitConflict, match="gc"):
        commit_run(plan, st, out2)
    assert not st.exists(f"{out2}/manifest.json")


def test_planted_lock_symlink_is_refused_and_victim_untouched(family, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "snaps" / "snap"
    out.parent.mkdir()
    os.symlink(victim, lock_path(out))
    base, experts = family
    args = ["merge", "--base", str(base), "--out", str(out), "--method", "ties", "-p", "density=0.5"]
    args += sum([["-e", str(e)] for e in experts], [])
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "symbolic link" in err and len(err.strip().splitlines()) == 1, err
    code, _out, err = run_cli(["gc", str(out.parent), "--grace", "0", "--dry-run"], monkeypatch, capsys)
    assert code == 0, err
    code, _out, err = run_cli(["gc", str(out.parent), "--grace", "0"], monkeypatch, capsys)
    assert code == 0, err
    assert victim.read_text() == "precious\n" and not out.exists()


@pytest.mark.parametrize("grace", ["-1", "1e999", "soon", "nan"])
def test_gc_refuses_bad_grace(tmp_path, monkeypatch, capsys, grace):
    code, out, err = run_cli(["gc", str(tmp_path), "--grace", grace], monkeypatch, capsys)
    assert code == 2 and "--grace" in err and len(err.strip().splitlines()) == 1


@pytest.mark.s3
def test_gc_on_a_missing_bucket_is_one_line(s3_env, monkeypatch, capsys):
    code, out, err = run_cli(["gc", "s3://no-such-bucket-mergepipe/x", "--dry-run"], monkeypatch, capsys)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "no-such-bucket-mergepipe" in lines[0] and "Traceback" not in err, err
