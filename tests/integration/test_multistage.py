"""Multi-stage mergekit configs (mergekit-multi's format) run locally: against mergekit 0.1.5's
``mergekit-multi`` on a tiny float32 Llama, stage order, cached intermediates, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergepipe.catalog.catalog import Catalog  # noqa: E402
from mergepipe.errors import InputError  # noqa: E402
from mergepipe.multistage import load_stages, merge_multi  # noqa: E402
from testkit.harness import merged_tensors  # noqa: E402
from testkit.mergekit_run import tiny_llama_family4  # noqa: E402


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return tiny_llama_family4(tmp_path_factory.mktemp("fp32"), torch.float32)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))


def _docs(m, density=0.5):
    stage1 = {
        "name": "stage1",
        "models": [{"model": m["a"], "parameters": {"weight": 0.5}}, {"model": m["b"], "parameters": {"weight": 0.5}}],
        "merge_method": "linear",
        "dtype": "float32",
    }
    final = {
        "models": [
            {"model": m["base"]},
            {"model": "stage1", "parameters": {"weight": 0.7, "density": density}},
            {"model": m["a"], "parameters": {"weight": 0.3, "density": density}},
        ],
        "merge_method": "ties",
        "base_model": m["base"],
        "dtype": "float32",
    }
    return [final, stage1]  # the final merge first: the order comes from the references


def _write(path, docs):
    path.write_text("---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))
    return path


def test_two_stage_config_matches_mergekit_multi_and_caches(fp32, tmp_path):
    """A linear stage whose output is an expert of the final TIES merge: both outputs equal
    mergekit-multi's (float32 rounding: mergepipe's linear is the task-vector form); a rerun
    recomputes nothing; changing only the final stage recomputes only it."""
    pytest.importorskip("mergekit")
    cfg = _write(tmp_path / "multi.yml", _docs(fp32))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mergekit.scripts.multimerge import main; main()",
            str(cfg),
            "--intermediate-dir",
            str(tmp_path / "mk_i"),
            "--out-path",
            str(tmp_path / "mk_out"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cat = Catalog(tmp_path / "c.db")
    res = merge_multi(cfg, tmp_path / "mp_i", str(tmp_path / "mp_out"), catalog=cat)
    assert [n for n, _ in res] == ["stage1", None] and not any(x.already_committed for _, x in res)
    for ours, theirs in (
        (tmp_path / "mp_i" / "stage1", tmp_path / "mk_i" / "stage1"),
        (tmp_path / "mp_out", tmp_path / "mk_out"),
    ):
        got, ref = merged_tensors(ours), merged_tensors(theirs)
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    # the final snapshot's plan names the intermediate as an expert
    assert any(e.uri == str(tmp_path / "mp_i" / "stage1") for e in res[1][1].plan.experts)
    again = merge_multi(cfg, tmp_path / "mp_i", str(tmp_path / "mp_out"), catalog=cat)
    assert all(x.already_committed for _, x in again)
    _write(cfg, _docs(fp32, density=0.6))
    third = merge_multi(cfg, tmp_path / "mp_i", str(tmp_path / "mp_out2"), catalog=cat)
    assert third[0][1].already_committed and not third[1][1].already_committed


@pytest.mark.parametrize(
    "docs,match",
    [
        (
            [{"name": "x", "merge_method": "linear"}, {"name": "x", "merge_method": "linear"}],
            r"two stages are named 'x'",
        ),
        ([{"merge_method": "linear"}, {"merge_method": "linear"}], r"two documents have no name"),
        ([{"name": "a/b", "merge_method": "linear"}], r"name: 'a/b' must be a folder name"),
        (
            [
                {"name": "x", "merge_method": "linear", "models": [{"model": "y"}]},
                {"name": "y", "merge_method": "linear", "models": [{"model": "x"}]},
            ],
            r"stages depend on each other in a cycle \(x -> y -> x\)",
        ),
    ],
)
def test_multistage_refusals(tmp_path, docs, match):
    cfg = _write(tmp_path / "multi.yml", docs)
    with pytest.raises(InputError, match=match) as ei:
        load_stages(cfg, tmp_path / "i")
    assert str(ei.value).startswith(str(cfg))


def test_final_stage_needs_out(fp32, tmp_path):
    cfg = _write(tmp_path / "multi.yml", _docs(fp32))
    with pytest.raises(InputError, match="unnamed final merge; give --out"):
        merge_multi(cfg, tmp_path / "i", None)


def test_cli_multi_merge_json_and_bad_input_exit_2(fp32, tmp_path, monkeypatch, capsys):
    """`mergepipe multi-merge`: one JSON object with every stage; a rerun reports every stage as
    already committed; a cycle exits 2 naming the file, writing nothing."""
    import json

    from testkit.harness import run_cli

    cfg = _write(tmp_path / "multi.yml", _docs(fp32))
    args = ["multi-merge", str(cfg), "-I", str(tmp_path / "i"), "--out", str(tmp_path / "o"), "--json"]
    args += ["--catalog", str(tmp_path / "c.db")]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    st = json.loads(out)["stages"]
    assert [s["name"] for s in st] == ["stage1", None] and not any(s["already_committed"] for s in st)
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0 and all(s["already_committed"] for s in json.loads(out)["stages"])
    bad = _write(
        tmp_path / "cycle.yml",
        [
            {"name": "x", "merge_method": "linear", "models": [{"model": "y"}]},
            {"name": "y", "merge_method": "linear", "models": [{"model": "x"}]},
        ],
    )
    code, out, err = run_cli(["multi-merge", str(bad), "-I", str(tmp_path / "j")], monkeypatch, capsys)
    assert code == 2 and str(bad) in err and "cycle" in err and out == "" and not (tmp_path / "j").exists()
