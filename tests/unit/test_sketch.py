"""Fidelity tiers: sign-plane block sketches (catalog), tiered plans (budget), reconstruction (engine)."""

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mergepipe.catalog.catalog import Catalog
from mergepipe.catalog.sketch import (
    PLANES,
    R1_LEVEL,
    SECTIONS,
    TIERS,
    SketchBuilder,
    SketchWriter,
    decode_blocks,
    decode_factors,
    encode_block,
    section_offsets,
    sketch_block_bytes,
    sketch_tiers,
    tensor_sketch_bytes,
    tensor_sketch_costs,
)
from mergepipe.pipeline import merge
from mergepipe.planner.planner import EngineOptions, PlanInputs, SelectionOptions, _select_tiers, make_plan
from mergepipe.request import ExpertRequest, MergeRequest
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage


def test_sign_planes_encode_decode_by_hand():
    d = np.array([[0.5, -1.5, 0.0, 2.0], [0.25, 0.25, -0.25, -0.75]], dtype=np.float32)
    planes, resids = encode_block(d)
    data, resid = planes[0], resids[0]
    # sign bits over the block, row-major, big-endian within a byte: 1001 1100 (δ > 0 is 1; 0 is not)
    assert data[:1] == bytes([0b10011100])
    # scales: mean |δ| per row = 1.0 and 0.375, as little-endian bfloat16
    assert data[1:] == bytes([0x80, 0x3F, 0xC0, 0x3E])
    assert len(data) == sketch_block_bytes(2, 4) == 1 + 4
    rec = decode_blocks(data, 2, 4, 2).reshape(2, 4)
    np.testing.assert_array_equal(rec, [[1, -1, -1, 1], [0.375, 0.375, -0.375, -0.375]])
    # residual Σ(δ − δ̂)²: row 0: .25 + .25 + 1 + 1; row 1: 3·0.125² + 0.375²
    assert resid == pytest.approx(2.5 + 3 * 0.015625 + 0.140625, rel=1e-12)
    assert resid == pytest.approx(float(((d - rec) ** 2).sum()), rel=1e-6)
    # plane 2 codes the residual r1 = δ − δ̂₁ = [[-.5, -.5, 1, 1], [-.125, -.125, .125, -.375]]:
    # signs 0011 0010, scales mean|r1| = 0.75 and 0.1875
    assert planes[1] == bytes([0b00110010]) + np.array([0x3F40, 0x3E40], dtype="<u2").tobytes()
    rec2 = rec + decode_blocks(planes[1], 2, 4, 2).reshape(2, 4)
    np.testing.assert_array_equal(rec2, [[0.25, -1.75, -0.25, 1.75], [0.1875, 0.1875, -0.1875, -0.5625]])
    assert resids[1] == pytest.approx(float(((d - rec2) ** 2).sum()), rel=1e-6)
    assert resids[0] > resids[1] > resids[2] >= 0  # every plane lowers the residual (least-squares scales)


def test_sign1_multi_block_decode_and_costs():
    rng = np.random.default_rng(0)
    d = rng.normal(size=(7, 5)).astype(np.float32)
    parts = [encode_block(d[r : r + 3]) for r in range(0, 7, 3)]
    data = b"".join(p[0][0] for p in parts)  # plane 1 of the three blocks
    costs = tensor_sketch_costs(7, 5, 3, 3)
    assert list(costs) == [len(p[0][0]) for p in parts] == [2 + 6, 2 + 6, 1 + 2]
    rec = decode_blocks(data, 7, 5, 3).reshape(7, 5)
    assert np.array_equal(np.sign(rec), np.where(d > 0, 1.0, -1.0))
    # the scale is the least-squares one: no other scale of these signs has a smaller residual
    for r in range(7):
        s = rec[r, 0] * np.sign(rec[r, 0])
        base = ((d[r] - rec[r]) ** 2).sum()
        for f in (0.9, 1.1):
            assert base <= ((d[r] - f * rec[r]) ** 2).sum()
        assert s == pytest.approx(np.abs(d[r]).mean(), rel=4e-3)  # bfloat16 rounding
    with pytest.raises(ValueError):
        decode_blocks(data[:-1], 7, 5, 3)


@pytest.fixture(scope="module")
def analyzed(family, tmp_path_factory):
    base, experts = family
    cat = Catalog(tmp_path_factory.mktemp("cat") / "c.sqlite")
    st_ = LocalStorage(IOCounters())
    b = cat.register(st_, str(base))
    es = [cat.register(st_, str(e)) for e in experts]
    return cat, b, es, cat.analyze(st_, b, es, block_bytes=4096)


def test_catalog_records_sketch_blobs(analyzed):
    import torch
    from safetensors.torch import load_file

    cat, b, es, an = analyzed
    bt = {}
    for f in Path(b.uri).glob("*.safetensors"):
        bt.update(load_file(str(f)))
    for e, a in zip(es, an):
        sk = a.sketch
        data = Path(sk["uri"]).read_bytes()
        assert sk["kind"] == "sign-planes" and sk["planes"] == PLANES and sk["bytes"] == len(data)
        assert sk["sha256"] == hashlib.sha256(data).hexdigest()
        assert Path(sk["uri"]).is_relative_to(Path(cat.path).parent)
        et = {}
        for f in Path(e.uri).glob("*.safetensors"):
            et.update(load_file(str(f)))
        expected = 0
        for name, info in b.layout.tensors.items():  # the blob follows the base's tensor order
            ts = a.tensors[name]
            if len(info.shape) < 2:
                assert not ts.has_sketch
                continue
            assert ts.has_sketch and ts.sketch_start == expected
            rn = info.numel // info.rows
            n = int(tensor_sketch_costs(info.rows, rn, ts.rows_per_block, ts.n_blocks).sum())  # one plane
            offs = section_offsets(info.rows, rn, ts.rows_per_block, ts.n_blocks)
            assert (offs[:PLANES, -1] - offs[:PLANES, 0] == n).all()
            expected += tensor_sketch_bytes(info.rows, rn, ts.rows_per_block, ts.n_blocks)
            delta = (et[name].to(torch.float32) - bt[name].to(torch.float32)).numpy().reshape(-1)
            rec = np.zeros_like(delta)
            assert ts.sketch_sq.shape == (ts.n_blocks, TIERS)
            assert ts.sketch_sha.shape == (ts.n_blocks, SECTIONS, 16)

            def per_block(rec, rn=rn, ts=ts, info=info, delta=delta):
                resid = ((delta.astype(np.float64) - rec) ** 2).reshape(-1, rn)
                return [resid[r : r + ts.rows_per_block].sum() for r in range(0, info.rows, ts.rows_per_block)]

            for p in range(PLANES):  # plane-major: plane p of every block, then plane p + 1
                o = ts.sketch_start + p * n
                rec = rec + decode_blocks(data[o : o + n], info.rows, rn, ts.rows_per_block)
                np.testing.assert_allclose(ts.sketch_sq[:, p], per_block(rec), rtol=1e-5, atol=1e-12)
            # the rank-1 tier: the factor section, then the residual plane
            f0, f1 = ts.sketch_start + offs[PLANES, 0], ts.sketch_start + offs[PLANES, -1]
            lr = decode_factors(data[f0:f1], info.rows, rn, ts.rows_per_block)
            r0 = ts.sketch_start + offs[PLANES + 1, 0]
            rec1 = lr + decode_blocks(data[r0 : r0 + n], info.rows, rn, ts.rows_per_block)
            np.testing.assert_allclose(ts.sketch_sq[:, PLANES], per_block(rec1), rtol=1e-5, atol=1e-12)
            assert (ts.sketch_sq[:, PLANES] <= ts.sq_norm * (1 + 1e-9) + 1e-15).all()
            assert (np.diff(ts.sketch_sq[:, :PLANES], axis=1) <= 1e-15).all()
            assert (ts.sketch_sq[:, 0] <= ts.sq_norm * (1 + 1e-9) + 1e-15).all()
        assert expected == len(data)
        # cached: a second analyze reads nothing and returns the same sketch
        st2 = LocalStorage(IOCounters())
        again = cat.analyze(st2, b, [e], block_bytes=4096)[0]
        assert again.sketch == sk and sum(st2.counters.snapshot()["read"].values()) == 0


def _plan(b, es, an, method, gp, ep, budget, fidelity=None, sketch="sign3", passes_gap=0):
    req = MergeRequest(
        base=b.uri,
        method=method,
        parameters=dict(gp),
        experts=[ExpertRequest(name=f"e{i}", uri=e.uri, parameters=dict(p)) for i, (e, p) in enumerate(zip(es, ep))],
    )
    return make_plan(
        req.resolve(),
        PlanInputs(b, es, an),
        SelectionOptions(budget, fidelity, sketch=sketch),
        EngineOptions(coalesce_gap=passes_gap),
    )


METHODS = st.sampled_from([("ties", True), ("dare_ties", True), ("task_arithmetic", False), ("linear", False)])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frac=st.floats(0, 1.1),
    m=METHODS,
    density=st.floats(0.05, 1.0),
    gap=st.sampled_from([0, 5000, 1 << 20]),
    w=st.lists(st.floats(-2, 2), min_size=3, max_size=3),
    sk=st.sampled_from(["sign1", "sign2", "sign3", "sign3+r1"]),
    fid=st.sampled_from([None, 0.5, 0.95]),
)
def test_tiered_plans_stay_within_budget(analyzed, frac, m, density, gap, w, sk, fid):
    _, b, es, an = analyzed
    total = sum(e.total_bytes for e in es)
    budget = int(frac * total)
    method, dens = m
    plan = _plan(
        b, es, an, method, {"density": density} if dens else {}, [{"weight": x} for x in w], budget, fid, sketch=sk
    )
    assert plan.io.expert_read_bytes <= budget
    assert 0.0 <= plan.retained_energy <= 1.0 + 1e-9
    exact = sketch = 0
    for t in plan.tensors:
        for te in t.experts:
            mine = set()
            for runs in (te.blocks, te.sketch_blocks):
                prev = 0
                for b0, b1 in runs:
                    assert prev <= b0 < b1 <= t.n_blocks
                    prev = b1
                    assert mine.isdisjoint(range(b0, b1))  # a block is read exactly or sketched, not both
                    mine.update(range(b0, b1))
            assert len(te.sketch_levels) == len(te.sketch_blocks)
            if te.sketch_blocks:
                assert len(t.shape) >= 2 and te.sketch_start >= 0
                assert all(k in sketch_tiers(sk) for k in te.sketch_levels)
                rn = math.prod(t.shape[1:])
                costs = tensor_sketch_costs(t.shape[0], rn, t.rows_per_block, t.n_blocks)
                fac = 2 * (np.minimum(t.rows_per_block, t.shape[0] - t.rows_per_block * np.arange(t.n_blocks)) + rn)
                assert te.sketch_bytes == sum(
                    int(costs[a:z].sum()) * (k if k <= PLANES else 1) + (int(fac[a:z].sum()) if k > PLANES else 0)
                    for (a, z), k in zip(te.sketch_blocks, te.sketch_levels)
                )
            exact += te.bytes * t.passes
            sketch += te.sketch_bytes * t.passes
    assert plan.io.sketch_read_bytes == sketch and plan.io.expert_read_bytes == exact + sketch
    assert plan.digest == plan.compute_digest()
    if sketch:
        assert plan.sketch == sk and plan.coalesce_gap == 0
        assert any(e.sketch for e in plan.experts)


def test_sketches_raise_retained_energy_and_none_is_unchanged(analyzed):
    _, b, es, an = analyzed
    total = sum(e.total_bytes for e in es)
    ep = [{"weight": 0.5}] * 3
    for frac in (0.1, 0.25, 0.5):
        p0 = _plan(b, es, an, "task_arithmetic", {}, ep, int(frac * total), sketch="none")
        p1 = _plan(b, es, an, "task_arithmetic", {}, ep, int(frac * total))
        assert p1.retained_energy > p0.retained_energy
        assert p0.sketch is None and p0.io.sketch_read_bytes == 0
        assert "sketch" not in p0.semantic_json()  # read-or-skip plans digest as before tiers existed
    # unlimited: every block exact, no sketch
    pu = _plan(b, es, an, "task_arithmetic", {}, ep, None)
    assert pu.sketch is None and pu.retained_energy == pytest.approx(1.0)
    # fidelity: reaches its target, with fewer bytes than read-or-skip
    f0 = _plan(b, es, an, "task_arithmetic", {}, ep, None, fidelity=0.9, sketch="none")
    f1 = _plan(b, es, an, "task_arithmetic", {}, ep, None, fidelity=0.9)
    assert f1.retained_energy >= 0.9 * (1 - 1e-9) and f1.io.expert_read_bytes < f0.io.expert_read_bytes


def _tiers(plan) -> dict:
    """{(tensor, block): {expert: tier}}: "x" exact, 1..3 the sketch level, per expert read."""
    out: dict = {}
    for tp in plan.tensors:
        for te in tp.experts:
            for b0, b1 in te.blocks:
                for blk in range(b0, b1):
                    out.setdefault((tp.name, blk), {})[te.expert] = "x"
            for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels):
                for blk in range(b0, b1):
                    out.setdefault((tp.name, blk), {})[te.expert] = k
    return out


def _worst_expert_share(plan) -> float:
    kept, full = np.zeros(len(plan.experts)), np.zeros(len(plan.experts))
    for tp in plan.tensors:
        for te in tp.experts:
            kept[te.expert] += te.kept_energy
    for tp in plan.tensors:
        for te in tp.experts:
            full[te.expert] += te.full_energy
    return float(min(k / f for k, f in zip(kept, full) if f > 0))


@pytest.mark.parametrize(
    "method, gp, w",
    [("ties", {"density": 0.5}, [1.5, 1.0, 0.4]), ("task_arithmetic", {}, [0.75, 0.5, 0.2])],
)
def test_budgeted_tiers_one_representation_per_block_and_monotone(analyzed, method, gp, w):
    """Under a budget every block of a tensor is merged from one representation in all the
    experts that read it (all exact, or all from the same sketch level: a sign election never
    mixes an exact trimmed block with a dense sketch, docs/QUALITY.md "Monotone in budget"),
    a larger budget never lowers the plan's retained value, and no expert is starved (its share
    of its own value, the planner's proxy of its task, is not far below the plan's). The
    experts' weights differ (block values scale with w²): block-by-block tiers mix exact and
    sketched blocks across experts here and fail this test."""
    _, b, es, an = analyzed
    total = sum(e.total_bytes for e in es)
    ep = [{"weight": x} for x in w]
    if method == "ties":
        ep = [{"weight": x, "density": gp["density"]} for x in w]
    prev_ret = -1.0
    for frac in (0.03, 0.05, 0.1, 0.25, 0.5, 0.75):
        plan = _plan(b, es, an, method, {}, ep, int(frac * total))
        mixed = {k: v for k, v in _tiers(plan).items() if len(set(v.values())) > 1}
        assert not mixed, (
            f"{method} at {frac:.0%}: blocks with mixed tiers across experts, e.g. {next(iter(mixed.items()))}"
        )
        assert plan.retained_energy >= prev_ret - 1e-12, (frac, plan.retained_energy, prev_ret)
        # every expert keeps a share of its own value (block-by-block tiers leave the light one at 0)
        assert _worst_expert_share(plan) > 0.1 * plan.retained_energy
        prev_ret = plan.retained_energy


def _reference_experts(plan, base: Path, experts: list[Path], out: Path) -> list[Path]:
    """Experts θ_base + δ̂ (float32): δ̂ the exact task vector on the plan's exact blocks, the
    decoded sketch on its sketched blocks, 0 elsewhere: the dense reference of a tiered merge."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    def load(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    bt = load(base)
    refs = []
    for i, e in enumerate(experts):
        et = load(e)
        deltas = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in bt.items()}
        for tp in plan.tensors:
            for te in tp.experts:
                if te.expert != i:
                    continue
                d = deltas[tp.name].view(tp.shape[0], -1) if len(tp.shape) > 1 else deltas[tp.name].view(-1, 1)
                x = (et[tp.name].float() - bt[tp.name].float()).view(d.shape)
                rpb = tp.rows_per_block
                for b0, b1 in te.blocks:
                    d[b0 * rpb : b1 * rpb] = x[b0 * rpb : b1 * rpb]
                if te.sketch_blocks:
                    blob = Path(plan.experts[i].sketch["uri"]).read_bytes()
                    rn = d.shape[1]
                    offs = section_offsets(tp.shape[0], rn, rpb, tp.n_blocks) + te.sketch_start
                    for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels):
                        r0, r1 = b0 * rpb, min(tp.shape[0], b1 * rpb)
                        acc = np.zeros((r1 - r0) * rn, dtype=np.float32)
                        if k == R1_LEVEL:  # u·vᵀ + (0 + the residual plane)
                            acc += decode_blocks(blob[offs[4, b0] : offs[4, b1]], r1 - r0, rn, rpb)
                            acc = decode_factors(blob[offs[3, b0] : offs[3, b1]], r1 - r0, rn, rpb) + acc
                        for p in range(k if k <= PLANES else 0):
                            acc += decode_blocks(blob[offs[p, b0] : offs[p, b1]], r1 - r0, rn, rpb)
                        d[r0:r1] = torch.from_numpy(acc.reshape(r1 - r0, rn))
        dst = out / f"ref{i}"
        shutil.copytree(e, dst)
        for f in sorted(dst.glob("*.safetensors")):
            keys = load_file(str(f)).keys()
            save_file({k: bt[k].float() + deltas[k] for k in keys}, str(f), metadata={"format": "pt"})
        refs.append(dst)
    return refs


@pytest.mark.parametrize(
    "method, params, sketch",
    [
        ("task_arithmetic", ["weight=0.5"], "sign3"),
        ("dare_linear", ["density=0.5"], "sign3"),
        ("task_arithmetic", ["weight=0.5"], "sign3+r1"),
    ],
)
def test_tiered_merge_equals_dense_reference_on_reconstructed_deltas(tmp_path, method, params, sketch):
    """float32 checkpoints: the tiered merge equals an unlimited read-or-skip merge of experts
    whose task vectors are the reconstructed ones, up to rounding: the engine merges a sketched
    entry's ``δ̂`` itself, the reference ``(b + δ̂) − b`` read back from a checkpoint, which differs
    from ``δ̂`` by the rounding of ``b + δ̂`` (a few ulps of the base); and realized expert bytes
    (sketch bytes included) equal the planned ones, within the budget."""
    import torch

    from testkit.harness import merged_tensors
    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "fam", 3, seed=3, dtype="float32")
    total = sum(sum(f.stat().st_size for f in e.glob("*.safetensors")) for e in experts)
    budget = int(0.06 * total)
    st_ = LocalStorage(IOCounters())
    cat = Catalog(tmp_path / "c.sqlite")
    res = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        method,
        str(tmp_path / "tiered"),
        params,
        budget=budget,
        seed=5,
        catalog=cat,
        storage=st_,
        block_bytes=4096,
        sketch=sketch,
    )
    plan = res.plan
    assert plan.sketch == sketch and any(te.sketch_blocks for tp in plan.tensors for te in tp.experts)
    used = {k for tp in plan.tensors for te in tp.experts for k in te.sketch_levels}
    assert len(used) >= 2 and (R1_LEVEL in used) == (sketch == "sign3+r1")
    io = res.manifest["io"]
    assert io["realized"]["expert_read_bytes"] == io["estimated"]["expert_read_bytes"] <= budget
    assert io["estimated"]["sketch_read_bytes"] > 0
    assert res.manifest["sketch"]["kind"] == sketch and sum(res.manifest["sketch"]["sketched_blocks"].values()) > 0
    refs = _reference_experts(plan, base, experts, tmp_path)
    merge(
        str(base),
        [(e.name, str(r)) for e, r in zip(experts, refs)],
        method,
        str(tmp_path / "ref"),
        params,
        seed=5,
        catalog=cat,
        storage=LocalStorage(IOCounters()),
        block_bytes=4096,
    )
    got, want = merged_tensors(tmp_path / "tiered"), merged_tensors(tmp_path / "ref")
    assert got.keys() == want.keys()
    for k in got:
        scale = float(want[k].abs().max()) if want[k].numel() else 0.0
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2.0**-20 * scale + 1e-30, msg=k)


def test_select_tiers_by_hand():
    # block 0: levels 1..3 cost 10/20/30 B for values 6/8.5/9.4, exact 100 B for 10;
    # block 1: exact only (100 B, value 5); block 2: level 1 worth little (1 for 10 B), level 2
    # 9 for 20 B: level 1 is below the hull's chord and never bought alone
    values = np.array([10.0, 5.0, 10.0])
    costs = np.array([100, 100, 100])
    sv = np.array([[6.0, 8.5, 9.4], [0.0, 0.0, 0.0], [1.0, 9.0, 9.5]])
    sc = np.array([10, 0, 10])
    ex, lv = _select_tiers(values, costs, sv, sc, 30, None)
    # by value per byte: b0 0→1 (.6), b2 0→2 (.45), b0 1→2 (.25), …; 30 B buy the first two
    assert list(ex) == [False, False, False] and list(lv) == [1, 0, 2]
    ex, lv = _select_tiers(values, costs, sv, sc, 60, None)
    # then b0 1→2 (.25, 10 B), b0 2→3 (.09, 10 B), b2 2→3 (.05, 10 B): 60 B
    assert list(lv) == [3, 0, 3] and not ex.any()
    ex, lv = _select_tiers(values, costs, sv, sc, 160, None)
    # b1 exact (.05, 100 B) ties b2 2→3 (.05): by block index, b1 first; then b2 2→3 fits (160 B)
    assert list(ex) == [False, True, False] and list(lv) == [3, 0, 3]
    ex, lv = _select_tiers(values, costs, sv, sc, None, None)
    assert ex.all() and not lv.any()  # unlimited: everything exact
    ex, lv = _select_tiers(values, costs, sv, sc, None, 0.5)  # 12.5 of 25: b0 level 1 (6), b2 level 2 (9)
    assert list(lv) == [1, 0, 2] and not ex.any()


def _lexsort_desc(key):
    """The selection order as the planner computed it before _desc_order (the reference)."""
    return np.lexsort((np.arange(len(key)), -key))


def _level_runs_by_loops(level):
    """One candidate's sketch runs found level by level with loops (the reference)."""
    from mergepipe.planner.planner import _runs

    blocks, levels = [], []
    for k in range(1, int(level.max(initial=0)) + 1):
        for r in _runs(np.nonzero(level == k)[0]):
            blocks.append(r)
            levels.append(k)
    order = sorted(range(len(blocks)), key=lambda q: blocks[q])
    return [blocks[q] for q in order], [levels[q] for q in order]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0 / 3.0, 2.0, 1e-300, 7.5]), max_size=40), st.integers(0, 4))
def test_desc_order_is_the_lexsort_order(small, seed):
    """Descending, ties by index, -0.0 equal to 0.0: the permutation of the reference lexsort, on
    few distinct values (many ties) and on many random ones."""
    from mergepipe.planner.planner import _desc_order

    key = np.array(small, dtype=np.float64)
    assert _desc_order(key).tolist() == _lexsort_desc(key).tolist()
    rng = np.random.default_rng(seed)
    key = np.round(rng.random(5000), 2)  # ~100 distinct values: long tied runs
    assert _desc_order(key).tolist() == _lexsort_desc(key).tolist()


def _flat_runs_by_loops(x, offs):
    """The planner's flattened runs computed candidate by candidate with the loops (the reference)."""
    out = [[], [], [], []]
    for j in range(len(offs) - 1):
        blocks, levels = _level_runs_by_loops(np.asarray(x[offs[j] : offs[j + 1]]).astype(np.int64))
        for (b0, b1), k in zip(blocks, levels):
            for col, v in zip(out, (offs[j] + b0, offs[j] + b1, k, j)):
                col.append(v)
    return tuple(np.array(c, dtype=np.int64) for c in out)


def _sketch_digests_by_loops(pc, cands, infos, runs, offs):
    """Sketch digests per candidate, run by run and section by section (the reference)."""
    from mergepipe.catalog.sketch import level_sections
    from mergepipe.planner.planner import _cand_runs

    out = {}
    for j, (sb, sl) in enumerate(_cand_runs(runs, offs)):
        if sb:
            c = cands[j]
            sha = pc.analyses[c.expert].tensors[infos[c.tensor].name].sketch_sha
            out[j] = "".join(sha[b0:b1, p].tobytes().hex() for (b0, b1), k in zip(sb, sl) for p in level_sections(k))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_level_runs_match_the_loops(levels, sizes):
    """Runs of every candidate at once (selected blocks and sketch levels) equal the runs found
    candidate by candidate with loops, on candidates of random sizes."""
    from mergepipe.planner.planner import _cand_runs, _flat_runs

    offs = np.cumsum([0] + sizes)
    lv = np.resize(np.array(levels or [0], dtype=np.int64), int(offs[-1]))
    for x in (lv, lv > 0):
        fast, ref = _flat_runs(x, offs), _flat_runs_by_loops(x, offs)
        assert all(a.tolist() == b.tolist() for a, b in zip(fast, ref))
        for j, (blocks, vals) in enumerate(_cand_runs(fast, offs)):
            assert (blocks, vals) == _level_runs_by_loops(np.asarray(x[offs[j] : offs[j + 1]]).astype(np.int64))


def test_fast_selection_plans_are_byte_identical(monkeypatch):
    """The planner's sort, run assembly and sketch digests against their reference implementations: identical
    plan digests, with and without fidelity tiers, under budgets and a fidelity target, and with
    two experts of identical statistics (every block value tied across them)."""
    import dataclasses

    from bench.synthetic_catalog import family
    from mergepipe.planner import planner

    base, recs, analyses = family("tiny", 3)
    twin = dataclasses.replace(analyses[0], id=9, expert_identity=recs[2].identity)
    total = sum(r.total_bytes for r in recs)
    cases = 0
    for an in (analyses, [analyses[0], analyses[1], twin]):
        for method, params in (("ties", {"density": 0.5}), ("task_arithmetic", {})):
            rr = MergeRequest(
                base=base.uri,
                method=method,
                parameters=params,
                experts=[ExpertRequest(name=f"e{i}", uri=r.uri) for i, r in enumerate(recs)],
            ).resolve()
            for sketch in ("none", "sign1", "sign3"):
                for budget, fidelity in ((0.05, None), (0.25, None), (0.5, None), (None, 0.9), (0.25, 0.95)):
                    sel = SelectionOptions(
                        budget_bytes=int(total * budget) if budget else None, fidelity=fidelity, sketch=sketch
                    )
                    fast = make_plan(rr, PlanInputs(base, recs, an), sel, EngineOptions())
                    with monkeypatch.context() as m:
                        m.setattr(planner, "_desc_order", _lexsort_desc)
                        m.setattr(planner, "_flat_runs", _flat_runs_by_loops)
                        m.setattr(planner, "_sketch_digests", _sketch_digests_by_loops)
                        ref = make_plan(rr, PlanInputs(base, recs, an), sel, EngineOptions())
                    assert fast.digest == ref.digest, (method, sketch, budget, fidelity)
                    assert fast.semantic_json() == ref.semantic_json()
                    cases += 1
    assert cases == 60


def test_a_requests_sketch_is_checked_and_named_in_the_front_ends_terms():
    """MergeRequest.planning.sketch (how the operator passes spec.sketch) is validated with the
    rest of the request; a bad value names the field path (``planning.sketch``), rendered as
    --sketch on the command line."""
    from mergepipe.errors import InputError

    def req(kind):
        return MergeRequest(base="b", experts=[ExpertRequest(name="e0", uri="e")], method="ties").with_planning(
            sketch=kind
        )

    assert req(None).resolve().request.planning.sketch is None
    kinds = ("none", "sign1", "sign2", "sign3", "sign3+r1")
    assert [req(k).resolve().request.planning.sketch for k in kinds] == list(kinds)
    with pytest.raises(InputError) as e:
        req("sign9").resolve()
    assert e.value.loc == ("planning", "sketch") and e.value.field == "planning.sketch"
    assert str(e.value) == "--sketch 'sign9': use one of none, sign1, sign2, sign3, sign3+r1."


def _load(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in Path(folder).glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_streamed_blob_equals_in_memory_reference(analyzed, tmp_path):
    """The blob analyze streams is byte for byte what the in-memory SketchBuilder (the layout's
    reference) makes of each whole tensor; a second analysis in one-block chunks, whose later
    planes spill to disk, gives the same blob and the same catalog rows."""
    import torch

    cat, b, es, an = analyzed
    bt = _load(b.uri)
    for e, a in zip(es, an):
        et = _load(e.uri)
        ref = []
        for name, info in b.layout.tensors.items():
            if len(info.shape) < 2:
                continue
            rn = info.numel // info.rows
            sb = SketchBuilder(info.rows, rn, a.tensors[name].rows_per_block)
            sb.add(0, (et[name].to(torch.float32) - bt[name].to(torch.float32)).numpy().reshape(-1))
            data, resid = sb.finish()
            np.testing.assert_array_equal(a.tensors[name].sketch_sq, resid)
            ref.append(data)
        assert Path(a.sketch["uri"]).read_bytes() == b"".join(ref)
    cat2 = Catalog(tmp_path / "c2.sqlite")
    st_ = LocalStorage(IOCounters())
    b2 = cat2.register(st_, b.uri)
    an2 = cat2.analyze(st_, b2, [cat2.register(st_, e.uri) for e in es], block_bytes=4096, chunk_bytes=4096)
    for a, a2 in zip(an, an2):
        assert Path(a2.sketch["uri"]).read_bytes() == Path(a.sketch["uri"]).read_bytes()
        assert {k: v for k, v in a2.sketch.items() if k != "uri"} == {k: v for k, v in a.sketch.items() if k != "uri"}
        assert list(a2.tensors) == list(a.tensors)
        assert all(a2.tensors[n].to_bytes() == a.tensors[n].to_bytes() for n in a.tensors)
    assert not [p for p in (tmp_path / "sketches").rglob("*") if p.name.startswith(".")]  # no temporaries left


@pytest.mark.parametrize("spill", [1, 1 << 20])
def test_sketch_writer_matches_builder_in_any_chunking(spill, tmp_path):
    rng = np.random.default_rng(7)
    out = bytearray()
    w = SketchWriter(out.extend, spill_bytes=spill, spill_dir=str(tmp_path))
    ref = []
    for rows, rn, rpb, step in [(37, 12, 5, 10), (8, 3, 8, 8), (64, 33, 4, 24)]:
        d = (rng.standard_normal((rows, rn)) * rng.uniform(0.1, 3.0, (rows, 1))).astype(np.float32)
        sb = SketchBuilder(rows, rn, rpb)
        sb.add(0, d.reshape(-1))
        data, resid = sb.finish()
        assert w.begin(rows, rn, rpb) == sum(map(len, ref))
        for r0 in range(0, rows, step):
            w.add(r0, d[r0 : r0 + step].reshape(-1))
        np.testing.assert_array_equal(w.end(), resid)
        ref.append(data)
    assert bytes(out) == b"".join(ref) and w.nbytes == len(out)
    assert w.sha256.hexdigest() == hashlib.sha256(out).hexdigest()
    assert not list(tmp_path.iterdir())  # spill files are gone with their tensor


def test_sketch_writer_rejects_gaps_and_short_tensors():
    w = SketchWriter(lambda b: None, spill_bytes=1 << 20)
    w.begin(8, 4, 2)
    with pytest.raises(ValueError, match="expected row 0"):
        w.add(2, np.zeros(8, np.float32))
    w.add(0, np.ones(8, np.float32))
    with pytest.raises(ValueError, match="begin"):
        w.begin(8, 4, 2)
    with pytest.raises(ValueError, match="2 of 8 rows"):
        w.end()
    w.discard()


def test_failed_analyze_leaves_no_sketch_and_no_analysis(family, tmp_path):
    """A read failure mid-stream: no blob, no temporary file and no catalog row survive, and a
    retry produces the analysis."""
    from mergepipe.storage.base import StorageError

    base, experts = family

    class Failing(LocalStorage):
        n = 0

        def read_range(self, uri, start, end, role):
            if role == "expert":
                Failing.n += 1
                if Failing.n == 6:
                    raise StorageError(f"{uri}: injected failure")
            return super().read_range(uri, start, end, role)

    cat = Catalog(tmp_path / "c.sqlite")
    st_ = Failing(IOCounters())
    b = cat.register(st_, str(base))
    es = [cat.register(st_, str(e)) for e in experts[:2]]
    with pytest.raises(StorageError, match="injected"):
        cat.analyze(st_, b, es, block_bytes=4096, chunk_bytes=4096)
    assert not [p for p in (tmp_path / "sketches").rglob("*") if p.is_file()]
    assert not any(cat.has_analysis(b.identity, e.identity, 4096) for e in es)
    an = cat.analyze(st_, b, es, block_bytes=4096, chunk_bytes=4096)
    assert all(Path(a.sketch["uri"]).stat().st_size == a.sketch["bytes"] > 0 for a in an)
