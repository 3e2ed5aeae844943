"""Commit targets: one protocol (exists, stage, publish, verify) for the two ways a snapshot is
published, chosen from what the storage declares (:class:`mergepipe.storage.base.Capabilities`).

* :class:`FolderTarget` (storage with folders: local files): a run is staged in a hidden folder
  beside ``out`` and published by ``rename(2)`` under ``out``'s
  :class:`~mergepipe.commit.manifest.OutputLock` (:mod:`mergepipe.commit.manifest`);
* :class:`PrefixTarget` (object stores, or local storage in object mode): a run is staged under
  ``<out>/runs/<run>/`` and published by a conditional create of ``<out>/manifest.json``
  (:mod:`mergepipe.commit.objectstore`).

Callers (:mod:`mergepipe.parts`, the CLI) never branch on the URI scheme: they ask
:func:`commit_target` for the target of ``out``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mergepipe.commit import objectstore as obj, ownership, runs
from mergepipe.commit.manifest import OutputLock, check_output, publish_local, read_manifest, verify_snapshot
from mergepipe.storage.base import Storage


class CommitTarget(abc.ABC):
    """Where and how a snapshot at ``out`` is committed.

    Attributes:
        storage: the storage that writes ``out``.
        out: the snapshot location (folder or ``s3://`` prefix).
        kind: the ownership record kind of its runs (``run-folder`` or ``run-prefix``).
    """

    kind: ownership.Kind

    def __init__(self, storage: Storage, out: str) -> None:
        self.storage, self.out = storage, str(out)

    @abc.abstractmethod
    def committed(self, plan_digest: str | None, inputs: Sequence[str] = ()) -> tuple[dict, str] | None:
        """*exists*: (manifest, manifest hash) when ``out`` holds this plan's snapshot (any
        snapshot when ``plan_digest`` is None), None when it is free.

        Raises:
            InputError: ``out`` holds another plan's snapshot or is unusable.
        """

    def run(self, run: str) -> runs.RunLayout:
        """*stage*: where run ``run`` of ``out`` writes its files and records."""
        return runs.run_layout(self.storage, self.out, run, self.kind == "run-prefix")

    #: a single-process run (:func:`mergepipe.parts.execute_single`) of this target has its own
    #: run, named after its plan and held exclusively (folders: ``out``'s lock for the whole run,
    #: so a rerun finds and reuses it); False: a fresh run per attempt (object stores, whose
    #: writers share no lock: concurrent writers never share a prefix, the loser's is deleted)
    exclusive_runs: bool = False

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold ``out`` against every other writer while a single-process run executes and
        commits (folders: ``out``'s :class:`~mergepipe.commit.manifest.OutputLock`, which
        :meth:`publish` then reuses). Object stores: nothing (the conditional create decides).

        Raises:
            CommitConflict: another live writer holds ``out`` (the message names it).
        """
        yield

    def prepare(self, unsafe_single_writer: bool = False) -> None:  # noqa: B027 (folders: nothing to check)
        """Check, before any work, that a commit to ``out`` can be made safe (object stores:
        conditional writes are enforced, :func:`mergepipe.commit.objectstore.require_conditional_writes`)."""

    @abc.abstractmethod
    def publish(self, layout: runs.RunLayout, compose: Callable[[], dict]) -> tuple[dict, str, bool]:
        """*publish*: compose the manifest (``compose()``, which checks the run) and make the
        snapshot visible atomically, excluding ``mergepipe gc``.

        Returns:
            (manifest, manifest hash, won): ``won`` False when an identical snapshot was
            already committed by another writer.

        Raises:
            CommitConflict: the run's files changed, another writer committed a different
                snapshot, or gc claimed the run.
        """

    @abc.abstractmethod
    def verify(self) -> dict:
        """*verify*: re-hash the committed snapshot (``{"ok", "snapshot_id", "manifest_hash",
        "files", "problems"}``)."""


class FolderTarget(CommitTarget):
    """A local folder: staged beside ``out``, published by rename under the output lock."""

    kind: ownership.Kind = "run-folder"
    exclusive_runs = True

    def __init__(self, storage: Storage, out: str) -> None:
        super().__init__(storage, out)
        self._held: OutputLock | None = None

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        Path(self.out).parent.mkdir(parents=True, exist_ok=True)
        with OutputLock(self.out) as lock:
            self._held = lock
            try:
                yield
            finally:
                self._held = None

    def committed(self, plan_digest: str | None, inputs: Sequence[str] = ()) -> tuple[dict, str] | None:
        if check_output(self.out, plan_digest, inputs) is None:
            return None
        return read_manifest(self.out)

    def publish(self, layout: runs.RunLayout, compose: Callable[[], dict]) -> tuple[dict, str, bool]:
        # gc takes the same lock before it deletes a run folder: the check and the rename below
        # cannot interleave with a deletion (mergepipe.commit.ownership)
        if self._held is not None:  # held by exclusive() for the whole run
            manifest = compose()
            return manifest, publish_local(Path(layout.files), self.out, manifest, self._held), True
        with OutputLock(self.out) as lock:
            manifest = compose()
            return manifest, publish_local(Path(layout.files), self.out, manifest, lock), True

    def verify(self) -> dict:
        return verify_snapshot(self.out)


class PrefixTarget(CommitTarget):
    """An object-store prefix: staged under ``runs/<run>/``, published by conditional create."""

    kind: ownership.Kind = "run-prefix"

    def __init__(self, storage: Storage, out: str) -> None:
        super().__init__(storage, out)
        self.unsafe_single_writer = False

    def committed(self, plan_digest: str | None, inputs: Sequence[str] = ()) -> tuple[dict, str] | None:
        if plan_digest is None:
            return obj.read_manifest_obj(self.storage, self.out)
        return obj.check_output_obj(self.storage, self.out, plan_digest)

    def prepare(self, unsafe_single_writer: bool = False) -> None:
        self.unsafe_single_writer = unsafe_single_writer
        obj.require_conditional_writes(self.storage, self.out, unsafe_single_writer)

    def publish(self, layout: runs.RunLayout, compose: Callable[[], dict]) -> tuple[dict, str, bool]:
        return obj.publish_obj(self.storage, self.out, layout.files, compose())

    def verify(self) -> dict:
        return obj.verify_obj(self.storage, self.out)


def commit_target(storage: Storage, out: str, *, object_mode: bool | None = None) -> CommitTarget:
    """The commit target of ``out``: a :class:`FolderTarget` where the storage declares folders,
    else a :class:`PrefixTarget`; ``object_mode=True`` forces the object-store protocol on local
    storage (tests, and stores mounted as folders)."""
    folders = storage.capabilities(str(out)).folders if object_mode is None else not object_mode
    return FolderTarget(storage, out) if folders else PrefixTarget(storage, out)


def verify_any(storage: Storage, snapshot: str) -> dict:
    """Verify a committed snapshot wherever it is: a local folder published by rename, or a
    snapshot whose files live under a run prefix (object stores, or a local object-mode
    snapshot with a ``runs/`` folder)."""
    local_prefix = storage.capabilities(snapshot).folders and (Path(snapshot) / "runs").is_dir()
    return commit_target(storage, snapshot, object_mode=True if local_prefix else None).verify()
