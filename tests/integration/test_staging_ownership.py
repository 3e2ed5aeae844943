"""Run ownership and verified publish (issue 12 item 1): two writers of one local --out on
different hosts (or PID namespaces) never produce a corrupt commit, and a publish checks every
manifest file before the rename. A single-process merge stages its files in its run folder
``.<name>.run-plan-<hex>`` (the one part of a run, issue 25) under --out's lock."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit.manifest import OutputLock, lock_path, staging_path, verify_snapshot
from mergepipe.errors import CommitConflict
from mergepipe.pipeline import merge
from mergepipe.storage.base import StorageError

ROOT = Path(__file__).resolve().parents[2]


def run_folder(out: Path) -> Path:
    """The run folder of the (only) plan written to ``out``: ``.<name>.run-plan-<hex>``."""
    (f,) = [q for q in out.parent.glob(f".{out.name}.run-plan-*") if q.is_dir() and q.suffix != ".records"]
    return f


def no_run_left(out: Path) -> bool:
    """Nothing of a run beside ``out``: no run folder, records or ownership record."""
    return not list(out.parent.glob(f".{out.name}.run-*"))


def _merge(family, out, catalog):
    base, experts = family
    return merge(
        str(base), [(e.name, str(e)) for e in experts], "ties", str(out), ["density=0.5"], catalog=Catalog(catalog)
    )


def _other_host_writer(family, out, home) -> subprocess.CompletedProcess:
    """`mergepipe merge` in another process that believes it runs on another host (the check the
    old staging cleanup relied on: host == gethostname() and pid alive)."""
    base, experts = family
    script = textwrap.dedent(f"""
        import socket, sys
        socket.gethostname = lambda: "another-node-{os.getpid()}"
        sys.argv = ["mergepipe", "merge", "--base", {str(base)!r}, "--out", {str(out)!r}, "--method", "ties",
                    "-p", "density=0.5", "--json"] + sum([["-e", e] for e in {[str(e) for e in experts]!r}], [])
        from mergepipe.cli import main
        main()
    """)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "MERGEPIPE_HOME": str(home)},
        timeout=600,
    )


def test_second_writer_on_another_host_is_refused_and_first_commits(family, tmp_path, monkeypatch):
    """Writer A is mid-merge (its shards staged) when writer B, on "another host", starts on the
    same --out. Before the fix B judged A's staging dead, deleted it and A committed a snapshot
    whose shards were missing (exit 0, verify failed). Now B stops at once with exit 2 and A's
    snapshot verifies."""
    from mergepipe.engine import executor

    out = tmp_path / "shared" / "snap"
    seen = {}
    real_execute = executor.execute

    def execute_then_other_writer(*a, **kw):
        res = real_execute(*a, **kw)
        seen["staged"] = sorted(p.name for p in run_folder(out).iterdir())
        seen["b"] = _other_host_writer(family, out, tmp_path / "home-b")
        seen["after_b"] = sorted(p.name for p in run_folder(out).iterdir())
        return res

    monkeypatch.setattr(executor, "execute", execute_then_other_writer)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    r = _merge(family, out, tmp_path / "a.sqlite")
    b = seen["b"]
    assert b.returncode == 2, b.stderr
    err = [ln for ln in b.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "another mergepipe process is writing it" in err[0] and "node-a" in err[0], b.stderr
    assert "Traceback" not in b.stderr and b.stdout == ""
    assert seen["after_b"] == seen["staged"] and seen["staged"], "B must not touch A's run folder"
    assert not r.already_committed
    v = verify_snapshot(out)
    assert v["ok"], v["problems"]
    assert no_run_left(out) and not lock_path(out).exists()
    # a rerun (e.g. B retried) finds the committed snapshot: exit 0, nothing rewritten
    again = _other_host_writer(family, out, tmp_path / "home-b")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["already_committed"] is True
    assert json.loads(again.stdout)["snapshot_id"] == r.manifest["snapshot_id"]


def test_dead_writers_staging_is_reclaimed(family, tmp_path):
    """A staging folder of an earlier version whose lock is free belongs to a dead writer (the
    kernel released its flock): the next writer commits; its content never reaches the snapshot
    (``gc`` reclaims the folder by its ownership record)."""
    out = tmp_path / "snap"
    st = staging_path(out)
    st.mkdir(parents=True)
    (st / "model-00001-of-00002.safetensors").write_bytes(b"half-written garbage")
    (st / "junk").write_text("x")
    lock_path(out).write_text("dead-host pid 1 since 2020-01-01T00:00:00Z\n")
    _merge(family, out, tmp_path / "c.sqlite")
    v = verify_snapshot(out)
    assert v["ok"], v["problems"]
    assert not (out / "junk").exists()


def test_killed_writer_releases_its_lock(family, tmp_path):
    """SIGKILL releases the flock: a child that holds the lock and dies leaves it reclaimable."""
    out = tmp_path / "snap"
    script = textwrap.dedent(f"""
        import os, signal
        from mergepipe.commit.manifest import OutputLock
        lock = OutputLock({str(out)!r}).acquire()
        print("locked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(ROOT))
    assert p.stdout.strip() == "locked" and p.returncode == -9
    assert lock_path(out).exists()
    with OutputLock(out):
        pass


def test_live_lock_is_exclusive_and_names_its_holder(tmp_path):
    out = tmp_path / "snap"
    with OutputLock(out):
        with pytest.raises(CommitConflict, match=socket.gethostname()):
            OutputLock(out).acquire()
    with OutputLock(out):  # released: free again
        pass


def test_publish_refuses_a_staging_folder_missing_a_file(family, tmp_path, monkeypatch):
    """publish verifies every manifest file (exists, recorded size) before the rename: a shard
    removed from staging after it was written fails the run; nothing appears at --out."""
    from mergepipe.engine import executor

    out = tmp_path / "snap"
    real_execute = executor.execute

    def execute_then_lose_a_shard(*a, **kw):
        res = real_execute(*a, **kw)
        shard = sorted(run_folder(out).glob("*.safetensors"))[0]
        shard.unlink()
        return res

    monkeypatch.setattr(executor, "execute", execute_then_lose_a_shard)
    with pytest.raises(CommitConflict, match="missing"):
        _merge(family, out, tmp_path / "c.sqlite")
    assert not out.exists() and no_run_left(out) and not lock_path(out).exists()


@pytest.mark.parametrize("tamper", ["truncate", "foreign"])
def test_publish_refuses_a_truncated_or_foreign_file(family, tmp_path, monkeypatch, tamper):
    """A shard truncated after it was recorded fails the run's record check (its bytes, read
    back, no longer give its recorded digest); a file the run did not write fails the publish's
    staged-file check. Nothing appears at --out either way."""
    from mergepipe.engine import executor

    out = tmp_path / "snap"
    real_execute = executor.execute

    def execute_then_tamper(*a, **kw):
        res = real_execute(*a, **kw)
        if tamper == "truncate":
            shard = sorted(run_folder(out).glob("*.safetensors"))[0]
            with open(shard, "r+b") as f:
                f.truncate(100)
        else:
            (run_folder(out) / "extra.bin").write_bytes(b"x")
        return res

    monkeypatch.setattr(executor, "execute", execute_then_tamper)
    with pytest.raises(CommitConflict) as ei:
        _merge(family, out, tmp_path / "c.sqlite")
    if tamper == "truncate":
        assert "model-00001-of-00002.safetensors" in str(ei.value) and "--part 0/1" in str(ei.value)
    else:
        assert "extra.bin: not written by this run" in str(ei.value)
    assert not out.exists() and no_run_left(out)


def test_writer_never_recreates_a_removed_staging_folder(family, tmp_path, monkeypatch):
    """Before the fix LocalWriter recreated folders (makedirs(exist_ok=True)), so a staging (now:
    run) folder removed mid-run came back half-empty; now the next file write fails the run."""
    from mergepipe.storage import local

    out = tmp_path / "snap"
    real_close = local.LocalWriter.close
    calls = {"n": 0}

    def close_then_remove_staging(self):
        n = real_close(self)
        calls["n"] += 1
        if calls["n"] == 1:
            shutil.rmtree(run_folder(out))
        return n

    monkeypatch.setattr(local.LocalWriter, "close", close_then_remove_staging)
    with pytest.raises(StorageError, match="does not exist"):
        _merge(family, out, tmp_path / "c.sqlite")
    assert not out.exists() and no_run_left(out)
