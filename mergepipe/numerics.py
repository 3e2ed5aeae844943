"""Numeric primitives shared by the catalog, the planner and the merge kernels (numpy only).

Three definitions here are mergepipe's canonical, device-independent semantics:

* **Magnitude key** (:func:`magnitude_keys`): ``|δ|`` (float32) rounded to bfloat16 with
  round-to-nearest-even, read as the 15-bit integer pattern (0 .. 0x7F80). Keys are monotone in
  magnitude. For bf16 checkpoints this equals mergekit's ``|δ|`` (mergekit subtracts in bf16,
  which rounds the same way), so magnitude trims agree with mergekit except among ties.
* **Trim rule** (:func:`trim_min_key`): TIES/breadcrumbs keep the ``k = int(density * numel)``
  largest magnitudes. Among entries whose key equals the k-th largest key ``τ`` (ties: bf16
  task vectors tie massively), mergekit's ``argsort`` keeps an unspecified subset. mergepipe
  keeps *all* tied entries when that lands nearer to ``k`` than keeping none, else none (a tie
  in distance keeps them). The decision needs only the key histogram, so the catalog fixes it
  at analyze time and block-wise execution reproduces a dense whole-tensor merge exactly.
* **DARE random stream** (:func:`dare_keep_mask`): element ``j`` of expert ``i``'s task vector
  in tensor ``t`` is kept iff ``splitmix64(key(seed, i, t) + j) < density * 2**64`` — a
  counter-based stream, so any block can be drawn without drawing the ones before it.
"""

from __future__ import annotations

import hashlib

import numpy as np

N_KEYS = 0x8000  # 15-bit magnitude keys (sign bit is always 0)
OCT_SHIFT = 7  # key >> 7 = the bf16 exponent field: one "octave" of magnitudes
N_OCT = N_KEYS >> OCT_SHIFT  # 256


def decode(raw: bytes | memoryview | np.ndarray, dtype: str) -> np.ndarray:
    """Decode little-endian safetensors bytes to a float32 (or float64 for F64) numpy array.

    Args:
        raw: the tensor bytes (any length multiple of the itemsize).
        dtype: safetensors dtype name. BF16 is widened exactly by shifting into float32;
            F8 types are decoded through torch (imported lazily).

    Returns:
        1-D array, float32 for every float dtype but F64 (float64), int64 for integer types.
    """
    buf = np.frombuffer(raw, dtype=np.uint8)
    if dtype == "BF16":
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F32":
        return buf.view("<f4").copy()
    if dtype == "F16":
        return buf.view("<f2").astype(np.float32)
    if dtype == "F64":
        return buf.view("<f8").copy()
    if dtype in ("F8_E4M3", "F8_E5M2"):
        import torch

        t = torch.frombuffer(bytearray(buf.tobytes()), dtype=getattr(torch, "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e5m2"))
        return t.float().numpy()
    from mergepipe.formats.safetensors import DTYPES

    return buf.view(DTYPES[dtype][2]).astype(np.int64)


def magnitude_keys(delta: np.ndarray) -> np.ndarray:
    """Magnitude keys of a float32 array: ``|δ|`` rounded to bf16 (RNE), as int32 in [0, 0x7F80].

    Matches ``delta.abs().to(torch.bfloat16).view(torch.int16)`` for finite inputs (tested).
    """
    bits = np.abs(delta.astype(np.float32, copy=False)).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.minimum(rounded, np.uint32(0x7F80)).astype(np.int32)


def key_value(key: int | np.ndarray) -> np.ndarray:
    """The float32 magnitude a key stands for (its bf16 value)."""
    return (np.asarray(key, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def trim_min_key(keys: np.ndarray, counts: np.ndarray, numel: int, density: float) -> int:
    """The smallest magnitude key kept by a magnitude trim to ``density`` (canonical tie rule).

    Args:
        keys: sorted distinct magnitude keys present in the tensor (int).
        counts: how many entries have each key (int, same length).
        numel: number of elements of the tensor.
        density: fraction to keep, in (0, 1].

    Returns:
        ``min_key``: keep an entry iff its key ``>= min_key``. ``0`` keeps everything.

    Source: TIES-Merging (Yadav et al., 2023, arXiv:2306.01708) keeps the top-k magnitudes;
    mergekit's ``sparsify.magnitude`` uses ``k = int(density * numel)`` (at least 1).
    """
    if density >= 1.0 or numel == 0 or len(keys) == 0:
        return 0
    k = max(1, int(density * numel))
    order = np.argsort(keys)[::-1]
    ks = np.asarray(keys)[order]
    cs = np.asarray(counts, dtype=np.int64)[order]
    cum = np.cumsum(cs)
    i = int(np.searchsorted(cum, k, side="left"))  # first key where the cumulative count >= k
    if i >= len(ks):
        return 0
    tau = int(ks[i])
    above = int(cum[i] - cs[i])
    ties = int(cs[i])
    if tau == 0:
        return 1  # zeros contribute nothing; keep all non-zero entries
    inclusive = (above + ties - k) <= (k - above)
    return tau if inclusive else tau + 1


def histogram(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sparse histogram of magnitude keys: (distinct keys ascending, counts)."""
    c = np.bincount(keys.ravel(), minlength=N_KEYS)
    nz = np.nonzero(c)[0]
    return nz.astype(np.int32), c[nz].astype(np.int64)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over uint64 arrays (Steele, Lea, Flood 2014; Vigna's reference)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stream_key(seed: int, expert_index: int, tensor: str) -> int:
    """The 64-bit key of the DARE random stream of one (expert, tensor) pair."""
    h = hashlib.sha256(f"mergepipe-dare/{seed}/{expert_index}/{tensor}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def dare_keep_mask(key: int, start: int, n: int, density: float) -> np.ndarray:
    """Bernoulli(density) keep-mask for flat elements ``[start, start + n)`` of one stream.

    Source: DARE (Yu et al., 2024, "Language Models are Super Mario", arXiv:2311.03099) drops each
    delta entry with probability ``1 - density``; mergekit draws ``torch.bernoulli``. Here the
    draw is counter-based (see module docstring), so blocks are independent of read order.
    """
    if density >= 1.0:
        return np.ones(n, dtype=bool)
    with np.errstate(over="ignore"):
        idx = np.arange(start, start + n, dtype=np.uint64) + np.uint64(key)
    u = splitmix64(idx)
    thresh = np.uint64(min(int(density * 2.0**64), 2**64 - 1))
    return u < thresh
