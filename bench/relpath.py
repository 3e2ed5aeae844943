"""Paths as the benchmark results record them: relative to the repository, never the absolute
paths of the machine a benchmark ran on (result files and summaries are committed under docs/)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _roots() -> list[tuple[str, str]]:
    """(absolute folder, what replaces it): the repository first (it may lie under the home
    folder), then the home folder; each as given and resolved."""
    home = Path.home()
    pairs = [(REPO, ""), (REPO.absolute(), ""), (home.resolve(), "~/"), (home, "~/")]
    seen, out = set(), []
    for root, repl in pairs:
        s = str(root).rstrip("/")
        if s and s not in seen:
            seen.add(s)
            out.append((s, repl))
    return out


def rel_text(text: str) -> str:
    """``text`` with every absolute path inside the repository made repository-relative
    (``/…/repo/bench/.work`` → ``bench/.work``) and every one under the home folder shown as
    ``~/…``; other text unchanged. Works on a path, a command line or a YAML document."""
    for root, repl in _roots():
        before = rf"(?<![\w.~/-]){re.escape(root)}"
        text = re.sub(before + "/", repl, text)
        text = re.sub(before + r"(?![\w.~/-])", repl.rstrip("/") or ".", text)
    return text


def rel_path(p: str | os.PathLike[str]) -> str:
    """The path ``p`` as a result file records it (see :func:`rel_text`)."""
    return rel_text(os.fspath(p))


def rel_argv(argv: Sequence[str]) -> list[str]:
    """A command line as a result file records it (see :func:`rel_text`)."""
    return [rel_text(a) for a in argv]


def rel_paths_in(obj: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, strings, numbers) with every string passed
    through :func:`rel_text` (command lines, ``--json`` results' URIs, notes)."""
    if isinstance(obj, dict):
        return {k: rel_paths_in(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rel_paths_in(v) for v in obj]
    if isinstance(obj, str):
        return rel_text(obj)
    return obj
