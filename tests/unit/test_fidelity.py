"""Fidelity mode, measured: the relative distance of a budgeted/fidelity merge to the full merge
versus the plan's retained energy E (docs/QUALITY.md, "Retained energy and distance").

For a linear method (task_arithmetic) an unread block is δ = 0, so
``θ_full − θ_budget = Σᵢ wᵢ·mᵢ`` (mᵢ: expert i's unread blocks) and
``θ_full − θ_base = Σᵢ wᵢ·δᵢ``. With one expert, ``‖θ_budget − θ_full‖ / ‖θ_full − θ_base‖ =
sqrt(1 − E)`` exactly; with several it holds up to the cross terms ``⟨wᵢmᵢ, wⱼmⱼ⟩``, which vanish
for mutually orthogonal task vectors.
"""

import math

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.pipeline import merge
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage


@pytest.fixture(scope="module")
def fp32_family(tmp_path_factory):
    """A float32 base + 3 experts with independent (near-orthogonal) task vectors; float32 so
    that output rounding does not blur the distances."""
    from testkit.synth import make_family

    return make_family(tmp_path_factory.mktemp("fp32fam"), 3, seed=7, dtype="float32")


def _floats(folder) -> dict:
    import torch

    from testkit.harness import merged_tensors

    return {k: v.to(torch.float64) for k, v in merged_tensors(folder).items() if v.dtype.is_floating_point}


def _sq(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return math.fsum(float(((a[k] - b[k]) ** 2).sum()) for k in a)


def _run(tmp, base, experts, out, **kw):
    return merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "task_arithmetic",
        str(tmp / out),
        ["weight=0.5"],
        catalog=Catalog(tmp / "c.sqlite"),
        storage=LocalStorage(IOCounters()),
        block_bytes=4096,
        **kw,
    )


@pytest.mark.parametrize("n_experts, rel_tol", [(1, 1e-6), (3, 0.02)])
def test_distance_matches_sqrt_missing_energy(fp32_family, tmp_path, n_experts, rel_tol):
    base, experts = fp32_family
    experts = experts[:n_experts]
    full = _run(tmp_path, base, experts, "full")
    assert full.plan.retained_energy == pytest.approx(1.0)
    th_base, th_full = _floats(base), _floats(full.out)
    den = _sq(th_full, th_base)
    assert den > 0
    total = full.manifest["io"]["expert_bytes_total"]
    seen = []
    for kw in ({"fidelity": 0.9}, {"fidelity": 0.99}, {"budget": "30%"}, {"budget": "60%"}):
        tag = "-".join(f"{k}{v}" for k, v in kw.items()).replace("%", "pct")
        res = _run(tmp_path, base, experts, tag, **kw)
        e = res.plan.retained_energy
        if "fidelity" in kw:  # fidelity plans meet their target energy, reading less than the full merge
            assert e >= kw["fidelity"] - 1e-9
            assert (
                res.manifest["io"]["realized"]["expert_read_bytes"]
                < full.manifest["io"]["realized"]["expert_read_bytes"]
            )
        else:
            assert res.manifest["io"]["realized"]["expert_read_bytes"] <= int(float(kw["budget"][:-1]) / 100 * total)
        assert 0.0 < e < 1.0  # a real partial merge, or the comparison below says nothing
        dist = math.sqrt(_sq(_floats(res.out), th_full) / den)
        assert f"√(1 − E) = {math.sqrt(1.0 - e):.1%}" in res.plan.explain  # what `mergepipe explain` prints
        assert dist == pytest.approx(math.sqrt(1.0 - e), rel=rel_tol), (kw, e, dist)
        seen.append(e)
    assert len(set(seen)) == len(seen)  # four distinct operating points
