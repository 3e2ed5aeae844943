"""The CLI contract: --json output, exit code 2 with one clear message for bad input, and
nothing written when it fails."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import run_cli
from testkit.synth import make_family, save_checkpoint


@pytest.fixture()
def fam(tmp_path):
    base, experts = make_family(tmp_path / "m", 2, seed=11)
    return tmp_path, base, experts


def merge_args(base, experts, out, *extra):
    a = ["merge", "--base", str(base)]
    for e in experts:
        a += ["--expert", str(e)]
    return a + ["--out", str(out), *extra]


def test_merge_json_contract(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    args = merge_args(
        base,
        experts,
        tmp / "out",
        "--method",
        "ties",
        "--param",
        "density=0.5",
        "--param",
        "expert1:weight=0.7",
        "--budget",
        "64KiB",
        "--json",
    )
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    res = json.loads(out)  # stdout holds exactly one JSON object
    for k in ("snapshot_id", "manifest_hash", "plan_digest", "retained_energy", "wall_s"):
        assert k in res
    for k in ("base_read_bytes", "expert_read_bytes", "output_write_bytes", "expert_budget_bytes"):
        assert isinstance(res["io"][k], int)
    assert res["io"]["expert_read_bytes"] <= res["io"]["expert_budget_bytes"] == 65536
    m = json.loads((tmp / "out" / "manifest.json").read_text())
    assert m["parameters"]["experts"]["expert1"]["weight"] == 0.7
    assert m["parameters"]["experts"]["expert0"]["weight"] == 1.0
    # rerun: idempotent, nothing recomputed
    code, out2, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0 and json.loads(out2)["already_committed"] is True
    code, out3, _ = run_cli(["verify", str(tmp / "out"), "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out3)["ok"]


def test_plan_explain_execute(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    plan = tmp / "plan.json"
    code, out, err = run_cli(
        [
            "plan",
            "--base",
            str(base),
            "-e",
            str(experts[0]),
            "-e",
            str(experts[1]),
            "-m",
            "dare_linear",
            "-p",
            "density=0.5",
            "-b",
            "30%",
            "-o",
            str(plan),
            "--json",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    digest = json.loads(out)["plan_digest"]
    code, out, _ = run_cli(["explain", str(plan), "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["plan_digest"] == digest
    code, out, err = run_cli(["execute", str(plan), "--out", str(tmp / "snap"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["plan_digest"] == digest


def test_verify_detects_tampering(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    assert run_cli(merge_args(base, experts, tmp / "out", "--json"), monkeypatch, capsys)[0] == 0
    shard = sorted((tmp / "out").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    code, out, _ = run_cli(["verify", str(tmp / "out"), "--json"], monkeypatch, capsys)
    assert code == 1 and not json.loads(out)["ok"]
    assert shard.name in json.loads(out)["problems"][0]


def _corrupt(folder: Path, how: str) -> str:
    shard = sorted(folder.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    if how == "truncated":
        shard.write_bytes(raw[:-100])
    elif how == "header_past_eof":
        shard.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    elif how == "header_too_large":
        shard.write_bytes(struct.pack("<Q", 200_000_000) + raw[8:])
    elif how == "invalid_json":
        shard.write_bytes(raw[:8] + b"{" * n + raw[8 + n :])
    elif how == "missing_shard":
        shard.unlink()
    return shard.name


@pytest.mark.parametrize("command", ["plan", "merge"])
def test_block_size_unlimited_is_refused_with_exit_2(fam, monkeypatch, capsys, command):
    """--block-size has no 'unlimited': plan and merge refuse it as analyze does (they passed
    None on to the planner)."""
    tmp, base, experts = fam
    args = merge_args(base, experts, tmp / "out", "--block-size", "unlimited", "--json")
    if command == "plan":
        args = ["plan", *[a for a in args[1:] if a not in ("--out", str(tmp / "out"))]]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    assert out == "" and "--block-size" in err and "must be a byte quantity from 1B to 1GiB" in err
    assert not (tmp / "out").exists()


BAD_FILES = ["truncated", "header_past_eof", "header_too_large", "invalid_json", "missing_shard"]


@pytest.mark.parametrize("how", BAD_FILES)
def test_bad_checkpoint_files_exit_2_nothing_written(fam, monkeypatch, capsys, how):
    tmp, base, experts = fam
    name = _corrupt(experts[1], how)
    code, out, err = run_cli(merge_args(base, experts, tmp / "out", "--json"), monkeypatch, capsys)
    assert code == 2
    assert out == ""
    assert name in err or str(experts[1]) in err
    assert not (tmp / "out").exists()
    assert not list(tmp.glob(".out.staging*")) and not list(tmp.glob(".out.run-*"))


def test_mismatched_expert_exit_2(fam, monkeypatch, capsys):
    import torch
    from safetensors.torch import load_file

    tmp, base, experts = fam
    t = {}
    for f in sorted(experts[0].glob("*.safetensors")):
        t.update(load_file(str(f)))
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_checkpoint(tmp / "bad", t, 2)
    code, out, err = run_cli(merge_args(base, [experts[0], tmp / "bad"], tmp / "out"), monkeypatch, capsys)
    assert code == 2 and "model.layers.0.mlp.up_proj.weight" in err and "bad" in err
    assert not (tmp / "out").exists()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--budget", "12 parsecs"], "--budget"),
        (["--budget", "lots"], "--budget"),
        (["--method", "frankenmerge"], "unknown merge method"),
        (["--method", "ties", "--param", "density=0"], "density"),
        (["--method", "ties", "--param", "colour=blue"], "colour"),
        (["--param", "nobody:weight=1"], "nobody"),
        (["--fidelity", "1.5"], "fidelity"),
        (["--device", "cuda:7"], "--device"),
        (["--param", "density=[0.5]"], "--param density: a gradient needs at least two values"),
        (["--param", "density=[0.2,"], "not valid JSON"),
        (["--param", 'density=[{"filter":"mlp","value":1.5}]'], "density[0].value: density=1.5 is outside (0, 1]"),
        (["--method", "slerp", "--param", "t=0.5"], "slerp takes exactly 1 expert(s)"),
        (["--method", "breadcrumbs", "--param", "gamma=1"], "gamma=1 is outside [0, 1)"),
        (["--method", "della", "--param", "density=0.95"], "epsilon"),
        (
            ["--method", "nuslerp", "--param", "nuslerp_row_wise=true", "--param", "nuslerp_flatten=false"],
            "nuslerp_row_wise",
        ),
        (["--param", "expert0:lambda=2"], "--param expert0:lambda: lambda is a global parameter"),
    ],
)
def test_bad_arguments_exit_2(fam, monkeypatch, capsys, extra, needle):
    tmp, base, experts = fam
    code, out, err = run_cli(merge_args(base, experts, tmp / "out", *extra), monkeypatch, capsys)
    assert code == 2, err
    assert needle in err
    assert not (tmp / "out").exists()


def test_layerwise_param_json_lists(fam, monkeypatch, capsys):
    """--param values may be JSON gradients and filter lists; the plan holds per-tensor values."""
    tmp, base, experts = fam
    plan = tmp / "plan.json"
    code, out, err = run_cli(
        [
            "plan",
            "--base",
            str(base),
            "-e",
            str(experts[0]),
            "-e",
            str(experts[1]),
            "-m",
            "ties",
            "-p",
            "density=[0.2,0.8]",
            "-p",
            'expert1:weight=[{"filter":"mlp","value":0.5},{"value":1}]',
            "-o",
            str(plan),
            "--json",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    p = json.loads(plan.read_text())
    t = {x["name"]: x for x in p["tensors"]}
    assert t["model.layers.0.self_attn.q_proj.weight"]["experts"][0]["density"] == 0.2
    assert t["model.layers.1.self_attn.q_proj.weight"]["experts"][0]["density"] == 0.8
    assert t["model.layers.1.mlp.up_proj.weight"]["experts"][1]["weight"] == 0.5
    assert t["model.layers.1.self_attn.q_proj.weight"]["experts"][1]["weight"] == 1.0
    assert p["experts"][0]["params"]["density"] == [0.2, 0.8]  # the setting itself is recorded too
    code, out, err = run_cli(["execute", str(plan), "--out", str(tmp / "snap"), "--json"], monkeypatch, capsys)
    assert code == 0, err


def test_output_path_problems(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    (tmp / "afile").write_text("x")
    code, _, err = run_cli(merge_args(base, experts, tmp / "afile"), monkeypatch, capsys)
    assert code == 2 and "afile" in err
    code, _, err = run_cli(merge_args(base, experts, tmp / "afile" / "sub"), monkeypatch, capsys)
    assert code == 2
    (tmp / "full").mkdir()
    (tmp / "full" / "keep.txt").write_text("precious")
    code, _, err = run_cli(merge_args(base, experts, tmp / "full"), monkeypatch, capsys)
    assert code == 2 and "not empty" in err
    assert (tmp / "full" / "keep.txt").read_text() == "precious"
    # a snapshot of another plan is never overwritten
    assert run_cli(merge_args(base, experts, tmp / "snap", "--method", "linear"), monkeypatch, capsys)[0] == 0
    before = (tmp / "snap" / "manifest.json").read_bytes()
    code, _, err = run_cli(merge_args(base, experts, tmp / "snap", "--method", "ties"), monkeypatch, capsys)
    assert code == 2 and "different plan" in err
    assert (tmp / "snap" / "manifest.json").read_bytes() == before


def test_help_is_fast_and_imports_no_torch():
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from mergepipe import cli; "
            "sys.argv=['mergepipe','--help']\ntry: cli.main()\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert "merge" in r.stdout and r.stdout.strip().endswith("NOTORCH")


def test_analyze_pairs_records_what_model_stock_plans_with(fam, monkeypatch, capsys):
    """`analyze` alone leaves model_stock unplannable without reading tensors (no pair statistics);
    `analyze --pairs` records the per-tensor <delta_0, delta_1>, equal to the dot product of the
    checkpoints' task vectors, and then planning reads nothing but the catalog."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import MissingAnalysis, build_plan
    from mergepipe.request import ExpertRequest, MergeRequest
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from testkit.harness import merged_tensors

    tmp, base, experts = fam
    cat = tmp / "cat.sqlite"
    ex = [a for e in experts for a in ("-e", str(e))]
    code, out, err = run_cli(
        ["analyze", "--base", str(base), *ex, "--catalog", str(cat), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    assert "pairs" not in json.loads(out)

    def plan_without_reading():
        st = LocalStorage(IOCounters())
        req = MergeRequest(
            base=str(base),
            method="model_stock",
            experts=[ExpertRequest(name=f"x{i}", uri=str(e)) for i, e in enumerate(experts)],
        )
        p = build_plan(Catalog(cat), st, req, analyze=False)
        return p, st.counters.snapshot()["read"]

    with pytest.raises(MissingAnalysis) as e:
        plan_without_reading()
    assert sorted(e.value.uris) == sorted(str(x) for x in experts)

    code, out, err = run_cli(
        ["analyze", "--base", str(base), *ex, "--pairs", "--catalog", str(cat), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    res = json.loads(out)
    b = merged_tensors(base)
    (pair,) = res["pairs"]
    assert pair["experts"] == [str(x) for x in experts] and pair["tensors"] == len(b)
    assert res["bytes_read"]["expert"] > 0  # the pair needed the experts streamed again

    c = Catalog(cat)
    brec, recs = (
        c.register(LocalStorage(IOCounters()), str(base)),
        [c.register(LocalStorage(IOCounters()), str(x)) for x in experts],
    )
    dots = c.pair_dots(brec, recs)[(0, 1)]
    e0, e1 = merged_tensors(experts[0]), merged_tensors(experts[1])
    for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        want = float(((e0[name].double() - b[name].double()) * (e1[name].double() - b[name].double())).sum())
        assert dots[name] == pytest.approx(want, rel=1e-6, abs=1e-12)

    p, read = plan_without_reading()
    assert p.method == "model_stock" and read["expert"] == 0 and read["base"] == 0

    # cached: a second run reads no expert byte
    code, out, _ = run_cli(
        ["analyze", "--base", str(base), *ex, "--pairs", "--catalog", str(cat), "--json"], monkeypatch, capsys
    )
    assert code == 0 and json.loads(out)["bytes_read"]["expert"] == 0


def test_analyze_pairs_needs_two_experts(fam, monkeypatch, capsys):
    tmp, base, experts = fam
    code, out, err = run_cli(
        [
            "analyze",
            "--base",
            str(base),
            "-e",
            str(experts[0]),
            "--pairs",
            "--catalog",
            str(tmp / "cat.sqlite"),
            "--json",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and out == "" and "--pairs needs at least two" in err


def test_errors_go_to_the_termination_log_as_one_line(fam, monkeypatch, capsys):
    """$MERGEPIPE_TERMINATION_LOG (the operator's Jobs point it at the container's
    terminationMessagePath) receives the one-line error of a failed run, nothing on success."""
    tmp, base, experts = fam
    log = tmp / "termination-log"
    monkeypatch.setenv("MERGEPIPE_TERMINATION_LOG", str(log))
    name = _corrupt(experts[1], BAD_FILES[0])
    code, _, err = run_cli(merge_args(base, experts, tmp / "out"), monkeypatch, capsys)
    assert code == 2
    text = log.read_text()
    assert text.startswith("error: ") and text.endswith("\n") and text.count("\n") == 1
    assert name in text or str(experts[1]) in text
    log.unlink()
    code, _, err = run_cli(merge_args(base, experts, tmp / "out2", "--method", "no_such_method"), monkeypatch, capsys)
    assert code == 2 and log.read_text().startswith("error: ") and "no_such_method" in log.read_text()
    log.unlink()
    code, *_ = run_cli(merge_args(base, [experts[0]], tmp / "ok"), monkeypatch, capsys)
    assert code == 0 and not log.exists()


# ---- a CLI that explains itself (issue 28) --------------------------------------------------------


def _help(args, width=200) -> str:
    r = subprocess.run(
        [sys.executable, "-c", "from mergepipe.cli import main; main()", *args, "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": str(width)},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_version_and_flags_render_as_flags():
    r = subprocess.run(
        [sys.executable, "-c", "from mergepipe.cli import main; main()", "--version"], capture_output=True, text=True
    )
    from mergepipe import __version__

    assert r.returncode == 0 and r.stdout.strip() == f"mergepipe {__version__}"
    text = _help(["merge"])
    assert "<bool>" not in text  # `--json`, never `--json <bool>` (then `--json true` is tried and refused)
    row = next(ln for ln in text.splitlines() if "--json" in ln)
    assert "Print one JSON object" in row and "bool" not in row
    assert "--no-resume" in text


def test_help_reads_as_sentences_and_keeps_bracketed_defaults():
    """Command descriptions wrap at the terminal's width, not where the docstring's source line
    ended; option help keeps its "[default: ...]" (rich took it for a style tag and dropped it)."""
    from mergepipe import cli

    top = _help([], width=100)
    # every command's first paragraph is one flowing text: no row ends mid-sentence with the next
    # row starting a new left-aligned fragment of the same docstring
    summaries = {i.name or i.callback.__name__: i.help for i in cli.app.registered_commands}
    assert all(h and "\n" not in h.split("\n\n")[0] for h in summaries.values())
    flat = " ".join(" ".join(ln.strip("│ ").split()) for ln in top.splitlines())
    assert "(truncated SVD, one module at a time)" in flat
    text = " ".join(_help(["merge"]).replace("│", " ").split())
    for needle in ("[default: 0]", "[default: sign3+r1]", "[default: resume when an interrupted"):
        assert needle in text, needle


@pytest.mark.parametrize(
    "args,want",
    [
        (["mrege"], "No such command 'mrege'. Did you mean 'merge' or 'register'? See `mergepipe --help`."),
        (["merg"], "No such command 'merg'. Did you mean 'merge'? See `mergepipe --help`."),
        (["merge", "--jsn"], "No such option: --jsn. Did you mean --json? See `mergepipe merge --help`."),
    ],
)
def test_mistyped_command_suggestion_is_one_clean_sentence(monkeypatch, capsys, args, want):
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert " ".join(err.split()) == f"error: {want}"


def test_refusal_after_progress_started_prints_no_bar(fam, monkeypatch, capsys):
    """A failure in the middle of a merge leaves no progress-bar line before its one-line error
    (the bar is transient and drawn only once bytes move)."""
    tmp, base, experts = fam
    plan = tmp / "plan.json"
    ex = [a for e in experts for a in ("-e", str(e))]
    code, _, err = run_cli(["plan", "--base", str(base), *ex, "-o", str(plan), "--json"], monkeypatch, capsys)
    assert code == 0, err
    from mergepipe.storage.local import LocalStorage

    real, calls = LocalStorage._fetch, []

    def fetch(self, uri, requests):
        """Truncate expert1's shard under the reader on its third fetch, once output has been
        written: a real short read, found mid-merge (a file changed while it was read)."""
        if str(experts[1]) in uri:
            calls.append(uri)
            if len(calls) == 3:
                with open(uri, "r+b") as f:
                    f.truncate(os.path.getsize(uri) // 2)
        return real(self, uri, requests)

    monkeypatch.setattr(LocalStorage, "_fetch", fetch)
    code, out, err = run_cli(["execute", str(plan), "--out", str(tmp / "snap")], monkeypatch, capsys)
    assert code != 0 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err


KILL_PRELUDE = """
import os, signal
from mergepipe.commit import runs
_real, _count = runs.write_file_record, [0]
def _write_then_die(*a, **k):
    _real(*a, **k)
    _count[0] += 1
    if _count[0] == {after}:
        os.kill(os.getpid(), signal.SIGKILL)
runs.write_file_record = _write_then_die
from mergepipe.cli import main
main()
"""


def test_rerun_resumes_an_interrupted_resumable_run_by_default(fam, monkeypatch, capsys):
    """`execute --resume` killed after 2 durable files; a plain rerun (no flag) resumes it, says
    so in one line with the bytes kept, and keeps exactly the recorded files (digests checked)."""
    import signal

    tmp, base, experts = fam
    plan = tmp / "plan.json"
    ex = [a for e in experts for a in ("-e", str(e))]
    code, _, err = run_cli(["plan", "--base", str(base), *ex, "-o", str(plan), "--json"], monkeypatch, capsys)
    assert code == 0, err
    out = tmp / "snap"
    p = subprocess.run(
        [sys.executable, "-c", KILL_PRELUDE.format(after=2), "execute", str(plan), "--out", str(out), "--resume"],
        capture_output=True,
        cwd=Path(__file__).parents[2],
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    recorded = sorted(q.name[: -len(".json")] for q in tmp.glob(".snap.run-plan-*.records/files/*.json"))
    assert len(recorded) == 2
    (run,) = [q for q in tmp.glob(".snap.run-plan-*") if q.is_dir() and not q.name.endswith(".records")]
    kept_bytes = sum((run / n).stat().st_size for n in recorded)
    code, so, err = run_cli(["execute", str(plan), "--out", str(out), "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert "resuming this plan's interrupted run .snap.run-plan-" in err and "2 finished file(s)" in err
    from mergepipe.cli import _human

    assert _human(kept_bytes) in err
    (part,) = json.loads((out / "manifest.json").read_text())["parts"]
    assert sorted(part["kept"]) == recorded


def test_rerun_after_a_plain_crash_names_resume_and_the_bytes(fam, monkeypatch, capsys):
    """A dead plain run's staging folder cannot be kept (no records): the rerun starts over and
    says in one line how many bytes it redoes and which flag makes a run resumable."""
    tmp, base, experts = fam
    stg = tmp / ".snap.staging"
    stg.mkdir()
    (stg / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 3000)  # what the dead writer left
    code, so, err = run_cli(merge_args(base, experts, tmp / "snap", "--json"), monkeypatch, capsys)
    assert code == 0, err
    note = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(note) == 1 and "1 file(s), 2.9 KiB" in note[0] and "--resume" in note[0]
    (part,) = json.loads((tmp / "snap" / "manifest.json").read_text())["parts"]  # a run of one part
    assert part["kept"] == []
