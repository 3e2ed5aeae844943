"""Snapshot manifests, local atomic publish, and verification.

Local commit protocol (one filesystem):

1. Before any work, the output path is checked: it must not exist, be an empty folder, or hold
   a committed snapshot of the *same* plan (then the merge is already done: idempotent).
2. Everything is written under a hidden staging folder beside the output,
   ``.<name>.staging-<uuid>`` (with an ``.owner`` file naming the writing process), each file
   fsync'd and hashed (SHA-256) as it is written.
3. ``manifest.json`` is written last into the staging folder and fsync'd, then the folder is
   renamed onto the output path (``rename(2)`` is atomic) and the parent folder fsync'd.

A run killed at any moment leaves at most a hidden staging folder (never anything at the
output path); the next run removes staging folders whose owner process is gone. Readers treat
a folder as a snapshot only if it holds a ``manifest.json``, and ``verify`` re-hashes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import uuid
from pathlib import Path

from mergepipe.errors import CommitConflict, InputError
from mergepipe.formats.safetensors import parse_header

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "mergepipe.manifest/v1"


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def content_key(info: dict) -> str:
    """What identifies an output file's content: its tree digest (shards) or its SHA-256."""
    return info.get("tree_sha256") or info["sha256"]


def snapshot_id(plan_digest: str, outputs: dict) -> str:
    """Content-addressed snapshot id: ``snap-`` + 16 hex of SHA-256 over the plan digest and
    each output file's size and content key (:func:`content_key`), so a snapshot written with
    server-side copies has the same id as the same bytes written locally."""
    keyed = {n: {"size": i["size"], "digest": content_key(i)} for n, i in outputs.items()}
    return "snap-" + hashlib.sha256(canonical({"plan": plan_digest, "outputs": keyed})).hexdigest()[:16]


def shard_tree_digest(read_range, size: int, name: str) -> str:
    """Recompute a safetensors shard's tree digest (see :func:`mergepipe.engine.writer.tree_digest`)
    from ``read_range(start, end) -> bytes``."""
    n = struct.unpack("<Q", read_range(0, 8))[0]
    raw = read_range(0, 8 + n)
    hdr = parse_header(raw, name, size)
    tensors = []
    for t in sorted(hdr.tensors.values(), key=lambda t: t.start):
        h = hashlib.sha256()
        for s in range(t.start, t.end, 16 << 20):
            h.update(read_range(s, min(t.end, s + (16 << 20))))
        tensors.append([t.name, h.hexdigest()])
    tree = {"header_sha256": hashlib.sha256(raw).hexdigest(), "tensors": tensors}
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def manifest_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(folder: str | Path) -> tuple[dict, str]:
    """Load ``manifest.json`` of a local snapshot; returns (manifest, manifest hash).

    Raises:
        InputError: no manifest (not a committed snapshot) or invalid JSON.
    """
    p = Path(folder) / MANIFEST_NAME
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{folder}: no {MANIFEST_NAME}; this is not a committed mergepipe snapshot.") from None
    try:
        m = json.loads(data)
    except json.JSONDecodeError as e:
        raise InputError(f"{p}: invalid JSON ({e}); the manifest is corrupt.") from None
    if m.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{p}: format {m.get('format')!r}, expected {MANIFEST_FORMAT!r}.")
    return m, manifest_hash(data)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def check_output(out: str | Path, plan_digest: str) -> dict | None:
    """Validate the output path before any work.

    Returns:
        The existing manifest when ``out`` already holds a snapshot of this plan, else None.

    Raises:
        InputError: ``out`` is a file, a non-empty folder without a manifest, a snapshot of a
            different plan, or its parent is not writable.
    """
    out = Path(out)
    parent = out.parent
    if out.exists():
        if not out.is_dir():
            raise InputError(f"--out {out}: is a file; give a folder path for the snapshot.")
        if (out / MANIFEST_NAME).exists():
            m, _ = read_manifest(out)
            if m.get("plan_digest") == plan_digest:
                return m
            raise InputError(
                f"--out {out}: already holds snapshot {m.get('snapshot_id')} of a different plan "
                f"({m.get('plan_digest', '')[:12]}); snapshots are immutable. Choose a new --out."
            )
        if any(out.iterdir()):
            raise InputError(f"--out {out}: folder exists and is not empty; choose a new path or empty it.")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out}: cannot create parent folder ({e.strerror}).") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: parent folder {parent} is not writable; choose a writable path.")
    return None


def clean_stale_staging(out: str | Path) -> list[Path]:
    """Remove staging folders of ``out`` whose owner process (on this host) is gone."""
    out = Path(out)
    removed = []
    for p in out.parent.glob(f".{out.name}.staging-*"):
        owner = p / ".owner"
        try:
            host, pid = owner.read_text().split()
            alive = host == socket.gethostname() and _pid_alive(int(pid))
        except (OSError, ValueError):
            alive = False
        if not alive:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def new_staging(out: str | Path) -> Path:
    out = Path(out)
    st = out.parent / f".{out.name}.staging-{uuid.uuid4().hex[:12]}"
    st.mkdir(parents=True)
    (st / ".owner").write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return st


def _fsync_dir(p: Path) -> None:
    fd = os.open(str(p), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_local(staging: Path, out: str | Path, manifest: dict) -> str:
    """Write the manifest into ``staging`` and rename it onto ``out`` atomically.

    Returns:
        The manifest hash.

    Raises:
        CommitConflict: ``out`` appeared meanwhile with other content.
    """
    out = Path(out)
    data = manifest_bytes(manifest)
    fd = os.open(str(staging / MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    (staging / ".owner").unlink(missing_ok=True)
    _fsync_dir(staging)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    try:
        os.rename(staging, out)
    except OSError as e:
        raise CommitConflict(f"--out {out}: could not publish ({e.strerror}); another writer created it.") from None
    _fsync_dir(out.parent)
    return manifest_hash(data)


def verify_snapshot(folder: str | Path) -> dict:
    """Re-hash every file of a local snapshot against its manifest.

    Returns:
        ``{"ok": bool, "snapshot_id", "manifest_hash", "files": n, "problems": [str]}``.
    """
    folder = Path(folder)
    m, mh = read_manifest(folder)
    problems = []
    listed = m.get("outputs", {})
    for name, info in sorted(listed.items()):
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing")
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        if p.stat().st_size != info["size"]:
            problems.append(f"{name}: size {p.stat().st_size} != {info['size']}")
        elif "sha256" in info and h.hexdigest() != info["sha256"]:
            problems.append(f"{name}: sha256 mismatch")
        elif "tree_sha256" in info:
            with open(p, "rb") as f:
                def rr(a, b, f=f):
                    f.seek(a)
                    return f.read(b - a)
                try:
                    ok = shard_tree_digest(rr, info["size"], name) == info["tree_sha256"]
                except Exception:
                    ok = False
            if not ok:
                problems.append(f"{name}: tree digest mismatch")
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != MANIFEST_NAME and rel not in listed:
            problems.append(f"{rel}: not listed in the manifest")
    if snapshot_id(m.get("plan_digest", ""), listed) != m.get("snapshot_id"):
        problems.append("snapshot_id does not match the plan digest and outputs")
    return {"ok": not problems, "snapshot_id": m.get("snapshot_id"), "manifest_hash": mh,
            "files": len(listed), "problems": problems}
