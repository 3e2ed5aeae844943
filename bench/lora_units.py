"""LoRA planning units: energy kept per expert byte by module, row block or rank component.

Under a budget the planner reads a LoRA expert's module whole (A and B) or skips it. Two finer
units keep I/O honest (every byte a plan needs is charged once):

* **row blocks** of ``δ = s·B·A``: a block of output rows needs those rows of B and all of A,
  so A is a fixed cost charged to the first block read of the module;
* **rank components** ``δ = s·Σ_k b_k a_kᵀ``: component ``k`` needs row ``k`` of A (contiguous)
  and column ``k`` of B (strided in the row-major file, so in practice B whole), so B is the
  fixed cost; energy is additive over components only when they are orthogonal.

This script computes, offline (numpy, no merge is run), the energy ``‖δ‖²`` each unit keeps at
budgets given as shares of the factor bytes: per module, the upper concave hull of (bytes,
energy) with the fixed cost at its start (units by energy per byte), then one greedy fill over
all modules' hull segments in order of energy per byte, a segment taken only after the one
before it in its module (Sinha & Zoltners' LP-greedy for the multiple-choice knapsack, as the
planner's fidelity tiers do). For rank components the greedy uses ``s²‖b_k‖²‖a_k‖²`` and the
table reports the energy the kept components explain, ``1 − ‖δ − δ_K‖²/‖δ‖²``. Row blocks follow
the catalog's grid (``--block-bytes`` of the base tensor's rows). The value is plain energy
(``task_arithmetic``, weight 1); a method's trim changes the values, not the comparison's shape.

Experts are PEFT LoRA adapters (``--adapters DIR ...``, their factors) or full fine-tunes
(``--experts DIR ...``: each 2-D non-embedding task vector as its rank-``--rank`` truncated SVD
in the factor form ``mergepipe extract-lora`` writes, ``B = U_r Σ_r^½``, ``A = Σ_r^½ V_rᵀ``,
float32), against ``--base DIR`` (safetensors folder)::

    python bench/lora_units.py --base BASE --adapters AD1 AD2
    python bench/lora_units.py --base BASE --experts EX1 EX2 --rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DEFAULT_BLOCK_BYTES = 128 * 1024


def _load(folder: Path) -> dict[str, np.ndarray]:
    """float64 numpy arrays of every tensor of a safetensors folder (bf16 through torch)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                out[n] = h.get_tensor(n).double().numpy()
    return out


def _base_itemsize(folder: Path) -> dict[str, int]:
    """Bytes per element of each base tensor (the catalog's block grid is in base bytes)."""
    from safetensors import safe_open

    size = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                out[n] = size.get(str(h.get_slice(n).get_dtype()), 4)
    return out


def _module(a: np.ndarray, b: np.ndarray, s: float, itemsize: int, block_bytes: int, fbytes: int = 4) -> dict:
    """Per-unit bytes and energies of one module ``δ = s·B·A`` (A ``(r, in)``, B ``(out, r)``)."""
    d = s * b @ a
    out, inn = d.shape
    rank = a.shape[0]
    rpb = max(1, block_bytes // (inn * itemsize))
    blocks = [(r0, min(out, r0 + rpb)) for r0 in range(0, out, rpb)]
    return {
        "a_bytes": a.size * fbytes,
        "b_bytes": b.size * fbytes,
        "energy": float((d**2).sum()),
        "rows": [((r1 - r0) * rank * fbytes, float((d[r0:r1] ** 2).sum())) for r0, r1 in blocks],
        "comps": [(inn * fbytes, float(s * s * (b[:, k] @ b[:, k]) * (a[k] @ a[k]))) for k in range(rank)],
        "factors": (a, b, s),
        "n_blocks": len(blocks),
    }


def hull(fixed: int, units: list[tuple[int, float]]) -> list[tuple[int, float, int]]:
    """Upper concave hull of a module's (bytes, energy) curve: units by energy per byte, the
    first charged ``fixed`` bytes more. Returns segments ``(bytes, energy, units in it)``."""
    units = sorted(units, key=lambda u: -u[1] / max(u[0], 1))
    pts = [(0, 0.0, 0)]
    c, v = fixed, 0.0
    for i, (cu, vu) in enumerate(units):
        c, v = c + cu, v + vu
        pts.append((c, v, i + 1))
    h = [pts[0]]
    for p in pts[1:]:
        while len(h) >= 2:
            (x1, y1, _), (x2, y2, _) = h[-2], h[-1]
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                h.pop()
            else:
                break
        h.append(p)
    return [(h[i + 1][0] - h[i][0], h[i + 1][1] - h[i][1], h[i + 1][2] - h[i][2]) for i in range(len(h) - 1)]


def greedy(groups: list[list[tuple[int, float, int]]], budget: int) -> tuple[int, list[int]]:
    """Greedy fill of hull segments by energy per byte, each after its predecessor; returns
    (bytes used, units taken per group)."""
    segs = sorted(
        ((v / max(c, 1), g, i, c) for g, sg in enumerate(groups) for i, (c, v, _) in enumerate(sg)),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    nxt, room = [0] * len(groups), budget
    for _, g, i, c in segs:
        if nxt[g] == i and c <= room:
            nxt[g] += 1
            room -= c
    taken = [sum(n for _, _, n in groups[g][: nxt[g]]) for g in range(len(groups))]
    return budget - room, taken


def _explained(m: dict, k: int) -> float:
    """Energy of δ explained by its ``k`` components of largest ``s²‖b‖²‖a‖²``."""
    if k == 0:
        return 0.0
    a, b, s = m["factors"]
    order = sorted(range(a.shape[0]), key=lambda j: -m["comps"][j][1])[:k]
    d = s * b @ a
    r = d - s * b[:, order] @ a[order]
    return max(0.0, m["energy"] - float((r**2).sum()))


def compare(mods: list[dict], shares: list[float]) -> list[dict]:
    """Energy kept (share of the total) and bytes per unit kind at each budget share."""
    total_b = sum(m["a_bytes"] + m["b_bytes"] for m in mods)
    total_e = sum(m["energy"] for m in mods)
    rows = []
    for sh in shares:
        bud = int(sh * total_b)
        bm, tm = greedy([[(m["a_bytes"] + m["b_bytes"], m["energy"], 1)] for m in mods], bud)
        br, tr = greedy([hull(m["a_bytes"], m["rows"]) for m in mods], bud)
        bc, tc = greedy([hull(m["b_bytes"], m["comps"]) for m in mods], bud)
        vm = sum(m["energy"] for m, t in zip(mods, tm) if t)
        vr = sum(_top_rows(m, t) for m, t in zip(mods, tr))
        vc = sum(_explained(m, t) for m, t in zip(mods, tc))
        partial = sum(1 for m, t in zip(mods, tr) if 0 < t < m["n_blocks"])
        rows.append(
            {
                "budget_share": sh,
                "budget_bytes": bud,
                "module": {"bytes": bm, "energy": vm / total_e},
                "row_blocks": {"bytes": br, "energy": vr / total_e, "partial_modules": partial},
                "rank_components": {"bytes": bc, "energy": vc / total_e},
            }
        )
    return rows


def _top_rows(m: dict, t: int) -> float:
    """Energy of the ``t`` row blocks of ``m`` first on its hull (by energy per byte)."""
    return sum(v for _, v in sorted(m["rows"], key=lambda u: -u[1] / max(u[0], 1))[:t])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="base checkpoint folder (safetensors)")
    ap.add_argument("--adapters", type=Path, nargs="*", default=[], help="PEFT LoRA adapter folders")
    ap.add_argument("--experts", type=Path, nargs="*", default=[], help="full fine-tunes (SVD factors)")
    ap.add_argument("--rank", type=int, default=16, help="rank of the SVD factors of --experts [16]")
    ap.add_argument("--budgets", default="25%,50%", help="shares of the factor bytes [25%%,50%%]")
    ap.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="catalog block size [131072]")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    if not a.adapters and not a.experts:
        raise SystemExit("pass --adapters or --experts")
    isz = _base_itemsize(a.base)
    mods = []
    for ad in a.adapters:
        cfg = json.loads((ad / "adapter_config.json").read_text())
        s = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
        t = _load(ad)
        for n in sorted(t):
            if n.endswith("lora_A.weight"):
                target = n.removesuffix(".lora_A.weight").removeprefix("base_model.model.") + ".weight"
                mods.append(_module(t[n], t[n.replace("lora_A", "lora_B")], s, isz.get(target, 2), a.block_bytes))
    if a.experts:
        base = _load(a.base)
        for ex in a.experts:
            t = _load(ex)
            for n, w in sorted(base.items()):
                if w.ndim != 2 or "embed" in n or n not in t:
                    continue
                u, sv, vt = np.linalg.svd(t[n] - w, full_matrices=False)
                k = min(a.rank, len(sv))
                b = (u[:, :k] * np.sqrt(sv[:k])).astype(np.float32).astype(np.float64)
                af = (np.sqrt(sv[:k])[:, None] * vt[:k]).astype(np.float32).astype(np.float64)
                mods.append(_module(af, b, 1.0, isz[n], a.block_bytes))
    shares = [float(x.rstrip("%")) / 100 for x in a.budgets.split(",")]
    rows = compare(mods, shares)
    nb = sorted({m["n_blocks"] for m in mods})
    if a.json:
        print(json.dumps({"modules": len(mods), "blocks_per_module": nb, "rows": rows}, indent=1))
        return
    print(
        f"{len(mods)} modules, {sum(m['a_bytes'] + m['b_bytes'] for m in mods):,} factor bytes, row blocks per module {nb}"
    )
    print("| budget | module | row blocks (A once) | rank components (B once) |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['budget_share']:.0%} | {r['module']['energy']:.4f} | {r['row_blocks']['energy']:.4f} "
            f"({r['row_blocks']['partial_modules']} partial) | {r['rank_components']['energy']:.4f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
