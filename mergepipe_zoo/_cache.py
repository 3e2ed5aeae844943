"""One cached, file-locked, atomic build for the testbeds (zoo, MiniLM, vision).

A testbed is built once per configuration key into ``root/<key>`` and reused: the entry is
complete when its ``marker`` file exists (it is written last, inside the build). Concurrent
callers serialise on an exclusive ``fcntl`` lock on ``root/.<key>.lock``; the build runs in
``root/.<key>.tmp-<pid>``, is fsynced and renamed into place, so a killed build never leaves a
complete-looking entry (the next builder removes its temp folder). A build whose *gates* fail
(``gate_error``) leaves only ``root/.<key>.gates-failed.json``, so a second call raises at once
instead of training again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from mergepipe.storage.local import fsync_folder

__all__ = ["GateFailure", "cached_build", "fsync_tree"]


class GateFailure(Protocol):
    """An exception class whose instances carry the gate report (``report``) and that can be
    constructed again from ``(message, report)`` (e.g. :class:`mergepipe_zoo.vision.VisionGateError`)."""

    report: dict

    def __init__(self, msg: str, report: dict) -> None: ...


def fsync_tree(d: Path) -> None:
    """fsync every file and folder under ``d`` and ``d`` itself (before the rename publishes it).

    Raises:
        OSError: a file or folder cannot be opened or synced.
    """
    for p in sorted(d.rglob("*")):
        if p.is_dir():
            fsync_folder(p, strict=True)
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_folder(d, strict=True)


def cached_build(
    root: Path,
    key: str,
    marker: str,
    build_into: Callable[[Path], None],
    gate_error: type[GateFailure] | None = None,
) -> Path:
    """Return ``root/<key>``, building it with ``build_into(tmp)`` first unless ``root/<key>/<marker>``
    is a file.

    Algorithm: fast path without the lock when the marker exists; otherwise take the exclusive lock,
    check again (another process may have built it while we waited), raise a recorded gate failure,
    remove stale temp folders of killed builds, build into a fresh temp folder, fsync it, rename it
    to ``root/<key>`` and fsync ``root``. ``build_into`` must write ``marker`` last (the entry is
    complete exactly when it exists).

    Args:
        root: the cache root (created if missing); an absolute path.
        key: the entry's name (a configuration digest).
        marker: the file (relative to the entry) whose existence marks a complete entry.
        build_into: writes the whole entry into the given empty folder; raises to abort.
        gate_error: the exception type ``build_into`` raises when the build's gates fail: its
            message and ``report`` are recorded in ``root/.<key>.gates-failed.json`` and later
            calls raise it again (message suffixed "recorded earlier") without building.

    Returns:
        The entry folder ``root/<key>``.

    Raises:
        RuntimeError: ``root/<key>`` exists without its marker (a foreign or damaged entry: delete it).
        OSError: ``root`` is not writable.
        Whatever ``build_into`` raises (the temp folder is removed first).
    """
    entry = root / key
    if (entry / marker).is_file():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    failed = root / f".{key}.gates-failed.json"
    with open(root / f".{key}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if (entry / marker).is_file():  # another process built it while we waited
                return entry
            if entry.exists():
                raise RuntimeError(f"{entry} exists but has no {marker}; delete it to rebuild")
            if gate_error is not None and failed.is_file():
                try:
                    rec = json.loads(failed.read_text(encoding="utf-8"))
                    msg, rep = str(rec["message"]), rec["gates"]
                    if not isinstance(rep, dict):
                        raise TypeError("gates is not an object")
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise RuntimeError(f"{failed}: unreadable gate record ({e}); delete it to rebuild") from None
                raise gate_error(f"{msg} (recorded earlier in {failed.name})", rep)  # type: ignore[misc]
            for stale in root.glob(f".{key}.tmp-*"):  # left by killed builds (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".{key}.tmp-{os.getpid()}"
            tmp.mkdir()
            try:
                build_into(tmp)
                fsync_tree(tmp)
                os.rename(tmp, entry)
                fsync_folder(root, strict=True)
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if gate_error is not None and isinstance(e, gate_error):
                    rec = {"message": str(e), "gates": e.report}
                    failed.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
                raise
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return entry
