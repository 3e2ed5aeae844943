"""Compare two merged checkpoints tensor by tensor, in units in the last place (ulps).

Usage::

    python bench/compare_outputs.py MERGEKIT_OUT MERGEPIPE_OUT [--json]

Reads every ``*.safetensors`` file of both folders with safetensors, matches tensors by name,
and reports per tensor: element count, elements that differ, elements more than 1 ulp apart,
and the largest distance in ulps. The ulp distance between two floats of the same dtype is the
difference of their bit patterns mapped to a monotonic integer scale (so +0 and -0 are 0 apart
and adjacent representable values are 1 apart); NaNs are counted separately.

A note on TIES: mergekit ranks |delta| with ``torch.argsort``, whose order among equal
magnitudes is unspecified, while mergepipe keeps or drops a whole tie at the threshold by a
canonical rule (docs/CONCEPTS.md, "Canonical TIES tie rule"). Where mergekit kept an arbitrary
subset of tied entries, single elements differ by a whole weighted delta, i.e. far more than
1 ulp; such tensors are reported, not hidden. With ``dtype: bfloat16`` mergekit also does every
step (delta, sum, divide, add) in bf16, mergepipe in float32 with one final rounding, so
outputs near zero (base + mixed cancelling) can differ by many output ulps.

``--ties BASE EXPERT... --density D`` attributes the differences (TIES with weight 1,
normalize true only): per tensor it recomputes the merge independently four ways, from the
same inputs, with numpy-free torch code here:

* ``mk_emul``: mergekit's algorithm (bf16 arithmetic, argsort mask) -- checked against the
  mergekit output, to show the emulation is faithful;
* ``mp_emul``: float32 arithmetic with the canonical tie rule -- checked against the mergepipe
  output;
* ``mk_canon``: mergekit's bf16 arithmetic with the canonical tie rule, compared with the
  mergepipe output: what remains is the arithmetic precision alone;
* the count of mask entries where mergekit's argsort kept a different subset of the tie.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load_all(folder: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = (f, k)
    return out


def _get(ref):
    from safetensors import safe_open

    f, k = ref
    with safe_open(str(f), framework="pt") as fh:
        return fh.get_tensor(k)


def _ordered(t):
    """Bit pattern -> integer that is monotonic in the float value (sign-magnitude to two's
    complement), as int64."""
    import torch

    bits = {
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
        torch.float32: torch.int32,
        torch.float64: torch.int64,
    }[t.dtype]
    width = {torch.int16: 16, torch.int32: 32, torch.int64: 64}[bits]
    i = t.contiguous().view(bits).to(torch.int64)
    if width < 64:
        i = i & ((1 << width) - 1)  # unsigned pattern
        sign = (i >> (width - 1)) & 1
        mag = i & ((1 << (width - 1)) - 1)
    else:
        sign = (i < 0).to(torch.int64)
        mag = i & 0x7FFFFFFFFFFFFFFF
    return torch.where(sign.bool(), -mag, mag)


def _ulps(x, y):
    import torch

    nx, ny = torch.isnan(x), torch.isnan(y)
    u = (_ordered(x) - _ordered(y)).abs()
    return torch.where(~(nx | ny), u, torch.zeros_like(u)), int((nx != ny).sum())


def ulp_distance(x, y):
    """Elementwise distance in units in the last place of the common dtype of ``x`` and ``y``
    (bfloat16, float16, float32 or float64 torch tensors of one shape): how many representable
    values lie between them, plus one (adjacent values are 1 apart, ``+0``/``-0`` are 0 apart;
    values of opposite sign are as far apart as the representable values between them).

    Returns:
        int64 tensor of the shape of ``x``; NaN pairs count 0 (see :func:`tensor_metrics`).

    Raises:
        ValueError: the dtypes or shapes differ.
    """
    if x.dtype != y.dtype or x.shape != y.shape:
        raise ValueError(f"ulp_distance: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
    return _ulps(x, y)[0]


_MANT_EMIN = {"bfloat16": (7, -126), "float16": (10, -14), "float32": (23, -126), "float64": (52, -1022)}


def ulp_of(v, dtype):
    """Spacing of the representable values of ``dtype`` (a torch floating dtype) at magnitude
    ``|v|`` (float64 tensor): ``2**(max(floor(log2|v|), emin) − mantissa_bits)``; at 0 and in the
    subnormal range, the subnormal spacing. Returns a float64 tensor of ``v``'s shape."""
    import torch

    mant, emin = _MANT_EMIN[str(dtype).replace("torch.", "")]
    a = v.double().abs()
    _, e = torch.frexp(a)  # a = m·2**e, m in [0.5, 1)
    ex = torch.where(a == 0, torch.full_like(e, emin), torch.clamp(e - 1, min=emin))
    return torch.ldexp(torch.ones_like(a), (ex - mant).to(torch.int64))


def _cos(a, b) -> float:
    """Cosine of two float tensors, in float64; 1 when both are zero, 0 when exactly one is."""
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b) / (na * nb)


def tensor_metrics(x, y, base=None, exclude=None) -> dict:
    """Compare two floating tensors of one dtype and shape (``x`` the reference).

    Args:
        x, y: torch tensors, same dtype (bfloat16 / float16 / float32 / float64) and shape.
        base: optional tensor of the same shape (the merge's base model): adds the cosine and the
            norm ratio of the task vectors ``y − base`` vs ``x − base``.
        exclude: optional bool tensor of the same shape; elements where it is True are left out
            of the ``*_outside`` figures (used for magnitude ties, see bench/parity.py).

    Returns:
        dict: ``elements``; ``differ`` (elements not bit-equal up to ±0) and ``frac_differ``;
        ``over_1ulp``; ``max_ulps`` (in ulps of the dtype); ``max_abs_diff`` (float64);
        ``nan_mismatch``; ``cosine`` of ``x`` and ``y`` (float64; 1 for two zero tensors);
        ``max_ulps_at_scale``: ``|x − y|`` in ulps of the dtype at the magnitude of the largest of
        ``|x|``, ``|y|`` (and ``|base|``), i.e. at the inputs' scale, so an output that cancels
        to near 0 does not turn one rounding step of the inputs into thousands of ulps;
        with ``base``: ``tv_cosine`` and ``tv_norm_ratio`` (‖y−base‖/‖x−base‖, 1 when both 0);
        with ``exclude``: ``excluded``, ``excluded_differ``, ``max_ulps_outside``,
        ``over_1ulp_outside``.
    """
    import torch

    u, nan_mm = _ulps(x, y)
    n = x.numel()
    xf, yf = x.double(), y.double()
    both = ~(torch.isnan(xf) | torch.isnan(yf))
    diff = (xf - yf).abs()
    r = {
        "elements": n,
        "differ": int((u > 0).sum()) + nan_mm,
        "over_1ulp": int((u > 1).sum()) + nan_mm,
        "max_ulps": int(u.max()) if n else 0,
        "max_abs_diff": float(diff[both].max()) if bool(both.any()) else 0.0,
        "nan_mismatch": nan_mm,
        "cosine": _cos(xf[both], yf[both]),
    }
    r["frac_differ"] = r["differ"] / n if n else 0.0
    scale = torch.maximum(xf.abs(), yf.abs())
    if base is not None:
        scale = torch.maximum(scale, base.double().abs())
    su = diff / ulp_of(scale, x.dtype)
    r["max_ulps_at_scale"] = float(su[both].max()) if bool(both.any()) else 0.0
    if base is not None:
        bf = base.double()
        tx, ty = xf - bf, yf - bf
        r["tv_cosine"] = _cos(tx, ty)
        nx, ny = float(tx.norm()), float(ty.norm())
        r["tv_norm_ratio"] = 1.0 if nx == 0 and ny == 0 else (ny / nx if nx else float("inf"))
    if exclude is not None:
        keep = ~exclude.reshape(u.shape)
        r["excluded"] = int(exclude.sum())
        r["excluded_differ"] = int(((u > 0) & exclude.reshape(u.shape)).sum())
        r["max_ulps_outside"] = int(u[keep].max()) if bool(keep.any()) else 0
        r["max_ulps_at_scale_outside"] = float(su[keep & both].max()) if bool((keep & both).any()) else 0.0
        r["over_1ulp_outside"] = int((u[keep] > 1).sum())
    return r


def _ties_masks(d, density: float):
    """(argsort mask as mergekit 0.1.5 computes it, canonical mask, A, T, k) for one delta."""
    import torch

    n = d.numel()
    k = max(1, int(density * n))
    w = d.abs().reshape(-1).float()
    ma = torch.zeros(n, dtype=torch.bool)
    ma[torch.argsort(w, descending=True)[:k]] = True
    key = d.float().abs().to(torch.bfloat16).float().reshape(-1)
    tau = torch.topk(key, k).values[-1]
    above = key > tau
    eq = key == tau
    a, t = int(above.sum()), int(eq.sum())
    keep_tie = abs(a + t - k) <= abs(a - k)
    mc = above | (eq & keep_tie)
    return ma.reshape(d.shape), mc.reshape(d.shape), a, t, k


def _ties_merge(base, xs, masks, dt):
    import torch

    b = base.to(dt)
    ds = torch.stack([(x.to(dt) - b) * m.to(dt) for x, m in zip(xs, masks)])
    maj = (ds.sum(0) >= 0).to(dt) * 2 - 1
    sm = ds.sign() == maj
    mixed = (ds * sm).sum(0)
    div = sm.to(dt).sum(0)
    div[div == 0] = 1
    return (b + mixed / div).to(base.dtype)


def attribute_ties(mk_dir: Path, mp_dir: Path, base_dir: Path, expert_dirs: list[Path], density: float) -> dict:
    """Per tensor, explain mergekit-vs-mergepipe differences of a TIES merge (weight 1, normalize
    true) by recomputing it independently (see the module docstring)."""
    mk, mp = _load_all(mk_dir), _load_all(mp_dir)
    base = _load_all(base_dir)
    exps = [_load_all(e) for e in expert_dirs]
    rows = []
    tot = {
        "elements": 0,
        "mk_emul_mismatch": 0,
        "mp_emul_mismatch": 0,
        "tie_mask_diff": 0,
        "tied_entries": 0,
        "arith_differ": 0,
        "arith_over_1ulp": 0,
        "arith_max_ulps": 0,
    }
    for name in sorted(set(mk) & set(mp) & set(base)):
        b = _get(base[name])
        if not b.is_floating_point() or b.dtype != _get(mk[name]).dtype:
            continue
        xs = [_get(e[name]) for e in exps]
        mks = [_ties_masks(x - b, density) for x in xs]
        ma = [m[0] for m in mks]
        mc = [m[1] for m in mks]
        mk_emul = _ties_merge(b, xs, ma, b.dtype)
        mp_emul = _ties_merge(b, xs, mc, __import__("torch").float32)
        mk_canon = _ties_merge(b, xs, mc, b.dtype)
        y_mk, y_mp = _get(mk[name]), _get(mp[name])
        u, _ = _ulps(mk_canon, y_mp)
        row = {
            "name": name,
            "elements": b.numel(),
            "mk_emul_mismatch": int((_ordered(mk_emul) != _ordered(y_mk)).sum()),
            "mp_emul_mismatch": int((_ordered(mp_emul) != _ordered(y_mp)).sum()),
            "tie_mask_diff": sum(int((x != y).sum()) for x, y in zip(ma, mc)),
            "tied_entries": sum(m[3] for m in mks),
            "arith_differ": int((u > 0).sum()),
            "arith_over_1ulp": int((u > 1).sum()),
            "arith_max_ulps": int(u.max()) if u.numel() else 0,
        }
        rows.append(row)
        for k in tot:
            tot[k] = max(tot[k], row[k]) if k == "arith_max_ulps" else tot[k] + row[k]
    return {
        "tensors": rows,
        "total": tot,
        "density": density,
        "emulation_faithful": tot["mk_emul_mismatch"] == 0 and tot["mp_emul_mismatch"] == 0,
    }


def compare(a_dir: Path, b_dir: Path) -> dict:
    import torch

    a, b = _load_all(a_dir), _load_all(b_dir)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    tensors = []
    tot = {"elements": 0, "differ": 0, "over_1ulp": 0, "max_ulps": 0, "nan_mismatch": 0}
    for name in sorted(set(a) & set(b)):
        x, y = _get(a[name]), _get(b[name])
        row = {"name": name, "dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)}
        if x.shape != y.shape or x.dtype != y.dtype:
            row["error"] = f"shape/dtype {list(x.shape)} {x.dtype} vs {list(y.shape)} {y.dtype}"
            tensors.append(row)
            continue
        if not x.is_floating_point():
            d = int((x != y).sum())
            row.update(elements=x.numel(), differ=d, over_1ulp=d, max_ulps=None)
        else:
            nx, ny = torch.isnan(x), torch.isnan(y)
            nan_mm = int((nx != ny).sum())
            both = ~(nx | ny)
            u = (_ordered(x) - _ordered(y)).abs()
            u = torch.where(both, u, torch.zeros_like(u))
            row.update(
                elements=x.numel(),
                differ=int((u > 0).sum()) + nan_mm,
                over_1ulp=int((u > 1).sum()) + nan_mm,
                max_ulps=int(u.max()) if u.numel() else 0,
                nan_mismatch=nan_mm,
            )
            if row["over_1ulp"]:
                xf, yf = x.float(), y.float()
                row["max_abs_diff"] = float((xf - yf).abs()[both].max())
            tot["nan_mismatch"] += nan_mm
        tensors.append(row)
        tot["elements"] += row["elements"]
        tot["differ"] += row["differ"]
        tot["over_1ulp"] += row["over_1ulp"]
        if row.get("max_ulps") is not None:
            tot["max_ulps"] = max(tot["max_ulps"], row["max_ulps"])
    errors = [t for t in tensors if "error" in t]
    within = not errors and not only_a and not only_b and tot["over_1ulp"] == 0
    return {
        "a": str(a_dir),
        "b": str(b_dir),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "tensors": tensors,
        "total": tot,
        "tensors_over_1ulp": sum(1 for t in tensors if t.get("over_1ulp")),
        "identical_within_1ulp": within,
        "bit_identical": within and tot["differ"] == 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    ap.add_argument(
        "--ties",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="BASE EXPERT...: attribute differences of a TIES merge (a = mergekit, b = mergepipe)",
    )
    ap.add_argument("--density", type=float, default=0.5)
    a = ap.parse_args()
    r = compare(a.a, a.b)
    if a.ties:
        r["attribution"] = attribute_ties(a.a, a.b, a.ties[0], a.ties[1:], a.density)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        t = r["total"]
        print(
            f"{len(r['tensors'])} common tensors, {t['elements']} elements; differ: {t['differ']}, "
            f">1 ulp: {t['over_1ulp']} in {r['tensors_over_1ulp']} tensors; max {t['max_ulps']} ulps"
        )
        for row in r["tensors"]:
            if row.get("differ") or "error" in row:
                print(
                    f"  {row['name']}: {row.get('error') or ''} differ {row.get('differ')}, >1ulp {row.get('over_1ulp')}, "
                    f"max {row.get('max_ulps')} ulps"
                )
        if "attribution" in r:
            t = r["attribution"]["total"]
            print(
                f"attribution (TIES, density {a.density}): emulations faithful: {r['attribution']['emulation_faithful']} "
                f"(mergekit emul. mismatches {t['mk_emul_mismatch']}, mergepipe emul. mismatches {t['mp_emul_mismatch']}); "
                f"tied entries at the thresholds {t['tied_entries']}, of which mergekit's argsort kept a different subset: "
                f"{t['tie_mask_diff']} mask entries; with canonical ties, mergekit's bf16 arithmetic vs mergepipe: "
                f"differ {t['arith_differ']}, >1 ulp {t['arith_over_1ulp']}, max {t['arith_max_ulps']} ulps"
            )
        if r["only_in_a"] or r["only_in_b"]:
            print(f"only in a: {r['only_in_a']}; only in b: {r['only_in_b']}")
    sys.exit(0 if r["identical_within_1ulp"] else 1)


if __name__ == "__main__":
    main()
