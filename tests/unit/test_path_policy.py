"""One path policy for names from checkpoints, indexes, plans and manifests (issue 12 item 2):
a crafted checkpoint can neither write outside --out nor read outside its own folder or prefix,
locally or on S3."""

import json
import os
import shutil
from pathlib import Path

import pytest

from mergepipe.errors import InputError
from mergepipe.paths import check_name, containment_root
from mergepipe.storage.base import Storage
from mergepipe.storage.local import LocalStorage
from testkit.harness import run_cli

INDEX = "model.safetensors.index.json"


def _copy_family(family, tmp_path):
    base, experts = family
    root = tmp_path / "models"
    nb = Path(shutil.copytree(base, root / "base"))
    ne = [Path(shutil.copytree(e, root / e.name)) for e in experts]
    return nb, ne


def _remap(ckpt: Path, new_name: str, which: int = 0) -> str:
    """Point every tensor of the ``which``-th shard at ``new_name`` in the index; returns the
    original shard name."""
    idx = json.loads((ckpt / INDEX).read_text())
    shard = sorted(set(idx["weight_map"].values()))[which]
    idx["weight_map"] = {k: (new_name if v == shard else v) for k, v in idx["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(idx))
    return shard


def _merge_args(base, experts, out):
    args = ["merge", "--base", str(base), "--out", str(out), "--method", "ties", "-p", "density=0.5", "--json"]
    for e in experts:
        args += ["-e", str(e)]
    return args


def _tree(p: Path) -> set:
    """Everything under ``p`` except the catalog home (the user's catalog, not an output)."""
    return {str(x.relative_to(p)) for x in p.rglob("*") if not x.relative_to(p).parts[0] == "mergepipe-home"}


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "a/../../x",
        "/etc/passwd",
        "",
        ".",
        "a//b",
        "./a",
        "a/./b",
        "a\\..\\b",
        "a\x00b",
        "a\nb",
        "x" * 300,
        ("d/" * 600) + "f",
    ],
)
def test_check_name_refuses(name):
    with pytest.raises(InputError, match="where"):
        check_name(name, "where")


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "runs/abc123/x",
        "ünïcode.safetensors",
        "a..b",
        "..a",
        "a..",
    ],
)
def test_check_name_accepts(name):
    assert check_name(name, "where") == name


def test_join_applies_the_policy_on_every_backend():
    for join in (Storage.join, LocalStorage.join):
        with pytest.raises(InputError):
            join("s3://bucket/models/expert" if join is Storage.join else "/data/x", "../other/model.safetensors")
        with pytest.raises(InputError):
            join("s3://bucket/p" if join is Storage.join else "/data/x", "/abs")
    assert Storage.join("s3://b/p/", "runs", "r1") == "s3://b/p/runs/r1"


def test_index_traversal_in_base_writes_nothing_outside_out(family, tmp_path, monkeypatch, capsys):
    """The issue's case: a base index mapping tensors to ``../shards/...`` (a real shard placed
    there) used to make the engine write the merged shard outside the snapshot."""
    base, experts = _copy_family(family, tmp_path)
    shards = tmp_path / "models" / "shards"
    shards.mkdir()
    shard = _remap(base, "../shards/evil.safetensors")
    shutil.copy(base / shard, shards / "evil.safetensors")
    before = _tree(tmp_path)
    code, out, err = run_cli(_merge_args(base, experts, tmp_path / "snap"), monkeypatch, capsys)
    assert code == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and INDEX in lines[0] and "weight_map" in lines[0] and "../shards/evil" in lines[0], err
    assert _tree(tmp_path) == before, "nothing may be created anywhere"


def test_absolute_path_in_expert_index_is_not_read(family, tmp_path, monkeypatch, capsys):
    base, experts = _copy_family(family, tmp_path)
    elsewhere = tmp_path / "private.safetensors"
    shard = _remap(experts[1], str(elsewhere))
    shutil.copy(experts[1] / shard, elsewhere)
    opened = []
    real_open = os.open

    def spy(path, *a, **kw):
        opened.append(os.fspath(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    code, out, err = run_cli(_merge_args(base, experts, tmp_path / "snap"), monkeypatch, capsys)
    monkeypatch.setattr(os, "open", real_open)
    assert code == 2 and "absolute path" in err and str(experts[1]) in err
    assert str(elsewhere) not in opened
    assert not (tmp_path / "snap").exists()


def test_subfolder_symlink_name_is_refused(family, tmp_path, monkeypatch, capsys):
    """A crafted name through a symlinked folder inside the checkpoint (``link/x``) chose where
    a file was created; shard names are single file names now."""
    base, experts = _copy_family(family, tmp_path)
    target = tmp_path / "chosen"
    target.mkdir()
    os.symlink(target, base / "link")
    shard = _remap(base, "link/evil.safetensors")
    shutil.copy(base / shard, target / "evil.safetensors")
    code, out, err = run_cli(_merge_args(base, experts, tmp_path / "snap"), monkeypatch, capsys)
    assert code == 2 and "is a path" in err
    assert sorted(p.name for p in target.iterdir()) == ["evil.safetensors"]


def test_symlinked_shard_leading_outside_is_refused(family, tmp_path, monkeypatch, capsys):
    base, experts = _copy_family(family, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = sorted(p.name for p in experts[0].glob("*.safetensors"))[0]
    shutil.move(experts[0] / shard, outside / shard)
    os.symlink(outside / shard, experts[0] / shard)
    code, out, err = run_cli(_merge_args(base, experts, tmp_path / "snap"), monkeypatch, capsys)
    assert code == 2 and "symbolic link" in err and str(outside) in err
    assert not (tmp_path / "snap").exists()


def test_hugging_face_cache_symlinks_are_followed(family, tmp_path):
    """The hub cache keeps files in ``models--org--name/blobs`` and symlinks them from
    ``snapshots/<rev>/``: that stays readable (the containment root is the repo folder)."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.commit.manifest import verify_snapshot
    from mergepipe.pipeline import merge

    base, experts = family
    repo = tmp_path / "hub" / "models--org--base"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(os.listdir(base)):
        blob = repo / "blobs" / f"blob-{f}"
        shutil.copy(base / f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f)
    assert containment_root(str(snap)) == os.path.realpath(repo)
    r = merge(
        str(snap),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(tmp_path / "snap-out"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
    )
    assert verify_snapshot(r.out)["ok"]


def test_verify_does_not_follow_traversal_in_a_manifest(family, tmp_path, monkeypatch, capsys):
    """A manifest listing ``../x`` used to be followed by verify (and reported ok)."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.commit.manifest import manifest_bytes, snapshot_id
    from mergepipe.pipeline import merge

    base, experts = family
    r = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(tmp_path / "s"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
    )
    m = dict(r.manifest)
    name, info = next(iter(m["outputs"].items()))
    (tmp_path / "outside.bin").write_bytes((tmp_path / "s" / name).read_bytes())
    (tmp_path / "s" / name).unlink()
    m["outputs"] = {("../outside.bin" if k == name else k): v for k, v in m["outputs"].items()}
    m["snapshot_id"] = snapshot_id(m["plan_digest"], m["outputs"])
    (tmp_path / "s" / "manifest.json").write_bytes(manifest_bytes(m))
    code, out, err = run_cli(["verify", str(tmp_path / "s"), "--json"], monkeypatch, capsys)
    assert code == 1
    problems = json.loads(out)["problems"]
    assert any("../outside.bin" in p and "normalised" in p for p in problems), problems
    # the same in the human output, with a name that is also rich markup (was a MarkupError traceback)
    m["outputs"] = {("[/]../x" if k == "../outside.bin" else k): v for k, v in m["outputs"].items()}
    m["snapshot_id"] = snapshot_id(m["plan_digest"], m["outputs"])
    (tmp_path / "s" / "manifest.json").write_bytes(manifest_bytes(m))
    code, out, err = run_cli(["verify", str(tmp_path / "s")], monkeypatch, capsys)
    assert code == 1 and "[/]../x" in err and "Traceback" not in err


def test_crafted_plan_cannot_name_files_outside(family, tmp_path, monkeypatch, capsys):
    """``execute`` runs a plan file: its shard names pass the same policy (a recomputed digest
    does not help)."""
    base, experts = family
    plan_file = tmp_path / "p.json"
    args = ["plan", "--base", str(base), "--method", "ties", "-p", "density=0.5", "--out", str(plan_file)]
    for e in experts:
        args += ["-e", str(e)]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    from mergepipe.planner.plan import Plan

    p = Plan.from_json(plan_file.read_text())
    p.tensors[0].file = "../../escape.safetensors"
    p.digest = p.compute_digest()
    plan_file.write_text(p.to_json())
    code, out, err = run_cli(["execute", str(plan_file), "--out", str(tmp_path / "snap")], monkeypatch, capsys)
    assert code == 2 and "tensors[0].file" in err and "escape" in err
    assert not (tmp_path / "snap").exists() and not (tmp_path.parent / "escape.safetensors").exists()


@pytest.mark.s3
def test_s3_expert_cannot_reach_another_prefix(s3_env, family, tmp_path, monkeypatch, capsys):
    """On a shared bucket an expert's index naming ``../victim/...`` (a key of another prefix)
    is refused before any object outside the expert's prefix is read."""
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("pp")

    def up(folder, prefix):
        for f in sorted(os.listdir(folder)):
            c.upload_file(str(Path(folder) / f), bucket, f"{prefix}/{f}")
        return f"s3://{bucket}/{prefix}"

    b = up(base, "team-a/base")
    es = [up(e, f"team-a/{e.name}") for e in experts]
    up(experts[0], "team-b/victim")
    idx = json.loads((experts[1] / INDEX).read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    idx["weight_map"] = {k: ("../../team-b/victim/" + v if v == shard else v) for k, v in idx["weight_map"].items()}
    c.put_object(Bucket=bucket, Key=f"team-a/{experts[1].name}/{INDEX}", Body=json.dumps(idx).encode())
    args = [
        "merge",
        "--base",
        b,
        "--out",
        f"s3://{bucket}/team-a/merged",
        "--method",
        "ties",
        "-p",
        "density=0.5",
        "--catalog",
        str(tmp_path / "c.sqlite"),
    ]
    for e in es:
        args += ["-e", e]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "weight_map" in err and "normalised" in err, err
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="team-a/merged").get("Contents", [])]
    assert keys == []
