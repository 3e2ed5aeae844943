"""The vision testbed (mergepipe_zoo.vision): a real tiny CNN build, merged through the public
pipeline and scored: the round trip bench/quality.py --testbed vision runs, on 4-D conv weights."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mergepipe.errors import InputError
from mergepipe_zoo.vision import VisionConfig, VisionGateError, build_vision, check_gates, evaluate, load_body


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # tiny sizes train in seconds; the gates are the real ones except the merge's share (a tiny
    # CNN's full merge need not keep 0.3 of every gain): experts must still be best on their tasks
    cfg = dataclasses.replace(VisionConfig.tiny(seed=0), min_expert_gain=0.0, min_merge_ng=-1e9)
    return build_vision(tmp_path_factory.mktemp("vision"), cfg)


@pytest.mark.slow
def test_tiny_build_merge_eval_round_trip(tiny, tmp_path):
    import torch
    from safetensors import safe_open

    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    base, experts = tiny.checkpoints("bfloat16")
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert f.get_slice("conv2.weight").get_shape() == [16, 8, 3, 3]
    rb = evaluate(base, tiny.root, per_item=True)
    assert set(rb) == set(tiny.config.tasks) and all(len(v["items"]) == v["n"] for v in rb.values())
    re_ = {t: evaluate(p, tiny.root) for t, p in experts.items()}
    for t in tiny.config.tasks:  # the gate the build enforced: each expert is the best model on its task
        assert re_[t][t]["loss"] < rb[t]["loss"], t
    gates = json.loads((tiny.root / "gates.json").read_text())
    assert gates["bfloat16"]["passed"] and set(gates) == {"float32", "bfloat16"}

    cat = Catalog(tmp_path / "catalog.sqlite")
    ex = [(t, str(p)) for t, p in experts.items()]
    lam = tiny.config.merge_weight

    def run(tag: str, budget=None, sketch: str = "none"):
        return merge(
            str(base),
            ex,
            "task_arithmetic",
            str(tmp_path / tag),
            [f"weight={lam}"],
            budget=budget,
            catalog=cat,
            storage=LocalStorage(IOCounters()),
            sketch=sketch,
        )

    full = run("full")
    got = evaluate(full.out, tiny.root)
    # the same merge in memory (float32 of the bf16 checkpoints), then rounded to bf16 as written
    bodies = {n: load_body(p).state_dict() for n, p in {"base": base, **experts}.items()}
    want = {
        k: (v + lam * sum(bodies[t][k] - v for t in tiny.config.tasks)).to(torch.bfloat16).float()
        for k, v in bodies["base"].items()
    }
    merged = load_body(full.out)
    for k, v in merged.state_dict().items():  # within one bf16 rounding step of each other
        assert torch.allclose(v, want[k], rtol=8e-3, atol=1e-6), k
    assert set(got) == set(tiny.config.tasks)

    # a budget far below one exact expert tensor: the planner buys sketch tiers, 4-D convs included
    small = run("10pct", "10%", "sign3+r1")
    s = small.summary()
    assert s["io"]["expert_read_bytes"] <= 0.10 * s["io"]["expert_bytes_total"] + 1
    sketched = {tp.name for tp in small.plan.tensors for e in tp.experts if e.sketch_blocks}
    assert any(n.startswith("conv") and n.endswith(".weight") for n in sketched), sketched
    r10 = evaluate(small.out, tiny.root)
    assert set(r10) == set(tiny.config.tasks) and all(v["loss"] > 0 for v in r10.values())


def _ensure_kind_plugin(tmp_path, monkeypatch) -> None:
    """The ``mergepipe.testbed_kinds`` entry point as pyproject.toml declares it: installed by
    ``pip install -e .``; a checkout whose editable install predates it gets the same declaration
    from a dist-info folder on sys.path (importlib.metadata reads both the same way)."""
    import importlib.metadata as md
    from pathlib import Path

    import tomllib

    decl = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    kinds = decl["project"]["entry-points"]["mergepipe.testbed_kinds"]
    assert kinds == {"image-classification": "mergepipe_zoo.vision:evaluate"}
    if any(ep.name == "image-classification" for ep in md.entry_points(group="mergepipe.testbed_kinds")):
        return
    info = tmp_path / "site" / "mergepipe_kinds-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mergepipe-kinds\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[mergepipe.testbed_kinds]\n" + "".join(f"{k} = {v}\n" for k, v in kinds.items())
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


@pytest.mark.slow
def test_mergepipe_eval_scores_the_vision_kind(tiny, tmp_path, monkeypatch, capsys):
    """`mergepipe eval` on a vision testbed: the image-classification plugin's metrics, as the
    testbed's own evaluate gives them; bad input is one line and exit 2."""
    from testkit.harness import run_cli

    _ensure_kind_plugin(tmp_path, monkeypatch)
    base, experts = tiny.checkpoints("bfloat16")
    t = tiny.config.tasks[1]
    want = evaluate(experts[t], tiny.root)
    code, out, err = run_cli(["eval", str(experts[t]), "--testbed", str(tiny.root)], monkeypatch, capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["kind"] == "image-classification" and got["tasks"] == want
    assert got["tasks"][t]["loss"] < evaluate(base, tiny.root, [t])[t]["loss"]  # the expert beats the base
    code, out, err = run_cli(
        ["eval", str(base), "--testbed", str(tiny.root), "--tasks", f"{t},nope"], monkeypatch, capsys
    )
    assert code == 2 and out == "" and "nope" in err
    code, out, err = run_cli(
        ["eval", str(base), "--testbed", str(tiny.root), "--max-batches", "1"], monkeypatch, capsys
    )
    assert code == 2 and "--max-batches" in err


def test_gates_refuse_a_testbed_where_merging_does_not_help():
    base = {"a": 1.0, "b": 1.0}
    experts = {"a": {"a": 0.5, "b": 1.1}, "b": {"a": 1.1, "b": 0.6}}
    ok = check_gates(base, experts, {"a": 0.8, "b": 0.8}, 0.1, 0.3)
    assert ok["passed"] and ok["normalised_gain"] == pytest.approx({"a": 0.4, "b": 0.5})
    bad = check_gates(base, experts, {"a": 0.8, "b": 1.05}, 0.1, 0.3)
    assert not bad["passed"] and any("on b" in f for f in bad["failures"])
    weak = check_gates(base, {"a": {"a": 0.95, "b": 1.0}, "b": experts["b"]}, {"a": 0.9, "b": 0.8}, 0.1, 0.3)
    assert any("expert a" in f for f in weak["failures"])


@pytest.mark.slow
def test_a_failed_build_is_recorded_and_not_trained_again(tmp_path):
    # gates no build can pass (an expert 1000% below the base): the build fails, caches nothing
    cfg = dataclasses.replace(
        VisionConfig.tiny(seed=3), base_epochs=1, expert_epochs=1, probe_steps=5, min_expert_gain=10.0
    )
    with pytest.raises(VisionGateError) as e:
        build_vision(tmp_path, cfg)
    assert "expert" in str(e.value) and not (tmp_path / cfg.key()).exists()
    with pytest.raises(VisionGateError, match="recorded earlier"):
        build_vision(tmp_path, cfg)


def test_evaluate_refuses_a_folder_that_is_not_a_vision_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InputError, match="model_type"):
        load_body(tmp_path)
    with pytest.raises(InputError, match="testbed.json"):
        evaluate(tmp_path, tmp_path)
