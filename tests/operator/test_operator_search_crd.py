"""The MergeSearch CRD (issue 7 item 5; installed by the chart, reconciled by the operator): the
example validates against the generated schema, the schema and the model refuse what the core's
`mergepipe search` would refuse, and the model's cross-field checks mirror the CRD's CEL rules."""

from __future__ import annotations

import copy

import pytest
from op_testlib import ROOT, cr_errors, crd_schema, load_docs
from pydantic import ValidationError

from mergepipe_operator import crdgen
from mergepipe_operator.modelmerge.model import METHODS
from mergepipe_operator.search.model import SEARCH_STRATEGIES, MergeSearchSpec


def example() -> dict:
    (doc,) = load_docs(ROOT / "examples" / "search.yaml")
    return doc


def with_spec(**changes) -> dict:
    doc = copy.deepcopy(example())
    for k, v in changes.items():
        if v is None:
            doc["spec"].pop(k, None)
        else:
            doc["spec"][k] = v
    return doc


def core_config(spec: dict):
    """The example as the core's SearchConfig (what `mergepipe search` would run)."""
    from mergepipe.search.runner import SearchConfig

    vary = [f"{v['expert'] + ':' if v.get('expert') else ''}{v['name']}={v['min']}:{v['max']}" for v in spec["vary"]]
    objectives = [o["metric"] + ("@max" if o.get("sense") == "max" else "") for o in spec["objectives"]]
    return SearchConfig(
        base=spec["base"]["uri"],
        experts=[[e["name"], e["uri"]] for e in spec["experts"]],
        method=spec.get("method", "task_arithmetic"),
        vary=vary,
        objectives=objectives,
        evaluations=spec.get("evaluations", 24),
        initial=spec.get("initial", 8),
        workers=spec.get("workers", 1),
        layer_blocks=spec.get("layerBlocks", 1),
        budget=spec.get("budget"),
        seed=spec.get("seed", 0),
        strategy=spec.get("strategy", "async"),
        ref_point=spec.get("refPoint"),
    )


def test_example_validates_and_is_a_search_the_core_accepts():
    doc = example()
    assert cr_errors(doc) == []
    MergeSearchSpec.model_validate(doc["spec"])
    cfg = core_config(doc["spec"])
    cfg.check()
    from mergepipe.search.space import parse_vary

    (v,) = parse_vary(cfg.vary)
    assert (v.name, v.lo, v.hi, v.expert) == ("weight", 0.0, 1.0, None)


def test_schema_enums_and_defaults_follow_the_core():
    from mergepipe.search.runner import STRATEGIES, SearchConfig

    spec = crd_schema("MergeSearch")["properties"]["spec"]["properties"]
    assert tuple(spec["strategy"]["enum"]) == SEARCH_STRATEGIES == STRATEGIES
    assert spec["method"]["enum"] == list(METHODS)
    d = SearchConfig(base="b", experts=[], method="m", vary=[], objectives=[], evaluations=24, initial=8)
    assert (
        spec["workers"]["default"],
        spec["strategy"]["default"],
        spec["seed"]["default"],
        spec["prior"]["default"],
    ) == (
        d.workers,
        d.strategy,
        d.seed,
        d.prior,
    )
    # layer blocks follow the CLI's evidence-based default (docs/SEARCH.md, "Defaults, following the
    # data"), which is what a user of `mergepipe search` gets; the driver passes it explicitly
    import typer

    from mergepipe.cli import app

    cmd = typer.main.get_command(app).commands["search"]
    (layer_blocks,) = [p for p in cmd.params if p.name == "layer_blocks"]
    assert spec["layerBlocks"]["default"] == layer_blocks.default == d.layer_blocks == 1  # one default
    assert spec["objectives"]["x-kubernetes-list-map-keys"] == ["metric"]  # the API server refuses a metric twice


def _rules(schema: dict) -> dict[str, str]:
    return {r["message"]: r["rule"] for r in schema.get("x-kubernetes-validations") or []}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s["vary"][0].update(min=1.0, max=0.5), "min must be below max"),
        (lambda s: s["vary"][0].update(min=0.5, max=0.5), "min must be below max"),
        (lambda s: s.update(evaluations=4, initial=8), "evaluations must be at least initial"),
        (lambda s: s.update(refPoint=[1.0]), "refPoint needs one value per objective"),
        (lambda s: s["vary"][0].update(expert="chat"), "vary[].expert must name one of spec.experts"),
        (
            lambda s: s.update(evaluator={"command": "eval.sh {checkpoint}", "zooBatches": 2}),
            "set at most one of command and zooBatches",
        ),
    ],
)
def test_cross_field_rules_in_the_model_and_as_cel(mutate, message):
    """What a structural schema cannot say is a CEL rule in the CRD (evaluated by the API server)
    and the same check, with the same message, in the model (for offline validation)."""
    doc = example()
    mutate(doc["spec"])
    assert cr_errors(doc) == []  # structurally fine: only the cross-field rule catches it
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MergeSearchSpec.model_validate(doc["spec"])
    schema = crd_schema("MergeSearch")["properties"]["spec"]
    rules = {
        **_rules(schema),
        **_rules(schema["properties"]["vary"]["items"]),
        **_rules(schema["properties"]["evaluator"]),
    }
    assert any(m.startswith(message) for m in rules), (message, rules)


def test_fewer_evaluations_than_design_points_is_refused_by_the_core_too():
    doc = with_spec(evaluations=4, initial=8)
    from mergepipe.errors import InputError

    with pytest.raises(InputError, match="fewer than --initial"):
        core_config(doc["spec"]).check()


def test_a_metric_listed_twice_is_refused():
    doc = with_spec(objectives=[{"metric": "loss:python"}, {"metric": "loss:python", "sense": "max"}])
    with pytest.raises(ValidationError, match="listed twice"):
        MergeSearchSpec.model_validate(doc["spec"])


@pytest.mark.parametrize(
    "changes, where",
    [
        ({"strategy": "grid"}, "spec.strategy"),
        ({"workers": 0}, "spec.workers"),
        ({"vary": []}, "spec.vary"),
        ({"objectives": []}, "spec.objectives"),
        ({"objectives": [{"metric": "loss python"}]}, "spec.objectives.0.metric"),
        ({"objectives": [{"metric": "loss:python", "sense": "maximize"}]}, "spec.objectives.0.sense"),
        ({"budget": "2 GB"}, "spec.budget"),
        ({"output": None}, "spec"),
        ({"vary": [{"name": "weight", "min": 0}]}, "spec.vary.0"),
        ({"layerBlocks": 0}, "spec.layerBlocks"),
        ({"evaluatons": 10}, "spec"),  # a typo: unknown field
    ],
)
def test_schema_refuses_bad_fields(changes, where):
    doc = with_spec(**changes)
    errs = cr_errors(doc)
    assert errs and any(e.startswith(where) for e in errs), errs
    with pytest.raises(ValidationError):
        MergeSearchSpec.model_validate(doc["spec"])


def test_status_as_the_operator_would_write_it_validates():
    doc = example()
    doc["status"] = {
        "observedGeneration": 1,
        "searchID": "3f2a",
        "evaluations": 12,
        "running": 4,
        "failed": 1,
        "hypervolume": 0.125,
        "refPoint": [2.5, 3.0],
        "paretoSize": 2,
        "stateURI": "s3://snapshots/x/state.json",
        "pareto": [
            {
                "candidate": 3,
                "objectives": {"loss:python": 1.9, "loss:arithmetic": 2.2},
                "snapshot": "llama-code-math-front-c3",
                "uri": "s3://snapshots/x/snapshots/c3/",
            },
            {"candidate": 7, "objectives": {"loss:python": 2.1, "loss:arithmetic": 2.0}},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "Searching",
                "message": "12 of 32",
                "lastTransitionTime": "2026-11-22T00:00:00Z",
                "observedGeneration": 1,
            }
        ],
    }
    assert cr_errors(doc) == []
    bad = copy.deepcopy(doc)
    bad["status"]["pareto"][0]["objectives"]["loss:python"] = "low"
    assert any(e.startswith("status.pareto.0.objectives") for e in cr_errors(bad))


def test_the_chart_installs_the_search_crd():
    assert "MergeSearch" in crdgen.chart_kinds()
    assert (ROOT / "helm" / "mergepipe" / "crds" / "mergesearches.yaml").read_text() == crdgen.render("MergeSearch")
    assert (ROOT / "crds" / "mergesearches.yaml").read_text() == crdgen.render("MergeSearch")
