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
  at analyze time and block-wise execution reproduces a dense whole-tensor merge exactly. For
  bf16, float16 and float32 inputs TIES (and breadcrumbs' window ends) then rank the exact
  float32 magnitudes inside the threshold key group (a bf16 task vector's float32 |δ| is often not
  a bf16 value, so the group holds distinct magnitudes) (:func:`trim_rank` locates the threshold key group, :func:`exact_shrink` the float32
  threshold inside it; the same tie rule applies to exactly equal values only).
* **DARE random stream** (:func:`dare_keep_mask`): element ``j`` of expert ``i``'s task vector
  in tensor ``t`` is kept iff ``splitmix64(key(seed, i, t) + j) < density * 2**64`` — a
  counter-based stream, so any block can be drawn without drawing the ones before it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mergepipe.formats.safetensors import DTYPES

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

        t = torch.frombuffer(
            bytearray(buf.tobytes()), dtype=getattr(torch, "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e5m2")
        )
        return t.float().numpy()
    np_dtype = DTYPES[dtype][2]
    if np_dtype is None:
        raise ValueError(f"decode: no numpy layout for safetensors dtype {dtype}")
    return buf.view(np_dtype).astype(np.int64)


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


class KeyTable(NamedTuple):
    """A magnitude-key histogram sorted by key, descending, with its cumulative counts: what
    every top-k rule over the histogram searches (:func:`key_table`). Built once per tensor's
    statistics and reused by every rule (:attr:`mergepipe.catalog.stats.TensorStats.key_table`).

    Attributes:
        keys: the histogram's keys (int), descending.
        counts: int64 entries per key, same order.
        cum: int64 cumulative sum of ``counts``.
    """

    keys: np.ndarray
    counts: np.ndarray
    cum: np.ndarray


def key_table(keys: np.ndarray, counts: np.ndarray) -> KeyTable:
    """The :class:`KeyTable` of a key histogram (``keys`` int, ``counts`` int, same length).
    Keys strictly ascending (as the catalog records them) are reversed without a sort: the one
    order a sort of distinct keys can give."""
    keys = np.asarray(keys)
    if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
        cs = np.asarray(counts, dtype=np.int64)[::-1]
        return KeyTable(keys[::-1], cs, np.cumsum(cs))
    order = np.argsort(keys)[::-1]
    cs = np.asarray(counts, dtype=np.int64)[order]
    return KeyTable(keys[order], cs, np.cumsum(cs))


def trim_min_key(
    keys: np.ndarray, counts: np.ndarray, numel: int, density: float, table: KeyTable | None = None
) -> int:
    """The smallest magnitude key kept by a magnitude trim to ``density`` (canonical tie rule).

    Args:
        keys: sorted distinct magnitude keys present in the tensor (int).
        counts: how many entries have each key (int, same length).
        numel: number of elements of the tensor.
        density: fraction to keep, in (0, 1].
        table: ``key_table(keys, counts)`` when already built (the same result, faster).

    Returns:
        ``min_key``: keep an entry iff its key ``>= min_key``. ``0`` keeps everything.

    Source: TIES-Merging (Yadav et al., 2023, arXiv:2306.01708) keeps the top-k magnitudes;
    mergekit's ``sparsify.magnitude`` uses ``k = int(density * numel)`` (at least 1).
    """
    if density >= 1.0 or numel == 0 or len(keys) == 0:
        return 0
    k = max(1, int(density * numel))
    ks, cs, cum = table if table is not None else key_table(keys, counts)
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


def trim_rank(
    keys: np.ndarray, counts: np.ndarray, numel: int, density: float, table: KeyTable | None = None
) -> tuple[int, int, int]:
    """Where the ``k = max(1, int(density * numel))`` largest magnitudes end, by key histogram.

    Returns:
        ``(tau, rank, ties)``: ``tau`` the key of the k-th largest entry, ``ties`` how many entries
        have key ``tau`` and ``rank = k − (entries with key > tau)``, in ``[1, ties]``: how many of
        the ``tau`` group exact top-k keeps. ``(0, 0, 0)`` when nothing is trimmed
        (``density >= 1``, empty) and ``tau = 0`` when the k-th largest is 0. ``table``:
        ``key_table(keys, counts)`` when already built (the same result, faster).
    """
    if density >= 1.0 or numel == 0 or len(keys) == 0:
        return 0, 0, 0
    k = max(1, int(density * numel))
    ks, cs, cum = table if table is not None else key_table(keys, counts)
    i = int(np.searchsorted(cum, k, side="left"))
    if i >= len(ks):
        return 0, 0, 0
    return int(ks[i]), int(k - (cum[i] - cs[i])), int(cs[i])


def topk_rank(keys: np.ndarray, counts: np.ndarray, k: int, table: KeyTable | None = None) -> tuple[int, int, int]:
    """:func:`trim_rank` for an explicit count ``k`` (``0 < k < numel``): ``(tau, rank, ties)``
    of the k largest entries by key histogram; ``(0, 0, 0)`` outside that range. ``table``:
    ``key_table(keys, counts)`` when already built (the same result, faster)."""
    n = int(np.asarray(counts, dtype=np.int64).sum())
    if k <= 0 or k >= n or len(keys) == 0:
        return 0, 0, 0
    ks, cs, cum = table if table is not None else key_table(keys, counts)
    i = int(np.searchsorted(cum, k, side="left"))
    return int(ks[i]), int(k - (cum[i] - cs[i])), int(cs[i])


def outlier_counts(numel: int, density: float, gamma: float) -> tuple[int, int] | None:
    """Breadcrumbs' two top-set sizes: ``(k_lo, k_top)`` with ``k_lo = numel − n_bot`` (keep the
    top ``k_lo``) and ``k_top = numel − n_bot − target`` (drop the top ``k_top``, the outliers);
    None when ``density >= 1`` or the tensor is empty (keep all). See :func:`outlier_window`."""
    if density >= 1.0 or numel == 0:
        return None
    target = int(density * numel)
    n_top = int(gamma * numel)
    n_bot = max(0, numel - target - n_top)
    return numel - n_bot, numel - n_bot - target


def exact_shrink(group: np.ndarray, rank: int, all_below: bool = False) -> float | None:
    """The float32 ``λ`` of an exact magnitude trim inside one key group: keep ``|δ| > λ``.

    Args:
        group: float32 ``|δ|`` of the entries of one task vector whose magnitude key is the
            threshold key ``tau`` (any order), as read.
        rank: how many of them exact top-k keeps (:func:`trim_rank`).
        all_below: when the whole group is in the top set, return ``λ`` just below its smallest
            value instead of None (breadcrumbs' outlier bound: ``|δ| <= λ`` is then the rest).

    Returns:
        With ``v`` the ``rank``-th largest of ``group``, ``a`` the count above ``v`` and ``t`` the
        count equal to it: ``λ`` just below ``v`` (the equal values kept) when ``a + t − rank <=
        rank − a`` (the canonical tie rule, on exactly equal values only), else ``v``. None when
        ``group`` has at most ``rank`` entries (keep the whole group: the key rule).

    Entries with a larger key are larger than every group value and entries with a smaller key
    smaller, so ``|δ| > λ`` is exactly the top-k set of the whole task vector (ties broken as
    above) when every entry of the group is present.
    """
    g = np.asarray(group, dtype=np.float32)
    if len(g) <= rank:
        return None if not all_below else (float(np.nextafter(g.min(), np.float32(0))) if len(g) else None)
    v = np.partition(g, len(g) - rank)[len(g) - rank]  # the rank-th largest
    above = int((g > v).sum())
    ties = int((g == v).sum())
    if above + ties - rank <= rank - above:
        return float(np.nextafter(v, np.float32(0)))
    return float(v)


#: bins of a key group's bit histogram (:func:`key_group_bits`): every float32 in one key group
GROUP_BINS = 0x10001


def key_group_bits(tau: int) -> tuple[int, int]:
    """The float32 bit patterns of the magnitudes whose key is ``tau``: ``(lo, n)``, the group is
    the bit patterns ``lo .. lo + n − 1`` (consecutive: the key rounds ``|δ|`` to bf16 with
    round-to-nearest-even, which is monotone; ``n <= GROUP_BINS``).

    For an even ``tau`` both midpoints round to it (``n = 0x10001``); for an odd one neither
    (``n = 0xFFFF``). Positive float32 values compare as their bit patterns, so a count per
    pattern is an exact histogram of the group's values.

    Raises:
        ValueError: ``tau`` outside ``[1, 0x7F7F]`` (key 0 is the zeros, key ``0x7F80`` holds
            infinities and NaN, which have no bit order).
    """
    if not 1 <= tau < 0x7F80:
        raise ValueError(f"key_group_bits: key {tau} has no bounded float32 group (1 .. 0x7F7F)")
    odd = tau & 1
    return (tau << 16) - 0x8000 + odd, GROUP_BINS - 2 * odd


def exact_shrink_hist(hist: np.ndarray, lo: int, rank: int, all_below: bool = False) -> float | None:
    """:func:`exact_shrink` from a bit histogram of the group instead of its values.

    Args:
        hist: int64 ``(n,)``: ``hist[i]`` entries of the group have float32 bit pattern ``lo + i``
            (:func:`key_group_bits`; built tile by tile, so memory is ``8·GROUP_BINS`` bytes
            whatever the group's size).
        lo: the bit pattern of bin 0 (positive, so the patterns order as the values).
        rank, all_below: as :func:`exact_shrink`.

    Returns:
        The value :func:`exact_shrink` returns for the multiset of values the histogram counts
        (the same ``λ`` bit for bit: the rank-th largest ``v`` is the bin where the count from
        the top reaches ``rank``; ``a`` and ``t`` are the counts above and in that bin; "just
        below ``v``" is the bit pattern ``v − 1``, positive values being ordered by bits).

    This is an exact selection in bounded memory (a radix select with one 16-bit digit: the key
    fixes the upper bits), replacing the collect-and-partition of the group's values.
    """
    h = np.asarray(hist, dtype=np.int64)
    total = int(h.sum())
    if total <= rank:
        if not all_below or total == 0:
            return None
        return _bits_f32(lo + int(np.flatnonzero(h)[0]) - 1)
    top = np.cumsum(h[::-1])
    j = int(np.searchsorted(top, rank, side="left"))  # bins from the top until the count reaches rank
    ties = int(h[len(h) - 1 - j])
    above = int(top[j]) - ties
    v = lo + len(h) - 1 - j
    return _bits_f32(v - 1 if above + ties - rank <= rank - above else v)


def _bits_f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


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


# --- canonical top-k threshold, breadcrumbs window -------------------------------------------


def topk_min_key(keys: np.ndarray, counts: np.ndarray, k: int, table: KeyTable | None = None) -> int:
    """The smallest key of the canonical top-``k`` set of a key histogram.

    With ``τ`` the k-th largest key, ``A`` the entries above ``τ`` and ``T`` those equal to it,
    the set holds every entry with key ``> τ`` and *all or none* of the ties: all when
    ``A + T`` is at least as close to ``k`` as ``A`` is. Returns ``N_KEYS`` (no key qualifies)
    for ``k <= 0`` and 0 (everything) for ``k >= numel``. Unlike :func:`trim_min_key` there is no
    special case for zeros. ``table``: ``key_table(keys, counts)`` when already built (the same
    result, faster).
    """
    n = int(np.asarray(counts, dtype=np.int64).sum())
    if k <= 0:
        return N_KEYS
    if k >= n or len(keys) == 0:
        return 0
    ks, cs, cum = table if table is not None else key_table(keys, counts)
    i = int(np.searchsorted(cum, k, side="left"))
    tau = int(ks[i])
    above = int(cum[i] - cs[i])
    ties = int(cs[i])
    return tau if (above + ties - k) <= (k - above) else tau + 1


def outlier_window(
    keys: np.ndarray, counts: np.ndarray, numel: int, density: float, gamma: float, table: KeyTable | None = None
) -> tuple[int, int]:
    """Breadcrumbs' ``magnitude_outliers`` as a key window: keep ``min_key <= key < max_key``.

    mergekit 0.1.5 sorts ``|δ|`` ascending and keeps positions ``[n_bot, n_bot + target)`` with
    ``target = int(density·n)``, ``n_top = int(gamma·n)``, ``n_bot = max(0, n − target − n_top)``:
    it drops the ``n_bot`` smallest and the ``n − n_bot − target`` largest. Both ends use the
    canonical tie rule of :func:`topk_min_key`: the upper bound is the threshold of the top
    ``n − n_bot − target`` (the outliers; ties there are dropped when that lands at least as near
    the count), the lower bound that of the top ``n − n_bot`` (ties kept when at least as near).
    ``density >= 1`` keeps everything (mergekit returns the tensor unchanged, ignoring gamma).

    Returns:
        ``(min_key, max_key)``; ``(0, N_KEYS)`` keeps all, ``min_key >= max_key`` keeps nothing.
        ``table``: ``key_table(keys, counts)`` when already built (the same result, faster).
    """
    if density >= 1.0 or numel == 0:
        return 0, N_KEYS
    target = int(density * numel)
    if target <= 0:
        return N_KEYS, N_KEYS
    n_top = int(gamma * numel)
    n_bot = max(0, numel - target - n_top)
    k_top = numel - n_bot - target
    max_key = N_KEYS if k_top <= 0 else topk_min_key(keys, counts, k_top, table)
    min_key = 0 if n_bot == 0 else topk_min_key(keys, counts, numel - n_bot, table)
    return int(min_key), int(max_key)


# --- canonical sums of products (whole-tensor statistics) ----------------------------------


def segment_dots(a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    """float64 ``Σ a·b`` of each consecutive ``width``-element segment of two flat arrays.

    Products are formed in float64 (exact for float32 inputs) and each segment is summed by
    numpy's row reduction, whose result for a segment does not depend on the segments around it
    (tested). Whole-tensor statistics are :func:`exact_total` of per-row values, so they do not
    depend on how rows are grouped into chunks.
    """
    if a.size == 0:
        return np.zeros(0)
    a64 = a.astype(np.float64, copy=False).reshape(-1, width)
    b64 = a64 if b is a else b.astype(np.float64, copy=False).reshape(-1, width)
    return (a64 * b64).sum(axis=1)


def exact_total(parts) -> float:
    """Exactly rounded sum (``math.fsum``) of float64 partial sums."""
    return math.fsum(float(x) for x in np.asarray(parts, dtype=np.float64).ravel())


# --- DELLA's magnitude-ranked keep probabilities --------------------------------------------


def uniform53(key: int, start: int, n: int) -> np.ndarray:
    """The top 53 bits of the counter-based stream (as float64 integers in ``[0, 2⁵³)``),
    elements ``[start, start + n)`` of the stream ``key`` (same stream as DARE's)."""
    with np.errstate(over="ignore"):
        idx = np.arange(start, start + n, dtype=np.uint64) + np.uint64(key)
    return (splitmix64(idx) >> np.uint64(11)).astype(np.float64)


def della_rank_axis(shape: Sequence[int], n_rows: int) -> tuple[int, int, int]:
    """How a chunk of ``n_rows`` rows of a tensor of ``shape`` is viewed for DELLA's ranking:
    ``(groups, axis_len, inner)`` such that ranks run along the middle axis of
    ``reshape(groups, axis_len, inner)``. mergekit ranks along dim 1 (a 1-D tensor is unsqueezed
    to one row, so its ranks run over the whole tensor)."""
    if len(shape) < 2:
        return 1, int(shape[0]) if shape else 1, 1
    inner = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return n_rows, int(shape[1]), inner


def della_probs(keys: np.ndarray, shape: Sequence[int], n_rows: int, density: float, epsilon: float) -> np.ndarray:
    """Per-element keep probabilities (float32, flat) of DELLA's ``della_magprune`` for a chunk.

    Ranks: position in an ascending *stable* sort of the magnitude keys along mergekit's rank
    axis (ties ordered by position: the canonical tie rule, device independent). With ``n`` the
    axis length, ``rank_norm = rank0 / (n − 1)`` (0.5 when ``n = 1``; mergekit divides 0 by 0
    there) and ``p = f32(density − ε) + (rank_norm · 2) · f32(ε)``, all in float32 as mergekit.
    """
    g, n, inner = della_rank_axis(shape, n_rows)
    k = keys.reshape(g, n, inner)
    order = np.argsort(k, axis=1, kind="stable")
    ranks = np.empty(order.shape, dtype=np.int64)
    np.put_along_axis(ranks, order, np.arange(n, dtype=np.int64).reshape(1, n, 1), axis=1)
    if n > 1:
        rn = ranks.astype(np.float32) / np.float32(n - 1)
    else:
        rn = np.full(ranks.shape, 0.5, dtype=np.float32)
    p = np.float32(density - epsilon) + (rn * np.float32(2.0)) * np.float32(epsilon)
    return p.reshape(-1)


def della_keep_mask(key: int, start: int, probs: np.ndarray) -> np.ndarray:
    """Keep-mask for flat elements ``[start, start + len(probs))``: element ``j`` is kept iff
    ``(splitmix64(key + j) >> 11) < p_j · 2⁵³`` (exact in float64)."""
    return uniform53(key, start, probs.size) < probs.astype(np.float64) * float(2**53)


# --- coefficients of the interpolating methods (float64 math, float32 results) --------------


def f32(x: float) -> float:
    """Round to the nearest float32 (the engine multiplies float32 tensors by these)."""
    return float(np.float32(x))


def slerp_coefficients(
    t: float, base_sq: float, expert_sq: float, base_dot_expert: float, dot_threshold: float = 0.9995, eps: float = 1e-8
) -> tuple[float, float]:
    """``(c_base, c_expert)`` of mergekit's ``slerp`` for one tensor, from whole-tensor sums.

    mergekit 0.1.5: norms (replaced by 1 when ``<= eps``), ``dot = ⟨x/‖x‖, y/‖y‖⟩`` clamped to
    [−1, 1]; linear interpolation when ``|dot| > 0.9995``, else ``sin((1−t)θ)/sin θ`` and
    ``sin(tθ)/sin θ``. Here in float64 from the catalog's exact sums, rounded to float32.
    """
    na = math.sqrt(max(base_sq, 0.0))
    nb = math.sqrt(max(expert_sq, 0.0))
    na = na if na > eps else 1.0
    nb = nb if nb > eps else 1.0
    dot = max(-1.0, min(1.0, base_dot_expert / (na * nb)))
    if abs(dot) > dot_threshold:
        return f32(1.0 - t), f32(t)
    theta = math.acos(dot)
    s = math.sin(theta)
    return f32(math.sin((1.0 - t) * theta) / s), f32(math.sin(t * theta) / s)


def nuslerp_coefficients(
    t: float, sq0: float, sq1: float, dot01: float, eps: float = 1e-8
) -> tuple[float, float, float]:
    """``(a, b, s)`` of mergekit's ``nuslerp`` on two task vectors: the result is
    ``(a·δ₀ + b·δ₁) / s``; when the vectors are colinear (``1 − cos² <= eps²``) it is the lerp
    ``(1−t)·δ₀ + t·δ₁``, returned as ``(1−t, t, 1)``. Norms are clamped below at 1e-7 as in
    mergekit's ``_normalize``."""
    n0 = max(math.sqrt(max(sq0, 0.0)), 1e-7)
    n1 = max(math.sqrt(max(sq1, 0.0)), 1e-7)
    cos = max(-1.0, min(1.0, dot01 / (n0 * n1)))
    if (1.0 - cos * cos) <= eps * eps:
        return f32(1.0 - t), f32(t), 1.0
    theta = math.acos(cos)
    return f32(math.sin((1.0 - t) * theta)), f32(math.sin(t * theta)), f32(math.sin(theta))


def nuslerp_coefficients_rows(t: float, sq0: np.ndarray, sq1: np.ndarray, dot01: np.ndarray) -> np.ndarray:
    """:func:`nuslerp_coefficients` per filter: float32 array ``(n, 3)`` of ``(a, b, s)``.
    Uses Python's ``math`` (libm) per filter rather than numpy's SIMD kernels so the values do
    not depend on the CPU's vector extensions."""
    out = np.empty((len(sq0), 3), dtype=np.float32)
    for i, (a, b, d) in enumerate(zip(sq0.tolist(), sq1.tolist(), dot01.tolist())):
        out[i] = nuslerp_coefficients(t, a, b, d)
    return out


def model_stock_t(n_models: int, sq: Sequence, dots: dict) -> np.ndarray:
    """Model Stock's interpolation ratio per tensor (scalars) or per filter (arrays).

    ``cos θ`` is the mean over pairs ``i < j`` (summed in that order) of
    ``⟨δᵢ,δⱼ⟩ / max(‖δᵢ‖‖δⱼ‖, 1e-6)`` clamped to [−1, 1];
    ``t = N·cos θ / (1 + (N−1)·cos θ)``, and 0 where the denominator is below 1e-6 in magnitude
    (mergekit 0.1.5 keeps the base there). Only IEEE-exact operations (sqrt, ×, ÷, +) in
    float64, so the result is the same on every machine; rounded to float32.

    Args:
        n_models: N, the number of experts.
        sq: ``‖δᵢ‖²`` per expert (floats or float64 arrays of one shape).
        dots: ``{(i, j): ⟨δᵢ,δⱼ⟩}`` for ``i < j``.

    Returns:
        float32 array of the statistics' shape (0-d for scalars).
    """
    norms = [np.sqrt(np.maximum(np.asarray(s, dtype=np.float64), 0.0)) for s in sq]
    acc = None
    npairs = 0
    for i in range(n_models):
        for j in range(i + 1, n_models):
            den = np.maximum(norms[i] * norms[j], 1e-6)
            c = np.clip(np.asarray(dots[(i, j)], dtype=np.float64) / den, -1.0, 1.0)
            acc = c if acc is None else acc + c
            npairs += 1
    if acc is None:
        raise ValueError(f"model_stock_t: needs at least two experts, got {n_models}")
    c = acc / npairs
    den = 1.0 + (n_models - 1) * c
    singular = np.abs(den) < 1e-6
    t = np.where(singular, 0.0, n_models * c / np.where(singular, 1.0, den))
    return t.astype(np.float32)


def multislerp_coefficients(
    weights: Sequence[float], gram: np.ndarray, normalize_weights: bool = True, eps: float = 1e-8
) -> list[float]:
    """Coefficients ``cᵢ`` of mergekit's ``multislerp`` with a base: the result is
    ``base + Σ cᵢ·δᵢ`` (float32 ``cᵢ``).

    mergekit 0.1.5 (``merge_methods/multislerp.py``) projects the task vectors onto the unit
    sphere, ``uᵢ = δᵢ/(‖δᵢ‖ + eps)``, takes their weighted mean ``m`` (normalised), maps each
    ``uᵢ`` to the tangent space at ``m`` (``uᵢ − ⟨uᵢ,m⟩m``), averages the tangents with the
    weights (``τ``), maps back with the exponential map, ``m·cos‖τ‖ + τ·sin‖τ‖/‖τ‖`` (with
    ``‖τ‖ + eps``), and scales by ``Σ wᵢ‖δᵢ‖``. Every step is a linear combination of the δᵢ whose
    coefficients need only the Gram matrix ``Gᵢⱼ = ⟨δᵢ,δⱼ⟩``, so they are computed here in float64
    from the catalog's exact sums; one expert gives ``c = [1]`` (mergekit returns that expert);
    a zero weighted mean (antipodal inputs) falls back, for two experts, to ``w₀δ₀ + w₁δ₁``.

    Args:
        weights: one weight per expert (``weight``).
        gram: float64 ``(K, K)`` of ``⟨δᵢ,δⱼ⟩``.

    Raises:
        ValueError: the weighted mean is zero for more than two experts (mergekit raises too);
            weights summing to 0 with ``normalize_weights``.
    """
    k = len(weights)
    if k == 1:
        return [1.0]
    g = np.asarray(gram, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if normalize_weights:
        w = w / w.sum()
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    inv = 1.0 / (norms + eps)  # u_i = inv_i * δ_i
    gu = g * np.outer(inv, inv)  # ⟨u_i, u_j⟩
    a = w.copy()  # mean = Σ a_j u_j
    mean_norm = math.sqrt(max(float(a @ gu @ a), 0.0))
    if mean_norm < eps:
        if k == 2:
            return [f32(w[0]), f32(w[1])]
        raise ValueError("the weighted sum of the task vectors is zero (antipodal experts with balanced weights)")
    a = a / mean_norm
    dots = gu @ a  # ⟨u_i, mean⟩
    # tangent_result = Σ w_i (u_i − dots_i·mean): coefficients over u
    tau = w - float(w @ dots) * a
    tn = math.sqrt(max(float(tau @ gu @ tau), 0.0)) + eps
    res = a * math.cos(tn) + tau * (math.sin(tn) / tn if tn > 0 else 1.0)
    res = res * float((norms * w).sum())
    return [f32(x) for x in (res * inv)]


def karcher_coefficients(gram: np.ndarray, max_iter: int = 10, tol: float = 1e-5) -> list[float]:
    """Coefficients ``cᵢ`` of mergekit's ``karcher`` over points ``θᵢ``: the result is ``Σ cᵢ·θᵢ``.

    mergekit 0.1.5 (``merge_methods/karcher.py``): the weighted Karcher (Riemannian) mean of the
    unit vectors ``θᵢ/‖θᵢ‖`` with equal weights ``1/N`` over the points of norm above ``tol``,
    started at their normalised mean, ``max_iter`` fixed-point steps of the log/exp maps
    (``θ = acos⟨m,uᵢ⟩``, skipped below ``tol``; stop when the tangent is shorter than ``tol``),
    then scaled by ``Σ ‖θᵢ‖/N``. Each iterate is a linear combination of the ``θᵢ`` whose
    coefficients need only the Gram matrix ``⟨θᵢ,θⱼ⟩``; here in float64 (mergekit computes in
    float32), rounded to float32 at the end.

    Args:
        gram: float64 ``(N, N)`` of ``⟨θᵢ,θⱼ⟩``.

    Returns:
        N float32 coefficients; all 0 when no point has a norm above ``tol``.
    """
    g = np.asarray(gram, dtype=np.float64)
    n = len(g)
    if n == 1:
        return [1.0]
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    inv = np.where(norms == 0.0, 0.0, 1.0 / np.where(norms == 0.0, 1.0, norms))
    gu = g * np.outer(inv, inv)  # ⟨u_i, u_j⟩
    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return [0.0] * n
    alpha = np.zeros(n)
    alpha[valid] = 1.0 / len(valid)

    def norm_of(c: np.ndarray) -> float:
        return math.sqrt(max(float(c @ gu @ c), 0.0))

    m = alpha.copy()  # mean = Σ m_j u_j
    mn = norm_of(m)
    if mn < tol:
        m = np.zeros(n)
        m[valid[0]] = 1.0
    else:
        m = m / mn
    for _ in range(max_iter):
        tangent = np.zeros(n)
        gm = gu @ m  # ⟨u_i, mean⟩
        for i in valid:
            dot = max(-1.0, min(1.0, float(gm[i])))
            theta = math.acos(dot)
            if theta < tol or math.sin(theta) == 0.0:
                continue
            unit = np.zeros(n)
            unit[i] = 1.0
            tangent += alpha[i] * (theta / math.sin(theta)) * (unit - dot * m)
        tn = norm_of(tangent)
        if tn < tol:
            break
        m = math.cos(tn) * m + math.sin(tn) * (tangent / tn)
        un = norm_of(m)
        if un > tol:
            m = m / un
    scale = float(norms.sum()) / n
    return [f32(x) for x in (scale * m * inv)]


def sce_weights(delta_sq: Sequence[float], numel: int) -> list[float]:
    """SCE's per-expert weights (mergekit 0.1.5 ``sce.sce_weight``): ``mean(δᵢ²)`` over the
    tensor, divided by their sum; equal weights ``1/K`` when that sum is below 1e-6. From the
    catalog's exact ``Σδᵢ²`` (float64), rounded to float32."""
    means = [float(s) / max(1, numel) for s in delta_sq]
    total = math.fsum(means)
    if abs(total) < 1e-6:
        return [f32(1.0 / len(means))] * len(means)
    return [f32(m / total) for m in means]
