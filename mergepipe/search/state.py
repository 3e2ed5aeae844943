"""Search state: one JSON file (``<out>/state.json``) rewritten atomically after every event
(temporary file, fsync, rename), so an interrupted search loses at most the work in flight.

Layout::

    {"format": "mergepipe.search/v1", "search_id": ..., "config": {...}, "space": {...},
     "prior": {...} | null, "ref_point": [...] | null, "evaluator": {...} | null,
     "candidates": [{id, x, params, phase, status, worker, snapshot, metrics, objectives,
                     error, proposal, times: {proposed, started, merged, ended}}, ...],
     "events": [{worker, kind, cand, t0, t1}, ...], "sessions": [{started, resumed}]}

Candidate ``status``: ``queued`` (proposed, not started), ``running``, ``done``, ``failed``.
On ``--resume`` the ``running`` and ``queued`` ones go back to ``queued`` with the same point and
are dispatched first; ``done`` and ``failed`` ones are kept. Times are Unix seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from mergepipe.errors import InputError

STATE_FORMAT = "mergepipe.search/v1"
STATE_NAME = "state.json"


def save_state(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (tmp + fsync + rename + directory fsync)."""
    from mergepipe.storage.local import replace_file

    replace_file(Path(path), json.dumps(state, indent=1, sort_keys=True).encode(), what="search state", durable=True)


def load_state(path: Path) -> dict:
    """Read a search state.

    Raises:
        InputError: missing, unreadable or not a search state.
    """
    path = Path(path)
    try:
        st = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no search state to resume; start the search without --resume.") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable search state ({e}).") from None
    if not isinstance(st, dict) or st.get("format") != STATE_FORMAT:
        raise InputError(
            f"{path}: not a mergepipe search state (format {st.get('format') if isinstance(st, dict) else '?'!r})."
        )
    return st
