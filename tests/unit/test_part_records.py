"""Part files are checked by content and part records are typed (issue 22 items 4 and 5): the
commit reads every part file back and recomputes its digest, so a same-size edit or another plan's
part copied into the run is refused before anything is published (locally and on SeaweedFS); a
record with a negative byte count, an unknown key or more bytes than planned is refused with one
line naming the record and the field; the typed model imports without torch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit import runs
from mergepipe.engine.partition import PartSpec
from mergepipe.errors import CommitConflict
from mergepipe.parts import commit_run, execute_part
from mergepipe.pipeline import build_plan
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _plan(family, catalog, density="0.5"):
    base, experts = family
    req = request_from_args(str(base), [(e.name, str(e)) for e in experts], "ties", [f"density={density}"])
    return build_plan(Catalog(catalog), open_storage(None, IOCounters()), req)


@pytest.fixture()
def run2(family, tmp_path):
    """A plan executed as 2 parts into a local run (not committed), and its plan file."""
    plan = _plan(family, tmp_path / "c.sqlite")
    st = open_storage(None, IOCounters())
    out = tmp_path / "snap"
    for i in range(2):
        execute_part(plan, st, str(out), PartSpec(i, 2))
    pf = tmp_path / "plan.json"
    pf.write_text(plan.to_json())
    layout = runs.run_layout(st, str(out), runs.default_run_id(plan.digest), False)
    return plan, st, out, pf, layout


def _commit_cli(pf, out, monkeypatch, capsys):
    code, _o, err = run_cli(["commit", str(pf), "--out", str(out)], monkeypatch, capsys)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_same_size_edit_of_a_part_file_is_refused(run2, monkeypatch, capsys):
    plan, st, out, pf, layout = run2
    shard = sorted(p for p in Path(layout.files).iterdir() if p.name.endswith(".safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a tensor byte, same size
    shard.write_bytes(bytes(data))
    line = _commit_cli(pf, out, monkeypatch, capsys)
    assert shard.name in line and "digest" in line, line
    assert not out.exists()


def test_part_of_another_plan_copied_into_the_run_is_refused(run2, family, tmp_path, monkeypatch, capsys):
    plan, st, out, pf, layout = run2
    other = _plan(family, tmp_path / "c.sqlite", density="0.3")
    assert other.digest != plan.digest
    oout = tmp_path / "other"
    execute_part(other, st, str(oout), PartSpec(0, 2))
    olayout = runs.run_layout(st, str(oout), runs.default_run_id(other.digest), False)
    name = sorted(p.name for p in Path(olayout.files).iterdir() if p.name.endswith(".safetensors"))[0]
    src, dst = Path(olayout.files) / name, Path(layout.files) / name
    assert src.stat().st_size == dst.stat().st_size and src.read_bytes() != dst.read_bytes()
    shutil.copyfile(src, dst)
    line = _commit_cli(pf, out, monkeypatch, capsys)
    assert name in line and "another plan" in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda r: r["realized"].__setitem__("expert_read_bytes", -5), "realized.expert_read_bytes"),
        (lambda r: r.__setitem__("surprise", 1), "surprise"),
        (lambda r: r["realized"].__setitem__("expert_read_bytes", 1 << 60), "realized.expert_read_bytes"),
        (lambda r: r.__setitem__("wall_s", -1.0), "wall_s"),
        (lambda r: r["files"][sorted(r["files"])[0]].__setitem__("size", -1), "size"),
    ],
    ids=["negative", "unknown-key", "above-plan", "negative-time", "negative-size"],
)
def test_invalid_part_records_are_refused_naming_the_field(run2, monkeypatch, capsys, edit, field):
    plan, st, out, pf, layout = run2
    rec_path = Path(runs.part_record_uri(st, layout, 1, 2))
    rec = json.loads(rec_path.read_text())
    edit(rec)
    rec_path.write_text(json.dumps(rec))
    line = _commit_cli(pf, out, monkeypatch, capsys)
    assert rec_path.name in line and field in line, line
    assert not out.exists()
    with pytest.raises(CommitConflict):
        commit_run(plan, st, str(out))


def test_commit_of_untampered_parts_still_succeeds(run2):
    plan, st, out, pf, layout = run2
    r = commit_run(plan, st, str(out))
    assert r.manifest["plan_digest"] == plan.digest and (out / "manifest.json").exists()


def test_record_models_import_without_torch():
    code = (
        "import sys; import mergepipe.commit.records as r; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules); "
        "print(r.PartRecord.__name__)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "PartRecord", p.stderr


@pytest.mark.s3
def test_same_size_edit_of_an_s3_part_object_is_refused(s3_env, family, tmp_path):
    bucket = s3_env.make_bucket("tamper")
    plan = _plan(family, tmp_path / "c.sqlite")
    st = open_storage(None, IOCounters())
    out = f"s3://{bucket}/snap"
    execute_part(plan, st, out, PartSpec(0, 1))
    c = s3_env.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="snap/runs/")["Contents"]]
    shard = sorted(k for k in keys if k.endswith(".safetensors") and ".records/" not in k)[0]
    data = bytearray(c.get_object(Bucket=bucket, Key=shard)["Body"].read())
    data[-3] ^= 0xFF
    c.put_object(Bucket=bucket, Key=shard, Body=bytes(data))
    with pytest.raises(CommitConflict, match="digest"):
        commit_run(plan, st, out)
    assert not st.exists(f"{out}/manifest.json")
    assert os.environ.get("AWS_ACCESS_KEY_ID")  # the run used SeaweedFS through the standard chain


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda r: r.__setitem__("part", 0), "records part 0/2, not 1/2"),
        (lambda r: r["files"].__setitem__("extra.json", next(iter(r["files"].values()))), "lists files"),
    ],
    ids=["other-index", "extra-file"],
)
def test_record_of_another_index_or_listing_extra_files_is_refused(run2, edit, words):
    plan, st, out, pf, layout = run2
    rec_path = Path(runs.part_record_uri(st, layout, 1, 2))
    rec = json.loads(rec_path.read_text())
    edit(rec)
    rec_path.write_text(json.dumps(rec))
    with pytest.raises(CommitConflict, match=words):
        commit_run(plan, st, str(out))
    assert not out.exists()
