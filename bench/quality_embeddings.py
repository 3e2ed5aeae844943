"""How should the budgeted planner treat ``lm_head`` and the token embeddings? A measurement.

On one tiny zoo (``ZooConfig.tiny(seed=SEED)``, built and swept first by ``bench/quality.py``,
whose work folder, catalog, calibration set and evaluations this reuses), for one method, at
expert budgets of 10/25/50%, five block values, all through the planner's sensitivity hook
(``make_plan(value="fisher", sensitivity=...)``) so that only the ranking differs:

* ``energy``: the energy ranking (sensitivity 1 everywhere);
* ``energy-noemb``: energy, embedding/``lm_head`` blocks ranked last (× 1e-9);
* ``fisher``: the base's block-mean Fisher on the calibration set (what ``--value fisher`` does);
* ``fisher-noemb``: Fisher, embedding/``lm_head`` blocks ranked last;
* ``fisher-embfirst``: Fisher, embedding/``lm_head`` blocks ranked first (× 1e9).

Prints per point the worst task's normalised gain and the worst task's share of the full
merge's gain (:mod:`mergepipe.metrics`).

    python bench/quality_embeddings.py 0 task_arithmetic
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ("energy", "energy-noemb", "fisher", "fisher-noemb", "fisher-embfirst")


def main() -> None:
    import dataclasses

    import numpy as np

    import mergepipe.pipeline as pipeline
    from bench.quality import method_params
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.catalog.sensitivity import load_calibration
    from mergepipe.evaluate import evaluate_checkpoint
    from mergepipe.metrics import kept_share, normalised_gain, worst
    from mergepipe.request import request_from_args
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from mergepipe_zoo import ZooConfig, build_zoo

    seed, method = int(sys.argv[1]), sys.argv[2]
    z = build_zoo(None, ZooConfig.tiny(seed=seed))
    wd = REPO / "bench" / ".work" / "quality" / f"zoo-{z.config.key()}"
    if not (wd / "evals.json").exists():
        raise SystemExit(f"run `python bench/quality.py --testbed zoo --size tiny --seeds {seed}` first")
    cat, st = Catalog(wd / "catalog.sqlite"), LocalStorage(IOCounters())
    tb = json.loads((z.root / "testbed.json").read_text())
    params = method_params(method, tb["recommended_params"]["task_arithmetic"]["weight"])
    ev = json.loads((wd / "evals.json").read_text())

    def q(r: dict) -> dict:
        return {t: v["loss"] for t, v in r.items()}

    base_q = q(ev["base"])
    own = {d: q(ev[f"expert:{d}"])[d] for d in tb["tasks"]}
    cal_file = str(wd / "calibration.jsonl")
    ex = [(n, str(p)) for n, p in z.experts.items()]
    base, _, _ = pipeline.register_and_analyze(cat, st, str(z.base), [p for _, p in ex], calibration=cal_file)
    fisher = cat.sensitivity(st, base, load_calibration(st, cal_file), 128 * 1024)

    def run(plan, tag: str) -> dict:
        out = wd / "embeddings" / method / tag
        if not (out / "manifest.json").exists():
            pipeline.execute_and_commit(plan, st, str(out))
        return q(evaluate_checkpoint(out, z.root))

    full_ng = normalised_gain(
        run(pipeline.build_plan(cat, st, request_from_args(str(z.base), ex, method, params, seed=seed)), "full"),
        base_q,
        own,
    )
    orig = pipeline.make_plan
    for b in (10, 25, 50):
        for var in VARIANTS:
            sens = {}
            for n, f in fisher.items():
                s = np.asarray(f, dtype=float) if var.startswith("fisher") else np.ones(len(f))
                if "embed_tokens" in n or "lm_head" in n:
                    s = s * (1e-9 if var.endswith("noemb") else 1e9 if var.endswith("embfirst") else 1.0)
                sens[n] = s

            def with_sens(request, inputs, selection, engine, _s=sens):
                return orig(
                    request,
                    dataclasses.replace(inputs, sensitivity=_s),
                    dataclasses.replace(selection, value="fisher", calibration="variant"),
                    engine,
                )

            pipeline.make_plan = with_sens
            try:
                req = request_from_args(str(z.base), ex, method, params, budget=f"{b}%", seed=seed)
                plan = pipeline.build_plan(cat, st, req)
            finally:
                pipeline.make_plan = orig
            ng = normalised_gain(run(plan, f"{b}-{var}"), base_q, own)
            ks = kept_share(ng, full_ng) if all(v > 0 for v in full_ng.values()) else None
            line = f"seed {seed} {method} {b}% {var:16s} worst NG {worst(ng)[0]:10s} {worst(ng)[1]:+.3f}"
            if ks:
                line += f"  worst kept {worst(ks)[1]:.1%} ({worst(ks)[0]})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
