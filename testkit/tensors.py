"""Reading merged checkpoints back and comparing tensors bit for bit."""

from __future__ import annotations

import glob
import os


def merged_tensors(folder) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (torch tensors by name)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        out.update(load_file(f))
    return out


def same_bits(a, b) -> bool:
    """Whether two torch tensors have the same dtype, shape and bits (NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(iv), b.view(iv))
    return torch.equal(a, b)
