"""A storage that routes each URI to its backend (local paths vs ``s3://``), sharing one set of
byte counters, so a merge may read a local base and S3 experts and write anywhere;
:func:`open_storage` makes one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mergepipe.storage.base import Capabilities, IOCounters, ObjectStat, Role, Storage, Writer, is_s3
from mergepipe.storage.local import LocalStorage


class RoutingStorage(Storage):
    """Dispatches every call by URI scheme to a :class:`LocalStorage` or a lazily created
    :class:`S3Storage` (``s3_kwargs`` are passed to it). ``max_gap`` is that of the backends in
    use; use :meth:`gap_for` for a set of URIs."""

    def __init__(self, counters: IOCounters | None = None, **s3_kwargs) -> None:
        super().__init__(counters)
        self.local = LocalStorage(self.counters)
        self._s3 = None
        self._stack: Storage | None = None
        self._s3_kwargs = s3_kwargs

    @property
    def s3(self):
        if self._s3 is None:
            from mergepipe.storage.s3 import S3Storage  # boto3: loaded on first s3:// URI

            self._s3 = S3Storage(counters=self.counters, **self._s3_kwargs)
        return self._s3

    @property
    def stack(self) -> Storage:
        """Stacked views (``stack://``, :mod:`mergepipe.stack`), read through this storage."""
        if self._stack is None:
            from mergepipe.stack import StackStorage

            self._stack = StackStorage(self)
        return self._stack

    def backend(self, uri: str) -> Storage:
        if str(uri).startswith("stack://"):
            return self.stack
        return self.s3 if is_s3(uri) else self.local

    def capabilities(self, uri: str) -> Capabilities:
        return self.backend(uri).capabilities(uri)

    def gap_for(self, uris: Sequence[str]) -> int:
        """The coalescing gap (bytes) the backends of ``uris`` read with (the largest)."""
        return max((self.backend(u).max_gap for u in uris), default=0)

    @property
    def max_gap(self) -> int:  # type: ignore[override]
        return self.s3.max_gap if self._s3 is not None else self.local.max_gap

    def join(self, root: str, *names: str) -> str:  # type: ignore[override]
        return self.backend(root).join(root, *names)

    def stat(self, uri: str) -> ObjectStat:
        return self.backend(uri).stat(uri)

    def _fetch(self, uri: str, requests):
        return self.backend(uri)._fetch(uri, requests)

    def read_ranges(self, uri: str, ranges, role: Role, max_gap: int | None = None):
        return self.backend(uri).read_ranges(uri, ranges, role, max_gap=max_gap)

    def read_range(self, uri: str, start: int, end: int, role: Role) -> bytes:
        return self.backend(uri).read_range(uri, start, end, role)

    def read_object(self, uri: str, role: Role, max_bytes: int | None = None) -> bytes:
        return self.backend(uri).read_object(uri, role, max_bytes)

    def exists(self, uri: str) -> bool:
        return self.backend(uri).exists(uri)

    def list(self, prefix: str) -> Iterator[str]:
        return self.backend(prefix).list(prefix)

    def open_writer(self, uri: str, role: Role = "output") -> Writer:
        return self.backend(uri).open_writer(uri, role)

    def make_prefix(self, uri: str) -> None:
        return self.backend(uri).make_prefix(uri)

    def sync_prefix(self, uri: str, *, through: str) -> None:
        return self.backend(uri).sync_prefix(uri, through=through)

    def put_object(
        self, uri: str, data: bytes, role: Role = "output", *, if_none_match: bool = False, durable: bool = False
    ) -> None:
        return self.backend(uri).put_object(uri, data, role, if_none_match=if_none_match, durable=durable)

    def delete(self, uri: str) -> None:
        return self.backend(uri).delete(uri)

    def probe_conditional_writes(self, prefix_uri: str) -> bool:
        return self.backend(prefix_uri).probe_conditional_writes(prefix_uri)


def open_storage(uri: str | None = None, counters: IOCounters | None = None, **kwargs) -> Storage:
    """A storage for any URI: a :class:`RoutingStorage` sending local paths to
    :class:`~mergepipe.storage.local.LocalStorage` and ``s3://`` URIs to
    :class:`~mergepipe.storage.s3.S3Storage` (created on first use, with ``kwargs``), all counted
    in one :class:`~mergepipe.storage.base.IOCounters`. ``uri`` is accepted for symmetry and not
    used: one storage serves every URI."""
    return RoutingStorage(counters=counters, **kwargs)
