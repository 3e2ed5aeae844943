"""mergekit 0.1.5's newer methods (multislerp, karcher, sce, nearswap, ram, ramplus_tl,
arcee_fusion): the streaming engine against a whole-tensor transcription of mergekit's code
(``testkit/mergekit_reference.py``) on real safetensors checkpoints, their budget semantics, and
the refusals of a budget where a method needs whole tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mergepipe.catalog.catalog import Catalog
from mergepipe.errors import InputError
from mergepipe.methods.registry import METHODS, budget_refusal
from mergepipe.numerics import karcher_coefficients, multislerp_coefficients
from mergepipe.pipeline import merge
from mergepipe.request import request_from_args
from testkit import mergekit_reference as mk
from testkit.harness import merged_tensors, same_bits

NEW = ("multislerp", "karcher", "sce", "nearswap", "ram", "ramplus_tl", "arcee_fusion")

# method, --param items, number of experts, how the engine compares with the transcription:
# "bits": same torch operations on the same float32 values, bit for bit; "ulp": coefficients
# from the catalog's exact float64 sums (mergekit: float32 over the tensor), so within one bf16
# rounding step at the inputs' scale
CASES = [
    ("multislerp", ["weight=1"], 3, "ulp"),
    ("multislerp", ["expert0:weight=0.6", "expert1:weight=0.3", "expert2:weight=0.1"], 3, "ulp"),
    ("multislerp", ["weight=2", "normalize_weights=false"], 2, "ulp"),
    ("karcher", [], 3, "ulp"),
    ("karcher", ["max_iter=3", "tol=1e-4"], 2, "ulp"),
    ("sce", [], 3, "ulp"),
    ("sce", ["select_topk=0.5"], 3, "bits"),
    ("nearswap", ["t=0.001"], 1, "bits"),
    ("nearswap", ["t=0.0001"], 1, "bits"),
    ("ram", [], 3, "bits"),
    ("ram", ["epsilon=0.002"], 3, "bits"),
    ("ramplus_tl", [], 3, "bits"),
    ("ramplus_tl", ["r=0.5", "alpha=0.9", "epsilon=0.002"], 3, "bits"),
    ("arcee_fusion", [], 1, "bits"),
]


def _kw(params: list[str]) -> dict:
    out = {}
    for p in params:
        k, v = p.split("=")
        if ":" in k:
            continue
        out[k] = float(v) if v not in ("true", "false") else v == "true"
    return out


def reference(method: str, params: list[str], b: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    """mergekit's result for one tensor (float32 inputs), from the transcription."""
    kw = _kw(params)
    if method == "multislerp":
        ws = [kw.get("weight", 1.0)] * len(xs)
        for p in params:
            if p.startswith("expert"):
                who, v = p.split(":weight=")
                ws[int(who[len("expert") :])] = float(v)
        return mk.multislerp(b, xs, ws, kw.get("normalize_weights", True))
    if method == "karcher":
        return mk.karcher(xs, int(kw.get("max_iter", 10)), kw.get("tol", 1e-5))
    if method == "sce":
        return mk.sce(b, xs, kw.get("select_topk", 1.0))
    if method == "nearswap":
        return mk.nearswap(b, xs[0], kw["t"])
    if method == "ram":
        return mk.ram(b, xs, kw.get("epsilon", 1e-5))
    if method == "ramplus_tl":
        return mk.ramplus_tl(b, xs, kw.get("r", 0.1), kw.get("alpha", 0.2), kw.get("epsilon", 1e-5))
    if method == "arcee_fusion":
        return mk.arcee_fusion(b, xs[0])
    raise AssertionError(method)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (float32)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.pow(2.0, e - 7)


def _merge(family_dirs, tmp_path, method, params, n, tag="out", **kw):
    base, experts = family_dirs
    experts = experts[:n]
    return merge(
        str(base),
        [(f"expert{i}", str(e)) for i, e in enumerate(experts)],
        method,
        str(tmp_path / tag),
        params,
        catalog=Catalog(tmp_path / "c.sqlite"),
        **kw,
    )


@pytest.mark.parametrize("method,params,n,how", CASES, ids=[f"{m}-{'-'.join(p) or 'default'}" for m, p, _, _ in CASES])
def test_engine_equals_mergekit_transcription(family, tmp_path, method, params, n, how):
    base, experts = family
    res = _merge(family, tmp_path, method, params, n)
    got = merged_tensors(res.out)
    b = merged_tensors(base)
    xs = [merged_tensors(e) for e in experts[:n]]
    changed = 0
    for name, bt in b.items():
        if not bt.dtype.is_floating_point:
            continue
        bf = bt.float()
        pts = [x[name].float() for x in xs]
        if method == "karcher":  # CLI semantics: the points are the experts (the base is their origin)
            ref = reference(method, params, bf, pts)
        else:
            ref = reference(method, params, bf, pts)
        ref16 = ref.to(bt.dtype)
        g = got[name]
        changed += not same_bits(g, bt)
        if how == "bits":
            assert same_bits(g, ref16), f"{method} {params}: {name} differs from mergekit's formula"
        else:
            scale = torch.maximum(ref.abs(), bf.abs())
            for p in pts:
                scale = torch.maximum(scale, p.abs())
            err = (g.float() - ref).abs()
            assert bool((err <= bf16_ulp(scale) * 1.0001).all()), (
                f"{method} {params}: {name}: max error {float((err / bf16_ulp(scale)).max()):.2f} ulp at input scale"
            )
            # and most entries are the same bf16 value
            assert float((g != ref16).float().mean()) < 0.02, name
    assert changed > 0  # the merge changed the model


def test_karcher_config_averages_the_base_in(family, tmp_path):
    """A mergekit config with base_model: mergekit's karcher averages every input model, the base
    included (it ignores which one is the base); mergepipe's config loader does the same."""
    from mergepipe.config import merge_from_config

    base, experts = family
    cfg = tmp_path / "k.yml"
    cfg.write_text(
        f"merge_method: karcher\nbase_model: {base}\nmodels:\n"
        + "".join(f"  - model: {e}\n" for e in experts[:2])
        + "dtype: float32\nout_dtype: bfloat16\n"
    )
    res = merge_from_config(cfg, str(tmp_path / "out"), catalog=Catalog(tmp_path / "c.sqlite"))
    assert [e.name for e in res.plan.experts][-1] == base.name  # the base is the third point
    got = merged_tensors(res.out)
    b = merged_tensors(base)
    xs = [merged_tensors(e) for e in experts[:2]]
    for name, bt in b.items():
        if bt.dtype.is_floating_point:
            ref = mk.karcher([xs[0][name].float(), xs[1][name].float(), bt.float()])
            scale = torch.maximum(ref.abs(), bt.float().abs())
            assert bool(((got[name].float() - ref).abs() <= bf16_ulp(scale) * 1.0001).all()), name


BLOCKS = [
    ("multislerp", ["weight=1"], 3),
    ("karcher", [], 3),
    ("sce", [], 3),
    ("nearswap", ["t=0.001"], 1),
    ("ram", [], 3),
]


@pytest.mark.parametrize("method,params,n", BLOCKS, ids=[m for m, _, _ in BLOCKS])
def test_budget_reads_blocks_and_keeps_full_budget_rows(family, tmp_path, method, params, n):
    """Under a budget the plan reads a subset of the expert blocks (realized ≤ planned ≤ budget),
    the coefficients stay those of the full tensors (catalog statistics), so rows where every
    expert's block was read equal the full-budget merge bit for bit, and rows no expert block
    covers are the base (karcher: the base times the plan's c_base)."""
    full = _merge(family, tmp_path, method, params, n, "full", block_bytes=2048)
    part = _merge(family, tmp_path, method, params, n, "part", block_bytes=2048, budget="30%")
    io = part.manifest["io"]
    assert io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"] <= part.plan.budget_bytes
    assert 0 < io["estimated"]["expert_read_bytes"] < full.manifest["io"]["estimated"]["expert_read_bytes"]
    assert part.plan.retained_energy < 1.0
    gf, gp, gb = merged_tensors(full.out), merged_tensors(part.out), merged_tensors(family[0])
    n_all = n_none = 0
    for tp in part.plan.tensors:
        if tp.dtype not in ("BF16", "F16", "F32") or not tp.shape:
            continue
        rows = tp.shape[0]
        rpb = tp.rows_per_block
        cover = np.zeros((n, rows), dtype=bool)
        for te in tp.experts:
            for b0, b1 in te.blocks:
                cover[te.expert, b0 * rpb : min(rows, b1 * rpb)] = True
        nonzero = np.zeros((n, rows), dtype=bool)  # blocks with a zero task vector are never read
        ftp = next(t for t in full.plan.tensors if t.name == tp.name)
        for te in ftp.experts:
            for b0, b1 in te.blocks:
                nonzero[te.expert, b0 * rpb : min(rows, b1 * rpb)] = True
        every = (cover | ~nonzero).all(axis=0)
        none = ~cover.any(axis=0)
        if every.any():
            assert same_bits(gp[tp.name][every], gf[tp.name][every]), tp.name
            n_all += int(every.sum())
        if none.any():
            want = gb[tp.name][none]
            if method == "karcher":
                want = (want.float() * tp.derived["c_base"]).to(want.dtype)
            assert same_bits(gp[tp.name][none], want), tp.name
            n_none += int(none.sum())
    assert n_all > 0 and n_none > 0


@pytest.mark.parametrize(
    "method,params,n",
    [("arcee_fusion", [], 1), ("ramplus_tl", [], 2), ("sce", ["select_topk=0.5"], 2)],
    ids=["arcee_fusion", "ramplus_tl", "sce-topk"],
)
def test_whole_tensor_methods_refuse_a_budget(family, tmp_path, method, params, n):
    base, experts = family
    ex = [(f"e{i}", str(e)) for i, e in enumerate(experts[:n])]
    for field, kw in (("budget", {"budget": "50%"}), ("budget", {"budget": 1000}), ("fidelity", {"fidelity": 0.9})):
        req = request_from_args(str(base), ex, method, params, **kw)
        with pytest.raises(InputError) as e:
            req.resolve()
        assert e.value.loc == (field,)
        assert f"--{field}" in str(e.value) and method in str(e.value) and "whole tensor" in str(e.value)
    for ok in ({"budget": "unlimited"}, {"budget": "100%"}, {}, {"fidelity": 1.0}):
        request_from_args(str(base), ex, method, params, **ok).resolve()
    # the pipeline refuses before reading anything or creating --out
    with pytest.raises(InputError):
        _merge(family, tmp_path, method, params, n, budget="50%")
    assert not (tmp_path / "out").exists()


def test_cli_budget_refusal_exit_2(family, tmp_path, monkeypatch, capsys):
    from testkit.harness import run_cli

    base, experts = family
    out = tmp_path / "o"
    code, so, se = run_cli(
        [
            "merge",
            "--base",
            str(base),
            "-e",
            str(experts[0]),
            "--method",
            "arcee_fusion",
            "--budget",
            "25%",
            "--out",
            str(out),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and not out.exists()
    assert "--budget" in se and "arcee_fusion cannot honour" in se


def test_sce_budget_refusal_follows_layerwise_select_topk():
    sce = METHODS["sce"]
    assert budget_refusal(sce, {"select_topk": 1.0}) is None
    assert budget_refusal(sce, {"select_topk": [1.0, 0.5]}) is not None
    assert budget_refusal(sce, {"select_topk": [{"filter": "mlp", "value": 0.9}, {"value": 1.0}]}) is not None
    for m in ("multislerp", "karcher", "nearswap", "ram"):
        assert budget_refusal(METHODS[m], {}) is None
        assert METHODS[m].budget == "blocks"


@pytest.mark.parametrize(
    "method,params,n,loc",
    [
        ("multislerp", [], 2, ("experts", 0, "parameters", "weight")),
        ("nearswap", [], 1, ("parameters", "t")),
        ("nearswap", ["t=0.1"], 2, ("experts",)),
        ("nearswap", ["t=-1"], 1, ("parameters", "t")),
        ("arcee_fusion", [], 2, ("experts",)),
        ("karcher", ["max_iter=2.5"], 2, ("parameters", "max_iter")),
        ("karcher", ["max_iter=[1,2]"], 2, ("parameters", "max_iter")),
        ("sce", ["select_topk=1.5"], 2, ("parameters", "select_topk")),
        ("ram", ["e0:epsilon=0.1"], 2, ("experts", 0, "parameters", "epsilon")),
        ("ramplus_tl", ["weight=1"], 2, ("parameters", "weight")),
    ],
)
def test_parameter_validation(method, params, n, loc):
    names = [f"e{i}" for i in range(n)]
    req = request_from_args("b", [(x, x) for x in names], method, params)
    with pytest.raises(InputError) as e:
        req.resolve()
    assert e.value.loc == loc, str(e.value)


def test_registry_has_mergekit_names_and_defaults():
    exp = {
        "multislerp": {"weight": None, "normalize_weights": True, "eps": 1e-8},
        "karcher": {"max_iter": 10, "tol": 1e-5},
        "sce": {"select_topk": 1.0, "int8_mask": False},
        "nearswap": {"t": None},
        "ram": {"epsilon": 1e-5},
        "ramplus_tl": {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5},
        "arcee_fusion": {},
    }
    for m, ps in exp.items():
        assert {p.name: p.default for p in METHODS[m].params} == ps, m
        assert METHODS[m].budget_doc


# --- coefficient formulas against mergekit's vector code (float64) ---------------------------


def _vecs(seed: int, k: int, n: int = 64, spread: float = 0.3):
    g = np.random.default_rng(seed)
    common = g.normal(size=n)
    return [common + spread * g.normal(size=n) for _ in range(k)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    k=st.integers(1, 5),
    spread=st.floats(0.001, 3.0),
    normalize=st.booleans(),
)
def test_multislerp_coefficients_reproduce_the_vector_formula(seed, k, spread, normalize):
    """Σcᵢδᵢ with cᵢ from the Gram matrix equals mergekit's multislerp on the vectors (float64)."""
    ds = [torch.from_numpy(v) for v in _vecs(seed, k, spread=spread)]
    ws = list(np.random.default_rng(seed + 1).uniform(0.1, 2.0, size=k))
    zero = torch.zeros_like(ds[0])
    ref = mk.multislerp(zero, ds, ws, normalize)
    gram = np.array([[float(a @ b) for b in ds] for a in ds])
    cs = multislerp_coefficients(ws, gram, normalize)
    got = sum(c * d for c, d in zip(cs, ds))
    assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max()) + 1e-12


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 5), spread=st.floats(0.001, 2.0), it=st.integers(0, 12))
def test_karcher_coefficients_reproduce_the_vector_formula(seed, k, spread, it):
    xs = [torch.from_numpy(v) for v in _vecs(seed, k, spread=spread)]
    ref = mk.karcher(xs, max_iter=it)
    gram = np.array([[float(a @ b) for b in xs] for a in xs])
    cs = karcher_coefficients(gram, it)
    got = sum(c * x for c, x in zip(cs, xs))
    assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_multislerp_antipodal_fallback_and_refusal():
    gram2 = np.array([[1.0, -1.0], [-1.0, 1.0]])
    assert multislerp_coefficients([1.0, 1.0], gram2) == [0.5, 0.5]
    gram3 = np.array([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError):
        multislerp_coefficients([1.0, 1.0, 1.0], gram3)
    assert math.isclose(sum(karcher_coefficients(np.eye(1))), 1.0)


def test_every_method_in_readme_table():
    """README's method table lists every registered method with its budget behaviour."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for m in METHODS:
        assert f"| `{m}`" in text or f", `{m}`" in text, m
    for m in NEW:
        row = next(line for line in text.splitlines() if line.strip().startswith(f"| `{m}`"))
        assert ("refuses" in row) == (METHODS[m].budget == "whole" or m == "sce"), m


def test_passthrough_scales_the_one_model(family, tmp_path):
    """passthrough: no experts; the one model (the base) times ``scale`` (default 1: a copy), no
    expert byte read under any budget; configs name the model once (or as base_model too)."""
    from mergepipe.config import load_config, merge_from_config

    base, experts = family
    b = merged_tensors(base)
    res = merge(str(base), [], "passthrough", str(tmp_path / "half"), ["scale=0.5"], catalog=Catalog(tmp_path / "c"))
    got = merged_tensors(res.out)
    for n, t in b.items():
        want = (t.float() * 0.5).to(t.dtype) if t.dtype.is_floating_point else t
        assert same_bits(got[n], want), n
    assert res.manifest["io"]["realized"]["expert_read_bytes"] == 0
    one = merge(str(base), [], "passthrough", str(tmp_path / "one"), [], catalog=Catalog(tmp_path / "c"), budget="10%")
    assert all(tp.copy_base for tp in one.plan.tensors)
    assert all(same_bits(merged_tensors(one.out)[n], t) for n, t in b.items())
    cfg = tmp_path / "p.yml"
    cfg.write_text(
        f"merge_method: passthrough\nbase_model: {base}\nmodels:\n  - model: {base}\n    parameters: {{scale: 2}}\n"
    )
    r2 = merge_from_config(cfg, str(tmp_path / "two"), catalog=Catalog(tmp_path / "c"))
    g2 = merged_tensors(r2.out)
    assert all(same_bits(g2[n], (t.float() * 2).to(t.dtype)) for n, t in b.items() if t.dtype.is_floating_point)
    for text, key in (
        (f"merge_method: passthrough\nmodels:\n  - model: {base}\n  - model: {experts[0]}\n", "models"),
        (f"merge_method: passthrough\nbase_model: {base}\nmodels:\n  - model: {experts[0]}\n", "base_model"),
        (f"merge_method: passthrough\nmodels:\n  - model: {base}\n    parameters: {{scale: [1, x]}}\n", "models[0]"),
    ):
        cfg.write_text(text)
        with pytest.raises(InputError) as e:
            load_config(cfg)
        assert f"{cfg}: {key}" in str(e.value), str(e.value)
    with pytest.raises(InputError) as e:
        request_from_args(str(base), [("e", str(experts[0]))], "passthrough").resolve()
    assert e.value.loc == ("experts",)


@pytest.mark.parametrize(
    "method,params,n", [("ramplus_tl", [], 3), ("arcee_fusion", [], 1), ("sce", ["select_topk=0.5"], 3)]
)
def test_whole_tensor_methods_ignore_small_work_memory(family, tmp_path, method, params, n):
    """Tensors of whole-tensor methods are one chunk whatever the working-memory target (their
    statistics span the tensor): a tiny target gives the same bytes as the default, while
    block-wise methods are cut into many chunks by it."""
    small = _merge(family, tmp_path, method, params, n, "small", block_bytes=1024, work_bytes=16 * 1024)
    assert all(tp.chunk_rows >= tp.shape[0] for tp in small.plan.tensors if tp.experts and tp.shape)
    full = _merge(family, tmp_path, method, params, n, "full")
    a, b = merged_tensors(small.out), merged_tensors(full.out)
    assert all(same_bits(a[k], b[k]) for k in b)
    ram = _merge(family, tmp_path, "ram", [], n, "ram", block_bytes=1024, work_bytes=16 * 1024)
    assert any(tp.chunk_rows < tp.shape[0] for tp in ram.plan.tensors if tp.experts and tp.shape)
