"""Every search arm of bench/search.py is what its name says (issue 27): no dead dimensions.

Each arm's space is built on the synthetic family (3 experts, real float32 safetensors); every
coordinate is perturbed and the real merge must change. The degenerate baseline the old
benchmark used (``ties`` with one weight shared by every expert, normalised by default) is the
negative control: its weight coordinate is dead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("botorch")


@pytest.fixture(scope="module")
def family32(tmp_path_factory):
    """The synthetic family in float32: in bf16, ties in |τ| at the trimming threshold let a
    shared ``ties`` weight move ~1 % of the merged model through rounding; in float32 it cancels
    to ~1e-7 (as on the zoo, issue 27)."""
    from testkit.synth import make_family

    return make_family(tmp_path_factory.mktemp("family32"), 3, seed=1, dtype="float32")


def _cfg(family32, tmp_path, **space):
    from mergepipe.search.runner import SearchConfig

    base, experts = family32
    return SearchConfig(
        base=str(base),
        experts=[[f"e{i}", str(e)] for i, e in enumerate(experts)],
        objectives=["a", "b"],
        evaluations=4,
        initial=2,
        catalog=str(tmp_path / "cat.sqlite"),
        **space,
    )


def test_every_arm_of_the_benchmark_has_only_live_coordinates(family32, tmp_path):
    from bench.search import ARMS, arm_space
    from mergepipe.search.runner import dead_coordinates

    seen = set()
    for arm in ARMS:
        sp = arm_space(arm, blocks=2)
        key = repr(sorted(sp.items()))
        if key in seen:  # arms that differ only in the optimizer share the space
            continue
        seen.add(key)
        cfg = _cfg(family32, tmp_path, **sp)
        assert dead_coordinates(cfg, tmp_path / arm) == [], arm


def test_shared_weight_under_normalised_ties_is_dead(family32, tmp_path):
    from mergepipe.search.runner import dead_coordinates

    # the old "2-D model-level BO": one weight and one density shared by every expert
    cfg = _cfg(family32, tmp_path, method="ties", vary=["*:weight=0:1", "*:density=0.1:1"], layer_blocks=1)
    assert dead_coordinates(cfg, tmp_path / "ties") == ["*:weight@L0-1"]
    # the same with per-expert weights: every weight is live again (relative weights matter)
    cfg = _cfg(family32, tmp_path, method="ties", vary=["weight=0:1", "*:density=0.1:1"], layer_blocks=1)
    assert dead_coordinates(cfg, tmp_path / "ties-per-expert") == []
