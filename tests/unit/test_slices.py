"""mergekit ``slices`` configs (frankenmerges, depth up-scaling, merged slices with per-slice
parameters) against mergekit 0.1.5 itself on tiny real Llama checkpoints (bf16 and fp32,
4 layers, 4 shards each), their budgets and explanations, and their refusals.

mergekit is a test-only dependency (extra ``parity``, part of ``all``, so the README's install and
CI run these parity tests); without it they skip."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergepipe.config import load_config  # noqa: E402
from mergepipe.errors import InputError  # noqa: E402
from testkit.harness import merged_tensors, same_bits  # noqa: E402
from testkit.mergekit_run import _mergekit, _ours, _write, tiny_llama_family4  # noqa: E402


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return tiny_llama_family4(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return tiny_llama_family4(tmp_path_factory.mktemp("fp32"), torch.float32)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))


def _solar(m):
    return {
        "slices": [
            {"sources": [{"model": m["a"], "layer_range": [0, 3]}]},
            {"sources": [{"model": m["b"], "layer_range": [1, 4]}]},
        ],
        "merge_method": "passthrough",
        "dtype": "bfloat16",
    }


def test_passthrough_frankenmerge_bit_identical_to_mergekit(bf16, tmp_path):
    """SOLAR-style depth up-scaling (layers 0-2 of a, then 1-3 of b: 6 layers): every tensor
    equals mergekit's bit for bit, config.json says 6 layers, transformers loads and runs it,
    and every byte read is a source byte (each tensor read once)."""
    p = _write(tmp_path, _solar(bf16))
    ref = _mergekit(p, tmp_path / "mk")
    res, got = _ours(tmp_path, p, tmp_path / "out")
    assert set(got) == set(ref) and len(got) == 3 + 6 * 9
    assert all(same_bits(got[k], ref[k]) for k in ref)
    # output layer 3 is b's layer 1, output layer 2 is a's layer 2
    b1 = merged_tensors(bf16["b"])["model.layers.1.mlp.up_proj.weight"]
    assert same_bits(got["model.layers.3.mlp.up_proj.weight"], b1)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 6
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.num_hidden_layers == 6
    assert torch.isfinite(model(torch.tensor([[1, 5, 7]])).logits).all()
    io = res.manifest["io"]
    tensor_bytes = sum(t.numel() * t.element_size() for t in got.values())
    assert io["realized"]["expert_read_bytes"] == 0
    assert tensor_bytes <= io["realized"]["base_read_bytes"] <= io["estimated"]["base_read_bytes"]
    assert "a[0:3] + b[1:4]" in res.plan.explain and "copied layers/tensors: a " in res.plan.explain


def test_slerp_slices_per_slice_parameters_match_mergekit(bf16, tmp_path):
    """Two slices, the second re-using layers of a at another offset, with slice-level t (a
    filter list with a gradient: evaluated within its slice) over a merge-wide gradient: equal to
    mergekit 0.1.5 within float32 rounding (slerp coefficients from the catalog's float64 sums)."""
    cfg = {
        "slices": [
            {
                "sources": [
                    {"model": bf16["base"], "layer_range": [0, 2]},
                    {"model": bf16["a"], "layer_range": [0, 2]},
                ],
                "parameters": {"t": [{"filter": "self_attn", "value": [0.1, 0.9]}, {"value": 0.3}]},
            },
            {
                "sources": [
                    {"model": bf16["base"], "layer_range": [2, 4]},
                    {"model": bf16["a"], "layer_range": [1, 3]},
                ]
            },
        ],
        "merge_method": "slerp",
        "base_model": bf16["base"],
        "parameters": {"t": [{"filter": "mlp", "value": [0.2, 0.7]}, {"value": 0.6}]},
        "dtype": "float32",
    }
    p = _write(tmp_path, cfg)
    ref = _mergekit(p, tmp_path / "mk")
    _, got = _ours(tmp_path, p, tmp_path / "out")
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=2e-6, atol=1e-7, msg=k)


def _ties_slices(m):
    return {
        "slices": [
            {
                "sources": [
                    {"model": m["base"], "layer_range": [0, 4]},
                    {"model": m["a"], "layer_range": [0, 4], "parameters": {"density": 0.6, "weight": [0.3, 0.9]}},
                    {"model": m["b"], "layer_range": [0, 4], "parameters": {"density": 0.4, "weight": 0.5}},
                ]
            },
            {
                "sources": [
                    {"model": m["base"], "layer_range": [2, 4]},
                    {"model": m["a"], "layer_range": [2, 4]},
                    {"model": m["b"], "layer_range": [2, 4]},
                ],
                "parameters": {"density": 0.8, "weight": 0.7},
            },
        ],
        "merge_method": "ties",
        "base_model": m["base"],
        "dtype": "float32",
    }


def test_ties_slices_per_source_parameters_match_mergekit(fp32, tmp_path):
    """TIES over two slices with per-source density and weight gradients (first slice) and
    slice-level values (second): bit-identical to mergekit 0.1.5 (float32 inputs: exact top-k)."""
    p = _write(tmp_path, _ties_slices(fp32))
    ref = _mergekit(p, tmp_path / "mk")
    res, got = _ours(tmp_path, p, tmp_path / "out")
    assert set(got) == set(ref) and len(got) == 3 + 6 * 9
    bad = [k for k in ref if not same_bits(got[k], ref[k])]
    assert not bad, bad[:5]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 6


def test_budgeted_slices_realized_le_planned_le_budget(bf16, tmp_path, monkeypatch, capsys):
    """A 40% expert budget on the merged slices: realized <= planned <= budget, and the plan's
    explanation says which source models the copied and merged bytes came from."""
    cfg = {**_ties_slices(bf16), "budget": "40%"}
    p = _write(tmp_path, cfg)
    res, _ = _ours(tmp_path, p, tmp_path / "out")
    io = res.manifest["io"]
    assert 0 < io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"] <= io["expert_budget_bytes"]
    assert io["expert_budget_bytes"] == int(0.4 * io["expert_bytes_total"])
    ex = res.plan.explain
    assert "base = base[0:4] + base[2:4] (6 layers)" in ex and "merged expert blocks: a " in ex
    # `mergepipe explain` shows the views and the bytes by source model
    from testkit.harness import run_cli

    pf = tmp_path / "plan.json"
    pf.write_text(res.plan.to_json())
    code, out, err = run_cli(["explain", str(pf)], monkeypatch, capsys)
    assert code == 0, err
    assert "view: a = a[0:4] + a[2:4] (6 layers)" in out and "bytes by source" in out


@pytest.mark.parametrize(
    "patch,match",
    [
        (
            lambda m: {
                "slices": [
                    {"sources": [{"model": m["a"], "layer_range": [0, 2]}, {"model": m["b"], "layer_range": [0, 2]}]}
                ]
            },
            r"slices\[0\]\.sources: passthrough takes one source per slice",
        ),
        (
            lambda m: {"slices": [{"sources": [{"model": m["a"], "layer_range": [0, 9]}]}]},
            r"slices\[0\]\.sources\[0\]\.layer_range: \[0, 9\] is outside the 4 layers of ",
        ),
        (
            lambda m: {"slices": [{"sources": [{"model": m["a"], "layer_range": [2, 2]}]}]},
            r"slices\[0\]\.sources\[0\]\.layer_range: \[2, 2\] must satisfy 0 <= start < end",
        ),
        (
            lambda m: {"slices": [{"sources": [{"model": m["a"], "layer_range": [0, 2]}], "residual_weight": 0.5}]},
            r"slices\[0\]\.residual_weight: not supported",
        ),
        (
            lambda m: {
                "models": [{"model": m["a"]}],
                "slices": [{"sources": [{"model": m["a"], "layer_range": [0, 2]}]}],
            },
            r"slices: give either models or slices",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "base_model": m["base"],
                "slices": [
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [0, 2]},
                            {"model": m["a"], "layer_range": [0, 2]},
                        ]
                    },
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [2, 4]},
                            {"model": m["b"], "layer_range": [2, 4]},
                        ]
                    },
                ],
            },
            r"slices\[1\]\.sources: its models differ from slices\[0\]'s",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "base_model": m["base"],
                "slices": [
                    {"sources": [{"model": m["base"], "layer_range": [0, 2]}, {"model": m["a"], "layer_range": [0, 3]}]}
                ],
            },
            r"slices\[0\]\.sources: layer ranges of different lengths \[2, 3\]",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "base_model": m["base"],
                "slices": [
                    {"sources": [{"model": m["a"], "layer_range": [0, 2]}, {"model": m["b"], "layer_range": [0, 2]}]}
                ],
            },
            r"base_model: not among the slices' sources",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "base_model": m["base"],
                "slices": [
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [0, 2]},
                            {"model": m["a"], "layer_range": [0, 2]},
                        ],
                        "parameters": {"nonsense": 1},
                    },
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [2, 4]},
                            {"model": m["a"], "layer_range": [2, 4]},
                        ]
                    },
                ],
            },
            r"slices\[0\]\.parameters\.nonsense: ties takes no parameter 'nonsense'",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "base_model": m["base"],
                "slices": [
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [0, 2]},
                            {"model": m["a"], "layer_range": [0, 2]},
                        ],
                        "parameters": {"normalize": True},
                    },
                    {
                        "sources": [
                            {"model": m["base"], "layer_range": [2, 4]},
                            {"model": m["a"], "layer_range": [2, 4]},
                        ],
                        "parameters": {"normalize": False},
                    },
                ],
            },
            r"parameters\.normalize: takes one value per merge .* but the slices give \['False', 'True'\]",
        ),
        (
            lambda m: {
                "merge_method": "ties",
                "slices": [
                    {"sources": [{"model": m["a"], "layer_range": [0, 2]}, {"model": m["a"], "layer_range": [2, 4]}]}
                ],
            },
            r"slices\[0\]\.sources: a model is listed twice in one slice",
        ),
        (
            lambda m: {"base_model": m["base"], "slices": [{"sources": [{"model": m["a"], "layer_range": [0, 2]}]}]},
            r"base_model: passthrough copies its slices' sources and .* is none of them",
        ),
    ],
)
def test_slices_refusals_name_the_key(bf16, tmp_path, patch, match):
    import re

    cfg = {"merge_method": "passthrough", **patch(bf16)}
    p = _write(tmp_path, cfg)
    with pytest.raises(InputError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(str(p)) and re.search(match, msg), msg
