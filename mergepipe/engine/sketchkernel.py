"""Bit-sliced decode of block sketches on the merge's torch device.

A sketched run of an expert (rows ``[row0, row1)`` of a tensor, whole blocks, level ``k``) arrives
from the reader as its ``k`` sign planes, undecoded (:class:`SketchRun`: ``k`` byte strings in the
layout of :mod:`mergepipe.catalog.sketch`, 1/16 of the bf16 bytes per plane). The merge asks for the
task vector of a few rows at a time -- the rows of one tile of the elementwise path
(:func:`mergepipe.engine.chunk._merge_chunk_tiled`), where an exact block's rows would be widened
-- and :meth:`SketchRun.delta` decodes only those rows, straight into float32 on the device:

    unpack   byte → 8 bits (a 256-entry table, big-endian as ``numpy.packbits``) → a k-bit sign
             code per entry (uint8)
    table    per row, the ``2^k`` values ``((±s₁ + ±s₂) + ±s₃)`` (float32, plane order)
    gather   ``δ̂ = T[row, code]``

The task vector the merge uses for a sketched entry is ``δ̂`` itself, the float32 sum of the
planes (:func:`mergepipe.catalog.sketch.decode_blocks` summed in plane order, element for element
the same value). So a row of a sketched run holds at most ``2^k <= 8`` distinct values, and what
a merge does to each entry through a monotone elementwise function of its value alone (a
magnitude trim) is done on the table, not on the entries (:meth:`SketchRun.delta` with
``shrink``), and the exact-threshold histogram of a row is its table's values times how often
each code occurs (:meth:`SketchRun.add_group_hist`), without decoding. (Before, the engine
merged ``(b + δ̂) − b``, the float32 round trip through the reconstructed expert value, which
differs from ``δ̂`` by the base's rounding and gave every entry its own value.)
The kernels are torch operations on whatever device holds the base tile (CPU threads via torch's
intra-op pool; ``cuda`` through the same code).

A run read at the rank-1 tier (level ``R1_LEVEL``, :mod:`mergepipe.catalog.sketch`) carries its
blocks' factor bytes (``factors``) and one plane, the residual plane: ``δ̂ = u[row]·v[col] + (0 + σ·s)``,
the product in float32 (exact for bfloat16 factors) then one float32 add -- the numpy reference
(:func:`~mergepipe.catalog.sketch.decode_factors` + (0 + :func:`~mergepipe.catalog.sketch.decode_blocks`),
the plane summed from zeros like the sign levels) in the same order, so bit-identical on any device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe.catalog.sketch import _from_bf16_bits

if TYPE_CHECKING:
    import torch

Buffer = bytes | memoryview


@dataclass(slots=True)
class _Prepared:
    """A run ready for the device: each entry's sign code, and the per-row value table."""

    codes: torch.Tensor  # uint8 (rows·row_numel,) torch tensor: the k sign bits of each entry, plane 1 most significant
    table: torch.Tensor  # float32 (rows, 2**k) torch tensor: the value of each k-bit sign code per row
    u: Any = None  # float32 (rows,) torch tensor: the rank-1 tier's row factor (None: sign planes only)
    v: Any = None  # float32 (n_blocks, row_numel) torch tensor: the column factor of each block


@dataclass
class SketchRun:
    """The undecoded sign planes of a sketched run of rows of one expert tensor.

    Args:
        rows: rows of the run (it starts on a block boundary; whole blocks, the last may be
            the tensor's shorter last block).
        row_numel: entries per row.
        rows_per_block: the tensor's block height.
        planes: ``k`` buffers, plane 1 first, each one plane's bytes of the run's blocks
            (:func:`mergepipe.catalog.sketch.sketch_block_bytes` per block).
        factors: the rank-1 tier's factor bytes of the run's blocks
            (:func:`mergepipe.catalog.sketch.factor_block_bytes` per block), with exactly one
            plane (the residual plane); None: sign planes only.

    Raises:
        ValueError: no planes (or more than 8), a non-positive size, a plane or factor buffer
            that is not exactly the bytes of those blocks (a truncated or foreign sketch blob),
            or factors with other than one plane.
    """

    rows: int
    row_numel: int
    rows_per_block: int
    planes: list[Buffer]
    factors: Buffer | None = None
    _dev: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.planes) <= 8 or self.rows < 1 or self.row_numel < 1 or self.rows_per_block < 1:
            raise ValueError(
                f"sketch run: {len(self.planes)} planes of {self.rows} rows x {self.row_numel} "
                f"(blocks of {self.rows_per_block} rows); need 1-8 planes and positive sizes"
            )
        want = sum(
            (r * self.row_numel + 7) // 8 + 2 * r
            for r in (min(self.rows_per_block, self.rows - r0) for r0 in range(0, self.rows, self.rows_per_block))
        )
        if self.factors is not None:
            fwant = sum(
                2 * (min(self.rows_per_block, self.rows - r0) + self.row_numel)
                for r0 in range(0, self.rows, self.rows_per_block)
            )
            if len(self.planes) != 1 or memoryview(self.factors).nbytes != fwant:
                raise ValueError(
                    f"sketch bytes: rank-1 factors of {memoryview(self.factors).nbytes} bytes with "
                    f"{len(self.planes)} planes; {fwant} bytes and one residual plane expected for "
                    f"{self.rows} rows of {self.row_numel}"
                )
        for p, buf in enumerate(self.planes):
            if memoryview(buf).nbytes != want:
                raise ValueError(
                    f"sketch bytes: plane {p + 1} has {memoryview(buf).nbytes} bytes, {want} expected for "
                    f"{self.rows} rows of {self.row_numel}"
                )

    @property
    def nbytes(self) -> int:
        """Bytes of the run's planes and factors (what was read)."""
        return sum(memoryview(b).nbytes for b in self.planes) + (
            memoryview(self.factors).nbytes if self.factors is not None else 0
        )

    def _prepared(self, dev: torch.device) -> _Prepared:
        """The run as device tensors, built once per device: the ``k``-bit sign code of every
        entry (uint8, one byte per entry: half the bytes of the bf16 block, a quarter of the
        float32 the numpy decoder materialised per plane) and per row the table of the ``2^k``
        values a code decodes to, ``T[row, c] = ((±s₁ + ±s₂) + ±s₃)`` with bit ``k − p`` of
        ``c`` choosing the sign of plane ``p`` -- the float32 sums of the numpy decoder, done
        once per row instead of once per entry.

        The codes are assembled at byte granularity: a 256-entry table turns a sign byte into
        eight 0/1 bytes held in one int64 (big-endian bit order, as ``numpy.packbits``), so
        ``code = (bits₁ << 2) | (bits₂ << 1) | bits₃`` costs three int64 operations per eight
        entries. On a CPU with the fused kernels the codes come from
        :func:`mergepipe.methods.kernels_cpu.build_codes` instead (the same bits, one pass)."""
        got = self._dev.get(dev)
        if got is not None:
            return got
        import torch

        rpb, rn, k = self.rows_per_block, self.row_numel, len(self.planes)
        table = np.zeros((self.rows, 1 << k), dtype=np.float32)
        signs = np.arange(1 << k)
        for p, buf in enumerate(self.planes):
            u8 = np.frombuffer(memoryview(buf), dtype=np.uint8)
            scales, pos = [], 0
            for r0 in range(0, self.rows, rpb):
                r = min(rpb, self.rows - r0)
                nb = (r * rn + 7) // 8
                scales.append(u8[pos + nb : pos + nb + 2 * r].view("<u2"))
                pos += nb + 2 * r
            sc = _from_bf16_bits(np.concatenate(scales))[:, None]
            bit = (signs >> (k - 1 - p)) & 1
            table = table + np.where(bit[None, :] == 1, sc, -sc)  # float32, plane order (0 + v₁ first)
        spans, pos = [], 0  # per block: (first bit byte, bit bytes, rows)
        for r0 in range(0, self.rows, rpb):
            r = min(rpb, self.rows - r0)
            nb = (r * rn + 7) // 8
            spans.append((pos, nb, r))
            pos += nb + 2 * r
        codes = self._codes(dev, spans)
        got = _Prepared(codes, torch.from_numpy(table).to(dev))
        if self.factors is not None:
            f = np.frombuffer(memoryview(self.factors), dtype="<u2")
            us, vs, pos = [], [], 0
            for r0 in range(0, self.rows, rpb):
                r = min(rpb, self.rows - r0)
                us.append(f[pos : pos + r])
                vs.append(f[pos + r : pos + r + rn])
                pos += r + rn
            got.u = torch.from_numpy(_from_bf16_bits(np.concatenate(us))).to(dev)
            got.v = torch.from_numpy(_from_bf16_bits(np.stack(vs))).to(dev)
        self._dev[dev] = got
        return got

    def _table(self, dev: torch.device, shrink: float | None) -> torch.Tensor:
        """The value table on ``dev``, trimmed by ``hardshrink(·, shrink)`` when ``shrink`` is given
        (cached per device and threshold: a few floats per row)."""
        pr = self._prepared(dev)
        if shrink is None:
            return pr.table
        key = (dev, "shrink", shrink)
        t = self._dev.get(key)
        if t is None:
            import torch

            t = self._dev[key] = torch.nn.functional.hardshrink(pr.table, shrink)
        return t

    def _codes(self, dev: torch.device, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """uint8 ``(rows·row_numel,)`` on ``dev``: the k-bit sign code of every entry (see
        :meth:`_prepared`); ``spans``: per block ``(first bit byte, bit bytes, rows)``."""
        import torch

        from mergepipe.methods import kernels_cpu

        rn, rpb = self.row_numel, self.rows_per_block
        if dev.type == "cpu" and kernels_cpu.available():  # the fused CPU kernel: one pass, no temporaries
            codes = torch.empty(self.rows * rn, dtype=torch.uint8)
            kernels_cpu.build_codes(
                codes.numpy(),
                [np.frombuffer(memoryview(b), dtype=np.uint8) for b in self.planes],
                [(a, r * rn) for a, _nb, r in spans],
            )
            return codes
        lut = _bit_lut(dev)
        with warnings.catch_warnings():  # read-only buffers: the views are only read
            warnings.simplefilter("ignore")
            wholes = [torch.frombuffer(buf, dtype=torch.uint8).to(dev) for buf in self.planes]
        if all(r * rn % 8 == 0 for _, _, r in spans):  # no padding bits: the run's codes in one sweep
            code = None
            for whole in wholes:
                bits = whole[: spans[0][1]] if len(spans) == 1 else torch.cat([whole[a : a + nb] for a, nb, _ in spans])
                v = lut.index_select(0, bits.to(torch.int32))
                code = v if code is None else code.bitwise_left_shift_(1).bitwise_or_(v)
            assert code is not None
            codes = code.view(torch.uint8)
        else:  # a block ends inside a byte: block by block, the padding cut
            codes = torch.empty(self.rows * rn, dtype=torch.uint8, device=dev)
            for (a, nb, r), r0 in zip(spans, range(0, self.rows, rpb)):
                code = lut.index_select(0, wholes[0][a : a + nb].to(torch.int32))
                for whole in wholes[1:]:
                    code.bitwise_left_shift_(1).bitwise_or_(lut.index_select(0, whole[a : a + nb].to(torch.int32)))
                codes[r0 * rn : (r0 + r) * rn] = code.view(torch.uint8)[: r * rn]
        return codes

    def host_arrays(
        self, dev: torch.device, shrink: float | None, factor: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The run as numpy arrays for the fused CPU kernels (:mod:`mergepipe.methods.kernels_cpu`;
        ``dev`` is a CPU device): ``(codes, table, u, v)`` -- the uint8 ``(rows·row_numel,)`` sign
        codes, and for a sign-plane run the float32 ``(rows, 2^k)`` value table trimmed by
        ``hardshrink(·, shrink)`` and times ``factor`` (each table value as the torch path computes
        it per entry: trimmed, then scaled), ``u = v = None``; for a rank-1 run the untrimmed
        residual table, ``u`` float32 ``(rows,)`` and ``v`` float32 ``(n_blocks, row_numel)``
        (the trim and the factor apply to the decoded entries). Cached per device, threshold and
        factor."""
        key = (dev, "host", shrink, factor)
        got = self._dev.get(key)
        if got is None:
            pr = self._prepared(dev)
            codes = pr.codes.numpy()
            if pr.u is not None:
                got = (codes, pr.table.numpy(), pr.u.numpy(), pr.v.numpy())
            else:
                t = self._table(dev, shrink)
                got = (codes, (t * factor if factor != 1.0 else t).contiguous().numpy(), None, None)
            self._dev[key] = got
        return got

    def zero_rows(self, r0: int, r1: int, dev: torch.device, shrink: float | None) -> bool:
        """True when every entry of rows ``[r0, r1)`` decodes to exactly zero after the trim
        ``hardshrink(·, shrink)`` (a sign-plane run whose rows' trimmed value tables are all zero:
        at density 0.3 a one-plane row's ``±s`` is usually below the threshold), so the merge can
        leave the run out of those rows without decoding them. A rank-1 run, or no ``shrink``:
        False unless the table says so for the untrimmed values."""
        if self.factors is not None:
            return False
        key = (dev, "zero", shrink)
        z = self._dev.get(key)
        if z is None:
            z = self._dev[key] = (self._table(dev, shrink) == 0).all(dim=1).cpu().numpy()
        return bool(z[r0:r1].all())

    def delta_rows(self, r0: int, r1: int, dev: torch.device, shrink: float | None = None) -> torch.Tensor:
        """float32 ``(r1 − r0, row_numel)`` torch tensor on ``dev``: ``δ̂_k`` of rows ``[r0, r1)``
        of the run (``Σ_p σ_p·s_p`` in plane order): one gather of the rows' sign codes from
        their rows' value tables; with ``shrink``, ``hardshrink(δ̂_k, shrink)`` (the table
        trimmed: the same values, entry for entry, as trimming the decoded rows)."""
        import torch

        pr = self._prepared(dev)
        rn = self.row_numel
        idx = pr.codes[r0 * rn : r1 * rn].view(r1 - r0, rn).to(torch.int64)
        if pr.u is None:
            return torch.gather(self._table(dev, shrink)[r0:r1], 1, idx)
        # rank-1 tier: u[row]·v[col] (float32, exact for bf16 factors), then + σ·s; no value table
        # holds these entries, so a trim applies to the decoded rows. The product is written block
        # by block (a row's v is its block's: broadcast, no per-row copy of v)
        rpb = self.rows_per_block
        d = torch.empty((r1 - r0, rn), dtype=torch.float32, device=dev)
        for blk in range(r0 // rpb, (r1 - 1) // rpb + 1):
            a, z = max(r0, blk * rpb), min(r1, (blk + 1) * rpb)
            torch.mul(pr.u[a:z, None], pr.v[blk], out=d[a - r0 : z - r0])
        d.add_(torch.gather(pr.table[r0:r1], 1, idx))
        return d if shrink is None else torch.nn.functional.hardshrink(d, shrink)

    def delta(self, e0: int, e1: int, b: torch.Tensor, shrink: float | None = None) -> torch.Tensor:
        """float32 task vector ``δ̂_k`` of the run's flat elements ``[e0, e1)`` (a 1-D torch tensor
        on the device of ``b``, the base's float32 values of those elements, which only name the
        device); with ``shrink``, trimmed: ``hardshrink(δ̂_k, shrink)`` (see :meth:`delta_rows`)."""
        rn = self.row_numel
        r0, r1 = e0 // rn, -(-e1 // rn)
        return self.delta_rows(r0, r1, b.device, shrink).view(-1)[e0 - r0 * rn : e1 - r0 * rn]

    def values(self, e0: int, e1: int, b: torch.Tensor) -> torch.Tensor:
        """float32 reconstructed expert values ``b + δ̂_k`` of elements ``[e0, e1)`` (see :meth:`delta`)."""
        import torch

        return torch.add(b, self.delta(e0, e1, b))

    def _count_codes(self, rows_i: np.ndarray, codes_i: np.ndarray, dev: torch.device) -> np.ndarray:
        """int64 counts of code ``codes_i[j]`` in row ``rows_i[j]`` of the run, for each ``j``: per
        distinct code, one comparison over the rows that ask for it (uint8, on ``dev``)."""
        import torch

        c2 = self._prepared(dev).codes.view(self.rows, self.row_numel)
        out = np.zeros(len(rows_i), dtype=np.int64)
        for c in np.unique(codes_i):
            sel = np.flatnonzero(codes_i == c)
            r = torch.from_numpy(np.ascontiguousarray(rows_i[sel], dtype=np.int64)).to(c2.device)
            out[sel] = c2.index_select(0, r).eq_(int(c)).sum(1).cpu().numpy()
        return out

    def code_counts(self, dev: torch.device) -> np.ndarray:
        """int64 ``(rows, 2^k)`` numpy array: how many entries of each row have each sign code."""
        k = len(self.planes)
        rows_i, codes_i = np.divmod(np.arange(self.rows << k), 1 << k)
        return self._count_codes(rows_i, codes_i, dev).reshape(self.rows, 1 << k)

    def add_group_hist(self, hist: np.ndarray, lo: int, dev: torch.device) -> None:
        """Add to ``hist`` (int64, :func:`mergepipe.numerics.exact_shrink_hist`'s layout: bin ``i``
        counts the bit pattern ``lo + i`` of ``|δ|``) the run's entries whose ``|δ̂_k|`` falls in
        its range, without decoding: the rows' table values in range, each weighted by how often
        its code occurs in its row (counted only for those (row, code) pairs: a key group is a
        narrow band of magnitudes, so few rows have a table value in it).

        Raises:
            ValueError: a rank-1 run (``factors``): its entries are not its table's values."""
        if self.factors is not None:
            raise ValueError("sketch run: a rank-1 run has no per-row value table; decode it")
        t = self._prepared(dev).table.cpu().numpy()
        off = np.abs(t).view(np.int32).astype(np.int64) - lo
        rows_i, codes_i = np.nonzero((off >= 0) & (off < len(hist)))
        if len(rows_i):
            np.add.at(hist, off[rows_i, codes_i], self._count_codes(rows_i, codes_i, dev))


_LUTS: dict[torch.device, torch.Tensor] = {}


def _bit_lut(dev: torch.device) -> torch.Tensor:
    """int64 ``(256,)`` on ``dev``: byte ``v`` → the eight bytes ``bit_7(v), …, bit_0(v)`` (0/1) in
    memory order, so ``lut[u8].view(uint8)`` unpacks big-endian bits like ``numpy.unpackbits``."""
    t = _LUTS.get(dev)
    if t is None:
        import torch

        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)  # (256, 8), MSB first
        t = _LUTS[dev] = torch.from_numpy(np.ascontiguousarray(bits).view("<i8").reshape(256).copy()).to(dev)
    return t
