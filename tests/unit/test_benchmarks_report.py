"""docs/BENCHMARKS.md's fused-kernel tables and S3 request profile are what the committed raw
results give (bench/benchmarks_report.py), a changed raw value changes the rendered block, and a
raw file that does not parse is refused naming the file and the field."""

import json
import shutil

import pytest

from bench import benchmarks_report as br, report_block


def test_benchmarks_doc_matches_committed_raw_results():
    """Re-render the four blocks from docs/benchmarks/; a hand-edited figure or raw data changed
    without re-rendering fails."""
    for _, glob, _ in br.BLOCKS:
        assert sorted(br.RAW.glob(glob)), f"no committed raw results {glob}"
    assert br.main(["--check"]) == 0


@pytest.fixture
def raw(tmp_path):
    """A copy of the committed raw files the blocks are rendered from."""
    d = tmp_path / "raw"
    d.mkdir()
    for _, glob, _ in br.BLOCKS:
        for f in br.RAW.glob(glob):
            shutil.copy(f, d / f.name)
    return d


def _edit_jsonl(path, fn):
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    for r in recs:
        fn(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _block(blocks, name):
    return next(b.text for b in blocks if b.label == name)


def test_a_changed_raw_value_changes_the_rendered_block(raw, tmp_path):
    before = br.render(raw)
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("\n\n".join(b.text for b in before) + "\n")
    assert report_block.differences(doc, br.render(raw)) == []

    (sd,) = raw.glob("sketch-decode-*.jsonl")
    _edit_jsonl(sd, lambda r: r.update(cpu_prepare_gb_s=2.5) if r["kernels"] == "torch" else None)
    (mt,) = raw.glob("merge-tile-*.jsonl")
    _edit_jsonl(mt, lambda r: r.update(torch_ns_per_expert_entry=9.99) if r["mode"] == "sign3" else None)
    (fx,) = raw.glob("fused-execute-*.txt")
    lines = fx.read_text().splitlines(keepends=True)
    i = next(i for i, x in enumerate(lines) if x.split()[:2] == ["10%", "torch"] and "cpu=5.69" in x)
    lines[i] = lines[i].replace("cpu=5.69", "cpu=7.69")
    fx.write_text("".join(lines))
    (s3,) = raw.glob("s3-requests-*.json")
    d = json.loads(s3.read_text())
    d["runs"][0]["by_kind"]["sketch"]["requests"] = 4040
    s3.write_text(json.dumps(d))

    after = br.render(raw)
    assert "| run preparation, `sign3` (codes + value tables, once per run) | 2.50 (2.50-2.50) |" in _block(
        after, "sketch-decode table"
    )
    assert "| `sign3` sketches | 9.99 | 2.92 |" in _block(after, "merge-tile table")
    # the 10% torch CPU medians over 5.69 (now 7.69), 5.82, 4.89: the median moves to 5.82
    fe = _block(after, "fused-execute table")
    assert "| 10%, tiers | 5.82 | 4.62 |" in fe and "take 1.2 s of CPU (21%)" in fe
    s3b = _block(after, "s3-requests table")
    assert "| 4,040 | 96.8 |" in s3b and "73 GETs per second" in s3b
    diffs = report_block.differences(doc, after)
    assert len(diffs) == 4 and all("differs from the re-derivation" in x for x in diffs)


def test_a_raw_line_that_does_not_parse_is_refused_naming_file_and_line(raw, monkeypatch, capsys):
    (fx,) = raw.glob("fused-execute-*.txt")
    fx.write_text(fx.read_text() + "      10% torch load=4.9 wall=nine cpu=5.0 rss=300MiB engine_wall=4 out=ab\n")
    with pytest.raises(br.RawError, match=r"fused-execute-llama-14m-k8.txt: line 16 is not"):
        br.render(raw)
    monkeypatch.setattr(br, "RAW", raw)
    assert br.main(["--check"]) == 2
    assert "line 16" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("glob", "edit", "message"),
    [
        ("merge-tile-*.jsonl", lambda r: r.update(identical=False), "field 'identical' is False"),
        (
            "merge-tile-*.jsonl",
            lambda r: r.update(fused_ns_per_expert_entry="1.2"),
            "'fused_ns_per_expert_entry' is '1.2'",
        ),
        ("sketch-decode-*.jsonl", lambda r: r.update(kernels="numba"), "field 'kernels' is 'numba'"),
        ("sketch-decode-*.jsonl", lambda r: r.pop("cpu_combine_fused_gb_s", None), "'cpu_combine_fused_gb_s' is None"),
    ],
)
def test_a_record_without_what_its_table_needs_is_refused(raw, glob, edit, message):
    (f,) = raw.glob(glob)
    _edit_jsonl(f, edit)
    with pytest.raises(br.RawError, match=message):
        br.render(raw)


def test_an_s3_profile_without_a_kind_figure_is_refused(raw):
    (s3,) = raw.glob("s3-requests-*.json")
    d = json.loads(s3.read_text())
    del d["runs"][2]["by_kind"]["expert"]["span_s"]
    s3.write_text(json.dumps(d))
    with pytest.raises(br.RawError, match=r"runs\[2\]: by_kind.expert: field 'span_s' is None"):
        br.render(raw)


def test_merge_tile_writes_a_record_the_report_renders(tmp_path):
    """bench/merge_tile.py --out appends its record with commit, time and command (no --out path),
    and the report renders that record's figures and provenance."""
    import subprocess
    import sys

    out = tmp_path / "merge-tile-x.jsonl"
    argv = ["--mode", "r1", "--rows", "170", "--cols", "64", "--experts", "2", "--repeat", "1", "--out", str(out)]
    subprocess.run([sys.executable, str(br.REPO / "bench" / "merge_tile.py"), *argv], check=True, capture_output=True)
    (rec,) = br.read_jsonl(out)
    assert rec["command"] == ["bench/merge_tile.py", *argv[:-2]] and rec["identical"] is True
    assert len(rec["git"].removesuffix("+dirty")) == 40 and rec["date_utc"].endswith("Z")
    md = br.render_merge_tile(out)
    row = f"| rank-1 tier (`sign3+r1`) | {rec['torch_ns_per_expert_entry']:.2f} | {rec['fused_ns_per_expert_entry']:.2f} |"
    assert row in md and f"code at {rec['git'][:7]}" in md and "K = 2 experts, 10,880 entries" in md


def test_records_with_provenance_name_commit_and_time(raw):
    (sd,) = raw.glob("sketch-decode-*.jsonl")
    times = iter(["2026-11-28T10:01:05Z", "2026-11-28T10:03:00Z"] * 3)
    _edit_jsonl(sd, lambda r: r.update(git="0123456789abcdef" * 2 + "01234567", date_utc=next(times)))
    md = _block(br.render(raw), "sketch-decode table")
    assert "load average 5.7-6.7; code at 0123456, 2026-11-28 10:01-10:03 UTC; raw:" in md


@pytest.mark.slow
def test_fused_execute_writes_the_record_the_report_renders(tmp_path, monkeypatch, capsys):
    """bench/fused_execute.py runs `mergepipe execute` of a real TIES plan with tiers on both
    paths, compares the outputs and writes the raw record the report parses and renders."""
    from bench import fused_execute
    from testkit.harness import run_cli
    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "m", 2, seed=11)
    plan = tmp_path / "p30.json"
    args = ["plan", "--base", str(base), *(x for e in experts for x in ("-e", str(e)))]
    args += ["-m", "ties", "-p", "density=0.3", "-b", "30%", "--sketch", "sign3", "-o", str(plan), "--json"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    out = tmp_path / "fused-execute-x.txt"
    argv = ["--plan", f"30%={plan}", "--rounds", "1", "--work", str(tmp_path / "w"), "--out", str(out)]
    assert fused_execute.main(argv) == 0
    runs = br.read_fused_execute(out)
    assert [(r["budget"], r["path"]) for r in runs] == [("30%", "torch"), ("30%", "c")]
    assert runs[0]["out"] == runs[1]["out"] and all(r["cpu"] > 0 and r["rss"] > 0 for r in runs)
    header = [x for x in out.read_text().splitlines() if x.startswith("#")]
    assert any("code at " in x for x in header) and not any(str(out) in x for x in header)
    md = br.render_fused_execute(out)
    assert f"| 30%, tiers | {runs[0]['cpu']:.2f} | {runs[1]['cpu']:.2f} |" in md and "| identical |" in md


def test_fused_execute_refuses_a_bad_plan_argument(tmp_path, capsys):
    from bench import fused_execute

    work = tmp_path / "w"
    assert fused_execute.main(["--plan", "nolabel.json", "--work", str(work)]) == 2
    assert "expected LABEL=PLAN.json" in capsys.readouterr().err
    assert fused_execute.main(["--plan", f"10%={tmp_path / 'missing.json'}", "--work", str(work)]) == 2
    assert "is not a file (write it with `mergepipe plan" in capsys.readouterr().err
    assert not work.exists()


def test_s3_requests_record_keeps_the_command_not_the_scratch_paths(capsys):
    from bench import s3_requests

    argv = ["--sketch-gap", "65536", "--out", "/tmp/p.json", "--record", "r.json", "--code", "main", "--"]
    argv += ["merge", "--base", "s3://bk/models/base", "--out", "s3://bk/prof/g64", "--json"]
    assert s3_requests.record_command(argv, "bk") == [
        "s3_requests.py",
        "--sketch-gap",
        "65536",
        "--",
        "merge",
        "--base",
        "s3://$BUCKET/models/base",
        "--out",
        "s3://$BUCKET/prof/g64",
        "--json",
    ]
    reqs = [
        {"kind": "catalog", "t0": 0.0, "s": 0.5},
        {"kind": "base", "t0": 1.0, "s": 0.5},
        {"kind": "sketch", "t0": 2.0, "s": 1.25},
        {"kind": "output", "t0": 4.0, "s": 1.0},
    ]
    assert s3_requests.input_window_s(reqs) == 2.25 and s3_requests.input_window_s(reqs[:1]) is None
    assert s3_requests.main(["--record", "r.json", "--", "merge"]) == 2
    assert "--record needs --code" in capsys.readouterr().err
