"""Development sweep of the vision testbed's recipe: gates per seed over task sets, fine-tuning
schedules and merge weights, on development seeds only (never a registered fresh seed).

Each (seed, recipe) trains the base and the experts once (as :func:`mergepipe_zoo.vision.build_vision`
does, in a temporary folder, nothing cached) and evaluates the build gates of both dtypes for every
``--weights`` value (the gate merge is cheap). Writes one JSON line per (seed, recipe) to ``--out``.

    OPENBLAS_NUM_THREADS=1 nice -n 10 python bench/vision_dev.py --seeds 0 1 2 3 4 \
        --tasks rot90 invert vflip hflip --weights 0.3 0.4 0.5 --out bench/.work/vision-dev.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(cfg, weights: list[float]) -> dict:
    """Gate reports of one build of ``cfg`` for each merge weight: ``{dtype: {weight: report}}``."""
    import torch

    from mergepipe_zoo import vision as V

    torch.set_num_threads(1)
    t0 = time.process_time()
    data = V.make_tasks(cfg)
    T = {k: tuple(torch.from_numpy(a) for a in v) for k, v in data.items()}
    base_sd = V._train_base(T, cfg, lambda m: None, time.perf_counter())
    with tempfile.TemporaryDirectory() as tmp:
        experts_sd, heads = V._train_experts(Path(tmp), T, base_sd, cfg, lambda m: None)
    probe = {t: (T[t][2], T[t][3]) for t in cfg.tasks}
    mc = V._model_config(cfg, "float32")

    def losses(sd: dict) -> dict[str, float]:
        b = V.DigitsCNN(mc)
        b.load_state_dict(sd)
        return {t: v["loss"] for t, v in V._scores(b.eval(), heads, probe, False).items()}

    out: dict = {"cpu_s": 0.0, "gates": {}}
    for dt in V.DTYPES:
        rd = {
            n: {k: v.float() for k, v in V._round(sd, dt).items()} for n, sd in {"base": base_sd, **experts_sd}.items()
        }
        lb = losses(rd["base"])
        le = {t: losses(rd[t]) for t in cfg.tasks}
        out["gates"][dt] = {}
        for w in weights:
            merged = {k: rd["base"][k] + w * sum(rd[t][k] - rd["base"][k] for t in cfg.tasks) for k in base_sd}
            g = V.check_gates(lb, le, losses(merged), cfg.min_expert_gain, cfg.min_merge_ng)
            out["gates"][dt][str(w)] = {"passed": g["passed"], "ng": g["normalised_gain"], "failures": g["failures"]}
        out["expert_gain"] = {t: round(1 - le[t][t] / lb[t], 3) for t in cfg.tasks}
    out["cpu_s"] = round(time.process_time() - t0, 1)
    return out


def main(argv=None) -> None:
    from mergepipe_zoo.vision import VisionConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--tasks", nargs="+", default=None)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.5])
    ap.add_argument("--set", nargs="*", default=[], help="VisionConfig overrides, e.g. expert_epochs=8")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    fresh = {100 + i for i in range(200)}
    if set(a.seeds) & fresh:
        sys.exit(f"--seeds {a.seeds}: 100-299 are reserved for fresh runs; develop on other seeds")
    over: dict = {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v)
    if a.tasks:
        over["tasks"] = tuple(a.tasks)
    for s in a.seeds:
        cfg = dataclasses.replace(VisionConfig(seed=s), **over)
        r = run(cfg, a.weights)
        rec = {"seed": s, "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in over.items()}, **r}
        with a.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        ok = {dt: [w for w, g in r["gates"][dt].items() if g["passed"]] for dt in r["gates"]}
        print(f"seed {s} {over} cpu {r['cpu_s']} s gain {r['expert_gain']} passed at weights {ok}", flush=True)
        for dt in r["gates"]:
            for w, g in r["gates"][dt].items():
                print(f"   {dt} w={w} ng " + " ".join(f"{t}:{v:.2f}" for t, v in g["ng"].items()), flush=True)


if __name__ == "__main__":
    main()
