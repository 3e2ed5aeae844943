"""``mergepipe eval``: per-task quality of a checkpoint on a testbed's probe sets.

A *testbed* is a folder with a ``testbed.json`` naming its tasks and, per task, a held-out probe
set (JSON lines). Two kinds are understood:

``causal-lm`` (the model zoo of :mod:`mergepipe_zoo.zoo`)::

    {"format": 1, "kind": "causal-lm", "tokenizer": "tokenizer", "eos_token": "</s>",
     "seq_len": 128, "batch_size": 16, "max_windows": 64,
     "tasks": {"python": {"probe": "eval/python.jsonl"}, ...}}

  Each probe file holds ``{"text": ...}`` documents. They are tokenized with the testbed's
  tokenizer (``tokenizer/tokenizer.json``), joined with ``eos_token`` and cut into at most
  ``max_windows`` windows of ``seq_len`` tokens; the metric is ``loss``, the mean next-token
  cross-entropy in nats/token over the ``seq_len − 1`` predictions of every window.

``sequence-classification`` (the MiniLM testbed of :mod:`mergepipe_zoo.minilm`)::

    {"format": 1, "kind": "sequence-classification", "tokenizer": "tokenizer", "seq_len": 64,
     "batch_size": 64, "pooling": "mean",
     "tasks": {"topic": {"probe": "eval/topic.jsonl", "head": "heads/topic.safetensors",
                         "labels": ["asyncio", ...]}, ...}}

  Each probe file holds ``{"text": ..., "label": int}`` examples. The checkpoint is an encoder
  (``AutoModel``); its last hidden states are mean-pooled over the attention mask and the task's
  own linear head (``weight`` float32[C, d], ``bias`` float32[C] in the head file) gives logits.
  Metrics: ``accuracy`` and ``loss`` (mean cross-entropy, nats/example). This is the standard
  protocol of task-arithmetic papers: a merged encoder, scored with each task's head.

Other kinds plug in through the entry-point group ``mergepipe.testbed_kinds`` (:mod:`mergepipe.plugins`):
the entry point named after the kind is a function ``evaluate(model_dir, testbed_root, tasks=None,
per_item=False) -> {task: {metric: float, "n": int, ...}}`` that reads and validates the testbed
itself. ``image-classification`` (the CNN testbed of :mod:`mergepipe_zoo.vision`, extra ``zoo``) is
one: :func:`mergepipe_zoo.vision.evaluate`, metrics ``accuracy`` and ``loss`` (nats/image).

Everything runs on CPU in float32, one thread, deterministic algorithms (results are reproducible on one
machine). torch and transformers are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import InputError

__all__ = ["TESTBED_FILE", "Testbed", "evaluate_checkpoint", "load_testbed", "testbed_kind"]

TESTBED_FILE = "testbed.json"
KINDS = ("causal-lm", "sequence-classification")
KIND_PLUGINS = "mergepipe.testbed_kinds"  # entry-point group of the other kinds (mergepipe.plugins)


@dataclass(frozen=True)
class Testbed:
    """A parsed ``testbed.json`` (paths absolute).

    Attributes:
        root: the testbed folder.
        kind: ``"causal-lm"`` or ``"sequence-classification"``.
        tokenizer: folder with ``tokenizer.json`` (and, for the encoder, the HF tokenizer files).
        tasks: task name -> its entry, with ``probe`` (and ``head``) made absolute.
        seq_len, batch_size: window/sequence length in tokens, examples per forward pass.
        max_windows: causal-lm only: windows scored per task.
        eos_token: causal-lm only: the document separator.
        calibration: the testbed's calibration set (``"calibration"``: a JSON-lines file of
            ``{"text": ...}`` training text, for ``mergepipe analyze --calibration``), or None.
        raw: the JSON object as read.
    """

    root: Path
    kind: str
    tokenizer: Path
    tasks: dict[str, dict]
    seq_len: int
    batch_size: int
    max_windows: int = 0
    eos_token: str = ""
    calibration: Path | None = None
    raw: dict = field(default_factory=dict)


def _description_file(path: str | Path) -> Path:
    """``path/testbed.json`` for a testbed folder, else ``path`` itself (that file)."""
    p = Path(path)
    return p / TESTBED_FILE if p.is_dir() else p


def _read_description(path: str | Path) -> tuple[Path, dict]:
    """(the ``testbed.json`` file, its JSON object) of a testbed folder or file.

    Raises:
        InputError: missing, unreadable or not a JSON object.
    """
    f = _description_file(path)
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{f}: no testbed description; pass --testbed a folder with {TESTBED_FILE} (a built zoo or MiniLM testbed)."
        ) from None
    except (OSError, ValueError) as e:
        raise InputError(f"{f}: unreadable testbed description ({e}).") from None
    if not isinstance(raw, dict):
        raise InputError(f"{f}: the testbed description must be a JSON object.")
    return f, raw


def testbed_kind(path: str | Path) -> str:
    """The ``kind`` of the testbed at ``path`` (a folder with ``testbed.json``, or that file).

    Raises:
        InputError: missing/unreadable description, or ``kind`` is not a string.
    """
    f, raw = _read_description(path)
    kind = raw.get("kind")
    if not isinstance(kind, str):
        raise InputError(f"{f}: kind must be a string, e.g. {KINDS[0]!r}.")
    return kind


def load_testbed(path: str | Path) -> Testbed:
    """Read ``path/testbed.json`` (or ``path`` itself if it is that file) of a built-in kind
    (``KINDS``; other kinds are their plugin's to read, see :func:`evaluate_checkpoint`).

    Raises:
        InputError: missing/unreadable file, another kind, a task without a probe set, or a
            probe/head file that does not exist; the message names the file and field.
    """
    f, raw = _read_description(path)
    root = f.parent
    kind = raw.get("kind")
    if kind not in KINDS:
        raise InputError(f"{f}: kind {kind!r} is not one of {list(KINDS)}.")
    tasks = raw.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise InputError(f"{f}: 'tasks' must be a non-empty object of task name -> {{'probe': file}}.")
    out = {}
    for name, t in tasks.items():
        if not isinstance(t, dict) or not isinstance(t.get("probe"), str):
            raise InputError(f"{f}: tasks.{name}.probe must be a file name relative to the testbed.")
        entry = dict(t)
        for k in ("probe", "head") if kind == "sequence-classification" else ("probe",):
            if not isinstance(t.get(k), str):
                raise InputError(f"{f}: tasks.{name}.{k} must be a file name relative to the testbed.")
            entry[k] = root / t[k]
            if not entry[k].is_file():
                raise InputError(f"{f}: tasks.{name}.{k} = {t[k]!r} does not exist under {root}.")
        out[name] = entry
    cal = raw.get("calibration")
    if cal is not None and not (isinstance(cal, str) and (root / cal).is_file()):
        raise InputError(f"{f}: calibration = {cal!r} must name a file under {root}.")
    try:
        return Testbed(
            root=root,
            kind=kind,
            tokenizer=root / str(raw.get("tokenizer", "tokenizer")),
            tasks=out,
            seq_len=int(raw["seq_len"]),
            batch_size=int(raw.get("batch_size", 16)),
            max_windows=int(raw.get("max_windows", 0)),
            eos_token=str(raw.get("eos_token", "")),
            calibration=root / cal if cal is not None else None,
            raw=raw,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{f}: seq_len/batch_size/max_windows must be integers ({e}).") from None


def _plugin_kind(
    model_dir: str | Path, testbed: str | Path, tasks: Sequence[str] | None, max_batches: int | None, per_item: bool
) -> dict[str, dict]:
    """Score ``model_dir`` with the ``mergepipe.testbed_kinds`` entry point named by the testbed's kind."""
    from mergepipe.plugins import PluginMissing, load_plugin

    kind = testbed_kind(testbed)
    f = _description_file(testbed)
    try:
        fn = load_plugin(KIND_PLUGINS, kind)
    except PluginMissing as e:
        raise InputError(
            f"{f}: kind {kind!r} is not one of {list(KINDS)} and no installed plugin scores it ({e}); "
            "image-classification needs the zoo extra: pip install 'mergepipe[zoo]'."
        ) from None
    if max_batches is not None:
        raise InputError(f"--max-batches: the {kind} testbed scores whole probe sets; drop the option.")
    if not (Path(model_dir) / "config.json").is_file():
        raise InputError(f"{model_dir}: not a checkpoint folder (no config.json); pass a snapshot folder.")
    res = fn(model_dir, f.parent, list(tasks) if tasks else None, per_item=per_item)
    if not isinstance(res, dict) or not all(isinstance(v, dict) for v in res.values()):
        raise TypeError(f"{KIND_PLUGINS} {kind!r}: the plugin must return {{task: {{metric: value}}}}, got {res!r:.80}")
    return res


def _torch_settings(fn):
    """Run ``fn`` with 1 intra-op thread (results independent of the core count, and the fastest
    setting on a shared machine) and deterministic algorithms, then restore them."""
    import torch

    threads = torch.get_num_threads()
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn)


def causal_lm_windows(tb: Testbed, tasks: Sequence[str]) -> dict:
    """task -> LongTensor[n, seq_len] of probe tokens (n <= max_windows), see the module docstring.

    Raises:
        InputError: a probe set has fewer than ``seq_len`` tokens.
    """
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tb.tokenizer / "tokenizer.json"))
    eos = tok.token_to_id(tb.eos_token)
    if eos is None:
        raise InputError(f"{tb.tokenizer}: the tokenizer has no {tb.eos_token!r} token; set eos_token in the testbed.")
    out = {}
    for t in tasks:
        path = tb.tasks[t]["probe"]
        docs = [json.loads(ln)["text"] for ln in path.read_text(encoding="utf-8").splitlines() if ln]
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        stream = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        L = tb.seq_len
        n = min(len(stream) // L, tb.max_windows or len(stream) // L)
        if n == 0:
            raise InputError(f"{path}: the probe set has fewer than seq_len={L} tokens.")
        out[t] = stream[: n * L].view(n, L)
    return out


def causal_lm_losses(
    model, windows: dict, batch_size: int, max_batches: int | None = None, per_item: bool = False
) -> dict:
    """``{task: {"loss", "n"}}`` of an in-memory causal LM on ``windows`` (task -> LongTensor[n, L]):
    summed next-token cross-entropy (float64 accumulation) over ``n`` predicted tokens. With
    ``per_item``, also ``"items"``: each window's mean loss (nats/token, a list of floats in
    window order; every window predicts ``L − 1`` tokens, so ``loss`` is their mean), the unit
    a test-set bootstrap resamples."""
    import torch
    import torch.nn.functional as F

    out: dict[str, dict] = {}
    with torch.inference_mode():
        for t, w in windows.items():
            total, count = 0.0, 0
            items: list[float] = []
            for i, start in enumerate(range(0, len(w), batch_size)):
                if max_batches is not None and i >= max_batches:
                    break
                batch = w[start : start + batch_size]
                logits = model(input_ids=batch, use_cache=False).logits.float()
                tok = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
                ).double()
                total += float(tok.sum())
                count += batch[:, 1:].numel()
                if per_item:
                    items += tok.view(len(batch), -1).mean(1).tolist()
            out[t] = {"loss": total / count, "n": count}
            if per_item:
                out[t]["items"] = items
    return out


def _causal_lm(
    model_dir: Path, tb: Testbed, tasks: Sequence[str], max_batches: int | None, per_item: bool = False
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    windows = causal_lm_windows(tb, tasks)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    vocab = model.config.vocab_size
    max_id = max(int(w.max()) for w in windows.values())
    if max_id >= vocab:
        raise InputError(
            f"{model_dir}: vocab_size={vocab} is too small for the testbed's tokenizer (token id {max_id})."
        )
    return causal_lm_losses(model, windows, tb.batch_size, max_batches, per_item)


def classification_examples(path: Path) -> tuple[list[str], list[int]]:
    """(texts, labels) of a ``{"text", "label"}`` JSON-lines probe file."""
    texts, labels = [], []
    for ln in path.read_text(encoding="utf-8").splitlines():
        if ln:
            r = json.loads(ln)
            texts.append(r["text"])
            labels.append(int(r["label"]))
    return texts, labels


def mean_pool(hidden, mask):
    """float32[B, d]: mean of ``hidden`` float32[B, T, d] over positions where ``mask`` [B, T] is 1
    (sentence-transformers' mean pooling)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _classification(
    model_dir: Path, tb: Testbed, tasks: Sequence[str], max_batches: int | None, per_item: bool = False
) -> dict:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tb.tokenizer, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    out: dict[str, dict] = {}
    with torch.inference_mode():
        for t in tasks:
            head = load_file(str(tb.tasks[t]["head"]))
            W, b = head["weight"].float(), head["bias"].float()
            texts, labels = classification_examples(tb.tasks[t]["probe"])
            y = torch.tensor(labels)
            correct, loss_sum, n = 0, 0.0, 0
            hits: list[int] = []
            for i, s in enumerate(range(0, len(texts), tb.batch_size)):
                if max_batches is not None and i >= max_batches:
                    break
                enc = tok(
                    texts[s : s + tb.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=tb.seq_len,
                    return_tensors="pt",
                )
                h = model(**enc).last_hidden_state
                logits = mean_pool(h, enc["attention_mask"]) @ W.T + b
                yb = y[s : s + tb.batch_size]
                ok = logits.argmax(-1) == yb
                correct += int(ok.sum())
                hits += ok.int().tolist()
                loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
                n += len(yb)
            out[t] = {"accuracy": correct / n, "loss": loss_sum / n, "n": n}
            if per_item:
                out[t]["items"] = hits
    return out


def evaluate_checkpoint(
    model_dir: str | Path,
    testbed: Testbed | str | Path,
    tasks: Sequence[str] | None = None,
    max_batches: int | None = None,
    per_item: bool = False,
) -> dict[str, dict]:
    """Per-task metrics of the HF checkpoint folder ``model_dir`` on ``testbed``'s probe sets.

    Args:
        model_dir: a local checkpoint folder (``config.json`` + safetensors), e.g. a committed
            snapshot.
        testbed: a :class:`Testbed` or its folder.
        tasks: task names (default: all, in the testbed's order).
        max_batches: score only the first ``max_batches`` batches per task (faster, noisier).
        per_item: also return each task's per-item metric as ``"items"`` (causal-lm: each probe
            window's mean loss; classification: 1/0 per example, correct or not), for intervals
            by resampling the test set.

    Returns:
        ``{task: {"loss": float, ...}}``: causal-lm ``loss`` (nats/token) and ``n`` (predicted
        tokens); sequence-classification ``accuracy``, ``loss`` (nats/example) and ``n``.

    A testbed of another kind (``testbed.json`` ``kind`` not in ``KINDS``) is scored by the
    ``mergepipe.testbed_kinds`` entry point of that name (see the module docstring), e.g.
    ``image-classification``: accuracy and loss (nats/image) of :mod:`mergepipe_zoo.vision`.

    Raises:
        InputError: ``model_dir`` is not a checkpoint folder, an unknown task, ``max_batches < 1``
            (or given for a plugin kind, which scores whole probe sets), a testbed error (see
            :func:`load_testbed`), or a kind no installed entry point scores.
    """
    if not isinstance(testbed, Testbed) and testbed_kind(testbed) not in KINDS:
        return _plugin_kind(model_dir, testbed, tasks, max_batches, per_item)
    tb = testbed if isinstance(testbed, Testbed) else load_testbed(testbed)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"{model_dir}: not a checkpoint folder (no config.json); pass a snapshot folder.")
    if max_batches is not None and max_batches < 1:
        raise InputError(f"--max-batches {max_batches}: must be >= 1.")
    todo = list(tb.tasks) if not tasks else list(tasks)
    bad = [t for t in todo if t not in tb.tasks]
    if bad:
        raise InputError(f"--tasks: unknown task(s) {bad}; the testbed {tb.root} has {list(tb.tasks)}.")
    fn = _causal_lm if tb.kind == "causal-lm" else _classification
    return _torch_settings(lambda: fn(model_dir, tb, todo, max_batches, per_item))
