"""Atomic publish: a merge killed (SIGKILL) at any moment leaves nothing at the output path, and
a rerun succeeds with the same snapshot as an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.synth import llama_like_shapes, make_family


@pytest.fixture(scope="module")
def medium_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("medium")
    shapes = llama_like_shapes(hidden=384, inter=1024, layers=4, vocab=4096)
    return make_family(root, 3, seed=21, shapes=shapes, n_shards=3)


def _cmd(base, experts, out):
    args = [sys.executable, "-m", "mergepipe.cli", "merge", "--base", str(base)]
    for e in experts:
        args += ["--expert", str(e)]
    return args + ["--out", str(out), "--method", "dare_ties", "--param", "density=0.5", "--budget", "60%", "--json"]


def _visible(parent: Path, name: str) -> list:
    return [p.name for p in parent.iterdir() if p.name == name or (not p.name.startswith("."))]


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_nothing_and_rerun_succeeds(medium_family, tmp_path):
    base, experts = medium_family
    env = {**os.environ, "MERGEPIPE_HOME": str(tmp_path / "home")}
    outdir = tmp_path / "outs"
    outdir.mkdir()
    out = outdir / "snap"
    # a clean reference run elsewhere (own catalog) to compare with
    ref = subprocess.run(
        _cmd(base, experts, tmp_path / "ref"),
        capture_output=True,
        text=True,
        env={**env, "MERGEPIPE_HOME": str(tmp_path / "home-ref")},
    )
    assert ref.returncode == 0, ref.stderr
    ref_res = json.loads(ref.stdout)

    rng = random.Random(0)
    kills = 0
    staged_seen = 0
    # ("time", t): kill t seconds after start (imports, analysis); ("staged", t): kill t seconds after the
    # run folder .snap.run-plan-<hex> appears (while shards are being written), whatever the machine's speed
    moments = [
        ("time", 0.05),
        ("time", 0.8),
        ("staged", 0.0),
        ("staged", 0.05),
        ("staged", 0.2),
        ("staged", rng.uniform(0.0, 0.5)),
        ("staged", rng.uniform(0.0, 1.0)),
    ]
    for mode, delay in moments:
        p = subprocess.Popen(_cmd(base, experts, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        t0 = time.time()
        staged = False
        while p.poll() is None and time.time() - t0 < 120:
            staged = staged or any(x.name.startswith(".snap.run-") for x in outdir.iterdir())
            if mode == "time" and time.time() - t0 >= delay:
                break
            if mode == "staged" and staged:
                time.sleep(delay)
                break
            time.sleep(0.002)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
            staged_seen += staged
        p.communicate()
        if p.returncode == 0:
            break  # finished before the kill: the snapshot is complete and committed
        assert not out.exists(), f"killed ({mode}, {delay:.2f}s) left {out}"
        assert _visible(outdir, "snap") == [], "only hidden run folders may remain"
    assert kills >= 2 and staged_seen >= 1, "the kills must land during analysis and during writing"
    done = subprocess.run(_cmd(base, experts, out), capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    # the same snapshot as the clean run with its own catalog, byte for byte
    ref_manifest = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["outputs"] == ref_manifest["outputs"]
    # the plain rerun resumes the killed run (a single-process merge is a run of one part): the
    # files it kept were read back, not merged again, and their bytes are the earlier attempts'
    (part,) = manifest["parts"]
    realized, ref_io = manifest["io"]["realized"], ref_manifest["io"]["realized"]
    if not part["kept"]:
        assert realized == ref_io and "earlier_attempts" not in manifest["io"]
    else:
        assert "resuming this plan's interrupted run" in done.stderr, done.stderr
        for k in ("base_read_bytes", "expert_read_bytes", "output_write_bytes"):
            assert realized[k] <= ref_io[k], k
        assert realized["output_write_bytes"] < ref_io["output_write_bytes"]
    assert (
        manifest["snapshot_id"] == ref_manifest["snapshot_id"]
        and manifest["plan_digest"] == ref_manifest["plan_digest"]
    )
    assert (res["snapshot_id"], ref_res["snapshot_id"]) == (manifest["snapshot_id"], ref_manifest["snapshot_id"])
    assert [x.name for x in outdir.iterdir() if x.name.startswith(".snap.run-")] == [], "the run is not cleaned"
    v = subprocess.run(
        [sys.executable, "-m", "mergepipe.cli", "verify", str(out), "--json"], capture_output=True, text=True, env=env
    )
    assert v.returncode == 0 and json.loads(v.stdout)["ok"]


def test_failure_mid_execution_leaves_nothing(family, tmp_path, monkeypatch):
    """An exception inside the engine (here: a write error) removes the run (its folder, records
    and ownership record)."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge
    from mergepipe.storage import local

    base, experts = family
    calls = {"n": 0}
    orig = local.LocalWriter.write

    def flaky(self, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return orig(self, data)

    monkeypatch.setattr(local.LocalWriter, "write", flaky)
    with pytest.raises(OSError):
        merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            "ties",
            str(tmp_path / "o"),
            ["density=0.5"],
            catalog=Catalog(tmp_path / "c.sqlite"),
        )
    assert not (tmp_path / "o").exists()
    assert list(tmp_path.glob(".o.run-*")) == []
    monkeypatch.setattr(local.LocalWriter, "write", orig)
    r = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(tmp_path / "o"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
    )
    assert (Path(r.out) / "manifest.json").exists()


def test_manifest_contents(family, tmp_path):
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.commit.manifest import manifest_hash
    from mergepipe.pipeline import merge

    base, experts = family
    r = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(tmp_path / "o"),
        ["density=0.5"],
        budget="50%",
        catalog=Catalog(tmp_path / "c.sqlite"),
        seed=9,
    )
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest_hash((tmp_path / "o" / "manifest.json").read_bytes()) == r.manifest_hash
    assert m["plan_digest"] == r.plan.digest and m["seed"] == 9
    assert len(m["inputs"]["experts"]) == 3 and all(len(e["content_digest"]) == 64 for e in m["inputs"]["experts"])
    assert len(m["inputs"]["base"]["content_digest"]) == 64
    files = {p.name for p in (tmp_path / "o").iterdir()} - {"manifest.json"}
    assert set(m["outputs"]) == files
    assert (
        m["io"]["realized"]["expert_read_bytes"]
        <= m["io"]["estimated"]["expert_read_bytes"]
        <= m["io"]["expert_budget_bytes"]
    )
    assert sum(m["touched_blocks"].values()) > 0
    assert {"python", "numpy", "torch", "mergepipe"} <= set(m["versions"])
    idx = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == {f for f in files if f.endswith(".safetensors")}


def test_two_catalogs_give_one_snapshot_id(family, tmp_path):
    """The same merge planned from two catalogs (two MERGEPIPE_HOMEs) is one plan digest and one
    snapshot id: the digest holds each expert's sketch blob by its name under the catalog
    (``sketches/<base>/<expert>...``), not by where the catalog is; execution reads the blob at the
    plan's location and checks it against the per-block digests."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge

    base, experts = family
    got = []
    for home in ("home-a", "home-b/deeper"):
        r = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            "ties",
            str(tmp_path / home / "out"),
            ["density=0.5"],
            budget="30%",
            catalog=Catalog(tmp_path / home / "catalog.sqlite"),
        )
        got.append(r)
    a, b = got
    uris = [[e.sketch["uri"] for e in r.plan.experts if e.sketch] for r in got]
    assert uris[0] and all(u.startswith(str(tmp_path / "home-a")) for u in uris[0])  # the tiers were used...
    assert all(u.startswith(str(tmp_path / "home-b")) for u in uris[1])  # ...from each run's own catalog
    assert a.plan.io.sketch_read_bytes > 0 and a.plan.digest == b.plan.digest
    assert a.manifest["snapshot_id"] == b.manifest["snapshot_id"]
    assert a.manifest["outputs"] == b.manifest["outputs"]
    assert a.manifest["io"]["realized"] == b.manifest["io"]["realized"]
