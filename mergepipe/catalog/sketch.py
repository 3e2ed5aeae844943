"""Block sketches: a compact code of each block's task vector, recorded once at analyze time.

A budgeted merge that skips a block merges it as ``δ = 0``. When the gain of a merge is spread
over all parameters (fine-tunes near a good optimum), block selection alone cannot keep most of
it at a small budget. A *sketch* is a cheap approximation of a block's task vector that the
planner may buy instead of the exact block, charged against the same expert-I/O budget.

The code is **progressive residual sign planes**. Plane 1 is BitDelta's one-bit code (Liu et al.,
"BitDelta: Your Fine-Tune May Only Be Worth One Bit", NeurIPS 2024) with one scale per row
instead of per matrix; each further plane codes the sign of what the planes before left::

    r₀ = δ,   plane p:  σ_p = +1 where r_{p−1} > 0 else −1,  s_p[row] = mean |r_{p−1}[row]|,
              r_p = r_{p−1} − s_p·σ_p,          δ̂_k = Σ_{p≤k} s_p·σ_p   (sketch level k)

``s_p`` is the least-squares scale of its sign pattern (closed form, no data or distillation),
so every plane lowers the residual energy; for a Gaussian row plane 1 keeps 2/π ≈ 64% of the
energy, and each plane removes about that share of what is left. Level ``k`` is the first
``k`` planes: a plan upgrading a block from level 1 to 2 reads only plane 2's bytes.

On disk, a plane of a block is ``ceil(n/8)`` bytes of sign bits (row-major over the block's
``n`` entries, ``numpy.packbits`` big-endian bit order, 1 = positive) followed by one bfloat16
scale per row (little-endian, round to nearest even): ``sketch_block_bytes(rows, row_numel)``
bytes, 1/16 of a bf16 block (1/32 of a float32 one) plus 2 bytes per row. A tensor's sketch is
plane-major (plane 1 of all its blocks, then plane 2, …), so level ``k`` of a run of blocks is
``k`` contiguous byte ranges; the tensors with two or more dimensions follow each other in the
base's tensor order in one blob per (base, expert, block size), each tensor's first byte recorded
in its statistics (``TensorStats.sketch_start``; 1-D tensors have no sketch: a per-row scale
would cost more than the values).

**Rank-1 tier** (level ``R1_LEVEL`` = 4, ``--sketch sign3+r1``): two more sections per tensor
after the three planes code each block as its rank-1 factors plus one sign plane of what they
leave (low-rank delta factors as in Delta-CoMe, Ping et al. 2024, whose top singular vectors
carry the most of a fine-tune's delta; the residual plane as above)::

    δ ≈ u·vᵀ + s·σ,   u·vᵀ: the block's top singular pair, u = U₀·√S₀, v = V₀·√S₀ in bfloat16
    σ = sign(δ − u·vᵀ),  s[row] = mean |δ − u·vᵀ|[row] (bfloat16)

Section 3 holds each block's factors (``rows`` bfloat16 entries of ``u`` then ``row_numel`` of
``v``: ``2·(rows + row_numel)`` bytes per block, :func:`factor_block_bytes`), section 4 the
residual plane (plane layout). A level-4 read is those two sections' byte ranges of its blocks.
Decoding is ``u[row]·v[col]`` in float32 (exact: a product of two bfloat16 values fits a
float32) plus ``(0 + ±s[row])`` (the plane summed from zeros, as the sign levels are). Per byte the tier pays where blocks have many rows: its factors cost
``1/row_numel + 1/rows`` of the bf16 block (tiny zoo, whole-tensor blocks: 2% of the bytes with
51% of the energy; a 4096-wide Llama tensor in 128 KiB blocks of 16 rows: 6.3%, as much as a sign
plane); the planner buys it only where its measured error per byte is better.

The residual energy ``Σ r_k²`` of each block after each plane (with the stored, rounded scales)
is recorded too (``TensorStats.sketch_sq``, float64 ``[n_blocks, TIERS]``, column ``k − 1`` for
level ``k``; column 3 the rank-1 tier): the energy a level-k read keeps is ``Σδ² − Σ r_k²``, the
planner's value of that tier.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from collections.abc import Callable

import numpy as np

from mergepipe.catalog.digest import BLOCK_DIGEST_BYTES, block_digest

#: sign planes of δ recorded per block (levels 1..PLANES)
PLANES = 3
#: the level of the rank-1 tier (rank-1 factors + one residual sign plane)
R1_LEVEL = PLANES + 1
#: tiers recorded per block (columns of ``TensorStats.sketch_sq``): the sign levels, then rank-1
TIERS = R1_LEVEL
#: sections per tensor in the blob (plane-major): the PLANES sign planes, the rank-1 factors,
#: the residual sign plane after them (columns of ``TensorStats.sketch_sha``)
SECTIONS = PLANES + 2
#: ``--sketch`` values: ``none`` (read or skip), ``signK`` (levels up to K planes may be read),
#: ``sign3+r1`` (levels 1-3 and the rank-1 tier)
SKETCH_KINDS = ("none", "sign1", "sign2", "sign3", "sign3+r1")
#: the sketch a plan uses when the caller does not say (see docs/QUALITY.md for the measurements)
DEFAULT_SKETCH = "sign3+r1"


def sketch_levels(kind: str) -> int:
    """Highest sign-plane level a ``--sketch`` kind allows (0 for ``none``)."""
    return 0 if kind == "none" else int(kind[4])


def sketch_tiers(kind: str) -> tuple[int, ...]:
    """The sketch levels a ``--sketch`` kind lets the planner choose from (``()`` for ``none``):
    ``signK`` → ``1..K``; ``sign3+r1`` → ``1, 2, 3, R1_LEVEL``."""
    if kind == "none":
        return ()
    return tuple(range(1, sketch_levels(kind) + 1)) + ((R1_LEVEL,) if kind.endswith("+r1") else ())


def level_sections(level: int) -> tuple[int, ...]:
    """Sections of the tensor's sketch a level-``level`` read takes, in read (and digest) order:
    level ``k <= PLANES`` the first ``k`` sign planes, ``R1_LEVEL`` the factors and the residual plane.

    Raises:
        ValueError: not a level 1..R1_LEVEL.
    """
    if 1 <= level <= PLANES:
        return tuple(range(level))
    if level == R1_LEVEL:
        return (PLANES, PLANES + 1)
    raise ValueError(f"sketch level {level}: use 1..{R1_LEVEL}")


def sketch_block_bytes(rows: int, row_numel: int) -> int:
    """Bytes of one plane of one block of ``rows`` rows of ``row_numel`` entries."""
    return (rows * row_numel + 7) // 8 + 2 * rows


def factor_block_bytes(rows: int, row_numel: int) -> int:
    """Bytes of the rank-1 factors of one block: ``rows`` + ``row_numel`` bfloat16 entries."""
    return 2 * (rows + row_numel)


def _block_rows(rows: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    r = np.minimum((np.arange(n_blocks) + 1) * rows_per_block, max(rows, 1)) - np.arange(n_blocks) * rows_per_block
    return np.maximum(r, 0)


@functools.lru_cache(maxsize=4096)
def section_costs(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    """int64 ``(n_blocks, SECTIONS)``: bytes of each block in each section of its tensor's sketch
    (read-only: cached per shape, since the K experts of a merge share every tensor's shape)."""
    r = _block_rows(rows, rows_per_block, n_blocks).astype(np.int64)
    plane = (r * row_numel + 7) // 8 + 2 * r
    fac = np.where(r > 0, 2 * (r + row_numel), 0)
    out = np.stack([plane] * PLANES + [fac, plane], axis=1).reshape(n_blocks, SECTIONS)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4096)
def tier_costs(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    """int64 ``(n_blocks, TIERS)``: bytes a read of each block at level ``k`` takes (column ``k − 1``;
    read-only, cached per shape)."""
    sc = section_costs(rows, row_numel, rows_per_block, n_blocks)
    out = np.stack([sc[:, list(level_sections(k))].sum(axis=1) for k in range(1, TIERS + 1)], axis=1)
    out.flags.writeable = False
    return out


def section_offsets(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    """int64 ``(SECTIONS, n_blocks + 1)``: byte offset of each block of each section from the
    tensor's first sketch byte (``TensorStats.sketch_start``); ``[s, -1]`` is section ``s``'s end."""
    sc = section_costs(rows, row_numel, rows_per_block, n_blocks)
    ends = np.cumsum(sc.sum(axis=0))
    starts = np.concatenate([[0], ends[:-1]])
    return np.concatenate([np.zeros((SECTIONS, 1), np.int64), np.cumsum(sc.T, axis=1)], axis=1) + starts[:, None]


def tensor_sketch_bytes(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> int:
    """Bytes of a tensor's whole sketch (every section)."""
    return int(section_costs(rows, row_numel, rows_per_block, n_blocks).sum())


def tensor_sketch_costs(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    """int64 ``(n_blocks,)``: bytes of one plane of each block of a tensor (the last may be shorter)."""
    r = _block_rows(rows, rows_per_block, n_blocks)
    return (r * row_numel + 7) // 8 + 2 * r


def block_offsets(rows: int, row_numel: int, rows_per_block: int, n_blocks: int) -> np.ndarray:
    """int64 ``(n_blocks + 1,)``: byte offset of each block inside one plane of its tensor's
    sketch (exclusive prefix sum); the last entry is the plane's size."""
    return np.concatenate([[0], np.cumsum(tensor_sketch_costs(rows, row_numel, rows_per_block, n_blocks))])


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bit patterns, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + r) >> 16).astype(np.uint16)


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _sign_plane(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, bytes]:
    """One sign plane of float32 ``r`` ``(rows, n)``: (positive mask, float32 stored scales, bytes)."""
    pos = r > 0
    s16 = _to_bf16_bits((np.abs(r).astype(np.float64).sum(axis=1) / max(r.shape[1], 1)).astype(np.float32))
    return pos, _from_bf16_bits(s16), np.packbits(pos.reshape(-1)).tobytes() + s16.astype("<u2").tobytes()


def rank1_factors(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint16 bfloat16 bits of the rank-1 factors ``(u (rows,), v (n,))`` of float32 ``d``: the top
    singular pair (float64 SVD, LAPACK), ``u = U₀·√S₀``, ``v = V₀·√S₀``, each rounded to bfloat16
    (zero for a zero block)."""
    d64 = np.asarray(d, dtype=np.float64)
    if not d64.any() or not np.isfinite(d64).all():
        return np.zeros(d.shape[0], np.uint16), np.zeros(d.shape[1], np.uint16)
    uu, sv, vt = np.linalg.svd(d64, full_matrices=False)
    g = np.sqrt(sv[0])
    return _to_bf16_bits((uu[:, 0] * g).astype(np.float32)), _to_bf16_bits((vt[0] * g).astype(np.float32))


def rank1_product(u16: np.ndarray, v16: np.ndarray) -> np.ndarray:
    """float32 ``u·vᵀ`` of bfloat16 factor bits (exact: a product of two bf16 values fits a float32)."""
    return _from_bf16_bits(u16)[:, None] * _from_bf16_bits(v16)[None, :]


def encode_block(delta: np.ndarray, planes: int = PLANES) -> tuple[list[bytes], np.ndarray]:
    """Sketch one block.

    Args:
        delta: float32 ``(rows, row_numel)`` task vector of the block.
        planes: sign planes to code (the rank-1 sections are coded when ``planes == PLANES``).

    Returns:
        (one ``bytes`` per section: ``planes`` sign planes, then with ``planes == PLANES`` the
        rank-1 factors and the residual plane; float64 ``(planes,)`` or ``(TIERS,)`` residual
        energy ``Σ (δ − δ̂_k)²`` after each level, with the stored bfloat16 scales and factors and
        the float32 reconstruction the decoders compute).
    """
    d = np.asarray(delta, dtype=np.float32)
    rec = np.zeros_like(d)
    out, resid = [], np.zeros(planes + (1 if planes == PLANES else 0))
    for p in range(planes):
        pos, s, b = _sign_plane(d - rec)
        rec = rec + np.where(pos, s[:, None], -s[:, None])
        out.append(b)
        e = (d - rec).astype(np.float64)
        resid[p] = float((e * e).sum())
    if planes == PLANES:
        u16, v16 = rank1_factors(d)
        lr = rank1_product(u16, v16)
        pos, s, b = _sign_plane(d - lr)
        rec = lr + np.where(pos, s[:, None], -s[:, None])
        out += [u16.astype("<u2").tobytes() + v16.astype("<u2").tobytes(), b]
        e = (d - rec).astype(np.float64)
        resid[PLANES] = float((e * e).sum())
    return out, resid


def decode_blocks(data: bytes | memoryview, rows: int, row_numel: int, rows_per_block: int) -> np.ndarray:
    """Decode one plane of ``rows`` rows (whole blocks of ``rows_per_block`` rows, the last may
    be shorter) from its consecutive bytes.

    Returns:
        float32 ``(rows * row_numel,)``: ``s_p·σ_p`` row-major (sum the planes of a level).

    Raises:
        ValueError: ``data`` is not exactly one plane's bytes of those blocks.
    """
    out = np.empty(rows * row_numel, dtype=np.float32)
    mv = memoryview(data)
    pos = 0
    for r0 in range(0, rows, rows_per_block):
        r = min(rows_per_block, rows - r0)
        nb = (r * row_numel + 7) // 8
        if pos + nb + 2 * r > mv.nbytes:
            raise ValueError(f"sketch bytes: {mv.nbytes} given, too few for {rows} rows")
        bits = np.unpackbits(np.frombuffer(mv[pos : pos + nb], dtype=np.uint8), count=r * row_numel)
        sc = _from_bf16_bits(np.frombuffer(mv[pos + nb : pos + nb + 2 * r], dtype="<u2"))
        pos += nb + 2 * r
        sgn = bits.astype(np.float32) * 2.0 - 1.0
        out[r0 * row_numel : (r0 + r) * row_numel] = (sgn.reshape(r, row_numel) * sc[:, None]).reshape(-1)
    if pos != mv.nbytes:
        raise ValueError(f"sketch bytes: {mv.nbytes} given, {pos} expected for {rows} rows")
    return out


def decode_factors(data: bytes | memoryview, rows: int, row_numel: int, rows_per_block: int) -> np.ndarray:
    """Decode the rank-1 section of ``rows`` rows (whole blocks) from its consecutive bytes.

    Returns:
        float32 ``(rows * row_numel,)``: ``u·vᵀ`` of each block, row-major (add the residual
        plane's :func:`decode_blocks` for the rank-1 tier).

    Raises:
        ValueError: ``data`` is not exactly the factor bytes of those blocks.
    """
    out = np.empty(rows * row_numel, dtype=np.float32)
    mv = memoryview(data)
    pos = 0
    for r0 in range(0, rows, rows_per_block):
        r = min(rows_per_block, rows - r0)
        nb = 2 * (r + row_numel)
        if pos + nb > mv.nbytes:
            raise ValueError(f"sketch factor bytes: {mv.nbytes} given, too few for {rows} rows")
        f = np.frombuffer(mv[pos : pos + nb], dtype="<u2")
        pos += nb
        out[r0 * row_numel : (r0 + r) * row_numel] = rank1_product(f[:r], f[r:]).reshape(-1)
    if pos != mv.nbytes:
        raise ValueError(f"sketch factor bytes: {mv.nbytes} given, {pos} expected for {rows} rows")
    return out


class SketchBuilder:
    """Accumulates one tensor's sketch over row chunks (block-aligned, in row order), in memory.

    The reference form of the blob layout (tests check :class:`SketchWriter` against it); the
    analyze pass streams with :class:`SketchWriter` instead.

    Args:
        rows, row_numel, rows_per_block: the tensor's block grid.
    """

    def __init__(self, rows: int, row_numel: int, rows_per_block: int) -> None:
        self.rows, self.row_numel, self.rpb = max(rows, 1), row_numel, rows_per_block
        self.planes: list[list[bytes]] = [[] for _ in range(SECTIONS)]
        self.resid: list[np.ndarray] = []

    def add(self, row0: int, delta: np.ndarray) -> None:
        """Add the float32 task vector (flat) of rows ``[row0, …)``; ``row0`` on a block boundary."""
        if row0 % self.rpb:
            raise ValueError("chunks must start on block boundaries")
        d = np.asarray(delta, dtype=np.float32).reshape(-1, self.row_numel)
        for r in range(0, d.shape[0], self.rpb):
            parts, e = encode_block(d[r : r + self.rpb])
            for p, b in enumerate(parts):
                self.planes[p].append(b)
            self.resid.append(e)

    def finish(self) -> tuple[bytes, np.ndarray]:
        """(the tensor's sketch bytes, section-major; float64 ``[n_blocks, TIERS]`` residual energies)."""
        return b"".join(b"".join(p) for p in self.planes), np.asarray(self.resid, dtype=np.float64).reshape(-1, TIERS)


#: bytes copied from a spool to the blob at a time
_COPY_BYTES = 1 << 20


class SketchWriter:
    """Writes one expert's sketch blob while its tensors are analysed, with bounded memory.

    Produces the bytes :class:`SketchBuilder` would (tensor after tensor, each plane-major), but
    never holds a tensor's or the expert's sketch: plane 1 of each block goes to ``write`` as soon
    as the block is coded (blocks arrive in row order, so plane 1 of a tensor is in blob order),
    sections 2..``SECTIONS`` (the later planes, the rank-1 factors and the residual plane) go to
    one spool per section (:class:`tempfile.SpooledTemporaryFile`: in
    memory up to ``spill_bytes / (SECTIONS - 1)`` bytes each, beyond that an unnamed temporary file
    in ``spill_dir``) and are copied to ``write`` in 1 MiB pieces when the tensor ends. Memory is
    thus at most ``spill_bytes`` + 1 MiB per expert, whatever the expert's size; the disk spill is
    at most 2/16 of the largest bf16 tensor's bytes.

    Args:
        write: receives the blob's bytes in order (a :class:`~mergepipe.storage.base.Writer`'s
            ``write``, a file's ``write``).
        spill_bytes: memory (bytes) the later planes of one tensor may take before spilling.
        spill_dir: folder of the spill files (None: the system temporary folder).

    Attributes:
        nbytes: bytes written so far. sha256: ``hashlib`` SHA-256 of those bytes.
        digests: after :meth:`end`, uint8 ``[n_blocks, SECTIONS, 16]``: the content digest
            (:func:`~mergepipe.catalog.stats.block_digest`) of each block's bytes of each plane
            of the tensor just ended (``TensorStats.sketch_sha``; the engine checks what it reads).
    """

    def __init__(self, write: Callable[[bytes], object], spill_bytes: int, spill_dir: str | None = None) -> None:
        self._write = write
        self.spill_each = max(1, spill_bytes // max(1, SECTIONS - 1))
        self.spill_dir = spill_dir
        self.nbytes = 0
        self.sha256 = hashlib.sha256()
        self._cur: tuple[int, int, int] | None = None
        self._spools: list = []
        self._resid: list[np.ndarray] = []
        self._next_row = 0
        self._plane_bytes = 0
        self._digests: list[bytes] = []
        self.digests = np.zeros((0, SECTIONS, BLOCK_DIGEST_BYTES), dtype=np.uint8)

    def _emit(self, data: bytes) -> None:
        self._write(data)
        self.sha256.update(data)
        self.nbytes += len(data)

    def begin(self, rows: int, row_numel: int, rows_per_block: int) -> int:
        """Start a tensor of ``rows`` rows of ``row_numel`` entries; returns its first byte in the
        blob (its ``TensorStats.sketch_start``).

        Raises:
            ValueError: the previous tensor was not ended.
        """
        if self._cur is not None:
            raise ValueError("sketch: begin() before the previous tensor's end()")
        self._cur = (max(rows, 1), row_numel, rows_per_block)
        self._spools = [
            tempfile.SpooledTemporaryFile(max_size=self.spill_each, dir=self.spill_dir) for _ in range(SECTIONS - 1)
        ]
        self._resid, self._next_row, self._plane_bytes = [], 0, 0
        self._digests = []
        return self.nbytes

    def add(self, row0: int, delta: np.ndarray) -> None:
        """Add the float32 task vector (flat) of rows ``[row0, …)`` of the current tensor.

        Raises:
            ValueError: ``row0`` is not the row after the previous chunk (chunks come in row
                order, block-aligned), or no tensor was begun.
        """
        if self._cur is None:
            raise ValueError("sketch: add() outside begin()/end()")
        _, row_numel, rpb = self._cur
        if row0 != self._next_row or row0 % rpb:
            raise ValueError(f"sketch: chunk at row {row0}, expected row {self._next_row} (block-aligned, in order)")
        d = np.asarray(delta, dtype=np.float32).reshape(-1, row_numel)
        for r in range(0, d.shape[0], rpb):
            parts, e = encode_block(d[r : r + rpb])
            self._emit(parts[0])
            self._plane_bytes += len(parts[0])
            for f, b in zip(self._spools, parts[1:]):
                f.write(b)
            self._resid.append(e)
            self._digests.append(b"".join(block_digest(b) for b in parts))
        self._next_row = row0 + d.shape[0]

    def end(self) -> np.ndarray:
        """Finish the current tensor: copy its later planes into the blob.

        Returns:
            float64 ``[n_blocks, TIERS]`` residual energies (``TensorStats.sketch_sq``).

        Raises:
            ValueError: the chunks added do not cover the tensor's rows.
        """
        if self._cur is None:
            raise ValueError("sketch: end() without begin()")
        rows, row_numel, rpb = self._cur
        n_blocks = -(-rows // rpb)
        if self._plane_bytes != int(block_offsets(rows, row_numel, rpb, n_blocks)[-1]):
            raise ValueError(f"sketch: {self._next_row} of {rows} rows added")
        try:
            for f in self._spools:
                f.seek(0)
                while piece := f.read(_COPY_BYTES):
                    self._emit(piece)
        finally:
            self.discard()
        resid = np.asarray(self._resid, dtype=np.float64).reshape(-1, TIERS)
        self.digests = np.frombuffer(b"".join(self._digests), dtype=np.uint8).reshape(-1, SECTIONS, BLOCK_DIGEST_BYTES)
        self._cur, self._resid, self._digests = None, [], []
        return resid

    def discard(self) -> None:
        """Drop the current tensor's spools (their files are deleted); never raises."""
        for f in self._spools:
            try:
                f.close()
            except OSError:
                pass
        self._spools = []
