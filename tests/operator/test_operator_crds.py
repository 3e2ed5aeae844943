"""The CRDs: generated from the pydantic models, checked in (twice), structural, complete."""

from __future__ import annotations

import re
from typing import Any

import pytest
from op_testlib import ROOT, crd_doc, k8s_validate, load_docs

from mergepipe_operator import crdgen
from mergepipe_operator.crd import GROUP, RESOURCES, VERSION
from mergepipe_operator.modelmerge.model import METHODS, ModelMergeSpec
from mergepipe_operator.modelmerge.spec import validate_merge_spec

KINDS = sorted(RESOURCES)


def test_checked_in_crds_match_the_models():
    generated = crdgen.all_files()
    assert sorted(generated) == ["mergedsnapshots.yaml", "mergequotas.yaml", "mergesearches.yaml", "modelmerges.yaml"]
    chart = {crdgen.file_name(k) for k in crdgen.chart_kinds()}
    assert chart == set(generated)  # the operator reconciles every kind
    for name, text in generated.items():
        for d in ("crds", "helm/mergepipe/crds"):
            path = ROOT / d / name
            if d.startswith("helm") and name not in chart:
                assert not path.exists(), f"{path}: the chart installs only CRDs the operator reconciles"
                continue
            assert path.exists(), f"{path} missing; run: python -m mergepipe_operator.crdgen"
            assert path.read_text() == text, f"{path} differs from the models; run: python -m mergepipe_operator.crdgen"


def test_crdgen_check_mode_passes_and_detects_drift(tmp_path, capsys):
    assert crdgen.main(["--check"]) == 0
    (tmp_path / "modelmerges.yaml").write_text("stale\n")
    assert crdgen.main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert crdgen.main(["--out-dir", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out-dir", str(tmp_path)]) == 0


# --- structural schema rules (k8s.io/apiextensions-apiserver/pkg/apiserver/schema/validation.go) ---

_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_FORBIDDEN_IN_JUNCTORS = {
    "type",
    "description",
    "default",
    "nullable",
    "additionalProperties",
    "title",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
}
# An independent oracle, kept deliberately apart from crdgen._ALLOWED_KEYS (the generator's own
# list) even though the two hold the same keys today: importing the generator's set would let a
# key wrongly added there pass here too. Written from the JSON names of JSONSchemaProps
# (k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1/types_jsonschema.go) without the ones
# a structural schema forbids or a generated CRD never carries (id, $schema, $ref, title,
# definitions, dependencies, additionalItems, patternProperties, externalDocs).
# test_generator_allows_no_key_the_oracle_refuses ties the two: crdgen may only be narrower.
_OPENAPI_KEYS = {
    "type",
    "format",
    "description",
    "default",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "uniqueItems",
    "multipleOf",
    "minProperties",
    "maxProperties",
    "required",
    "items",
    "properties",
    "additionalProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "nullable",
    "example",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
}


def test_generator_allows_no_key_the_oracle_refuses():
    assert crdgen._ALLOWED_KEYS <= _OPENAPI_KEYS, sorted(crdgen._ALLOWED_KEYS - _OPENAPI_KEYS)


def structural_errors(
    node: dict[str, Any], path: str = "", level: str = "root", untyped: list | None = None
) -> list[str]:
    errs: list[str] = []
    unknown = set(node) - _OPENAPI_KEYS
    if unknown:
        errs.append(f"{path}: keys {sorted(unknown)} are not OpenAPI v3 schema keys of a CRD")
    t = node.get("type")
    ios, puf = node.get("x-kubernetes-int-or-string"), node.get("x-kubernetes-preserve-unknown-fields")
    if t is None and not ios and not puf:
        errs.append(f"{path or '<root>'}: no type ({level})")
    if t is None and (ios or puf) and untyped is not None:
        untyped.append(path)
    if puf is not None and puf is not True:
        errs.append(f"{path}: x-kubernetes-preserve-unknown-fields must be true or absent")
    if ios and puf:
        errs.append(f"{path}: int-or-string and preserve-unknown-fields together")
    if level == "root" and t != "object":
        errs.append("<root>: type must be object")
    if level == "root" and "additionalProperties" in node:
        errs.append("<root>: additionalProperties not allowed at the root")
    if t == "array" and "items" not in node:
        errs.append(f"{path}: array without items")
    if "properties" in node and "additionalProperties" in node:
        errs.append(f"{path}: properties and additionalProperties are mutually exclusive")
    if node.get("additionalProperties") is False:
        errs.append(f"{path}: additionalProperties: false is not allowed")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node.get("exclusiveMinimum"), bool):
        errs.append(f"{path}: exclusiveMinimum must be a boolean in OpenAPI v3.0")
    if "pattern" in node:
        re.compile(node["pattern"])
        assert "(?" not in node["pattern"], f"{path}: look-around/flags are not RE2"
    for j in ("anyOf", "oneOf", "allOf"):
        for i, branch in enumerate(node.get(j) or []):
            if j == "anyOf" and ios and node["anyOf"] == _INT_OR_STRING:
                break
            bad = set(branch) & _FORBIDDEN_IN_JUNCTORS
            if bad:
                errs.append(f"{path}.{j}[{i}]: {sorted(bad)} forbidden inside a logical junctor")
    if "not" in node and set(node["not"]) & _FORBIDDEN_IN_JUNCTORS:
        errs.append(f"{path}.not: forbidden keys")
    if node.get("x-kubernetes-list-type") == "map":
        items = node.get("items") or {}
        keys = node.get("x-kubernetes-list-map-keys") or []
        if items.get("type") != "object" or not keys:
            errs.append(f"{path}: list-type map needs object items and map keys")
        for k in keys:
            if k not in (items.get("required") or []) and "default" not in (items.get("properties", {}).get(k) or {}):
                errs.append(f"{path}: map key {k} must be required or defaulted")
            if (items.get("properties", {}).get(k) or {}).get("type") not in ("string", "integer", "boolean"):
                errs.append(f"{path}: map key {k} must be a scalar")
    for rule in node.get("x-kubernetes-validations") or []:
        if (
            set(rule) - {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}
            or "rule" not in rule
        ):
            errs.append(f"{path}: bad x-kubernetes-validations entry {rule}")
    for k, v in (node.get("properties") or {}).items():
        errs += structural_errors(v, f"{path}.{k}", "field", untyped)
    if isinstance(node.get("additionalProperties"), dict):
        errs += structural_errors(node["additionalProperties"], f"{path}.*", "field", untyped)
    if isinstance(node.get("items"), dict):
        errs += structural_errors(node["items"], f"{path}[]", "item", untyped)
    if level == "root":
        meta = (node.get("properties") or {}).get("metadata")
        if meta is not None and set(meta) - {"type"}:
            errs.append("metadata: only name/generateName may be restricted")
    return errs


@pytest.mark.parametrize("kind", KINDS)
def test_schema_is_structural(kind):
    untyped: list[str] = []
    schema = crd_doc(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert structural_errors(schema, untyped=untyped) == []
    # preserve-unknown-fields only on the layer-wise parameter values; everything else is typed
    free = [p for p in untyped if not crd_path_is_int_or_string(schema, p)]
    if kind in ("ModelMerge", "MergeSearch"):
        assert sorted(free) == [".spec.experts[].parameters.*", ".spec.parameters.*"]
    else:
        assert free == []


def crd_path_is_int_or_string(schema: dict, path: str) -> bool:
    node = schema
    for part in re.findall(r"\.([A-Za-z0-9_*]+)|(\[\])", path):
        name, arr = part
        if arr:
            node = node["items"]
        elif name == "*":
            node = node["additionalProperties"]
        else:
            node = node["properties"][name]
    return bool(node.get("x-kubernetes-int-or-string"))


def test_structural_checker_catches_violations():
    bad = {
        "type": "object",
        "properties": {
            "a": {"description": "no type"},
            "b": {"type": "array"},
            "c": {
                "type": "object",
                "properties": {"x": {"type": "string"}},
                "additionalProperties": {"type": "string"},
            },
            "d": {"anyOf": [{"type": "number"}, {"type": "array", "items": {"type": "number"}}]},
            "e": {"type": "number", "exclusiveMinimum": 0},
            "f": {"type": "object", "additionalProperties": False},
            "g": {"type": "string", "const": "x"},
        },
    }
    errs = "\n".join(structural_errors(bad))
    for needle in (
        ".a: no type",
        ".b: array without items",
        "mutually exclusive",
        ".d: no type",
        ".d.anyOf[0]",
        "exclusiveMinimum must be a boolean",
        "additionalProperties: false",
        "not OpenAPI",
    ):
        assert needle in errs, (needle, errs)


@pytest.mark.parametrize("kind", KINDS)
def test_crd_shape(kind):
    doc = crd_doc(kind)
    r = RESOURCES[kind]
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1" and doc["kind"] == "CustomResourceDefinition"
    assert doc["metadata"]["name"] == f"{r['plural']}.{GROUP}"
    spec = doc["spec"]
    assert spec["group"] == GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == kind and spec["names"]["plural"] == r["plural"]
    assert (
        spec["names"]["shortNames"]
        == {"ModelMerge": ["mm"], "MergedSnapshot": ["msnap"], "MergeQuota": ["mq"], "MergeSearch": ["msearch"]}[kind]
    )
    (v,) = spec["versions"]
    assert v["name"] == VERSION and v["served"] and v["storage"]
    assert v["subresources"] == {"status": {}}
    schema = v["schema"]["openAPIV3Schema"]
    assert schema["required"] == ["spec"]
    status = schema["properties"]["status"]["properties"]
    assert status["observedGeneration"]["type"] == "integer"
    conds = status["conditions"]
    assert conds["x-kubernetes-list-type"] == "map" and conds["x-kubernetes-list-map-keys"] == ["type"]
    item = conds["items"]
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert "observedGeneration" in item["properties"]
    # the CRD manifest itself is a valid apiextensions.k8s.io/v1 object
    k8s_validate(doc)


def _resolve_json_path(schema: dict, json_path: str) -> dict | None:
    node = schema
    parts = re.findall(r'\.(\w+)(\[\?\(@\.\w+=="\w+"\)\])?', json_path)
    if "".join(f".{a}{b}" for a, b in parts) != json_path:
        return None
    for name, flt in parts:
        node = (node.get("properties") or {}).get(name)
        if node is None:
            return None
        if flt:
            node = node["items"]
    return node


@pytest.mark.parametrize("kind", KINDS)
def test_printer_columns_point_at_schema_fields(kind):
    v = crd_doc(kind)["spec"]["versions"][0]
    cols = v["additionalPrinterColumns"]
    names = [c["name"] for c in cols]
    assert names[-1] == "Age" and cols[-1]["jsonPath"] == ".metadata.creationTimestamp"
    if kind == "ModelMerge":
        # the issue's columns by default; the plan and its snapshot with -o wide (priority 1)
        assert [c["name"] for c in cols if not c.get("priority")] == [
            "Ready",
            "Reason",
            "Method",
            "Experts",
            "Budget",
            "ExpertRead",
            "Parts",  # parts done / total of a partitioned merge (empty for one pod)
            "Age",
        ]
        wide = {c["name"]: c["jsonPath"] for c in cols if c.get("priority") == 1}
        assert wide == {
            "Retained": ".status.plan.retainedEnergy",
            "Plan": ".status.plan.digest",
            "Snapshot": ".status.snapshot",
        }
    if kind != "MergeQuota":
        assert names[:2] == ["Ready", "Reason"]
        assert cols[0]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    schema = v["schema"]["openAPIV3Schema"]
    for c in cols:
        if c["jsonPath"].startswith(".metadata."):
            continue
        node = _resolve_json_path(schema, c["jsonPath"])
        assert node is not None, f"{c['name']}: {c['jsonPath']} is not in the schema"
        if c["type"] in ("integer", "number"):
            assert node.get("type") == c["type"], c


def test_method_enum_and_parameter_table_agree():
    spec = crd_doc("ModelMerge")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["method"]["enum"] == list(METHODS)
    assert len(METHODS) == 19  # the registry's methods that merge experts (passthrough takes none)


def test_the_core_implements_every_method_of_the_crd():
    from mergepipe.methods.registry import METHODS as CORE

    assert set(CORE) - set(METHODS) == {"passthrough"}  # one model, no experts: not a ModelMerge
    for name, spec in CORE.items():
        if name not in METHODS:
            continue
        for n in range(1, 6):  # the operator's spec check gives the core's verdict on model counts
            core_ok = spec.min_experts <= n and (spec.max_experts is None or n <= spec.max_experts)
            body = {
                "base": {"uri": "s3://m/base/"},
                "method": name,
                "output": {"uri": "s3://out/x/"},
                "experts": [{"uri": f"s3://m/e{i}/"} for i in range(n)],
                "parameters": {"t": 0.5} if name in ("slerp", "nearswap") else {},
            }
            assert ("spec.experts" in dict(validate_merge_spec(body))) != core_ok, (name, n)


def test_cel_rules_present_on_spec():
    spec = crd_doc("ModelMerge")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["rule"] for r in spec["x-kubernetes-validations"]}
    assert "!(has(self.budget) && has(self.fidelity))" in rules
    assert any("slerp" in r for r in rules) and any("model_stock" in r for r in rules)


def test_byte_quantities_are_int_or_string_with_pattern():
    spec = crd_doc("ModelMerge")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    b = spec["properties"]["budget"]
    assert b["x-kubernetes-int-or-string"] is True and b["anyOf"] == _INT_OR_STRING
    for good in ("512MiB", "10Gi", "1G", "1.5TB", "4096", "100kB"):
        assert re.match(b["pattern"], good), good
    for bad in ("10 GB", "-1Gi", "1gb", "10Gib", "1e9", "Gi", ""):
        assert not re.match(b["pattern"], bad), bad
    f = spec["properties"]["fidelity"]
    assert f == {**f, "minimum": 0, "exclusiveMinimum": True, "maximum": 1}


def test_models_accept_the_examples():
    for doc in load_docs(ROOT / "examples" / "merge.yaml"):
        ModelMergeSpec.model_validate(doc["spec"])
