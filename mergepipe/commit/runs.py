"""Runs of a partitioned merge: where parts write, their records, and the checks before a commit.

A *run* is one attempt at a snapshot, named by a run id (default: derived from the plan
digest, so every process working on a plan finds the same run without talking to the others,
and a rerun of the same plan finds what an interrupted one wrote). Layout:

- object storage: files under ``<out>/runs/<run>/`` (the manifest's ``files_prefix``, as for
  a single-process merge), records under ``<out>/runs/<run>.records/``;
- local folders: files under ``<parent>/.<name>.run-<run>/`` (renamed onto ``<out>`` by the
  commit), records under ``<parent>/.<name>.run-<run>.records/`` (removed after the commit).

Records are small JSON objects:

- a *file record* (``files/<name>.json``) is written as soon as an output file is complete
  and durable: its size, content key (``tree_sha256`` of a shard, ``sha256`` of another file),
  the SHA-256 of the base tensors it holds, and its attempt (id, bytes moved so far). A
  resumed run keeps a file whose record is there and whose bytes, read back, still give the
  recorded size and digest;
- a *part record* (``part-<i>-of-<N>.json``) is written when part ``i`` of ``N`` is done: its
  shards, its files, the base tensors' SHA-256, the bytes it read and wrote per role, wall
  time, which files it kept from an earlier attempt and what those attempts had moved.

The commit (:func:`check_parts`) requires the records of every part ``0..N-1``, each made for
this plan and this partition, and every file they list present with its recorded size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mergepipe.commit.manifest import shard_tree_digest
from mergepipe.errors import CommitConflict, InputError
from mergepipe.storage.base import NotFoundError, Storage, is_s3

PART_FORMAT = "mergepipe.part/v1"
FILE_FORMAT = "mergepipe.file/v1"
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class RunLayout:
    """Where one run's files and records live.

    Attributes:
        out: the snapshot location (folder or ``s3://`` prefix).
        run: the run id.
        files: URI of the folder/prefix holding the run's output files.
        records: URI of the folder/prefix holding its file and part records.
        files_prefix: the manifest's ``files_prefix`` (relative to ``out``; "" locally, where
            the files folder is renamed onto ``out``).
        object_mode: object-store protocol (conditional manifest create) rather than rename.
    """

    out: str
    run: str
    files: str
    records: str
    files_prefix: str
    object_mode: bool


def default_run_id(plan_digest: str) -> str:
    """The run id every process of a plan uses unless told otherwise: ``plan-`` + 16 hex."""
    return "plan-" + plan_digest[:16]


def check_run_id(run: str) -> str:
    """Return ``run`` if it is a valid run id (1-64 of ``A-Z a-z 0-9 . _ -``, not starting with
    ``.``, ``_`` or ``-``).

    Raises:
        InputError: anything else.
    """
    if not _RUN_RE.fullmatch(run or ""):
        raise InputError(
            f"--run {run!r}: a run id is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."
        )
    return run


def run_layout(storage: Storage, out: str, run: str, object_mode: bool) -> RunLayout:
    """The :class:`RunLayout` of run ``run`` of snapshot ``out``."""
    check_run_id(run)
    if object_mode:
        files = storage.join(out, "runs", run)
        return RunLayout(out, run, files, files + ".records", f"runs/{run}", True)
    p = Path(out)
    files = str(p.parent / f".{p.name}.run-{run}")
    return RunLayout(out, run, files, files + ".records", "", False)


@contextmanager
def part_lock(layout: RunLayout, index: int, count: int) -> Iterator[None]:
    """Hold an exclusive ``flock(2)`` on ``<records>/part-<i>-of-<N>.lock`` while part ``i`` of a
    local run executes, so two processes never rewrite the same part's files at once (the kernel
    frees the lock when its holder dies). On object storage two attempts write identical
    objects, each replaced atomically, so no lock is taken.

    Raises:
        CommitConflict: another live process holds the lock.
    """
    if is_s3(layout.records):
        yield
        return
    import fcntl

    folder = Path(layout.records)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"part-{index:05d}-of-{count:05d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommitConflict(
                f"run {layout.run}: part {index}/{count} is being executed by another process; wait for it "
                "(rerunning afterwards keeps what it finished)."
            ) from None
        yield
    finally:
        os.close(fd)


def part_record_uri(storage: Storage, layout: RunLayout, index: int, count: int) -> str:
    return storage.join(layout.records, f"part-{index:05d}-of-{count:05d}.json")


def file_record_uri(storage: Storage, layout: RunLayout, name: str) -> str:
    return storage.join(layout.records, "files", name + ".json")


def _record_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def _read_json(storage: Storage, uri: str) -> dict | None:
    """A record, or None when it is missing or not a JSON object (a torn write counts as missing)."""
    try:
        data = storage.read_object(uri, "other")
    except NotFoundError:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def write_file_record(
    storage: Storage,
    layout: RunLayout,
    plan_digest: str,
    name: str,
    info: dict,
    base_sha256: dict[str, str],
    *,
    attempt: dict | None = None,
) -> None:
    """Record that output file ``name`` (``info``: size and content key) is complete.
    ``attempt``: ``{"id", "realized"}``, the attempt that wrote it and the bytes per role that
    attempt had moved by then (see :mod:`mergepipe.parts`)."""
    rec = {
        "format": FILE_FORMAT,
        "plan_digest": plan_digest,
        "run": layout.run,
        "name": name,
        "info": info,
        "base_tensor_sha256": base_sha256,
    }
    if attempt is not None:
        rec["attempt"] = attempt
    storage.put_object(file_record_uri(storage, layout, name), _record_bytes(rec), "other")


def file_digest(storage: Storage, uri: str, info: dict) -> str | None:
    """Recompute the content key of the file at ``uri`` the way ``info`` records it
    (``tree_sha256`` or ``sha256``), reading it back (role ``other``); None if unreadable."""
    try:
        size = storage.stat(uri).size
        if size != info["size"]:
            return None
        if "tree_sha256" in info:
            return shard_tree_digest(lambda a, b: storage.read_range(uri, a, b, "other"), size, uri)
        h = hashlib.sha256()
        for s in range(0, size, 16 << 20):
            h.update(storage.read_range(uri, s, min(size, s + (16 << 20)), "other"))
        return h.hexdigest()
    except Exception:  # noqa: BLE001 - a file that cannot be read back is not kept
        return None


def kept_files(storage: Storage, layout: RunLayout, plan_digest: str, names: list[str]) -> dict[str, dict]:
    """The files among ``names`` an earlier attempt of this run finished: record present, made
    for this plan, and the file's bytes read back give the recorded size and digest.

    Returns:
        name -> its file record (``info`` and ``base_tensor_sha256``).
    """
    out = {}
    for name in names:
        rec = _read_json(storage, file_record_uri(storage, layout, name))
        if not rec or rec.get("format") != FILE_FORMAT or rec.get("plan_digest") != plan_digest:
            continue
        info = rec.get("info") or {}
        key = info.get("tree_sha256") or info.get("sha256")
        if key and file_digest(storage, storage.join(layout.files, name), info) == key:
            out[name] = rec
    return out


def write_part_record(storage: Storage, layout: RunLayout, record: dict) -> str:
    """Write part record ``record`` (see the module docstring); returns its URI."""
    uri = part_record_uri(storage, layout, record["part"], record["parts"])
    storage.put_object(uri, _record_bytes(record), "other")
    return uri


def read_part_records(storage: Storage, layout: RunLayout) -> dict[tuple[int, int], dict]:
    """Every part record of the run: ``(index, count)`` -> record."""
    out = {}
    for uri in storage.list(layout.records):
        m = re.search(r"part-(\d+)-of-(\d+)\.json$", uri)
        if not m or "/files/" in uri.replace("\\", "/"):
            continue
        rec = _read_json(storage, uri)
        if rec is not None:
            out[(int(m.group(1)), int(m.group(2)))] = rec
    return out


def check_parts(
    storage: Storage,
    layout: RunLayout,
    plan_digest: str,
    expected: list[list[str]],
    side_required: set[str],
    side_optional: set[str],
) -> list[dict]:
    """The part records of a finished run, checked against the plan and the stored objects.

    Args:
        expected: the shards of each part (:func:`mergepipe.engine.partition.partition`), which
            also gives the number of parts N.
        side_required: files part 0 must have written besides its shards (the index, when
            the plan needs one).
        side_optional: files part 0 may have written (the base's config/tokenizer files the
            plan lists; the base may lack some).

    Returns:
        The records of parts ``0..N-1`` in order.

    Raises:
        CommitConflict: a part record is missing, was made for another plan or partition, or
            lists a file that is missing or has another size (nothing is committed; the
            message names the part to re-run).
    """
    n = len(expected)
    recs = read_part_records(storage, layout)
    others = sorted({c for _, c in recs} - {n})
    out = []
    for i in range(n):
        rec = recs.get((i, n))
        again = f"run `mergepipe execute PLAN --out {layout.out} --part {i}/{n} --run {layout.run}` again"
        if rec is None:
            hint = f" (records of a {others[0]}-part split exist: the same N must be used)" if others else ""
            raise CommitConflict(f"run {layout.run}: part {i}/{n} has no record{hint}; {again}.")
        if rec.get("format") != PART_FORMAT or rec.get("plan_digest") != plan_digest:
            raise CommitConflict(
                f"run {layout.run}: part {i}/{n} was made for plan "
                f"{str(rec.get('plan_digest'))[:12]}, not this plan; {again}."
            )
        if rec.get("shards") != expected[i]:
            raise CommitConflict(
                f"run {layout.run}: part {i}/{n} wrote shards {rec.get('shards')}, the plan's "
                f"partition gives {expected[i]}; {again}."
            )
        files = rec.get("files") or {}
        want = set(expected[i]) | (side_required if i == 0 else set())
        missing = want - set(files)
        extra = set(files) - want - (side_optional if i == 0 else set())
        if missing or extra:
            raise CommitConflict(
                f"run {layout.run}: part {i}/{n} lists files {sorted(files)}, expected {sorted(want)}; {again}."
            )
        for name, info in files.items():
            uri = storage.join(layout.files, name)
            try:
                size = storage.stat(uri).size
            except NotFoundError:
                raise CommitConflict(f"{uri}: listed by part {i}/{n} but missing; {again}.") from None
            if size != info.get("size"):
                raise CommitConflict(f"{uri}: size {size}, part {i}/{n} recorded {info.get('size')}; {again}.")
        out.append(rec)
    seen: dict[str, int] = {}
    for i, rec in enumerate(out):
        for name in rec["files"]:
            if name in seen:
                raise CommitConflict(f"run {layout.run}: {name} is listed by parts {seen[name]} and {i}.")
            seen[name] = i
    return out
