"""Extract a PEFT LoRA adapter from a checkpoint's task vector: ``mergepipe extract-lora``.

For every linear module whose weight differs between the snapshot (any checkpoint: a merged
snapshot, a fine-tune) and the base, the task vector ``δ = θ − θ_base`` (float32, shape
``(out_features, in_features)``) is approximated by its truncated SVD (Eckart–Young: the best
rank-``r`` approximation in Frobenius norm), ``δ ≈ U_r Σ_r V_rᵀ``, written as LoRA factors
``B = U_r Σ_r^½`` ``(out, r)`` and ``A = Σ_r^½ V_rᵀ`` ``(r, in)`` with ``lora_alpha = r`` (scale
1), so that PEFT's ``δ = (lora_alpha/r)·B·A`` is the approximation. The split of Σ between the
factors follows mergekit's ``mergekit-extract-lora`` (its default distributes the singular values
between A and B); a module whose ``min(out, in)`` is below ``r`` gets that rank
(``rank_pattern``) and is exact.

The adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's layout
(``base_model.model.<module>.lora_A.weight``); ``PeftModel.from_pretrained(base_model, DIR)``
loads it. ``extract_report.json`` beside them records, per module, the rank and the **explained
energy** ``Σ_{i<r} σᵢ² / Σ σᵢ² = 1 − ‖δ − δ_r‖²/‖δ‖²``, and the task-vector energy the adapter
cannot carry: tensors that changed but are not linear weights (norms, biases, embeddings — PEFT
LoRA on them would need other module types).

Streaming: one module at a time is read (base and snapshot rows of that tensor), decomposed and
written into memory as its two small factors, so peak memory is one tensor's δ and its SVD
workspace (``torch.linalg.svd``, float32, ``full_matrices=False``: about ``3·out·in`` floats),
whatever the model size; unchanged tensors are compared by their bytes and skipped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import FLOAT_DTYPES
from mergepipe.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SAVED_PREFIX
from mergepipe.storage.base import Storage
from mergepipe.storage.local import fresh_folder, fsync_folder, write_new_file

REPORT = "extract_report.json"
#: adapter factor dtypes accepted by ``--dtype``
FACTOR_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _is_embedding(name: str) -> bool:
    """2-D weights PEFT would wrap as ``nn.Embedding`` (token/position embeddings), not linear."""
    low = name.lower()
    return "embed" in low or low.endswith(("wte.weight", "wpe.weight"))


def extract_lora(
    storage: Storage,
    snapshot: str,
    base: str,
    rank: int,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Write a PEFT LoRA adapter approximating ``snapshot − base`` at rank ``rank`` into ``out``.

    Args:
        storage: reads both checkpoints (bytes counted: ``base`` and ``expert`` roles).
        snapshot, base: checkpoint folders or ``s3://`` prefixes with the same tensor names and
            shapes (dtypes may differ, e.g. a snapshot written with another ``out_dtype``).
        rank: the LoRA rank r (>= 1).
        out: a local folder that must not exist; created complete or not at all (written in a
            hidden sibling folder, then renamed).
        dtype: the factors' dtype (``float32``, ``bfloat16``, ``float16``).
        progress: called with each module's name as it is done.

    Returns:
        The report written to ``out/extract_report.json`` (see the module docstring).

    Raises:
        InputError: a bad rank or dtype, ``out`` exists, is not a local path, lies inside the
            snapshot or the base, or cannot be created there (a parent that is a file, an
            unwritable folder, a name too long: :func:`mergepipe.commit.manifest.check_output`),
            the checkpoints' tensors differ in names or shapes, or nothing linear changed —
            before anything is written (the first four before anything is read).
    """
    outp = _check_extract_args(rank, dtype, out, snapshot, base)
    t0 = time.perf_counter()
    from mergepipe.formats.safetensors import load_layout

    bl = load_layout(storage, base, role="catalog")
    sl = load_layout(storage, snapshot, role="catalog")
    _check_same_tensors(bl, sl, snapshot, base)
    ex = _Extraction(str(snapshot))
    for name, bt in bl.tensors.items():
        if bt.dtype not in FLOAT_DTYPES or bt.numel == 0:
            continue
        d = _task_vector(storage, bl, sl, base, snapshot, name)
        if d is not None:
            ex.add(name, list(bt.shape), d, rank, dtype, progress)
    if not ex.modules:
        raise InputError(
            f"{snapshot}: no linear weight differs from the base {base}; there is no task vector to extract."
        )
    config = _adapter_config(base, rank, ex)
    report = _extract_report(snapshot, base, rank, dtype, ex)
    _write_adapter(outp, ex.factors, config, report, t0)
    return report


def _check_extract_args(rank: int, dtype: str, out: str | os.PathLike, snapshot: str, base: str) -> Path:
    """Validate :func:`extract_lora`'s arguments before any byte is read; returns ``out`` as a Path.

    Raises:
        InputError: a bad rank or dtype, ``out`` is not local or exists, or cannot be created
            there (:func:`mergepipe.commit.manifest.check_output`).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"--rank {rank!r}: must be a positive integer, e.g. 16.")
    if dtype not in FACTOR_DTYPES:
        raise InputError(f"--dtype {dtype!r}: use one of {', '.join(FACTOR_DTYPES)}.")
    if "://" in str(out):
        raise InputError(
            f"--out {out}: extract-lora writes a local adapter folder; give a local path and copy the folder "
            "to object storage afterwards."
        )
    outp = Path(out)
    if outp.exists() or outp.is_symlink():
        raise InputError(f"--out {out}: already exists; extract-lora writes a new folder (remove it or pick another).")
    from mergepipe.commit.manifest import check_output

    # before any byte is read or any SVD computed: a parent that is a file, an unwritable folder,
    # a name too long for the filesystem, or a folder inside the snapshot or the base
    check_output(outp, None, inputs=[snapshot, base])
    return outp


def _check_same_tensors(bl: Any, sl: Any, snapshot: str, base: str) -> None:
    """Refuse a snapshot whose tensor names or shapes differ from the base's (``InputError``)."""
    for n, bt in bl.tensors.items():
        st = sl.tensors.get(n)
        if st is None or st.shape != bt.shape:
            what = "is missing" if st is None else f"is {list(st.shape)}, the base's {list(bt.shape)}"
            raise InputError(
                f"{snapshot}: tensor {n!r} {what}; extract-lora needs the snapshot of a merge of this base "
                "(same tensor names and shapes)."
            )
    extra = [n for n in sl.tensors if n not in bl.tensors]
    if extra:
        raise InputError(f"{snapshot}: tensor {extra[0]!r} is not in the base {base}; pick the snapshot's true base.")


def _task_vector(storage: Storage, bl: Any, sl: Any, base: str, snapshot: str, name: str) -> Any:
    """Tensor ``name``'s task vector ``θ − θ_base`` (flat float32 numpy array), or None when the
    snapshot's bytes equal the base's (same dtype). Reads role ``base`` then ``expert``."""
    import numpy as np

    from mergepipe.numerics import decode

    bt, st = bl.tensors[name], sl.tensors[name]
    braw = storage.read_range(storage.join(base, bt.file), bt.start, bt.end, "base")
    sraw = storage.read_range(storage.join(snapshot, st.file), st.start, st.end, "expert")
    if st.dtype == bt.dtype and braw == sraw:
        return None  # unchanged: no task vector
    b = decode(braw, bt.dtype).astype(np.float32, copy=False)
    del braw
    d = decode(sraw, st.dtype).astype(np.float32, copy=False) - b
    return d


def _factorize(d: Any, rows: int, cols: int, rank: int, dtype: str) -> tuple[Any, Any, int, float]:
    """Truncated SVD of ``d`` (``rows·cols`` float32) as LoRA factors ``(A (r, cols), B (rows, r),
    r, explained energy)``, ``r = min(rank, rows, cols)``, factors in ``dtype`` (see the module
    docstring)."""
    import torch

    r = min(rank, rows, cols)
    u, s, vh = torch.linalg.svd(torch.from_numpy(d.reshape(rows, cols)), full_matrices=False)
    s64 = s.double()
    explained = float((s64[:r] ** 2).sum() / (s64**2).sum()) if float(s64.abs().sum()) > 0 else 1.0
    root = s[:r].sqrt()
    tdt = getattr(torch, dtype)
    bf = (u[:, :r] * root).to(tdt).contiguous()
    af = (root[:, None] * vh[:r]).to(tdt).contiguous()
    return af, bf, r, explained


@dataclass
class _Extraction:
    """What :func:`extract_lora` has gathered so far: factors (PEFT names -> tensors), the
    report's ``modules``/``skipped`` rows, the rank pattern, and the energies (float64 sums)."""

    snapshot: str
    factors: dict[str, Any] = field(default_factory=dict)
    modules: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    total_energy: float = 0.0
    captured: float = 0.0

    def add(
        self, name: str, shape: list[int], d: Any, rank: int, dtype: str, progress: Callable[[str], None] | None
    ) -> None:
        """Account tensor ``name``'s task vector ``d``: factorize a changed linear weight, record
        a changed other tensor as skipped. Raises InputError on a non-finite task vector."""
        import numpy as np

        energy = float(np.dot(d.astype(np.float64), d.astype(np.float64)))
        if not math.isfinite(energy):
            raise InputError(
                f"{self.snapshot}: tensor {name!r} has a non-finite task vector (NaN or inf); check the snapshot."
            )
        self.total_energy += energy
        linear = len(shape) == 2 and name.endswith(".weight") and not _is_embedding(name)
        if not linear or energy == 0.0:
            if energy > 0.0:
                why = "embedding" if _is_embedding(name) else f"{len(shape)}-D, not a linear layer's weight"
                self.skipped.append({"tensor": name, "shape": shape, "energy": energy, "reason": why})
            return
        rows, cols = int(shape[0]), int(shape[1])
        af, bf, r, explained = _factorize(d, rows, cols, rank, dtype)
        module = name[: -len(".weight")]
        self.factors[f"{SAVED_PREFIX}{module}.lora_A.weight"] = af
        self.factors[f"{SAVED_PREFIX}{module}.lora_B.weight"] = bf
        if r != rank:
            self.rank_pattern[module] = r
        self.captured += explained * energy
        row = {"module": module, "tensor": name, "shape": [rows, cols], "rank": r, "energy": energy}
        self.modules.append({**row, "explained_energy": explained})
        if progress:
            progress(module)


def _adapter_config(base: str, rank: int, ex: _Extraction) -> dict:
    """PEFT's ``adapter_config.json`` for the extracted factors (scale ``lora_alpha / r`` = 1)."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "target_modules": sorted(m["module"] for m in ex.modules),
        "rank_pattern": {k: v for k, v in ex.rank_pattern.items()},
        # scale = lora_alpha / r must be 1 for every module, so a module of smaller rank gets alpha = rank
        "alpha_pattern": {k: v for k, v in ex.rank_pattern.items()},
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _extract_report(snapshot: str, base: str, rank: int, dtype: str, ex: _Extraction) -> dict:
    """``extract_report.json`` (see the module docstring); ``adapter_bytes``/``seconds`` are
    filled in when the adapter is written."""
    lin = sum(m["energy"] for m in ex.modules)
    return {
        "format": "mergepipe.extract-lora/v1",
        "snapshot": str(snapshot),
        "base": str(base),
        "rank": rank,
        "dtype": dtype,
        "modules": ex.modules,
        "skipped": ex.skipped,
        "linear_energy": lin,
        "explained_energy_linear": ex.captured / lin if lin > 0 else 1.0,
        "total_energy": ex.total_energy,
        "explained_energy_total": ex.captured / ex.total_energy if ex.total_energy > 0 else 1.0,
        "adapter_bytes": None,
        "seconds": 0.0,
    }


def _write_adapter(outp: Path, factors: dict[str, Any], config: dict, report: dict, t0: float) -> None:
    """Write the adapter folder ``outp`` complete or not at all: the three files in a hidden
    sibling folder (ours alone), fsynced, then renamed. Fills ``report``'s ``adapter_bytes`` and
    ``seconds`` (since ``t0``, ``time.perf_counter``)."""
    from safetensors.torch import save_file

    parent = outp.parent if str(outp.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    stage = parent / f".{outp.name}.extract-{os.getpid()}"
    try:
        fresh_folder(stage)  # ours alone (0700; a planted link there is removed, never followed)
        save_file(factors, str(stage / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_new_file(stage / ADAPTER_CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        report["adapter_bytes"] = (stage / ADAPTER_WEIGHTS).stat().st_size
        report["seconds"] = round(time.perf_counter() - t0, 3)
        write_new_file(stage / REPORT, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
        for f in stage.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_folder(stage, strict=True)  # the three names, then the rename, survive a crash
        os.rename(stage, outp)
        fsync_folder(parent, strict=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
