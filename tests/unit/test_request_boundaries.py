"""One validator, three front ends (issue 11): every method parameter's boundary values — open and
closed ends, gradients, filter lists with unreachable entries, the wrong scope — pushed through the
command line (``mergepipe plan --param``), a mergekit YAML config (``mergepipe plan --config``) and
the operator's ModelMerge path (admission check ``validate_merge_spec``, then in-process planning
``plan_merge``) get the same verdict: accepted by all three, or refused by all three naming the
same field in each front end's terms (``--param expert1:density[0].value``,
``models[1].parameters.density[0].value``, ``spec.experts[1].parameters.density[0].value``).

The cases are generated from the method registry, so a new parameter or a changed range is covered
without editing this file. Inputs are the tiny synthetic family (2 layers); the operator plans
from catalog index objects in a local folder (the same code path as on S3, see
tests/operator/test_operator_planning.py for the S3 version).
"""

from __future__ import annotations

import re

import pytest
import yaml

from mergepipe.methods.registry import METHODS, ParamSpec
from testkit.harness import run_cli

#: the method each parameter is tried with: ties where it takes it (linear's mergekit config has its
#: own rules: every model needs a weight and the base is averaged in), else its own method
_METHOD_OF = {
    "gamma": "breadcrumbs",
    "epsilon": "della",
    "t": "slerp",
    "filter_wise": "model_stock",
    "nuslerp_flatten": "nuslerp",
    "nuslerp_row_wise": "nuslerp",
    "normalize_weights": "multislerp",
    "eps": "multislerp",
    "max_iter": "karcher",
    "tol": "karcher",
    "select_topk": "sce",
    "r": "ramplus_tl",
    "alpha": "ramplus_tl",
}
#: fixed settings a method needs besides the parameter under test (multislerp's weight has no default)
_NEEDS = {"slerp": {"t": 0.5}, "multislerp": {"weight": 1.0}}


def _method_for(name: str) -> str:
    if name in _METHOD_OF:
        return _METHOD_OF[name]
    return next(m for m in ("ties", *METHODS) if any(p.name == name for p in METHODS[m].params))


def _inside(p: ParamSpec) -> float:
    if p.lo is not None and p.hi is not None:
        return (p.lo + p.hi) / 2
    return 0.5


def _values(p: ParamSpec) -> list[tuple[str, object, str | None]]:
    """``(case id, setting, refused field suffix or None when accepted)`` for parameter ``p``."""
    if p.kind == "bool":
        return [("true", True, None), ("false", False, None), ("number", 0.5, ""), ("list", [True, False], "")]
    if p.kind == "int":
        lo = int(p.lo) if p.lo is not None else 0
        return [
            ("lo-at", lo, None),
            ("lo-outside", lo - 1, ""),
            ("integral-float", float(lo + 3), None),
            ("fraction", lo + 2.5, ""),
            ("gradient", [lo + 1, lo + 2], ""),
        ]
    out: list[tuple[str, object, str | None]] = []
    for end, bound, is_open, step in (("lo", p.lo, p.lo_open, -1), ("hi", p.hi, p.hi_open, 1)):
        if bound is None:
            out.append((f"{end}-unbounded", step * 1e6, None))
            continue
        out.append((f"{end}-at", bound, "" if is_open else None))
        out.append((f"{end}-inside", bound - step * 1e-6, None))
        out.append((f"{end}-outside", bound + step * 1e-3, ""))
    v = _inside(p)
    bad = (p.hi + 0.5) if p.hi is not None else (p.lo - 0.5) if p.lo is not None else None
    out += [
        ("gradient", [v, v], None),
        ("gradient-one-value", [v], ""),
        ("filters", [{"filter": "mlp", "value": v}, {"filter": "self_attn", "value": [v, v]}, {"value": v}], None),
        ("filters-catch-all-first", [{"value": v}, {"filter": "mlp", "value": v}], "[0]"),
        (
            "filters-unreachable-entry",
            [{"filter": "mlp", "value": v}, {"filter": "mlp.up_proj", "value": v}, {"value": v}],
            "[1].filter",
        ),
        ("filters-unknown-key", [{"filter": "mlp", "value": v, "weight": 1}, {"value": v}], "[0]"),
    ]
    if bad is not None:
        out += [
            ("gradient-outside", [v, bad], "[1]"),
            ("filters-value-outside", [{"filter": "mlp", "value": bad}, {"value": v}], "[0].value"),
        ]
    if p.default is None:  # a required parameter: a filter list must cover every tensor
        out.append(("filters-no-catch-all", [{"filter": "mlp", "value": v}], ""))
    return out


def _cases():
    seen = set()
    for spec in METHODS.values():
        if (
            spec.max_experts == 0
        ):  # passthrough (scale): one model, no experts; tests/integration/test_mergekit_methods.py
            continue
        for p in spec.params:
            if p.name in seen:
                continue
            seen.add(p.name)
            method = _method_for(p.name)
            for cid, value, refused in _values(p):
                scope = "expert" if p.scope == "expert" else "merge"
                yield pytest.param(method, p.name, scope, value, refused, id=f"{method}-{p.name}-{scope}-{cid}")
            if p.scope == "global":  # a merge-wide parameter set on one expert
                yield pytest.param(
                    method,
                    p.name,
                    "expert",
                    p.default if p.default is not None else _inside(p),
                    "",
                    id=f"{method}-{p.name}-expert-scope",
                )
    yield pytest.param("ties", "gamma", "merge", 0.1, "", id="ties-unknown-parameter")


@pytest.fixture(scope="module")
def front(family, tmp_path_factory):
    """Paths and a catalog per front end, with every method's statistics analyzed once."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.pipeline import build_plan
    from mergepipe.request import ExpertRequest, MergeRequest
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    base, experts = family
    root = tmp_path_factory.mktemp("boundaries")
    sqlite, index = root / "cat.sqlite", root / "index"
    for method in sorted({_method_for(p.name) for s in METHODS.values() for p in s.params if s.max_experts != 0}):
        ex = experts[:1] if method == "slerp" else experts[:2]
        req = MergeRequest(
            base=str(base),
            method=method,
            parameters=dict(_NEEDS.get(method, {})),
            experts=[ExpertRequest(name=e.name, uri=str(e)) for e in ex],
        )
        build_plan(Catalog(sqlite), LocalStorage(IOCounters()), req)
        build_plan(ObjectCatalog(LocalStorage(IOCounters()), str(index)), LocalStorage(IOCounters()), req)
    return {"base": base, "experts": experts, "root": root, "sqlite": sqlite, "index": index}


def _setup(front, method, name, scope, value):
    """Merge-wide and per-expert settings of one case (slerp's required t filled in)."""
    experts = front["experts"][:1] if method == "slerp" else front["experts"][:2]
    glob: dict = {}
    own: list[dict] = [{} for _ in experts]
    for k, v in _NEEDS.get(method, {}).items():
        if not (name == k and scope == "merge"):
            glob[k] = v
    (glob if scope == "merge" else own[-1])[name] = value
    return experts, glob, own


def _field_re(field: str) -> str:
    return re.escape(field) + r"(?::| /)"


def _cli(front, monkeypatch, capsys, method, experts, glob, own):
    import json

    args = ["plan", "--json", "--catalog", str(front["sqlite"]), "--base", str(front["base"]), "--method", method]
    for e in experts:
        args += ["--expert", f"{e.name}={e}"]
    for k, v in glob.items():
        args += ["--param", f"{k}={json.dumps(v)}"]
    for e, d in zip(experts, own):
        args += [x for k, v in d.items() for x in ("--param", f"{e.name}:{k}={json.dumps(v)}")]
    code, _, err = run_cli(args, monkeypatch, capsys)
    return code, err.replace("error: ", "", 1).strip()


def _yaml(front, monkeypatch, capsys, tmp_path, method, experts, glob, own):
    cfg = {
        "merge_method": method,
        "base_model": str(front["base"]),
        "models": [{"model": str(e), **({"parameters": d} if d else {})} for e, d in zip(experts, own)],
    }
    if glob:
        cfg["parameters"] = glob
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(cfg))
    code, _, err = run_cli(
        ["plan", "--json", "--catalog", str(front["sqlite"]), "--config", str(path)], monkeypatch, capsys
    )
    return code, err.replace("error: ", "", 1).replace(f"{path}: ", "", 1).strip()


def _operator(front, method, experts, glob, own):
    """(refused field or None, message): admission check, then in-process planning."""
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from mergepipe_operator.modelmerge import planning
    from mergepipe_operator.modelmerge.spec import validate_merge_spec

    def spec(base_uri, uri_of):
        s = {
            "base": {"uri": base_uri},
            "method": method,
            "output": {"uri": "s3://snapshots/boundary/"},
            "experts": [
                {"name": e.name, "uri": uri_of(e), **({"parameters": d} if d else {})} for e, d in zip(experts, own)
            ],
        }
        if glob:
            s["parameters"] = glob
        return s

    issues = validate_merge_spec(spec("s3://models/base/", lambda e: f"s3://models/{e.name}/"))
    if issues:
        return issues[0]
    try:
        planning.plan_merge(spec(str(front["base"]), str), str(front["index"]), storage=LocalStorage(IOCounters()))
    except planning.PlanInputError as e:
        return e.field, str(e)
    return None, ""


@pytest.mark.slow
@pytest.mark.parametrize("method, name, scope, value, refused", list(_cases()))
def test_every_front_end_gives_the_same_verdict(
    front, monkeypatch, capsys, tmp_path, method, name, scope, value, refused
):
    experts, glob, own = _setup(front, method, name, scope, value)
    k = len(experts) - 1
    cli_code, cli_err = _cli(front, monkeypatch, capsys, method, experts, glob, own)
    yml_code, yml_err = _yaml(front, monkeypatch, capsys, tmp_path, method, experts, glob, own)
    op_field, op_msg = _operator(front, method, experts, glob, own)
    if refused is None:
        assert (cli_code, yml_code, op_field) == (0, 0, None), (cli_err, yml_err, op_msg)
        return
    model = f"models[{k}].parameters.{name}{refused}"
    want = {
        "cli": f"--param {name}{refused}" if scope == "merge" else f"--param {experts[k].name}:{name}{refused}",
        "yaml": f"parameters.{name}{refused}" if scope == "merge" else model,
        "operator": f"spec.parameters.{name}{refused}"
        if scope == "merge"
        else f"spec.experts[{k}].parameters.{name}{refused}",
    }
    assert cli_code == 2 and re.match(_field_re(want["cli"]), cli_err), cli_err
    assert yml_code == 2 and re.match(_field_re(want["yaml"]), yml_err), yml_err
    assert op_field == want["operator"], (op_field, op_msg)
    # the same problem, in each front end's terms: the text after the field agrees
    problem = cli_err.split(": ", 1)[1]
    assert yml_err.split(": ", 1)[1] == problem and op_msg == problem


def test_planning_and_run_refusals_carry_a_field_path_each_front_end_renders():
    """The request's planning and run options are refused with a field path (``planning.value``,
    ``run.workers``), never a front end's flag: the command line renders it as the option
    (``--value``), the operator as the spec field (``spec.blockValue``), and the search checks its
    ``SearchConfig.planning`` with the same validator."""
    from mergepipe.errors import InputError
    from mergepipe.request import ExpertRequest, MergeRequest, PlanningOptions, RunOptions
    from mergepipe.search.runner import SearchConfig
    from mergepipe_operator.modelmerge.request import spec_where

    req = MergeRequest(base="b", experts=[ExpertRequest(name="e0", uri="e")], method="ties", budget="10%")
    spec = {"base": {"uri": "b"}, "experts": [{"uri": "e"}], "method": "ties"}
    cases = [
        (PlanningOptions(value="curvature"), RunOptions(), "planning.value", "--value 'curvature'", "spec.blockValue"),
        (PlanningOptions(value="fisher"), RunOptions(), "planning.value", "--value fisher needs --calibration", None),
        (PlanningOptions(sketch="sign7"), RunOptions(), "planning.sketch", "--sketch 'sign7'", "spec.sketch"),
        (PlanningOptions(block_bytes=0), RunOptions(), "planning.block_bytes", "--block-size 0", None),
        (PlanningOptions(), RunOptions(work_bytes=0), "run.work_bytes", "--work-memory 0 bytes", None),
        (PlanningOptions(), RunOptions(workers=0), "run.workers", "--workers 0", None),
    ]
    for planning, run, field, cli, op in cases:
        r = req.model_copy(update={"planning": planning, "run": run})
        with pytest.raises(InputError) as e:
            r.resolve()
        assert e.value.field == field and str(e.value).startswith(cli), (field, str(e.value))
        if op is not None:
            with pytest.raises(InputError) as e:
                r.resolve(spec_where(spec))
            assert e.value.field == field and str(e.value).startswith(op) and "--" not in str(e.value)
    cfg = SearchConfig(
        base="b",
        experts=[["e0", "e"]],
        method="ties",
        vary=["weight=0:1"],
        objectives=["a"],
        evaluations=2,
        initial=2,
        planning=PlanningOptions(sketch="sign7"),
    )
    with pytest.raises(InputError, match=r"^--sketch 'sign7': use one of"):
        cfg.check()
    # a search state recorded before the planning options were one field reads the same
    old = {**cfg.to_json(), "planning": None}
    del old["planning"]
    back = SearchConfig.from_json({**old, "sketch": "sign1", "value": None, "block_bytes": 4096})
    assert back.planning == PlanningOptions(sketch="sign1", block_bytes=4096)
    assert SearchConfig.from_json(cfg.to_json()).planning == cfg.planning


def test_out_dtype_outside_the_written_dtypes_is_a_field_refusal(tmp_path):
    """``options.out_dtype`` takes safetensors codes; a torch name (``float16``) or anything else
    is refused by the request with its field path and the code to use -- it reached the planner
    as a ``KeyError`` before. Nothing is written: the refusal comes before any read."""
    import mergepipe
    from mergepipe.errors import InputError
    from mergepipe.request import ExpertRequest, MergeRequest, RequestOptions

    def req(dtype: object) -> MergeRequest:
        return MergeRequest(
            base=str(tmp_path / "missing-base"),
            experts=[ExpertRequest(name="e0", uri=str(tmp_path / "missing-expert"))],
            method="ties",
            options=RequestOptions(out_dtype=dtype),
        )

    for bad, hint in (("float16", "(float16 is F16)"), ("torch.bfloat16", "(torch.bfloat16 is BF16)"), ("I8", "")):
        with pytest.raises(InputError) as e:
            req(bad).resolve()
        assert e.value.field == "options.out_dtype"
        assert str(e.value).startswith("options.out_dtype: ") and "use one of BF16, F16, F32, F64" in str(e.value)
        assert hint in str(e.value)
        with pytest.raises(InputError, match="options.out_dtype"):
            mergepipe.plan(req(bad))  # refused before the missing checkpoints are looked at
    for ok in (None, "BF16", "F16", "F32", "F64"):
        req(ok).resolve()
    home = tmp_path / "mergepipe-home"  # conftest's MERGEPIPE_HOME: no catalog opened either
    assert [p for p in tmp_path.iterdir() if p != home] == [] and list(home.rglob("*")) == []
