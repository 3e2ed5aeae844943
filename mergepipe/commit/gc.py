"""Garbage collection of what failed or killed merges leave behind (``mergepipe gc``).

A merge never leaves anything a reader could take for a snapshot, but it may leave debris:

* **object storage** (``s3://``): a killed run leaves objects under ``<out>/runs/<run-id>/`` that no
  manifest references, and multipart uploads that were never completed or aborted (a lost
  CreateMultipartUpload response leaks one even when the merge succeeds); S3 bills both.
* **local folders**: a dead writer's hidden staging folder ``.<name>.staging`` and its lock file
  ``.<name>.lock`` (reclaimed anyway by the next merge to the same ``--out``), staging
  folders ``.<name>.staging-<id>`` of mergepipe versions before the lock, and the run folders of
  an abandoned partitioned or resumable merge, ``.<name>.run-<run-id>`` and its ``.records``
  (:mod:`mergepipe.commit.runs`; kept by a crash so that a rerun can resume).

:func:`collect` removes, under one root (a snapshot's ``--out`` or a prefix/folder holding
several), only what mergepipe's own naming identifies as its own and nothing is using:

* a run prefix ``<out>/runs/<run-id>/`` that ``<out>/manifest.json`` does not reference (or that
  belongs to an ``<out>`` without a manifest) and whose newest object is older than ``grace``;
  run ids mergepipe generates are recognised (16 hex; a partitioned merge's ``plan-<16 hex>`` and
  its ``.records``), a run named with ``--run`` is not (its owner removes it);
* a multipart upload whose key lies in such a ``runs/<id>/`` prefix and which was initiated more
  than ``grace`` ago (even in the referenced run: its object, if any, is complete);
* a local staging folder whose lock is free (its writer is provably dead, see
  :mod:`mergepipe.commit.manifest`); its lock file is removed with it; a pre-lock staging folder
  ``.<name>.staging-<hex>`` older than ``grace``; a lock file without staging folder older than
  ``grace`` whose lock is free;
* a local run folder ``.<name>.run-plan-<16 hex>`` (and its ``.records`` folder) whose newest
  file is older than ``grace`` and none of whose parts is being executed (every part lock in its
  records folder is free). A committed run was renamed onto ``<name>`` and its records removed,
  so what is left is an abandoned run; removing it means a rerun starts over.

``grace`` must exceed the longest merge (a run prefix is written for the whole merge before its
manifest references it); the default is 24 hours. The same clean-up is available without
mergepipe as an S3 lifecycle rule (see the README's "Garbage collection"): it can abort
incomplete multipart uploads after N days, but it cannot tell referenced runs from orphans, so
orphan run prefixes still need ``mergepipe gc``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.commit.manifest import LOCK_SUFFIX, MANIFEST_NAME, STAGING_SUFFIX, OutputLock
from mergepipe.errors import CommitConflict, InputError
from mergepipe.storage.base import Storage, is_s3

#: default grace period (seconds): younger debris may belong to a running merge
DEFAULT_GRACE_S = 24 * 3600.0

#: a run prefix mergepipe creates: a random run id (16 hex), or a partitioned merge's default run id
#: (``plan-`` + 16 hex, :func:`mergepipe.commit.runs.default_run_id`) and its ``.records`` prefix
_RUN = re.compile(r"^(?P<out>(?:.*/)?)runs/(?P<rid>(?:plan-)?[0-9a-f]{16}(?:\.records)?)/")
_LEGACY_STAGING = re.compile(r"^\.(?P<name>.+)\.staging-[0-9a-f]{12}$")
#: a local run folder of a partitioned/resumable merge with a mergepipe-made run id, or its records
_LOCAL_RUN = re.compile(r"^\.(?P<name>.+)\.run-(?P<rid>plan-[0-9a-f]{16})(?P<records>\.records)?$")


@dataclass
class GcReport:
    """What :func:`collect` removed (or, with ``dry_run``, would remove), as URIs/paths."""

    root: str
    grace_s: float
    dry_run: bool
    deleted_runs: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)
    removed_staging: list[str] = field(default_factory=list)
    removed_locks: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    kept_young: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def collect(
    storage: Storage,
    root: str,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
    log: Callable[[str], None] | None = None,
) -> GcReport:
    """Remove mergepipe's debris under ``root`` (see the module docstring).

    Args:
        storage: a storage that can reach ``root`` (local folder or ``s3://`` prefix).
        grace_s: seconds; younger debris is kept (it may belong to a running merge).
        dry_run: report what would be removed, remove nothing.
        now: the current time (seconds since the epoch; tests).

    Raises:
        InputError: ``grace_s`` negative or not finite, or a local ``root`` that is not a folder.
    """
    import math

    if not math.isfinite(grace_s) or grace_s < 0:
        raise InputError(f"--grace {grace_s}: must be a non-negative number of seconds.")
    now = time.time() if now is None else now
    rep = GcReport(root=root, grace_s=grace_s, dry_run=dry_run)
    say = log or (lambda m: None)
    if not is_s3(root):
        if not os.path.isdir(root):
            raise InputError(f"{root}: not a folder; give a snapshot's --out or a folder of snapshots.")
        _collect_local_staging(Path(root), rep, now, say)
    _collect_runs(storage, root, rep, now, say)
    if is_s3(root):
        _abort_uploads(storage, root, rep, now, say)
    return rep


def _s3_prefix(storage: Storage, root: str) -> tuple[Any, str, str]:
    """(boto3 S3 client, bucket, key prefix ending in ``/`` or empty) to list ``root``
    (``s3://bucket/prefix``) with, from a RoutingStorage's S3 backend or an S3Storage."""
    from mergepipe.storage.s3 import split_uri

    s3: Any = getattr(storage, "s3", storage)
    bucket, key = split_uri(root)
    return s3.client, bucket, (key.rstrip("/") + "/" if key else "")


def _objects(storage: Storage, root: str) -> Iterator[tuple[str, float]]:
    """(key relative to ``root``, modification time) of every object/file under ``root``."""
    if is_s3(root):
        client, bucket, pre = _s3_prefix(storage, root)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=pre)
        for page in pages:
            for o in page.get("Contents", ()) or ():
                yield o["Key"][len(pre) :], o["LastModified"].timestamp()
        return
    for dp, dns, fns in os.walk(root):
        dns[:] = [d for d in dns if not (d.startswith(".") and (STAGING_SUFFIX in d))]
        for fn in fns:
            p = os.path.join(dp, fn)
            try:
                yield os.path.relpath(p, root).replace(os.sep, "/"), os.lstat(p).st_mtime
            except FileNotFoundError:
                continue


def _collect_runs(storage: Storage, root: str, rep: GcReport, now: float, say) -> None:
    runs: dict[tuple[str, str], float] = {}
    outs_with_manifest: set[str] = set()
    for rel, mtime in _objects(storage, root):
        m = _RUN.match(rel)
        if m:
            k = (m.group("out"), m.group("rid"))
            runs[k] = max(runs.get(k, 0.0), mtime)
        elif rel == MANIFEST_NAME or rel.endswith("/" + MANIFEST_NAME):
            outs_with_manifest.add(rel[: -len(MANIFEST_NAME)])
    referenced: dict[str, str | None] = {}
    for out_rel in {o for o, _ in runs}:
        ref = None
        if out_rel in outs_with_manifest:
            ref = _referenced_run(storage, _join(storage, root, out_rel))
            if ref is None:  # unreadable manifest: keep all its runs, it is not ours to judge
                continue
        referenced[out_rel] = ref
    for (out_rel, rid), newest in sorted(runs.items()):
        if out_rel not in referenced:
            continue
        uri = _join(storage, root, out_rel + f"runs/{rid}")
        if referenced[out_rel] == f"runs/{rid}":
            continue
        if now - newest < rep.grace_s:
            rep.kept_young.append(uri)
            continue
        say(f"{'would delete' if rep.dry_run else 'deleting'} unreferenced run {uri}/")
        if not rep.dry_run:
            storage.delete(uri.rstrip("/") + "/")
        rep.deleted_runs.append(uri)


def _join(storage: Storage, root: str, rel: str) -> str:
    rel = rel.strip("/")
    return storage.join(root, rel) if rel else root.rstrip("/")


def _referenced_run(storage: Storage, out: str) -> str | None:
    """The ``files_prefix`` a committed manifest references ("" for a local snapshot), or None
    when the manifest cannot be read."""
    from mergepipe.commit.objectstore import read_manifest_obj

    try:
        got = read_manifest_obj(storage, out)
    except (InputError, OSError):
        return None
    if got is None:
        return None
    return str(got[0].get("files_prefix") or "")


def _abort_uploads(storage: Storage, root: str, rep: GcReport, now: float, say) -> None:
    client, bucket, pre = _s3_prefix(storage, root)
    pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=pre)
    for page in pages:
        for u in page.get("Uploads", ()) or ():
            rel = u["Key"][len(pre) :]
            if not _RUN.match(rel):
                continue  # not a mergepipe run object: not ours
            uri = f"s3://{bucket}/{u['Key']}"
            if now - u["Initiated"].timestamp() < rep.grace_s:
                rep.kept_young.append(f"{uri} (upload {u['UploadId'][:12]})")
                continue
            say(f"{'would abort' if rep.dry_run else 'aborting'} multipart upload of {uri}")
            if not rep.dry_run:
                client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            rep.aborted_uploads.append(f"{uri} (upload {u['UploadId']})")


def _collect_local_staging(root: Path, rep: GcReport, now: float, say) -> None:
    folders = [root, root.parent] + [Path(dp) for dp, _, _ in _walk_dirs(root)]
    seen: set[Path] = set()
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            p = Path(e.path)
            if p in seen or not e.name.startswith("."):
                continue
            seen.add(p)
            if folder == root.parent and not e.name.startswith(f".{root.name}."):
                continue  # beside root only root's own staging and lock
            if e.name.endswith(STAGING_SUFFIX) and e.is_dir(follow_symlinks=False):
                out = p.parent / e.name[1 : -len(STAGING_SUFFIX)]
                _reclaim(out, p, rep, say)
            elif (m := _LOCAL_RUN.match(e.name)) and e.is_dir(follow_symlinks=False):
                files = p.parent / f".{m.group('name')}.run-{m.group('rid')}"
                if files in seen and m.group("records"):
                    continue
                seen.update({files, Path(str(files) + ".records")})
                _collect_local_run(files, Path(str(files) + ".records"), rep, now, say)
            elif _LEGACY_STAGING.match(e.name) and e.is_dir(follow_symlinks=False):
                if now - e.stat(follow_symlinks=False).st_mtime < rep.grace_s:
                    rep.kept_young.append(str(p))
                    continue
                say(f"{'would remove' if rep.dry_run else 'removing'} old staging folder {p}")
                if not rep.dry_run:
                    shutil.rmtree(p, ignore_errors=True)
                rep.removed_staging.append(str(p))
            elif e.name.endswith(LOCK_SUFFIX) and e.is_file(follow_symlinks=False):
                out = p.parent / e.name[1 : -len(LOCK_SUFFIX)]
                staging = p.parent / f".{out.name}{STAGING_SUFFIX}"
                try:
                    if staging.exists() or now - os.lstat(p).st_mtime < rep.grace_s:
                        continue  # handled with its staging folder, or possibly just being taken
                except FileNotFoundError:
                    continue  # already removed with its staging folder

                _reclaim(out, None, rep, say)


def _walk_dirs(root: Path):
    for dp, dns, fns in os.walk(root):
        dns[:] = [
            d
            for d in dns
            if not d.endswith(STAGING_SUFFIX)
            and not _LEGACY_STAGING.match(d)
            and not _LOCAL_RUN.match(d)
            and d != "runs"
        ]
        yield dp, dns, fns


def _collect_local_run(files: Path, records: Path, rep: GcReport, now: float, say) -> None:
    """Remove an abandoned local run (``files`` and ``records`` folders) unless one of its part
    locks is held (a part is executing) or its newest file is younger than ``grace``."""
    import fcntl

    newest = 0.0
    for folder in (files, records):
        for dp, _, fns in os.walk(folder):
            for fn in [*fns, "."]:
                try:
                    newest = max(newest, os.lstat(os.path.join(dp, fn)).st_mtime)
                except FileNotFoundError:
                    continue
    label = str(files)
    if now - newest < rep.grace_s:
        rep.kept_young.append(label)
        return
    held: list[int] = []
    try:
        for lock in sorted(records.glob("part-*.lock")) if records.is_dir() else []:
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                rep.kept_in_use.append(label)
                return
            held.append(fd)  # held until removed: no part starts meanwhile
        say(f"{'would remove' if rep.dry_run else 'removing'} abandoned run {files}")
        if not rep.dry_run:
            shutil.rmtree(files, ignore_errors=True)
            shutil.rmtree(records, ignore_errors=True)
        rep.deleted_runs.append(label)
    finally:
        for fd in held:
            os.close(fd)


def _reclaim(out: Path, staging: Path | None, rep: GcReport, say) -> None:
    """Take ``out``'s lock (a live writer holds it: keep everything), then remove the dead
    writer's staging folder and, on release, the lock file."""
    lock = OutputLock(out)
    existed = lock.path.exists()
    try:
        lock.acquire()
    except (CommitConflict, InputError):
        rep.kept_in_use.append(str(staging or lock.path))
        return
    try:
        if staging is not None:
            say(f"{'would remove' if rep.dry_run else 'removing'} dead writer's staging folder {staging}")
            if not rep.dry_run:
                shutil.rmtree(staging, ignore_errors=True)
            rep.removed_staging.append(str(staging))
        rep.removed_locks.append(str(lock.path))
    finally:
        if rep.dry_run:  # a dry run changes nothing: keep (or drop the just created) lock file
            if not existed:
                lock.path.unlink(missing_ok=True)
            if lock.fd is not None:
                os.close(lock.fd)
                lock.fd = None
        else:
            lock.release()
