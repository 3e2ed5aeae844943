"""Content checks of what the engine reads: every expert block and sketch plane against the plan.

The catalog records, at analyze time, a content digest of every block of every expert tensor
and of every block of every sign plane of its sketch (:func:`mergepipe.catalog.stats.block_digest`:
SHA-256 truncated to 128 bits); the plan carries the digests of what it selects
(``TensorExpert.block_digests`` / ``sketch_digests``, inside the plan digest). The reader threads
hash each block as it arrives and compare before the bytes reach the merge, so a block edited
after analyze (same size, even with the file's mtime restored), a sketch blob replaced by
another one of the same size, or a plan pointing a sketch at some other file is refused with
:class:`ContentMismatch` before any output is published (the executor discards every
unfinished shard on error). Base tensors are checked whole against the catalog's per-tensor
SHA-256 by the writer (``TensorPlan.base_sha256``).

Cost: one SHA-256 pass over the bytes read, in the reader threads (``hashlib`` releases the GIL
for buffers over 2 KiB); measured in ``bench/content_checks.py`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mergepipe.catalog.digest import BLOCK_DIGEST_BYTES, block_digest
from mergepipe.errors import InputError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from mergepipe.planner.plan import TensorExpert

_HEX = 2 * BLOCK_DIGEST_BYTES


class ContentMismatch(InputError):
    """Bytes read differ from the digest the catalog recorded (exit code 2, nothing published)."""


def _runs_index(runs: Sequence[tuple[int, int]], per_run: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(run starts, digest position of each run's first entry) for bisecting a block to its
    position; ``per_run``: entries per block of each run (sketch levels; default 1)."""
    starts, cum, pos = [], [], 0
    for i, (b0, b1) in enumerate(runs):
        starts.append(b0)
        cum.append(pos)
        pos += (b1 - b0) * (per_run[i] if per_run is not None else 1)
    return starts, cum


_INDEX: dict[tuple[int, str], tuple[object, list[int], list[int]]] = {}


def _index(te: TensorExpert, kind: str) -> tuple[list[int], list[int]]:
    """:func:`_runs_index` of ``te``'s exact (``kind="blocks"``) or sketched runs, cached per
    plan object (reader threads share it; a race computes the same value twice)."""
    got = _INDEX.get((id(te), kind))
    if got is not None and got[0] is te:
        return got[1], got[2]
    if kind == "blocks":
        starts, cum = _runs_index(te.blocks)
    else:
        from mergepipe.catalog.sketch import level_sections

        starts, cum = _runs_index(te.sketch_blocks, [len(level_sections(k)) for k in te.sketch_levels])
    if len(_INDEX) > 1 << 16:
        _INDEX.clear()
    _INDEX[(id(te), kind)] = (te, starts, cum)
    return starts, cum


def expected_block(te: TensorExpert, b: int) -> str | None:
    """The recorded digest (hex) of block ``b`` of ``te``'s exact blocks, or None when ``b`` is
    not selected or the plan carries no digests."""
    if not te.block_digests:
        return None
    starts, cum = _index(te, "blocks")
    i = bisect.bisect_right(starts, b) - 1
    if i < 0 or b >= te.blocks[i][1]:
        return None
    p = cum[i] + b - te.blocks[i][0]
    return te.block_digests[p * _HEX : (p + 1) * _HEX]


def expected_sketch(te: TensorExpert, b: int, plane: int) -> str | None:
    """The recorded digest (hex) of block ``b``'s bytes of the ``plane``-th section (0-based, in
    :func:`~mergepipe.catalog.sketch.level_sections` order: a sign plane, or the rank-1 factors
    and the residual plane) its run reads in ``te``'s sketched runs, or None when not read."""
    from mergepipe.catalog.sketch import level_sections

    if not te.sketch_digests:
        return None
    starts, cum = _index(te, "sketch")
    i = bisect.bisect_right(starts, b) - 1
    if i < 0 or b >= te.sketch_blocks[i][1] or plane >= len(level_sections(te.sketch_levels[i])):
        return None
    b0, b1 = te.sketch_blocks[i]
    p = cum[i] + plane * (b1 - b0) + b - b0
    return te.sketch_digests[p * _HEX : (p + 1) * _HEX]


def check_expert_runs(
    te: TensorExpert,
    tensor: str,
    expert: str,
    uri: str,
    rpb: int,
    row_bytes: int,
    runs: Sequence[tuple[int, int]],
    bufs: Sequence[bytes | memoryview],
) -> None:
    """Check the expert bytes of row runs ``runs`` (block-aligned starts; ``bufs[i]`` holds rows
    ``runs[i]``) of tensor ``tensor`` against ``te``'s block digests.

    Raises:
        ContentMismatch: naming the expert, the file, the tensor and the block, and the fix.
        InputError: the plan carries no digests for these blocks (made by an older mergepipe).
    """
    if not runs:
        return
    if not te.block_digests:
        raise InputError(
            f"plan: expert {expert!r} tensor {tensor[:200]!r} has no block content digests (a plan made by an "
            "older mergepipe, or edited); re-plan it with this mergepipe."
        )
    for (a, z), buf in zip(runs, bufs, strict=True):
        mv = memoryview(buf)
        for q in range(a, z, rpb):
            b = q // rpb
            want = expected_block(te, b)
            got = block_digest(mv[(q - a) * row_bytes : (min(q + rpb, z) - a) * row_bytes]).hex()
            if want != got:
                raise ContentMismatch(
                    f"{uri}: block {b} of tensor {tensor[:200]!r} of expert {expert!r} differs from the bytes the "
                    "catalog analyzed (same size, other content): the expert changed after analyze. Nothing was "
                    "published; re-run `mergepipe merge` (it re-analyzes changed checkpoints) or restore the file."
                )


def check_sketch_plane(
    te: TensorExpert,
    tensor: str,
    expert: str,
    uri: str,
    blocks: range,
    plane: int,
    buf: bytes | memoryview,
    offs: npt.NDArray[np.int64],
) -> None:
    """Check one section's bytes of ``blocks`` (consecutive; ``buf`` starts at
    ``offs[blocks.start]`` of the section, ``offs`` the section's block offsets; ``plane`` the
    section's ordinal among those its run reads) against ``te``'s sketch digests.

    Raises:
        ContentMismatch: naming the expert, the sketch blob, the tensor, block and plane, and the fix.
    """
    if not te.sketch_digests:
        raise InputError(
            f"plan: expert {expert!r} tensor {tensor[:200]!r} reads sketches without content digests (a plan made "
            "by an older mergepipe, or edited); re-plan it with this mergepipe."
        )
    mv = memoryview(buf)
    lo = int(offs[blocks.start])
    for b in blocks:
        want = expected_sketch(te, b, plane)
        got = block_digest(mv[int(offs[b]) - lo : int(offs[b + 1]) - lo]).hex()
        if want != got:
            raise ContentMismatch(
                f"{uri}: the sketch of expert {expert!r} (tensor {tensor[:200]!r}, block {b}, plane {plane + 1}) "
                "differs from the one analyzed (same size, other bytes, or another expert's blob). Nothing was "
                "published; re-run `mergepipe analyze --force` for this expert and re-plan, or plan with --sketch none."
            )
