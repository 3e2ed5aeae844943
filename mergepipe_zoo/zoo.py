"""A deterministic, offline "model zoo" of small *real trained* Llama models.

The zoo is a base model pretrained on a mixture of four text domains plus one (or more) full
fine-tunes of it per domain ("experts"). Everything is built locally from data that exists on any
Python install, so demos, tests and benchmarks get genuine fine-tuning task vectors and a
measurable merge trade-off without network access:

* ``python``     -- source files of the Python standard library (tests excluded);
* ``prose``      -- English prose: ``pydoc_data.topics`` and docstrings of stdlib modules;
* ``arithmetic`` -- generated column additions such as ``37 + 58 : ... ; 37 + 58 = 95`` (seeded RNG);
* ``json``       -- generated JSON records, one per line (seeded RNG).

Each domain has a held-out evaluation set that no model saw in training. :func:`evaluate` returns
the mean per-token cross-entropy (nats/token) of any HF causal-LM checkpoint on those sets, so a
merged model can be scored against the base and the experts.

Layout of a built zoo (``root/<config.key()>/``)::

    zoo.json                  manifest (config, relative paths, sha256 of every file)
    tokenizer/                byte-level BPE tokenizer (PreTrainedTokenizerFast files)
    base/                     HF checkpoint: config.json, generation_config.json, tokenizer,
                              model-0000i-of-0000n.safetensors (bf16), model.safetensors.index.json
    experts/<name>/           one HF checkpoint per expert (name = domain, or domain-2, ...)
    eval/<domain>.jsonl       held-out documents, one ``{"text": ...}`` object per line
    calibration.jsonl         a little *training* text of every domain (``{"text": ...}`` lines,
                              domains interleaved) for ``mergepipe analyze --calibration``
    testbed.json              what ``mergepipe eval`` reads (tasks, probe sets, calibration)

Builds are cached, atomic (a temp dir beside the cache entry is renamed into place at the end)
and serialised between processes with an ``fcntl`` lock. On one machine (same Python, torch,
transformers and tokenizers versions) the same config gives byte-identical checkpoints.

``import mergepipe_zoo`` is cheap: torch, transformers and tokenizers are imported inside the
functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mergepipe_zoo._cache import cached_build

__all__ = ["DOMAINS", "ZooConfig", "Zoo", "default_zoo_root", "build_zoo", "evaluate"]

DOMAINS: tuple[str, ...] = ("python", "prose", "arithmetic", "json")
"""The text domains of the zoo; every build has one expert (or more) per domain."""

ZOO_FORMAT = 3  # 3: fine-tunes at about the base's final learning rate, calibration.jsonl; 2: a well-trained base, short low-LR fine-tunes, build gates, testbed.json. Bump when the data, training recipe or layout changes (invalidates the cache)
_MANIFEST = "zoo.json"
TESTBED = "testbed.json"
CALIBRATION = "calibration.jsonl"
CALIBRATION_DOCS = 8  # training documents per domain in calibration.jsonl
GATE_MIN_GAIN = 0.30  # the merge must keep >= 30% of every expert's normalised gain
_PAD, _BOS, _EOS = "<pad>", "<s>", "</s>"  # token ids 0, 1, 2
_NUM_THREADS = 1  # fixed so that results do not depend on the core count; 1 is also fastest on a shared machine


# --------------------------------------------------------------------------------------------
# configuration and result types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooConfig:
    """Sizes and training recipe of a zoo. The defaults are the demo size (~5.3 M parameters,
    every 2-D weight >= 128 KiB in bf16; 820 optimizer steps in all, build times in
    docs/QUALITY.md); :meth:`tiny` is a minutes-scale variant for tests and the quality benchmark.

    The recipe is the regime task arithmetic works in: a base trained on the four-domain mixture
    with a cosine schedule down to 10 % of ``lr``, then short fine-tunes that continue at about
    that final learning rate (``expert_lr`` <= 2 x ``lr / 10``) with replay. Fine-tuning at a
    learning rate several times the base's final one re-warms the optimiser: every expert then
    moves the whole model (loss up on the other domains) and the merged task vectors interfere
    (measured in docs/QUALITY.md, "The zoo's recipe").

    Attributes:
        hidden_size: model width ``d``. Must be divisible by ``num_heads`` with an even head dim.
        intermediate_size: MLP width (``gate_proj``/``up_proj`` are ``[intermediate, d]``).
        num_layers: number of decoder layers.
        num_heads: attention heads (no GQA: ``num_key_value_heads == num_heads``).
        vocab_size: BPE vocabulary size (incl. 3 special tokens); embedding and the untied
            ``lm_head`` are ``[vocab_size, d]``.
        seq_len: training/eval window length in tokens (also ``max_position_embeddings``).
        base_steps: optimizer steps of base pretraining on the domain mixture.
        expert_steps: optimizer steps of each expert's full fine-tune on its own domain.
        batch_size: sequences per step (training) and per batch (evaluation).
        lr: peak AdamW learning rate of base pretraining.
        expert_lr: peak AdamW learning rate of the expert fine-tunes.
        seed: master seed; every other seed is derived from it.
        n_experts_per_domain: experts per domain; replica ``r >= 2`` is named ``"<domain>-<r>"``.
            Every replica starts from the base and trains on the same domain text, but with its
            own seed, i.e. its own random sample of training windows and their order.
        max_shard_size: ``save_pretrained`` shard limit (e.g. ``"4MB"``); it must be small
            enough that every checkpoint has >= 2 shards (checked at build time).
        corpus_chars: training text per domain, in characters (also feeds the tokenizer).
        eval_sequences: held-out windows of ``seq_len`` tokens per domain used by
            :func:`evaluate`.
        expert_mix: share of each fine-tuning batch drawn from the base's four-domain mixture
            (replay; in eighths: 0.5 = 4 rows in 8 from the mixture, one per domain, the rest from
            the expert's domain). Replay keeps an expert's change specific to its domain (little
            forgetting elsewhere), the regime where task vectors add up.
        merge_weight: task_arithmetic weight λ of the gates' full merge
            ``base + λ/r · Σ δ`` (``r = n_experts_per_domain``); also the testbed's recommended
            ``weight`` parameter per expert (``testbed.json``).
        enforce_gates: raise :class:`ZooGateError` when the build gates (:func:`check_gates`)
            fail, before anything is published (False: record the report and keep the zoo).
    """

    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    vocab_size: int = 4096
    seq_len: int = 128
    base_steps: int = 500
    expert_steps: int = 80
    batch_size: int = 16
    lr: float = 2e-3
    expert_lr: float = 3e-4
    seed: int = 0
    n_experts_per_domain: int = 1
    max_shard_size: str = "4MB"
    corpus_chars: int = 1_000_000
    eval_sequences: int = 64
    expert_mix: float = 0.5
    merge_weight: float = 0.25
    enforce_gates: bool = True

    def __post_init__(self) -> None:  # noqa: C901, PLR0912 - one type/range check per ZooConfig field, each naming the field
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "enforce_gates":
                if not isinstance(v, bool):
                    raise ValueError(f"ZooConfig.enforce_gates must be a bool, got {v!r}")
            elif f.name == "expert_mix":
                if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                    raise ValueError(f"ZooConfig.expert_mix must be in [0, 1), got {v!r}")
            elif f.name in ("lr", "expert_lr", "merge_weight"):
                if not (isinstance(v, (int, float)) and v > 0):
                    raise ValueError(f"ZooConfig.{f.name} must be a positive number, got {v!r}")
            elif f.name == "max_shard_size":
                if not isinstance(v, (str, int)) or not str(v):
                    raise ValueError(f"ZooConfig.max_shard_size must be like '4MB', got {v!r}")
            elif f.name == "seed":
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"ZooConfig.seed must be an int >= 0, got {v!r}")
            elif f.name in ("base_steps", "expert_steps"):
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"ZooConfig.{f.name} must be an int >= 0, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ZooConfig.{f.name} must be an int >= 1, got {v!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"ZooConfig: hidden_size={self.hidden_size} must be a multiple of num_heads="
                f"{self.num_heads} with an even head dim (RoPE)"
            )
        if self.vocab_size < 300:
            raise ValueError(f"ZooConfig.vocab_size must be >= 300 (256 bytes + specials), got {self.vocab_size}")
        if self.seq_len < 8:
            raise ValueError(f"ZooConfig.seq_len must be >= 8, got {self.seq_len}")

    @classmethod
    def tiny(cls, **overrides) -> ZooConfig:
        """A small config for tests and bench/quality.py: ~0.2 M parameters, 620 optimizer steps
        (about 4-8 min on one thread of a loaded 2-core machine), still >= 2 shards per checkpoint
        and passing the build gates (seeds 0, 1, 2 measured). Keyword arguments override fields."""
        base: dict[str, Any] = dict(
            hidden_size=64,
            intermediate_size=176,
            num_layers=2,
            num_heads=2,
            vocab_size=1024,
            seq_len=64,
            base_steps=300,
            expert_steps=80,
            batch_size=16,
            lr=3e-3,
            expert_lr=5e-4,
            max_shard_size="200KB",
            corpus_chars=200_000,
            eval_sequences=32,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def deep(cls, **overrides) -> ZooConfig:
        """:meth:`tiny` with 8 decoder layers (~0.53 M parameters): a testbed where per-layer merge
        parameters have depth to act on (bench/search.py, docs/SEARCH.md), four experts, built in
        ~4 min at nice 15 on the loaded 2-core machine (seed 0: gates passed, measured in
        docs/SEARCH.md). Keyword arguments override fields."""
        return cls.tiny(**{"num_layers": 8, **overrides})

    def key(self) -> str:
        """Short stable hash (16 hex chars) of the config and the zoo format version; names the
        cache directory ``root/<key>``."""
        blob = json.dumps({"format": ZOO_FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def expert_names(self) -> list[str]:
        """Expert names in build order: ``python, prose, ..., python-2, prose-2, ...``."""
        return [d if r == 1 else f"{d}-{r}" for r in range(1, self.n_experts_per_domain + 1) for d in DOMAINS]


@dataclass(frozen=True)
class Zoo:
    """A built zoo (all paths absolute).

    Attributes:
        root: the cache entry ``<root>/<config.key()>``.
        base: HF checkpoint folder of the base model.
        experts: expert name -> HF checkpoint folder (name = domain, or ``domain-2`` ...).
        eval_sets: domain -> held-out ``.jsonl`` file (one ``{"text": ...}`` document a line).
        config: the config the zoo was built with.
        gates: the build gates' report (:func:`check_gates`) recorded in the manifest.
    """

    root: Path
    base: Path
    experts: dict[str, Path]
    eval_sets: dict[str, Path]
    config: ZooConfig
    gates: dict = field(default_factory=dict, compare=False)

    @property
    def testbed(self):
        """The zoo's ``testbed.json`` parsed (:class:`mergepipe.evaluate.Testbed`), what
        ``mergepipe eval SNAPSHOT --testbed <zoo root>`` reads."""
        from mergepipe.evaluate import load_testbed

        return load_testbed(self.root)

    @property
    def tokenizer_dir(self) -> Path:
        """Folder with the zoo's tokenizer (same files as in every checkpoint folder)."""
        return self.root / "tokenizer"

    def expert_domain(self, name: str) -> str:
        """Domain of expert ``name`` (``"python-2"`` -> ``"python"``). Raises KeyError if unknown."""
        if name not in self.experts:
            raise KeyError(f"no expert {name!r} in zoo; have {sorted(self.experts)}")
        return name.rsplit("-", 1)[0] if name not in DOMAINS else name


def default_zoo_root() -> Path:
    """``$MERGEPIPE_HOME/zoo`` if ``MERGEPIPE_HOME`` is set, else ``~/.mergepipe/zoo``."""
    home = os.environ.get("MERGEPIPE_HOME")
    return (Path(home) if home else Path.home() / ".mergepipe") / "zoo"


# --------------------------------------------------------------------------------------------
# data (pure Python, deterministic)
# --------------------------------------------------------------------------------------------


def _stable_order(items: list[str], salt: str) -> list[str]:
    """A deterministic pseudo-random permutation (by sha256 of salt + item)."""
    return sorted(items, key=lambda s: hashlib.sha256(f"{salt}/{s}".encode()).digest())


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(relative path, path) of stdlib ``.py`` files, tests/site-packages/generated data excluded."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "pydoc_data",  # prose domain source
        "encodings",  # generated codec tables
    }
    out = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)  # prune, don't descend
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                p = Path(dirpath, name)
                out.append((p.relative_to(stdlib).as_posix(), p))
    out.sort()
    if not out:
        raise RuntimeError(f"no Python standard library sources found under {stdlib}")
    return out


def _read_text(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if 200 <= len(text) <= 400_000 else None


def _docstrings(source: str) -> list[str]:
    """Module/class/function docstrings of ``source``, doctest lines removed, >= 80 chars."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            lines = [ln for ln in doc.splitlines() if not ln.lstrip().startswith((">>>", "... "))]
            doc = "\n".join(lines).strip()
            if len(doc) >= 80:
                out.append(doc)
    return out


def _head(text: str, n: int = 3000, middle: bool = False) -> str:
    """At most ``n`` chars of ``text`` cut at line boundaries: its beginning, or (``middle``) a
    piece from its middle (the body of a source file rather than its license and docstring).
    Held-out documents are capped like this so that the eval set spans many files/topics."""
    if len(text) <= n:
        return text
    start = 0
    if middle:
        nl = text.find("\n", (len(text) - n) // 2)
        start = nl + 1 if 0 <= nl < len(text) - n // 2 else (len(text) - n) // 2
    cut = text.rfind("\n", start, start + n)
    return text[start : cut if cut > start + n // 2 else start + n]


def _fill(docs, budget: int) -> list[str]:
    out, n = [], 0
    for d in docs:
        if n >= budget:
            break
        out.append(d)
        n += len(d) + 1
    return out


def _python_and_prose(cfg: ZooConfig, eval_chars: int) -> dict[str, tuple[list[str], list[str]]]:
    """Python and prose documents. Stdlib files are taken in a seeded pseudo-random order: the
    first ``eval_chars`` worth are held out (neither their code nor their docstrings train),
    the rest feed the python training set and the docstrings of the prose training set."""
    files = dict(_stdlib_sources())
    order = _stable_order(list(files), f"zoo-python-{cfg.seed}")
    texts = (t for t in map(_read_text, (files[rel] for rel in order)) if t is not None)
    py_eval, n_eval = [], 0
    for text in texts:
        py_eval.append(_head(text, middle=True))
        n_eval += len(py_eval[-1])
        if n_eval >= eval_chars:
            break
    pool: list[str] = []  # non-held-out files, read lazily

    def train_files():
        yield from list(pool)
        for t in texts:
            pool.append(t)
            yield t

    py_train = _fill(train_files(), cfg.corpus_chars)

    from pydoc_data.topics import topics

    keys = _stable_order(sorted(topics), f"zoo-prose-{cfg.seed}")
    prose_eval, prose_train, n_eval = [], [], 0
    for k in keys:
        text = topics[k].strip()
        if n_eval < eval_chars:
            prose_eval.append(_head(text))
            n_eval += len(prose_eval[-1])
        else:
            prose_train.append(text)
    need = cfg.corpus_chars - sum(len(t) + 1 for t in prose_train)
    if need > 0:
        extra: list[str] = []
        n_extra = 0
        for text in train_files():
            if n_extra >= need:
                break
            for doc in _docstrings(text):
                extra.append(doc)
                n_extra += len(doc) + 1
        prose_train = prose_train + _fill(extra, need)
    else:
        prose_train = _fill(prose_train, cfg.corpus_chars)
    return {"python": (py_train, py_eval), "prose": (prose_train, prose_eval)}


def _arith_line(rng: random.Random) -> tuple[str, bool]:
    """One worked column addition and whether it is held out, e.g.
    ``864 + 394 : 4 + 4 = 8 , 6 + 9 = 15 , 8 + 3 + 1 = 12 ; 864 + 394 = 1258 ; 1258 - 394 = 864``.

    The digit-by-digit working makes most tokens learnable (single-digit facts, carries, copies)
    while the problems themselves are partitioned: a pair ``(a, b)`` is either always held out
    or never, so eval problems never occur in training."""
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    n = max(len(str(a)), len(str(b)))
    da, db = str(a).zfill(n), str(b).zfill(n)
    steps, carry = [], 0
    for i in range(n - 1, -1, -1):
        x, y = int(da[i]), int(db[i])
        s = x + y + carry
        steps.append(f"{x} + {y} + 1 = {s}" if carry else f"{x} + {y} = {s}")
        carry = s // 10
    line = f"{a} + {b} : " + " , ".join(steps) + f" ; {a} + {b} = {a + b} ; {a + b} - {b} = {a}"
    h = ((a * 1000 + b) * 2654435761) & 0xFFFFFFFF
    return line, (h >> 7) % 10 == 0


def _arithmetic(cfg: ZooConfig, eval_chars: int) -> tuple[list[str], list[str]]:
    """Documents of 8 worked problems (see :func:`_arith_line`); train/held-out by problem."""
    lines: dict[bool, list[str]] = {False: [], True: []}
    budget = {False: cfg.corpus_chars, True: eval_chars}
    size = {False: 0, True: 0}
    rng = random.Random(f"zoo-arithmetic-{cfg.seed}")
    while size[False] < budget[False] or size[True] < budget[True]:
        line, held = _arith_line(rng)
        if size[held] < budget[held]:
            lines[held].append(line)
            size[held] += len(line) + 1
    docs = {k: ["\n".join(v[i : i + 8]) for i in range(0, len(v), 8)] for k, v in lines.items()}
    return docs[False], docs[True]


_FIRST = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Peter "
    "Quinn Rachel Samuel Tina Umar Victor Wendy Xavier Yara Zoe Ahmed Bianca Chen Dmitri Elena "
    "Fatima Giorgio Hana Ivan Jun Kofi Lucia Mateo Nadia Oscar Priya Rosa Sven Tariq Ursula Wei"
).split()
_LAST = (
    "Smith Johnson Garcia Brown Miller Davis Lopez Wilson Anderson Thomas Taylor Moore Martin Lee "
    "Walker Hall Young King Wright Scott Green Baker Adams Nelson Hill Campbell Mitchell Roberts "
    "Carter Phillips Evans Turner Torres Parker Collins Edwards Stewart Morris Nguyen Murphy Rivera"
).split()
_CITIES = (
    "Berlin Paris London Madrid Rome Vienna Prague Lisbon Dublin Oslo Stockholm Helsinki Warsaw "
    "Athens Boston Chicago Denver Austin Seattle Toronto Montreal Sydney Melbourne Tokyo Osaka Seoul"
).split()
_MAIL = ("example.com", "mail.org", "inbox.net", "corp.io", "post.de")
_TAGS = "new sale premium eco vintage limited bulk gift imported local organic refurbished".split()
_ADJ = "red blue green small large light heavy smart classic modern compact wireless steel wooden".split()
_NOUN = "lamp chair desk phone kettle backpack bottle speaker keyboard monitor jacket blender".split()
_EVENTS = "login logout purchase refund signup click view search share download".split()
_STATUS = "pending paid shipped delivered cancelled returned".split()


def _json_record(rng: random.Random) -> str:
    kind = rng.choice(("user", "product", "event", "order"))
    if kind == "user":
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        rec = {
            "type": "user",
            "id": rng.randint(1, 99999),
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}@{rng.choice(_MAIL)}",
            "age": rng.randint(18, 90),
            "active": rng.random() < 0.7,
            "city": rng.choice(_CITIES),
            "tags": rng.sample(_TAGS, rng.randint(0, 3)),
        }
    elif kind == "product":
        adj, noun = rng.choice(_ADJ), rng.choice(_NOUN)
        rec = {
            "type": "product",
            "sku": f"{noun[:3].upper()}-{rng.randint(1000, 9999)}",
            "name": f"{adj} {noun}",
            "price": round(rng.uniform(1, 500), 2),
            "stock": rng.randint(0, 1000),
            "tags": rng.sample(_TAGS, rng.randint(1, 3)),
        }
    elif kind == "event":
        rec = {
            "type": "event",
            "event": rng.choice(_EVENTS),
            "user_id": rng.randint(1, 99999),
            "ts": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z",
            "ok": rng.random() < 0.9,
        }
    else:
        n = rng.randint(1, 3)
        items = [
            {"sku": f"{rng.choice(_NOUN)[:3].upper()}-{rng.randint(1000, 9999)}", "qty": rng.randint(1, 5)}
            for _ in range(n)
        ]
        rec = {
            "type": "order",
            "order_id": rng.randint(100000, 999999),
            "status": rng.choice(_STATUS),
            "items": items,
            "total": round(rng.uniform(5, 2000), 2),
            "shipping": {"city": rng.choice(_CITIES), "express": rng.random() < 0.3},
        }
    return json.dumps(rec)


def _json_docs(cfg: ZooConfig, eval_chars: int) -> tuple[list[str], list[str]]:
    """Documents of 8 JSON lines; train and eval come from independent RNG streams."""
    out = []
    for split, budget in (("train", cfg.corpus_chars), ("eval", eval_chars)):
        rng = random.Random(f"zoo-json-{split}-{cfg.seed}")
        docs, n = [], 0
        while n < budget:
            doc = "\n".join(_json_record(rng) for _ in range(8))
            docs.append(doc)
            n += len(doc) + 1
        out.append(docs)
    return out[0], out[1]


def _corpora(cfg: ZooConfig) -> dict[str, tuple[list[str], list[str]]]:
    """domain -> (train documents, held-out documents). Held-out text is generous (~8 chars per
    eval token); it is trimmed to what the eval windows need once the tokenizer exists."""
    eval_chars = cfg.eval_sequences * cfg.seq_len * 8
    out = _python_and_prose(cfg, eval_chars)
    out["arithmetic"] = _arithmetic(cfg, eval_chars)
    out["json"] = _json_docs(cfg, eval_chars)
    return {d: out[d] for d in DOMAINS}


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def _train_tokenizer(cfg: ZooConfig, corpora: dict[str, tuple[list[str], list[str]]]):
    """Byte-level BPE (digits split individually) trained on the training documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=[_PAD, _BOS, _EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    per_domain = min(cfg.corpus_chars, 400_000)
    texts = [doc for d in DOMAINS for doc in _fill(corpora[d][0], per_domain)]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _wrap_tokenizer(tok, cfg: ZooConfig):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        model_max_length=cfg.seq_len,
        clean_up_tokenization_spaces=False,
    )


def _save_tokenizer(hf_tok, out: Path) -> None:
    """``save_pretrained`` the tokenizer, naming its class ``PreTrainedTokenizerFast`` (what
    transformers 4.x knows; transformers 5 aliases it to its ``TokenizersBackend``)."""
    hf_tok.save_pretrained(out)
    p = out / "tokenizer_config.json"
    conf = json.loads(p.read_text(encoding="utf-8"))
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    p.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _token_stream(tok, docs: list[str], eos_id: int):
    """1-D int64 tensor: the documents' tokens, each followed by EOS."""
    import numpy as np
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


def _derive_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def _llama_config(cfg: ZooConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.seq_len,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=True,
    )


def _train(
    model,
    streams: list,
    steps: int,
    lr: float,
    weight_decay: float,
    seed: int,
    cfg: ZooConfig,
    log: Callable[[str], None],
    label: str,
) -> None:
    """AdamW (float32), linear warmup (10 %) + cosine decay to 10 % of ``lr``, grad clip 1.0.
    Batch row ``j`` of step ``s`` is a random window of ``streams[(s * B + j) % len(streams)]``."""
    import math

    import torch

    if steps == 0:
        return
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False
    )
    warm = max(1, steps // 10)

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        t = (s - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    L, B = cfg.seq_len, cfg.batch_size
    offs = torch.arange(L)
    model.train()
    t0, ema = time.perf_counter(), None
    for s in range(steps):
        rows = []
        for j in range(B):
            st = streams[(s * B + j) % len(streams)]
            start = int(torch.randint(0, len(st) - L + 1, (1,), generator=g))
            rows.append(st[start + offs])
        batch = torch.stack(rows)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        v = loss.detach().item()
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        if (s + 1) % max(1, steps // 5) == 0 or s + 1 == steps:
            log(f"  {label}: step {s + 1}/{steps} loss {ema:.3f} ({time.perf_counter() - t0:.1f}s)")
    model.eval()


def _save_checkpoint(model, hf_tok, out: Path, cfg: ZooConfig) -> None:
    """Save ``model`` (float32) as a bf16 sharded safetensors HF checkpoint + tokenizer."""
    import copy

    import torch

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.save_pretrained(out, max_shard_size=cfg.max_shard_size)
    _save_tokenizer(hf_tok, out)
    mode = (out / "config.json").stat().st_mode & 0o777
    for p in out.glob("*.safetensors"):  # safetensors writes 0600; use the umask like the rest
        os.chmod(p, mode)
    shards = sorted(out.glob("*.safetensors"))
    if len(shards) < 2 or not (out / "model.safetensors.index.json").is_file():
        raise ValueError(
            f"checkpoint {out.name} has {len(shards)} safetensors shard(s); lower "
            f"ZooConfig.max_shard_size (now {cfg.max_shard_size!r}) so that it has >= 2"
        )


def _bf16_round_trip(model) -> dict:
    import torch

    return {k: v.detach().to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()}


def _expert_streams(streams: dict, domain: str, mix: float) -> list:
    """Row pattern of an expert's batches (see :func:`_train`): 8 slots, ``round(8 * mix)`` of
    them cycling over the four domains (replay), the rest the expert's own domain."""
    n_mix = round(8 * mix)
    return [streams[domain]] * (8 - n_mix) + [streams[DOMAINS[i % len(DOMAINS)]] for i in range(n_mix)]


def _calibration_docs(corpora: dict[str, tuple[list[str], list[str]]]) -> list[str]:
    """The zoo's calibration set: the first :data:`CALIBRATION_DOCS` *training* documents of every
    domain (never held-out text), each cut to at most 600 characters at a line end, domains
    interleaved (python, prose, arithmetic, json, python, ...) so that the first sequences of the
    Fisher statistic (:mod:`mergepipe.catalog.sensitivity`, at most 32 x 128 tokens) see every
    domain."""
    out = []
    for i in range(CALIBRATION_DOCS):
        for d in DOMAINS:
            train = corpora[d][0]
            if i < len(train):
                out.append(_head(train[i], 600))
    return out


class ZooGateError(ValueError):
    """A built zoo failed its gates (:func:`check_gates`): merging would not help on it."""


def _testbed_json(cfg: ZooConfig, eval_files: dict[str, str]) -> dict:
    """The zoo's ``testbed.json`` (see :mod:`mergepipe.evaluate`)."""
    return {
        "format": 1,
        "kind": "causal-lm",
        "tokenizer": "tokenizer",
        "eos_token": _EOS,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "max_windows": cfg.eval_sequences,
        "tasks": {d: {"probe": eval_files[d]} for d in DOMAINS},
        "base": "base",
        "experts": {n: f"experts/{n}" for n in cfg.expert_names()},
        "expert_task": {n: (n if n in DOMAINS else n.rsplit("-", 1)[0]) for n in cfg.expert_names()},
        "metric": "loss",
        "calibration": CALIBRATION,
        "recommended_params": {"task_arithmetic": {"weight": cfg.merge_weight / cfg.n_experts_per_domain}},
    }


def check_gates(
    base: dict[str, float],
    experts: dict[str, dict[str, float]],
    merged: dict[str, float],
    min_gain: float = GATE_MIN_GAIN,
) -> dict:
    """The zoo's build gates: does merging help on it?

    1. every expert is the best model on its own domain: lower loss there than the base and
       than every expert of another domain;
    2. the full task_arithmetic merge has a lower mean loss than the base;
    3. the merge keeps at least ``min_gain`` of every expert's normalised gain
       ``(L_base − L_merge) / (L_base − L_expert)`` on the expert's domain
       (:func:`mergepipe.metrics.normalised_gain`).

    Args:
        base: ``{domain: loss}`` of the base; experts: ``{expert name: {domain: loss}}`` (name =
            domain, or ``domain-r``); merged: ``{domain: loss}`` of the full merge.

    Returns:
        ``{"passed": bool, "failures": [str], "best_on_own_domain": {expert: bool},
        "normalised_gain": {expert: float}, "base_mean_loss", "merge_mean_loss", "min_gain"}``.
    """
    failures = []
    dom = {n: (n if n in DOMAINS else n.rsplit("-", 1)[0]) for n in experts}
    best, ng = {}, {}
    for n, d in dom.items():
        others = [experts[o][d] for o in experts if dom[o] != d]
        best[n] = experts[n][d] < min([base[d], *others])
        if not best[n]:
            failures.append(
                f"expert {n} is not the best model on {d} ({experts[n][d]:.4f} vs base "
                f"{base[d]:.4f}, other experts {min(others, default=math.inf):.4f})"
            )
        den = base[d] - experts[n][d]
        ng[n] = (base[d] - merged[d]) / den if den > 0 else -math.inf
        if not ng[n] >= min_gain:
            failures.append(f"the merge keeps {ng[n]:.3f} of expert {n}'s normalised gain on {d} (< {min_gain})")
    bm, mm = sum(base.values()) / len(base), sum(merged.values()) / len(merged)
    if not mm < bm:
        failures.append(f"the merge's mean loss {mm:.4f} is not below the base's {bm:.4f}")
    return {
        "passed": not failures,
        "failures": failures,
        "best_on_own_domain": best,
        "normalised_gain": ng,
        "base_mean_loss": bm,
        "merge_mean_loss": mm,
        "min_gain": min_gain,
        "losses": {"base": base, "experts": experts, "merge": merged},
    }


def _build_into(tmp: Path, cfg: ZooConfig, log: Callable[[str], None]) -> dict:
    """Build every artifact into ``tmp``; return the manifest (without file hashes).

    Steps (in this order, which fixes every random draw): corpora -> tokenizer -> held-out and
    calibration sets -> token streams -> base -> testbed -> experts (each scored) -> gates.
    """
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    corpora = _corpora(cfg)
    log(
        "data: "
        + ", ".join(f"{d} {sum(map(len, corpora[d][0])) / 1e6:.2f}M chars" for d in DOMAINS)
        + f" ({time.perf_counter() - t0:.1f}s)"
    )

    tok = _train_tokenizer(cfg, corpora)
    hf_tok = _wrap_tokenizer(tok, cfg)
    _save_tokenizer(hf_tok, tmp / "tokenizer")
    log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.perf_counter() - t0:.1f}s)")

    eval_files = _write_eval_sets(tmp, cfg, tok, corpora, log)
    streams = _token_streams(cfg, tok, corpora, t0, log)
    del corpora

    lcfg = _llama_config(cfg)
    base_sd, n_params = _train_base(tmp, cfg, lcfg, hf_tok, streams, log)

    (tmp / TESTBED).write_text(json.dumps(_testbed_json(cfg, eval_files), indent=1) + "\n")
    from mergepipe.evaluate import causal_lm_windows, load_testbed

    windows = causal_lm_windows(load_testbed(tmp), DOMAINS)
    gate_model = LlamaForCausalLM(lcfg)
    gate_model.eval()
    losses_of = _LossProbe(gate_model, windows, cfg.batch_size)
    base_losses = losses_of(base_sd)
    experts, expert_losses, merged_losses = _train_experts(tmp, cfg, lcfg, hf_tok, streams, base_sd, losses_of, log)
    log(f"trained base + {len(experts)} experts ({time.perf_counter() - t0:.1f}s)")
    gates = _check_zoo_gates(cfg, base_losses, expert_losses, merged_losses, log)
    return _zoo_manifest(cfg, experts, eval_files, n_params, gates)


def _write_eval_sets(tmp: Path, cfg: ZooConfig, tok: Any, corpora: dict, log: Callable[[str], None]) -> dict[str, str]:
    """Write the held-out sets (``eval/<domain>.jsonl``: just enough documents to fill
    ``eval_sequences`` windows, plus one spare) and the calibration set; returns domain -> path."""
    (tmp / "eval").mkdir()
    need = cfg.eval_sequences * cfg.seq_len
    eval_files = {}
    for d in DOMAINS:
        docs, n = [], 0
        for doc, enc in zip(corpora[d][1], tok.encode_batch(corpora[d][1], add_special_tokens=False)):
            docs.append(doc)
            n += len(enc.ids) + 1
            if n >= need + cfg.seq_len:
                break
        if n < need:
            log(f"warning: held-out {d} text gives only {n // cfg.seq_len} windows")
        rel = f"eval/{d}.jsonl"
        (tmp / rel).write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
        eval_files[d] = rel

    (tmp / CALIBRATION).write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _calibration_docs(corpora)), encoding="utf-8"
    )
    return eval_files


def _token_streams(cfg: ZooConfig, tok: Any, corpora: dict, t0: float, log: Callable[[str], None]) -> dict:
    """Each domain's training text as one token stream (documents joined by EOS).

    Raises:
        ValueError: a domain with less than one training window of text.
    """
    eos = tok.token_to_id(_EOS)
    streams = {d: _token_stream(tok, corpora[d][0], eos) for d in DOMAINS}
    for d, st in streams.items():
        if len(st) < cfg.seq_len + 1:
            raise ValueError(f"ZooConfig.corpus_chars={cfg.corpus_chars} gives too little {d} text")
    log(
        "tokens: "
        + ", ".join(f"{d} {len(streams[d]) / 1e3:.0f}k" for d in DOMAINS)
        + f" ({time.perf_counter() - t0:.1f}s)"
    )
    return streams


def _train_base(
    tmp: Path, cfg: ZooConfig, lcfg: Any, hf_tok: Any, streams: dict, log: Callable[[str], None]
) -> tuple[dict, int]:
    """Train the base on the domain mixture and save it to ``base/``; returns its bf16-rounded
    state dict (what the experts start from) and its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(lcfg)
    model.generation_config.pad_token_id = 0
    n_params = sum(p.numel() for p in model.parameters())
    log(f"base: {n_params / 1e6:.2f}M params, {cfg.base_steps} steps on the domain mixture")
    _train(
        model,
        [streams[d] for d in DOMAINS],
        cfg.base_steps,
        cfg.lr,
        0.1,
        _derive_seed(cfg.seed, "base-data"),
        cfg,
        log,
        "base",
    )
    _save_checkpoint(model, hf_tok, tmp / "base", cfg)
    return _bf16_round_trip(model), n_params  # experts start from the released (bf16) base


class _LossProbe:
    """Held-out loss per domain of a state dict, on one reused model (``causal_lm_losses``)."""

    def __init__(self, model: Any, windows: Any, batch_size: int) -> None:
        self.model, self.windows, self.batch_size = model, windows, batch_size

    def __call__(self, sd: dict) -> dict[str, float]:
        from mergepipe.evaluate import causal_lm_losses

        self.model.load_state_dict(sd)
        return {d: r["loss"] for d, r in causal_lm_losses(self.model, self.windows, self.batch_size).items()}


def _train_experts(
    tmp: Path,
    cfg: ZooConfig,
    lcfg: Any,
    hf_tok: Any,
    streams: dict,
    base_sd: dict,
    losses_of: _LossProbe,
    log: Callable[[str], None],
) -> tuple[dict[str, str], dict[str, dict[str, float]], dict[str, float]]:
    """Fine-tune and save each expert (``experts/<name>``) from the base; score each, and the
    task-arithmetic merge of all (weight ``merge_weight / n_experts_per_domain``). Returns
    name -> path, the experts' losses and the merge's losses."""
    import torch
    from transformers import LlamaForCausalLM

    expert_losses: dict[str, dict[str, float]] = {}
    merged_delta = {k: torch.zeros_like(v) for k, v in base_sd.items()}
    w = cfg.merge_weight / cfg.n_experts_per_domain
    experts = {}
    for name in cfg.expert_names():
        domain, r = (name, 1) if name in DOMAINS else (name.rsplit("-", 1)[0], int(name.rsplit("-", 1)[1]))
        torch.manual_seed(_derive_seed(cfg.seed, "expert-init", domain, r))
        model = LlamaForCausalLM(lcfg)
        model.load_state_dict(base_sd)
        model.generation_config.pad_token_id = 0
        _train(
            model,
            _expert_streams(streams, domain, cfg.expert_mix),
            cfg.expert_steps,
            cfg.expert_lr,
            0.0,
            _derive_seed(cfg.seed, "expert-data", domain, r),
            cfg,
            log,
            f"expert {name}",
        )
        rel = f"experts/{name}"
        _save_checkpoint(model, hf_tok, tmp / rel, cfg)
        experts[name] = rel
        esd = _bf16_round_trip(model)
        del model
        expert_losses[name] = losses_of(esd)
        for k, v in esd.items():
            merged_delta[k] += w * (v - base_sd[k])
        del esd
    merged_losses = losses_of({k: base_sd[k] + merged_delta[k] for k in base_sd})
    return experts, expert_losses, merged_losses


def _check_zoo_gates(
    cfg: ZooConfig, base_losses: dict, expert_losses: dict, merged_losses: dict, log: Callable[[str], None]
) -> dict:
    """:func:`check_gates`, logged; returns its result.

    Raises:
        ZooGateError: the gates failed and ``cfg.enforce_gates``.
    """
    w = cfg.merge_weight / cfg.n_experts_per_domain
    gates = check_gates(base_losses, expert_losses, merged_losses)
    log(
        "gates: "
        + ("passed" if gates["passed"] else "FAILED: " + "; ".join(gates["failures"]))
        + f" (task_arithmetic weight {w:g}: mean loss {gates['merge_mean_loss']:.4f} vs base "
        f"{gates['base_mean_loss']:.4f}, normalised gain per expert "
        + ", ".join(f"{n} {g:.2f}" for n, g in gates["normalised_gain"].items())
        + ")"
    )
    if cfg.enforce_gates and not gates["passed"]:
        raise ZooGateError(
            "zoo build gates failed: "
            + "; ".join(gates["failures"])
            + " (set ZooConfig.enforce_gates=False to keep such a zoo anyway)"
        )
    return gates


def _zoo_manifest(cfg: ZooConfig, experts: dict, eval_files: dict, n_params: int, gates: dict) -> dict:
    """The zoo manifest (without file hashes)."""
    import tokenizers
    import torch
    import transformers

    return {
        "format": ZOO_FORMAT,
        "key": cfg.key(),
        "config": asdict(cfg),
        "domains": list(DOMAINS),
        "base": "base",
        "experts": experts,
        "eval_sets": eval_files,
        "tokenizer": "tokenizer",
        "testbed": TESTBED,
        "n_params": n_params,
        "gates": gates,
        "built_with": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _zoo_from_manifest(entry: Path, cfg: ZooConfig) -> Zoo:
    try:
        man = json.loads((entry / _MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"zoo cache entry {entry} is unreadable ({e}); delete it to rebuild") from e
    if man.get("format") != ZOO_FORMAT or man.get("key") != cfg.key() or man.get("config") != asdict(cfg):
        raise RuntimeError(f"zoo cache entry {entry} does not match the requested config; delete it to rebuild")
    return Zoo(
        root=entry,
        base=entry / man["base"],
        experts={k: entry / v for k, v in man["experts"].items()},
        eval_sets={k: entry / v for k, v in man["eval_sets"].items()},
        config=cfg,
        gates=man.get("gates", {}),
    )


def build_zoo(
    root: Path | None = None, config: ZooConfig | None = None, log: Callable[[str], None] | None = None
) -> Zoo:
    """Build (once) and return the zoo for ``config`` under ``root/<config.key()>``.

    If the cache entry exists it is returned immediately (a manifest read; torch is not even
    imported). Otherwise, under an exclusive ``fcntl`` lock on ``root/.<key>.lock`` (so concurrent
    callers wait and then reuse one build), this trains the tokenizer, the base model and
    ``len(DOMAINS) * n_experts_per_domain`` experts into ``root/.<key>.tmp-<pid>`` and renames it
    to ``root/<key>`` at the end: a killed build never leaves a complete-looking entry (its temp
    dir is removed by the next build). Uses 1 torch thread and deterministic algorithms during
    the build (previous settings are restored).

    Args:
        root: cache root; default :func:`default_zoo_root`.
        config: sizes/recipe; default ``ZooConfig()`` (demo size, < 5 min on 2 cores).
        log: optional progress callback (one human-readable line per call).

    Returns:
        The :class:`Zoo` with absolute paths.

    Raises:
        ValueError: the config is unusable (e.g. ``max_shard_size`` too large for >= 2 shards).
        RuntimeError: an existing cache entry is corrupt or does not match ``config``.
        OSError: ``root`` is not writable.
    """
    cfg = config if config is not None else ZooConfig()
    root = Path(root if root is not None else default_zoo_root()).expanduser().absolute()
    key = cfg.key()
    say = log or (lambda msg: None)

    def build_into(tmp: Path) -> None:
        t0 = time.perf_counter()
        say(f"building zoo {key} in {root}")
        man = _with_torch_settings(lambda: _build_into(tmp, cfg, say))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        man["files"] = {p.relative_to(tmp).as_posix(): _sha256(p) for p in files}
        (tmp / _MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
        say(f"zoo {key} built in {time.perf_counter() - t0:.1f}s")

    entry = cached_build(root, key, _MANIFEST, build_into)
    return _zoo_from_manifest(entry, cfg)


def _with_torch_settings(fn):
    """Run ``fn`` with 1 intra-op thread, deterministic algorithms and no HF progress bars,
    then restore the previous settings."""
    import torch
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(_NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    hf_logging.disable_progress_bar()
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)
        if bars:
            hf_logging.enable_progress_bar()


def evaluate(
    model_dir: Path, zoo: Zoo, max_batches: int | None = None, domains: tuple[str, ...] | list[str] | None = None
) -> dict[str, float]:
    """Mean per-token cross-entropy (nats/token) of a checkpoint on each domain's held-out set.

    The zoo's ``testbed.json`` task for ``mergepipe eval`` (:func:`mergepipe.evaluate.evaluate_checkpoint`):
    the held-out documents are tokenized with the zoo's tokenizer (the checkpoint need not ship
    one), joined with EOS and cut into ``zoo.config.eval_sequences`` windows of
    ``zoo.config.seq_len`` tokens; the loss averages over the ``seq_len - 1`` next-token
    predictions of every window. Weights (bf16 or any dtype) are loaded as float32 and run on
    CPU with 1 thread, so the result is deterministic.

    Args:
        model_dir: HF causal-LM checkpoint folder (``config.json`` + safetensors), e.g. a
            zoo checkpoint or a merge of them.
        zoo: the zoo whose tokenizer and held-out sets to use.
        max_batches: if given, only the first ``max_batches`` batches of ``batch_size`` windows
            per domain are scored (faster, noisier).
        domains: score only these domains (default: every domain in :data:`DOMAINS`).

    Returns:
        ``{domain: loss}`` for every requested domain (may be ``inf``/``nan`` for a broken
        model).

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
        ValueError: the model's vocabulary is smaller than the zoo tokenizer's,
            ``max_batches < 1``, or an unknown domain.
    """
    from mergepipe.errors import InputError
    from mergepipe.evaluate import evaluate_checkpoint

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a HF checkpoint folder (no config.json)")
    todo = tuple(DOMAINS if domains is None else domains)
    if any(d not in DOMAINS for d in todo):
        raise ValueError(f"unknown domain(s) {sorted(set(todo) - set(DOMAINS))}; the zoo's domains are {list(DOMAINS)}")
    try:
        r = evaluate_checkpoint(model_dir, zoo.testbed, todo, max_batches=max_batches)
    except InputError as e:
        raise ValueError(str(e)) from None
    return {d: r[d]["loss"] for d in todo}
