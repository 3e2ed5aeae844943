"""Garbage collection of what failed or killed merges leave behind (``mergepipe gc``).

A merge never leaves anything a reader could take for a snapshot, but it may leave debris: a
killed writer's staging folder or run (files and records), its lock file, and on object storage
multipart uploads that were never completed or aborted (S3 bills both).

**gc deletes only what carries proof that it is mergepipe's garbage**, never by the shape of a
name. Every area a merge writes is created with an *ownership record* written before any data
(:mod:`mergepipe.commit.ownership`: kind, owner ``out`` canonical, run id, plan digest, start
time, version, format tag). :func:`collect` acts on an area only when all of this holds:

1. its record parses (strict model, format tag) and lies exactly where its own content says
   (``<area>.owner.json`` of the area computed from its kind, ``out`` and run id): a record
   copied elsewhere, or a folder merely named like a run, proves nothing;
2. its owner ``out`` is the canonical root or lies under it (``gc .`` and ``gc /abs/path`` are
   the same root; ``gc snaps/a`` never touches the debris of a sibling ``snaps/a.b``);
3. it is not under a committed snapshot (a folder/prefix holding a ``manifest.json`` other than
   its own ``out``), holds none, and is not the run ``out``'s manifest references;
4. it is not in use: a ``staging`` area only when ``out``'s lock is free (the kernel releases it
   when its writer dies; no grace needed); a run (``run-folder``/``run-prefix``) only when its
   newest file/object is older than ``grace`` and, locally, ``out``'s lock and every part lock
   are free (taken while deleting, so neither a commit nor a part can start meanwhile); on object
   storage, only after the claim/intent handshake with a commit
   (:func:`mergepipe.commit.ownership.claim_for_gc`) and a fresh read of the manifest.

It also removes a lock file that carries a lock record naming its ``out`` (JSON,
:data:`mergepipe.commit.manifest.LOCK_FORMAT`), when free, older than ``grace`` and without a
staging area; and aborts a multipart upload initiated more than ``grace`` ago whose key lies in
a proven area or in the run a committed manifest references.

Everything else is kept. Debris that has the shape of mergepipe's names but no valid record (left
by mergepipe versions before records, or someone else's objects) is reported as **unproven**
(``GcReport.unproven``) and never deleted: remove it by hand once you know whose it is.

``--dry-run`` changes nothing: it takes no lock that creates or rewrites a file (a free lock
is probed with a shared lock on a read-only descriptor, dropped at once), writes no claim and
deletes nothing. ``grace`` must exceed the longest merge (a run area is written for the whole
merge before a manifest references it); the default is 24 hours.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from mergepipe.commit import ownership
from mergepipe.commit.manifest import (
    LOCK_SUFFIX,
    MANIFEST_NAME,
    OutputLock,
    lock_is_free,
    lock_path,
    read_lock_record,
)
from mergepipe.errors import CommitConflict, InputError
from mergepipe.storage.base import NotFoundError, Storage, is_s3

#: default grace period (seconds): younger debris may belong to a running merge
DEFAULT_GRACE_S = 24 * 3600.0

#: name shapes of earlier mergepipe versions' debris (reported as unproven when no record proves it)
_RUN_SHAPE = re.compile(r"(?:^|/)runs/(?:plan-)?[0-9a-f]{16}(?:\.records)?(?:/|$)")
_LOCAL_SHAPE = re.compile(r"^\..+(?:\.staging|\.staging-[0-9a-f]{12}|\.run-.+|\.lock)$")


@dataclass
class GcReport:
    """What :func:`collect` removed (or, with ``dry_run``, would remove) and what it kept, as
    canonical URIs/paths.

    Attributes:
        deleted_runs: run areas removed (files, records and ownership record).
        aborted_uploads: multipart uploads aborted (``uri (upload id)``).
        removed_staging: staging areas of dead writers removed.
        removed_locks: lock files removed.
        kept_in_use: proven garbage candidates whose lock, part lock or commit intent is held.
        kept_young: proven runs (or uploads) younger than ``grace``.
        kept_committed: proven areas under or holding a committed snapshot, or whose owner's
            manifest could not be read.
        unproven: debris shaped like mergepipe's without a valid ownership record (kept).
    """

    root: str
    grace_s: float
    dry_run: bool
    deleted_runs: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)
    removed_staging: list[str] = field(default_factory=list)
    removed_locks: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    kept_young: list[str] = field(default_factory=list)
    kept_committed: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@dataclass
class _Site:
    """One root's listing: every file/object (and, locally, folder) with its modification time,
    the folders holding a manifest, and the manifests read so far."""

    storage: Storage
    root: str
    s3: bool
    entries: dict[str, float] = field(default_factory=dict)
    manifests: set[str] = field(default_factory=set)
    _read: dict[str, Any] = field(default_factory=dict)

    def newest(self, *areas: str) -> float:
        best = 0.0
        for uri, mt in self.entries.items():
            if any(_under(uri, a) for a in areas):
                best = max(best, mt)
        return best

    def manifest(self, out: str) -> dict | None:
        """``out``'s manifest; raises InputError/OSError when unreadable; None when absent."""
        from mergepipe.commit.objectstore import read_manifest_obj

        if out not in self._read:
            got = read_manifest_obj(self.storage, out)
            self._read[out] = got[0] if got else None
        return self._read[out]


def collect(
    storage: Storage,
    root: str,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
    log: Callable[[str], None] | None = None,
) -> GcReport:
    """Remove mergepipe's proven debris under ``root`` (see the module docstring).

    Args:
        storage: a storage that can reach ``root`` (local folder or ``s3://`` prefix).
        root: a snapshot's ``--out`` or a folder/prefix holding several (canonicalised first).
        grace_s: seconds; younger runs are kept (they may belong to a running merge).
        dry_run: report what would be removed; change nothing.
        now: the current time (seconds since the epoch; tests).

    Raises:
        InputError: ``grace_s`` negative or not finite, or a local ``root`` that is not a folder.
    """
    if not math.isfinite(grace_s) or grace_s < 0:
        raise InputError(f"--grace {grace_s}: must be a non-negative number of seconds.")
    now = time.time() if now is None else now
    s3 = is_s3(root)
    if not s3 and not os.path.isdir(root):
        raise InputError(f"{root}: not a folder; give a snapshot's --out or a folder of snapshots.")
    site = _Site(storage, os.path.realpath(root) if not s3 else ownership.canonical_out(root), s3)
    rep = GcReport(root=site.root, grace_s=grace_s, dry_run=dry_run)
    say = log or (lambda m: None)
    _list(site)
    proven: list[ownership.OwnerRecord] = []
    for uri in sorted(u for u in site.entries if u.endswith(ownership.OWNER_SUFFIX)):
        rec = _proven_record(site, uri, rep)
        if rec is not None:
            proven.append(rec)
            _collect_area(site, rec, rep, now, say)
    if not s3:
        _collect_locks(site, proven, rep, now, say)
    _report_unproven(site, proven, rep)
    if s3:
        _abort_uploads(site, proven, rep, now, say)
    return rep


def _s3_pages(s3: Any, op: str, uri: str, **kw: Any) -> Iterator[dict]:
    """The pages of the paginated S3 listing ``op``; a failure of the store (missing bucket,
    refused credentials, unreachable endpoint) is the storage layer's one-line
    :class:`~mergepipe.storage.s3.S3Error` naming ``uri`` and the fix, not a botocore traceback."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield from s3.client.get_paginator(op).paginate(**kw)
    except (BotoCoreError, ClientError) as e:
        raise s3._error(e, uri, op) from None


def _list(site: _Site) -> None:
    """Fill ``site.entries`` (files/objects under the root and, locally, the root's own hidden
    siblings ``.<name>.*``) and ``site.manifests`` (folders holding a manifest, the root's
    ancestors included)."""
    if site.s3:
        from mergepipe.storage.s3 import split_uri

        s3: Any = getattr(site.storage, "s3", site.storage)
        bucket, key = split_uri(site.root)
        pre = key.rstrip("/") + "/" if key else ""
        for page in _s3_pages(s3, "list_objects_v2", site.root, Bucket=bucket, Prefix=pre):
            for o in page.get("Contents", ()) or ():
                site.entries[f"s3://{bucket}/{o['Key']}"] = o["LastModified"].timestamp()
        parts = key.strip("/").split("/") if key.strip("/") else []
        for i in range(len(parts)):
            anc = f"s3://{bucket}/" + "/".join(parts[:i])
            if site.storage.exists(anc.rstrip("/") + "/" + MANIFEST_NAME):
                site.manifests.add(anc.rstrip("/"))
    else:
        _walk_into(site, site.root)
        parent, name = os.path.split(site.root)
        try:
            beside = [e for e in os.scandir(parent) if e.name.startswith(f".{name}.")]
        except OSError:
            beside = []
        for e in beside:
            if e.is_dir(follow_symlinks=False):
                _walk_into(site, e.path)
            else:
                _add_lstat(site, e.path)
        anc = parent
        while True:
            if os.path.isfile(os.path.join(anc, MANIFEST_NAME)):
                site.manifests.add(anc)
            up = os.path.dirname(anc)
            if up == anc:
                break
            anc = up
    for uri in site.entries:
        if uri.rsplit("/", 1)[-1] == MANIFEST_NAME:
            site.manifests.add(uri.rsplit("/", 1)[0])


def _add_lstat(site: _Site, path: str) -> None:
    try:
        site.entries[path] = os.lstat(path).st_mtime
    except FileNotFoundError:
        pass


def _walk_into(site: _Site, top: str) -> None:
    _add_lstat(site, top)
    for dp, dns, fns in os.walk(top):  # never follows symbolic links
        for n in [*dns, *fns]:
            _add_lstat(site, os.path.join(dp, n))


def _read_local_record(path: str) -> bytes:
    """A local record's bytes, never through a symbolic link, at most the record cap."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file")
        if st.st_size > ownership.MAX_OWNER_BYTES:
            raise InputError(f"{path}: {st.st_size} bytes, larger than an ownership record")
        return os.pread(fd, ownership.MAX_OWNER_BYTES, 0)
    finally:
        os.close(fd)


def _proven_record(site: _Site, uri: str, rep: GcReport) -> ownership.OwnerRecord | None:
    """The record at ``uri`` when it proves an area in scope (conditions 1 and 2); else None,
    with the reason in ``rep.unproven``."""
    try:
        if site.s3:
            rec = ownership.read_record(site.storage, uri)
        else:
            rec = ownership.parse_record(_read_local_record(uri), uri)
    except NotFoundError:
        return None
    except (InputError, OSError) as e:
        rep.unproven.append(f"{uri} (invalid ownership record: {e})")
        return None
    if rec.record_uri() != uri:
        rep.unproven.append(f"{uri} (record names {rec.record_uri()}, not this location)")
        return None
    if not _under(rec.out, site.root):
        rep.unproven.append(f"{uri} (owner {rec.out} is outside {site.root})")
        return None
    return rec


def _protection(site: _Site, rec: ownership.OwnerRecord) -> str | None:
    """Why the area of ``rec`` must be kept whatever its age (condition 3), or None; "" when it
    is the live run of a committed snapshot (kept silently)."""
    area = rec.area()
    for f in sorted(site.manifests):
        if f != rec.out and _under(area, f):
            return f"under the committed snapshot {f}"
        if _under(f, area):
            return f"holds the committed snapshot {f}"
    if rec.out in site.manifests or (not site.s3 and os.path.isfile(os.path.join(rec.out, MANIFEST_NAME))):
        try:
            m = site.manifest(rec.out)
        except (InputError, OSError) as e:
            return f"the manifest of {rec.out} cannot be read ({e})"
        prefix = str((m or {}).get("files_prefix") or "")
        if m is not None and prefix and _under(area, f"{rec.out}/{prefix}"):
            return ""
    return None


def _collect_area(site: _Site, rec: ownership.OwnerRecord, rep: GcReport, now: float, say) -> None:
    area, records = rec.area(), rec.records()
    why = _protection(site, rec)
    if why == "":
        return
    if why is not None:
        rep.kept_committed.append(f"{area} ({why})")
        return
    marks = [area + s for s in (ownership.OWNER_SUFFIX, ownership.INTENT_SUFFIX, ownership.CLAIM_SUFFIX)]
    if rec.kind != "staging" and now - site.newest(area, *([records] if records else []), *marks) < rep.grace_s:
        rep.kept_young.append(area)
        return
    with ExitStack() as held:
        if not _exclude(site, rec, rep, now, held):
            rep.kept_in_use.append(area)
            return
        verb = "would remove" if rep.dry_run else "removing"
        what = "dead writer's staging folder" if rec.kind == "staging" else "abandoned run"
        say(f"{verb} {what} {area} (owner {rec.out}, plan {rec.plan_digest[:12]})")
        if not rep.dry_run:
            for a in [area, records]:
                if a is not None:
                    _remove(site, a)
            for suffix in (ownership.INTENT_SUFFIX, ownership.OWNER_SUFFIX, ownership.CLAIM_SUFFIX):
                _remove(site, area + suffix)
        (rep.removed_staging if rec.kind == "staging" else rep.deleted_runs).append(area)


def _exclude(site: _Site, rec: ownership.OwnerRecord, rep: GcReport, now: float, held: ExitStack) -> bool:
    """Make sure no writer or commit uses ``rec``'s area for as long as ``held`` is open
    (condition 4); False when one does. A dry run only probes."""
    area, records = rec.area(), rec.records()
    if rec.kind in ("staging", "run-folder"):
        if rep.dry_run:
            if not lock_is_free(lock_path(rec.out)):
                return False
        else:
            try:
                lock = OutputLock(rec.out).acquire()
            except (CommitConflict, InputError):
                return False
            held.callback(lock.release)
    if records and not site.s3 and os.path.isdir(records):
        for p in sorted(os.listdir(records)):
            if re.fullmatch(r"part-\d+-of-\d+\.lock", p) and not _hold_part_lock(
                os.path.join(records, p), rep.dry_run, held
            ):
                return False
    if rec.kind == "run-prefix":
        if rep.dry_run:
            age = ownership._age(site.storage, area + ownership.INTENT_SUFFIX, now)
            return age is None or age >= ownership.INTENT_TTL_S
        if not ownership.claim_for_gc(site.storage, area, now):
            return False
        site._read.pop(rec.out, None)  # re-read: a commit may have published meanwhile
        if _protection(site, rec) is not None or _fresh_manifest_references(site, rec):
            ownership.release_claim(site.storage, area)
            return False
    return True


def _fresh_manifest_references(site: _Site, rec: ownership.OwnerRecord) -> bool:
    try:
        m = site.manifest(rec.out)
    except (InputError, OSError):
        return True
    prefix = str((m or {}).get("files_prefix") or "")
    return m is not None and bool(prefix) and _under(rec.area(), f"{rec.out}/{prefix}")


def _hold_part_lock(path: str, dry_run: bool, held: ExitStack) -> bool:
    import fcntl

    if dry_run:
        return lock_is_free(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True  # gone, or a link: nothing of a live part
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    held.callback(os.close, fd)  # held until the run is removed: no part starts meanwhile
    return True


def _remove(site: _Site, uri: str) -> None:
    """Delete a file/folder (never following a link: a link is removed, not its target) or an
    object/prefix."""
    if site.s3:
        site.storage.delete(uri)
        site.storage.delete(uri.rstrip("/") + "/")
        return
    try:
        st = os.lstat(uri)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(uri, ignore_errors=True)
    else:
        try:
            os.unlink(uri)
        except FileNotFoundError:
            pass


def _collect_locks(site: _Site, proven: list[ownership.OwnerRecord], rep: GcReport, now: float, say) -> None:
    """Remove lock files proven by their lock record, free, older than ``grace`` and without a
    staging area (one with a staging area went with it, or is kept with it)."""
    for path in sorted(u for u in site.entries if u.endswith(LOCK_SUFFIX) and os.path.basename(u).startswith(".")):
        if path in rep.removed_locks or not os.path.lexists(path):
            continue
        d = read_lock_record(path)
        if d is None:
            continue  # unproven: reported by _report_unproven
        out = d["out"]
        if str(lock_path(out)) != path or not _under(out, site.root):
            continue
        if os.path.lexists(ownership.area_of("staging", out, None)):
            continue
        if now - site.entries[path] < rep.grace_s:
            rep.kept_young.append(path)
            continue
        if rep.dry_run:
            if not lock_is_free(path):
                rep.kept_in_use.append(path)
                continue
        else:
            try:
                lock = OutputLock(out).acquire()
            except (CommitConflict, InputError):
                rep.kept_in_use.append(path)
                continue
            lock.release()  # unlinks it
        say(f"{'would remove' if rep.dry_run else 'removing'} stale lock file {path}")
        rep.removed_locks.append(path)


def _report_unproven(site: _Site, proven: list[ownership.OwnerRecord], rep: GcReport) -> None:
    """List debris shaped like mergepipe's names that no valid record proves (kept)."""
    covered: list[str] = []
    for rec in proven:
        covered += [rec.area(), rec.area() + ".", *([r] if (r := rec.records()) else [])]
    seen: set[str] = set()
    for uri in sorted(site.entries):
        if any(_under(uri, c) or uri.startswith(c) for c in covered):
            continue
        if uri in rep.removed_locks:
            continue
        rel = uri[len(site.root) :] if uri.startswith(site.root) else os.path.basename(uri)
        m = _RUN_SHAPE.search(rel)
        if m:
            top = uri[: len(uri) - len(rel) + m.end()].rstrip("/")
            if any(_under(top, f"{o}/{_files_prefix(site, o)}") for o in site.manifests if _files_prefix(site, o)):
                continue  # a committed snapshot's live run
        elif not site.s3 and _LOCAL_SHAPE.match(os.path.basename(uri)) and not uri.endswith(ownership.OWNER_SUFFIX):
            top = uri
            if uri.endswith(LOCK_SUFFIX) and read_lock_record(uri) is not None:
                continue  # a proven lock file (kept with its staging, or young, or in use)
            if any(_under(uri, c) for c in seen):
                continue
        else:
            continue
        if top not in seen:
            seen.add(top)
            rep.unproven.append(f"{top} (no ownership record; kept)")


def _files_prefix(site: _Site, out: str) -> str:
    try:
        m = site.manifest(out)
    except (InputError, OSError):
        return ""
    return str((m or {}).get("files_prefix") or "")


def _abort_uploads(site: _Site, proven: list[ownership.OwnerRecord], rep: GcReport, now: float, say) -> None:
    """Abort stale multipart uploads in proven areas or in committed snapshots' runs."""
    from mergepipe.storage.s3 import split_uri

    s3: Any = getattr(site.storage, "s3", site.storage)
    bucket, key = split_uri(site.root)
    ours = [r.area() for r in proven] + [
        f"{o}/{p}" for o in sorted(site.manifests) if _under(o, site.root) and (p := _files_prefix(site, o))
    ]
    pre = key.rstrip("/") + "/" if key else ""
    for page in _s3_pages(s3, "list_multipart_uploads", site.root, Bucket=bucket, Prefix=pre):
        for u in page.get("Uploads", ()) or ():
            uri = f"s3://{bucket}/{u['Key']}"
            if not any(_under(uri, a) for a in ours):
                if _RUN_SHAPE.search(u["Key"][len(pre) :]):
                    rep.unproven.append(f"{uri} (upload {u['UploadId'][:12]}; no ownership record; kept)")
                continue
            if now - u["Initiated"].timestamp() < rep.grace_s:
                rep.kept_young.append(f"{uri} (upload {u['UploadId'][:12]})")
                continue
            say(f"{'would abort' if rep.dry_run else 'aborting'} multipart upload of {uri}")
            if not rep.dry_run:
                s3.client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            rep.aborted_uploads.append(f"{uri} (upload {u['UploadId']})")
