"""Refusals of `load_config` and the parameter validator that no other test reaches: each pins
the message (config path + key path first) so that restructuring the loader keeps them."""

from pathlib import Path

import pytest
import yaml

from mergepipe.config import load_config
from mergepipe.errors import InputError
from mergepipe.methods.params import resolve_params


@pytest.fixture
def models(tmp_path) -> dict[str, str]:
    """Folders named as checkpoints (these refusals come before any checkpoint is read)."""
    out = {}
    for n in ("base", "a", "b", "x/a", "x/base"):
        (tmp_path / n).mkdir(parents=True)
        out[n] = str(tmp_path / n)
    return out


def load(tmp_path: Path, cfg: dict | bytes):
    p = tmp_path / "merge.yml"
    if isinstance(cfg, bytes):
        p.write_bytes(cfg)
    else:
        p.write_text(yaml.safe_dump(cfg))
    return str(p), load_config(p)


def refusal(tmp_path: Path, cfg: dict | bytes) -> str:
    with pytest.raises(InputError) as e:
        load(tmp_path, cfg)
    return str(e.value)


def test_config_that_is_not_utf8(tmp_path):
    assert refusal(tmp_path, b"merge_method: \xff\n").endswith("merge.yml: the config is not UTF-8 text.")


def test_passthrough_takes_one_model_and_no_other_base(tmp_path, models):
    two = [{"model": models["a"]}, {"model": models["b"]}]
    msg = refusal(tmp_path, {"merge_method": "passthrough", "models": two})
    assert "merge.yml: models: passthrough takes exactly one model" in msg and "got 2" in msg
    one = [{"model": models["a"]}]
    msg = refusal(tmp_path, {"merge_method": "passthrough", "models": one, "base_model": models["base"]})
    assert "merge.yml: base_model: passthrough takes one model and mergekit adds base_model" in msg


def test_averaged_base_named_like_an_expert(tmp_path, models):
    cfg = {"merge_method": "karcher", "models": [{"model": models["a"]}], "base_model": models["x/a"]}
    assert "merge.yml: base_model: " in refusal(tmp_path, cfg)
    assert "has the same folder name 'a' as an expert" in refusal(tmp_path, cfg)


def test_linear_base_parameters_are_named_as_the_averaged_base(tmp_path, models):
    cfg = {
        "merge_method": "linear",
        "models": [{"model": models["a"], "parameters": {"weight": 1.0}}],
        "base_model": models["base"],
        "parameters": {"weight": 0.5},
    }
    p, c = load(tmp_path, cfg)
    assert (
        c.where(("experts", 1, "parameters", "weight")) == f"{p}: base_model (averaged in by linear): parameters.weight"
    )
    assert c.where(("experts", 0, "parameters", "weight")) == f"{p}: models[0].parameters.weight"
    assert c.where(("experts", 1)) == f"{p}: models[1].model"
    assert [e.name for e in c.request.experts] == ["a", "base"]


def test_passthrough_parameters_of_its_model_are_the_merges(tmp_path, models):
    cfg = {"merge_method": "passthrough", "models": [{"model": models["a"], "parameters": {"scale": 0.5}}]}
    p, c = load(tmp_path, cfg)
    assert c.request.parameters == {"scale": 0.5} and c.request.experts == []
    assert c.where(("parameters", "scale")) == f"{p}: models[0].parameters.scale"


@pytest.mark.parametrize(
    "setting, field, text",
    [
        ([{"filter": "mlp", "value": 0.2}, {"filter": "mlp.up", "value": 0.1}], "density[1].filter", "is never used"),
        ([{"filter": "mlp", "value": [0.2, {"v": 1}]}], "density[0].value", "not nested entries"),
        ([{"filter": "mlp", "value": {"v": 1}}], "density[0].value", "not a mapping"),
        ([], "density", "empty list"),
    ],
)
def test_filter_list_refusals_name_the_entry(setting, field, text):
    with pytest.raises(InputError) as e:
        resolve_params("ties", {"density": setting}, [{}])
    assert str(e.value).startswith(f"--param {field}: ") and text in str(e.value)


def test_global_parameter_given_per_expert():
    with pytest.raises(InputError, match="lambda is a global parameter of ties; set it for the merge"):
        resolve_params("ties", {}, [{"lambda": 1.0}])
