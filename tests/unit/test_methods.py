"""Each method, executed block-wise by the streaming engine at unlimited budget, equals the dense
whole-tensor reference implementation bit for bit; and the kernels' primitives match torch."""

import numpy as np
import pytest
import torch

from mergepipe.catalog.catalog import Catalog
from mergepipe.methods.params import resolve_params
from mergepipe.methods.registry import METHODS
from mergepipe.numerics import dare_keep_mask, histogram, magnitude_keys, trim_min_key
from mergepipe.pipeline import merge
from testkit.dense_reference import merge_checkpoint_dense, reference_min_key
from testkit.harness import merged_tensors, same_bits

CASES = [
    ("linear", []),
    ("linear", ["normalize=false", "weight=0.4"]),
    ("task_arithmetic", ["lambda=0.7", "expert1:weight=-0.5"]),
    ("task_arithmetic", ["normalize=true"]),
    ("ties", ["density=0.5"]),
    ("ties", ["density=0.2", "expert0:density=0.7", "expert2:weight=0.3", "lambda=1.3"]),
    ("ties", ["density=0.5", "normalize=false", "rescale=true"]),
    ("dare_ties", ["density=0.5"]),
    ("dare_ties", ["density=0.3", "rescale=false", "normalize=true"]),
    ("dare_linear", ["density=0.4", "expert1:density=0.9"]),
    # methods added with mergekit's names and defaults
    ("breadcrumbs", ["density=0.5"]),
    ("breadcrumbs", ["density=0.3", "gamma=0.05", "expert1:weight=0.6", "rescale=true"]),
    ("breadcrumbs_ties", ["density=0.6", "expert2:gamma=0.02", "normalize=true"]),
    ("della", ["density=0.5"]),
    ("della", ["density=0.4", "epsilon=0.1", "rescale=false", "expert0:density=0.7"]),
    ("della_linear", ["density=0.5", "lambda=1.2"]),
    ("model_stock", []),
    ("model_stock", ["filter_wise=true"]),
    ("slerp", ["t=0.3"], 1),
    ("slerp", ["t=1"], 1),
    ("nuslerp", [], 2),
    ("nuslerp", ["expert1:weight=3", "nuslerp_flatten=false"], 2),
    # layer-wise parameters: gradients and filter lists, per expert and merge-wide
    ("ties", ["density=[0.2,0.9]", 'expert0:weight=[{"filter":"mlp","value":0.5},{"value":1.5}]']),
    ("dare_linear", ['density=[{"filter":"self_attn","value":[0.3,0.8]},{"value":0.6}]', "expert1:weight=[1,0.2]"]),
    ("della", ["density=[0.3,0.6]", 'epsilon=[{"filter":"mlp","value":0.05}]']),
    ("slerp", ["t=[0.1,0.9]"], 1),
    ("task_arithmetic", ['lambda=[{"filter":"lm_head","value":0.5},{"value":[1,2]}]']),
]
CASES = [c if len(c) == 3 else (*c, 3) for c in CASES]
IDS = [f"{m}-{n}-{'-'.join(p) or 'default'}" for m, p, n in CASES]


def _resolved(method, params, names):
    from mergepipe.request import parse_param_args

    g, per = parse_param_args(params, method, names)
    return resolve_params(method, g, per)


@pytest.mark.parametrize("method,params,n", CASES, ids=IDS)
def test_engine_equals_dense_reference(family, tmp_path, method, params, n):
    base, experts = family
    experts = experts[:n]
    names = [e.name for e in experts]
    res = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        method,
        str(tmp_path / "out"),
        params,
        catalog=Catalog(tmp_path / "c.sqlite"),
        seed=7,
    )
    got = merged_tensors(res.out)
    ref = merge_checkpoint_dense(str(base), [str(e) for e in experts], _resolved(method, params, names), seed=7)
    assert set(got) == set(ref)
    bad = [n for n in ref if not same_bits(got[n], ref[n])]
    assert not bad, f"{len(bad)} tensors differ from the dense reference, e.g. {bad[:3]}"
    # the merge really changed the model (the test would catch a no-op engine)
    from testkit.harness import merged_tensors as mt

    b = mt(base)
    assert any(not same_bits(got[n], b[n]) for n in b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_other_dtypes_equal_reference(tmp_path, dtype):
    """bf16/float16/float32 TIES and breadcrumbs trim by exact ranks of the stored magnitudes: the engine (threshold
    group from the key histogram, float32 threshold inside it; in one chunk, or with a pre-pass
    over many chunks, with and without the L1 rescale pre-pass) equals the dense sort."""
    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "m", 2, seed=3, dtype=dtype)
    n_exact = 0
    for i, (method, params, work) in enumerate(
        [
            ("ties", ["density=0.4"], None),
            ("dare_ties", ["density=0.5"], None),
            ("ties", ["density=0.3", "expert1:density=0.6"], 16 * 1024),
            ("ties", ["density=0.5", "rescale=true"], 16 * 1024),
            ("ties", ["density=0.5", "rescale=true"], None),
            ("breadcrumbs", ["density=0.5", "gamma=0.05"], None),
            ("breadcrumbs_ties", ["density=0.6", "gamma=0.02", "rescale=true"], 16 * 1024),
        ]
    ):
        kw = {"work_bytes": work, "block_bytes": 1024} if work else {}
        res = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            method,
            str(tmp_path / f"out-{i}"),
            params,
            catalog=Catalog(tmp_path / "c.sqlite"),
            **kw,
        )
        got = merged_tensors(res.out)
        ref = merge_checkpoint_dense(
            str(base), [str(e) for e in experts], _resolved(method, params, [e.name for e in experts])
        )
        bad = [n for n in ref if not same_bits(got[n], ref[n])]
        assert not bad, (method, params, work, bad[:3])
        exact = [te for tp in res.plan.tensors for te in tp.experts if te.exact_rank or te.exact_rank_hi]
        n_exact += len(exact)
        if method.startswith("breadcrumbs"):  # both window ends are refined somewhere
            assert any(te.exact_rank for te in exact) and any(te.exact_rank_hi for te in exact)
        if work:  # several chunks: the threshold pre-pass is planned and counted
            assert any(
                tp.passes == (3 if "rescale=true" in params else 2) and tp.derived.get("threshold_pass")
                for tp in res.plan.tensors
            )
    assert n_exact > 0  # the key rule would have cut threshold groups here


def test_exact_trim_keeps_exactly_k_unless_values_are_equal():
    """reference_topk_mask and the engine's rule: exactly k entries of float32 magnitudes without
    equal values; equal values are kept or dropped together (canonical tie rule)."""
    import numpy as np

    from mergepipe.numerics import exact_shrink, histogram, magnitude_keys, trim_rank
    from testkit.dense_reference import reference_topk_mask

    g = torch.Generator().manual_seed(0)
    d = torch.randn(100_000, generator=g) * 1e-3
    for dens in (0.1, 0.37, 0.5, 0.9):
        m = reference_topk_mask(d, dens)
        assert int(m.sum()) == int(dens * d.numel())
        keys = magnitude_keys(d.numpy())
        tau, rank, ties = trim_rank(*histogram(keys), d.numel(), dens)
        assert 1 <= rank < ties  # the key rule would keep or drop a whole group here
        lam = exact_shrink(np.abs(d.numpy())[keys == tau], rank)
        assert torch.equal(torch.nn.functional.hardshrink(d, lam) != 0, m)
    # equal values: 4 entries of the same magnitude straddle k = 5 of 10 -> A = 3, T = 4: keep all 4 (7 kept)
    # since |7 - 5| = 2 > |3 - 5| = 2 is false (a tie in distance keeps them)
    v = torch.tensor([9.0, 8.0, 7.0, 5.0, -5.0, 5.0, 5.0, 1.0, 0.5, 0.25])
    assert int(reference_topk_mask(v, 0.5).sum()) == 7
    assert int(reference_topk_mask(v, 0.4).sum()) == 3  # k = 4: |7-4| = 3 > |3-4| = 1: drop the group


CHUNKED = [
    ("dare_ties", ["density=0.4"], 3),
    ("ties", ["density=0.5", "rescale=true"], 3),
    ("task_arithmetic", [], 3),
    ("breadcrumbs_ties", ["density=0.5", "rescale=true"], 3),
    ("della", ["density=0.5", "expert1:density=[0.3,0.7]"], 3),
    ("model_stock", [], 3),
    ("model_stock", ["filter_wise=true"], 3),
    ("slerp", ["t=[0.2,0.7]"], 1),
    ("nuslerp", ["nuslerp_flatten=false"], 2),
    ("nuslerp", ["expert1:weight=0.25"], 2),
]


@pytest.mark.parametrize("method,params,n", CHUNKED, ids=[f"{m}-{'-'.join(p) or 'default'}" for m, p, _ in CHUNKED])
def test_chunked_and_two_pass_execution_equal_reference(family, tmp_path, method, params, n):
    """A tiny working-memory target forces many chunks per tensor and the L1-rescale pre-pass."""
    base, experts = family
    experts = experts[:n]
    cat = Catalog(tmp_path / "c.sqlite")
    res = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        method,
        str(tmp_path / f"o-{method}"),
        params,
        catalog=cat,
        block_bytes=4096,
        work_bytes=64 * 1024,
        seed=3,
    )
    plan = res.plan
    assert any(t.chunk_rows < t.shape[0] for t in plan.tensors if not t.copy_base)
    if "rescale=true" in params or method in ("dare_ties", "della"):
        # (bf16 TIES/breadcrumbs: the exact threshold's pre-pass too, before the L1 sums')
        assert any(t.passes == (3 if method in ("ties", "breadcrumbs_ties") else 2) for t in plan.tensors)
    got = merged_tensors(res.out)
    ref = merge_checkpoint_dense(
        str(base), [str(e) for e in experts], _resolved(method, params, [e.name for e in experts]), seed=3
    )
    assert all(same_bits(got[n], ref[n]) for n in ref)
    # realized reads include the pre-pass (all but the first chunk) and equal the plan
    m = res.manifest["io"]
    assert m["realized"]["expert_read_bytes"] == m["estimated"]["expert_read_bytes"]
    assert m["realized"]["base_read_bytes"] == m["estimated"]["base_read_bytes"]


def test_magnitude_keys_match_torch_bf16_rounding():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 5, 100_000),
            np.array([0.0, -0.0, 1e-45, 3.4e38, 65504.0], dtype=np.float32),
        ]
    )
    ours = magnitude_keys(x)
    theirs = torch.from_numpy(x).abs().to(torch.bfloat16).view(torch.int16).to(torch.int32).numpy()
    np.testing.assert_array_equal(ours, np.minimum(theirs, 0x7F80))
    assert np.all(np.diff(ours[np.argsort(np.abs(x))]) >= 0), "keys must be monotone in |x|"


@pytest.mark.parametrize("density", [0.01, 0.1, 0.37, 0.5, 0.9, 0.999])
def test_trim_threshold_from_histogram_equals_sort(density):
    rng = np.random.default_rng(int(density * 1000))
    # bf16-quantized deltas tie massively, like real task vectors
    d = (rng.standard_normal(50_000) * 1e-3).astype(np.float32)
    d = torch.from_numpy(d).to(torch.bfloat16).float()
    keys = magnitude_keys(d.numpy())
    k, c = histogram(keys)
    assert trim_min_key(k, c, keys.size, density) == reference_min_key(d)(density)
    mk = trim_min_key(k, c, keys.size, density)
    kept = int((keys >= mk).sum())
    target = max(1, int(density * keys.size))
    tau = int(np.sort(keys)[::-1][target - 1])  # the k-th largest key
    above, with_ties = int((keys > tau).sum()), int((keys >= tau).sum())
    # canonical tie rule: keep all ties or none, whichever lands nearer k (ties -> keep)
    assert kept in (above, with_ties)
    assert abs(kept - target) == min(abs(above - target), abs(with_ties - target))


def test_cached_trims_of_tensor_stats_equal_the_histogram_rules():
    """TensorStats.min_key (derived from its cached trim_rank, the sorted histogram built once)
    equals numerics.trim_min_key and trim_rank on the raw histogram: ascending keys (as recorded),
    unsorted ones, zeros among the keys, every density from none to all, twice (the cache)."""
    from mergepipe.catalog.stats import TensorStats
    from mergepipe.numerics import trim_rank

    rng = np.random.default_rng(5)
    for trial in range(200):
        m = int(rng.integers(1, 60))
        keys = np.sort(
            rng.choice(np.arange(0, 400 if trial % 3 else 3), size=min(m, 400 if trial % 3 else 3), replace=False)
        )
        counts = rng.integers(1, 50 if trial % 2 else 3, size=len(keys)).astype(np.int64)
        if trial % 5 == 0:
            perm = rng.permutation(len(keys))
            keys, counts = keys[perm], counts[perm]
        numel = int(counts.sum())
        st = TensorStats(
            "t",
            numel,
            1,
            np.ones(1, np.int64),
            np.ones(1),
            np.ones(1),
            np.ones(1, np.float32),
            0,
            np.ones((1, 1), np.int64),
            np.ones((1, 1)),
            keys.astype(np.int32),
            counts,
        )
        for d in (*rng.random(6).tolist(), 1e-9, 1.0, 1.0 - 1e-12, 1 / numel, 0.5):
            for _ in range(2):
                assert st.min_key(d) == trim_min_key(keys, counts, numel, d), (keys, counts, d)
                assert st.trim_rank(d) == trim_rank(keys, counts, numel, d)


def test_dare_mask_is_counter_based():
    key = 1234567
    whole = dare_keep_mask(key, 0, 10_000, 0.3)
    parts = np.concatenate([dare_keep_mask(key, s, min(777, 10_000 - s), 0.3) for s in range(0, 10_000, 777)])
    np.testing.assert_array_equal(whole, parts)
    assert abs(whole.mean() - 0.3) < 0.02
    assert not np.array_equal(whole, dare_keep_mask(key + 1, 0, 10_000, 0.3))


def test_registry_names_and_defaults():
    assert {"linear", "task_arithmetic", "ties", "dare_ties", "dare_linear"} <= set(METHODS)
    r = resolve_params("ties", {}, [{}])
    assert r.globals["normalize"] is True and r.globals["rescale"] is False
    r = resolve_params("dare_ties", {}, [{}])
    assert r.globals["rescale"] is True and r.globals["normalize"] is False
    assert r.experts[0] == {"weight": 1.0, "density": 1.0}


def test_new_methods_registered_with_mergekit_defaults():
    from mergepipe.methods.registry import get_method

    for m in ("breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "model_stock", "slerp", "nuslerp"):
        assert m in METHODS
    assert resolve_params("breadcrumbs", {}, [{}]).experts[0]["gamma"] == 0.01
    r = resolve_params("della", {}, [{}])
    assert r.experts[0]["epsilon"] == 0.15 and r.globals["normalize"] is True and r.globals["rescale"] is True
    r = resolve_params("della_linear", {}, [{}])
    assert r.globals["normalize"] is False and r.globals["rescale"] is True
    r = resolve_params("breadcrumbs_ties", {}, [{}])
    assert r.globals["normalize"] is False and r.globals["rescale"] is False
    assert resolve_params("model_stock", {}, [{}, {}]).globals == {"filter_wise": False}
    r = resolve_params("nuslerp", {}, [{}, {}])
    assert r.globals == {"nuslerp_flatten": True, "nuslerp_row_wise": False}
    assert get_method("slerp").max_experts == 1 and get_method("nuslerp").min_experts == 2


@pytest.mark.parametrize(
    "density,gamma", [(0.5, 0.01), (0.9, 0.05), (0.2, 0.0), (0.99, 0.02), (0.3, 0.9), (1e-5, 0.01), (0.7, 0.3)]
)
def test_breadcrumbs_window_from_histogram_equals_sort(density, gamma):
    from mergepipe.numerics import outlier_window
    from testkit.dense_reference import reference_outlier_window

    rng = np.random.default_rng(int(density * 1000 + gamma * 100))
    d = torch.from_numpy((rng.standard_normal(40_000) * 1e-3).astype(np.float32)).to(torch.bfloat16).float()
    d[:500] = 0.0  # exact zeros, as in untouched parameters
    keys = magnitude_keys(d.numpy())
    k, c = histogram(keys)
    lo, hi = outlier_window(k, c, keys.size, density, gamma)
    assert (lo, hi) == reference_outlier_window(d, density, gamma)
    n = keys.size
    target = int(density * n)
    kept = int(((keys >= lo) & (keys < hi)).sum())
    if target == 0:
        assert kept == 0
    else:  # each end is off by at most the ties at its boundary key
        slack = int((keys == min(lo, 0x7F80)).sum()) + int((keys == max(hi - 1, 0)).sum())
        assert abs(kept - target) <= slack
        assert lo < hi


def test_della_probabilities_follow_mergekit():
    """With distinct magnitudes (no ties) the ranks are mergekit's argsort ranks, so the keep
    probabilities equal mergekit 0.1.5's float32 formula bit for bit; the mask keeps ~density."""
    from mergepipe.numerics import della_keep_mask, della_probs

    rng = np.random.default_rng(5)
    rows, cols = 64, 300
    keys = (rng.permutation(rows * cols) + 0x3000).astype(np.uint32)  # distinct bf16 magnitudes
    x = ((keys << 16).view(np.float32) * np.sign(rng.standard_normal(rows * cols))).astype(np.float32)
    t = torch.from_numpy(x).reshape(rows, cols)
    density, eps = 0.4, 0.15
    ranks = torch.argsort(torch.argsort(t.abs(), dim=1), dim=1).to(torch.float32) + 1
    mn, mx = ranks.min(dim=1, keepdim=True).values, ranks.max(dim=1, keepdim=True).values
    rank_norm = ((ranks - mn) / (mx - mn)).clamp(0, 1)
    probs = torch.tensor(density - eps, dtype=torch.float32) + rank_norm * 2 * torch.tensor(eps, dtype=torch.float32)
    ours = della_probs(magnitude_keys(x), (rows, cols), rows, density, eps)
    assert np.array_equal(ours, probs.flatten().numpy())
    assert ours.min() == pytest.approx(density - eps) and ours.max() == pytest.approx(density + eps)
    keep = della_keep_mask(123, 0, ours)
    assert abs(keep.mean() - density) < 0.02
    assert keep[np.abs(x) >= np.median(np.abs(x))].mean() > keep.mean()  # larger magnitudes kept more often
    # counter-based: a chunk of rows draws the same mask as the whole tensor
    part = della_keep_mask(123, 10 * cols, ours[10 * cols : 20 * cols])
    assert np.array_equal(part, keep[10 * cols : 20 * cols])


def _mk_slerp(t, v0, v1, dot_threshold=0.9995, eps=1e-8):
    """mergekit 0.1.5 slerp (merge_methods/slerp.py) for one tensor, float64 transcription."""
    a, b = v0.flatten().double(), v1.flatten().double()
    na, nb = a.norm(), b.norm()
    na = na if na > eps else torch.tensor(1.0, dtype=torch.float64)
    nb = nb if nb > eps else torch.tensor(1.0, dtype=torch.float64)
    dot = ((a / na) * (b / nb)).sum().clamp(-1, 1)
    if dot.abs() > dot_threshold:
        return (1 - t) * a + t * b
    th = torch.acos(dot)
    return torch.sin((1 - t) * th) / torch.sin(th) * a + torch.sin(t * th) / torch.sin(th) * b


def test_interpolation_coefficients_match_mergekit_formulas():
    from mergepipe.numerics import model_stock_t, nuslerp_coefficients, slerp_coefficients

    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        v0 = torch.randn(2000, generator=g, dtype=torch.float64)
        v1 = v0 + (0.01 if trial % 2 else 1.0) * torch.randn(2000, generator=g, dtype=torch.float64)
        if trial == 5:
            v1 = v0 * 1.0000001  # colinear: lerp
        for t in (0.0, 0.3, 0.5, 1.0):
            ca, cb = slerp_coefficients(t, float(v0 @ v0), float(v1 @ v1), float(v0 @ v1))
            torch.testing.assert_close(ca * v0 + cb * v1, _mk_slerp(t, v0, v1), rtol=1e-6, atol=1e-6)
            # nuslerp on task vectors: (a·v0 + b·v1)/s, mergekit's nuslerp(t, v0, v1)
            a, b, s = nuslerp_coefficients(t, float(v0 @ v0), float(v1 @ v1), float(v0 @ v1))
            cos = (v0 / v0.norm()) @ (v1 / v1.norm())
            th = torch.acos(cos.clamp(-1, 1))
            mk = (
                (torch.sin((1 - t) * th) * v0 + torch.sin(t * th) * v1) / torch.sin(th)
                if (1 - cos**2) > 1e-16
                else (1 - t) * v0 + t * v1
            )
            torch.testing.assert_close((a * v0 + b * v1) / s, mk, rtol=1e-6, atol=1e-6)  # float32 coefficients
    # model stock: t = N·cos/(1 + (N−1)·cos) with cos the mean pairwise cosine (mergekit 0.1.5)
    ds = [torch.randn(500, generator=g, dtype=torch.float64) + 0.5 for _ in range(3)]
    cos = [(ds[i] @ ds[j]) / (ds[i].norm() * ds[j].norm()) for i in range(3) for j in range(i + 1, 3)]
    c = sum(cos) / 3
    expect = 3 * c / (1 + 2 * c)
    got = model_stock_t(
        3, [float(d @ d) for d in ds], {(i, j): float(ds[i] @ ds[j]) for i in range(3) for j in range(i + 1, 3)}
    )
    assert float(got) == pytest.approx(float(expect), rel=1e-6)
    # singular denominator keeps the base (t = 0), like mergekit 0.1.5
    assert float(model_stock_t(2, [1.0, 1.0], {(0, 1): -1.0})) == 0.0


def test_engine_uses_per_tensor_values_only(family, tmp_path):
    """Layer-wise settings are resolved into the plan per tensor; erasing the merge-level
    settings from the plan does not change the output (the engine never reads them)."""
    from mergepipe.pipeline import build_plan, execute_and_commit
    from mergepipe.request import request_from_args
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    base, experts = family
    params = ["density=[0.2,0.9]", 'expert1:weight=[{"filter":"mlp","value":0.5},{"value":1.5}]', "lambda=[1,0.5]"]
    st = LocalStorage(IOCounters())
    plan = build_plan(
        Catalog(tmp_path / "c.sqlite"),
        st,
        request_from_args(str(base), [(e.name, str(e)) for e in experts], "ties", params),
    )
    tp = {t.name: t for t in plan.tensors}
    l0, l1 = tp["model.layers.0.mlp.up_proj.weight"], tp["model.layers.1.self_attn.q_proj.weight"]
    assert [te.density for te in l0.experts] == [0.2] * 3 and [te.density for te in l1.experts] == [0.9] * 3
    assert l0.experts[1].weight == 0.5 and l1.experts[1].weight == 1.5 and l1.experts[0].weight == 1.0
    assert l0.params["lambda"] == 1.0 and l1.params["lambda"] == 0.5
    assert tp["model.embed_tokens.weight"].experts[0].density == 0.2  # no layer index: the first value
    assert tp["lm_head.weight"].params["lambda"] == 1.0
    plan.globals = {}
    for e in plan.experts:
        e.params = {}
    plan.seal()
    res = execute_and_commit(plan, st, str(tmp_path / "out"))
    got = merged_tensors(res.out)
    ref = merge_checkpoint_dense(
        str(base), [str(e) for e in experts], _resolved("ties", params, [e.name for e in experts])
    )
    assert all(same_bits(got[n], ref[n]) for n in ref)


def test_pair_statistics_exact_and_cached(family, tmp_path):
    """model_stock's cross terms come from the catalog: exact, computed in the analysis stream,
    and for an expert analyzed earlier read once more, then cached."""
    import math

    from mergepipe.catalog import catalog as catmod
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from testkit.harness import merged_tensors as mt

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    es = [cat.register(st, str(e)) for e in experts]
    cat.analyze(st, b, es[:1], block_bytes=4096)  # one expert alone: no pair yet
    before = st.counters.snapshot()["read"]["expert"]
    an = cat.analyze(st, b, es, block_bytes=4096, pairs=True)
    first = st.counters.snapshot()["read"]["expert"] - before
    tensor_bytes = sum(t.nbytes for t in es[0].layout.tensors.values())
    assert first == 3 * tensor_bytes  # expert 0 is streamed again for its pairs, once
    dots = cat.pair_dots(b, es, an)
    B, E = mt(base), [mt(e) for e in experts]
    for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        d = [(x[name].float() - B[name].float()).numpy().reshape(B[name].shape[0], -1) for x in E]
        for (i, j), v in dots.items():
            exact = math.fsum((d[i].astype(np.float64) * d[j]).sum(axis=1).tolist())
            assert v[name] == exact
        assert an[0].tensors[name].delta_sq == math.fsum((d[0].astype(np.float64) ** 2).sum(axis=1).tolist())
    before = st.counters.snapshot()["read"]
    cat.analyze(st, b, es, block_bytes=4096, pairs=True)
    after = st.counters.snapshot()["read"]
    assert after["expert"] == before["expert"] and after["base"] == before["base"]  # all cached
    # statistics of an older version are recomputed (STATS_VERSION is part of the key)
    cat.db.execute("UPDATE analyses SET stats_version = ?", (catmod.STATS_VERSION - 1,))
    cat.db.commit()
    cat.analyze(st, b, es[:1], block_bytes=4096)
    assert st.counters.snapshot()["read"]["expert"] > after["expert"]


def _mk_gta(base, experts, weights, *, consensus, normalize, lam=1.0):
    """mergekit 0.1.5 ``GeneralizedTaskArithmeticMerge.merge_group`` (no sparsification), float32."""
    deltas = torch.stack([e - base for e in experts])
    w = torch.tensor(weights, dtype=torch.float32).reshape(-1, *([1] * base.dim()))
    deltas = deltas * w
    if consensus:
        maj = (deltas.sum(dim=0) >= 0).to(torch.float32) * 2 - 1
        mask = deltas.sign() == maj
        mixed, div = (deltas * mask).sum(dim=0), (w * mask).sum(dim=0)
        div[div == 0] = 1
    else:
        mixed, div = deltas.sum(dim=0), w.sum(dim=0)
        div[div.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / div
    return base + mixed * lam


@pytest.mark.parametrize("weights", [[1e-9, 2e-9, 3e-9], [1.0, -1.0, 0.5], [0.4, 0.3, 0.2]])
def test_ties_divisor_and_rescale_thresholds_follow_mergekit(weights):
    """mergekit 0.1.5 replaces the TIES divisor by 1 only where it is exactly 0 (tiny positive
    weights still divide), and skips the L1 rescale when a norm is below 1e-7; the kernels and
    the dense reference agree with it."""
    from mergepipe.methods.kernels import combine, rescale_factor
    from mergepipe.methods.params import TensorParams
    from mergepipe.methods.registry import get_method
    from testkit.dense_reference import merge_tensor_dense

    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 64, generator=g)
    experts = [base + 0.01 * torch.randn(8, 64, generator=g) for _ in weights]
    experts[1][0, :8] = base[0, :8] - 2 * (experts[0][0, :8] - base[0, :8])  # opposite signs: divisor 1 + (-1) = 0
    expect = _mk_gta(base, experts, weights, consensus=True, normalize=True)
    eps = tuple({"weight": w, "density": 1.0} for w in weights)
    ref = merge_tensor_dense(
        "w", base, experts, TensorParams({"normalize": True, "lambda": 1.0, "rescale": False}, eps), method="ties"
    )
    ker = combine(
        base.flatten(),
        [(e - base).flatten() for e in experts],
        list(weights),
        get_method("ties"),
        {"normalize": True, "lambda": 1.0},
    ).reshape(base.shape)
    assert same_bits(ref, ker)
    torch.testing.assert_close(ref, expect, rtol=0, atol=2e-7 * float(base.abs().max()))
    if weights[0] == 1e-9:  # the old |divisor| < 1e-8 rule would have returned base + ~1e-9·δ
        assert (ref - base).abs().max() > 1e-3
    # rescale: mergekit's eps is 1e-7
    assert rescale_factor(5e-8, 1.0) == 1.0 and rescale_factor(1.0, 5e-8) == 1.0
    assert rescale_factor(4e-7, 2e-7) == 2.0
