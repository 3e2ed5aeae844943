"""The fused CPU kernels (mergepipe/methods/kernels_cpu.py) against the torch formulation they
replace, bit for bit: each kernel on random tiles and edge cases (all-zero experts, one expert,
ties that cancel, trimmed rows, subnormals, signed zeros, NaN/inf, lengths that are not a multiple
of the vector width), and the engine's tiled merge with the kernels against the same merge with
``MERGEPIPE_KERNELS=torch`` (the path a CUDA device runs) for TIES, task arithmetic and DARE-TIES
over exact, sign-plane and rank-1 runs."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from mergepipe.catalog.sketch import PLANES, encode_block
from mergepipe.engine.sketchkernel import SketchRun
from mergepipe.methods import kernels_cpu
from mergepipe.methods.kernels import task_arithmetic_combine
from mergepipe.numerics import magnitude_keys


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.delenv("MERGEPIPE_KERNELS", raising=False)
    if not kernels_cpu.available():
        if os.environ.get("CI"):
            pytest.fail(f"fused CPU kernels unavailable in CI: {kernels_cpu.unavailable_reason()}")
        pytest.skip(f"fused CPU kernels unavailable: {kernels_cpu.unavailable_reason()}")


def _bits(x) -> np.ndarray:
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _tile(rng, k: int, n: int, zero_rows=(), density=0.5) -> np.ndarray:
    """float32 (k, n + 5) task vectors (the padding past n must not be read): normal draws,
    trimmed to ``density``, some exact cancellations, subnormals and signed zeros."""
    d = (rng.standard_normal((k, n + 5)) * 0.01).astype(np.float32)
    d[rng.random(d.shape) > density] = 0.0
    d[:, 3::17] = -0.0
    if k > 1:
        d[1, 5::13] = -d[0, 5::13]  # election sums that cancel exactly
    d[:, 7::29] = np.float32(1e-42)  # subnormal
    for r in zero_rows:
        d[r] = 0.0
    return d


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 4099])
@pytest.mark.parametrize(
    ("normalize", "lam", "weights"), [(True, 1.0, "ones"), (True, 0.7, "mixed"), (False, 1.0, "mixed")]
)
def test_combine_sum_equals_torch_ties(k, n, normalize, lam, weights):
    rng = np.random.default_rng(k * 1000 + n)
    d = _tile(rng, k, n, zero_rows=(k - 1,) if k > 2 else ())
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    base[::9] = -0.0
    ws = [1.0] * k if weights == "ones" else [float(x) for x in rng.choice([1.0, 0.5, 2.0, 0.3], size=k)]
    g = {"normalize": normalize, "lambda": lam}
    want = task_arithmetic_combine(
        torch.from_numpy(base), [torch.from_numpy(d[i, :n].copy()) for i in range(k)], ws, g, "sum"
    )
    out = np.full(n, np.nan, dtype=np.float32)
    assert kernels_cpu.combine_sum(out, base, d, k, n, ws, normalize, lam)
    assert np.array_equal(_bits(out), _bits(want))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_combine_sum_refuses_a_non_finite_tile(bad):
    """A NaN or ±inf election sum anywhere (also in the scalar tail) is left to the torch path."""
    rng = np.random.default_rng(3)
    for pos in (0, 37, 1001):  # (1001: in the scalar tail, 1003 = 62·16 + 11)
        d = _tile(rng, 3, 1003)
        d[1, pos] = bad
        out = np.empty(1003, dtype=np.float32)
        assert not kernels_cpu.combine_sum(out, np.zeros(1003, np.float32), d, 3, 1003, [1.0] * 3, True, 1.0)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize(("normalize", "lam"), [(True, 1.0), (False, 0.6), (True, 1.3)])
def test_combine_plain_equals_torch_task_arithmetic(k, normalize, lam):
    rng = np.random.default_rng(k)
    n = 2051
    d = _tile(rng, k, n, density=0.8)
    d[0, 11] = np.nan  # no consensus: NaN and inf pass through as in torch
    d[-1, 12] = np.inf
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    base[::7] = -0.0
    ws = [float(x) for x in rng.choice([1.0, 0.5, 2.0], size=k)]
    wsum = sum(ws) + 1.0  # an expert without a block in this chunk still counts
    g = {"normalize": normalize, "lambda": lam}
    want = task_arithmetic_combine(
        torch.from_numpy(base), [torch.from_numpy(d[i, :n].copy()) for i in range(k)], ws, g, None, weight_sum=wsum
    )
    out = np.empty(n, dtype=np.float32)
    kernels_cpu.combine_plain(out, base, d, k, n, ws, wsum if normalize else None, lam)
    assert np.array_equal(_bits(out), _bits(want))


def test_trim_scale_equals_hardshrink_times_factor():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1037) * 0.01).astype(np.float32)
    lam = float(np.float32(0.008))
    x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, lam, -lam, np.nextafter(np.float32(lam), np.float32(1))]
    for trim, f in [(lam, 1.0), (lam, 1.7), (None, 0.4), (None, 1.0)]:
        t = torch.from_numpy(x.copy())
        want = torch.nn.functional.hardshrink(t, trim) if trim is not None else t
        want = want * f if f != 1.0 else want
        got = x.copy()
        kernels_cpu.trim_scale(got, trim, f)
        assert np.array_equal(_bits(got), _bits(want))


def _sections(delta: np.ndarray, rpb: int) -> list[bytes]:
    secs: list[list[bytes]] = []
    for r in range(0, delta.shape[0], rpb):
        parts, _ = encode_block(delta[r : r + rpb])
        secs = secs or [[] for _ in parts]
        for p, b in enumerate(parts):
            secs[p].append(b)
    return [b"".join(s) for s in secs]


@pytest.mark.parametrize(("rows", "rn", "rpb"), [(20, 33, 6), (9, 8, 9), (50, 5, 7)])
def test_run_decode_equals_sketchrun_delta(rows, rn, rpb):
    """gather_rows (sign planes, table trimmed and scaled) and rank1_rows (rank-1 tier) on any
    element range equal SketchRun.delta trimmed by hardshrink and times the factor."""
    rng = np.random.default_rng(rows)
    delta = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    delta[rows // 2] = 0.0  # a row whose trimmed table is all zeros
    secs = _sections(delta, rpb)
    dev = torch.device("cpu")
    runs = [SketchRun(rows, rn, rpb, secs[:k]) for k in range(1, PLANES + 1)]
    runs.append(SketchRun(rows, rn, rpb, [secs[PLANES + 1]], factors=secs[PLANES]))
    lam = float(np.float32(np.median(np.abs(delta))))
    n = rows * rn
    b = torch.zeros(n)
    for run in runs:
        for trim, f in [(None, 1.0), (lam, 1.0), (lam, 1.37)]:
            for e0, e1 in [(0, n), (rn + 3, n - 2), (n - 1, n)]:
                want = run.delta(e0, e1, b[e0:e1], trim)
                want = want * f if f != 1.0 else want
                got = np.full(e1 - e0, np.nan, dtype=np.float32)
                codes, table, u, v = run.host_arrays(dev, trim, f)
                if u is None:
                    kernels_cpu.gather_rows(got, codes, table, e0, e1, rn)
                else:
                    kernels_cpu.rank1_rows(got, codes, table, u, v, rpb, e0, e1, rn, trim, f)
                assert np.array_equal(_bits(got), _bits(want)), (len(run.planes), run.factors is not None, trim, f)


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("ties", {}),
        ("ties", {"normalize": False, "lambda": 0.8}),
        ("task_arithmetic", {"normalize": True}),
        ("task_arithmetic", {}),
        ("dare_ties", {"rescale": True}),
    ],
)
def test_engine_tiles_fused_equal_torch(monkeypatch, method, params):
    """merge_chunk with the fused kernels gives the bytes of the torch path over a chunk mixing
    an exact partial run (the rest of its rows count as zero), sign-plane runs of 1 and 3 planes
    (one with rows trimmed to zero), a rank-1 run, an expert with no run at all, and one expert
    whose task vector has an inf (its tiles fall back to the torch combine for TIES); tiles of
    3 rows, so runs start and end inside tiles."""
    from mergepipe.engine import chunk
    from mergepipe.engine.reader import ChunkInputs
    from mergepipe.engine.worklist import WorkItem
    from mergepipe.methods.registry import get_method
    from mergepipe.planner.plan import TensorExpert, TensorPlan

    rows, rn, rpb = 42, 37, 6
    rng = np.random.default_rng(11)
    base = torch.from_numpy((rng.standard_normal((rows, rn)) * 0.02).astype(np.float32)).bfloat16()
    base.view(-1)[::13] = -0.0

    def noise(scale=0.01):
        return (rng.standard_normal((rows, rn)) * scale).astype(np.float32)

    x0 = (base.float() + torch.from_numpy(noise())).bfloat16()
    x5 = (base.float() + torch.from_numpy(noise())).bfloat16()
    x5.view(-1)[rn * 30 + 4] = float("inf")
    d1, d2, d3 = noise(), noise(), noise()
    d1[rows // 2 :] *= 1e-3
    s1, s2, s3 = _sections(d1, rpb), _sections(d2[12:], rpb), _sections(d3, rpb)
    exps = [
        [((5, 17), x0[5:17].contiguous().view(torch.uint8).numpy().tobytes())],
        [((0, rows), SketchRun(rows, rn, rpb, s1[:1]))],
        [((12, rows), SketchRun(rows - 12, rn, rpb, s2[:PLANES]))],
        [((0, rows), SketchRun(rows, rn, rpb, [s3[PLANES + 1]], factors=s3[PLANES]))],
        [],
        [((24, 36), x5[24:36].contiguous().view(torch.uint8).numpy().tobytes())],
    ]
    min_key = int(magnitude_keys(np.array([0.004], dtype=np.float32))[0])
    spec = get_method(method)
    weights = [1.0, 0.5, 2.0, 1.0, 0.7, 1.5]
    dens = 1.0 if method == "task_arithmetic" else 0.5
    tes = [
        TensorExpert(expert=i, file="x", start=0, weight=w, density=dens, min_key=min_key, stream_key=17 + i,
                     blocks=[], bytes=0, kept_energy=1.0, full_energy=1.0)
        for i, w in enumerate(weights)
    ]  # fmt: skip
    g = {p.name: p.default for p in spec.params if p.scope == "global" and p.default is not None}
    tp = TensorPlan(name="t", dtype="BF16", shape=[rows, rn], file="x", start=0, rows_per_block=rpb,
                    n_blocks=-(-rows // rpb), chunk_rows=rows, params={**g, **params}, weight_sum=sum(weights),
                    experts=tes)  # fmt: skip
    it = WorkItem("merge", tp, 0, rows, 0)
    monkeypatch.setattr(chunk, "TILE_ELEMS", 3 * rn)
    used = []
    real = chunk._fused_output
    monkeypatch.setattr(chunk, "_fused_output", lambda *a: used.append(1) or real(*a))

    def merged() -> bytes:
        inputs = ChunkInputs(base.view(torch.uint8).numpy().tobytes(), exps)
        return bytes(chunk.merge_chunk(it, inputs, None, spec, torch.device("cpu"), chunk.L1Sums()))  # type: ignore[arg-type]

    fused = merged()
    assert used, "the fused kernels did not run"
    monkeypatch.setenv("MERGEPIPE_KERNELS", "torch")
    used.clear()
    assert merged() == fused
    assert not used


def test_rank1_group_hist_fused_equals_decoded(monkeypatch):
    """The exact-threshold histogram of a rank-1 run counted by rank1_hist (decode and count in one
    pass) equals the histogram of the decoded entries, on key groups across the run's range."""
    from mergepipe.engine.chunk import _dense_group_hist, _GroupHist

    rows, rn, rpb = 30, 21, 8
    rng = np.random.default_rng(9)
    delta = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    secs = _sections(delta, rpb)
    run = SketchRun(rows, rn, rpb, [secs[PLANES + 1]], factors=secs[PLANES])
    cpu = torch.device("cpu")
    decoded = run.delta(0, rows * rn, torch.zeros(rows * rn))
    keys = magnitude_keys(decoded.numpy())
    groups = sorted(set(keys[keys > 0].tolist()))
    for tau in groups[:2] + groups[len(groups) // 2 : len(groups) // 2 + 2] + groups[-2:]:
        want = _dense_group_hist(decoded, tau)
        assert want.sum() > 0
        for env in ("", "torch"):
            monkeypatch.setenv("MERGEPIPE_KERNELS", env)
            g = _GroupHist(tau)
            g.add_run(run, cpu)
            assert np.array_equal(g.done(), want)


@pytest.mark.parametrize(("rows", "rn", "rpb"), [(20, 33, 6), (16, 8, 4), (7, 5, 3), (1, 1, 1)])
def test_sign_codes_fused_equal_torch(monkeypatch, rows, rn, rpb):
    """build_codes gives every entry the code SketchRun's torch assembly gives it, for 1 to 3
    planes and blocks that end inside a byte (padding bits) or on one."""
    rng = np.random.default_rng(rows * rn)
    secs = _sections((rng.standard_normal((rows, rn)) * 0.01).astype(np.float32), rpb)
    cpu = torch.device("cpu")
    for k in range(1, PLANES + 1):
        fused = SketchRun(rows, rn, rpb, secs[:k])._prepared(cpu).codes
        monkeypatch.setenv("MERGEPIPE_KERNELS", "torch")
        want = SketchRun(rows, rn, rpb, secs[:k])._prepared(cpu).codes
        monkeypatch.delenv("MERGEPIPE_KERNELS")
        assert torch.equal(fused, want) and int(want.max()) < (1 << k)


def test_exact_bf16_equals_widen_subtract_trim_scale():
    """exact_bf16 is torch's ``hardshrink(x.float() − b, λ) · f`` for bf16 ``x``: NaN, ±inf, ±0
    and values at the trim included."""
    rng = np.random.default_rng(8)
    n = 1029
    b = (rng.standard_normal(n) * 0.02).astype(np.float32)
    x = (torch.from_numpy(b) + torch.from_numpy((rng.standard_normal(n) * 0.01).astype(np.float32))).bfloat16()
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
    b[3:5] = [-0.0, 0.0]
    d = x.float() - torch.from_numpy(b)
    lam = float(d.abs().median())
    b[6] = float(x[6].float()) - lam  # a task vector on the trim (up to rounding)
    d = x.float() - torch.from_numpy(b)
    for trim, f in [(lam, 1.0), (lam, 0.6), (None, 1.0), (None, 1.9)]:
        want = torch.nn.functional.hardshrink(d, trim) if trim is not None else d
        want = want * f if f != 1.0 else want
        got = np.full(n, np.nan, dtype=np.float32)
        kernels_cpu.exact_bf16(got, x.view(torch.int16).numpy(), b, trim, f)
        assert np.array_equal(_bits(got), _bits(want))


def test_kernels_load_from_the_cache_without_a_compiler_and_fall_back_without_either(monkeypatch, tmp_path):
    """A library compiled once into MERGEPIPE_KERNEL_CACHE loads with no compiler on PATH (an
    image built with one); with neither, available() is False with a reason naming the cache,
    and the engine runs the torch path. Real compiles with the system cc, into temporary dirs."""
    monkeypatch.setattr(kernels_cpu.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))

    def fresh(cache: str, cc: str | None) -> bool:
        monkeypatch.setenv("MERGEPIPE_KERNEL_CACHE", cache)
        if cc is None:
            monkeypatch.delenv("CC", raising=False)
        else:
            monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(kernels_cpu, "_TRIED", False)
        monkeypatch.setattr(kernels_cpu, "_LIB", None)
        return kernels_cpu.available()

    built = tmp_path / "built"
    assert fresh(str(built), None)
    assert len(list(built.glob("tile-*.so"))) == 1
    assert fresh(str(built), "no-such-cc-anywhere")  # loaded from the cache, no compile
    out = np.array([1.0, -0.5, 0.1], np.float32)
    kernels_cpu.trim_scale(out, 0.2, 2.0)
    assert out.tolist() == [2.0, -1.0, 0.0]
    assert not fresh(str(tmp_path / "empty"), "no-such-cc-anywhere")
    assert "no-such-cc-anywhere" in kernels_cpu.unavailable_reason()
    assert str(tmp_path / "empty") in kernels_cpu.unavailable_reason()


def test_a_cached_library_others_could_write_is_not_loaded(monkeypatch, tmp_path):
    """Loading a library runs its code and the fallback cache path is predictable (/tmp): a
    library in a directory writable by group/others, a writable file, or a symbolic link is
    refused with a reason naming the path, and the engine runs the torch path."""
    monkeypatch.setattr(kernels_cpu.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.delenv("CC", raising=False)
    cache = tmp_path / "cache"

    def fresh() -> bool:
        monkeypatch.setenv("MERGEPIPE_KERNEL_CACHE", str(cache))
        monkeypatch.setattr(kernels_cpu, "_TRIED", False)
        monkeypatch.setattr(kernels_cpu, "_LIB", None)
        return kernels_cpu.available()

    assert fresh()
    (lib,) = cache.glob("tile-*.so")
    assert stat.S_IMODE(lib.stat().st_mode) == 0o755
    cache.chmod(0o777)
    assert not fresh()
    assert str(cache) in kernels_cpu.unavailable_reason() and "777" in kernels_cpu.unavailable_reason()
    cache.chmod(0o700)
    lib.chmod(0o766)
    assert not fresh()
    assert str(lib) in kernels_cpu.unavailable_reason()
    lib.chmod(0o755)
    assert fresh()
    real = tmp_path / "elsewhere.so"
    lib.rename(real)
    lib.symlink_to(real)
    assert not fresh()
    assert "not a regular file" in kernels_cpu.unavailable_reason()


def test_fused_kernels_refuse_arguments_that_would_index_out_of_bounds():
    """Sizes reach the C kernels from stored statistics and sketch blobs (untrusted): a short
    array, a wrong dtype or a non-contiguous view raises ValueError naming the argument before
    any pointer is passed (the C code would read or write past the end)."""
    if not kernels_cpu.available():
        pytest.skip(kernels_cpu.unavailable_reason())
    rn, rows = 16, 4
    codes = np.zeros(rows * rn, np.uint8)
    table = np.zeros((rows, 8), np.float32)
    out = np.zeros(rows * rn, np.float32)
    kernels_cpu.gather_rows(out, codes, table, 0, rows * rn, rn)  # the right sizes run
    cases = [
        lambda: kernels_cpu.gather_rows(out, codes[:-1], table, 0, rows * rn, rn),
        lambda: kernels_cpu.gather_rows(out, codes, table[:-1], 0, rows * rn, rn),
        lambda: kernels_cpu.gather_rows(out[:-1], codes, table, 0, rows * rn, rn),
        lambda: kernels_cpu.gather_rows(out, codes, table.astype(np.float64), 0, rows * rn, rn),
        lambda: kernels_cpu.gather_rows(out, codes, np.zeros((rows, 16), np.float32)[:, ::2], 0, 64, rn),
        lambda: kernels_cpu.rank1_rows(out, codes, table[:, :2].copy(), np.zeros(rows - 1, np.float32),
                                       np.zeros((1, rn), np.float32), rows, 0, rows * rn, rn, None, 1.0),
        lambda: kernels_cpu.rank1_hist(np.zeros(8, np.int64), codes, table[:, :2].copy(),
                                       np.zeros(rows, np.float32), np.zeros((1, rn - 1), np.float32), rows, rows, rn, 0),
        lambda: kernels_cpu.exact_bf16(out, np.zeros(rows * rn - 1, np.uint16), np.zeros(rows * rn, np.float32), None, 1.0),
        lambda: kernels_cpu.combine_sum(out, out.copy(), np.zeros((2, 10), np.float32), 2, 64, [1.0, 1.0], False, 1.0),
        lambda: kernels_cpu.combine_plain(out, out.copy(), np.zeros((2, 64), np.float32), 3, 64, [1.0] * 3, None, 1.0),
        lambda: kernels_cpu.build_codes(np.zeros(64, np.uint8), [np.zeros(7, np.uint8)], [(0, 64)]),
    ]  # fmt: skip
    for case in cases:
        with pytest.raises(ValueError, match="fused kernel"):
            case()
