"""mergekit YAML configs (`mergepipe merge --config`): parsing, every refusal (with the config
path and key in the message, exit 2, nothing written, no tensor byte read), out_dtype end to end."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.catalog.catalog import Catalog
from mergepipe.config import load_config, merge_from_config
from mergepipe.errors import InputError
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage
from testkit.dense_reference import merge_checkpoint_dense
from testkit.harness import merged_tensors, run_cli, same_bits


def write(tmp_path, cfg, name="merge.yml") -> Path:
    p = tmp_path / name
    p.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False))
    return p


def base_cfg(family, **kw):
    base, experts = family
    cfg = {
        "models": [{"model": str(base)}] + [{"model": str(e), "parameters": {"weight": 1.0}} for e in experts],
        "merge_method": "ties",
        "base_model": str(base),
        "parameters": {"density": 0.5},
    }
    cfg.update(kw)
    return cfg


def test_parses_mergekit_config_with_own_keys(family, tmp_path):
    base, experts = family
    cfg = base_cfg(
        family, dtype="bfloat16", out_dtype="float16", tokenizer_source="base", budget="40%", fidelity=0.9, seed=5
    )
    cfg["models"][1]["parameters"] = {"weight": 0.7, "density": [0.3, 0.9]}
    cfg["models"][2]["parameters"] = {"weight": [{"filter": "mlp", "value": 0.2}, {"value": 0.5}]}
    cfg["parameters"].update({"normalize": True, "int8_mask": True, "lambda": 1.1})
    c = load_config(write(tmp_path, cfg))
    assert c.base == str(base) and c.method == "ties"
    assert c.experts == [(e.name, str(e)) for e in experts]  # the base entry is the base, not an expert
    assert c.dtype == "bfloat16" and c.out_dtype == "F16"
    assert (c.budget, c.fidelity, c.seed) == ("40%", 0.9, 5)
    r = c.resolved
    assert r.experts[0]["density"] == [0.3, 0.9] and r.experts[1]["density"] == 0.5
    assert r.globals["lambda"] == 1.1
    assert c.source["sha256"] and "merge_method: ties" in c.source["yaml"]
    # dtype alone is also the output dtype (mergekit keeps results in dtype)
    c = load_config(write(tmp_path, base_cfg(family, dtype="torch.float32")))
    assert c.dtype == "float32" and c.out_dtype == "F32"


REFUSALS = [
    ({"slices": [{"sources": []}]}, r"slices: give either models or slices"),
    ({"modules": {"text": {}}}, r"modules: mergekit modules .* not supported"),
    # (this family has no tokenizer files: a merged vocabulary or chat template needs them)
    ({"tokenizer_source": "union"}, r"tokenizer: cannot load the tokenizer of .*needs each model's tokenizer files"),
    ({"tokenizer_source": "some/model"}, r"tokenizer source: 'some/model' is not a folder"),
    ({"tokenizer": {"source": "base"}}, r"tokenizer: cannot load the tokenizer of"),
    ({"chat_template": "chatml"}, r"tokenizer: cannot load the tokenizer of"),
    ({"merge_method": "frankenmerge"}, r"merge_method: unknown merge method 'frankenmerge'; allowed: linear"),
    ({"dtype": "int8"}, r"dtype: 'int8' is not a dtype mergepipe writes; use one of bfloat16"),
    ({"out_dtype": "fp8"}, r"out_dtype: 'fp8' is not a dtype"),
    ({"budget": "lots"}, r"budget 'lots': not a byte quantity"),
    ({"fidelity": 1.5}, r"fidelity: 1.5 is outside \(0, 1\]"),
    ({"seed": -1}, r"seed: must be a non-negative integer"),
    ({"random_key": 1}, r"random_key: unknown key"),
    ({"parameters": {"density": 0}}, r"parameters.density: density=0 is outside \(0, 1\]"),
    ({"parameters": {"density": [0.5]}}, r"parameters.density: a gradient needs at least two values"),
    ({"parameters": {"gamma": 0.1}}, r"parameters.gamma: method 'ties' takes no parameter 'gamma'; allowed:"),
    ({"merge_method": "slerp", "parameters": {"t": 0.5}}, r"models: slerp takes exactly 1 expert\(s\)"),
    ({"merge_method": "slerp", "parameters": {"t": 2}}, r"models: slerp takes exactly 1"),
]


@pytest.mark.parametrize("patch,match", REFUSALS, ids=[next(iter(p)) + str(i) for i, (p, _) in enumerate(REFUSALS)])
def test_refusals_name_config_and_key(family, tmp_path, patch, match):
    p = write(tmp_path, base_cfg(family, **patch))
    with pytest.raises(InputError, match=match) as ei:
        load_config(p)
    assert str(ei.value).startswith(f"{p}: ")


def test_model_reference_refusals(family, tmp_path):
    base, experts = family
    cases = [
        (
            f"{experts[0]}+{experts[1]}",
            r"models\[1\].model: the LoRA adapter .* is given on .*, which is not the merge's base_model",
        ),
        (f"{experts[0]}@main", r"models\[1\].model: .* model@revision reference; revisions are not supported"),
        ({"model": {"path": str(experts[0]), "revision": "v1"}}, r"models\[1\].model.model.revision: revisions"),
        ({"model": str(experts[0]), "lora": "adapter"}, r"models\[1\].model.lora: 'adapter' is not a folder"),
        (f"{base}@main+{experts[0]}", r"models\[1\].model: .* model@revision reference"),
        (
            "mistralai/Mistral-7B-v0.1",
            r"models\[1\].model: 'mistralai/Mistral-7B-v0.1' is not a folder .* Hugging Face Hub",
        ),
    ]
    for ref, match in cases:
        cfg = base_cfg(family)
        cfg["models"][1]["model"] = ref
        p = write(tmp_path, cfg)
        with pytest.raises(InputError, match=match) as ei:
            load_config(p)
        assert str(ei.value).startswith(f"{p}: ")
    cfg = base_cfg(family)
    del cfg["base_model"]
    with pytest.raises(InputError, match=r"merge.yml: base_model: required"):
        load_config(write(tmp_path, cfg))
    cfg = base_cfg(family)
    cfg["models"][0]["parameters"] = {"weight": 0.5}
    with pytest.raises(InputError, match=r"models\[0\].parameters: parameters on the base model"):
        load_config(write(tmp_path, cfg))
    cfg = base_cfg(family)
    cfg["models"][1]["parameters"] = {"weight": 1, "densty": 0.5}
    with pytest.raises(InputError, match=r"merge.yml: models\[1\].parameters.densty: method 'ties' takes no parameter"):
        load_config(write(tmp_path, cfg))
    cfg = base_cfg(family)
    cfg["models"][1]["extra"] = 1
    with pytest.raises(InputError, match=r"merge.yml: models\[1\].extra: unknown key"):
        load_config(write(tmp_path, cfg))
    for text, match in (
        ("models: [\n", r"not valid YAML at line"),
        ("- a\n- b\n", r"a mergekit config is a mapping"),
        ("merge_method: ties\nbase_model: x\n", r"models: required"),
    ):
        with pytest.raises(InputError, match=match):
            load_config(write(tmp_path, text))
    with pytest.raises(InputError, match=r"nope.yml: cannot read the config"):
        load_config(tmp_path / "nope.yml")


def test_layerwise_problem_found_before_any_tensor_byte(family, tmp_path):
    """A layer-wise value invalid for some tensors (della's density ± epsilon) is refused after
    reading only headers: no base or expert tensor byte, nothing written."""
    cfg = base_cfg(family, merge_method="della", parameters={"density": [0.5, 0.9]})
    p = write(tmp_path, cfg)
    st = LocalStorage(IOCounters())
    with pytest.raises(InputError, match=r"models\[1\].parameters.density / .*epsilon: for tensor 'model.layers.1"):
        merge_from_config(p, str(tmp_path / "out"), catalog=Catalog(tmp_path / "c.sqlite"), storage=st)
    rd = st.counters.snapshot()["read"]
    assert rd.get("base", 0) == 0 and rd.get("expert", 0) == 0
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_out_dtype_end_to_end(family, tmp_path):
    """out_dtype float32 from bf16 inputs: data equals the dense reference cast to float32, shard
    headers and index say F32 (including tensors copied from the base), config.json too, and the
    snapshot verifies. slerp with t = 0 at layer 0 leaves those tensors equal to the base."""
    from mergepipe.commit.manifest import verify_snapshot
    from mergepipe.formats.safetensors import load_layout

    base, experts = family
    cfg = {
        "models": [{"model": str(base)}, {"model": str(experts[0])}],
        "merge_method": "slerp",
        "base_model": str(base),
        "parameters": {"t": [0.0, 0.6]},
        "dtype": "bfloat16",
        "out_dtype": "float32",
    }
    res = merge_from_config(write(tmp_path, cfg), str(tmp_path / "out"), catalog=Catalog(tmp_path / "c.sqlite"))
    assert any(t.copy_base for t in res.plan.tensors) and res.plan.out_dtype == "F32"
    got = merged_tensors(res.out)
    c = load_config(tmp_path / "merge.yml")
    ref = merge_checkpoint_dense(str(base), [str(experts[0])], c.resolved, out_dtype=torch.float32)
    assert set(got) == set(ref)
    assert all(got[n].dtype == torch.float32 and same_bits(got[n], ref[n]) for n in ref)
    b = merged_tensors(base)
    assert same_bits(got["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"].float())
    lay = load_layout(LocalStorage(IOCounters()), res.out)
    assert {t.dtype for t in lay.tensors.values()} == {"F32"}
    idx = json.loads((Path(res.out) / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == sum(t.nbytes for t in lay.tensors.values())
    assert json.loads((Path(res.out) / "config.json").read_text())["torch_dtype"] == "float32"
    m = res.manifest
    assert m["dtype"] == {"compute": "float32", "requested": "bfloat16", "out": "F32"}
    assert m["config"]["sha256"] and m["io"]["estimated"]["output_write_bytes"] > 0
    assert verify_snapshot(res.out)["ok"]


def test_out_dtype_equal_to_input_plans_like_cli(family, tmp_path):
    from mergepipe.pipeline import build_plan
    from mergepipe.request import request_from_args

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    c = load_config(write(tmp_path, base_cfg(family, out_dtype="bfloat16")))
    p1 = build_plan(cat, st, c.with_overrides(budget="50%"), where=c.where)
    p2 = build_plan(
        cat,
        st,
        request_from_args(
            str(base), [(e.name, str(e)) for e in experts], "ties", ["density=0.5", "weight=1.0"], budget="50%"
        ),
    )
    assert p1.out_dtype is None and p1.digest == p2.digest


def test_cli_merge_config(family, tmp_path, monkeypatch, capsys):
    base, experts = family
    cfg = base_cfg(family, budget="30%", seed=2)
    cfg["parameters"]["density"] = [0.3, 0.8]
    p = write(tmp_path, cfg)
    code, out, err = run_cli(
        ["merge", "--config", str(p), "--out", str(tmp_path / "out"), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    res = json.loads(out)
    assert res["io"]["expert_budget_bytes"] == int(
        0.3 * sum(f.stat().st_size for e in experts for f in Path(e).glob("*.safetensors"))
    )
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["seed"] == 2 and m["config"]["path"] == str(p)
    # CLI --budget overrides the config's budget
    code, out, err = run_cli(
        ["merge", "--config", str(p), "--out", str(tmp_path / "out2"), "--budget", "unlimited", "--json"],
        monkeypatch,
        capsys,
    )
    assert code == 0 and json.loads(out)["io"]["expert_budget_bytes"] is None
    # models/method/parameters come from the config only
    code, _, err = run_cli(
        ["merge", "--config", str(p), "--out", str(tmp_path / "o3"), "--method", "linear"], monkeypatch, capsys
    )
    assert code == 2 and "drop --method" in err and not (tmp_path / "o3").exists()
    code, _, err = run_cli(["merge", "--out", str(tmp_path / "o4")], monkeypatch, capsys)
    assert code == 2 and "--base and --expert are required" in err
    # a config without mergepipe's own keys (a plain mergekit config) merges with seed 0
    p5 = write(tmp_path, base_cfg(family), name="plain.yml")
    code, out, err = run_cli(
        ["merge", "--config", str(p5), "--out", str(tmp_path / "o5"), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    assert json.loads((tmp_path / "o5" / "manifest.json").read_text())["seed"] == 0


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"slices": [{"sources": []}]}, "slices"),
        ({"parameters": {"density": 2}}, "parameters.density"),
        ({"merge_method": "model_stock", "parameters": {}}, None),
    ],
)
def test_cli_config_bad_input_exit_2_nothing_written(family, tmp_path, monkeypatch, capsys, patch, match):
    base, experts = family
    cfg = base_cfg(family, **patch)
    if match is None:  # model_stock with one expert (2 models incl. the base)
        cfg["models"] = cfg["models"][:2]
        match = r"models: model_stock takes at least 2 expert\(s\) besides the base \(3 models including the base\)"
    p = write(tmp_path, cfg)
    out = tmp_path / "out"
    code, stdout, err = run_cli(["merge", "--config", str(p), "--out", str(out)], monkeypatch, capsys)
    assert code == 2
    assert str(p) in err
    import re

    assert re.search(match, err.replace("\n", "")), err
    assert not out.exists() and stdout == ""


def test_cli_plan_config_same_plan_as_merge(family, tmp_path, monkeypatch, capsys):
    """`plan --config` reads the same mergekit YAML as `merge --config` and plans the same merge:
    the saved plan executes to the snapshot `merge --config` commits."""
    cfg = base_cfg(family, budget="40%", seed=3)
    cfg["parameters"]["density"] = [0.3, 0.8]
    p = write(tmp_path, cfg)
    code, out, err = run_cli(
        ["plan", "--config", str(p), "--out", str(tmp_path / "plan.json"), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    planned = json.loads(out)
    code, out, err = run_cli(["merge", "--config", str(p), "--out", str(tmp_path / "m"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    merged = json.loads(out)
    assert planned["plan_digest"] == merged["plan_digest"]
    assert planned["expert_budget_bytes"] == merged["io"]["expert_budget_bytes"]
    code, out, err = run_cli(
        ["execute", str(tmp_path / "plan.json"), "--out", str(tmp_path / "x"), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    assert json.loads(out)["snapshot_id"] == merged["snapshot_id"]
    # the same refusals as merge: config and explicit models together, bad config keys
    code, _, err = run_cli(["plan", "--config", str(p), "--param", "density=0.2"], monkeypatch, capsys)
    assert code == 2 and "drop --param" in err
    bad = write(tmp_path, {**cfg, "slices": [{"sources": []}]}, name="bad.yml")
    code, _, err = run_cli(["plan", "--config", str(bad), "--out", str(tmp_path / "bad.json")], monkeypatch, capsys)
    assert code == 2 and str(bad) in err and "slices" in err and not (tmp_path / "bad.json").exists()
    code, _, err = run_cli(["plan"], monkeypatch, capsys)
    assert code == 2 and "--base and --expert are required" in err


def _mergekit_linear(models_and_weights, name):
    """mergekit 0.1.5's linear (merge_methods/linear.py) in float64: Σ wᵢθᵢ / Σ wᵢ."""

    from testkit.harness import merged_tensors

    num = den = 0
    for folder, w in models_and_weights:
        t = merged_tensors(folder)[name].double()
        num = num + w * t
        den = den + w
    return num / den


@pytest.mark.parametrize("with_base_model", [True, False])
def test_linear_config_averages_every_input_like_mergekit(family, tmp_path, monkeypatch, capsys, with_base_model):
    """mergekit's linear averages every input model, base_model included (added when not listed)
    with its weight; mergepipe computes the same average as task vectors against that origin."""
    import torch

    from testkit.harness import merged_tensors

    base, experts = family
    ws = [0.4, 0.3, 0.2]
    cfg = {
        "models": [{"model": str(e), "parameters": {"weight": w}} for e, w in zip(experts, ws)],
        "merge_method": "linear",
        "dtype": "float32",
    }
    inputs = list(zip(experts, ws))
    if with_base_model:  # base not listed: mergekit adds it, weighted by the global weight
        cfg["base_model"] = str(base)
        cfg["parameters"] = {"weight": 0.1}
        inputs.append((base, 0.1))
    p = write(tmp_path, cfg)
    code, out, err = run_cli(
        ["merge", "--config", str(p), "--out", str(tmp_path / "out"), "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    got = merged_tensors(tmp_path / "out")
    assert got
    for name, t in got.items():
        if not t.dtype.is_floating_point:
            continue
        want = _mergekit_linear(inputs, name)
        # float32 output: the task-vector form rounds differently from mergekit's direct sum by a few ulps
        assert t.dtype == torch.float32
        torch.testing.assert_close(t.double(), want, rtol=1e-6, atol=1e-6), name


def test_linear_config_refusals(family, tmp_path, monkeypatch, capsys):
    base, experts = family
    models = [{"model": str(e), "parameters": {"weight": 0.5}} for e in experts]
    cases = [
        (
            {"models": models, "merge_method": "linear", "base_model": str(base)},
            "base_model: parameters.weight: required by mergekit's linear",
        ),
        (
            {"models": [{"model": str(base)}] + models, "merge_method": "linear", "base_model": str(base)},
            "models[0]: parameters.weight: required by mergekit's linear",
        ),
        (
            {"models": models, "merge_method": "linear", "parameters": {"normalize": False}},
            "parameters.normalize: mergekit's linear with normalize: false",
        ),
        ({"models": models, "merge_method": "ties"}, "base_model: required"),
    ]
    for i, (cfg, msg) in enumerate(cases):
        p = write(tmp_path, cfg, name=f"c{i}.yml")
        out = tmp_path / f"o{i}"
        code, stdout, err = run_cli(["merge", "--config", str(p), "--out", str(out)], monkeypatch, capsys)
        assert code == 2, (cfg, err)
        assert str(p) in err and msg in " ".join(err.split()), err
        assert not out.exists() and stdout == ""


def test_mergekit_multi_configs_refused_naming_the_key(family, tmp_path):
    """mergekit-multi's format (a name: per stage, several YAML documents) is refused by `merge
    --config` in one line naming the key and the command that runs it (`multi-merge`)."""
    cfg = base_cfg(family)
    p = write(tmp_path, {**cfg, "name": "stage1"}, name="named.yml")
    with pytest.raises(InputError, match=r"named\.yml: name: name: marks a mergekit-multi stage"):
        load_config(p)
    multi = tmp_path / "multi.yml"
    multi.write_text(yaml.safe_dump({**cfg, "name": "a"}) + "---\n" + yaml.safe_dump(cfg))
    with pytest.raises(InputError) as ei:
        load_config(multi)
    msg = str(ei.value)
    assert msg.startswith(f"{multi}: a mergekit-multi config") and "multi-merge" in msg and "\n" not in msg
