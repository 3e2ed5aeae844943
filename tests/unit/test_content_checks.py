"""Everything the engine reads is checked by content before anything is published (issue 22).

Real checkpoints (testkit/synth.py, bf16 safetensors), the real SQLite catalog and CLI: a block
sketch blob or an expert block replaced by other bytes of the same size, another expert's
sketch, or a plan pointing a sketch elsewhere is refused with exit code 2 and one line naming
the expert and the fix, and nothing appears at ``--out``. Missing sketch blobs are re-created
by analyze; damaged statistics are named, and ``analyze --force`` repairs them.
"""

import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage
from testkit.harness import run_cli


@pytest.fixture
def fam(tmp_path):
    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "fam", 2, seed=7)
    return tmp_path, base, experts


def _merge_args(tmp, base, experts, out, budget="20%", extra=()):
    args = ["merge", "--base", str(base), "--method", "ties", "-p", "density=0.5", "--out", str(out)]
    for e in experts:
        args += ["--expert", str(e)]
    return [*args, "--budget", budget, "--block-size", "4096", "--catalog", str(tmp / "c.sqlite"), *extra]


def _one_line_refusal(code, err, out_dir, *needles):
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "━" not in ln and " kB " not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # (the progress bar aside)
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    assert not Path(out_dir).exists() or not any(Path(out_dir).iterdir())
    assert not [p for p in Path(out_dir).parent.glob(f".{Path(out_dir).name}*") if p.name.endswith(".staging")]


def _analyses(tmp, base, experts):
    cat = Catalog(tmp / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    es = [cat.register(st, str(e)) for e in experts]
    return cat, b, es, cat.analyze(st, b, es, block_bytes=4096)


def _plan_with_sketches(tmp, base, experts, monkeypatch, capsys, budget="20%"):
    plan_file = tmp / "plan.json"
    args = ["plan", "--base", str(base), "--method", "ties", "-p", "density=0.5", "--budget", budget]
    for e in experts:
        args += ["--expert", str(e)]
    args += ["--block-size", "4096", "--catalog", str(tmp / "c.sqlite"), "--out", str(plan_file)]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(plan_file.read_text())
    assert any(te["sketch_blocks"] for tp in plan["tensors"] for te in tp["experts"])
    return plan_file, plan


def test_same_size_sketch_with_other_bytes_is_refused(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    _, _, _, an = _analyses(tmp, base, experts)
    blob = Path(an[0].sketch["uri"])
    data = np.frombuffer(blob.read_bytes(), dtype=np.uint8) ^ np.uint8(0x55)  # same size, other bytes
    blob.write_bytes(data.tobytes())
    out = tmp / "out"
    code, _, err = run_cli(_merge_args(tmp, base, experts, out), monkeypatch, capsys)
    _one_line_refusal(code, err, out, "sketch of expert", experts[0].name, "analyze --force")


def test_another_experts_sketch_blob_is_refused(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    _, _, _, an = _analyses(tmp, base, experts)
    a, b = Path(an[0].sketch["uri"]), Path(an[1].sketch["uri"])
    assert a.stat().st_size == b.stat().st_size  # same architecture: same-size blobs
    shutil.copyfile(b, a)
    out = tmp / "out"
    code, _, err = run_cli(_merge_args(tmp, base, experts, out), monkeypatch, capsys)
    _one_line_refusal(code, err, out, "sketch of expert", experts[0].name)


def test_plan_pointing_a_sketch_outside_the_catalog_is_refused(fam, monkeypatch, capsys):
    """A plan whose sketch uri names any other file (of the right size, the digest recomputed so
    the plan is self-consistent) is refused before a byte of it is read."""
    from mergepipe.planner.plan import Plan

    tmp, base, experts = fam
    plan_file, plan = _plan_with_sketches(tmp, base, experts, monkeypatch, capsys)
    sk = plan["experts"][0]["sketch"]
    foreign = tmp / "elsewhere.bin"
    foreign.write_bytes(os.urandom(sk["bytes"]))
    for uri in (str(foreign), str(tmp / "sketches" / "x" / Path(sk["uri"]).name), plan["experts"][1]["sketch"]["uri"]):
        plan["experts"][0]["sketch"]["uri"] = uri
        p = Plan.model_validate(plan)
        p.digest = ""
        plan_file.write_text(p.seal().to_json())
        out = tmp / "out"
        code, _, err = run_cli(["execute", str(plan_file), "--out", str(out)], monkeypatch, capsys)
        _one_line_refusal(code, err, out, "experts[0].sketch.uri", "not the catalog location")


def test_sketch_blob_is_in_the_plan_digest_and_its_location_is_checked(fam, monkeypatch, capsys):
    """The digest holds which sketch blob an expert's tiers read (its name under the catalog), so
    naming another expert's blob breaks the digest; where the catalog lies is not in the digest
    (two catalogs plan one digest), but a location outside the catalog's shape (``..``) is
    refused when the plan is loaded."""
    from mergepipe.errors import InputError
    from mergepipe.planner.plan import Plan

    tmp, base, experts = fam
    plan_file, plan = _plan_with_sketches(tmp, base, experts, monkeypatch, capsys)
    uri = plan["experts"][0]["sketch"]["uri"]
    other = json.loads(json.dumps(plan))
    other["experts"][0]["sketch"]["uri"] = plan["experts"][1]["sketch"]["uri"]
    with pytest.raises(InputError, match="digest does not match"):
        Plan.from_json(json.dumps(other))
    moved = json.loads(json.dumps(plan))
    moved["experts"][0]["sketch"]["uri"] = "/elsewhere/catalog/" + uri[uri.rindex("sketches/") :]
    assert Plan.from_json(json.dumps(moved)).digest == plan["digest"]
    plan["experts"][0]["sketch"]["uri"] = uri.replace("sketches", "sketches/../sketches")
    with pytest.raises(InputError, match="not the catalog location"):
        Plan.from_json(json.dumps(plan))


def _touch_back(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_same_size_edit_of_an_expert_after_analyze_is_refused(fam, monkeypatch, capsys):
    """An expert edited in place after analyze, same size and mtime restored (so the catalog's
    stat signature still matches): the merge refuses the block it reads instead of merging it
    with stale statistics."""
    from safetensors import safe_open

    tmp, base, experts = fam
    out0 = tmp / "first"
    code, _, err = run_cli(
        _merge_args(tmp, base, experts, out0, budget="100%", extra=["--sketch", "none"]), monkeypatch, capsys
    )
    assert code == 0, err
    shard = sorted(experts[1].glob("*.safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        name = next(n for n in f.keys() if len(f.get_slice(n).get_shape()) == 2)
    hdr = int.from_bytes(shard.read_bytes()[:8], "little")
    meta = json.loads(shard.read_bytes()[8 : 8 + hdr])[name]
    st = shard.stat()
    with open(shard, "r+b") as fh:
        fh.seek(8 + hdr + meta["data_offsets"][0] + 2)
        fh.write(b"\x7f\x3f")
    _touch_back(shard, st)
    out = tmp / "out"
    code, _, err = run_cli(
        _merge_args(tmp, base, experts, out, budget="100%", extra=["--sketch", "none"]), monkeypatch, capsys
    )
    _one_line_refusal(code, err, out, "differs from the bytes the catalog analyzed", experts[1].name, "re-run")


def test_missing_sketch_blob_is_recreated_by_analyze(fam, monkeypatch, capsys):
    """The advice of a missing blob works: `mergepipe analyze` (and `merge`) re-create it."""
    tmp, base, experts = fam
    _, _, _, an = _analyses(tmp, base, experts)
    blob = Path(an[0].sketch["uri"])
    want = blob.read_bytes()
    blob.unlink()
    args = ["analyze", "--base", str(base), "--expert", str(experts[0]), "--block-size", "4096"]
    code, _, err = run_cli([*args, "--catalog", str(tmp / "c.sqlite")], monkeypatch, capsys)
    assert code == 0, err
    assert blob.read_bytes() == want
    blob.unlink()
    code, _, err = run_cli(_merge_args(tmp, base, experts, tmp / "out"), monkeypatch, capsys)
    assert code == 0, err
    assert blob.read_bytes() == want


def test_damaged_statistics_are_named_and_analyze_force_repairs(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    _analyses(tmp, base, experts)
    db = sqlite3.connect(tmp / "c.sqlite")
    with db:
        db.execute(
            "UPDATE expert_stats SET stats = X'504B0304deadbeef' WHERE rowid = (SELECT min(rowid) FROM expert_stats)"
        )
    db.close()
    out = tmp / "out"
    code, _, err = run_cli(_merge_args(tmp, base, experts, out), monkeypatch, capsys)
    _one_line_refusal(code, err, out, "are damaged", "analyze --force")
    args = ["analyze", "--base", str(base), "--force", "--block-size", "4096", "--catalog", str(tmp / "c.sqlite")]
    for e in experts:
        args += ["--expert", str(e)]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(_merge_args(tmp, base, experts, out), monkeypatch, capsys)
    assert code == 0, err


def test_sensitivity_blob_is_read_without_pickle(tmp_path):
    """A catalog sensitivity blob is data: a pickled object array in it is never unpickled."""
    import io

    from mergepipe.catalog.sensitivity import fisher_from_bytes, fisher_to_bytes
    from mergepipe.errors import InputError

    f = {"a.weight": np.arange(3, dtype=np.float64), "b": np.ones(1)}
    got = fisher_from_bytes(fisher_to_bytes(f))
    assert list(got) == list(f) and all(np.array_equal(got[k], f[k]) for k in f)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    np.savez(buf, t0=np.ones(2), names=np.array([Evil()], dtype=object))
    with pytest.raises(InputError, match="not a sensitivity blob"):
        fisher_from_bytes(buf.getvalue(), "s3://cat/sensitivity/x")
    assert not marker.exists()
