"""Splitting a plan into N parts of balanced bytes, along output shards.

A part is a set of output shards: its process reads the base rows and expert blocks those
shards need and writes only those shards, so parts share no output object and can run on
different machines. Part 0 also writes the small side files (the safetensors index and the
base's config/tokenizer files). The split is a pure function of the plan and N, so every
process of a partitioned run (and the commit) computes the same parts without talking to the
others.

Balance: each shard costs the bytes its process moves (base bytes read, planned expert bytes
read, times the tensor's passes, and output bytes written); shards are assigned greedily,
largest first, to the part with the fewest bytes so far (Graham's LPT rule: the largest part
is at most 4/3 of the optimum). Balance is limited by shard granularity: with fewer shards
than parts some parts are empty, and one shard larger than 1/N of the model bounds the
speed-up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import DTYPES
from mergepipe.planner.plan import Plan


@dataclass(frozen=True)
class PartSpec:
    """Part ``index`` of ``count`` (0-based), as in ``--part 2/8``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def writes_side_files(self) -> bool:
        """Part 0 writes the index and the base's config/tokenizer files."""
        return self.index == 0


#: largest N accepted by ``--part``/``--workers`` (an Indexed Job allows 100 000 completions;
#: a merge has at most a few hundred shards)
MAX_PARTS = 10_000


def parse_part(text: str, what: str = "--part") -> PartSpec:
    """``"i/N"`` -> :class:`PartSpec`; 0 <= i < N <= :data:`MAX_PARTS`.

    Raises:
        InputError: another form, or i/N out of range (the message names ``what``).
    """
    m = re.fullmatch(r"\s*(\d{1,6})\s*/\s*(\d{1,6})\s*", text or "")
    if not m:
        raise InputError(f"{what} {text!r}: expected INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 0/4.")
    i, n = int(m.group(1)), int(m.group(2))
    if not 0 < n <= MAX_PARTS or not 0 <= i < n:
        raise InputError(f"{what} {text}: expected INDEX/COUNT with 0 <= INDEX < COUNT <= {MAX_PARTS}, e.g. 0/4.")
    return PartSpec(i, n)


def shard_costs(plan: Plan) -> dict[str, int]:
    """Output shard name -> bytes its part moves (base read + planned expert reads × passes +
    output written), in the plan's shard order."""
    out: dict[str, int] = {}
    for tp in plan.tensors:
        n = math.prod(tp.shape)
        cost = n * DTYPES[tp.dtype][0] + n * DTYPES[tp.out_dtype or tp.dtype][0]
        cost += tp.passes * sum(te.bytes for te in tp.experts)
        out[tp.file] = out.get(tp.file, 0) + cost
    return out


def partition(plan: Plan, count: int) -> list[list[str]]:
    """The output shards of each of ``count`` parts (each list in the plan's shard order).

    Every shard of the plan is in exactly one part; parts may be empty when the plan has
    fewer shards than ``count``.
    """
    return partition_costs(shard_costs(plan), count)


def partition_costs(costs: dict[str, int], count: int) -> list[list[str]]:
    """LPT assignment of items (name -> cost, in their output order) to ``count`` bins; each
    bin lists its names in the input order. Deterministic: ties go to the earlier name and the
    lower bin."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    order = {name: k for k, name in enumerate(costs)}
    loads = [0] * count
    bins: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(costs, key=lambda s: (-costs[s], order[s])):
        j = min(range(count), key=lambda b: (loads[b], b))
        loads[j] += costs[name]
        bins[j].append(name)
    return [sorted(b, key=order.__getitem__) for b in bins]
