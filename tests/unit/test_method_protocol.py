"""Methods are objects behind one protocol (mergepipe.methods.base): every registered method is an
instance of its family module's class, and a new method is one class plus a registry entry —
planned, budgeted, merged by the streaming engine and explained with no other change."""

from dataclasses import dataclass

import pytest
import torch

from mergepipe.catalog.catalog import Catalog
from mergepipe.methods import registry
from mergepipe.methods.base import MethodSpec, ParamSpec, TensorStatsView
from mergepipe.pipeline import merge
from testkit.harness import merged_tensors, same_bits


def test_every_method_comes_from_its_family_module():
    by_module = {m.__name__: m for m in registry.FAMILIES}
    listed = [s.name for fam in registry.FAMILIES for s in fam.METHODS]
    assert listed == list(registry.METHODS)  # the registry is exactly the families' methods, in order
    for name, spec in registry.METHODS.items():
        assert isinstance(spec, MethodSpec)
        assert type(spec).__module__ in by_module, f"{name}: {type(spec).__module__} is not a family module"
    # the behaviour differs by object, not by a kind string: e.g. only the task-arithmetic family
    # combines sparsified task vectors, only slerp/nearswap/arcee_fusion need the experts' values
    assert {n for n, s in registry.METHODS.items() if s.combines_task_vectors} == {
        "linear",
        "task_arithmetic",
        "ties",
        "dare_ties",
        "dare_linear",
        "breadcrumbs",
        "breadcrumbs_ties",
        "della",
        "della_linear",
    }
    assert {n for n, s in registry.METHODS.items() if s.needs_expert_values} == {"slerp", "nearswap", "arcee_fusion"}


SCALE = ParamSpec("s", 1.0, "global", lo=0.0, doc="scale of the summed task vectors")


@dataclass(frozen=True)
class ScaledSum(MethodSpec):
    """``base + s·Σδᵢ``: a toy method written only against the protocol."""

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        s = float(ts.globals["s"])
        return [s] * ts.n_experts, {"s": s}

    def merge_chunk(self, base, present, tp, n_experts):
        acc = None
        for i in sorted(present):
            acc = present[i][1] if acc is None else acc + present[i][1]
        return base if acc is None else base + tp.derived["s"] * acc

    def explain_head(self, tp) -> str:
        return f"scaled_sum s={tp.derived['s']:g}; "


def _dense(base, experts, s: float) -> dict:
    b = merged_tensors(base)
    xs = [merged_tensors(e) for e in experts]
    out = {}
    for n, t in b.items():
        bf = t.float()
        acc = None
        for x in xs:
            d = x[n].float() - bf
            acc = d if acc is None else acc + d
        out[n] = (bf + s * acc).to(t.dtype)
    return out


def test_a_new_method_is_one_class_and_a_registry_entry(family, tmp_path, monkeypatch):
    base, experts = family
    spec = ScaledSum("scaled_sum", "none", None, (SCALE,), kind="scaled_sum", paper="test")
    monkeypatch.setitem(registry.METHODS, spec.name, spec)
    cat = Catalog(tmp_path / "c.sqlite")
    pairs = [(e.name, str(e)) for e in experts]
    full = merge(str(base), pairs, "scaled_sum", str(tmp_path / "full"), ["s=0.5"], catalog=cat, seed=7)
    got, ref = merged_tensors(full.out), _dense(base, experts, 0.5)
    bad = [n for n in ref if not same_bits(got[n], ref[n])]
    assert not bad, f"{len(bad)} tensors differ from base + s·Σδ, e.g. {bad[:3]}"
    assert any(tp.explain.startswith("scaled_sum s=0.5; ") for tp in full.plan.tensors)
    # under a budget the planner ranks its blocks by s²·‖δ‖² and reads at most the budget
    part = merge(str(base), pairs, "scaled_sum", str(tmp_path / "q"), ["s=0.5"], budget="25%", catalog=cat, seed=7)
    io = part.manifest["io"]
    assert 0 < io["realized"]["expert_read_bytes"] <= io["expert_budget_bytes"]
    assert part.plan.retained_energy < 1.0
    # its parameters are validated like any method's
    from mergepipe.errors import InputError

    with pytest.raises(InputError, match="s=-1 is outside"):
        merge(str(base), pairs, "scaled_sum", str(tmp_path / "bad"), ["s=-1"], catalog=cat)
    assert torch.is_tensor(next(iter(got.values())))
