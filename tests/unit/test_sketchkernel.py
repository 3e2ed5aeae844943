"""The engine's bit-sliced sketch decoder equals the numpy reference decoder, bit for bit.

Reference: :func:`mergepipe.catalog.sketch.decode_blocks` summed over planes in float32 (``δ̂``, the
task vector the engine merges for a sketched entry), and the expert values ``b + δ̂`` (float32).
The table forms -- a trimmed gather, the exact-threshold histogram counted from the tables -- equal
the same operations on the decoded entries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe.catalog.sketch import PLANES, SECTIONS, decode_blocks, decode_factors, encode_block
from mergepipe.engine.chunk import _dense_group_hist, _GroupHist
from mergepipe.engine.sketchkernel import SketchRun
from mergepipe.numerics import GROUP_BINS, exact_shrink, exact_shrink_hist, key_group_bits, magnitude_keys

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _planes(delta: np.ndarray, rpb: int) -> list[bytes]:
    """The tensor's sections: PLANES sign planes, the rank-1 factors, the residual plane."""
    planes: list[list[bytes]] = [[] for _ in range(SECTIONS)]
    for r in range(0, delta.shape[0], rpb):
        parts, _ = encode_block(delta[r : r + rpb])
        for p, b in enumerate(parts):
            planes[p].append(b)
    return [b"".join(p) for p in planes]


def _reference(planes: list[bytes], k: int, rows: int, rn: int, rpb: int, base: np.ndarray):
    d = np.zeros(rows * rn, dtype=np.float32)
    for p in range(k):
        d += decode_blocks(planes[p], rows, rn, rpb)
    return torch.from_numpy(d), torch.from_numpy(base + d)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(
    ("rows", "rn", "rpb"),
    [(7, 5, 3), (13, 7, 4), (9, 13, 9), (1, 1, 1), (40, 33, 6), (6, 1, 4), (17, 64, 5)],
)
def test_kernel_equals_numpy_decoder_for_any_rows_and_levels(dtype, rows, rn, rpb):
    rng = np.random.default_rng(rows * 1000 + rn * 10 + rpb)
    delta = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    delta[rng.random((rows, rn)) < 0.1] = 0.0  # zeros: their sign bit is "negative"
    if rows > 2:
        delta[1] = 0.0  # a row whose every scale is 0
    base = torch.from_numpy((rng.standard_normal(rows * rn) * 0.02).astype(np.float32)).to(DTYPES[dtype]).float()
    base[::7] = -0.0  # signed zeros in the base
    bn = base.numpy()
    planes = _planes(delta, rpb)
    n = rows * rn
    _check_rank1_tier(planes, rows, rn, rpb, base)
    for k in range(1, PLANES + 1):
        ref_d, ref_x = _reference(planes, k, rows, rn, rpb, bn)
        run = SketchRun(rows, rn, rpb, planes[:k])
        assert np.array_equal(_bits(run.delta(0, n, base)), _bits(ref_d))
        assert np.array_equal(_bits(run.values(0, n, base)), _bits(ref_x))
        for e0, e1 in {(0, 1), (1, n), (n // 3, 2 * n // 3 + 1), (n - 1, n), (rn, min(n, 3 * rn + 2))}:
            if e1 <= e0:
                continue
            got = run.delta(e0, e1, base[e0:e1])
            assert np.array_equal(_bits(got), _bits(ref_d[e0:e1])), (k, e0, e1)
        for r0, r1 in {(0, rows), (rows // 2, rows), (0, 1), (rows - 1, rows)}:
            want = torch.from_numpy(
                sum(decode_blocks(planes[p], rows, rn, rpb) for p in range(k)).reshape(rows, rn)[r0:r1]
            )
            assert torch.equal(run.delta_rows(r0, r1, torch.device("cpu")), want)


def _check_rank1_tier(planes, rows, rn, rpb, base):
    """The rank-1 tier (factors + residual plane) through the kernel equals the numpy reference:
    ``u·vᵀ`` (float32) + ``(0 + ±s)`` of the residual plane (``δ̂``, merged as is), its trim and its
    group histogram (decoded: a rank-1 row is no table of values)."""
    bn = base.numpy()
    fac, res = planes[PLANES], planes[PLANES + 1]
    # plane sums start from float32 zeros, as for the sign levels (a zero row's −0 scale gives +0)
    d = decode_factors(fac, rows, rn, rpb) + (np.zeros(rows * rn, np.float32) + decode_blocks(res, rows, rn, rpb))
    x = bn + d
    ref_d = torch.from_numpy(d)
    run = SketchRun(rows, rn, rpb, [res], factors=fac)
    lam = float(np.sort(np.abs(d))[len(d) // 2])
    assert torch.equal(run.delta(0, rows * rn, base, shrink=lam), torch.nn.functional.hardshrink(ref_d, lam))
    keys = magnitude_keys(d)
    for tau in sorted(set(keys[keys > 0].tolist()))[:3]:
        g = _GroupHist(tau)
        g.add_run(run, torch.device("cpu"))
        assert np.array_equal(g.done(), _dense_group_hist(ref_d, tau))
    with pytest.raises(ValueError, match="rank-1 run"):
        run.add_group_hist(np.zeros(GROUP_BINS, dtype=np.int64), 0x3C000000, torch.device("cpu"))
    n = rows * rn
    assert run.nbytes == len(fac) + len(res)
    assert np.array_equal(_bits(run.delta(0, n, base)), _bits(ref_d))
    assert np.array_equal(_bits(run.values(0, n, base)), _bits(torch.from_numpy(x)))
    for e0, e1 in {(0, 1), (1, n), (n // 3, 2 * n // 3 + 1), (n - 1, n), (rn, min(n, 3 * rn + 2))}:
        if e1 > e0:
            assert np.array_equal(_bits(run.delta(e0, e1, base[e0:e1])), _bits(ref_d[e0:e1])), (e0, e1)
    for r0, r1 in {(0, rows), (rows // 2, rows), (0, 1), (rows - 1, rows)}:
        want = torch.from_numpy(d.reshape(rows, rn)[r0:r1])
        assert torch.equal(run.delta_rows(r0, r1, torch.device("cpu")), want)


def test_rank1_tier_keeps_a_low_rank_delta():
    """A rank-1 task vector plus small noise: the rank-1 tier's residual is far below one sign plane's."""
    rng = np.random.default_rng(5)
    d = (np.outer(rng.standard_normal(24), rng.standard_normal(40)) + 0.05 * rng.standard_normal((24, 40))).astype(
        np.float32
    )
    _, resid = encode_block(d)
    sq = float((d.astype(np.float64) ** 2).sum())
    assert resid[PLANES] < 0.01 * sq < resid[0]


def test_run_refuses_planes_of_the_wrong_size():
    delta = np.ones((7, 5), dtype=np.float32)
    planes = _planes(delta, 3)
    SketchRun(7, 5, 3, planes[:PLANES])
    with pytest.raises(ValueError, match="plane 2 has"):
        SketchRun(7, 5, 3, [planes[0], planes[1][:-1]])
    with pytest.raises(ValueError, match="expected for 6 rows"):
        SketchRun(6, 5, 3, planes[:1])
    SketchRun(7, 5, 3, [planes[PLANES + 1]], factors=planes[PLANES])
    with pytest.raises(ValueError, match="rank-1 factors of"):
        SketchRun(7, 5, 3, [planes[PLANES + 1]], factors=planes[PLANES][:-2])
    with pytest.raises(ValueError, match="one residual plane expected"):
        SketchRun(7, 5, 3, planes[:2], factors=planes[PLANES])


def test_kernel_runs_on_the_requested_device():
    """The decoder's tensors follow the base tile's device (``--device cuda`` runs this same code)."""
    rows, rn, rpb = 12, 11, 5
    rng = np.random.default_rng(3)
    planes = _planes(rng.standard_normal((rows, rn)).astype(np.float32), rpb)
    runs = [SketchRun(rows, rn, rpb, planes[:PLANES]), SketchRun(rows, rn, rpb, [planes[-1]], factors=planes[PLANES])]
    devs = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for run in runs:
        outs = []
        for dev in devs:
            b = torch.zeros(rows * rn, device=dev)
            d = run.delta(0, rows * rn, b)
            assert d.device.type == dev.type
            outs.append(d.cpu())
        assert all(torch.equal(outs[0], o) for o in outs)


@pytest.mark.parametrize(("rows", "rn", "rpb"), [(7, 5, 3), (40, 33, 6), (17, 64, 5), (300, 700, 7)])
def test_table_forms_equal_the_decoded_entries(rows, rn, rpb):
    """A trimmed gather is ``hardshrink`` of the decoded entries, and the group histogram counted
    from the value tables (no decode) is the one counted from the decoded entries, at every key
    present; its exact threshold is :func:`exact_shrink` of the decoded group's values."""
    rng = np.random.default_rng(rows + rn)
    delta = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    delta[rng.random((rows, rn)) < 0.1] = 0.0
    planes = _planes(delta, rpb)
    n = rows * rn
    cpu = torch.device("cpu")
    for k in range(1, PLANES + 1):
        run = SketchRun(rows, rn, rpb, planes[:k])
        b = torch.zeros(n)
        d = run.delta(0, n, b)
        counts = run.code_counts(cpu)
        assert counts.shape == (rows, 1 << k) and (counts.sum(axis=1) == rn).all()
        keys = magnitude_keys(d.numpy())
        for tau in sorted(set(keys[keys > 0].tolist()))[:12]:
            lo, nb = key_group_bits(tau)
            h = np.zeros(nb, dtype=np.int64)
            run.add_group_hist(h, lo, cpu)
            want = _dense_group_hist(d, tau)
            assert np.array_equal(h, want), (k, tau)
            group = np.abs(d.numpy())[keys == tau]
            assert h.sum() == len(group)
            for rank in {1, len(group) // 2 + 1, max(1, len(group) - 1)}:
                assert exact_shrink_hist(h, lo, rank) == exact_shrink(group, rank)
            lam = float(np.sort(np.abs(d.numpy()))[n // 2])
            for e0, e1 in [(0, n), (rn + 1, min(n, 5 * rn - 2))]:
                got = run.delta(e0, e1, b[e0:e1], shrink=lam)
                assert torch.equal(got, torch.nn.functional.hardshrink(d[e0:e1], lam))


def test_key_group_bits_are_exactly_the_key_group():
    """Every float32 in ``key_group_bits(τ)`` has key ``τ`` and its neighbours outside do not
    (even and odd keys: round-to-nearest-even includes both midpoints or neither)."""
    for tau in (1, 2, 0x3C00, 0x3C01, 0x3F7F, 0x7F7F):
        lo, nb = key_group_bits(tau)
        inside = np.array([lo, lo + 1, lo + nb // 2, lo + nb - 2, lo + nb - 1], dtype=np.uint32).view(np.float32)
        outside = np.array([lo - 1, lo + nb], dtype=np.uint32).view(np.float32)
        assert (magnitude_keys(inside) == tau).all(), tau
        assert (magnitude_keys(outside) != tau).all(), tau
    for bad in (0, 0x7F80):
        with pytest.raises(ValueError, match="no bounded float32 group"):
            key_group_bits(bad)


def test_exact_shrink_hist_equals_exact_shrink_on_random_groups():
    """The histogram select returns :func:`exact_shrink`'s ``λ`` bit for bit, ties included."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        tau = int(rng.integers(0x3000, 0x3F00))
        lo, nb = key_group_bits(tau)
        m = int(rng.integers(1, 300))
        spread = nb if trial % 2 else 4  # many exact ties when the group uses few bit patterns
        bits = lo + rng.integers(0, spread, size=m)
        g = bits.astype(np.uint32).view(np.float32)
        h = np.bincount(bits - lo, minlength=nb)
        for rank in {1, m // 2 + 1, max(1, m - 1), m, m + 1}:
            for all_below in (False, True):
                assert exact_shrink_hist(h, lo, rank, all_below) == exact_shrink(g, rank, all_below)


def test_group_hist_counts_exactly_the_group_bit_patterns():
    """The clamped bincount counts an entry iff its ``|δ|`` bit pattern is in ``[lo, lo + n)``: the
    patterns just outside, zeros, ±inf and NaN are not counted, in any tile split."""
    tau = int(magnitude_keys(np.array([0.01], dtype=np.float32))[0])
    lo, n = key_group_bits(tau)
    pats = np.array([lo - 1, lo, lo + 1, lo + n // 2, lo + n - 1, lo + n, 0, 0x7F800000, 0x7FC00000], dtype=np.int32)
    vals = np.concatenate([pats.view(np.float32), -pats.view(np.float32)])
    vals = np.concatenate([vals, np.zeros(5, np.float32)])
    want = np.zeros(n, dtype=np.int64)
    for p in pats:
        if lo <= p < lo + n:
            want[p - lo] += 2
    for split in (1, 4, len(vals)):
        g = _GroupHist(tau)
        for s in range(0, len(vals), split):
            g.add_dense(torch.from_numpy(vals[s : s + split]))
        assert np.array_equal(g.done(), want)
    assert _GroupHist(tau).done().sum() == 0


@pytest.mark.parametrize(("method", "params"), [("ties", {}), ("task_arithmetic", {}), ("linear", {"normalize": True})])
def test_zero_experts_left_out_of_a_tile_change_no_bit(monkeypatch, method, params):
    """The tiled merge leaves an expert out of a tile where its task vector is known to be zero
    (no run there, or sketched rows whose trimmed value tables are all zero): the output bytes
    equal those of the merge that combines every expert's zeros. The fixture makes both happen:
    expert 0 is exact on the first rows only, expert 1 one sign plane whose second half of rows
    has scales below the trim, expert 2 three planes on the last rows; tiles of 2 rows."""
    from mergepipe.engine import chunk
    from mergepipe.engine.reader import ChunkInputs
    from mergepipe.engine.worklist import WorkItem
    from mergepipe.methods.registry import get_method
    from mergepipe.planner.plan import TensorExpert, TensorPlan

    rows, rn, rpb = 40, 33, 6
    rng = np.random.default_rng(7)
    base = torch.from_numpy((rng.standard_normal((rows, rn)) * 0.02).astype(np.float32)).bfloat16()
    base.view(-1)[::11] = -0.0
    x0 = (base.float() + torch.from_numpy((rng.standard_normal((rows, rn)) * 0.01).astype(np.float32))).bfloat16()
    d1 = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    d1[rows // 2 :] *= 1e-3  # their one-plane scale |δ| is far below the trim below
    d2 = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    p1, p2 = _planes(d1, rpb), _planes(d2[18:], rpb)
    exps = [
        [((0, 12), x0[:12].contiguous().view(torch.uint8).numpy().tobytes())],
        [((0, rows), SketchRun(rows, rn, rpb, p1[:1]))],
        [((18, rows), SketchRun(rows - 18, rn, rpb, p2[:PLANES]))],
    ]
    min_key = int(magnitude_keys(np.array([0.004], dtype=np.float32))[0])
    spec = get_method(method)
    tes = [
        TensorExpert(expert=i, file="x", start=0, weight=w, density=0.5 if method == "ties" else 1.0, min_key=min_key,
                     blocks=[], bytes=0, kept_energy=1.0, full_energy=1.0)
        for i, w in enumerate([1.0, 0.5, 2.0])
    ]  # fmt: skip
    g = {p.name: p.default for p in spec.params if p.scope == "global" and p.default is not None}
    tp = TensorPlan(name="t", dtype="BF16", shape=[rows, rn], file="x", start=0, rows_per_block=rpb,
                    n_blocks=-(-rows // rpb), chunk_rows=rows, params={**g, **params}, weight_sum=3.5, experts=tes)  # fmt: skip
    it = WorkItem("merge", tp, 0, rows, 0)
    monkeypatch.setattr(chunk, "TILE_ELEMS", 2 * rn)
    calls = []
    real = SketchRun.zero_rows

    def spy(self, r0, r1, dev, shrink):
        calls.append(out := real(self, r0, r1, dev, shrink))
        return out

    monkeypatch.setattr(SketchRun, "zero_rows", spy)

    def merged() -> bytes:
        inputs = ChunkInputs(base.view(torch.uint8).numpy().tobytes(), exps)
        return bytes(chunk.merge_chunk(it, inputs, None, spec, torch.device("cpu"), chunk.L1Sums()))  # type: ignore[arg-type]

    skipping = merged()
    if method == "ties":
        assert any(calls) and not all(calls)  # some tiles of expert 1 are left out, some not
    monkeypatch.setattr(type(spec), "zero_delta_droppable", lambda self, g: False)
    assert merged() == skipping
