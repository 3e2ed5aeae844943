"""The operator's object-storage calls (write a plan, read a manifest, HEAD the outputs) over the
core's storage layer (:mod:`mergepipe.storage`): one S3 client, with the core's retries, error
mapping and endpoint/credential handling, serves both these calls and planning."""

from __future__ import annotations

from typing import Any

from mergepipe.commit.manifest import (
    MANIFEST_NAME,  # "manifest.json" under the snapshot URI
)
from mergepipe.storage.base import IOCounters, NotFoundError, Storage
from mergepipe.storage.routing import open_storage


def join(prefix: str, name: str) -> str:
    """``prefix`` + ``/`` + ``name`` with exactly one slash between them."""
    return prefix.rstrip("/") + "/" + name.lstrip("/")


def manifest_uri(snapshot_uri: str) -> str:
    """The URI of a snapshot's ``manifest.json``."""
    return join(snapshot_uri, MANIFEST_NAME)


class ObjectStore:
    """Whole-object reads and writes through a core :class:`~mergepipe.storage.base.Storage`.

    Args:
        storage: the core storage to use; default: ``open_storage`` with ``endpoint`` (the region
            and credentials come from the environment, ``AWS_*``, as for every core S3 client).
        endpoint: S3 endpoint URL (``None``: AWS).

    Errors: :class:`mergepipe.storage.base.StorageError` (e.g. ``S3Error`` after the core's
    retries) for anything but a missing object.
    """

    def __init__(self, storage: Storage | None = None, *, endpoint: str | None = None):
        self.storage: Any = (
            storage if storage is not None else open_storage(None, IOCounters(), endpoint_url=endpoint or None)
        )

    def get(self, uri: str) -> bytes | None:
        """The object's bytes, or ``None`` when there is no such object."""
        try:
            return self.storage.read_object(uri, "other")
        except NotFoundError:
            return None

    def head_size(self, uri: str) -> int | None:
        """The object's size in bytes, or ``None`` when there is no such object."""
        try:
            return int(self.storage.stat(uri).size)
        except NotFoundError:
            return None

    def put(self, uri: str, data: bytes) -> None:
        """Write ``data`` as the object at ``uri`` (replacing it)."""
        self.storage.put_object(uri, data, "other")
