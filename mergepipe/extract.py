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
from pathlib import Path

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
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from mergepipe.formats.safetensors import load_layout
    from mergepipe.numerics import decode

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
    t0 = time.perf_counter()
    bl = load_layout(storage, base, role="catalog")
    sl = load_layout(storage, snapshot, role="catalog")
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

    def read(layout, uri, name, role):
        t = layout.tensors[name]
        return storage.read_range(storage.join(uri, t.file), t.start, t.end, role)

    tdt = getattr(torch, dtype)
    factors: dict[str, torch.Tensor] = {}
    modules: list[dict] = []
    skipped: list[dict] = []
    rank_pattern: dict[str, int] = {}
    total_energy = captured = 0.0
    for name, bt in bl.tensors.items():
        if bt.dtype not in FLOAT_DTYPES or bt.numel == 0:
            continue
        st = sl.tensors[name]
        braw = read(bl, base, name, "base")
        sraw = read(sl, snapshot, name, "expert")
        if st.dtype == bt.dtype and braw == sraw:
            continue  # unchanged: no task vector
        b = decode(braw, bt.dtype).astype(np.float32, copy=False)
        d = decode(sraw, st.dtype).astype(np.float32, copy=False) - b
        del braw, sraw, b
        energy = float(np.dot(d.astype(np.float64), d.astype(np.float64)))
        if not math.isfinite(energy):
            raise InputError(
                f"{snapshot}: tensor {name!r} has a non-finite task vector (NaN or inf); check the snapshot."
            )
        total_energy += energy
        linear = len(bt.shape) == 2 and name.endswith(".weight") and not _is_embedding(name)
        if not linear or energy == 0.0:
            if energy > 0.0:
                why = "embedding" if _is_embedding(name) else f"{len(bt.shape)}-D, not a linear layer's weight"
                skipped.append({"tensor": name, "shape": list(bt.shape), "energy": energy, "reason": why})
            continue
        rows, cols = int(bt.shape[0]), int(bt.shape[1])
        r = min(rank, rows, cols)
        dm = torch.from_numpy(d.reshape(rows, cols))
        u, s, vh = torch.linalg.svd(dm, full_matrices=False)
        del dm, d
        s64 = s.double()
        explained = float((s64[:r] ** 2).sum() / (s64**2).sum()) if float(s64.abs().sum()) > 0 else 1.0
        root = s[:r].sqrt()
        bf = (u[:, :r] * root).to(tdt).contiguous()
        af = (root[:, None] * vh[:r]).to(tdt).contiguous()
        del u, s, vh
        module = name[: -len(".weight")]
        factors[f"{SAVED_PREFIX}{module}.lora_A.weight"] = af
        factors[f"{SAVED_PREFIX}{module}.lora_B.weight"] = bf
        if r != rank:
            rank_pattern[module] = r
        captured += explained * energy
        modules.append(
            {
                "module": module,
                "tensor": name,
                "shape": [rows, cols],
                "rank": r,
                "energy": energy,
                "explained_energy": explained,
            }
        )
        if progress:
            progress(module)
    if not modules:
        raise InputError(
            f"{snapshot}: no linear weight differs from the base {base}; there is no task vector to extract."
        )
    config = {
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
        "target_modules": sorted(m["module"] for m in modules),
        "rank_pattern": {k: v for k, v in rank_pattern.items()},
        # scale = lora_alpha / r must be 1 for every module, so a module of smaller rank gets alpha = rank
        "alpha_pattern": {k: v for k, v in rank_pattern.items()},
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    lin = sum(m["energy"] for m in modules)
    report = {
        "format": "mergepipe.extract-lora/v1",
        "snapshot": str(snapshot),
        "base": str(base),
        "rank": rank,
        "dtype": dtype,
        "modules": modules,
        "skipped": skipped,
        "linear_energy": lin,
        "explained_energy_linear": captured / lin if lin > 0 else 1.0,
        "total_energy": total_energy,
        "explained_energy_total": captured / total_energy if total_energy > 0 else 1.0,
        "adapter_bytes": None,
        "seconds": 0.0,
    }
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
    return report
