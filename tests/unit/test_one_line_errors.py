"""One-line errors for the cases of issue 22 item 7 that used to end in a traceback or in a
wrong write: exit code 2, one ``error:`` line naming the path and the fix, nothing written."""

import os
from pathlib import Path

import pytest

from testkit.harness import run_cli


def _error_line(code, err):
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "━" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_very_long_base_path_is_one_line(tmp_path, monkeypatch, capsys):
    long_base = str(tmp_path / ("a" * 300))
    for cmd in (
        ["plan", "--base", long_base, "--expert", str(tmp_path), "--method", "ties", "--catalog", str(tmp_path / "c")],
        ["extract-lora", str(tmp_path / "s"), "--base", long_base, "--rank", "2", "--out", str(tmp_path / "o" / "ad")],
    ):
        line = _error_line(*run_cli(cmd, monkeypatch, capsys)[::2])
        assert "File name too long" in line and len(line) < 400
    assert not (tmp_path / "o").exists()


@pytest.fixture
def snapshot_pair(tmp_path):
    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "fam", 1, seed=2, n_shards=1)
    return base, experts[0]


def test_extract_lora_out_on_s3_is_refused_without_a_local_folder(snapshot_pair, tmp_path, monkeypatch, capsys):
    base, snap = snapshot_pair
    monkeypatch.chdir(tmp_path)
    args = ["extract-lora", str(snap), "--base", str(base), "--rank", "2", "--out", "s3://bucket/adapter"]
    line = _error_line(*run_cli(args, monkeypatch, capsys)[::2])
    assert "local adapter folder" in line
    assert not (tmp_path / "s3:").exists()


def test_extract_lora_out_under_a_file_fails_before_the_svd(snapshot_pair, tmp_path, monkeypatch, capsys):
    import mergepipe.formats.safetensors as sf

    base, snap = snapshot_pair
    (tmp_path / "afile").write_text("x")
    calls = []
    monkeypatch.setattr(sf, "load_layout", lambda *a, **k: calls.append(a))  # nothing may be read
    args = ["extract-lora", str(snap), "--base", str(base), "--rank", "2", "--out", str(tmp_path / "afile" / "ad")]
    line = _error_line(*run_cli(args, monkeypatch, capsys)[::2])
    assert "is a file" in line and not calls
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("where", ["snapshot", "base"])
def test_extract_lora_never_writes_inside_its_inputs(snapshot_pair, tmp_path, monkeypatch, capsys, where):
    base, snap = snapshot_pair
    target = (snap if where == "snapshot" else base) / "adapter"
    before = sorted(os.listdir(target.parent))
    args = ["extract-lora", str(snap), "--base", str(base), "--rank", "2", "--out", str(target)]
    line = _error_line(*run_cli(args, monkeypatch, capsys)[::2])
    assert "inside the input checkpoint" in line
    assert sorted(os.listdir(target.parent)) == before


def test_commit_parts_count_is_bounded_before_any_work(tmp_path, monkeypatch, capsys):
    from mergepipe.engine.partition import MAX_PARTS

    args = ["commit", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o"), "--parts", str(10**12)]
    line = _error_line(*run_cli(args, monkeypatch, capsys)[::2])
    assert "--parts" in line and str(MAX_PARTS) in line.replace(",", "")
    assert not Path(tmp_path / "o").exists()


@pytest.mark.parametrize("fault", ["missing bucket", "wrong credentials", "unreachable endpoint"])
def test_gc_on_s3_store_failures_are_one_line(s3_env, monkeypatch, capsys, fault):
    """`mergepipe gc s3://...` against a real S3 server (SeaweedFS) that refuses: one line naming
    the URI and what to check, exit 2, no botocore traceback."""
    bucket = s3_env.make_bucket("gcerr")
    uri = f"s3://{bucket}/snaps"
    if fault == "missing bucket":
        uri, want = "s3://no-such-bucket-gc/snaps", "no-such-bucket-gc"
    elif fault == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        want = "credentials"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        want = "cannot connect to the S3 endpoint"
    line = _error_line(*run_cli(["gc", uri, "--grace", "0"], monkeypatch, capsys)[::2])
    assert want in line, line
