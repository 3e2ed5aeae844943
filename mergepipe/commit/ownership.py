"""Ownership records: the proof ``mergepipe gc`` needs before it deletes anything.

Every area a merge writes before its commit is created with an *ownership record* written
before any data, beside the area (``<area>.owner.json``):

=============  ===========================================  ====================================
kind           area (``out`` canonical, see below)          written by
=============  ===========================================  ====================================
``staging``    ``<parent>/.<name>.staging``                 a single-process local merge of
                                                            versions before runs of one part
``run-folder`` ``<parent>/.<name>.run-<run>`` (+ ``.records``)  every local run (single-process,
                                                            partitioned, resumed)
``run-prefix`` ``<out>/runs/<run>`` (+ ``.records``)        every object-store run (and a local
                                                            ``object_mode`` run)
=============  ===========================================  ====================================

A record names its owner ``out`` exactly (canonical: a local path is ``realpath(parent)/name``,
an S3 URI ``s3://bucket/key`` without trailing ``/``), its kind and run id, the plan digest, the
start time (seconds since the epoch), the mergepipe version and a format tag
(:data:`OWNER_FORMAT`). It is parsed by one strict pydantic model (:class:`OwnerRecord`: known
keys only) and is valid only where its own content says it must lie (:meth:`OwnerRecord.record_uri`):
a record copied elsewhere, or an area whose name merely looks like a run, proves nothing.

Commit and gc exclude each other:

* local folders (``staging``, ``run-folder``): the commit holds ``out``'s
  :class:`~mergepipe.commit.manifest.OutputLock` (``flock(2)``) around the staged-file check and
  the rename; gc takes the same lock (and a run's part locks) before it deletes, so a finished
  run is either renamed onto ``out`` or deleted, never both;
* object stores (``run-prefix``), which have no locks: a Dekker-style handshake of two marker
  objects. The commit writes ``<area>.commit.json`` (an *intent*) and only then checks that no
  ``<area>.gc.json`` (a *claim*) exists before it creates the manifest; gc creates the claim with
  a conditional PUT (``If-None-Match: *``) and only then checks for an intent and re-reads the
  manifest before deleting. With a strongly consistent store (AWS S3, SeaweedFS, MinIO: a GET or
  HEAD after a completed PUT sees it) at least one side sees the other's marker, so gc never
  deletes a run whose manifest is being created: either the commit refuses (the claim is there;
  nothing is published) or gc keeps the run (an intent younger than :data:`INTENT_TTL_S`, or a
  manifest that references it). An intent older than :data:`INTENT_TTL_S` is a dead commit's; a
  claim older than that is a dead gc's and is taken over.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergepipe.errors import CommitConflict, InputError
from mergepipe.storage.base import NotFoundError, PreconditionFailed, Storage, is_s3

OWNER_FORMAT: Literal["mergepipe.owner/v1"] = "mergepipe.owner/v1"
OWNER_SUFFIX = ".owner.json"
CLAIM_SUFFIX = ".gc.json"
INTENT_SUFFIX = ".commit.json"
#: seconds an intent (a commit in progress) or a claim (a gc in progress) is honoured
INTENT_TTL_S = 3600.0
#: largest ownership record read (bytes); a real one is ~400 bytes
MAX_OWNER_BYTES = 64 << 10

Kind = Literal["staging", "run-folder", "run-prefix"]


def canonical_out(out: str) -> str:
    """``out`` in the one spelling records and gc compare: a local path becomes
    ``realpath(parent)/name`` (``.`` and ``/abs/path`` give the same string; ``out`` itself is not
    resolved, it may not exist yet), an ``s3://`` URI loses its trailing ``/``."""
    s = str(out)
    if is_s3(s):
        return s.rstrip("/")
    a = os.path.abspath(s)
    parent, name = os.path.split(a)
    return os.path.join(os.path.realpath(parent), name) if name else os.path.realpath(a)


def area_of(kind: str, out: str, run: str | None) -> str:
    """The canonical location of the area of ``kind`` (see the module table) owned by ``out``."""
    o = canonical_out(out)
    if kind == "run-prefix":
        return f"{o}/runs/{run}"
    parent, name = os.path.split(o)
    if kind == "staging":
        return os.path.join(parent, f".{name}.staging")
    return os.path.join(parent, f".{name}.run-{run}")


class OwnerRecord(BaseModel):
    """An ownership record (see the module docstring); unknown keys are refused.

    Attributes:
        format: :data:`OWNER_FORMAT`.
        kind: ``staging``, ``run-folder`` or ``run-prefix``.
        out: the owner snapshot location, canonical (:func:`canonical_out`).
        run: the run id (None for ``staging``).
        plan_digest: the plan's digest (64 hex).
        started_at: when the area was created, seconds since the epoch (>= 0).
        version: the mergepipe version that wrote it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["mergepipe.owner/v1"]
    kind: Kind
    out: str = Field(min_length=1, max_length=4096)
    run: str | None = Field(default=None, max_length=64)
    plan_digest: str = Field(pattern=r"^[0-9a-f]{16,128}$")
    started_at: float = Field(ge=0)
    version: str = Field(max_length=64)

    def area(self) -> str:
        """The area this record owns (canonical path or URI)."""
        return area_of(self.kind, self.out, self.run)

    def records(self) -> str | None:
        """The run's records folder/prefix (None for staging)."""
        return None if self.kind == "staging" else self.area() + ".records"

    def record_uri(self) -> str:
        """Where this record must lie to prove anything."""
        return self.area() + OWNER_SUFFIX


def record_uri(area: str) -> str:
    """The ownership record of ``area``."""
    return str(area).rstrip("/") + OWNER_SUFFIX


#: a run id: 1-64 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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


def _version() -> str:
    from mergepipe import __version__

    return str(__version__)


def make_record(kind: Kind, out: str, run: str | None, plan_digest: str) -> OwnerRecord:
    """A fresh record for ``out``'s area of ``kind`` (started now)."""
    if kind != "staging":
        check_run_id(run or "")
    return OwnerRecord(
        format=OWNER_FORMAT,
        kind=kind,
        out=canonical_out(out),
        run=run,
        plan_digest=plan_digest,
        started_at=time.time(),
        version=_version(),
    )


def _bytes(rec: OwnerRecord) -> bytes:
    return (json.dumps(rec.model_dump(), indent=1, sort_keys=True) + "\n").encode()


def parse_record(data: bytes, where: str) -> OwnerRecord:
    """Parse and validate an ownership record.

    Raises:
        InputError: not JSON, unknown keys, a wrong format tag or field (one line naming ``where``).
    """
    try:
        return OwnerRecord.model_validate_json(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ())) or "record"
        raise InputError(f"{where}: ownership record field {loc}: {err.get('msg')}.") from None


def read_record(storage: Storage, uri: str) -> OwnerRecord:
    """Read the record at ``uri`` (at most :data:`MAX_OWNER_BYTES`).

    Raises:
        NotFoundError: no record.
        InputError: too large or invalid (:func:`parse_record`).
    """
    return parse_record(storage.read_object(uri, "other", MAX_OWNER_BYTES), uri)


def write_record(storage: Storage, area: str, rec: OwnerRecord) -> OwnerRecord:
    """Write ``rec`` beside ``area`` (``area`` as the caller's storage spells it) before any data
    of the area. A staging record replaces a dead writer's (the caller holds the output lock); a
    run record is created once (``If-None-Match``) and an existing one must name the same owner,
    kind and plan.

    Returns:
        The record in force (an existing run record keeps its start time).

    Raises:
        CommitConflict: the run area already belongs to another plan or owner (choose another
            ``--run``).
    """
    uri = record_uri(area)
    if rec.kind == "staging":
        storage.put_object(uri, _bytes(rec), "other")
        return rec
    try:
        storage.put_object(uri, _bytes(rec), "other", if_none_match=True)
        return rec
    except PreconditionFailed:
        pass
    try:
        old = read_record(storage, uri)
    except (NotFoundError, InputError):
        storage.put_object(uri, _bytes(rec), "other")  # a torn or vanished record: ours now
        return rec
    if (old.kind, old.out, old.run, old.plan_digest) != (rec.kind, rec.out, rec.run, rec.plan_digest):
        raise CommitConflict(
            f"run {rec.run} of {rec.out}: its area belongs to plan {old.plan_digest[:12]} "
            f"(record {uri}); choose another --run or remove that run with `mergepipe gc`."
        )
    return old


def remove_record(storage: Storage, area: str) -> None:
    """Remove ``area``'s ownership record and its commit intent (after a commit or an abort)."""
    for suffix in (INTENT_SUFFIX, OWNER_SUFFIX):
        storage.delete(str(area).rstrip("/") + suffix)


def _age(storage: Storage, uri: str, now: float) -> float | None:
    """Seconds since the marker ``uri`` was written (its recorded time), None when absent."""
    try:
        data = storage.read_object(uri, "other", MAX_OWNER_BYTES)
    except NotFoundError:
        return None
    try:
        at = float(json.loads(data)["at"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # a torn marker: treat it as fresh (the safe side for both parties)
    return now - at


def _marker(kind: str) -> bytes:
    return (json.dumps({"format": f"mergepipe.{kind}/v1", "at": time.time(), "version": _version()}) + "\n").encode()


def announce_commit(storage: Storage, area: str) -> None:
    """The commit's half of the handshake (object stores): write the intent, then check for a gc
    claim. Call right before verifying the outputs and creating the manifest.

    Raises:
        CommitConflict: ``mergepipe gc`` claimed this run for deletion (nothing is published).
    """
    base = str(area).rstrip("/")
    storage.put_object(base + INTENT_SUFFIX, _marker("commit"), "other")
    age = _age(storage, base + CLAIM_SUFFIX, time.time())
    if age is not None:
        storage.delete(base + INTENT_SUFFIX)
        raise CommitConflict(
            f"{base}: `mergepipe gc` is deleting this run (claim {base + CLAIM_SUFFIX}, "
            f"{max(0, int(age))} s old); nothing was published. Rerun the merge."
        )


def claim_for_gc(storage: Storage, area: str, now: float) -> bool:
    """gc's half of the handshake (object stores): create the claim (conditional), then check for
    a commit intent younger than :data:`INTENT_TTL_S`. Returns True when gc may delete (the
    caller must still re-read the manifest); False when a commit is in progress or another gc
    holds a fresh claim (then nothing of ours is left behind)."""
    base = str(area).rstrip("/")
    try:
        storage.put_object(base + CLAIM_SUFFIX, _marker("gc"), "other", if_none_match=True)
    except PreconditionFailed:
        age = _age(storage, base + CLAIM_SUFFIX, now)
        if age is not None and age < INTENT_TTL_S:
            return False  # another gc is at it
        storage.put_object(base + CLAIM_SUFFIX, _marker("gc"), "other")  # a dead gc's claim
    age = _age(storage, base + INTENT_SUFFIX, now)
    if age is not None and age < INTENT_TTL_S:
        storage.delete(base + CLAIM_SUFFIX)
        return False
    return True


def release_claim(storage: Storage, area: str) -> None:
    """Remove gc's claim on ``area`` (it decided to keep the run)."""
    storage.delete(str(area).rstrip("/") + CLAIM_SUFFIX)
