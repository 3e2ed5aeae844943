"""Local filesystem storage: ``os.pread`` ranged reads on a thread pool, fsync'd writers."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mergepipe.errors import InputError
from mergepipe.storage.base import (
    Capabilities,
    NotFoundError,
    ObjectStat,
    PreconditionFailed,
    Role,
    Storage,
    StorageError,
    Writer,
)


def _path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else str(uri)


def fsync_folder(folder: str | os.PathLike[str], *, strict: bool) -> None:
    """Make the names in ``folder`` durable: a file created, renamed, linked or removed in it
    survives a crash only once the folder itself is fsync'd (POSIX ``fsync(2)`` on a directory
    descriptor; cf. ``rename(2)`` and the ext4/XFS guidance that an atomic replace is
    write + fsync(file) + rename + fsync(folder)).

    Args:
        folder: path of a folder (``str`` or ``os.PathLike``).
        strict: ``True`` where a commit's durability depends on it (a published snapshot, a
            search state): any failure raises. ``False`` for best effort: a folder that cannot be
            opened or fsync'd (some network and FUSE file systems refuse ``fsync`` on folders) is
            left as it is and nothing is raised.

    Raises:
        OSError: only with ``strict``, when ``folder`` cannot be opened or fsync'd.
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


def _link_refusal(path: str, what: str) -> InputError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return InputError(
        f"{path}: the {what} is a symbolic link (to {target}); mergepipe never writes through a link it "
        "did not create. Remove the link and rerun."
    )


def open_for_write(path: str | os.PathLike[str], flags: int, mode: int = 0o644, *, what: str = "file") -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)`` for writing, the one way mergepipe opens a
    local file it writes (locks, staging, records, outputs, manifests, plans, state files): a
    symbolic link at ``path`` (planted by someone else) is refused, never followed, and what was
    opened must be a regular file (checked with ``fstat`` on the descriptor). Pass ``O_CREAT |
    O_EXCL`` where the file is created.

    Args:
        flags: ``os.O_*`` access and creation flags (e.g. ``O_WRONLY | O_CREAT | O_EXCL``).
        what: names the file in the error (``"lock file"``, ``"manifest"``...).

    Returns:
        An open file descriptor (the caller closes it).

    Raises:
        InputError: ``path`` is a symbolic link or not a regular file (one line naming it).
        OSError: any other failure (``FileExistsError`` with ``O_EXCL``...).
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if os.path.islink(p):  # ELOOP, or EEXIST for O_EXCL on a link
            raise _link_refusal(p, what) from None
        raise e
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{p}: the {what} is not a regular file; remove it and rerun.")
    return fd


def write_new_file(path: str | os.PathLike[str], data: bytes, *, what: str = "file", fsync: bool = True) -> None:
    """Create ``path`` (exclusively, never through a link: :func:`open_for_write`) holding ``data``.

    Raises:
        InputError: a link or non-regular file is at ``path``.
        FileExistsError: ``path`` exists.
    """
    fd = open_for_write(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what=what)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike[str], data: bytes, *, what: str = "file", durable: bool = False) -> None:
    """Replace ``path`` atomically with ``data``: a new hidden file in the same folder (created
    exclusively, fsync'd), then ``rename(2)`` onto ``path``; a link at ``path`` is refused (a
    rename would replace the link, not write through it, but someone planted it). ``durable``:
    the folder is fsync'd strictly afterwards (:func:`fsync_folder`).

    Raises:
        InputError: a symbolic link or a folder is at ``path``.
        OSError: the write, rename or (``durable``) folder fsync fails.
    """
    p = os.fspath(path)
    if os.path.islink(p):
        raise _link_refusal(p, what)
    if os.path.isdir(p):
        raise InputError(f"{p}: the {what} is a folder; give a file path.")
    folder = os.path.dirname(p) or "."
    tmp = os.path.join(folder, f".{os.path.basename(p)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    write_new_file(tmp, data, what=what)
    try:
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(folder, strict=durable)


def ensure_folder(path: str | os.PathLike[str], *, what: str = "folder") -> None:
    """Create folder ``path`` (and its parents) unless it exists; refuse a symbolic link at
    ``path`` itself (files created under it would land in the link's target).

    Raises:
        InputError: ``path`` is a link or a file.
    """
    p = os.fspath(path)
    if os.path.islink(p):
        raise _link_refusal(p, what)
    if os.path.lexists(p) and not os.path.isdir(p):
        raise InputError(f"{p}: the {what} is a file, not a folder; remove it and rerun.")
    os.makedirs(p, exist_ok=True)


def fresh_folder(path: str | os.PathLike[str]) -> None:
    """Remove whatever is at ``path`` without following links (a link or file is unlinked, a
    folder removed with its content) and create an empty folder there (mode 0700)."""
    p = os.fspath(path)
    if os.path.islink(p) or (os.path.lexists(p) and not os.path.isdir(p)):
        os.unlink(p)
    elif os.path.isdir(p):
        shutil.rmtree(p)
    os.mkdir(p, 0o700)


class LocalWriter(Writer):
    """Writes one file sequentially; ``close()`` fsyncs it. ``copy_range`` reads from the source
    file (counted under ``base``) since a local copy cannot skip the page cache anyway."""

    def __init__(self, storage: LocalStorage, uri: str, role: Role) -> None:
        self.storage, self.uri, self.role = storage, uri, role
        p = _path(uri)
        d = os.path.dirname(p) or "."
        if not os.path.isdir(d):
            # never recreated: a folder that vanished mid-run (a staging folder removed by someone
            # else) must fail the run, not yield a half-empty output (see mergepipe.commit.manifest)
            raise StorageError(f"{uri}: folder {d} does not exist (removed while writing?); nothing was committed.")
        self._f = os.fdopen(open_for_write(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="output file"), "wb")
        self._n = 0

    def write(self, data) -> None:
        self._f.write(data)
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._n += n
        self.storage.counters.add_write(self.role, n)

    def copy_range(self, src_uri: str, start: int, end: int) -> None:
        self.write(self.storage.read_range(src_uri, start, end, "base"))

    def close(self) -> int:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._n

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            try:
                os.unlink(_path(self.uri))
            except OSError:
                pass


class LocalStorage(Storage):
    """Files on a local (or mounted) filesystem.

    Reads use ``os.pread`` with a small thread pool (reads release the GIL); exactly-adjacent
    ranges coalesce (``max_gap=0``), so realized bytes equal the bytes of the requested ranges.
    """

    max_gap = 0

    def capabilities(self, uri: str) -> Capabilities:
        """Folders with rename/flock/fsync; files are created exclusively, so a torn one must be
        removed before it is rewritten; no server-side copy."""
        return Capabilities(folders=True, atomic_replace=False)

    def __init__(self, counters=None, *, threads: int = 4, max_gap: int = 0) -> None:
        super().__init__(counters)
        self.max_gap = max_gap
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def join(root: str, *names: str) -> str:
        """``root/name...`` after the path policy (:mod:`mergepipe.paths`): every name relative
        and normalised, and the joined path resolving inside ``root`` (no symlink escape).

        Raises:
            InputError: a name breaks the policy or leads out of ``root`` through a symlink.
        """
        from mergepipe.paths import check_inside, check_name

        r = _path(root)
        for n in names:
            check_name(n, f"{root}: name")
        if not names:
            return r
        p = os.path.join(r, *names)
        check_inside(r, p, f"{root}: name {'/'.join(names)!r}")
        return p

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mergepipe-read")
            return self._pool

    def stat(self, uri: str) -> ObjectStat:
        try:
            st = os.stat(_path(uri))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{uri}: no such file") from None
        except OSError as e:  # a name too long, a loop of links, no permission: one line, not a traceback
            shown = uri if len(uri) <= 200 else uri[:120] + "..." + uri[-60:]
            raise StorageError(f"{shown}: cannot be read ({e.strerror}); check the path.") from None
        if not os.path.isfile(_path(uri)):
            raise NotFoundError(f"{uri}: not a regular file")
        # mtime alone does not tell two files apart: a script writing two same-layout checkpoints in
        # one clock tick gives them one size, mtime and header; the inode does (and a file replaced
        # in place by a new one gets a new inode even with its mtime restored)
        return ObjectStat(size=st.st_size, version=f"{st.st_mtime_ns}.{st.st_dev}.{st.st_ino}")

    def _fetch(self, uri: str, requests: Sequence[tuple[int, int]]) -> list[bytes]:
        p = _path(uri)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(f"{uri}: no such file") from None
        except OSError as e:
            raise StorageError(f"{uri}: cannot open for reading ({e.strerror})") from None
        try:

            def one(req):
                # os.pread fills a fresh bytes object (no zero-fill pass, unlike bytearray(n))
                s, e = req
                data = os.pread(fd, e - s, s)
                if len(data) == e - s or not data:
                    return data
                parts, pos = [data], s + len(data)
                while pos < e:
                    d = os.pread(fd, e - pos, pos)
                    if not d:
                        break
                    parts.append(d)
                    pos += len(d)
                return b"".join(parts)

            if len(requests) == 1:
                return [one(requests[0])]
            return list(self._executor().map(one, requests))
        finally:
            os.close(fd)

    def list(self, prefix: str) -> Iterator[str]:
        root = _path(prefix)
        out = []
        for dp, _, fns in os.walk(root):
            for fn in fns:
                out.append(os.path.join(dp, fn))
        yield from sorted(out)

    def open_writer(self, uri: str, role: Role = "output") -> Writer:
        """A writer creating file ``uri`` (exclusive create) in an existing folder: writers never
        create folders (see :meth:`make_prefix`)."""
        return LocalWriter(self, uri, role)

    def make_prefix(self, uri: str) -> None:
        """Create folder ``uri`` (and its parents) so writers can create files under it; a
        symbolic link at ``uri`` is refused (:func:`ensure_folder`)."""
        ensure_folder(_path(uri), what="output folder")

    def sync_prefix(self, uri: str, *, through: str) -> None:
        """fsync (strictly, :func:`fsync_folder`) every folder under ``uri`` bottom-up, then the
        parents of ``uri`` up to the folder holding ``through``; see
        :meth:`mergepipe.storage.base.Storage.sync_prefix`."""
        top, last = os.path.abspath(_path(uri)), os.path.abspath(_path(through))
        stop = os.path.dirname(last)
        if os.path.commonpath([top, last]) != last or last == stop:
            raise ValueError(f"sync_prefix: {through} is not {uri} or one of its parents")

        def fail(e: OSError) -> None:
            raise e

        for folder, _dirs, _files in os.walk(top, topdown=False, onerror=fail):
            fsync_folder(folder, strict=True)
        folder = top
        while folder != stop:
            folder = os.path.dirname(folder)
            fsync_folder(folder, strict=True)

    def put_object(
        self, uri: str, data: bytes, role: Role = "output", *, if_none_match: bool = False, durable: bool = False
    ) -> None:
        """Write object ``uri`` whole: readers see either no object or all of ``data``, never a
        prefix of it (the bytes go to a hidden temporary file in the same folder first, then are
        published by ``link`` -- fails if ``uri`` exists -- or ``replace``). The file is always
        fsync'd; the folder afterwards (so the new name survives a crash) is fsync'd best effort,
        or strictly with ``durable`` (:func:`fsync_folder`).

        With ``durable`` (a commit's manifest) the folder is fsync'd once before the name is
        published, so a file system that refuses folder fsync fails the write while nothing is
        visible; if the fsync after publishing fails, an object created with ``if_none_match`` is
        removed again (a ``replace`` cannot be undone: the new bytes stay, not known durable).

        Raises:
            PreconditionFailed: ``if_none_match`` and ``uri`` already exists (S3's
                ``If-None-Match: *`` answered 412).
            InputError: ``uri`` or its folder is a symbolic link (never written through).
            OSError: ``durable`` and the folder cannot be fsync'd.
        """
        p = _path(uri)
        if os.path.islink(p):
            raise _link_refusal(p, "object")
        folder = os.path.dirname(p) or "."
        ensure_folder(folder)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.", suffix=".tmp", dir=folder)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, 0o644)
                os.fsync(fd)
            finally:
                os.close(fd)
            if durable:
                fsync_folder(folder, strict=True)  # refused here: nothing published yet
            if if_none_match:
                try:
                    os.link(tmp, p)  # atomic create-if-absent with the full content
                except FileExistsError:
                    raise PreconditionFailed(f"{uri}: already exists") from None
            else:
                os.replace(tmp, p)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        try:
            fsync_folder(folder, strict=durable)
        except OSError:
            if if_none_match:  # ours (created just now): a commit that failed publishes nothing
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            raise
        self.counters.add_write(role, len(data))

    def delete(self, uri: str) -> None:
        p = Path(_path(uri))
        if p.is_dir() and not p.is_symlink():  # a link is removed itself, never its target
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
