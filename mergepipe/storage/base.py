"""Storage protocol: ranged, coalesced, concurrent reads with byte accounting by role.

Every byte mergepipe reads or writes goes through a :class:`Storage`, and every byte is counted
in an :class:`IOCounters` under a *role* (``base``, ``expert``, ``output``, ``catalog``,
``other``). These counters are the source of truth for the I/O figures in plans, manifests and
``--json`` output: the budget guarantee (realized expert bytes <= planned <= budget) is checked
against them.

URIs are either local paths (``/data/model``) or ``s3://bucket/prefix`` (see
:mod:`mergepipe.storage.s3`). :func:`mergepipe.storage.routing.open_storage` picks the
implementation.
"""

from __future__ import annotations

import abc
import bisect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["base", "expert", "output", "catalog", "other"]
ROLES: tuple[Role, ...] = ("base", "expert", "output", "catalog", "other")

#: Requests are split at this size (bytes) so that one range never needs one huge buffer and
#: S3 GETs stay in the 8-16 MiB band AWS recommends.
DEFAULT_MAX_REQUEST = 16 * 1024 * 1024


class StorageError(Exception):
    """An object could not be read or written. The message names the URI and the fix."""


class NotFoundError(StorageError, FileNotFoundError):
    """The object or file does not exist."""


class PreconditionFailed(StorageError):
    """A conditional create (``If-None-Match: *``) lost: the object already exists."""


@dataclass
class IOCounters:
    """Thread-safe byte and request counters per role.

    ``bytes_read[role]`` counts bytes actually transferred from storage (including bytes of
    gaps bridged by coalescing), ``bytes_written[role]`` bytes sent to storage, and
    ``bytes_copied[role]`` bytes copied server-side (S3 UploadPartCopy, local
    ``copy_file_range``), which are neither read nor uploaded by this process.
    """

    bytes_read: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    bytes_written: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    bytes_copied: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    requests: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    #: a breakdown of bytes already counted in ``bytes_read`` (not added to any total): ``sketch``
    #: is the part of the ``expert`` reads that were block-sketch planes (issue 24: realized
    #: sketch bytes in every manifest)
    detail: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_detail(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` of reads already counted under a role as part ``name`` of them."""
        with self._lock:
            self.detail[name] = self.detail.get(name, 0) + int(nbytes)

    def add_read(self, role: str, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_read[role] = self.bytes_read.get(role, 0) + int(nbytes)
            self.requests[role] = self.requests.get(role, 0) + int(requests)

    def add_write(self, role: str, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_written[role] = self.bytes_written.get(role, 0) + int(nbytes)
            self.requests[role] = self.requests.get(role, 0) + int(requests)

    def add_copy(self, role: str, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_copied[role] = self.bytes_copied.get(role, 0) + int(nbytes)
            self.requests[role] = self.requests.get(role, 0) + int(requests)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A consistent copy: ``{"read": {role: bytes}, "written": {...}, "copied": {...},
        "requests": {...}, "detail": {part: bytes}}``."""
        with self._lock:
            return {
                "read": dict(self.bytes_read),
                "written": dict(self.bytes_written),
                "copied": dict(self.bytes_copied),
                "requests": dict(self.requests),
                "detail": dict(self.detail),
            }


@dataclass(frozen=True)
class ObjectStat:
    """Size in bytes and a version token (local: ``mtime_ns.device.inode``; S3: ETag) of one object."""

    size: int
    version: str


def coalesce(
    ranges: Sequence[tuple[int, int]], max_gap: int = 0, max_request: int = DEFAULT_MAX_REQUEST
) -> list[tuple[int, int]]:
    """Merge byte ranges ``[start, end)`` into the requests that will actually be issued.

    Ranges are sorted; two ranges whose gap is ``<= max_gap`` bytes are merged (the gap bytes
    are read and counted); overlapping and adjacent ranges always merge. Merged requests longer
    than ``max_request`` are split into pieces of at most ``max_request`` bytes. The result is
    sorted, non-overlapping, and its total length is what a read of ``ranges`` costs.

    This one function defines the cost model: the planner calls it to compute planned bytes and
    the storage layer calls it to issue requests, so realized bytes equal planned bytes.

    Raises:
        ValueError: a range with ``start > end`` or a negative start, or ``max_request < 1``.
    """
    if max_request < 1:
        raise ValueError(f"max_request must be at least 1 byte, got {max_request}")
    max_gap = max(0, max_gap)
    spans = []
    for s, e in ranges:
        if s < 0 or e < s:
            raise ValueError(f"invalid byte range [{s}, {e})")
        if e > s:
            spans.append((s, e))
    spans.sort()
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s - merged[-1][1] <= max_gap:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out: list[tuple[int, int]] = []
    for s, e in merged:
        while e - s > max_request:
            out.append((s, s + max_request))
            s += max_request
        out.append((s, e))
    return out


def coalesced_cost(ranges: Sequence[tuple[int, int]], max_gap: int = 0, max_request: int = DEFAULT_MAX_REQUEST) -> int:
    """Bytes transferred to read ``ranges`` under :func:`coalesce` (splitting costs nothing)."""
    return sum(e - s for s, e in coalesce(ranges, max_gap, max_request))


def slice_from_requests(
    requests: Sequence[tuple[int, int]], buffers: Sequence[bytes | bytearray | memoryview], start: int, end: int
) -> memoryview | bytes:
    """Extract bytes ``[start, end)`` from fetched ``requests`` (sorted, non-overlapping) whose
    data are ``buffers``. A range spanning several split requests is joined (one copy)."""
    if start == end:
        return b""
    starts = [s for s, _ in requests]
    i = bisect.bisect_right(starts, start) - 1
    if i < 0:
        raise ValueError(f"range [{start}, {end}) not covered by requests")
    s0, e0 = requests[i]
    if end <= e0:
        return memoryview(buffers[i])[start - s0 : end - s0]
    parts = []
    pos = start
    while pos < end:
        if i >= len(requests):
            raise ValueError(f"range [{start}, {end}) not covered by requests")
        s, e = requests[i]
        if pos < s or pos >= e:
            raise ValueError(f"range [{start}, {end}) not covered by requests")
        take = min(e, end)
        parts.append(memoryview(buffers[i])[pos - s : take - s])
        pos = take
        i += 1
    return b"".join(parts)


class Writer(abc.ABC):
    """A sequential writer of one object. ``close()`` makes the bytes durable (local: fsync) but
    never visible to readers as a snapshot: visibility is the commit's job."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    def copy_range(self, src_uri: str, start: int, end: int) -> None:
        """Append bytes ``[start, end)`` of ``src_uri``. Stores that can copy server-side
        override this; the default reads (role ``base``) and writes."""
        raise NotImplementedError

    @abc.abstractmethod
    def close(self) -> int:
        """Finish the object; return its size in bytes."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; never raises."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


@dataclass(frozen=True)
class Capabilities:
    """What a storage backend can do, declared by the backend (callers never probe with
    ``hasattr`` or branch on the URI scheme).

    Attributes:
        folders: real folders with ``rename(2)``, ``flock(2)`` and fsync-able names (local
            files): a snapshot is published by renaming a folder under a lock. Without them (object
            stores) it is published by a conditional create of its manifest.
        atomic_replace: rewriting an object replaces it whole (S3 PUT); False where a torn file
            must be removed before it is rewritten (local files, created exclusively).
        server_side_copy: unchanged bytes can be copied by the store itself (S3 UploadPartCopy).
    """

    folders: bool
    atomic_replace: bool
    server_side_copy: bool = False


class Storage(abc.ABC):
    """Byte-addressed object storage with per-role accounting.

    Implementations: :class:`mergepipe.storage.local.LocalStorage` and
    :class:`mergepipe.storage.s3.S3Storage`.
    """

    #: ranges whose gap is at most this many bytes are merged into one request
    max_gap: int = 0
    max_request: int = DEFAULT_MAX_REQUEST

    def __init__(self, counters: IOCounters | None = None) -> None:
        self.counters = counters if counters is not None else IOCounters()

    # --- what it can do -----------------------------------------------------------------
    def capabilities(self, uri: str) -> Capabilities:
        """What this storage can do for ``uri`` (default: an object store without server-side
        copy; backends override)."""
        return Capabilities(folders=False, atomic_replace=True)

    def backend(self, uri: str) -> Storage:
        """The storage that serves ``uri`` (itself, unless it routes between backends)."""
        return self

    def gap_for(self, uris: Sequence[str]) -> int:
        """The coalescing gap (bytes) reads of ``uris`` use (default: :attr:`max_gap`)."""
        return self.max_gap

    def probe_conditional_writes(self, prefix_uri: str) -> bool:
        """Whether ``put_object(if_none_match=True)`` is enforced under ``prefix_uri`` (default
        True: local storage creates with ``link(2)``, which fails on an existing name; object
        stores override with a probe)."""
        return True

    # --- naming -----------------------------------------------------------------------
    @staticmethod
    def join(root: str, *names: str) -> str:
        """``root/name1/name2...``. Every name must satisfy :func:`mergepipe.paths.check_name`
        (relative, normalised, no ``..``), so the result is always under ``root``.

        Raises:
            InputError: a name breaks the path policy.
        """
        from mergepipe.paths import check_name

        out = root.rstrip("/")
        for n in names:
            out = out + "/" + check_name(n, f"{root}: name")
        return out

    # --- reads --------------------------------------------------------------------------
    @abc.abstractmethod
    def stat(self, uri: str) -> ObjectStat:
        """Size and version of ``uri``. Raises :class:`NotFoundError`."""

    @abc.abstractmethod
    def _fetch(self, uri: str, requests: Sequence[tuple[int, int]]) -> Sequence[bytes | bytearray]:
        """Fetch already-coalesced requests (concurrently where useful); no accounting."""

    def exists(self, uri: str) -> bool:
        try:
            self.stat(uri)
            return True
        except NotFoundError:
            return False

    def read_range(self, uri: str, start: int, end: int, role: Role) -> bytes:
        """Bytes ``[start, end)`` of ``uri``, counted under ``role``. Raises
        :class:`NotFoundError` or :class:`StorageError` (short read)."""
        return bytes(self.read_ranges(uri, [(start, end)], role)[0])

    def read_ranges(
        self, uri: str, ranges: Sequence[tuple[int, int]], role: Role, max_gap: int | None = None
    ) -> list[memoryview | bytes]:
        """Read several byte ranges of one object, coalesced with :func:`coalesce` under this
        storage's ``max_request`` and ``max_gap`` (or the smaller ``max_gap`` given: a plan made
        for a smaller gap must not be read with a larger one) and fetched concurrently. Returns
        one buffer per requested range, in the order given. Bytes counted = coalesced request
        bytes."""
        if not ranges:
            return []
        gap = self.max_gap if max_gap is None else min(max_gap, self.max_gap)
        reqs = coalesce(ranges, gap, self.max_request)
        bufs = self._fetch(uri, reqs)
        for (s, e), b in zip(reqs, bufs):
            if len(b) != e - s:
                raise StorageError(
                    f"{uri}: short read at bytes [{s}, {e}): got {len(b)} bytes; "
                    "the file was truncated or changed while reading"
                )
        self.counters.add_read(role, sum(e - s for s, e in reqs), len(reqs))
        return [slice_from_requests(reqs, bufs, s, e) for s, e in ranges]

    def read_object(self, uri: str, role: Role, max_bytes: int | None = None) -> bytes:
        """A whole (small) object, e.g. ``config.json``, refused before reading when larger than
        ``max_bytes`` (default :data:`mergepipe.limits.MAX_OBJECT_BYTES`; see :mod:`mergepipe.limits`).

        Raises:
            NotFoundError: no such object.
            InputError: larger than ``max_bytes``.
        """
        from mergepipe.limits import MAX_OBJECT_BYTES, check_size

        size = self.stat(uri).size
        check_size(size, MAX_OBJECT_BYTES if max_bytes is None else max_bytes, uri, "object")
        return self.read_range(uri, 0, size, role) if size else b""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """URIs of objects under ``prefix`` (a folder), recursively, sorted."""

    # --- writes -------------------------------------------------------------------------
    def make_prefix(self, uri: str) -> None:  # noqa: B027 (a no-op by default: object stores have no folders)
        """Prepare ``uri`` for writers to create objects under it: a local folder is created;
        object stores have no folders, so nothing happens."""

    def sync_prefix(self, uri: str, *, through: str) -> None:  # noqa: B027 (object stores: nothing to do)
        """Make durable the names of everything written under prefix ``uri`` and of ``uri``
        itself and its parent prefixes up to ``through`` (``through`` included, as a name in its
        own parent), before a commit publishes them. Local storage fsyncs each of those folders
        strictly; object stores have no folders and a PUT is durable once acknowledged, so
        nothing happens.

        Raises:
            OSError: local storage, a folder cannot be opened or fsync'd.
            ValueError: ``through`` is not ``uri`` or one of its parents.
        """

    @abc.abstractmethod
    def open_writer(self, uri: str, role: Role = "output") -> Writer:
        """A sequential writer creating ``uri`` (which must not be visible as committed)."""

    @abc.abstractmethod
    def put_object(
        self, uri: str, data: bytes, role: Role = "output", *, if_none_match: bool = False, durable: bool = False
    ) -> None:
        """Write a whole small object. With ``if_none_match`` the write is a conditional
        create and raises :class:`PreconditionFailed` when ``uri`` exists. ``durable`` (a
        commit's manifest): the write must survive a crash once this returns, else it raises;
        local storage then fsyncs the folder strictly, object stores ignore it (a PUT is durable
        once acknowledged)."""

    @abc.abstractmethod
    def delete(self, uri: str) -> None:
        """Delete one object or, for a local folder, the whole tree. Missing is not an error."""


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def local_path(uri: str) -> str | None:
    """The local filesystem path ``uri`` names, or None when a storage routes it elsewhere (an
    ``s3://`` object prefix, a ``stack://`` view): how a caller without a storage asks whether
    ``uri`` is a local file or folder (e.g. to load a tokenizer with transformers, or to list a
    crashed run's staging folder). A ``file://`` URI gives its path."""
    uri = str(uri)
    if is_s3(uri) or uri.startswith("stack://"):
        return None
    return uri[len("file://") :] if uri.startswith("file://") else uri
