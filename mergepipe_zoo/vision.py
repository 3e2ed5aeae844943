"""A vision testbed of another architecture family: a small CNN on scikit-learn's digits.

The zoo (:mod:`mergepipe_zoo.zoo`) and the MiniLM testbed (:mod:`mergepipe_zoo.minilm`) are both
transformers. This one is a convolutional network whose convolution weights are 4-D tensors
(``float[out, in, 3, 3]``), trained offline in about a minute on one CPU core from the 1,797
8x8 grey-level images of :func:`sklearn.datasets.load_digits` (UCI optical digits, bundled with
scikit-learn, no download).

Model (:class:`DigitsCNN`, 0.49 M parameters at the default sizes; the *body* is what is merged)::

    x float32[B, 1, 8, 8] in [0, 1]
    conv1 3x3 1->32, ReLU; conv2 3x3 32->64, ReLU; max-pool 2   -> [B, 64, 4, 4]
    conv3 3x3 64->128, ReLU; max-pool 2                          -> [B, 128, 2, 2]
    fc1 512->512, ReLU; fc2 512->256, ReLU                       -> features float32[B, 256]
    task head (not merged): logits = features @ W.T + b,  W float32[10, 256], b float32[10]

Recipe: the *base* is trained on a mix of the clean and transformed digits (with a head that is
not kept). Each of four
tasks changes the inputs; each *expert* is the base fine-tuned on one task, LP-FT as in the MiniLM
testbed (Kumar et al., ICLR 2022): a linear probe on the frozen base's features, then body and
head together at a low learning rate. The experts start from the base as released in bfloat16
(as the zoo's do), so the float32 and bfloat16 checkpoints of one build differ only by the final
rounding. Tasks (deterministic per seed; the same transformation on training and held-out
images):

* ``rot90``: the image turned a quarter turn counter-clockwise;
* ``invert``: grey levels inverted, ``1 − x``;
* ``vflip``: the image upside down;
* ``hflip``: the image mirrored left to right.

Other transformations for :attr:`VisionConfig.tasks`: ``rot180``, ``rot270``, ``transpose`` and
``shift`` (2 pixels right and down, zeros entering from the top and left: format 1's fourth task,
whose full merge was worse than the base on 6 of 10 fresh seeds).

The base sees a *task mix*: half of its training images as they are, the other half transformed
by one of the four tasks (uniformly drawn per image), as the zoo's base is pretrained on all its
domains; each expert then specialises on one task.

Quality of a merged body = each task's held-out cross-entropy (``loss``, nats/image: the metric
of ``testbed.json``, smoother than accuracy on 629 held-out images; ``accuracy`` is reported
too) with that task's own head; the base is scored with the same heads (the standard task-arithmetic
protocol with task-specific heads).

Gates (:func:`check_gates`, on the losses of both dtypes; a build that fails raises
:class:`VisionGateError` and caches no testbed): every expert is the best model on its task, its
loss at least ``min_expert_gain`` (10%) below the base's; the full task_arithmetic merge (weight
``merge_weight``) has a lower loss than the base on every task and keeps at least
``min_merge_ng`` (0.3, as the zoo's gate) of every expert's normalised gain.

Layout of a built testbed (``root/<config.key()>/``)::

    testbed.json                kind image-classification (read by :func:`evaluate`)
    float32/base/               config.json + model.safetensors (the body, float32)
    float32/experts/<task>/     the fine-tuned body per task
    bfloat16/base/, bfloat16/experts/<task>/   the same checkpoints rounded to bfloat16
    heads/<task>.safetensors    weight float32[10, 256], bias float32[10]
    eval/<task>.safetensors     images float32[N, 1, 8, 8], labels int64[N] (held out)
    gates.json                  the gate report of both dtypes
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError
from mergepipe_zoo._cache import cached_build

__all__ = [
    "DTYPES",
    "TASKS",
    "DigitsCNN",
    "VisionConfig",
    "VisionGateError",
    "VisionTestbed",
    "build_vision",
    "check_gates",
    "evaluate",
    "make_tasks",
]

TASKS: tuple[str, ...] = ("rot90", "invert", "vflip", "hflip")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
FORMAT = 2  # bump when data, model or recipe change (2: hflip for shift, expert lr 5e-5; 1: shift, lr 1e-4)
KIND = "image-classification"
MODEL_TYPE = "mergepipe-digits-cnn"


class VisionGateError(RuntimeError):
    """A build whose gates fail (merging would not help on it); ``report`` holds the gate report."""

    def __init__(self, msg: str, report: dict) -> None:
        super().__init__(msg)
        self.report = report


@dataclass(frozen=True)
class VisionConfig:
    """Sizes and recipe of the vision testbed.

    Attributes:
        seed: master seed (train/held-out split, initialisation, data order, task draws).
        tasks: the transformations, one expert each (see the module docstring; default ``TASKS``).
        channels: output channels of conv1..conv3.
        hidden: widths of fc1 and fc2 (fc2's is the feature width the heads read).
        test_fraction: share of the 1,797 images held out (stratified by digit).
        base_mix: share of the base's training images shown transformed (by one of the tasks,
            uniformly): the base is pretrained on a task mix, as the zoo's is on its domains.
        base_epochs, base_lr: the base's training (Adam, batch ``batch_size``, cosine decay).
        probe_steps, probe_l2: the linear probe (full batch Adam lr 1e-2, L2 ``probe_l2·‖W‖²``).
        expert_epochs, expert_lr: the full fine-tune of body and head (Adam, linear decay); 5e-5
            (format 2) keeps each task vector small enough to compose: at 1e-4 (format 1) the
            full merge kept < 0.3 of a task's gain on 8 of 10 fresh seeds.
        merge_weight: the recommended task_arithmetic weight λ (the gate merge's).
        min_expert_gain: gate: an expert's loss on its task at least this fraction below the base's.
        min_merge_ng: gate: the full merge's least normalised gain on any task.
    """

    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    channels: tuple[int, int, int] = (32, 64, 128)
    hidden: tuple[int, int] = (512, 256)
    test_fraction: float = 0.35
    batch_size: int = 64
    base_mix: float = 0.5
    base_epochs: int = 10
    base_lr: float = 2e-3
    probe_steps: int = 150
    probe_l2: float = 1e-3
    expert_epochs: int = 6
    expert_lr: float = 5e-5
    merge_weight: float = 0.8
    min_expert_gain: float = 0.1
    min_merge_ng: float = 0.3

    @classmethod
    def tiny(cls, seed: int = 0) -> VisionConfig:
        """A smaller, faster build for tests (a few seconds on one core)."""
        return cls(seed=seed, channels=(8, 16, 32), hidden=(64, 32), base_epochs=4, expert_epochs=3, probe_steps=60)

    def key(self) -> str:
        """16 hex chars naming the cache entry: the testbed format and every field."""
        blob = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class VisionTestbed:
    """A built testbed (absolute paths). ``base``/``experts`` are the float32 checkpoints;
    :meth:`checkpoints` gives either dtype's."""

    root: Path
    base: Path
    experts: dict[str, Path]
    config: VisionConfig

    def checkpoints(self, dtype: str) -> tuple[Path, dict[str, Path]]:
        """(base folder, {task: expert folder}) of ``dtype`` (``"float32"`` or ``"bfloat16"``).

        Raises:
            ValueError: another dtype.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {list(DTYPES)}")
        d = self.root / dtype
        return d / "base", {t: d / "experts" / t for t in self.config.tasks}


# ------------------------------------------------------------------------------------------ model


def _model_config(cfg: VisionConfig, dtype: str) -> dict:
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["DigitsCNN"],
        "in_channels": 1,
        "image_size": 8,
        "channels": list(cfg.channels),
        "hidden": list(cfg.hidden),
        "torch_dtype": dtype,
    }


def DigitsCNN(config: dict):  # noqa: N802  (a class factory: torch is imported lazily)
    """The CNN body of ``config`` (a checkpoint's ``config.json``), a ``torch.nn.Module`` mapping
    float32[B, 1, 8, 8] to features float32[B, hidden[-1]] (the module docstring draws it).

    Tensor names: ``conv{1,2,3}.{weight,bias}`` (weights float[out, in, 3, 3]),
    ``fc{1,2}.{weight,bias}``.

    Raises:
        InputError: ``config`` is not this model's (``model_type``) or its sizes are not positive
            integers.
    """
    import torch
    from torch import nn

    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        raise InputError(f"config.json: model_type must be {MODEL_TYPE!r} (a vision testbed checkpoint).")
    try:
        c1, c2, c3 = (int(x) for x in config["channels"])
        h1, h2 = (int(x) for x in config["hidden"])
        cin, size = int(config["in_channels"]), int(config["image_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(
            f"config.json: channels (3), hidden (2), in_channels, image_size must be integers ({e})."
        ) from None
    if min(c1, c2, c3, h1, h2, cin) < 1 or size != 8:
        raise InputError("config.json: sizes must be positive and image_size 8.")

    class _Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, c1, 3, padding=1)
            self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
            self.conv3 = nn.Conv2d(c2, c3, 3, padding=1)
            self.fc1 = nn.Linear(c3 * 4, h1)
            self.fc2 = nn.Linear(h1, h2)

        def forward(self, x):
            f = torch.nn.functional
            x = f.max_pool2d(f.relu(self.conv2(f.relu(self.conv1(x)))), 2)
            x = f.max_pool2d(f.relu(self.conv3(x)), 2)
            return f.relu(self.fc2(f.relu(self.fc1(x.flatten(1)))))

    return _Body()


def load_body(model_dir: str | Path):
    """The body of a checkpoint folder (``config.json`` + ``model.safetensors``), float32, eval mode.

    Raises:
        InputError: no ``config.json``/``model.safetensors``, not this model's config, or tensors
            that do not match the config (missing, extra, or of another shape).
    """
    from safetensors.torch import load_file

    d = Path(model_dir)
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{d / 'config.json'}: unreadable ({e}); pass a vision checkpoint folder.") from None
    model = DigitsCNN(config)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise InputError(f"{d}: no *.safetensors file.")
    sd: dict = {}
    for f in files:
        sd.update(load_file(str(f)))
    want = model.state_dict()
    bad = sorted(set(want) ^ set(sd)) + sorted(
        k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)
    )
    if bad:
        raise InputError(f"{d}: tensors do not match config.json: {bad[:5]}")
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    return model.eval()


# ------------------------------------------------------------------------------------------ data


def _derive_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def _transform(task: str, x, seed: int):
    """``x`` float32[N, 1, 8, 8] in [0, 1] transformed for ``task`` (deterministic in ``seed``)."""
    import numpy as np

    del seed  # every task's transformation is deterministic; the seed is kept for random ones
    if task == "clean":
        return x.copy()
    if task == "rot90":
        return np.ascontiguousarray(np.rot90(x, 1, axes=(2, 3)))
    if task == "invert":
        return 1.0 - x
    if task == "vflip":
        return np.ascontiguousarray(x[:, :, ::-1])
    if task == "hflip":
        return np.ascontiguousarray(x[:, :, :, ::-1])
    if task == "rot180":
        return np.ascontiguousarray(np.rot90(x, 2, axes=(2, 3)))
    if task == "rot270":
        return np.ascontiguousarray(np.rot90(x, 3, axes=(2, 3)))
    if task == "transpose":
        return np.ascontiguousarray(np.swapaxes(x, 2, 3))
    if task == "shift":
        out = np.zeros_like(x)
        out[:, :, 2:, 2:] = x[:, :, :-2, :-2]
        return out
    raise ValueError(task)


def make_tasks(cfg: VisionConfig) -> dict:
    """``{"clean"|task: (train images float32[n,1,8,8], train labels int64[n], test images,
    test labels)}``: a stratified split of :func:`sklearn.datasets.load_digits` (the same split
    for every task), grey levels scaled to [0, 1], each task's transformation drawn from its own
    seed."""
    import numpy as np
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=cfg.test_fraction, stratify=y, random_state=_derive_seed(cfg.seed, "split") % 2**31
    )
    out = {}
    for t in ("clean", *cfg.tasks):
        out[t] = (
            _transform(t, xtr, _derive_seed(cfg.seed, t, "train")),
            ytr,
            _transform(t, xte, _derive_seed(cfg.seed, t, "test")),
            yte,
        )
    return out


# ------------------------------------------------------------------------------------------ training


def _train(body, head, x, y, epochs: int, lr: float, bs: int, seed: int, cosine: bool) -> float:
    """Adam over body and head, ``epochs`` seeded passes; returns the last epoch's mean loss."""
    import torch
    import torch.nn.functional as F

    params = list(body.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    n = len(x)
    per = max(1, math.ceil(n / bs))
    steps = per * epochs
    if cosine:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    g = torch.Generator().manual_seed(seed)
    body.train()
    last = 0.0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        tot = 0.0
        for b in range(per):
            idx = perm[b * bs : (b + 1) * bs]
            loss = F.cross_entropy(head(body(x[idx])), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss.detach()) * len(idx)
        last = tot / n
    body.eval()
    return last


def _probe(body, x, y, n_classes: int, steps: int, l2: float):
    """A linear head fitted on the frozen body's features (full batch Adam, lr 1e-2, L2)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        feats = body(x)
    head = torch.nn.Linear(feats.shape[1], n_classes)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(head(feats), y) + l2 * head.weight.pow(2).sum()
        loss.backward()
        opt.step()
    return head


def _mixture(T: dict, cfg: VisionConfig):
    """The base's training set: each training image once, as is with probability
    ``1 − base_mix`` or else transformed by one of the tasks (uniform), drawn per image."""
    import numpy as np
    import torch

    rng = np.random.default_rng(_derive_seed(cfg.seed, "mixture"))
    names = ("clean", *cfg.tasks)
    k = len(cfg.tasks)
    n = len(T["clean"][0])
    pick = rng.choice(len(names), size=n, p=[1 - cfg.base_mix] + [cfg.base_mix / k] * k)
    x = torch.stack([T[names[int(c)]][0][i] for i, c in enumerate(pick)])
    return x, T["clean"][1]


def _round(sd: dict, dtype: str) -> dict:
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return {k: v.detach().to(dt).contiguous() for k, v in sd.items()}


def _save(out: Path, sd: dict, cfg: VisionConfig, dtype: str) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(_round(sd, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_model_config(cfg, dtype), indent=1) + "\n")


# ------------------------------------------------------------------------------------------ evaluation


def _scores(body, heads: dict, data: dict, per_item: bool) -> dict:
    import torch
    import torch.nn.functional as F

    out = {}
    with torch.inference_mode():
        for t, (W, b) in heads.items():
            x, y = data[t]
            logits = body(x) @ W.T + b
            ok = logits.argmax(-1) == y
            r: dict = {
                "accuracy": float(ok.float().mean()),
                "loss": float(F.cross_entropy(logits, y, reduction="mean")),
                "n": len(y),
            }
            if per_item:
                r["items"] = F.cross_entropy(logits, y, reduction="none").tolist()
            out[t] = r
    return out


def _read_testbed(testbed: str | Path, tasks: Sequence[str] | None) -> tuple[dict, dict]:
    """(heads {task: (W, b)}, probe data {task: (x, y)}) of a built testbed, validated.

    Raises:
        InputError: no/invalid ``testbed.json``, another kind, unknown tasks, missing files or
            tensors of the wrong shape/dtype.
    """
    import torch
    from safetensors.torch import load_file

    root = Path(testbed)
    f = root / "testbed.json"
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{f}: unreadable testbed description ({e}).") from None
    if raw.get("kind") != KIND or not isinstance(raw.get("tasks"), dict):
        raise InputError(f"{f}: kind must be {KIND!r} with a 'tasks' object (a built vision testbed).")
    todo = list(raw["tasks"]) if not tasks else list(tasks)
    bad = [t for t in todo if t not in raw["tasks"]]
    if bad:
        raise InputError(f"tasks {bad}: not in the testbed {root} ({list(raw['tasks'])}).")
    heads, data = {}, {}
    for t in todo:
        spec = raw["tasks"][t]
        try:
            h = load_file(str(root / spec["head"]))
            p = load_file(str(root / spec["probe"]))
        except Exception as e:  # OSError, KeyError, TypeError, safetensors' own errors
            raise InputError(f"{f}: tasks.{t}: head/probe unreadable ({e}).") from None
        W, b, x, y = h.get("weight"), h.get("bias"), p.get("images"), p.get("labels")
        ok = (
            W is not None
            and b is not None
            and x is not None
            and y is not None
            and W.ndim == 2
            and b.shape == (W.shape[0],)
            and x.ndim == 4
            and x.shape[1:] == (1, 8, 8)
            and y.shape == (x.shape[0],)
            and y.dtype == torch.int64
            and len(y) > 0
            and int(y.min()) >= 0
            and int(y.max()) < W.shape[0]
            and bool(torch.isfinite(x).all())
        )
        if not ok or W is None or b is None or x is None or y is None:
            raise InputError(
                f"{f}: tasks.{t}: the head needs weight [C, d] and bias [C], the probe images [N, 1, 8, 8] "
                "and int64 labels [N] in 0..C-1."
            )
        heads[t] = (W.float(), b.float())
        data[t] = (x.float(), y)
    return heads, data


def evaluate(
    model_dir: str | Path, testbed: str | Path, tasks: Sequence[str] | None = None, per_item: bool = False
) -> dict[str, dict]:
    """Per-task metrics of a vision checkpoint (a merged snapshot, the base or an expert) on the
    testbed's held-out images: ``{task: {"accuracy", "loss" (mean cross-entropy, nats/image),
    "n", "items" (1/0 per image, with ``per_item``)}}``. Runs in float32 on one thread with
    deterministic algorithms (weights of any dtype are read as float32).

    Raises:
        InputError: see :func:`load_body` and the testbed checks (unknown task, bad files).
    """
    import torch

    heads, data = _read_testbed(testbed, tasks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _scores(load_body(model_dir), heads, data, per_item)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ gates


def check_gates(
    base: dict[str, float],
    experts: dict[str, dict[str, float]],
    merged: dict[str, float],
    min_expert_gain: float,
    min_merge_ng: float,
) -> dict:
    """The testbed's build gates on held-out losses ``{task: cross-entropy}`` (``experts`` keyed
    by task; lower is better):

    1. every expert is the best model on its task, its loss at least ``min_expert_gain`` (a
       fraction, 0.1 = 10%) below the base's;
    2. the full task_arithmetic merge's loss is below the base's on every task and keeps at least
       ``min_merge_ng`` of every expert's normalised gain ``(L_base − L_merge)/(L_base − L_expert)``
       (:func:`mergepipe.metrics.normalised_gain`).

    Returns:
        ``{"passed", "failures": [str], "normalised_gain": {task: float}, "loss": {...}}``.
    """
    failures, ng = [], {}
    for t in experts:
        others = [experts[o][t] for o in experts if o != t]
        gain = base[t] - experts[t][t]
        if not (gain >= min_expert_gain * base[t] and experts[t][t] < min(others, default=math.inf)):
            failures.append(
                f"expert {t}: loss {experts[t][t]:.4f} on its task vs base {base[t]:.4f}, other experts "
                f"{min(others, default=math.inf):.4f} (needs {min_expert_gain:.0%} below the base and the best)"
            )
        ng[t] = (base[t] - merged[t]) / gain if gain > 0 else -math.inf
        if not (merged[t] < base[t] and ng[t] >= min_merge_ng):
            failures.append(
                f"the merge's loss on {t} {merged[t]:.4f} (base {base[t]:.4f}) keeps {ng[t]:.2f} of the "
                f"expert's gain (< {min_merge_ng})"
            )
    return {
        "passed": not failures,
        "failures": failures,
        "normalised_gain": ng,
        "loss": {"base": base, "experts": experts, "merge": merged},
    }


# ------------------------------------------------------------------------------------------ build


def default_root() -> Path:
    home = os.environ.get("MERGEPIPE_HOME")
    return (Path(home) if home else Path.home() / ".mergepipe") / "vision"


def build_vision(
    root: Path | None = None, config: VisionConfig | None = None, log: Callable[[str], None] | None = None
) -> VisionTestbed:
    """Build (once, cached under ``root/<config.key()>``, atomically and under a file lock:
    :func:`mergepipe_zoo._cache.cached_build`) and return the vision testbed.

    A build that fails its gates leaves only ``root/.<key>.gates-failed.json`` (the gate report),
    so a second call raises at once instead of training again.

    Raises:
        VisionGateError: the build fails its gates (no testbed is cached).
        RuntimeError: ``root/<key>`` exists without ``testbed.json`` (delete it to rebuild).
    """
    cfg = config or VisionConfig()
    root = Path(root or default_root()).expanduser().absolute()
    say = log or (lambda m: None)
    entry = cached_build(root, cfg.key(), "testbed.json", lambda tmp: _build_into(tmp, cfg, say), VisionGateError)
    return _load(entry, cfg)


def _load(entry: Path, cfg: VisionConfig) -> VisionTestbed:
    return VisionTestbed(
        root=entry,
        base=entry / "float32" / "base",
        experts={t: entry / "float32" / "experts" / t for t in cfg.tasks},
        config=cfg,
    )


def _build_into(tmp: Path, cfg: VisionConfig, log: Callable[[str], None]) -> None:
    """Train the base and the experts, write every checkpoint, head and probe set into ``tmp``,
    gate each dtype, and write ``testbed.json`` (only when every gate passes).

    Raises:
        VisionGateError: a dtype's gates fail (``gates.json`` is written first).
    """
    import torch

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = make_tasks(cfg)
        T = {k: tuple(torch.from_numpy(a) for a in v) for k, v in data.items()}
        base_sd = _train_base(T, cfg, log, t0)
        experts_sd, heads = _train_experts(tmp, T, base_sd, cfg, log)
        probe = {t: (T[t][2], T[t][3]) for t in cfg.tasks}
        gates = {dt: _save_and_gate(tmp, dt, base_sd, experts_sd, heads, probe, cfg, log) for dt in DTYPES}
        (tmp / "gates.json").write_text(json.dumps(gates, indent=1) + "\n")
        failed = [f"{dt}: {f}" for dt, g in gates.items() for f in g["failures"]]
        if failed:
            raise VisionGateError(f"vision testbed seed {cfg.seed} fails its gates: " + "; ".join(failed), gates)
        (tmp / "testbed.json").write_text(json.dumps(_testbed_record(cfg), indent=1) + "\n")
        log(f"vision testbed {cfg.key()} built in {time.perf_counter() - t0:.0f} s")
    finally:
        torch.set_num_threads(threads)


def _train_base(T: dict[str, tuple[Any, ...]], cfg: VisionConfig, log: Callable[[str], None], t0: float) -> dict:
    """The base: a CNN trained on the task mixture; its state dict rounded to bf16 (as released)."""
    import torch

    mc = _model_config(cfg, "float32")
    torch.manual_seed(_derive_seed(cfg.seed, "base-init"))
    body = DigitsCNN(mc)
    head = torch.nn.Linear(cfg.hidden[-1], 10)
    xtr, ytr = _mixture(T, cfg)
    loss = _train(
        body, head, xtr, ytr, cfg.base_epochs, cfg.base_lr, cfg.batch_size, _derive_seed(cfg.seed, "base"), True
    )
    base_sd = {k: v.to(torch.bfloat16).float() for k, v in body.state_dict().items()}  # released in bf16
    log(f"  base: {cfg.base_epochs} epochs, loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)")
    return base_sd


def _train_experts(
    tmp: Path, T: dict[str, tuple[Any, ...]], base_sd: dict, cfg: VisionConfig, log: Callable[[str], None]
) -> tuple[dict[str, dict], dict[str, tuple[Any, Any]]]:
    """One expert per task (LP-FT from the base); writes ``heads/<task>`` and ``eval/<task>``.
    Returns the experts' state dicts and the heads' ``(weight, bias)``."""
    import torch
    from safetensors.torch import save_file

    mc = _model_config(cfg, "float32")
    experts_sd, heads = {}, {}
    (tmp / "heads").mkdir()
    (tmp / "eval").mkdir()
    for t in cfg.tasks:
        t1 = time.perf_counter()
        xtr, ytr, xte, yte = T[t]
        torch.manual_seed(_derive_seed(cfg.seed, "expert", t))
        body = DigitsCNN(mc)
        body.load_state_dict(base_sd)
        body.eval()
        head = _probe(body, xtr, ytr, 10, cfg.probe_steps, cfg.probe_l2)
        seed = _derive_seed(cfg.seed, "ft", t)
        loss = _train(body, head, xtr, ytr, cfg.expert_epochs, cfg.expert_lr, cfg.batch_size, seed, False)
        experts_sd[t] = {k: v.detach().clone() for k, v in body.state_dict().items()}
        heads[t] = (head.weight.detach().clone(), head.bias.detach().clone())
        save_file(
            {"weight": heads[t][0].contiguous(), "bias": heads[t][1].contiguous()},
            str(tmp / "heads" / f"{t}.safetensors"),
        )
        save_file({"images": xte.contiguous(), "labels": yte.contiguous()}, str(tmp / "eval" / f"{t}.safetensors"))
        log(f"  {t}: probe + {cfg.expert_epochs} epochs, loss {loss:.3f} ({time.perf_counter() - t1:.0f} s)")
    return experts_sd, heads


def _save_and_gate(
    tmp: Path,
    dt: str,
    base_sd: dict,
    experts_sd: dict[str, dict],
    heads: dict[str, tuple[Any, Any]],
    probe: dict[str, tuple[Any, Any]],
    cfg: VisionConfig,
    log: Callable[[str], None],
) -> dict:
    """Write the base and experts in dtype ``dt`` and gate them: the gate merge is
    task_arithmetic on the saved (rounded) checkpoints, in float32 (:func:`check_gates`)."""
    mc = _model_config(cfg, "float32")
    _save(tmp / dt / "base", base_sd, cfg, dt)
    for t in cfg.tasks:
        _save(tmp / dt / "experts" / t, experts_sd[t], cfg, dt)
    rd = {n: {k: v.float() for k, v in _round(sd, dt).items()} for n, sd in {"base": base_sd, **experts_sd}.items()}
    merged = {k: rd["base"][k] + cfg.merge_weight * sum(rd[t][k] - rd["base"][k] for t in cfg.tasks) for k in base_sd}

    def acc(sd: dict) -> dict[str, float]:
        b = DigitsCNN(mc)
        b.load_state_dict(sd)
        return {t: v["loss"] for t, v in _scores(b.eval(), heads, probe, False).items()}

    g = check_gates(
        acc(rd["base"]), {t: acc(rd[t]) for t in cfg.tasks}, acc(merged), cfg.min_expert_gain, cfg.min_merge_ng
    )
    log(
        f"  gates {dt}: {'passed' if g['passed'] else 'FAILED'}; merge NG "
        + ", ".join(f"{t} {v:.2f}" for t, v in g["normalised_gain"].items())
    )
    return g


def _testbed_record(cfg: VisionConfig) -> dict[str, Any]:
    """``testbed.json``: tasks (probe set, head, labels), checkpoints per dtype, metric, config."""
    return {
        "format": FORMAT,
        "kind": KIND,
        "tasks": {
            t: {"probe": f"eval/{t}.safetensors", "head": f"heads/{t}.safetensors", "labels": list(range(10))}
            for t in cfg.tasks
        },
        "base": "float32/base",
        "experts": {t: f"float32/experts/{t}" for t in cfg.tasks},
        "checkpoints": {
            dt: {"base": f"{dt}/base", "experts": {t: f"{dt}/experts/{t}" for t in cfg.tasks}} for dt in DTYPES
        },
        "expert_task": {t: t for t in cfg.tasks},
        "metric": "loss",
        "config": asdict(cfg),
        "key": cfg.key(),
        "recommended_params": {"task_arithmetic": {"weight": cfg.merge_weight}},
        "source": "sklearn.datasets.load_digits (UCI optical recognition of handwritten digits, 8x8)",
    }
