"""Budget guarantee (realized <= planned <= budget), fidelity mode, explanations, digests."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mergepipe.catalog.catalog import Catalog
from mergepipe.errors import InputError
from mergepipe.pipeline import execute_and_commit, merge
from mergepipe.planner.plan import Plan
from mergepipe.planner.planner import EngineOptions, PlanInputs, SelectionOptions, make_plan
from mergepipe.request import ExpertRequest, MergeRequest
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage


def _plan(
    b,
    es,
    an,
    method,
    gp=None,
    ep=None,
    *,
    expert_names=None,
    budget_bytes=None,
    fidelity=None,
    seed=0,
    coalesce_gap=0,
    gram=None,
    value="energy",
    sensitivity=None,
    calibration=None,
):
    """make_plan over a request built from merge-wide ``gp`` and per-expert ``ep`` settings
    (experts named by ``expert_names``, else their folder names)."""
    names = expert_names or [e.uri.rstrip("/").rsplit("/", 1)[-1] for e in es]
    req = MergeRequest(
        base=b.uri,
        method=method,
        parameters=dict(gp or {}),
        seed=seed,
        experts=[
            ExpertRequest(name=n, uri=e.uri, parameters=dict(p)) for n, e, p in zip(names, es, ep or [{}] * len(es))
        ],
    )
    return make_plan(
        req.resolve(),
        PlanInputs(b, es, an, gram=gram, sensitivity=sensitivity),
        SelectionOptions(budget_bytes, fidelity, value=value, calibration=calibration),
        EngineOptions(coalesce_gap=coalesce_gap),
    )


@pytest.fixture(scope="module")
def analyzed(family, tmp_path_factory):
    base, experts = family
    cat = Catalog(tmp_path_factory.mktemp("cat") / "c.sqlite")
    st = LocalStorage(IOCounters())
    out = {}
    for bb in (4096, 32768):
        b = cat.register(st, str(base))
        es = [cat.register(st, str(e)) for e in experts]
        out[bb] = (b, es, cat.analyze(st, b, es, block_bytes=bb))
    return out


METHODS = st.sampled_from(
    [
        ("ties", "magnitude"),
        ("dare_ties", "random"),
        ("task_arithmetic", None),
        ("dare_linear", "random"),
        ("linear", None),
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frac=st.floats(0, 1.2),
    m=METHODS,
    density=st.floats(0.05, 1.0),
    gap=st.sampled_from([0, 100, 5000, 1 << 20]),
    bb=st.sampled_from([4096, 32768]),
    w=st.lists(st.floats(-2, 2), min_size=3, max_size=3),
)
def test_planned_never_exceeds_budget(analyzed, frac, m, density, gap, bb, w):
    b, es, an = analyzed[bb]
    total = sum(e.total_bytes for e in es)
    budget = int(frac * total)
    method, sp = m
    gp = {"density": density} if sp else {}
    plan = _plan(b, es, an, method, gp, [{"weight": x} for x in w], budget_bytes=budget, coalesce_gap=gap)
    assert plan.io.expert_read_bytes <= budget
    assert 0.0 <= plan.retained_energy <= 1.0 + 1e-9
    # selected blocks are within each tensor's grid and runs are disjoint and sorted
    for t in plan.tensors:
        for te in t.experts:
            prev = 0
            for b0, b1 in te.blocks:
                assert prev <= b0 < b1 <= t.n_blocks
                prev = b1
    assert plan.digest == plan.compute_digest()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0.0, 1.0), m=METHODS)
def test_realized_never_exceeds_planned(family, tmp_path_factory, frac, m):
    base, experts = family
    tmp = tmp_path_factory.mktemp("run")
    method, sp = m
    params = ["density=0.5"] if sp else []
    total = sum(sum(f.stat().st_size for f in e.iterdir()) for e in experts)
    st_ = LocalStorage(IOCounters())
    try:
        res = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            method,
            str(tmp / "out"),
            params,
            budget=int(frac * total),
            catalog=Catalog(tmp / "c.sqlite"),
            storage=st_,
            block_bytes=4096,
        )
    except InputError as e:  # a budget below the cheapest block is refused, before anything is written
        assert "buys no block" in str(e) and not (tmp / "out").exists(), str(e)
        return
    io = res.manifest["io"]
    assert io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"] <= int(frac * total)
    # with gap 0 on local storage, realized equals planned exactly
    assert io["realized"]["expert_read_bytes"] == io["estimated"]["expert_read_bytes"]


def test_full_and_zero_budget(analyzed):
    b, es, an = analyzed[4096]
    full = _plan(b, es, an, "ties", {"density": 0.5})
    assert full.retained_energy == pytest.approx(1.0)
    assert full.budget_bytes is None
    # TIES never reads blocks whose every entry is trimmed, so full budget reads <= everything
    assert full.io.expert_read_bytes <= sum(t.nbytes for e in es for t in e.layout.tensors.values())
    zero = _plan(b, es, an, "ties", {"density": 0.5}, budget_bytes=0)
    assert zero.io.expert_read_bytes == 0 and zero.retained_energy == 0.0
    assert all(t.copy_base for t in zero.tensors)
    half = _plan(b, es, an, "ties", {"density": 0.5}, budget_bytes=full.io.expert_read_bytes // 2)
    # greedy by value per byte keeps more than half the energy with half the bytes
    assert 0.5 < half.retained_energy < 1.0


def test_fidelity_mode(analyzed):
    b, es, an = analyzed[4096]
    prev = -1
    for f in (0.5, 0.9, 0.99, 1.0):
        p = _plan(b, es, an, "task_arithmetic", {}, fidelity=f)
        assert p.retained_energy >= f - 1e-9
        assert p.io.expert_read_bytes >= prev
        prev = p.io.expert_read_bytes
    both = _plan(b, es, an, "task_arithmetic", {}, fidelity=0.99, budget_bytes=1000)
    assert both.io.expert_read_bytes <= 1000
    # (a user's fidelity and budget are refused by the request; test_selection_options_refuse_...)
    with pytest.raises(ValueError, match="fidelity"):
        _plan(b, es, an, "ties", {}, fidelity=1.5)
    with pytest.raises(ValueError, match="budget"):
        _plan(b, es, an, "ties", {}, budget_bytes=-1)


def test_digest_is_semantic_and_roundtrips(analyzed, tmp_path):
    b, es, an = analyzed[4096]
    p1 = _plan(b, es, an, "ties", {"density": 0.5}, budget_bytes=100_000)
    p2 = _plan(b, es, an, "ties", {"density": 0.5}, budget_bytes=100_000)
    assert p1.digest == p2.digest and p1.created_at != 0
    p3 = _plan(b, es, an, "ties", {"density": 0.6}, budget_bytes=100_000)
    assert p3.digest != p1.digest
    again = Plan.from_json(p1.to_json())
    assert again.digest == p1.digest
    tampered = p1.to_json().replace('"budget_bytes": 100000', '"budget_bytes": 100001')
    with pytest.raises(InputError, match="digest"):
        Plan.from_json(tampered)


def test_explanations_name_experts_and_blocks(analyzed):
    b, es, an = analyzed[4096]
    p = _plan(b, es, an, "ties", {"density": 0.3}, budget_bytes=60_000, expert_names=["a", "b", "c"])
    assert "retaining" in p.explain and "budget" in p.explain
    merged = [t for t in p.tensors if t.experts]
    assert merged and all("blocks" in t.explain for t in merged)
    assert any(t.copy_base and "copied from base" in t.explain for t in p.tensors)


def test_execute_saved_plan_is_deterministic(family, tmp_path):
    """Same plan and inputs give bit-identical shards, through `execute` of a saved plan too."""
    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    r1 = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "dare_ties",
        str(tmp_path / "a"),
        ["density=0.3"],
        budget="40%",
        catalog=cat,
        seed=3,
    )
    plan = Plan.from_json(r1.plan.to_json())
    r2 = execute_and_commit(plan, LocalStorage(IOCounters()), str(tmp_path / "b"))
    assert r1.manifest["outputs"] == r2.manifest["outputs"]
    assert r1.manifest["snapshot_id"] == r2.manifest["snapshot_id"]
    r3 = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "dare_ties",
        str(tmp_path / "c"),
        ["density=0.3"],
        budget="40%",
        catalog=cat,
        seed=4,
    )
    assert r3.manifest["outputs"] != r1.manifest["outputs"]


NEW = st.sampled_from(
    [
        ("breadcrumbs", {}),
        ("breadcrumbs_ties", {"gamma": 0.05}),
        ("della", {}),
        ("della_linear", {"rescale": False}),
        ("model_stock", {}),
        ("model_stock", {"filter_wise": True}),
        ("nuslerp", {}),
        ("nuslerp", {"nuslerp_flatten": False}),
        ("slerp", {"t": 0.4}),
    ]
)


@pytest.fixture(scope="module")
def analyzed_pairs(family, tmp_path_factory):
    base, experts = family
    cat = Catalog(tmp_path_factory.mktemp("catp") / "c.sqlite")
    st_ = LocalStorage(IOCounters())
    b = cat.register(st_, str(base))
    es = [cat.register(st_, str(e)) for e in experts]
    an = cat.analyze(st_, b, es, block_bytes=4096, pairs=True)
    return b, es, an, cat.pair_dots(b, es, an)


def _new_method_args(m, extra, density, analyzed_pairs):
    b, es, an, gram = analyzed_pairs
    k = {"slerp": 1, "nuslerp": 2}.get(m, 3)
    gp = dict(extra)
    if m.startswith(("breadcrumbs", "della")):
        gp["density"] = density
        if m.startswith("della"):
            gp["epsilon"] = min(0.15, density / 2, (1 - density) / 2)
    g = {(i, j): v for (i, j), v in gram.items() if j < k}
    return b, es[:k], an[:k], gp, g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frac=st.floats(0, 1.2),
    m=NEW,
    density=st.floats(0.05, 1.0).map(lambda x: round(x, 3)),
    gap=st.sampled_from([0, 5000]),
)
def test_new_methods_never_exceed_budget(analyzed_pairs, frac, m, density, gap):
    method, extra = m
    b, es, an, gp, gram = _new_method_args(method, extra, density, analyzed_pairs)
    budget = int(frac * sum(e.total_bytes for e in es))
    plan = _plan(b, es, an, method, gp, None, budget_bytes=budget, coalesce_gap=gap, gram=gram)
    assert plan.io.expert_read_bytes <= budget
    assert 0.0 <= plan.retained_energy <= 1.0 + 1e-9
    full = _plan(b, es, an, method, gp, None, gram=gram)
    assert full.retained_energy == pytest.approx(1.0)
    # unlimited budget reads every block with a non-zero task vector (kept value or a row-local statistic)
    if method.startswith(("della", "model_stock", "nuslerp")) or (method == "slerp"):
        for tp in full.tensors:
            for te in tp.experts:
                assert sum(b1 - b0 for b0, b1 in te.blocks) == int((an[te.expert].tensors[tp.name].sq_norm > 0).sum())


@pytest.mark.parametrize(
    "method,params,n",
    [
        ("breadcrumbs_ties", ["density=0.5", "rescale=true"], 3),
        ("della", ["density=0.5"], 3),
        ("model_stock", ["filter_wise=true"], 3),
        ("slerp", ["t=0.5"], 1),
        ("nuslerp", ["nuslerp_flatten=false"], 2),
    ],
)
def test_new_methods_realized_within_planned(family, tmp_path, method, params, n):
    base, experts = family
    experts = experts[:n]
    total = sum(sum(f.stat().st_size for f in e.iterdir()) for e in experts)
    for frac in (0.1, 0.45):
        st_ = LocalStorage(IOCounters())
        res = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            method,
            str(tmp_path / f"out{frac}"),
            params,
            budget=int(frac * total),
            catalog=Catalog(tmp_path / "c.sqlite"),
            storage=st_,
            block_bytes=4096,
            work_bytes=64 * 1024,
        )
        io = res.manifest["io"]
        assert io["realized"]["expert_read_bytes"] == io["estimated"]["expert_read_bytes"] <= int(frac * total)
        assert 0.0 < res.plan.retained_energy < 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frac=st.floats(0, 1.2),
    m=METHODS,
    density=st.floats(0.05, 1.0),
    gap=st.sampled_from([0, 100, 5000]),
    bb=st.sampled_from([4096, 32768]),
    seed=st.integers(0, 2**31 - 1),
    zero=st.floats(0.0, 0.5),
)
def test_fisher_valued_plans_stay_within_budget(analyzed, frac, m, density, gap, bb, seed, zero):
    """The sensitivity-weighted block value (some blocks with zero Fisher) never breaks the budget;
    at unlimited budget it reads exactly the blocks the energy plan reads (same output)."""
    import numpy as np

    b, es, an = analyzed[bb]
    rng = np.random.default_rng(seed)
    sens = {}
    for name, s in an[0].tensors.items():
        f = rng.lognormal(0.0, 2.0, s.n_blocks)
        f[rng.random(s.n_blocks) < zero] = 0.0
        sens[name] = f
    method, sp = m
    gp = {"density": density} if sp else {}
    budget = int(frac * sum(e.total_bytes for e in es))
    plan = _plan(
        b,
        es,
        an,
        method,
        gp,
        budget_bytes=budget,
        coalesce_gap=gap,
        value="fisher",
        sensitivity=sens,
        calibration="c" * 64,
    )
    assert plan.io.expert_read_bytes <= budget
    assert 0.0 <= plan.retained_energy <= 1.0 + 1e-9
    assert plan.block_value == {"kind": "fisher", "calibration": "c" * 64}
    full_f = _plan(b, es, an, method, gp, coalesce_gap=gap, value="fisher", sensitivity=sens, calibration="c" * 64)
    full_e = _plan(b, es, an, method, gp, coalesce_gap=gap)
    assert [[te.blocks for te in t.experts] for t in full_f.tensors] == [
        [te.blocks for te in t.experts] for t in full_e.tensors
    ]
    assert full_f.digest != full_e.digest and full_e.block_value is None


def test_fisher_value_needs_its_statistic(analyzed):
    b, es, an = analyzed[4096]
    # (a user's value/calibration are refused by the request with field paths, before planning)
    with pytest.raises(ValueError, match="sensitivity"):
        _plan(b, es, an, "ties", {"density": 0.5}, value="fisher")
    with pytest.raises(ValueError, match="value"):
        _plan(b, es, an, "ties", {"density": 0.5}, value="curvature")
    with pytest.raises(InputError, match="lacks tensor"):
        _plan(b, es, an, "ties", {"density": 0.5}, value="fisher", sensitivity={"x": [1.0]}, calibration="c")


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    gap_blocks=st.sampled_from([0, 1, 3]),
    passes=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=4),
)
def test_selection_is_gap_closed_exact_and_spends_the_budget(data, gap_blocks, passes):
    """_select: the selection is closed under the storage's gap rule, so its coalesced cost (per
    expert and tensor, as the engine reads) is exactly its blocks' bytes and within the budget;
    and no unselected valuable block would still fit (with the gap blocks taking it bridges)."""
    import numpy as np

    from mergepipe.planner.planner import _gap_closure, _select
    from mergepipe.storage.base import coalesce

    block = 100
    lens = [data.draw(st.integers(1, 12)) for _ in passes]
    cost1 = np.concatenate([[block] * (n - 1) + [data.draw(st.integers(1, block))] for n in lens]).astype(np.int64)
    costs = cost1 * np.repeat(passes, lens)
    cand_of = np.repeat(np.arange(len(lens)), lens)
    values = np.array(
        data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0, 30.0]), min_size=len(cost1), max_size=len(cost1)))
    )
    budget = data.draw(st.integers(0, int(costs.sum()) + 50))
    gap = gap_blocks * block
    sel = _select(values, costs, cost1, cand_of, gap, budget, None)
    cum = np.concatenate([[0], np.cumsum(cost1)])
    assert np.array_equal(_gap_closure(sel, cand_of, cum, gap), sel)
    spent = int(costs[sel].sum())
    assert spent <= budget
    off = 0
    coalesced = 0
    for c, n in enumerate(lens):
        s = sel[off : off + n]
        rng = [(int(cum[off + i]), int(cum[off + i + 1])) for i in np.flatnonzero(s)]
        coalesced += passes[c] * sum(e - a for a, e in coalesce(rng, gap))
        off += n
    assert coalesced == spent
    for j in np.flatnonzero(~sel & (values > 0)):
        more = sel.copy()
        more[j] = True
        assert int(costs[_gap_closure(more, cand_of, cum, gap)].sum()) > budget, "a valuable block still fits"


def test_selection_options_refuse_what_no_request_produces():
    """The user-facing refusals (budget, fidelity, block value, tiers) happen in the request with
    field paths; the planner's own options refuse values no validated request produces, as a
    caller's bug (ValueError), with no command-line wording."""
    for kw in ({"budget_bytes": -1}, {"fidelity": 0.0}, {"fidelity": 1.5}, {"value": "loss"}, {"sketch": "sign9"}):
        with pytest.raises(ValueError, match=r"^SelectionOptions\.") as e:
            SelectionOptions(**kw)
        assert not isinstance(e.value, InputError) and "--" not in str(e.value)
    req = MergeRequest(base="b", experts=[ExpertRequest(name="e", uri="e")], method="ties", parameters={"density": 0.5})
    for field, bad in (("budget", -1), ("fidelity", 1.5)):
        with pytest.raises(InputError) as ie:
            req.model_copy(update={field: bad}).resolve()
        assert ie.value.loc == (field,)
    with pytest.raises(InputError) as ie:
        req.with_planning(sketch="sign9").resolve()
    assert ie.value.loc == ("planning", "sketch")
