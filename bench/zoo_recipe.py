"""Zoo recipe diagnosis: train one base, then experts under several fine-tuning recipes, and
report the build gates of each recipe for several task-arithmetic weights λ.

The base is the expensive part of a zoo build; this script trains it once per (size, seed, base
recipe) and caches it (with every expert) under ``--work``, so comparing expert recipes and
merge weights costs only the fine-tunes. It uses the zoo's own data, tokenizer, training loop and
gate check (:mod:`mergepipe_zoo.zoo`), so a recipe that passes here passes in ``build_zoo``.

    python bench/zoo_recipe.py --size demo --seed 0 --work bench/.work/zr \
        --recipe steps=60,lr=5e-4,mix=0.5 --recipe steps=120,lr=2.5e-4,mix=0.5 --lambdas 0.25 0.3 0.4

A recipe is ``key=value`` pairs: ``steps``, ``lr``, ``mix`` (replay share), ``base_steps``,
``base_lr`` (the latter two select the base). Output: one line per (recipe, λ) with the
per-expert normalised gains and the gate verdict, and ``results.jsonl`` in ``--work``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergepipe_zoo import zoo as Z  # noqa: E402


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _parse_recipe(s: str) -> dict:
    out = {}
    for part in s.split(","):
        k, v = part.split("=")
        out[k.strip()] = float(v) if k.strip() in ("lr", "mix", "base_lr") else int(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "demo"), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--recipe", action="append", default=[], help="e.g. steps=60,lr=5e-4,mix=0.5")
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.25])
    args = ap.parse_args()

    cfg0 = Z.ZooConfig.tiny(seed=args.seed) if args.size == "tiny" else Z.ZooConfig(seed=args.seed)
    recipes = [_parse_recipe(r) for r in args.recipe] or [{}]
    args.work.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, flush=True)  # noqa: E731

    def run():
        import torch
        from transformers import LlamaForCausalLM

        from mergepipe.evaluate import causal_lm_losses, causal_lm_windows, load_testbed

        t0 = time.perf_counter()
        corpora = Z._corpora(cfg0)
        tok = Z._train_tokenizer(cfg0, corpora)
        eos = tok.token_to_id(Z._EOS)
        tb = args.work / f"tb-{args.size}-{args.seed}"
        if not (tb / Z.TESTBED).is_file():
            tb.mkdir(exist_ok=True)
            Z._save_tokenizer(Z._wrap_tokenizer(tok, cfg0), tb / "tokenizer")
            (tb / "eval").mkdir(exist_ok=True)
            need = cfg0.eval_sequences * cfg0.seq_len
            files = {}
            for d in Z.DOMAINS:
                docs, n = [], 0
                for doc, enc in zip(corpora[d][1], tok.encode_batch(corpora[d][1], add_special_tokens=False)):
                    docs.append(doc)
                    n += len(enc.ids) + 1
                    if n >= need + cfg0.seq_len:
                        break
                (tb / f"eval/{d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
                files[d] = f"eval/{d}.jsonl"
            (tb / Z.CALIBRATION).write_text(
                "".join(json.dumps({"text": t}) + "\n" for t in Z._calibration_docs(corpora))
            )
            (tb / Z.TESTBED).write_text(json.dumps(Z._testbed_json(cfg0, files)))
        windows = causal_lm_windows(load_testbed(tb), Z.DOMAINS)
        streams = {d: Z._token_stream(tok, corpora[d][0], eos) for d in Z.DOMAINS}
        del corpora
        lcfg = Z._llama_config(cfg0)
        ev = LlamaForCausalLM(lcfg)
        ev.eval()

        def losses(sd):
            ev.load_state_dict(sd)
            return {d: r["loss"] for d, r in causal_lm_losses(ev, windows, cfg0.batch_size).items()}

        for rec in recipes:
            cfg = replace(
                cfg0,
                base_steps=int(rec.get("base_steps", cfg0.base_steps)),
                lr=float(rec.get("base_lr", cfg0.lr)),
                expert_steps=int(rec.get("steps", cfg0.expert_steps)),
                expert_lr=float(rec.get("lr", cfg0.expert_lr)),
                expert_mix=float(rec.get("mix", cfg0.expert_mix)),
            )
            bkey = _key({"size": args.size, "seed": args.seed, "bs": cfg.base_steps, "blr": cfg.lr})
            bpath = args.work / f"base-{bkey}.pt"
            if bpath.is_file():
                base_sd = torch.load(bpath)
            else:
                torch.manual_seed(cfg.seed)
                m = LlamaForCausalLM(lcfg)
                tb0 = time.perf_counter()
                Z._train(
                    m,
                    [streams[d] for d in Z.DOMAINS],
                    cfg.base_steps,
                    cfg.lr,
                    0.1,
                    Z._derive_seed(cfg.seed, "base-data"),
                    cfg,
                    log,
                    "base",
                )
                log(f"base trained in {time.perf_counter() - tb0:.0f}s")
                base_sd = Z._bf16_round_trip(m)
                torch.save(base_sd, bpath)
            bl = losses(base_sd)
            el, deltas = {}, {}
            ekey = _key({"b": bkey, "s": cfg.expert_steps, "lr": cfg.expert_lr, "mix": cfg.expert_mix})
            te = time.perf_counter()
            for d in Z.DOMAINS:
                p = args.work / f"expert-{ekey}-{d}.pt"
                if p.is_file():
                    esd = torch.load(p)
                else:
                    torch.manual_seed(Z._derive_seed(cfg.seed, "expert-init", d, 1))
                    m = LlamaForCausalLM(lcfg)
                    m.load_state_dict(base_sd)
                    Z._train(
                        m,
                        Z._expert_streams(streams, d, cfg.expert_mix),
                        cfg.expert_steps,
                        cfg.expert_lr,
                        0.0,
                        Z._derive_seed(cfg.seed, "expert-data", d, 1),
                        cfg,
                        lambda _m: None,
                        d,
                    )
                    esd = Z._bf16_round_trip(m)
                    torch.save(esd, p)
                el[d] = losses(esd)
                deltas[d] = {k: esd[k] - base_sd[k] for k in base_sd}
            log(f"recipe {rec}: experts in {time.perf_counter() - te:.0f}s; base {_fmt(bl)}")
            for d in Z.DOMAINS:
                log(f"   expert {d:10s} {_fmt(el[d])}")
            for lam in args.lambdas:
                ml = losses({k: base_sd[k] + lam * sum(deltas[d][k] for d in Z.DOMAINS) for k in base_sd})
                g = Z.check_gates(bl, el, ml)
                ng = " ".join(f"{d[:5]} {g['normalised_gain'][d]:+.2f}" for d in Z.DOMAINS)
                log(
                    f"   λ={lam:<5g} {'PASS' if g['passed'] else 'fail'}  NG {ng}  mean {g['merge_mean_loss']:.4f}"
                    f" vs base {g['base_mean_loss']:.4f}  own-best {sum(g['best_on_own_domain'].values())}/4"
                )
                with open(args.work / "results.jsonl", "a") as f:
                    f.write(
                        json.dumps(
                            {"size": args.size, "seed": args.seed, "recipe": rec, "lambda": lam, "gates": g}
                            | {"config": asdict(cfg)}
                        )
                        + "\n"
                    )
        log(f"total {time.perf_counter() - t0:.0f}s")

    Z._with_torch_settings(run)


def _fmt(losses: dict) -> str:
    return " ".join(f"{d[:5]} {v:.3f}" for d, v in losses.items())


if __name__ == "__main__":
    main()
