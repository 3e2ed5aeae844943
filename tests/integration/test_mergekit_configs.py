"""mergekit configs beyond slices against mergekit 0.1.5 itself on a tiny bf16 Llama: exact
TIES/breadcrumbs thresholds on bf16 inputs, multislerp without base_model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testkit.harness import merged_tensors  # noqa: E402
from testkit.mergekit_run import _mergekit, _ours, _write, tiny_llama_family4  # noqa: E402


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return tiny_llama_family4(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))


def _exact_ties(plan, base: dict, experts: list[dict], name: str):
    """Elements of ``name`` where some expert's float32 |δ| equals exactly its k-th largest (the
    only place mergekit's argsort and mergepipe's canonical tie rule may choose differently)."""
    tp = next(t for t in plan.tensors if t.name == name)
    flag = torch.zeros(base[name].numel(), dtype=torch.bool)
    for te in tp.experts:
        if te.density >= 1.0:
            continue
        d = (experts[te.expert][name].float() - base[name].float()).abs().flatten()
        n = d.numel()
        if plan.method == "ties":  # mergekit keeps the top k = max(1, int(density·n))
            cuts = [n - max(1, int(te.density * n))]
        else:  # breadcrumbs: ascending positions [n_bot, n_bot + target)
            target = int(te.density * n)
            n_bot = max(0, n - target - int(te.gamma * n))
            cuts = [n_bot, n_bot + target]
        asc = torch.sort(d).values
        for c in cuts:
            if 0 < c < n and asc[c - 1] == asc[c]:
                flag |= d == asc[c]
    return flag.reshape(base[name].shape)


@pytest.mark.parametrize(
    "method,params", [("ties", {"density": 0.5}), ("breadcrumbs", {"density": 0.6, "gamma": 0.05})]
)
def test_bf16_exact_thresholds_match_mergekit_outside_exact_ties(bf16, tmp_path, method, params):
    """bf16 inputs get exact top-k of the float32 |δ| (a bf16 difference is often not a bf16
    value, so a magnitude-key group holds distinct values): against mergekit 0.1.5 with
    ``dtype: float32`` every differing element is an exact tie at the threshold (equal float32
    |δ|, where mergekit's argsort order decides), and the plan refines threshold groups."""
    cfg = {
        "models": [
            {"model": bf16["base"]},
            {"model": bf16["a"], "parameters": {"weight": 0.6}},
            {"model": bf16["b"], "parameters": {"weight": 0.4}},
        ],
        "merge_method": method,
        "base_model": bf16["base"],
        "parameters": params,
        "dtype": "float32",
    }
    p = _write(tmp_path, cfg)
    ref = _mergekit(p, tmp_path / "mk")
    res, got = _ours(tmp_path, p, tmp_path / "out")
    assert any(te.exact_rank or te.exact_rank_hi for tp in res.plan.tensors for te in tp.experts)
    base = merged_tensors(bf16["base"])
    experts = [merged_tensors(bf16["a"]), merged_tensors(bf16["b"])]
    differ = 0
    for name in ref:
        d = got[name] != ref[name]
        differ += int(d.sum())
        if d.any():
            outside = d & ~_exact_ties(res.plan, base, experts, name)
            assert not outside.any(), (name, int(outside.sum()))
    assert differ < 0.002 * sum(t.numel() for t in ref.values())


def test_multislerp_without_base_model_matches_mergekit(bf16, tmp_path):
    """mergekit's multislerp without ``base_model`` interpolates the models' raw weights on the
    sphere (no task vectors). mergepipe takes the first model as the origin (a zero task vector
    with its own weight) and the coefficients from the raw points' Gram matrix: equal to mergekit
    within float32 rounding, every tensor rescaled (the plan's c_base is not 1)."""
    cfg = {
        "models": [
            {"model": bf16["base"], "parameters": {"weight": 0.5}},
            {"model": bf16["a"], "parameters": {"weight": 0.3}},
            {"model": bf16["b"], "parameters": {"weight": 0.2}},
        ],
        "merge_method": "multislerp",
        "dtype": "float32",
    }
    p = _write(tmp_path, cfg)
    ref = _mergekit(p, tmp_path / "mk")
    res, got = _ours(tmp_path, p, tmp_path / "out")
    assert [e.name for e in res.plan.experts] == ["base", "a", "b"]
    assert any(tp.derived.get("c_base", 1.0) != 1.0 for tp in res.plan.tensors)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=5e-6, atol=1e-6, msg=k)
    # with a base_model it stays the task-vector barycentre (not the same merge)
    cfg2 = {**cfg, "base_model": bf16["base"], "models": cfg["models"][1:]}
    _, got2 = _ours(tmp_path, _write(tmp_path, cfg2, "b.yml"), tmp_path / "out2")
    assert any(not torch.equal(got2[k], got[k]) for k in got)
