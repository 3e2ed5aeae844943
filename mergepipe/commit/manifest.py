"""Snapshot manifests, local atomic publish, and verification.

Local commit protocol (one filesystem, possibly shared between hosts, e.g. NFS):

1. Before any work, the output path is checked: it must not exist, be an empty folder, or hold
   a committed snapshot of the *same* plan (then the merge is already done: idempotent).
2. **Ownership.** A writer of ``<parent>/<name>`` holds an exclusive ``flock(2)`` on the lock file
   ``<parent>/.<name>.lock`` (see :class:`OutputLock`) from before it touches the staging folder
   until after the publish. The kernel (or, on NFS, the lock manager) releases the lock when the
   holder dies, whatever its host or PID namespace, so "the lock is free" is the proof that no
   live writer owns the staging folder. No decision depends on host names or PIDs (the lock
   file's text, ``host pid time``, is only quoted in messages). A second writer finds the lock
   held and stops at once (:class:`~mergepipe.errors.CommitConflict`, exit 2) before reading any
   tensor. Filesystems without locks are refused rather than written without ownership.
3. **Staging.** Under the lock, everything is written into the run folder
   ``<parent>/.<name>.run-plan-<hex>`` (a single-process merge is the one part of a run,
   :func:`mergepipe.parts.execute_single`; each file fsync'd, hashed and recorded as it is
   written, :mod:`mergepipe.commit.runs`). A run folder of the same plan found there when the
   lock is acquired is a dead writer's (nobody else can hold the locks): a rerun keeps its files
   whose bytes give their recorded digests, or rewrites them. (Versions before runs of one part
   staged in ``<parent>/.<name>.staging``, :func:`staging_path`, reclaimed by ``gc``.)
   Writers never create the staging folder implicitly
   (:class:`~mergepipe.storage.local.LocalWriter` refuses a missing folder), so a removed folder
   makes the run fail instead of being silently recreated half-empty.
4. **Publish** (:func:`publish_local`): every file the manifest lists must be in the staging
   folder with its recorded size, and nothing else may be there; then ``manifest.json`` is
   written last and fsync'd, the folder is renamed onto the output path (``rename(2)`` is atomic)
   and the parent folder fsync'd; then the lock is released (and its file removed).

A run killed at any moment leaves at most the hidden run folder, its records and the lock file
(never anything at the output path); the next run of the plan resumes from them, ``gc`` reclaims
an abandoned one. Readers treat a folder as a snapshot
only if it holds a ``manifest.json``, and ``verify`` re-hashes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from mergepipe.errors import CommitConflict, InputError
from mergepipe.formats.safetensors import parse_header
from mergepipe.limits import MAX_MANIFEST_BYTES, loads_json, read_file, short_repr
from mergepipe.paths import check_inside, name_problem
from mergepipe.storage.base import is_s3
from mergepipe.storage.local import fsync_folder, open_for_write, write_new_file

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
    if not p.exists():
        raise InputError(f"{folder}: no {MANIFEST_NAME}; this is not a committed mergepipe snapshot.")
    data = read_file(p, MAX_MANIFEST_BYTES, "manifest")
    m = loads_json(data, str(p), what="manifest")
    if not isinstance(m, dict):
        raise InputError(f"{p}: the manifest is not a JSON object; it is corrupt.")
    if m.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{p}: format {m.get('format')!r}, expected {MANIFEST_FORMAT!r}.")
    return m, manifest_hash(data)


def check_output(out: str | Path, plan_digest: str | None, inputs: Sequence[str] = ()) -> dict | None:
    """Validate the output path before any work; creates nothing.

    Args:
        plan_digest: the plan's digest, or None before planning (then any snapshot at ``out``
            is returned, for the caller to compare once it has a plan).
        inputs: the merge's checkpoint URIs (local ones are checked not to contain ``out``).

    Returns:
        The existing manifest when ``out`` already holds a snapshot of this plan, else None.

    Raises:
        InputError: ``out`` is a file, a symbolic link (dangling or not), a non-empty folder
            without a manifest, a snapshot of a different plan, inside an input checkpoint; its
            name (with the staging suffix) is longer than the filesystem allows or the path
            longer than PATH_MAX; or its nearest existing folder is not writable.
    """
    out = Path(out)
    parent = out.parent
    _check_out_name(out)  # first: a path too long for the filesystem fails every other check
    if out.is_symlink():
        raise InputError(
            f"--out {out}: is a symbolic link (to {os.readlink(out)}); give the real folder path "
            "(a link could be redirected between the checks and the publish)."
        )
    for u in inputs:
        if is_s3(u):
            continue
        src = os.path.realpath(u)
        dst = os.path.realpath(out)
        if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
            raise InputError(
                f"--out {out}: is inside the input checkpoint {u}; write the snapshot elsewhere "
                "(it would change the input while it is read)."
            )
    if out.exists():
        if not out.is_dir():
            raise InputError(f"--out {out}: is a file; give a folder path for the snapshot.")
        if (out / MANIFEST_NAME).exists():
            m, _ = read_manifest(out)
            if plan_digest is None or m.get("plan_digest") == plan_digest:
                return m
            raise InputError(
                f"--out {out}: already holds snapshot {m.get('snapshot_id')} of a different plan "
                f"({m.get('plan_digest', '')[:12]}); snapshots are immutable. Choose a new --out."
            )
        if any(out.iterdir()):
            raise InputError(f"--out {out}: folder exists and is not empty; choose a new path or empty it.")
    anc = parent
    while not anc.exists():  # nothing is created here: the nearest existing folder must allow it
        if anc.is_symlink():
            raise InputError(f"--out {out}: {anc} is a dangling symbolic link; choose a real folder path.")
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"--out {out}: {anc} is a file, not a folder; choose another --out.")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: folder {anc} is not writable; choose a writable path.")
    return None


def _check_out_name(out: Path) -> None:
    """Refuse an ``--out`` whose staging/lock names would not fit the filesystem's NAME_MAX or
    whose absolute path exceeds PATH_MAX, before anything is read or written."""
    absolute = os.path.abspath(out)
    try:
        path_max = os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        path_max = 4096
    if len(os.fsencode(absolute)) + len(STAGING_SUFFIX) + 1 >= path_max:
        raise InputError(
            f"--out {short_repr(str(out))}: the path is longer than this system's PATH_MAX ({path_max} "
            "bytes, with the staging suffix); choose a shorter path."
        )
    anc = out.parent
    while not anc.exists():
        anc = anc.parent
    try:
        name_max = os.pathconf(str(anc), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in Path(absolute).parts[1:]:
        longest = len(os.fsencode(part)) + (len(STAGING_SUFFIX) + 1 if part == out.name else 0)
        if longest > name_max:
            raise InputError(
                f"--out {short_repr(str(out))}: the name {short_repr(part, 40)} is too long for the "
                f"filesystem ({name_max} bytes, {len(STAGING_SUFFIX) + 1} of them taken by the hidden "
                "staging folder's prefix and suffix); choose a shorter name."
            )


def probe_lock(out: str | Path) -> None:
    """Fail fast, creating nothing, when a live writer holds ``out``'s :class:`OutputLock`.

    Raises:
        CommitConflict: the lock is held.
        InputError: the lock's name is a symbolic link (mergepipe never writes through one).
    """
    p = lock_path(out)
    if p.is_symlink():
        os.close(open_for_write(p, os.O_RDONLY, what="lock file"))  # raises the one-line refusal
    if lock_is_free(p):
        return
    raise CommitConflict(
        f"--out {out}: another mergepipe process is writing it (lock {p.name} held by {_lock_holder(p)}); wait "
        "for it to finish (a rerun then finds the snapshot) or choose another --out."
    )


def lock_is_free(path: str | Path) -> bool:
    """Whether nobody holds the ``flock`` of lock file ``path``, found without creating or
    changing anything (a shared, non-blocking lock on a read-only descriptor, dropped at once;
    a missing file or a symbolic link counts as free: nothing of ours is there).

    Returns:
        False when a live process holds it exclusively.
    """
    import fcntl

    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
    return True


LOCK_FORMAT = "mergepipe.lock/v1"


def _lock_holder(path: str | Path, fd: int | None = None) -> str:
    """``host pid N since T`` from a lock file's record (for messages only), or ``unknown``."""
    try:
        if fd is None:
            raw = read_file(Path(path), 4096, "lock file") if Path(path).is_file() else b""
        else:
            raw = os.pread(fd, 4096, 0)
        d = json.loads(raw)
        return f"{d['host']} pid {d['pid']} since {d['since']}"
    except Exception:  # noqa: BLE001 - an old or torn lock file: only quoted
        return "unknown"


def read_lock_record(path: str | Path) -> dict | None:
    """The JSON record of lock file ``path`` (format :data:`LOCK_FORMAT`, naming its ``out``
    canonically), or None when it is missing, a link, not a regular file or not such a record
    (a lock file of a mergepipe version before records: unproven)."""
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        d = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    ok = isinstance(d, dict) and d.get("format") == LOCK_FORMAT and isinstance(d.get("out"), str)
    return d if ok else None


LOCK_SUFFIX = ".lock"
STAGING_SUFFIX = ".staging"


def lock_path(out: str | Path) -> Path:
    """The lock file of output folder ``out``: ``<parent>/.<name>.lock``."""
    out = Path(out)
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def staging_path(out: str | Path) -> Path:
    """The staging folder of output folder ``out``: ``<parent>/.<name>.staging``."""
    out = Path(out)
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


class OutputLock:
    """Exclusive ownership of one local output path (its staging folder and its publish).

    ``acquire()`` opens (creating if needed, never through a symbolic link) ``<parent>/.<name>.lock``,
    takes a non-blocking exclusive ``flock`` and checks that the path still names the locked
    file (a releasing holder unlinks it), retrying otherwise; then it writes its record (JSON,
    :data:`LOCK_FORMAT`: the canonical ``out``, host, pid, start time), quoted in messages and
    read by ``gc`` as the proof that the file is mergepipe's. ``release()`` unlinks the file and
    then unlocks it. Use as a context manager.

    Raises (from ``acquire``):
        CommitConflict: another live process holds the lock (the message quotes its
            ``host pid start-time`` record).
        InputError: the filesystem does not support ``flock`` (ownership could not be proven),
            or the lock's name is a symbolic link or not a regular file.
    """

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = lock_path(out)
        self.fd: int | None = None

    def acquire(self) -> OutputLock:
        import fcntl

        from mergepipe.commit.ownership import canonical_out

        for _ in range(100):
            try:  # never through a link planted at the lock's name
                fd = open_for_write(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, what="lock file")
            except OSError as e:
                raise InputError(f"--out {self.out}: cannot open the lock file {self.path} ({e.strerror}).") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    who = _lock_holder(self.path, fd)
                finally:
                    os.close(fd)
                raise CommitConflict(
                    f"--out {self.out}: another mergepipe process is writing it (lock {self.path.name} held by "
                    f"{who}); wait for it to finish (a rerun then finds the snapshot) or choose another --out."
                ) from None
            except OSError as e:
                os.close(fd)
                raise InputError(
                    f"--out {self.out}: the filesystem does not support file locks ({e.strerror}), so mergepipe "
                    "cannot prove it is the only writer; write to a local or NFS folder, or to s3://."
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(str(self.path)).st_ino
            except FileNotFoundError:
                same = False
            if same:
                rec = {
                    "format": LOCK_FORMAT,
                    "out": canonical_out(str(self.out)),
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                data = (json.dumps(rec, sort_keys=True) + "\n").encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                self.fd = fd
                return self
            os.close(fd)  # the holder released and unlinked it between our open and flock: retry
        raise CommitConflict(f"--out {self.out}: could not take lock {self.path} (it keeps changing).")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_staged_files(staging: Path, outputs: dict) -> None:
    """Before publishing: every file ``outputs`` lists (name -> ``{"size", ...}``) is a regular
    file in ``staging`` with its recorded size, and nothing else is there.

    Raises:
        CommitConflict: a file is missing, has another size, or an unlisted file is present
            (the staging folder was tampered with or removed); nothing is published.
    """
    from mergepipe.paths import check_name

    problems = []
    for name, info in sorted(outputs.items()):
        check_name(name, "manifest outputs")
        p = staging / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{name}: not a regular file")
        elif st.st_size != info["size"]:
            problems.append(f"{name}: size {st.st_size} != {info['size']} written")
    listed = set(outputs)
    for dp, _dns, fns in os.walk(staging):
        for fn in fns:
            rel = Path(dp, fn).relative_to(staging).as_posix()
            if rel not in listed:
                problems.append(f"{rel}: not written by this run")
    if problems:
        raise CommitConflict(
            f"staging folder {staging} does not hold what this run wrote ({'; '.join(problems[:5])}); "
            "it was changed by someone else. Nothing was published; rerun the merge."
        )


def publish_local(staging: Path, out: str | Path, manifest: dict, lock: OutputLock | None = None) -> str:
    """Check the staged files against ``manifest["outputs"]`` (:func:`check_staged_files`),
    write the manifest into ``staging`` and rename it onto ``out`` atomically. ``lock`` (the
    :class:`OutputLock` of ``out``, held) must still be ours.

    Returns:
        The manifest hash.

    Raises:
        CommitConflict: the staged files differ from the manifest, or ``out`` appeared
            meanwhile with other content.
    """
    out = Path(out)
    if lock is not None and lock.fd is None:
        raise RuntimeError("publish_local needs the output lock held")
    check_staged_files(staging, manifest["outputs"])
    data = manifest_bytes(manifest)
    write_new_file(staging / MANIFEST_NAME, data, what="manifest")
    fsync_folder(staging, strict=True)
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
    try:
        os.rename(staging, out)
    except OSError as e:
        raise CommitConflict(f"--out {out}: could not publish ({e.strerror}); another writer created it.") from None
    fsync_folder(out.parent, strict=True)
    return manifest_hash(data)


def verify_snapshot(folder: str | Path) -> dict:  # noqa: C901 - one check per way a stored snapshot can differ from its manifest, each with its own problem line
    """Re-hash every file of a local snapshot against its manifest.

    Returns:
        ``{"ok": bool, "snapshot_id", "manifest_hash", "files": n, "problems": [str]}``.
    """
    folder = Path(folder)
    m, mh = read_manifest(folder)
    problems = []
    listed = m.get("outputs", {})
    if not isinstance(listed, dict):
        raise InputError(f"{folder / MANIFEST_NAME}: outputs must be an object; the manifest is corrupt.")
    for name, info in sorted(listed.items()):
        why = name_problem(name)
        if why is None:
            try:  # the name may not lead out of the snapshot through a symlink either
                check_inside(str(folder), str(folder / name), str(folder))
            except InputError:
                why = "resolves outside the snapshot through a symbolic link"
        if why is not None:
            problems.append(f"{short_repr(name)}: output name {why}")
            continue
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
    return {
        "ok": not problems,
        "snapshot_id": m.get("snapshot_id"),
        "manifest_hash": mh,
        "files": len(listed),
        "problems": problems,
    }
