"""The MiniLM search objective, made cheap enough to search with, and what a MiniLM search costs.

Issue 27 asks for layer-wise vs model-level search on a deep real model; the MiniLM testbed
(:mod:`mergepipe_zoo.minilm`: the pretrained 6-layer MiniLM encoder, three experts fully
fine-tuned on ``order``/``rotate``/``match``, task-specific heads) is the real one here. Scored the
way ``mergepipe eval`` scores it (a fresh process, ``from_pretrained``, each example tokenised per
call, all 512 examples of 3 tasks) plus a ``mergepipe merge`` process, one candidate cost ~364 s
at load 15 (docs/SEARCH.md). :class:`MiniLMObjective` computes the same numbers for less:

* **in process, built once**: the tokenizer, the heads and an encoder skeleton
  (``AutoModel.from_config``) are made once; a candidate's weights are loaded into the skeleton
  from its snapshot's safetensors (``load_state_dict``), not through ``from_pretrained``;
* **tokenised once**: every example is tokenised when the objective is built, batches are formed
  once by length (a batch pads to its own longest example, not the batch's in file order);
* **fewer examples, with the noise stated**: ``n_search`` examples per task are the objective
  the optimizer sees, the next ``n_heldout`` are scored in the same pass and never shown to it
  (held-out); an accuracy on ``n`` examples has binomial standard error ``sqrt(p(1-p)/n)``
  (:func:`binomial_se`, 3.5 points at p = 0.8 and n = 128, against 1.8 at n = 512). The
  objectives are the per-task mean cross-entropies (continuous; less noisy than accuracy on the
  same examples), accuracies are recorded beside them;
* **one thread, no autograd**: ``torch.set_num_threads(1)`` and ``inference_mode``
  (:func:`mergepipe.evaluate._torch_settings`, as ``mergepipe eval``);
* **the merge in process**: the search runner's :class:`~mergepipe.search.runner.LocalMerger`
  (``build_plan`` + ``execute_and_commit``, the committed snapshot), no CLI process start.

Run (prints and writes a JSON of the measurement; never a search)::

    PYTHONPATH=. nice -n 15 .venv/bin/python -W ignore bench/search_minilm.py \\
        --work bench/.work/search-minilm --out bench/.work/search-minilm/cost.json

It checks the objective against ``mergepipe.evaluate.evaluate_checkpoint`` on the same examples
(identical per-example correctness, losses within 1e-4), times the old protocol and the new one
side by side on one checkpoint, times ``--candidates`` real merges and their scoring, times BO
proposals at the observation counts of an 8 + 40 run, and projects the cost of a
pre-registered run (``--runs`` runs per arm, ``--arms`` arms, 8 + 40 evaluations each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` measured on ``n`` independent examples:
    ``sqrt(p (1 - p) / n)`` (a fraction, not points).

    Raises:
        ValueError: ``n < 1`` or ``p`` outside [0, 1].
    """
    if n < 1 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binomial_se needs n >= 1 and p in [0, 1], got p={p}, n={n}")
    return math.sqrt(p * (1.0 - p) / n)


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``k / n`` (95% with the default ``z``;
    Wilson 1927), as fractions.

    Raises:
        ValueError: ``n < 1`` or ``k`` outside [0, n].
    """
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


class MiniLMObjective:
    """Per-task loss and accuracy of a merged MiniLM encoder with each task's head, on
    ``n_search`` examples per task (the objective) and the next ``n_heldout`` (held-out).

    Args:
        testbed: the built testbed folder (``testbed.json``; :func:`mergepipe_zoo.minilm.build_minilm`).
        n_search, n_heldout: examples per task in each split (their sum at most the testbed's
            ``eval_examples``, 512); the first ``n_search`` of the probe file, then the next
            ``n_heldout``.
        seq_len: tokens per example (truncation); None: the testbed's (40).
        batch_size: examples per forward pass.

    Raises:
        mergepipe.errors.InputError: a testbed error (:func:`mergepipe.evaluate.load_testbed`).
        ValueError: a split larger than the probe set.
    """

    def __init__(
        self, testbed: Path, n_search: int = 128, n_heldout: int = 128, seq_len: int | None = None, batch_size: int = 64
    ) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from mergepipe.evaluate import classification_examples, load_testbed

        self.tb = load_testbed(testbed)
        self.tasks = list(self.tb.tasks)
        self.seq_len = seq_len or self.tb.seq_len
        tok = AutoTokenizer.from_pretrained(self.tb.tokenizer, local_files_only=True)
        self.heads = {}
        self.batches: dict[str, dict[str, list]] = {}
        for t in self.tasks:
            head = load_file(str(self.tb.tasks[t]["head"]))
            self.heads[t] = (head["weight"].float(), head["bias"].float())
            texts, labels = classification_examples(self.tb.tasks[t]["probe"])
            if n_search + n_heldout > len(texts):
                raise ValueError(f"{t}: {n_search} + {n_heldout} examples asked, the probe set has {len(texts)}")
            splits = {"search": range(0, n_search), "heldout": range(n_search, n_search + n_heldout)}
            self.batches[t] = {}
            for split, idx in splits.items():
                if not idx:
                    self.batches[t][split] = []
                    continue
                enc = tok([texts[i] for i in idx], truncation=True, max_length=self.seq_len)
                lens = [len(ids) for ids in enc["input_ids"]]
                order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
                out = []
                for s in range(0, len(order), batch_size):
                    part = order[s : s + batch_size]
                    width = max(lens[i] for i in part)
                    ids = torch.zeros((len(part), width), dtype=torch.long)
                    mask = torch.zeros((len(part), width), dtype=torch.long)
                    types = torch.zeros((len(part), width), dtype=torch.long)
                    for r, i in enumerate(part):
                        ids[r, : lens[i]] = torch.tensor(enc["input_ids"][i])
                        mask[r, : lens[i]] = 1
                        if "token_type_ids" in enc:
                            types[r, : lens[i]] = torch.tensor(enc["token_type_ids"][i])
                    y = torch.tensor([labels[idx[i]] for i in part])
                    out.append((ids, mask, types, y, [idx[i] for i in part]))
                self.batches[t][split] = out
        self.n = {"search": n_search, "heldout": n_heldout}
        self.model = AutoModel.from_config(AutoConfig.from_pretrained(self.tb.root / "base", local_files_only=True))
        self.model.eval()
        self._lock = threading.Lock()  # one skeleton: a load and its scoring must not interleave

    def load(self, model_dir: Path) -> None:
        """Load the checkpoint folder's weights (``*.safetensors``) into the skeleton.

        Raises:
            ValueError: a tensor of the encoder is missing from the checkpoint, or the checkpoint
                has tensors the encoder does not (a different architecture).
        """
        from safetensors.torch import load_file

        sd: dict = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            sd.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        unexpected = [k for k in unexpected if not k.endswith("position_ids")]  # a buffer some files hold
        if missing or unexpected:
            raise ValueError(f"{model_dir}: missing {missing[:3]}, unexpected {unexpected[:3]} tensors")

    def scores(self, model_dir: Path) -> dict[str, dict[str, dict]]:
        """``{split: {task: {"loss", "accuracy", "n", "hits"}}}`` of the checkpoint folder
        ``model_dir``: mean cross-entropy (nats/example), accuracy, examples, and the indices
        (in the probe file) of the examples it got right.

        Thread-safe: calls are serialised (the weights are loaded into the one skeleton, so
        two concurrent calls would otherwise score each other's weights)."""
        import torch
        import torch.nn.functional as F

        from mergepipe.evaluate import _torch_settings, mean_pool

        def run():
            self.load(model_dir)
            out: dict[str, dict[str, dict]] = {s: {} for s in self.n}
            with torch.inference_mode():
                for t in self.tasks:
                    W, b = self.heads[t]
                    for split, batches in self.batches[t].items():
                        loss, hits = 0.0, []
                        for ids, mask, types, y, where in batches:
                            h = self.model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
                            logits = mean_pool(h, mask) @ W.T + b
                            loss += float(F.cross_entropy(logits, y, reduction="sum"))
                            ok = (logits.argmax(-1) == y).tolist()
                            hits += [i for i, g in zip(where, ok) if g]
                        n = self.n[split]
                        out[split][t] = {"loss": loss / n, "accuracy": len(hits) / n, "n": n, "hits": sorted(hits)}
            return out

        with self._lock:  # the search's workers call this from two threads
            return _torch_settings(run)

    def metrics(self, model_dir: Path) -> dict[str, float]:
        """The search's metrics: ``loss:<task>`` and ``acc:<task>`` on the search examples,
        ``heldout:loss:<task>`` and ``heldout:acc:<task>`` on the held-out ones."""
        s = self.scores(model_dir)
        out = {}
        for t in self.tasks:
            out[f"loss:{t}"] = s["search"][t]["loss"]
            out[f"acc:{t}"] = s["search"][t]["accuracy"]
            out[f"heldout:loss:{t}"] = s["heldout"][t]["loss"]
            out[f"heldout:acc:{t}"] = s["heldout"][t]["accuracy"]
        return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class _Timer:
    """Wall and CPU seconds of this process (``time.process_time``: all its threads; with one
    torch thread, close to the work's own cost whatever the machine's load)."""

    def __enter__(self) -> _Timer:
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = round(time.perf_counter() - self.w0, 2)
        self.cpu = round(time.process_time() - self.c0, 2)


def check_against_reference(obj: MiniLMObjective, model_dir: Path) -> dict:
    """Score ``model_dir`` with ``obj`` and with ``mergepipe.evaluate.evaluate_checkpoint`` (the
    first ``n_search`` examples: ``max_batches`` of its 64-example batches), timed side by side.

    Raises:
        AssertionError: a different example is right/wrong, or a loss differs by more than 1e-4.
    """
    from mergepipe.evaluate import evaluate_checkpoint

    n = obj.n["search"]
    if n % obj.tb.batch_size:
        raise ValueError(f"the reference check needs n_search a multiple of {obj.tb.batch_size}")
    with _Timer() as t_ref:
        ref = evaluate_checkpoint(model_dir, obj.tb, max_batches=n // obj.tb.batch_size, per_item=True)
    with _Timer() as t_new:
        mine = obj.scores(model_dir)["search"]
    for t in obj.tasks:
        hits = [i for i, h in enumerate(ref[t]["items"]) if h]
        assert hits == mine[t]["hits"], f"{t}: per-example correctness differs"
        assert abs(ref[t]["loss"] - mine[t]["loss"]) < 1e-4, (t, ref[t]["loss"], mine[t]["loss"])
    return {
        "examples_per_task": n,
        "reference_s": t_ref.wall,
        "reference_cpu_s": t_ref.cpu,
        "objective_s": t_new.wall,
        "objective_cpu_s": t_new.cpu,
        "load": _load(),
    }


def time_proposals(dims: list[int], counts: list[int], objectives: int = 3, seed: int = 0) -> list[dict]:
    """Seconds of one BO proposal (:func:`mergepipe.search.optimizer.propose`, no prior, no
    reranking: the ``bo`` arms) with ``n`` observations in ``d`` dimensions, one pending point,
    on a smooth synthetic 3-objective problem; one thread."""
    import torch

    from mergepipe.search.optimizer import propose

    torch.set_num_threads(1)
    rng = random.Random(seed)
    out = []
    for d in dims:
        for n in counts:
            X = [[rng.random() for _ in range(d)] for _ in range(n)]
            Y = [[sum((x - (k + 1) / (objectives + 1)) ** 2 for x in p) / d for k in range(objectives)] for p in X]
            with _Timer() as tm:
                propose(X, Y, [1.0] * objectives, pending=[[0.5] * d], rerank=False, seed=seed)
            out.append({"d": d, "n": n, "seconds": tm.wall, "cpu_s": tm.cpu, "load": _load()})
            print(f"propose d={d} n={n}: {tm.wall} s, cpu {tm.cpu} s (load {out[-1]['load'][0]})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="testbed cache root (default ~/.mergepipe/minilm)")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="MiniLMConfig seed of the testbed (development: 0); only timings are recorded, no scores",
    )
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / ".work" / "search-minilm")
    ap.add_argument("--out", type=Path, default=None, help="write the measurement here (JSON)")
    ap.add_argument("--n", type=int, default=128, help="search (and held-out) examples per task")
    ap.add_argument("--candidates", type=int, default=4, help="real merges + scorings to time")
    ap.add_argument("--blocks", type=int, default=6, help="layer blocks of the timed merges (6: one per layer)")
    ap.add_argument("--runs", type=int, default=10, help="runs per arm of the projected run")
    ap.add_argument("--arms", type=int, default=8, help="arms of the projected run")
    ap.add_argument("--initial", type=int, default=8)
    ap.add_argument("--bo", type=int, default=40)
    ap.add_argument("--full-reference", action="store_true", help="also time mergepipe eval's 3 x 512 protocol")
    args = ap.parse_args()

    from mergepipe.catalog.objectstore import open_catalog
    from mergepipe.pipeline import register_and_analyze
    from mergepipe.search.runner import LocalMerger, SearchConfig
    from mergepipe.search.space import parse_vary, space_for_base
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage
    from mergepipe_zoo.minilm import MiniLMConfig, build_minilm

    rec: dict = {"machine": {"cpus": os.cpu_count()}, "load_start": _load(), "started": time.time()}
    bed = build_minilm(root=args.root, config=MiniLMConfig(seed=args.seed), log=print)
    rec["testbed"] = {"seed": args.seed, "key": bed.config.key(), "eval_examples": bed.config.eval_examples}
    args.work.mkdir(parents=True, exist_ok=True)

    with _Timer() as tm:
        obj = MiniLMObjective(bed.root, n_search=args.n, n_heldout=args.n)
    rec["objective_setup"] = {"s": tm.wall, "cpu_s": tm.cpu}
    lens = [int(b[1].sum(1).max()) for t in obj.tasks for b in obj.batches[t]["search"]]
    rec["seq_len"] = {"max_length": obj.seq_len, "batch_widths": sorted(lens)}
    rec["check"] = check_against_reference(obj, bed.base)
    print(f"objective == mergepipe eval on {args.n} examples/task: {rec['check']}", flush=True)
    if args.full_reference:
        from mergepipe.evaluate import evaluate_checkpoint

        full = MiniLMObjective(bed.root, n_search=bed.config.eval_examples, n_heldout=0)
        with _Timer() as t_ref:
            evaluate_checkpoint(bed.base, bed.root)
        with _Timer() as t_new:
            full.scores(bed.base)
        rec["full_512"] = {"reference_s": t_ref.wall, "reference_cpu_s": t_ref.cpu}
        rec["full_512"].update(objective_s=t_new.wall, objective_cpu_s=t_new.cpu, load=_load())
        print(f"3 x 512 examples: {rec['full_512']}", flush=True)

    names = list(bed.experts)
    cfg = SearchConfig(
        base=str(bed.base),
        experts=[[n, str(bed.experts[n])] for n in names],
        method="task_arithmetic",
        vary=["weight=0:1"],
        layer_blocks=args.blocks,
        objectives=[f"loss:{t}" for t in obj.tasks],
        evaluations=1,
        initial=1,
        catalog=str(args.work / "catalog.sqlite"),
    )
    cat = open_catalog(cfg.catalog)
    st = open_storage(None, IOCounters())
    with _Timer() as tm:
        register_and_analyze(cat, st, cfg.base, [u for _, u in cfg.experts], cfg.block_bytes)
    rec["catalog_analysis"] = {"s": tm.wall, "cpu_s": tm.cpu}  # once per testbed (cached)
    base = cat.register(st, cfg.base)
    space = space_for_base(list(base.layout.tensors), cfg.method, names, parse_vary(cfg.vary), args.blocks, {})
    rng = random.Random(args.seed)
    cands = []
    merger = LocalMerger(str(args.work / "snapshots"))
    for i in range(args.candidates):
        x = [rng.random() for _ in range(space.d)]
        shutil.rmtree(args.work / "snapshots" / f"c{i:04d}", ignore_errors=True)
        with _Timer() as t_merge:
            m = merger.merge(cfg, {"id": i, "params": space.to_params(x)}, args.work, {}, cat)
        with _Timer() as t_score:
            met = obj.metrics(Path(m.snapshot))
        shutil.rmtree(m.snapshot, ignore_errors=True)
        cands.append(
            {
                "merge_s": t_merge.wall,
                "merge_cpu_s": t_merge.cpu,
                "score_s": t_score.wall,
                "score_cpu_s": t_score.cpu,
                "load": _load(),
            }
        )
        print(f"candidate {i}: {cands[-1]}", flush=True)
        assert sorted(met) == sorted(
            f"{p}{m}:{t}" for p in ("", "heldout:") for m in ("loss", "acc") for t in obj.tasks
        )
    rec["candidates"] = cands
    rec["space_dims"] = space.d
    rec["proposals"] = time_proposals([len(names), space.d], [args.initial, args.initial + args.bo // 2, 47])

    n_eval = args.initial + args.bo
    rec["projection"] = {"evaluations_per_run": n_eval, "runs": args.runs, "arms": args.arms}
    for key, suffix in (("wall", "s"), ("cpu", "cpu_s")):
        per_eval = sum(c[f"merge_{suffix}"] + c[f"score_{suffix}"] for c in cands) / len(cands)
        props = [p["seconds" if key == "wall" else "cpu_s"] for p in rec["proposals"] if p["d"] == space.d]
        per_prop = sum(props) / len(props)  # mean at n = 8, 28, 47: about the mean over a run's 40 steps
        per_run = n_eval * per_eval + args.bo * per_prop
        rec["projection"][key] = {
            "per_evaluation_s": round(per_eval, 1),
            "per_proposal_s_layerwise": round(per_prop, 1),
            "per_run_s": round(per_run, 0),
            "all_arms_hours": round(per_run * args.runs * args.arms / 3600, 1),
            "two_arms_hours": round(per_run * args.runs * 2 / 3600, 1),
        }
    rec["projection"].update(
        {
            "binomial_se_points_at_p0.8": round(100 * binomial_se(0.8, args.n), 2),
            "wilson95_at_p0.8": [round(100 * v, 1) for v in wilson_interval(round(0.8 * args.n), args.n)],
        }
    )
    rec["load_end"] = _load()
    rec["wall_s"] = round(time.time() - rec.pop("started"), 1)
    print(json.dumps(rec["projection"], indent=1), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
