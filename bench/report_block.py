"""Generated blocks of the docs: the one helper of every bench report that renders Markdown from
committed raw results into a document (``bench/table23_report.py``, ``bench/quality_report.py``,
``bench/search_report.py``).

A block is the text from a begin-marker line to an end-marker line (both HTML comments, kept
in the document); the report renders it whole, markers included. ``--write`` replaces each
block in the document, ``--check`` compares and names the first differing line of each block
that differs (CI runs it through the reports' tests), no flag prints the rendered blocks.

Exit codes of :func:`main`: 0 written / identical, 1 a block differs (``--check``), 2 the
document lacks a block's markers (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Block:
    """One generated block.

    Attributes:
        label: what the block is, for messages (e.g. ``"issue 23 table"``, ``"testbed zoo8-dev"``).
        begin: the begin-marker line (no newline).
        end: the end-marker line (no newline).
        text: the rendered block: ``begin``, the body, ``end`` (exactly as in the document).
    """

    label: str
    begin: str
    end: str
    text: str

    def __post_init__(self) -> None:
        if not (self.text.startswith(self.begin) and self.text.endswith(self.end)):
            raise ValueError(f"rendered {self.label} does not start and end with its markers")


def span(doc_text: str, begin: str, end: str) -> tuple[int, int] | None:
    """``(start, stop)`` of the first ``begin`` … ``end`` block in ``doc_text`` (markers
    included), or None when either marker is missing (or ``end`` only precedes ``begin``)."""
    i = doc_text.find(begin)
    if i < 0:
        return None
    j = doc_text.find(end, i + len(begin))
    return None if j < 0 else (i, j + len(end))


def _where(doc: Path) -> str:
    try:
        return str(doc.resolve().relative_to(REPO))
    except ValueError:
        return doc.name


def _compare(doc: Path, blocks: Sequence[Block]) -> tuple[list[str], list[str]]:
    """(blocks whose markers ``doc`` lacks, blocks ``doc`` holds otherwise), one line each."""
    text = doc.read_text()
    missing, differ = [], []
    for b in blocks:
        s = span(text, b.begin, b.end)
        if s is None:
            missing.append(f"{_where(doc)}: no generated block for the {b.label} (markers {b.begin!r} … {b.end!r})")
            continue
        old, new = text[s[0] : s[1]].splitlines(), b.text.splitlines()
        if old != new or text[s[0] : s[1]] != b.text:
            i = next((k for k, (x, y) in enumerate(zip(old, new, strict=False)) if x != y), min(len(old), len(new)))
            differ.append(f"{_where(doc)}: the {b.label}: line {i + 1} of the block differs from the re-derivation")
    return missing, differ


def differences(doc: Path, blocks: Sequence[Block]) -> list[str]:
    """One line per block of ``blocks`` that ``doc`` lacks or holds otherwise (empty: all match).

    Each line names the document, the block and, for a difference, its first differing line
    (1 = the begin marker)."""
    missing, differ = _compare(doc, blocks)
    return missing + differ


def write(doc: Path, blocks: Sequence[Block]) -> list[str]:
    """Replace every block of ``blocks`` in ``doc``; nothing is written when a block's markers
    are missing.

    Returns:
        one line per block whose markers ``doc`` lacks (empty: written)."""
    text = doc.read_text()
    missing = []
    for b in blocks:
        s = span(text, b.begin, b.end)
        if s is None:
            missing.append(f"{_where(doc)}: no generated block for the {b.label}; add the lines {b.begin} and {b.end}")
        else:
            text = text[: s[0]] + b.text + text[s[1] :]
    if not missing:
        doc.write_text(text)
    return missing


def main(
    argv: Sequence[str] | None,
    doc: Path,
    render: Callable[[], list[Block]],
    description: str,
    script: str,
    bare_writes: bool = False,
) -> int:
    """The command line of a report: ``--write`` / ``--check`` / print.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).
        doc: the document holding the blocks.
        render: the rendered blocks (called once).
        description: ``--help`` text.
        script: the report's path in the repository, for the fix in a ``--check`` message.
        bare_writes: with no flag, write (``bench/table23_report.py``'s usage) instead of printing.

    Returns:
        the exit code (see the module docstring).
    """
    ap = argparse.ArgumentParser(description=description)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"rewrite the generated blocks of {_where(doc)}")
    g.add_argument("--check", action="store_true", help=f"exit 1 if {_where(doc)} differs from the rendering")
    a = ap.parse_args(argv)
    blocks = render()
    if a.check:
        missing, differ = _compare(doc, blocks)
        for line in missing + differ:
            print(line, file=sys.stderr)
        if missing or differ:
            print(f"fix: python {script} --write (never edit the blocks by hand)", file=sys.stderr)
        return 2 if missing else (1 if differ else 0)
    if a.write or bare_writes:
        missing = write(doc, blocks)
        for line in missing:
            print(line, file=sys.stderr)
        return 2 if missing else 0
    print("\n\n".join(b.text for b in blocks))
    return 0
