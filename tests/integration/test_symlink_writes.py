"""No write ever follows a symbolic link mergepipe did not create (issue 22 item 2): a link planted
at each place mergepipe writes (lock, ownership records, run and records folders, part lock, plan
file, search state, termination log) leaves its victim untouched, and where the write cannot go on
the command fails with exit 2 and one line naming the link."""

import os
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit.manifest import lock_path, staging_path, verify_snapshot
from mergepipe.errors import InputError
from mergepipe.pipeline import build_plan
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import open_for_write, replace_file, write_new_file
from mergepipe.storage.routing import open_storage
from testkit.harness import run_cli


def _victims(tmp_path: Path) -> tuple[Path, Path]:
    f = tmp_path / "victim.txt"
    f.write_text("precious\n")
    d = tmp_path / "victim-dir"
    d.mkdir()
    (d / "keep").write_text("keep\n")
    return f, d


def _untouched(f: Path, d: Path) -> None:
    assert f.read_text() == "precious\n"
    assert sorted(p.name for p in d.iterdir()) == ["keep"] and (d / "keep").read_text() == "keep\n"


def _one_line(err: str) -> str:
    # (the progress display may have drawn its bars on stderr before the refusal)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture()
def plan_file(family, tmp_path):
    base, experts = family
    req = request_from_args(str(base), [(e.name, str(e)) for e in experts], "ties", ["density=0.5"])
    plan = build_plan(Catalog(tmp_path / "c.sqlite"), open_storage(None, IOCounters()), req)
    p = tmp_path / "plan.json"
    p.write_text(plan.to_json())
    return p, "plan-" + plan.digest[:16]


@pytest.mark.parametrize(
    "where",
    ["lock", "plain run record", "run record", "run folder", "plain run folder", "records folder", "part lock"],
)
def test_planted_link_at_a_merge_write_is_refused(plan_file, tmp_path, monkeypatch, capsys, where):
    victim, victim_dir = _victims(tmp_path)
    plan, run = plan_file
    out = tmp_path / "snaps" / "snap"
    out.parent.mkdir()
    files = out.parent / f".snap.run-{run}"
    link, target, args = {
        "lock": (lock_path(out), victim, ["execute", str(plan), "--out", str(out)]),
        "plain run record": (  # a single-process execute is the one part of the plan's run
            Path(str(files) + ".owner.json"),
            victim,
            ["execute", str(plan), "--out", str(out)],
        ),
        "run record": (
            Path(str(files) + ".owner.json"),
            victim,
            ["execute", str(plan), "--out", str(out), "--part", "0/1"],
        ),
        "run folder": (files, victim_dir, ["execute", str(plan), "--out", str(out), "--part", "0/1"]),
        "plain run folder": (files, victim_dir, ["execute", str(plan), "--out", str(out)]),
        "records folder": (
            Path(str(files) + ".records"),
            victim_dir,
            ["execute", str(plan), "--out", str(out), "--part", "0/1"],
        ),
        "part lock": (None, victim, ["execute", str(plan), "--out", str(out), "--part", "0/1"]),
    }[where]
    if where == "part lock":
        rec = Path(str(files) + ".records")
        rec.mkdir()
        link = rec / "part-00000-of-00001.lock"
    os.symlink(target, link)
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    line = _one_line(err)
    assert "symbolic link" in line and str(link) in line, line
    _untouched(victim, victim_dir)
    assert not out.exists()


def test_planted_staging_folder_link_is_removed_not_followed(plan_file, tmp_path, monkeypatch, capsys):
    """A link at the staging folder's name (where versions before runs of one part staged) is
    never followed: the merge stages in its run folder and commits."""
    victim, victim_dir = _victims(tmp_path)
    plan, _ = plan_file
    out = tmp_path / "snap"
    os.symlink(victim_dir, staging_path(out))
    code, _out, err = run_cli(["execute", str(plan), "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    _untouched(victim, victim_dir)
    assert verify_snapshot(out)["ok"]


def test_planted_link_at_plan_out_is_refused(family, tmp_path, monkeypatch, capsys):
    victim, victim_dir = _victims(tmp_path)
    base, experts = family
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))
    link = tmp_path / "plan.json"
    os.symlink(victim, link)
    args = ["plan", "--base", str(base), "--method", "ties", "-p", "density=0.5", "--out", str(link)]
    args += sum([["-e", str(e)] for e in experts], [])
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    assert "symbolic link" in _one_line(err)
    _untouched(victim, victim_dir)


def test_search_state_and_termination_log_never_follow_links(tmp_path, monkeypatch, capsys):
    from mergepipe.search.state import save_state

    victim, victim_dir = _victims(tmp_path)
    state = tmp_path / "state.json"
    os.symlink(victim, state)
    with pytest.raises(InputError, match="symbolic link"):
        save_state(state, {"format": "x"})
    log = tmp_path / "termination-log"
    os.symlink(victim, log)
    monkeypatch.setenv("MERGEPIPE_TERMINATION_LOG", str(log))
    code, _out, _err = run_cli(["gc", str(tmp_path / "missing")], monkeypatch, capsys)
    assert code == 2
    _untouched(victim, victim_dir)


def test_write_helpers_refuse_links_and_create_exclusively(tmp_path):
    victim, victim_dir = _victims(tmp_path)
    link = tmp_path / "link"
    os.symlink(victim, link)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    for p in (link, dangling):
        with pytest.raises(InputError, match="symbolic link"):
            write_new_file(p, b"x")
        with pytest.raises(InputError, match="symbolic link"):
            replace_file(p, b"x")
        with pytest.raises(InputError, match="symbolic link"):
            os.close(open_for_write(p, os.O_WRONLY | os.O_CREAT))
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(InputError, match="not a regular file"):
        os.close(open_for_write(victim_dir, os.O_RDONLY))
    write_new_file(tmp_path / "new", b"a")
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "new", b"b")
    replace_file(tmp_path / "new", b"c")
    assert (tmp_path / "new").read_bytes() == b"c"
    _untouched(victim, victim_dir)
