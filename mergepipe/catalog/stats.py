"""Per-tensor and per-block statistics of one expert's task vector, and how they are computed.

For every floating tensor of an expert checkpoint (task vector ``δ = expert − base`` computed in
float32), the catalog keeps:

* per block (rows ``[row0, row1)``, see :func:`mergepipe.formats.safetensors.iter_blocks`):
  ``‖δ‖₂²`` (``sq_norm``), ``‖δ‖₁`` (``l1``), ``max|δ|`` (``max_abs``), element count
  (``numel``) and an octave histogram — count and energy of entries per bf16 exponent — used to
  estimate how much energy of the block survives a magnitude trim at any density;
* per tensor: the exact histogram of magnitude keys (:func:`mergepipe.numerics.magnitude_keys`),
  enough to fix the magnitude-trim threshold (TIES) and the outlier window (breadcrumbs) exactly
  for any density; and four whole-tensor sums of products — ``Σδ²``, ``Σθ_base²``,
  ``Σθ_expert²`` and ``Σθ_base·θ_expert`` — each the exactly rounded sum (``math.fsum``) of
  per-row float64 sums (:func:`mergepipe.numerics.segment_dots`), so they do not depend on how
  the tensor was chunked. slerp's and nuslerp's norms and model_stock's ``‖δ‖`` come from these;
  the cross terms ``⟨δᵢ,δⱼ⟩`` between experts are pair statistics (see the catalog).

Everything is numpy: the planner and the operator use these without torch.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from mergepipe.catalog.digest import BLOCK_DIGEST_BYTES
from mergepipe.catalog.sketch import SECTIONS, TIERS
from mergepipe.numerics import (
    N_KEYS,
    N_OCT,
    OCT_SHIFT,
    KeyTable,
    exact_total,
    key_table,
    key_value,
    magnitude_keys,
    trim_rank,
)

#: the array fields of :class:`TensorStats` (both stored forms name them so)
ARRAY_FIELDS = (
    "sums",
    "block_numel",
    "sq_norm",
    "l1",
    "max_abs",
    "oct_count",
    "oct_energy",
    "hist_keys",
    "hist_counts",
    "sketch_sq",
    "block_sha",
    "sketch_sha",
)


@dataclass
class TensorStats:
    """Statistics of one expert tensor's task vector.

    Attributes:
        name: tensor name.
        numel: elements in the tensor.
        rows_per_block: rows per block (the last block may be shorter).
        block_numel: int64[nb] elements per block.
        sq_norm: float64[nb] ``Σ δ²`` per block.
        l1: float64[nb] ``Σ |δ|`` per block.
        max_abs: float32[nb] ``max |δ|`` per block.
        oct_lo: first octave (bf16 exponent) of the octave histograms.
        oct_count: int64[nb, n_oct] entries per octave per block.
        oct_energy: float64[nb, n_oct] ``Σ δ²`` per octave per block.
        hist_keys: int32[m] distinct magnitude keys in the tensor, ascending.
        hist_counts: int64[m] entries per key.
        content_sha256: SHA-256 of the expert tensor's raw bytes.
        sums: float64[4] exact whole-tensor sums ``[Σδ², Σθ_b², Σθ_e², Σθ_b·θ_e]`` (see the
            module docstring).
        sketch_start: first byte of this tensor's sign planes in the expert's sketch blob
            (:mod:`mergepipe.catalog.sketch`); -1: no sketch (1-D tensors, older analyses).
        sketch_sq: float64[nb, TIERS] residual energy ``Σ (δ − δ̂_k)²`` of each block after
            each sketch level ``k`` (the sign planes, then the rank-1 tier; None: no sketch).
        block_sha: uint8[nb, 16]: the first 16 bytes of the SHA-256 of each block's raw expert
            bytes (:data:`BLOCK_DIGEST_BYTES`), so the engine can check the blocks it reads
            (a partial read of a tensor cannot be checked against ``content_sha256``); None: not
            recorded (a LoRA adapter, analyses before stats version 4).
        sketch_sha: uint8[nb, SECTIONS, 16]: the same for each block's bytes of each section
            of the sketch blob (sign planes, rank-1 factors, residual plane; None: no sketch).
    """

    name: str
    numel: int
    rows_per_block: int
    block_numel: np.ndarray
    sq_norm: np.ndarray
    l1: np.ndarray
    max_abs: np.ndarray
    oct_lo: int
    oct_count: np.ndarray
    oct_energy: np.ndarray
    hist_keys: np.ndarray
    hist_counts: np.ndarray
    content_sha256: str = ""
    sums: np.ndarray | None = None
    sketch_start: int = -1
    sketch_sq: np.ndarray | None = None
    block_sha: np.ndarray | None = None
    sketch_sha: np.ndarray | None = None

    @property
    def has_sketch(self) -> bool:
        return self.sketch_start >= 0 and self.sketch_sq is not None

    def _sum(self, i: int) -> float:
        if self.sums is None:
            raise ValueError("tensor statistics without exact sums; re-run `mergepipe analyze`")
        return float(self.sums[i])

    @property
    def delta_sq(self) -> float:
        """Exact ``Σδ²`` (canonical, chunking-independent)."""
        return self._sum(0)

    @property
    def base_sq(self) -> float:
        return self._sum(1)

    @property
    def expert_sq(self) -> float:
        return self._sum(2)

    @property
    def base_dot_expert(self) -> float:
        return self._sum(3)

    @property
    def n_blocks(self) -> int:
        return len(self.sq_norm)

    @property
    def energy(self) -> float:
        return float(self.sq_norm.sum())

    @functools.cached_property
    def key_table(self) -> KeyTable:
        """The key histogram sorted for top-k rules (:func:`mergepipe.numerics.key_table`), built
        on first use and kept: a plan asks several rules of one tensor's histogram."""
        return key_table(self.hist_keys, self.hist_counts)

    @functools.cached_property
    def block_max_key(self) -> np.ndarray:
        """int32[nb]: the magnitude key of each block's ``max|δ|`` (built on first use and kept)."""
        return magnitude_keys(self.max_abs)

    def trim_rank(self, density: float) -> tuple[int, int, int]:
        """:func:`mergepipe.numerics.trim_rank` of this tensor's histogram at ``density``
        (``(tau, rank, ties)``), kept per density: a plan asks it of each tensor several times."""
        r = self._trims.get(density)
        if r is None:
            r = self._trims[density] = trim_rank(self.hist_keys, self.hist_counts, self.numel, density, self.key_table)
        return r

    @functools.cached_property
    def _trims(self) -> dict[float, tuple[int, int, int]]:
        return {}

    def min_key(self, density: float) -> int:
        """Canonical magnitude-trim threshold key for ``density`` (see numerics.trim_min_key),
        from :meth:`trim_rank`: the threshold group's key ``tau`` when keeping all of its ``ties``
        lands at least as near ``k`` as keeping none (``ties − rank <= rank``), else ``tau + 1``;
        1 when the k-th largest is 0 (zeros are never kept); 0 (keep all) when nothing is trimmed."""
        tau, rank, ties = self.trim_rank(density)
        if ties == 0:
            return 0
        if tau == 0:
            return 1
        return tau if ties - rank <= rank else tau + 1

    def kept_fraction_by_octave(self, min_key: int) -> np.ndarray:
        """float64[n_oct]: estimated fraction of each octave's energy that a trim keeping keys
        ``>= min_key`` retains. Exact for octaves wholly above/below the threshold; inside the
        threshold's octave, the fraction of the tensor's energy there above it (from the exact
        key histogram), applied to every block."""
        n_oct = self.oct_count.shape[1]
        frac = np.zeros(n_oct)
        if min_key >= 0x8000:
            return frac
        if min_key <= 0:
            frac[:] = 1.0
            return frac
        t_oct = min_key >> OCT_SHIFT
        i = int(t_oct - self.oct_lo)  # the threshold octave's column: the columns after it are kept whole
        frac[max(0, i + 1) :] = 1.0
        if 0 <= i < n_oct:
            if self._keys_ascending:  # the octave's keys are one slice, in the same order as the mask's
                a, b = np.searchsorted(self.hist_keys, (t_oct << OCT_SHIFT, (t_oct + 1) << OCT_SHIFT)).tolist()
                k, cnt = self.hist_keys[a:b], self.hist_counts[a:b]
            else:
                in_oct = (self.hist_keys >> OCT_SHIFT) == t_oct
                k, cnt = self.hist_keys[in_oct], self.hist_counts[in_oct]
            e = cnt * key_value(k).astype(np.float64) ** 2
            tot = e.sum()
            frac[i] = e[k >= min_key].sum() / tot if tot > 0 else 0.0
        return frac

    @functools.cached_property
    def _keys_ascending(self) -> bool:
        """``hist_keys`` strictly ascending (as recorded; checked once, on first use)."""
        k = self.hist_keys
        return len(k) < 2 or bool((k[1:] > k[:-1]).all())

    def kept_energy(self, min_key: int) -> np.ndarray:
        """float64[nb]: estimated ``Σ δ²`` per block kept by a trim at ``min_key``; blocks whose
        ``max|δ|`` key is below the threshold keep exactly 0."""
        if min_key <= 0:
            return self.sq_norm.copy()
        est = self.oct_energy @ self.kept_fraction_by_octave(min_key)
        est[self.block_max_key < min_key] = 0.0
        return est

    def kept_energy_window(self, min_key: int, max_key: int) -> np.ndarray:
        """float64[nb]: estimated ``Σ δ²`` per block with ``min_key <= key < max_key``
        (breadcrumbs); exact 0 for blocks whose ``max|δ|`` key is below ``min_key``."""
        if min_key >= max_key:
            return np.zeros(self.n_blocks)
        frac = self.kept_fraction_by_octave(min_key)
        if max_key < N_KEYS:
            frac = np.clip(frac - self.kept_fraction_by_octave(max_key), 0.0, 1.0)
        est = self.oct_energy @ frac
        est[self.block_max_key < min_key] = 0.0
        return est

    def della_kept_energy(self, density: float, epsilon: float) -> np.ndarray:
        """float64[nb]: expected ``Σ p·δ²`` per block under DELLA's rank-based keep probability.

        Estimate: an entry's rank within its row is approximated by its magnitude's rank in the
        whole tensor (the key histogram), at octave resolution: octave ``o`` gets
        ``p = density − ε + 2ε·c_o`` with ``c_o`` the fraction of entries below the octave plus
        half of those in it."""
        n_oct = self.oct_count.shape[1]
        cnt = np.zeros(n_oct)
        ko = (self.hist_keys >> OCT_SHIFT).astype(np.int64) - self.oct_lo
        ok = (ko >= 0) & (ko < n_oct)
        np.add.at(cnt, ko[ok], self.hist_counts[ok])
        below = np.cumsum(cnt) - cnt
        tot = max(1.0, float(self.hist_counts.sum()))
        c = (below + cnt / 2.0) / tot
        p = np.clip(density - epsilon + 2.0 * epsilon * c, 0.0, 1.0)
        return self.oct_energy @ p

    # --- serialization (SQLite blobs and object-storage index objects) -------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(
            buf,
            meta=np.array([self.numel, self.rows_per_block, self.oct_lo], dtype=np.int64),
            sums=self.sums if self.sums is not None else np.full(4, np.nan),
            block_numel=self.block_numel,
            sq_norm=self.sq_norm,
            l1=self.l1,
            max_abs=self.max_abs,
            oct_count=self.oct_count,
            oct_energy=self.oct_energy,
            hist_keys=self.hist_keys,
            hist_counts=self.hist_counts,
            sketch_start=np.array([self.sketch_start if self.has_sketch else -1], dtype=np.int64),
            sketch_sq=self.sketch_sq if self.sketch_sq is not None else np.zeros((0, 0)),
            block_sha=self.block_sha if self.block_sha is not None else np.zeros((0, BLOCK_DIGEST_BYTES), np.uint8),
            sketch_sha=(
                self.sketch_sha if self.sketch_sha is not None else np.zeros((0, 0, BLOCK_DIGEST_BYTES), np.uint8)
            ),
        )
        return buf.getvalue()

    @classmethod
    def from_fields(
        cls,
        name: str,
        content_sha256: str,
        head: tuple[int, int, int, int],
        arrays: Mapping[str, np.ndarray | None],
        *,
        values_checked: bool = False,
    ) -> TensorStats:
        """The one constructor of both readers (:meth:`from_bytes`, :func:`unpack_stats`): a
        tensor's statistics from stored fields (untrusted), normalised and checked.

        Args:
            name: tensor name; ``content_sha256``: SHA-256 of its expert bytes ("" unknown).
            head: ``(numel, rows_per_block, oct_lo, sketch_start)``; a ``sketch_start`` < 0,
                or no ``sketch_sq``, means no sketch (both become -1 / None).
            arrays: the array fields by name (:data:`ARRAY_FIELDS`), shaped as the class
                documents; ``sums``, ``sketch_sq``, ``block_sha`` and ``sketch_sha`` may be
                missing or None (``block_sha``/``sketch_sha`` also empty: not recorded).
            values_checked: the caller already ran :func:`_check_values` on these arrays (or
                on sections holding them, every tensor at once).

        Raises:
            ValueError: arrays of inconsistent shapes, or values out of range
                (:func:`_check_values`); the catalog turns it into a one-line error.
        """
        numel, rpb, oct_lo, sketch_start = head
        sums, sketch_sq = arrays.get("sums"), arrays.get("sketch_sq")
        bsha, ssha = arrays.get("block_sha"), arrays.get("sketch_sha")
        if sketch_start < 0 or sketch_sq is None:
            sketch_start, sketch_sq = -1, None
        st = cls(
            name=name,
            numel=numel,
            rows_per_block=rpb,
            block_numel=_required(arrays, "block_numel"),
            sq_norm=_required(arrays, "sq_norm"),
            l1=_required(arrays, "l1"),
            max_abs=_required(arrays, "max_abs"),
            oct_lo=oct_lo,
            oct_count=_required(arrays, "oct_count"),
            oct_energy=_required(arrays, "oct_energy"),
            hist_keys=_required(arrays, "hist_keys"),
            hist_counts=_required(arrays, "hist_counts"),
            content_sha256=content_sha256,
            sums=sums if sums is not None else np.full(4, np.nan),
            sketch_start=sketch_start,
            sketch_sq=sketch_sq,
            block_sha=None if bsha is None or not len(bsha) else np.asarray(bsha, dtype=np.uint8),
            sketch_sha=None if ssha is None or not len(ssha) else np.asarray(ssha, dtype=np.uint8),
        )
        if not st._shapes_consistent():
            raise ValueError("statistics arrays of inconsistent shapes")
        if not values_checked:
            for f in ARRAY_FIELDS:
                a = getattr(st, f)
                if a is not None:
                    _check_values(f, a)
        return st

    def _shapes_consistent(self) -> bool:
        """Whether the array fields have the shapes the class documents, for ``nb`` blocks."""
        nb = len(self.sq_norm)
        return (
            self.numel >= 0
            and self.rows_per_block > 0
            and nb >= 1
            and self.sq_norm.ndim == 1
            and self.sums is not None
            and self.sums.shape == (4,)
            and self.block_numel.shape == (nb,)
            and self.l1.shape == (nb,)
            and self.max_abs.shape == (nb,)
            and self.oct_count.ndim == 2
            and self.oct_count.shape[0] == nb
            and 0 < self.oct_count.shape[1] <= N_OCT
            and self.oct_energy.shape == self.oct_count.shape
            and self.hist_keys.ndim == 1
            and self.hist_keys.shape == self.hist_counts.shape
            and len(self.hist_keys) <= N_KEYS
            and (self.block_sha is None or self.block_sha.shape == (nb, BLOCK_DIGEST_BYTES))
            and (self.sketch_sq is None or self.sketch_sq.shape in ((0, TIERS), (nb, TIERS)))
            and (self.sketch_sha is None or self.sketch_sha.shape == (nb, SECTIONS, BLOCK_DIGEST_BYTES))
        )

    @classmethod
    def from_bytes(cls, name: str, data: bytes, content_sha256: str = "") -> TensorStats:
        """Parse :meth:`to_bytes` output (untrusted) through :meth:`from_fields`.

        Raises:
            ValueError: not a statistics blob of a tensor (truncated, other bytes, arrays of
                the wrong kind, shape or values).
        """
        try:
            z = load_npz(data)
            numel, rpb, oct_lo = (int(x) for x in z["meta"])
            sketch_start = int(z["sketch_start"][0]) if "sketch_start" in z else -1
        except ValueError:
            raise
        except Exception as e:  # KeyError, TypeError (meta of the wrong length), IndexError ...
            raise ValueError(f"not a statistics blob ({type(e).__name__}: {str(e)[:80]})") from None
        return cls.from_fields(name, content_sha256, (numel, rpb, oct_lo, sketch_start), z)


#: dtypes of the catalog's arrays (``descr`` of their ``.npy`` headers)
_NPY_DTYPES = frozenset({"<f8", "<f4", "<i8", "<i4", "<u2", "|u1", "|b1"})
_NPY_HEADER = re.compile(
    r"\{'descr': '([<|][a-z][0-9])', 'fortran_order': False, 'shape': \(((?:[0-9]+, ?)*(?:[0-9]+)?)\), \} *\n"
)


_CDIR = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header (30 bytes)


def _stored_members(data: bytes) -> dict[str, bytes] | None:
    """Members of a zip archive of stored (uncompressed), single-disk, non-zip64-sized entries --
    what ``numpy.savez`` writes for small arrays -- each checked against its CRC-32; None when
    the archive is laid out otherwise (the caller falls back to :mod:`zipfile`)."""
    import zlib

    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 65557))
    if end < 0 or end + 22 > len(data):
        return None
    n, cd_size, cd_off = struct.unpack_from("<HII", data, end + 10)
    if cd_off + cd_size > end:
        return None
    out, pos = {}, cd_off
    for _ in range(n):
        if pos + 46 > end:
            return None
        sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, _, _, _, lho = _CDIR.unpack_from(data, pos)
        if sig != b"PK\x01\x02" or method != 0 or flags & 1 or csize != usize or usize == 0xFFFFFFFF:
            return None
        name = data[pos + 46 : pos + 46 + nlen].decode("utf-8", "replace")
        pos += 46 + nlen + xlen + clen
        if lho + 30 > len(data):
            return None
        lsig, _, _, _, _, _, _, _, _, lnlen, lxlen = _LOCAL.unpack_from(data, lho)
        start = lho + 30 + lnlen + lxlen
        body = data[start : start + usize]
        if lsig != b"PK\x03\x04" or len(body) != usize or zlib.crc32(body) != crc:
            return None
        out[name] = body
    return out


def load_npz(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an uncompressed ``numpy.savez`` archive, parsed without ``numpy.load``.

    ``numpy.load`` parses each member's ``.npy`` header with ``ast.literal_eval``: ~0.2 ms per
    array, ~1.5 s to plan from a cached catalog of 8 experts of 110 tensors (issue 23). This
    reader accepts only what :meth:`TensorStats.to_bytes` writes -- format 1.0 headers in
    numpy's exact layout, a known little-endian dtype, C order, data of exactly the shape's
    size -- and reads members through :mod:`zipfile` (CRC-32 checked).

    Returns:
        name (without ``.npy``) → array (a fresh, writable copy).

    Raises:
        ValueError: not a zip archive, or a member that is not such an ``.npy`` array.
    """
    members = _stored_members(data)
    if members is None:  # not the plain layout numpy writes: let zipfile read it (or say why not)
        import zipfile

        try:
            zf = zipfile.ZipFile(io.BytesIO(data))
            members = {i.filename: zf.read(i) for i in zf.infolist()}
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, NotImplementedError) as e:
            raise ValueError(f"catalog statistics: not a .npz archive ({e})") from None
    out = {}
    for fn, raw in members.items():
        if not fn.endswith(".npy") or raw[:8] != b"\x93NUMPY\x01\x00" or len(raw) < 10:
            raise ValueError(f"catalog statistics: member {fn!r} is not a format-1.0 .npy array")
        hlen = int.from_bytes(raw[8:10], "little")
        m = _NPY_HEADER.fullmatch(raw[10 : 10 + hlen].decode("latin1"))
        if m is None or m.group(1) not in _NPY_DTYPES:
            raise ValueError(f"catalog statistics: member {fn!r} has an unexpected .npy header")
        shape = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
        dt = np.dtype(m.group(1))
        body = memoryview(raw)[10 + hlen :]
        n = 1
        for x in shape:
            n *= x
        if body.nbytes != n * dt.itemsize:
            raise ValueError(f"catalog statistics: member {fn!r} holds {body.nbytes} bytes, {n * dt.itemsize} expected")
        out[fn[:-4]] = np.frombuffer(body, dtype=dt).reshape(shape).copy()
    return out


class TensorStatsBuilder:
    """Accumulates :class:`TensorStats` over row chunks of one tensor, in row order.

    Args:
        name: tensor name.
        rows: rows of the tensor; ``row_numel`` elements per row.
        rows_per_block: block height in rows.
    """

    def __init__(self, name: str, rows: int, row_numel: int, rows_per_block: int) -> None:
        self.name, self.rows, self.row_numel, self.rpb = name, rows, row_numel, rows_per_block
        nb = max(1, -(-rows // rows_per_block)) if rows else 1
        self.nb = nb
        self.sq = np.zeros(nb)
        self.l1 = np.zeros(nb)
        self.mx = np.zeros(nb, dtype=np.float32)
        self.bn = np.zeros(nb, dtype=np.int64)
        self.oc = np.zeros((nb, N_OCT), dtype=np.int64)
        self.oe = np.zeros((nb, N_OCT))
        self.hist = np.zeros(0x8000, dtype=np.int64)
        self.row_sums: list[list[np.ndarray]] = [[], [], [], []]

    def add(
        self,
        row0: int,
        delta: np.ndarray,
        expert: np.ndarray | None = None,
        base: np.ndarray | None = None,
        base_sq_rows: np.ndarray | None = None,
    ) -> None:
        """Add the float32 task vector of rows ``[row0, row0 + len(delta)/row_numel)``; ``row0``
        must be a block boundary. With ``expert`` and ``base`` (the decoded values of the same
        rows, the base preferably already float64; ``base_sq_rows`` its per-row ``Σθ_b²``) the
        exact whole-tensor sums are accumulated too, equal to
        :func:`mergepipe.numerics.segment_dots` per row."""
        if row0 % self.rpb:
            raise ValueError("chunks must start on block boundaries")
        n = delta.size
        if n == 0:
            return
        b0 = row0 // self.rpb
        per_block = self.rpb * self.row_numel
        bid = np.arange(n, dtype=np.int64) // per_block
        nbl = int(bid[-1]) + 1
        a = np.abs(delta.astype(np.float32, copy=False))
        e = a.astype(np.float64) ** 2
        keys = magnitude_keys(a)
        octs = keys >> OCT_SHIFT
        flat = bid * N_OCT + octs
        sl = slice(b0, b0 + nbl)
        self.oc[sl] += np.bincount(flat, minlength=nbl * N_OCT).reshape(nbl, N_OCT)
        self.oe[sl] += np.bincount(flat, weights=e, minlength=nbl * N_OCT).reshape(nbl, N_OCT)
        self.sq[sl] += np.bincount(bid, weights=e, minlength=nbl)
        self.l1[sl] += np.bincount(bid, weights=a, minlength=nbl)
        self.bn[sl] += np.bincount(bid, minlength=nbl)
        starts = np.arange(0, n, per_block)
        self.mx[sl] = np.maximum(self.mx[sl], np.maximum.reduceat(a, starts))
        self.hist += np.bincount(keys, minlength=0x8000)
        if expert is not None and base is not None:
            w = self.row_numel
            x64 = expert.astype(np.float64, copy=False).reshape(-1, w)
            b64 = base.astype(np.float64, copy=False).reshape(-1, w)  # float64 already: no copy
            self.row_sums[0].append(e.reshape(-1, w).sum(axis=1))  # = segment_dots(δ, δ): |δ|² = δ²
            self.row_sums[1].append(base_sq_rows if base_sq_rows is not None else (b64 * b64).sum(axis=1))
            self.row_sums[2].append((x64 * x64).sum(axis=1))
            self.row_sums[3].append((b64 * x64).sum(axis=1))

    def finish(self, content_sha256: str = "") -> TensorStats:
        used = np.nonzero(self.oc.sum(axis=0))[0]
        lo, hi = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 1)
        nz = np.nonzero(self.hist)[0]
        return TensorStats(
            name=self.name,
            numel=int(self.bn.sum()),
            rows_per_block=self.rpb,
            block_numel=self.bn,
            sq_norm=self.sq,
            l1=self.l1,
            max_abs=self.mx,
            oct_lo=lo,
            oct_count=self.oc[:, lo:hi].copy(),
            oct_energy=self.oe[:, lo:hi].copy(),
            hist_keys=nz.astype(np.int32),
            hist_counts=self.hist[nz],
            content_sha256=content_sha256,
            sums=np.array([exact_total(np.concatenate(r)) if r else np.nan for r in self.row_sums]),
        )


# --- one packed blob per expert (stats version 6) -------------------------------------------
#: format tag of :func:`pack_stats` blobs (8 bytes; the last byte is the layout's version)
PACK_MAGIC = b"MPSTATS\x01"
_PACK_HEAD = struct.Struct("<8s32sQ")  # magic, SHA-256 of everything after this head, header bytes
#: the body's sections, in order: (field, dtype, per-tensor element count as a function of the
#: header row (nb, n_oct, n_keys, has_sketch_sq, has_block_sha, has_sketch_sha)); 8-byte items
#: first so every section starts aligned to its item size
_SECTIONS: tuple[tuple[str, str, Callable[[tuple[int, ...]], int]], ...] = (
    ("sums", "<f8", lambda r: 4),
    ("block_numel", "<i8", lambda r: r[0]),
    ("sq_norm", "<f8", lambda r: r[0]),
    ("l1", "<f8", lambda r: r[0]),
    ("oct_count", "<i8", lambda r: r[0] * r[1]),
    ("oct_energy", "<f8", lambda r: r[0] * r[1]),
    ("hist_counts", "<i8", lambda r: r[2]),
    ("sketch_sq", "<f8", lambda r: r[0] * TIERS * (r[3] == 1)),
    ("max_abs", "<f4", lambda r: r[0]),
    ("hist_keys", "<i4", lambda r: r[2]),
    ("block_sha", "|u1", lambda r: r[0] * BLOCK_DIGEST_BYTES * r[4]),
    ("sketch_sha", "|u1", lambda r: r[0] * SECTIONS * BLOCK_DIGEST_BYTES * r[5]),
)


def pack_stats(stats: dict[str, TensorStats]) -> bytes:
    """One expert's statistics, every tensor, as one blob (what the catalog stores per analysis).

    Layout: :data:`PACK_MAGIC`; the SHA-256 of everything that follows the 48-byte head; the
    byte length of a JSON header (one row per tensor: name, content SHA-256, numel, rows per
    block, first octave, sketch start, blocks, octaves, distinct keys, and 0/1 for the presence
    of sketch residual energies — 2: a sketch extent with no planes, a LoRA expert's —, block
    digests and sketch digests); zero padding to 8 bytes;
    then per field (:data:`_SECTIONS`) the little-endian arrays of every tensor concatenated in
    header order. Reading it back (:func:`unpack_stats`) is one hash, one ``json.loads`` and
    array views of one buffer: planning from a cached catalog parses 8 of these instead of 880
    ``.npz`` archives (issue 23).

    Args:
        stats: ``{tensor name: TensorStats}`` of one expert (names in checkpoint order).

    Returns:
        bytes of the blob.
    """
    rows: list[tuple] = []
    parts: dict[str, list[bytes]] = {f: [] for f, _, _ in _SECTIONS}
    for n, s in stats.items():
        sk = s.sketch_sq is not None and s.sketch_start >= 0
        # 1: a residual-energy table per block; 2: a sketch extent with no planes coded (a LoRA
        # expert's, sketch_sq of shape (0, TIERS)); 0: no sketch
        sq_flag = 0 if not sk else (1 if s.sketch_sq.shape[0] > 0 else 2)  # type: ignore[union-attr]
        rows.append(
            (n, s.content_sha256, int(s.numel), int(s.rows_per_block), int(s.oct_lo), int(s.sketch_start) if sk else -1)
            + (s.n_blocks, int(s.oct_count.shape[1]), len(s.hist_keys))
            + (sq_flag, int(s.block_sha is not None), int(s.sketch_sha is not None))
        )
        arrays = {
            "sums": s.sums if s.sums is not None else np.full(4, np.nan),
            "block_numel": s.block_numel,
            "sq_norm": s.sq_norm,
            "l1": s.l1,
            "oct_count": s.oct_count,
            "oct_energy": s.oct_energy,
            "hist_counts": s.hist_counts,
            "sketch_sq": s.sketch_sq if sq_flag == 1 else None,
            "max_abs": s.max_abs,
            "hist_keys": s.hist_keys,
            "block_sha": s.block_sha,
            "sketch_sha": s.sketch_sha,
        }
        for f, dt, _ in _SECTIONS:
            if arrays[f] is not None:
                parts[f].append(np.ascontiguousarray(arrays[f], dtype=dt).tobytes())
    import json

    header = json.dumps({"tensors": rows}, separators=(",", ":")).encode()
    header += b" " * (-(len(header) + _PACK_HEAD.size) % 8)
    rest = header + b"".join(b"".join(parts[f]) for f, _, _ in _SECTIONS)
    return _PACK_HEAD.pack(PACK_MAGIC, hashlib.sha256(rest).digest(), len(header)) + rest


def unpack_stats(data: bytes) -> dict[str, TensorStats]:
    """Parse a :func:`pack_stats` blob (read back from a catalog: untrusted).

    Checked before any array is built: the format tag, the SHA-256 of everything after the
    head (a flipped bit anywhere is refused), the header's JSON and field types, and that the
    body holds exactly the bytes the header's counts imply; each section's values
    (:func:`_check_values`: key range, non-negative counts, finite non-negative residual
    energies, every tensor at once); then every tensor through :meth:`TensorStats.from_fields`,
    the constructor :meth:`TensorStats.from_bytes` uses too (shapes).

    Returns:
        ``{tensor name: TensorStats}`` in stored order; the arrays are writable views of one
        copy of the body.

    Raises:
        ValueError: what is wrong (the catalog turns it into a one-line error naming the expert
            and the fix).
    """
    rows, body = _unpack_head(data)
    counts = [tuple(r[6:12]) for r in rows]
    sizes = {f: [size(c) for c in counts] for f, _, size in _SECTIONS}
    need = sum(sum(sizes[f]) * np.dtype(dt).itemsize for f, dt, _ in _SECTIONS)
    if need != len(body):
        raise ValueError(f"body of {len(body)} bytes, its header's counts say {need}")
    views: dict[str, list[np.ndarray]] = {}
    pos = 0
    for f, dt, _ in _SECTIONS:
        n = sum(sizes[f])
        flat = np.frombuffer(body, dtype=dt, count=n, offset=pos)
        pos += flat.nbytes
        _check_values(f, flat)  # every tensor's values at once
        ends = np.cumsum(sizes[f]).tolist()
        views[f] = [flat[e - k : e] for k, e in zip(sizes[f], ends, strict=True)]
    out = {}
    for i, r in enumerate(rows):
        name, sha, numel, rpb, oct_lo, sk_start, nb, n_oct, _, has_sq, has_bsha, has_ssha = r
        v: dict[str, np.ndarray | None] = {f: views[f][i] for f, _, _ in _SECTIONS}
        v["oct_count"] = v["oct_count"].reshape(nb, n_oct)  # type: ignore[union-attr]
        v["oct_energy"] = v["oct_energy"].reshape(nb, n_oct)  # type: ignore[union-attr]
        # has_sq 1: a residual-energy row per block; 2: a sketch extent with no planes (LoRA)
        sq = v["sketch_sq"]
        v["sketch_sq"] = sq.reshape(nb, TIERS) if has_sq == 1 else (np.zeros((0, TIERS)) if has_sq else None)  # type: ignore[union-attr]
        v["block_sha"] = v["block_sha"].reshape(nb, BLOCK_DIGEST_BYTES) if has_bsha else None  # type: ignore[union-attr]
        v["sketch_sha"] = v["sketch_sha"].reshape(nb, SECTIONS, BLOCK_DIGEST_BYTES) if has_ssha else None  # type: ignore[union-attr]
        out[name] = TensorStats.from_fields(name, sha, (numel, rpb, oct_lo, sk_start), v, values_checked=True)
    if len(out) != len(rows):
        raise ValueError("a tensor name is listed twice")
    return out


def _unpack_head(data: bytes) -> tuple[list, bytearray]:
    """The header rows and a writable copy of the body of a :func:`pack_stats` blob, after
    checking the format tag, the digest and the header's JSON and row types.

    Raises:
        ValueError: what is wrong.
    """
    import json

    if len(data) < _PACK_HEAD.size:
        raise ValueError(f"statistics blob of {len(data)} bytes, shorter than its {_PACK_HEAD.size}-byte head")
    magic, digest, hlen = _PACK_HEAD.unpack_from(data)
    if magic != PACK_MAGIC:
        raise ValueError(f"not a packed statistics blob (format tag {bytes(magic)[:8]!r})")
    if hashlib.sha256(memoryview(data)[_PACK_HEAD.size :]).digest() != digest:
        raise ValueError("content digest mismatch (the blob was modified or truncated)")
    if hlen > len(data) - _PACK_HEAD.size or (hlen + _PACK_HEAD.size) % 8:
        raise ValueError(f"header length {hlen} out of range")
    from mergepipe.limits import json_depth

    raw = bytes(memoryview(data)[_PACK_HEAD.size : _PACK_HEAD.size + hlen])
    if json_depth(raw) > 3:
        raise ValueError("header nested too deep")
    try:
        rows = json.loads(raw)["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"header is not the expected JSON ({type(e).__name__})") from None
    if not isinstance(rows, list) or not all(_row_ok(r) for r in rows):
        raise ValueError("header rows of the wrong form")
    return rows, bytearray(memoryview(data)[_PACK_HEAD.size + hlen :])  # one writable copy


def _row_ok(r: object) -> bool:
    """A header row of :func:`pack_stats`: two strings, ten integers (counts in range)."""
    if not (isinstance(r, list) and len(r) == 12 and isinstance(r[0], str) and isinstance(r[1], str)):
        return False
    ints = r[2:]
    if not all(type(x) is int for x in ints):
        return False
    numel, rpb, _, sk_start, nb, n_oct, n_keys, *flags = ints
    return (
        (numel >= 0 and rpb > 0 and sk_start >= -1 and nb >= 1 and 0 < n_oct <= N_OCT and 0 <= n_keys <= N_KEYS)
        and flags[0] in (0, 1, 2)
        and all(f in (0, 1) for f in flags[1:])
    )


def _required(arrays: Mapping[str, np.ndarray | None], field: str) -> np.ndarray:
    """``arrays[field]``, which a statistics record must hold.

    Raises:
        ValueError: the field is missing.
    """
    a = arrays.get(field)
    if a is None:
        raise ValueError(f"statistics without the {field!r} array")
    return a


def _check_values(field: str, a: np.ndarray) -> None:
    """Value checks of one array field of tensor statistics, shared by both readers (one
    tensor's array, or a packed blob's section of every tensor at once): magnitude keys in
    range, counts non-negative, residual energies finite and >= 0.

    Raises:
        ValueError: naming the field.
    """
    if not a.size:
        return
    if field == "hist_keys" and (int(a.min()) < 0 or int(a.max()) >= N_KEYS):
        raise ValueError("magnitude keys out of range")
    if field in ("hist_counts", "block_numel", "oct_count") and int(a.min()) < 0:
        raise ValueError(f"negative counts in {field!r}")
    if field == "sketch_sq" and not (np.isfinite(a).all() and a.min() >= 0):
        raise ValueError("sketch residual energies not finite and >= 0")
