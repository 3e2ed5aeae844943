"""Commit protocol for object storage (S3): fresh run prefix + conditional manifest create.

Object stores have no rename, so visibility comes from a single conditional write:

1. Shards, the index and config files of one run go under a fresh, never-reused prefix
   ``<out>/runs/<run-id>/`` (a run id is random; a retry is a new run). That prefix is a
   complete Hugging Face checkpoint folder.
2. After all uploads finish, the commit announces itself to ``mergepipe gc`` (an intent object;
   a run gc has claimed is refused, see :mod:`mergepipe.commit.ownership`), every output object is HEAD-checked (exists, size matches); on
   local storage the run's folders are fsync'd (their names survive a crash).
3. ``<out>/manifest.json`` is created with ``PutObject(IfNoneMatch='*')``. Its ``files_prefix``
   names the run prefix (relative to ``<out>``) and ``outputs`` the files under it. Readers trust only manifests: objects no manifest references do
   not exist as far as mergepipe is concerned.
4. A 412 means another writer committed first: if its manifest describes the *same* snapshot
   (same snapshot id: same plan, same output hashes) our run is a duplicate and succeeds (its
   objects are deleted); otherwise it is a conflict. A 409 (conflicting in-flight operation) is
   retried by the storage layer.

Stores that silently ignore ``If-None-Match`` (rclone's and s3rver's S3 gateways) would let two
writers both "win", so :func:`require_conditional_writes` probes the store first and refuses to
commit on one that ignores it unless the caller opts into single-writer mode.

The protocol needs only the :class:`~mergepipe.storage.base.Storage` primitives, so it also
runs (and is tested) on local storage, where the conditional create is ``O_CREAT|O_EXCL``.
"""

from __future__ import annotations

import hashlib
import uuid

from mergepipe.commit.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    manifest_bytes,
    manifest_hash,
    shard_tree_digest,
    snapshot_id,
)
from mergepipe.errors import CommitConflict, InputError
from mergepipe.limits import MAX_MANIFEST_BYTES, loads_json, short_repr
from mergepipe.paths import check_name, name_problem
from mergepipe.storage.base import NotFoundError, PreconditionFailed, Storage


def manifest_uri(storage: Storage, out: str) -> str:
    return storage.join(out, MANIFEST_NAME)


def read_manifest_obj(storage: Storage, out: str) -> tuple[dict, str] | None:
    """The committed manifest at ``out`` and its hash, or None when nothing is committed."""
    try:
        data = storage.read_object(manifest_uri(storage, out), "other", MAX_MANIFEST_BYTES)
    except NotFoundError:
        return None
    m = loads_json(data, manifest_uri(storage, out), what="manifest")
    if not isinstance(m, dict):
        raise InputError(f"{manifest_uri(storage, out)}: the manifest is not a JSON object; it is corrupt.")
    if m.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{manifest_uri(storage, out)}: format {m.get('format')!r}, expected {MANIFEST_FORMAT!r}.")
    return m, manifest_hash(data)


def check_output_obj(storage: Storage, out: str, plan_digest: str) -> tuple[dict, str] | None:
    """Before any work: the existing manifest when ``out`` holds a snapshot of this plan; None
    when ``out`` is free.

    Raises:
        InputError: ``out`` holds a snapshot of a different plan.
    """
    got = read_manifest_obj(storage, out)
    if got is None:
        return None
    m, h = got
    if m.get("plan_digest") == plan_digest:
        return m, h
    raise InputError(
        f"--out {out}: already holds snapshot {m.get('snapshot_id')} of a different plan "
        f"({str(m.get('plan_digest', ''))[:12]}); snapshots are immutable. Choose a new --out."
    )


def new_run_prefix(storage: Storage, out: str, plan_digest: str) -> tuple[str, str]:
    """(run id, run prefix URI) for a fresh run under ``out``, whose ownership record
    (:mod:`mergepipe.commit.ownership`, naming ``out`` and ``plan_digest``) is written before
    anything else."""
    from mergepipe.commit import ownership

    rid = uuid.uuid4().hex[:16]
    run = storage.join(out, "runs", rid)
    ownership.write_record(storage, run, ownership.make_record("run-prefix", out, rid, plan_digest))
    storage.make_prefix(run)
    return rid, run


def require_conditional_writes(storage: Storage, out: str, unsafe_single_writer: bool = False) -> bool:
    """Probe that the store enforces ``If-None-Match: *``.

    Returns:
        True when enforced; False when not enforced but ``unsafe_single_writer`` is set.

    Raises:
        InputError: the store ignores conditional writes and single-writer mode was not chosen.
    """
    if storage.probe_conditional_writes(storage.join(out, "runs", "_probe")):
        return True
    if unsafe_single_writer:
        return False
    raise InputError(
        f"--out {out}: this object store ignores conditional writes (If-None-Match), so two writers "
        "could both believe they committed. Use a store that honours them (AWS S3, SeaweedFS, MinIO), "
        "or pass --unsafe-single-writer if you guarantee a single writer."
    )


def verify_outputs_exist(storage: Storage, files_root: str, outputs: dict) -> None:
    """HEAD-check every output object under ``files_root`` before the commit.

    Raises:
        CommitConflict: an object is missing or has the wrong size (nothing is committed).
    """
    for rel, info in outputs.items():
        uri = storage.join(files_root, rel)
        try:
            st = storage.stat(uri)
        except NotFoundError:
            raise CommitConflict(f"{uri}: uploaded object is missing at commit time; nothing was committed.") from None
        if st.size != info["size"]:
            raise CommitConflict(f"{uri}: size {st.size} != uploaded {info['size']}; nothing was committed.")


def publish_obj(storage: Storage, out: str, run_prefix: str, manifest: dict) -> tuple[dict, str, bool]:
    """Commit by conditional create of ``<out>/manifest.json``, written ``durable``. On local
    storage the folders of ``run_prefix`` and its parents up to ``out`` are fsync'd first, and
    the manifest's folder after (strictly; a refused fsync removes the manifest again), so a
    crash cannot leave a manifest naming files whose names were lost.

    Returns:
        (manifest, manifest hash, won): ``won`` is False when an identical snapshot was already
        committed by another writer (then its manifest is returned and our run is deleted).

    Raises:
        CommitConflict: a different snapshot was committed at ``out`` meanwhile.
        OSError: local storage, the manifest's folder cannot be fsync'd (nothing is published).
    """
    from mergepipe.commit import ownership

    ownership.announce_commit(storage, run_prefix)  # gc's claim excludes us, our intent excludes gc
    try:
        verify_outputs_exist(storage, run_prefix, manifest["outputs"])
        storage.sync_prefix(run_prefix, through=out)
    except BaseException:
        storage.delete(run_prefix.rstrip("/") + ownership.INTENT_SUFFIX)
        raise
    data = manifest_bytes(manifest)
    try:
        storage.put_object(manifest_uri(storage, out), data, "output", if_none_match=True, durable=True)
        ownership.remove_record(storage, run_prefix)
        return manifest, manifest_hash(data), True
    except PreconditionFailed:
        ownership.remove_record(storage, run_prefix)
        got = read_manifest_obj(storage, out)
        # a run id derived from the plan (partitioned runs) can be the winner's own prefix: its
        # files are then the committed snapshot's and stay
        ours_committed = got is not None and got[0].get("files_prefix") == manifest.get("files_prefix")
        if got is not None and got[0].get("snapshot_id") == manifest["snapshot_id"]:
            if not ours_committed:
                storage.delete(run_prefix.rstrip("/") + "/")
            return got[0], got[1], False
        other = got[0].get("snapshot_id") if got else "?"
        if not ours_committed:
            storage.delete(run_prefix.rstrip("/") + "/")
        raise CommitConflict(
            f"--out {out}: another writer committed snapshot {other} first; ours "
            f"({manifest['snapshot_id']}) was discarded. Choose a new --out."
        ) from None


def verify_obj(storage: Storage, out: str) -> dict:
    """Re-read and re-hash every output of a snapshot on any storage against its manifest.

    Returns:
        ``{"ok", "snapshot_id", "manifest_hash", "files", "problems"}`` like
        :func:`mergepipe.commit.manifest.verify_snapshot`.
    """
    got = read_manifest_obj(storage, out)
    if got is None:
        raise InputError(f"{out}: no {MANIFEST_NAME}; this is not a committed mergepipe snapshot.")
    m, mh = got
    where = manifest_uri(storage, out)
    if not isinstance(m.get("outputs"), dict):
        raise InputError(f"{where}: outputs must be an object; the manifest is corrupt.")
    root = storage.join(out, check_name(m["files_prefix"], f"{where}: files_prefix")) if m.get("files_prefix") else out
    problems = []
    for rel, info in sorted(m["outputs"].items()):
        why = name_problem(rel)
        if why is not None:
            problems.append(f"{short_repr(rel)}: output name {why}")
            continue
        try:
            uri = storage.join(root, rel)
        except InputError as e:  # a local root: the name leads out through a symlink
            problems.append(f"{short_repr(rel)}: {e}")
            continue
        try:
            size = storage.stat(uri).size
        except NotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if size != info["size"]:
            problems.append(f"{rel}: size {size} != {info['size']}")
            continue
        if "sha256" in info:
            h = hashlib.sha256()
            step = 16 << 20
            for s in range(0, size, step):
                h.update(storage.read_range(uri, s, min(size, s + step), "other"))
            if h.hexdigest() != info["sha256"]:
                problems.append(f"{rel}: sha256 mismatch")
                continue
        if "tree_sha256" in info:
            try:
                ok = (
                    shard_tree_digest(lambda a, b, uri=uri: storage.read_range(uri, a, b, "other"), size, rel)
                    == info["tree_sha256"]
                )
            except Exception:
                ok = False
            if not ok:
                problems.append(f"{rel}: tree digest mismatch")
    if snapshot_id(m.get("plan_digest", ""), m["outputs"]) != m.get("snapshot_id"):
        problems.append("snapshot_id does not match the plan digest and outputs")
    return {
        "ok": not problems,
        "snapshot_id": m.get("snapshot_id"),
        "manifest_hash": mh,
        "files": len(m["outputs"]),
        "problems": problems,
    }
