"""Reconstruction error per byte of candidate sketch codes on real task vectors (issue 24, item 1).

For every 2-D tensor of each expert of a testbed (task vector δ = expert − base, float32 from
the bf16 checkpoints), codes of δ per row-block and their bytes, as a share of the bf16 expert:

* ``signK``: today's sketch (:mod:`mergepipe.catalog.sketch`): K residual sign planes, one
  bfloat16 scale per row and plane (BitDelta's 1-bit code with per-row scales);
* ``ternary``: one 2-bit code per entry in {−s, 0, +s} per row (the threshold 0.7·mean|r| of
  TWN, Li et al. 2016, and the least-squares s of the kept entries), + a bf16 scale per row;
* ``q2``: 2-bit uniform code per entry with 4 levels {±a, ±3a} per row (least-squares a), + a
  bf16 scale per row;
* ``lowrankR``: the truncated SVD of the tensor's δ at rank R in bf16 factors (``2R(m+n)`` bytes);
* ``lowrankR+signK`` / ``lowrankR+ternary`` (R = 1, 2): rank-R factors, then K sign planes (or the
  ternary code) of the residual; ``lowrank1+sign1`` is the catalog's rank-1 tier (``--sketch sign3+r1``).

Prints one row per code: bytes (% of the bf16 expert) and the residual energy share
``Σ(δ − δ̂)²/Σδ²`` summed over the experts' tensors. Cheap: seconds on the tiny zoo.

    python bench/tier_error.py --seed 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _bf16(x: np.ndarray) -> np.ndarray:
    from mergepipe.catalog.sketch import _from_bf16_bits, _to_bf16_bits

    return _from_bf16_bits(_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def sign_planes(d: np.ndarray, k: int) -> np.ndarray:
    """δ̂ of k residual sign planes with per-row bf16 scales (the catalog's code)."""
    rec = np.zeros_like(d)
    for _ in range(k):
        r = d - rec
        s = _bf16(np.abs(r).mean(axis=1))
        rec = rec + np.where(r > 0, 1.0, -1.0) * s[:, None]
    return rec


def ternary(d: np.ndarray) -> np.ndarray:
    """Per row: entries with |δ| > 0.7·mean|δ| coded ±s (s = their mean |δ|, bf16), others 0."""
    a = np.abs(d)
    keep = a > 0.7 * a.mean(axis=1, keepdims=True)
    s = _bf16((a * keep).sum(axis=1) / np.maximum(keep.sum(axis=1), 1))
    return np.sign(d) * keep * s[:, None]


def q2(d: np.ndarray) -> np.ndarray:
    """Per row: 4 levels {±a, ±3a}; the code is the nearest level; a by two least-squares steps."""
    a = _bf16(np.abs(d).mean(axis=1) / 2)
    for _ in range(2):
        c = np.clip(np.round((d / np.maximum(a, 1e-30)[:, None] + 3) / 2), 0, 3) * 2 - 3  # {-3,-1,1,3}
        a = _bf16((d * c).sum(axis=1) / np.maximum((c * c).sum(axis=1), 1e-30))
    c = np.clip(np.round((d / np.maximum(a, 1e-30)[:, None] + 3) / 2), 0, 3) * 2 - 3
    return c * a[:, None]


def lowrank(d: np.ndarray, r: int) -> np.ndarray:
    u, s, vt = np.linalg.svd(d.astype(np.float64), full_matrices=False)
    return (_bf16(u[:, :r] * s[:r]) @ _bf16(vt[:r])).astype(np.float32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from safetensors.numpy import load_file

    from mergepipe_zoo.zoo import ZooConfig, build_zoo

    z = build_zoo(None, ZooConfig.tiny(seed=a.seed), log=lambda m: None)

    def load(folder: Path) -> dict:
        import torch
        from safetensors.torch import load_file as lt

        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update({k: v.to(torch.float32).numpy() for k, v in lt(str(f)).items()})
        return out

    del load_file
    base = load(z.base)
    codes: dict[str, list[float]] = {}
    total_bytes = 0
    total_sq = 0.0
    for _, path in sorted(z.experts.items()):
        ex = load(path)
        for name, b in base.items():
            total_bytes += 2 * b.size
            if b.ndim < 2:
                continue
            d = (ex[name] - b).reshape(b.shape[0], -1).astype(np.float32)
            m, n = d.shape
            sq = float((d.astype(np.float64) ** 2).sum())
            total_sq += sq
            cand = {f"sign{k}": (sign_planes(d, k), k * (m * n / 8 + 2 * m)) for k in (1, 2, 3)}
            cand["ternary"] = (ternary(d), m * n / 4 + 2 * m)
            cand["q2"] = (q2(d), m * n / 4 + 2 * m)
            if min(m, n) > 2:  # rank-r factors first, sign planes (or a ternary code) of what they leave
                for r in (1, 2):
                    lr = lowrank(d, r)
                    for k in (1, 2):
                        cand[f"lowrank{r}+sign{k}"] = (
                            lr + sign_planes(d - lr, k),
                            2 * r * (m + n) + k * (m * n / 8 + 2 * m),
                        )
                    cand[f"lowrank{r}+ternary"] = (lr + ternary(d - lr), 2 * r * (m + n) + m * n / 4 + 2 * m)
            for r in (1, 2, 4, 8):
                if r < min(m, n):
                    cand[f"lowrank{r}"] = (lowrank(d, r), 2 * r * (m + n))
            for k, (rec, nb) in cand.items():
                e = float(((d - rec).astype(np.float64) ** 2).sum())
                c = codes.setdefault(k, [0.0, 0.0])
                c[0] += nb
                c[1] += e
    print(f"zoo tiny seed {a.seed}: {len(z.experts)} experts, 2-D tensors only (1-D have no sketch)")
    print("| code | bytes (% of bf16 experts) | residual energy share | kept energy per % of bytes |")
    print("|---|---:|---:|---:|")
    for k, (nb, e) in sorted(codes.items(), key=lambda kv: kv[1][0]):
        share = 100 * nb / total_bytes
        print(f"| {k} | {share:.2f}% | {100 * e / total_sq:.1f}% | {(1 - e / total_sq) * 100 / share:.1f} |")


if __name__ == "__main__":
    main()
