"""The operator's in-process planning (mergepipe_operator.modelmerge.planning.plan_merge) with the real core
planner over an object catalog on SeaweedFS: no tensor byte read, no torch imported, ModelMerge
parameters (layer-wise lists included) reaching the plan, missing statistics reported with a
content address, refused inputs naming the spec field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from op_testlib import ROOT, analyze_into, core_storage, make_merge, upload_dir

from mergepipe.catalog.sketch import DEFAULT_SKETCH
from mergepipe_operator.modelmerge import (
    decisions as mmd,  # noqa: E402
    planning,  # noqa: E402
    spec as mmspec,  # noqa: E402
)

pytest.importorskip("kopf", reason="kopf (the operator framework) is not installed")

pytestmark = pytest.mark.s3


def merge_spec(m, *, experts=None, **over):
    names = ["code", "math", "chat"]
    spec = make_merge(**over)["spec"]
    spec["base"] = {"uri": m.base + "/"}
    spec["experts"] = (
        experts
        if experts is not None
        else [{"name": names[i], "uri": u + "/", "weight": 0.5} for i, u in enumerate(m.experts[:2])]
    )
    spec["output"] = {"uri": f"s3://{m.bucket}/snapshots/x/"}
    return spec


def test_plan_merge_reads_no_tensor_and_gives_the_worker_its_plan(s3_models, seaweed):
    from mergepipe.planner.plan import Plan

    st = core_storage(seaweed)
    spec = merge_spec(s3_models, budget=None)
    spec["budget"] = 20_000
    p = planning.plan_merge(spec, s3_models.catalog, storage=st)
    assert p.missing_experts == () and len(p.digest) == 64
    plan = Plan.from_json(p.plan_json.decode())
    assert plan.digest == p.digest and plan.method == "ties"
    assert [e.name for e in plan.experts] == ["code", "math"] and plan.base.uri == s3_models.base
    assert 0 < p.expert_read_bytes <= 20_000 and p.budget_bytes == 20_000 == plan.budget_bytes
    assert 0 < p.retained_energy < 1
    read = st.counters.snapshot()["read"]
    assert read["base"] == 0 and read["expert"] == 0 and read["catalog"] > 0  # headers + catalog objects only
    # deterministic: the same spec plans to the same digest (the Job name depends on it)
    assert planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed)).digest == p.digest
    unbounded = planning.plan_merge(merge_spec(s3_models, budget=None), s3_models.catalog, storage=st)
    assert unbounded.budget_bytes is None and unbounded.retained_energy == pytest.approx(1.0)


def test_spec_sketch_sets_the_plans_fidelity_tiers_as_the_cli_does(s3_models, seaweed):
    """spec.sketch none plans read-or-skip (digested as before tiers existed: no sketch field in
    the plan's semantic JSON), sign3 (also the default) merges some blocks from their sketches
    within the same budget; each plan is the CLI's plan for the same --sketch (same digest)."""
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.pipeline import build_plan
    from mergepipe.planner.plan import Plan
    from mergepipe_operator.modelmerge.request import merge_request, spec_where

    budget = 20_000
    spec = merge_spec(s3_models, budget=None)
    spec["budget"] = budget
    st = core_storage(seaweed)
    got = {
        kind: planning.plan_merge({**spec, "sketch": kind} if kind else spec, s3_models.catalog, storage=st)
        for kind in ("none", "sign1", "sign3", DEFAULT_SKETCH, None)
    }
    none, tiered = got["none"], got["sign3"]
    assert (none.sketch, none.sketch_read_bytes) == ("none", 0) and 0 < none.expert_read_bytes <= budget
    plan = Plan.from_json(none.plan_json.decode())
    assert plan.sketch is None and plan.io.sketch_read_bytes == 0 and '"sketch' not in plan.semantic_json()
    assert tiered.sketch == "sign3" and 0 < tiered.sketch_read_bytes <= tiered.expert_read_bytes <= budget
    assert got["sign1"].sketch == "sign1" and 0 < got["sign1"].sketch_read_bytes <= budget
    assert tiered.retained_energy > none.retained_energy  # the same budget keeps more with tiers
    assert (
        len({none.digest, got["sign1"].digest, tiered.digest}) == 3 and got[None].digest == got[DEFAULT_SKETCH].digest
    )
    tplan = Plan.from_json(tiered.plan_json.decode())
    assert tplan.sketch == "sign3" and any(te.sketch_blocks for t in tplan.tensors for te in t.experts)
    for kind in ("none", "sign3"):  # the CLI's path: the request without a sketch, --sketch KIND
        cli = build_plan(
            ObjectCatalog(st, s3_models.catalog),
            st,
            merge_request(spec, budget=budget).with_planning(block_bytes=mmd.ANALYZE_BLOCK_BYTES, sketch=kind),
            where=spec_where(spec),
            analyze=False,
        )
        assert cli.digest == got[kind].digest
    # without a budget every block is read exactly: no tiers whatever spec.sketch says
    free = planning.plan_merge({**merge_spec(s3_models, budget=None), "sketch": "sign3"}, s3_models.catalog, storage=st)
    assert (free.sketch, free.sketch_read_bytes) == ("none", 0)


def test_layer_wise_parameters_reach_the_plan(s3_models, seaweed):
    from mergepipe.planner.plan import Plan

    experts = [
        {"name": "code", "uri": s3_models.experts[0], "weight": 0.5, "parameters": {"density": [0.2, 0.8]}},
        {
            "name": "math",
            "uri": s3_models.experts[1],
            "parameters": {"weight": [{"filter": "mlp", "value": 0.25}, {"value": 0.75}], "density": 0.5},
        },
    ]
    spec = merge_spec(s3_models, experts=experts, budget=None, parameters={"normalize": False, "lambda": 1.5})
    assert mmspec.validate_merge_spec(spec) == []
    plan = Plan.from_json(
        planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed)).plan_json.decode()
    )
    by = {t.name: t for t in plan.tensors}

    def te(tensor, i):
        return next(e for e in by[tensor].experts if e.expert == i)

    q0, q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert (te(q0, 0).density, te(q1, 0).density) == pytest.approx((0.2, 0.8))  # gradient over 2 layers
    assert te(q0, 0).weight == pytest.approx(0.5)
    assert te("model.layers.0.mlp.up_proj.weight", 1).weight == pytest.approx(0.25)
    assert te(q0, 1).weight == pytest.approx(0.75) and te(q0, 1).density == pytest.approx(0.5)
    assert by[q0].params["lambda"] == pytest.approx(1.5) and by[q0].params["normalize"] is False


def test_missing_statistics_are_named_and_content_addressed(s3_models, seaweed):
    from mergepipe.catalog.objectstore import ObjectCatalog

    st = core_storage(seaweed)
    catalog = f"s3://{s3_models.bucket}/catalog-partial"
    analyze_into(seaweed, catalog, s3_models.base, s3_models.experts[:1])
    spec = merge_spec(s3_models, budget=10 * 1024**3)
    before = st.counters.snapshot()["read"]
    p = planning.plan_merge(spec, catalog, storage=st)
    after = st.counters.snapshot()["read"]
    assert p.digest == "" and p.missing_experts == (s3_models.experts[1],)
    cat = ObjectCatalog(st, catalog)
    base_id = cat.register(st, s3_models.base).identity
    math_id = cat.register(st, s3_models.experts[1]).identity
    assert p.analysis_id == mmd.analysis_id(base_id, [math_id], catalog, "ties")
    assert after["base"] == before["base"] and after["expert"] == before["expert"]  # nothing analyzed here
    # model_stock also needs the pair statistics, which `mergepipe analyze` does not record
    ms = merge_spec(
        s3_models, method="model_stock", parameters={}, budget=None, experts=[{"uri": u} for u in s3_models.experts[:2]]
    )
    ready = planning.plan_merge(ms, s3_models.catalog, storage=st)
    assert set(ready.missing_experts) == set(s3_models.experts[:2])


def test_inputs_the_core_refuses_name_the_spec_field(s3_models, seaweed, tmp_path):
    spec = merge_spec(s3_models, budget=None)
    spec["experts"][1]["uri"] = f"s3://{s3_models.bucket}/llama/no-such-expert/"
    with pytest.raises(planning.PlanInputError) as e:
        planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed))
    assert e.value.field == "spec.experts[1].uri" and "no-such-expert" in str(e.value)
    # an expert of another architecture is refused from its headers, before any analysis
    import numpy as np
    from safetensors.numpy import save_file

    alien = tmp_path / "alien"
    alien.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(alien / "model.safetensors"))
    spec = merge_spec(s3_models, budget=None)
    spec["experts"][0]["uri"] = upload_dir(s3_models.client, s3_models.bucket, alien, "llama/alien")
    with pytest.raises(planning.PlanInputError) as e:
        planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed))
    assert e.value.field == "spec.experts[0].uri" and "llama/alien" in str(e.value)
    # a parameter the core refuses (a gradient needs two values)
    spec = merge_spec(s3_models, budget=None)
    spec["experts"][0]["parameters"] = {"density": [0.5]}
    with pytest.raises(planning.PlanInputError, match="at least two values") as e:
        planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed))
    assert e.value.field == "spec.experts[0].parameters.density"


def _pod_env(seaweed, tmp_path, **extra: str) -> dict[str, str]:
    """This process's environment less its AWS settings, plus SeaweedFS's endpoint and keys and
    no AWS config files or instance metadata (what a pod sees), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        seaweed.env(),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
        **extra,
    )
    return env


def _run_cli(seaweed, tmp_path, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """Run the real ``mergepipe ARGS`` in a fresh interpreter with :func:`_pod_env` (its own
    ``MERGEPIPE_HOME``); asserts it exits 0."""
    env = _pod_env(seaweed, tmp_path, PYTHONPATH=str(ROOT), MERGEPIPE_HOME=str(tmp_path / "home"))
    r = subprocess.run(
        [sys.executable, "-m", "mergepipe.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr
    return r


def test_planning_never_imports_torch(s3_models, seaweed, tmp_path):
    """The operator image has no torch: plan in a fresh interpreter and check sys.modules."""
    spec = merge_spec(s3_models, budget=None)
    code = f"""
import json, sys
sys.path[:0] = {[str(ROOT), str(ROOT / "operator")]!r}
from mergepipe_operator.modelmerge.planning import plan_merge
p = plan_merge(json.loads({json.dumps(json.dumps(spec))}), {s3_models.catalog!r})
print(json.dumps({{"digest": p.digest, "torch": "torch" in sys.modules,
                   "kopf": "kopf" in sys.modules, "numpy": "numpy" in sys.modules}}))
"""
    env = _pod_env(seaweed, tmp_path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # planning is no kopf handler: the module imports neither torch nor kopf
    assert out["torch"] is False and out["numpy"] is True and out["kopf"] is False
    assert out["digest"] == planning.plan_merge(spec, s3_models.catalog, storage=core_storage(seaweed)).digest


def test_the_analyze_command_records_what_planning_needs(s3_models, seaweed, tmp_path):
    """The analyze Job's command (decisions.analyze_args) run with the real CLI fills the catalog:
    per-expert statistics, and for model_stock the pair statistics too (`mergepipe analyze --pairs`)."""
    catalog = f"s3://{s3_models.bucket}/catalog-pairs"
    spec = merge_spec(
        s3_models,
        method="model_stock",
        parameters={"filter_wise": False},
        budget=None,
        experts=[{"uri": u + "/"} for u in s3_models.experts[:2]],
    )
    assert mmspec.validate_merge_spec(spec) == []
    p = planning.plan_merge(spec, catalog, storage=core_storage(seaweed))
    assert set(p.missing_experts) == set(s3_models.experts[:2])
    args = mmd.analyze_args(spec, p.missing_experts, catalog)
    assert args[:2] == ["analyze", "--base"] and "--pairs" in args
    r = _run_cli(seaweed, tmp_path, args, timeout=300)
    (pair,) = json.loads(r.stdout)["pairs"]
    assert sorted(pair["experts"]) == sorted(s3_models.experts[:2]) and pair["tensors"] > 0
    done = planning.plan_merge(spec, catalog, storage=core_storage(seaweed))
    assert done.missing_experts == () and len(done.digest) == 64


@pytest.fixture(scope="module")
def s3_llm(seaweed, tmp_path_factory):
    """A real (tiny, randomly initialised) transformers Llama with a BPE tokenizer, base + 2
    experts in SeaweedFS, their statistics in an object catalog (no sensitivity yet), and a
    calibration file: what the Fisher statistic needs (config.json, tokenizer.json)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from testkit.tiny_llm import tiny_llama_family

    root = tmp_path_factory.mktemp("llm")
    text = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n# f{i} grows with x" for i in range(120)]
    paths, _model, _tok = tiny_llama_family(root, text, (("base", 0.0), ("code", 0.01), ("math", 0.02)))
    client = seaweed.client()
    bucket = seaweed.make_bucket("llm")
    uris = {name: upload_dir(client, bucket, d, f"llama/{name}") for name, d in paths.items()}
    client.put_object(
        Bucket=bucket,
        Key="calibration/code.jsonl",
        Body="".join(json.dumps({"text": t}) + "\n" for t in text[:40]).encode(),
    )
    catalog = f"s3://{bucket}/catalog"
    analyze_into(seaweed, catalog, uris["base"], [uris["code"], uris["math"]])
    return uris, f"s3://{bucket}/calibration/code.jsonl", catalog, bucket


@pytest.mark.slow
def test_a_calibration_set_in_the_spec_is_analyzed_once_and_plans_with_fisher(s3_llm, seaweed, tmp_path):
    """spec.calibration.uri: planning reports the base's sensitivity missing (content-addressed by
    the calibration file's digest, nothing but headers and catalog objects read); the analyze Job's
    command (real CLI) records it in the object catalog; then the plan uses the fisher value with
    the calibration digest in the plan (and its digest); blockValue energy plans without it."""
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.catalog.sensitivity import load_calibration
    from mergepipe.planner.plan import Plan

    uris, cal, catalog, bucket = s3_llm
    st = core_storage(seaweed)
    spec = make_merge(method="task_arithmetic", parameters={}, budget=None)["spec"]
    spec.update(
        base={"uri": uris["base"] + "/"},
        experts=[{"name": n, "uri": uris[n] + "/", "weight": 0.5} for n in ("code", "math")],
        output={"uri": f"s3://{bucket}/snapshots/x/"},
        calibration={"uri": cal},
        budget=30_000,
    )
    assert mmspec.validate_merge_spec(spec) == []
    p = planning.plan_merge(spec, catalog, storage=st)
    read = st.counters.snapshot()["read"]
    assert p.digest == "" and p.missing_experts == () and p.missing_sensitivity and p.needs_analysis
    base_id = ObjectCatalog(st, catalog).register(st, uris["base"]).identity
    digest = load_calibration(st, cal).digest
    assert p.analysis_id == mmd.analysis_id(base_id, [], catalog, "task_arithmetic", digest)
    assert p.analysis_id != mmd.analysis_id(base_id, [], catalog, "task_arithmetic")
    assert read["base"] == 0 and read["expert"] == 0
    args = mmd.analyze_args(spec, p.missing_experts, catalog, p.calibration_uri)
    assert args[args.index("--calibration") + 1] == cal
    r = _run_cli(seaweed, tmp_path, args, timeout=600)
    assert json.loads(r.stdout)["calibration"]["digest"] == digest
    assert ObjectCatalog(st, catalog).find_sensitivity(base_id, digest, mmd.ANALYZE_BLOCK_BYTES) is not None
    done = planning.plan_merge(spec, catalog, storage=st)
    assert not done.needs_analysis and len(done.digest) == 64 and done.block_value == "fisher"
    plan = Plan.from_json(done.plan_json.decode())
    assert plan.block_value == {"kind": "fisher", "calibration": digest} and plan.digest == done.digest
    assert 0 < done.expert_read_bytes <= 30_000
    energy = planning.plan_merge({**spec, "blockValue": "energy"}, catalog, storage=st)
    assert energy.block_value == "energy" and energy.digest not in ("", done.digest)
    # fisher without any calibration set is refused at the field
    nocal = {k: v for k, v in spec.items() if k != "calibration"}
    with pytest.raises(planning.PlanInputError) as e:
        planning.plan_merge({**nocal, "blockValue": "fisher"}, catalog, storage=st)
    assert e.value.field == "spec.blockValue"
    # a calibration URI that is no s3:// object is refused by the schema check
    bad = mmspec.validate_merge_spec({**spec, "calibration": {"uri": "/local/file.jsonl"}})
    assert [f for f, _ in bad] == ["spec.calibration.uri"]


def _synthetic_adapter(base_dir, out, modules, r=4, alpha=8.0, seed=0):
    """A PEFT-layout LoRA adapter (float32 factors) for ``modules`` of the synthetic family."""
    import numpy as np
    from safetensors.numpy import save_file

    from mergepipe.formats.safetensors import load_layout
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    lay = load_layout(LocalStorage(IOCounters()), str(base_dir))
    rng = np.random.default_rng(seed)
    t = {}
    for m in modules:
        o, i = lay.tensors[m + ".weight"].shape
        t[f"base_model.model.{m}.lora_A.weight"] = rng.standard_normal((r, i)).astype(np.float32) * 0.05
        t[f"base_model.model.{m}.lora_B.weight"] = rng.standard_normal((o, r)).astype(np.float32) * 0.05
    out.mkdir()
    save_file(t, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "up_proj"], "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return sum(a.nbytes for a in t.values())


def test_a_lora_adapter_expert_is_analyzed_planned_and_merged_from_its_factors(s3_models, seaweed, family, tmp_path):
    """spec.experts[i].format: lora — the analyze Job's command names it lora:URI, the in-process
    plan prices it at its factors' bytes, and the worker's execute reads just those."""
    base_dir, _ = family
    mods = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    fbytes = _synthetic_adapter(base_dir, tmp_path / "ad", mods)
    ad = upload_dir(s3_models.client, s3_models.bucket, tmp_path / "ad", "llama/adapter")
    catalog = f"s3://{s3_models.bucket}/catalog-lora"
    spec = merge_spec(
        s3_models,
        method="ties",
        budget=None,
        experts=[{"name": "ad", "uri": ad + "/", "format": "lora"}, {"name": "e0", "uri": s3_models.experts[0] + "/"}],
    )
    assert mmspec.validate_merge_spec(spec) == []
    p = planning.plan_merge(spec, catalog, storage=core_storage(seaweed))
    assert ad in p.missing_experts
    args = mmd.analyze_args(spec, p.missing_experts, catalog)
    assert f"lora:{ad}" in args and s3_models.experts[0] in args
    _run_cli(seaweed, tmp_path, args, timeout=300)
    st = core_storage(seaweed)
    done = planning.plan_merge(spec, catalog, storage=st)
    assert done.missing_experts == ()
    from mergepipe.planner.plan import Plan

    plan = Plan.from_json(done.plan_json.decode())
    assert plan.experts[0].adapter is not None and plan.experts[0].adapter["r"] == 4
    lora_bytes = sum(te.bytes for tp in plan.tensors for te in tp.experts if te.expert == 0)
    assert lora_bytes == fbytes and {tp.name for tp in plan.tensors if any(te.expert == 0 for te in tp.experts)} == {
        m + ".weight" for m in mods
    }
    assert st.counters.snapshot()["read"]["expert"] == 0  # planning reads no tensor byte
    (tmp_path / "plan.json").write_text(plan.to_json())
    out = f"s3://{s3_models.bucket}/snapshots/lora-op"
    r = _run_cli(seaweed, tmp_path, ["execute", str(tmp_path / "plan.json"), "--out", out, "--json"], timeout=300)
    res = json.loads(r.stdout)
    assert res["io"]["expert_read_bytes"] == plan.io.expert_read_bytes
