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
this plan and this partition, parsed by one strict model (:mod:`mergepipe.commit.records`), and
every file they list present with bytes that, read back, give its recorded size and digest.
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
from mergepipe.commit.ownership import check_run_id
from mergepipe.commit.records import (  # (formats re-exported)
    FILE_FORMAT as FILE_FORMAT,
    PART_FORMAT as PART_FORMAT,
    FileRecord,
    PartRecord,
    parse_file_record,
    parse_part_record,
)
from mergepipe.errors import CommitConflict, InputError
from mergepipe.storage.base import NotFoundError, Storage, is_s3


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

    from mergepipe.storage.local import ensure_folder, open_for_write

    folder = Path(layout.records)
    ensure_folder(folder, what="run records folder")
    fd = open_for_write(folder / f"part-{index:05d}-of-{count:05d}.lock", os.O_RDWR | os.O_CREAT, what="part lock")
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
    FileRecord.model_validate(rec)  # what the reader will accept, checked before it is written
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
        uri = file_record_uri(storage, layout, name)
        try:
            rec = parse_file_record(storage.read_object(uri, "other"), uri)
        except (NotFoundError, InputError):
            continue  # missing, torn or forged: the file is rewritten
        if rec.plan_digest != plan_digest or rec.name != name:
            continue
        info = rec.info.as_info()
        if file_digest(storage, storage.join(layout.files, name), info) == rec.info.key():
            d = rec.model_dump(exclude_none=True)
            d["info"] = info
            out[name] = d
    return out


def write_part_record(storage: Storage, layout: RunLayout, record: dict) -> str:
    """Write part record ``record`` (see the module docstring); returns its URI."""
    uri = part_record_uri(storage, layout, record["part"], record["parts"])
    PartRecord.model_validate(record)  # what the commit will accept, checked before it is written
    storage.put_object(uri, _record_bytes(record), "other")
    return uri


def part_record_uris(storage: Storage, layout: RunLayout) -> dict[tuple[int, int], str]:
    """Every part record of the run (by name, unread): ``(index, count)`` -> URI."""
    out = {}
    for uri in storage.list(layout.records):
        m = re.search(r"part-(\d{1,9})-of-(\d{1,9})\.json$", uri)
        if not m or "/files/" in uri.replace("\\", "/"):
            continue
        out[(int(m.group(1)), int(m.group(2)))] = uri
    return out


def read_part_record(storage: Storage, uri: str) -> PartRecord:
    """Read and parse one part record (:class:`mergepipe.commit.records.PartRecord`).

    Raises:
        NotFoundError: missing.
        InputError: invalid (one line naming ``uri`` and the field).
    """
    return parse_part_record(storage.read_object(uri, "other"), uri)


def read_part_records(storage: Storage, layout: RunLayout) -> dict[tuple[int, int], dict]:
    """Every part record of the run that parses: ``(index, count)`` -> record (as a dict)."""
    out = {}
    for key, uri in part_record_uris(storage, layout).items():
        try:
            out[key] = read_part_record(storage, uri).as_dict()
        except (NotFoundError, InputError):
            continue
    return out


def check_parts(
    storage: Storage,
    layout: RunLayout,
    plan_digest: str,
    expected: list[list[str]],
    side_required: set[str],
    side_optional: set[str],
    planned: dict[str, int] | None = None,
) -> list[dict]:
    """The part records of a finished run, checked against the plan and the stored objects.

    Args:
        expected: the shards of each part (:func:`mergepipe.engine.partition.partition`), which
            also gives the number of parts N.
        side_required: files part 0 must have written besides its shards (the index, when
            the plan needs one).
        side_optional: files part 0 may have written (the base's config/tokenizer files the
            plan lists; the base may lack some).
        planned: the plan's bytes per role (``{"base_read_bytes": n, ...}``): no part may
            record more (a record is untrusted input).

    Every record is parsed by :class:`mergepipe.commit.records.PartRecord` (known keys,
    non-negative numbers, digests) and every file it lists is read back and its digest
    recomputed (role ``other``): sizes alone prove nothing.

    Returns:
        The records of parts ``0..N-1`` in order.

    Raises:
        CommitConflict: a part record is missing, invalid (naming the field), was made for
            another plan or partition, records more bytes than planned, or lists a file that is
            missing or whose bytes do not give its recorded size and digest (nothing is
            committed; the message names the part to re-run).
    """
    n = len(expected)
    uris = part_record_uris(storage, layout)
    others = sorted({c for _, c in uris} - {n})
    out = []
    for i in range(n):
        again = f"run `mergepipe execute PLAN --out {layout.out} --part {i}/{n} --run {layout.run}` again"
        prec = _read_part_for_commit(storage, layout, uris, others, i, n, again)
        _check_record_is_this_plans(prec, uris[(i, n)], layout, i, n, plan_digest, planned, again)
        rec = prec.as_dict()
        side = (side_required, side_optional) if i == 0 else (set(), set())
        _check_record_files(storage, layout, prec, rec, i, n, expected[i], side, again)
        out.append(rec)
    _check_no_file_in_two_parts(layout, out)
    return out


def _read_part_for_commit(
    storage: Storage,
    layout: RunLayout,
    uris: dict[tuple[int, int], str],
    others: list[int],
    i: int,
    n: int,
    again: str,
) -> PartRecord:
    """Part ``i``/``n``'s record, parsed; a missing or invalid one is a :class:`CommitConflict`.

    ``others`` are the part counts of records made for another split (named in the hint).
    """
    uri = uris.get((i, n))
    if uri is None:
        hint = f" (records of a {others[0]}-part split exist: the same N must be used)" if others else ""
        raise CommitConflict(f"run {layout.run}: part {i}/{n} has no record{hint}; {again}.")
    try:
        return read_part_record(storage, uri)
    except NotFoundError:
        raise CommitConflict(f"run {layout.run}: part {i}/{n} has no record; {again}.") from None
    except InputError as e:
        raise CommitConflict(f"{str(e).rstrip('.')}; {again}.") from None


def _check_record_is_this_plans(
    prec: PartRecord,
    uri: str,
    layout: RunLayout,
    i: int,
    n: int,
    plan_digest: str,
    planned: dict[str, int] | None,
    again: str,
) -> None:
    """Refuse a record made for another plan or split, or recording more bytes than planned."""
    if prec.plan_digest != plan_digest:
        raise CommitConflict(
            f"run {layout.run}: part {i}/{n} was made for plan {prec.plan_digest[:12]}, not this plan; {again}."
        )
    if (prec.part, prec.parts) != (i, n):
        raise CommitConflict(f"{uri}: records part {prec.part}/{prec.parts}, not {i}/{n}; {again}.")
    for role, cap in (planned or {}).items():
        got = getattr(prec.realized, role)
        if got > cap:
            raise CommitConflict(
                f"{uri}: realized.{role} {got} exceeds the plan's {cap}; the record is not this plan's run; {again}."
            )


def _check_record_files(
    storage: Storage,
    layout: RunLayout,
    prec: PartRecord,
    rec: dict,
    i: int,
    n: int,
    shards: list[str],
    side: tuple[set[str], set[str]],
    again: str,
) -> None:
    """Refuse part ``i``'s record unless it lists exactly its ``shards`` plus the required side
    files (``side = (required, optional)``), and every listed file is stored with the recorded
    size and digest (read back, role ``other``)."""
    if rec["shards"] != shards:
        raise CommitConflict(
            f"run {layout.run}: part {i}/{n} wrote shards {rec['shards']}, the plan's "
            f"partition gives {shards}; {again}."
        )
    files = rec["files"]
    want = set(shards) | side[0]
    missing = want - set(files)
    extra = set(files) - want - side[1]
    if missing or extra:
        raise CommitConflict(
            f"run {layout.run}: part {i}/{n} lists files {sorted(files)}, expected {sorted(want)}; {again}."
        )
    for name, finfo in prec.files.items():
        fu = storage.join(layout.files, name)
        try:
            size = storage.stat(fu).size
        except NotFoundError:
            raise CommitConflict(f"{fu}: listed by part {i}/{n} but missing; {again}.") from None
        if size != finfo.size:
            raise CommitConflict(f"{fu}: size {size}, part {i}/{n} recorded {finfo.size}; {again}.")
        # by content: a same-size edit, or another plan's file copied in, is refused here
        if file_digest(storage, fu, finfo.as_info()) != finfo.key():
            raise CommitConflict(
                f"{fu}: its bytes do not give the digest part {i}/{n} recorded (changed after it was "
                f"written, or written for another plan); nothing was committed; {again}."
            )


def _check_no_file_in_two_parts(layout: RunLayout, records: list[dict]) -> None:
    """Refuse a file listed by two parts' records."""
    seen: dict[str, int] = {}
    for i, rec in enumerate(records):
        for name in rec["files"]:
            if name in seen:
                raise CommitConflict(f"run {layout.run}: {name} is listed by parts {seen[name]} and {i}.")
            seen[name] = i
