"""Parameter settings (scalars, gradients, filter lists) and their per-tensor resolution: unit
tests of the pure resolver (mergepipe.methods.params), no checkpoint involved."""

import pytest

from mergepipe.errors import InputError
from mergepipe.methods.params import evaluate, layer_count, layer_index, layer_t, param_loc, resolve_params
from mergepipe.request import parse_param_args

NAMES = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)] + ["model.embed_tokens.weight", "lm_head.weight"]


def test_layer_index_and_position():
    assert layer_index("model.layers.12.self_attn.q_proj.weight") == 12
    assert layer_index("transformer.h.3.attn.c_attn.weight") == 3
    assert layer_index("bert.encoder.layer.5.attention.self.query.weight") == 5
    assert layer_index("model.blocks.0.ffn.weight") == 0
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers_extra.1.w"):
        assert layer_index(n) is None
    assert layer_count(NAMES) == 5
    # mergekit: t = layer / (layers - 1); a single layer gets t = 1; no layer index gets t = 0
    assert [layer_t(n, 5) for n in NAMES] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.0, 0.0]
    assert layer_t("model.layers.0.w", 1) == 1.0


def test_gradient_interpolation_is_mergekits():
    g = [0.0, 0.5, 1.0]
    assert [evaluate(g, "x", t) for t in (0, 0.25, 0.5, 0.75, 1.0)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert evaluate([0.2, 0.8], "x", 1 / 3) == pytest.approx(0.4)
    assert evaluate([1.0, 0.0, 1.0, 0.0], "x", 0.5) == pytest.approx(0.5)  # between the middle points
    assert evaluate([0.3, 0.3], "x", 0.7) == 0.3


def _tensor(rp, name, n=5):
    return rp.for_tensor(name, layer_t(name, n))


def test_precedence_expert_over_global_over_default():
    rp = resolve_params("ties", {"density": 0.5}, [{"density": 0.2}, {}, {"weight": 2}])
    t = _tensor(rp, NAMES[0])
    assert [e["density"] for e in t.experts] == [0.2, 0.5, 0.5]
    assert [e["weight"] for e in t.experts] == [1.0, 1.0, 2.0]  # default weight 1
    assert t.globals == {"lambda": 1.0, "normalize": True, "rescale": False, "int8_mask": False}


def test_filters_first_match_and_fall_through_to_global():
    rp = resolve_params(
        "ties",
        {"density": [{"filter": "self_attn", "value": 0.3}, {"value": [0.2, 0.6]}]},
        [{"density": [{"filter": "mlp", "value": 0.9}]}, {}],
    )
    mlp, attn, emb = "model.layers.2.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight", NAMES[5]
    assert _tensor(rp, mlp).experts[0]["density"] == 0.9  # expert's own filter
    assert _tensor(rp, attn).experts[0]["density"] == 0.3  # no own match: falls through to the merge-wide filter
    assert _tensor(rp, attn).experts[1]["density"] == 0.3
    assert _tensor(rp, mlp).experts[1]["density"] == pytest.approx(0.4)  # catch-all gradient, layer 2 of 5
    assert _tensor(rp, emb).experts[1]["density"] == 0.2  # no layer: the gradient's first value
    # an expert's filter list without a match and no merge-wide setting: the method's default
    rp = resolve_params("ties", {}, [{"density": [{"filter": "mlp", "value": 0.4}]}])
    assert _tensor(rp, emb).experts[0]["density"] == 1.0
    # '*' is mergekit's catch-all
    rp = resolve_params("ties", {"density": [{"filter": "mlp", "value": 0.4}, {"filter": "*", "value": 0.7}]}, [{}])
    assert _tensor(rp, emb).experts[0]["density"] == 0.7


def test_filter_lists_that_shadow_entries_are_refused():
    with pytest.raises(
        InputError, match=r"--param density\[1\].filter: 'mlp.down_proj' is never used.*entry 0 \('mlp'\)"
    ):
        resolve_params(
            "ties", {"density": [{"filter": "mlp", "value": 0.4}, {"filter": "mlp.down_proj", "value": 0.2}]}, [{}]
        )
    with pytest.raises(InputError, match=r"--param density\[0\]: the entry without filter matches every tensor"):
        resolve_params("ties", {"density": [{"value": 0.4}, {"filter": "mlp", "value": 0.2}]}, [{}])
    # the more specific filter first is fine (first match == most specific)
    resolve_params(
        "ties", {"density": [{"filter": "mlp.down_proj", "value": 0.2}, {"filter": "mlp", "value": 0.4}]}, [{}]
    )


@pytest.mark.parametrize(
    "setting,match",
    [
        ("[0.5]", r"a gradient needs at least two values"),
        ("[]", r"empty list"),
        ("[0.5, 2]", r"density\[1\]: density=2 is outside \(0, 1\]"),
        ('[0.5, "x"]', r"must be a number"),
        ("[0.5, [0.2, 0.3]]", r"mixes numbers"),
        ("[0.5,", r"not valid JSON"),
        ('[{"filter": "mlp"}]', r"value is missing"),
        ('[{"filter": "mlp", "value": 0.5, "extra": 1}]', r"unknown key"),
        ('[{"filter": "", "value": 0.5}]', r"filter: must be a non-empty substring"),
        ('[{"filter": "mlp", "value": [0.5, 0]}]', r"density\[0\].value\[1\]: density=0 is outside \(0, 1\]"),
        ("0", r"density=0 is outside \(0, 1\]"),
        ("1.5", r"outside \(0, 1\]"),
        ("nan", r"finite"),
    ],
)
def test_bad_settings_name_the_key(setting, match):
    with pytest.raises(InputError, match=match) as ei:
        g, per = parse_param_args([f"density={setting}"], "ties", ["x"])  # the CLI edge, then the validator
        resolve_params("ties", g, per)
    assert str(ei.value).startswith("--param density")
    assert ei.value.loc[:2] == ("parameters", "density")


def test_method_level_checks():
    with pytest.raises(
        InputError, match=r"--param 1:gamma: method 'ties' takes no parameter 'gamma'; allowed: weight, density"
    ):
        resolve_params("ties", {}, [{"gamma": 0.1}])
    with pytest.raises(InputError, match="lambda is a global parameter"):
        resolve_params("ties", {}, [{"lambda": 2}])
    with pytest.raises(
        InputError, match=r"slerp takes exactly 1 expert\(s\) besides the base \(the base and one expert\); got 2"
    ):
        resolve_params("slerp", {"t": 0.5}, [{}, {}])
    with pytest.raises(InputError, match=r"model_stock takes at least 2 expert\(s\) besides the base \(3 models"):
        resolve_params("model_stock", {}, [{}])
    with pytest.raises(InputError, match=r"nuslerp takes exactly 2"):
        resolve_params("nuslerp", {}, [{}, {}, {}])
    with pytest.raises(InputError, match=r"--param t: slerp needs t in \[0, 1\]"):
        resolve_params("slerp", {}, [{}])
    with pytest.raises(InputError, match=r"--param t: t=1.5 is outside \[0, 1\]"):
        resolve_params("slerp", {"t": 1.5}, [{}])
    with pytest.raises(InputError, match=r"gamma=1 is outside \[0, 1\)"):
        resolve_params("breadcrumbs", {"gamma": 1}, [{}])
    with pytest.raises(InputError, match="boolean parameters are not layer-wise"):
        resolve_params("ties", {"normalize": [True, False]}, [{}])
    with pytest.raises(InputError, match="nuslerp_row_wise=true with nuslerp_flatten=false"):
        resolve_params("nuslerp", {"nuslerp_row_wise": True, "nuslerp_flatten": False}, [{}, {}])
    with pytest.raises(InputError, match="unknown merge method 'frankenmerge'"):
        resolve_params("frankenmerge", {}, [{}])


def test_della_density_epsilon_checked_per_tensor():
    # scalars: checked at once
    with pytest.raises(InputError, match=r"--param 1:density / --param 1:epsilon: .*density=0.9 and epsilon=0.15"):
        resolve_params("della", {"density": 0.9}, [{}])
    # layer-wise: only the tensors where it fails, named in the message
    rp = resolve_params("della", {"density": [0.5, 0.9]}, [{}])
    rp.for_tensor(NAMES[0], 0.0)
    with pytest.raises(InputError, match=r"for tensor 'model.layers.4.mlp.up_proj.weight'"):
        rp.check_tensors(NAMES)
    resolve_params("della", {"density": 1.0, "epsilon": 0.5}, [{}])  # density 1: no sparsification, no constraint


def test_required_parameter_without_a_match_for_a_tensor():
    rp = resolve_params("slerp", {"t": [{"filter": "mlp", "value": 0.5}]}, [{}])
    assert _tensor(rp, NAMES[0]).globals["t"] == 0.5
    with pytest.raises(InputError, match=r"--param t: no value for tensor 'model.embed_tokens.weight'"):
        rp.check_tensors(NAMES)


def test_custom_key_paths_in_messages():
    def where(loc):
        i, n, rest = param_loc(loc)
        return f"m.yml: parameters.{n}" if i is None else f"m.yml: models[{i + 1}].parameters.{n}"

    rp_kw = dict(where=where)
    with pytest.raises(InputError, match=r"^m.yml: models\[2\].parameters.density: density=2 is outside"):
        resolve_params("ties", {}, [{}, {"density": 2}], **rp_kw)
    with pytest.raises(InputError, match=r"^m.yml: parameters.t: "):
        resolve_params("slerp", {"t": -1}, [{}], **rp_kw)
