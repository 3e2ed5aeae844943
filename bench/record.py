"""A benchmark's raw record: where and when it was measured, and one JSON line per run appended
to a file that is committed under docs/benchmarks/ and rendered into the docs from there
(``bench/benchmarks_report.py``).

Used by ``bench/sketch_decode.py`` and ``bench/merge_tile.py`` (``--out FILE``); :func:`git_rev`
and :func:`committed` also by ``bench/search.py`` and ``bench/quality.py``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.relpath import rel_argv  # noqa: E402


def git_rev() -> str:
    """The commit the benchmark runs at: ``MERGEPIPE_BENCH_REV`` when set (a run from an exported
    tree), else ``git rev-parse HEAD``, with ``+dirty`` when tracked files under ``mergepipe/``,
    ``mergepipe_zoo/`` (the testbeds) or ``bench/`` differ from it; ``"unknown"`` outside a git
    checkout."""
    env = os.environ.get("MERGEPIPE_BENCH_REV")
    if env:
        return env
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if r.returncode != 0:
        return "unknown"
    d = subprocess.run(
        [
            "git",
            "-C",
            str(REPO),
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            "mergepipe",
            "mergepipe_zoo",
            "bench",
        ],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() + ("+dirty" if d.stdout.strip() else "")


def committed(path: Path, fix: str, root: Path = REPO) -> tuple[str, str]:
    """(``path`` relative to ``root``, the last commit that changed it) for a file a run must
    not start without having committed unchanged (a pre-registration, an amendment).

    Raises:
        SystemExit: the file has uncommitted changes, is not committed, or is outside the
            checkout; the message names it and ends with ``fix``.
    """
    try:
        rel = str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        raise SystemExit(f"{path}: not in the checkout {root}; {fix}.") from None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", rel], capture_output=True, text=True)
    commit = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%H", "--", rel], capture_output=True, text=True
    ).stdout.strip()
    if dirty.returncode or dirty.stdout.strip() or not commit:
        raise SystemExit(f"{rel}: not committed (or changed since); {fix}.")
    return rel, commit


def command(script: str, argv: Sequence[str]) -> list[str]:
    """``[script, *argv]`` as a record keeps it: ``--out`` and its value dropped (where the record
    went is not a condition of the measurement, and a scratch path is this machine's), paths in
    the repository or the home folder made relative (:func:`bench.relpath.rel_argv`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return rel_argv([script, *out])


def provenance(script: str, argv: Sequence[str]) -> dict:
    """``{"git", "date_utc", "command"}`` of a run: the commit (:func:`git_rev`), the UTC time
    the run ended (ISO 8601, seconds) and its command line (:func:`command`)."""
    return {
        "git": git_rev(),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command(script, argv),
    }


def append_jsonl(path: Path, rec: dict) -> None:
    """Append ``rec`` to ``path`` as one JSON line (the file and its folder created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
