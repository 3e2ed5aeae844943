"""The engine's writer: a thread that writes output shards from typed messages and hashes them.

The executor sends, per output shard, :class:`OpenShard` (the header), then per tensor its
bytes (:class:`TensorBytes`, or one :class:`CopyRange` for a server-side copy) and
:class:`EndTensor`, and finally :class:`CloseShard`. :class:`BaseBytes` carries a merged
tensor's base bytes, which are hashed (to check them against the catalog's SHA-256) but not
written. The writer thread does all hashing (hashlib releases the GIL, so on a multi-core
machine it runs beside the merge arithmetic): every output byte is hashed once, and a copied
tensor's bytes once for both its base and output digests. Shards are identified by their
*tree digest* (:func:`tree_digest`), which needs no second pass over the file.

Messages wait in a queue bounded in bytes (:class:`ByteQueue`), so a slow store holds the
merge back instead of letting finished bytes pile up in memory.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mergepipe.errors import InputError
from mergepipe.planner.plan import TensorPlan
from mergepipe.storage.base import Storage, Writer

Buffer = bytes | memoryview


# ---- messages --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpenShard:
    """Start output shard ``name`` (a file under the output prefix) with its ``header`` bytes."""

    name: str
    header: bytes


@dataclass(frozen=True, slots=True)
class BaseBytes:
    """The next base bytes of merged tensor ``tensor``: hashed, not written."""

    tensor: str
    data: Buffer


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """The next output bytes of tensor ``tensor``: hashed and appended to the open shard."""

    tensor: str
    data: Buffer


@dataclass(frozen=True, slots=True)
class CopyRange:
    """Tensor ``tensor`` is bytes ``[start, end)`` of ``src``, copied by the store; ``sha256``
    is their known digest (the catalog's)."""

    tensor: str
    sha256: str
    src: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class EndTensor:
    """All bytes of tensor ``tp`` were sent; ``copied``: its output bytes are its base bytes."""

    tp: TensorPlan
    copied: bool


@dataclass(frozen=True, slots=True)
class CloseShard:
    """Output shard ``name`` is complete: make it durable and record its size and tree digest."""

    name: str


WriterMessage = OpenShard | BaseBytes | TensorBytes | CopyRange | EndTensor | CloseShard


# ---- helpers ---------------------------------------------------------------------------------
class Digest(Protocol):
    """What the writer keeps per tensor: a running SHA-256 or a digest known in advance."""

    def update(self, data: Buffer, /) -> None: ...

    def hexdigest(self) -> str: ...


class _KnownHash:
    """A finished hash known in advance (a base tensor's SHA-256 from the catalog)."""

    def __init__(self, hexdigest: str) -> None:
        self._h = hexdigest

    def update(self, data: Buffer, /) -> None:
        raise TypeError("a known digest takes no more bytes")

    def hexdigest(self) -> str:
        return self._h


def tree_digest(tree: dict) -> str:
    """The *tree digest* of a safetensors shard: SHA-256 of the canonical JSON
    ``{"header_sha256": …, "tensors": [[name, sha256 of its bytes], …]}`` in file order. Unlike a
    whole-file SHA-256 it can be computed for shards whose unchanged tensors were copied
    server-side (from the base tensors' digests), and it identifies the same bytes."""
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ByteQueue:
    """A FIFO of ``(message, nbytes)`` bounded by the bytes it holds (a message counts from
    :meth:`put` until the consumer calls :meth:`done`). One message larger than the bound is
    let through when the queue is empty. :meth:`fail` (consumer died or producer gave up)
    releases every waiter: puts return at once, :meth:`get` returns ``(None, 0)``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.items: deque[tuple[WriterMessage | None, int]] = deque()
        self.cv = threading.Condition()
        self.failed = False

    def put(self, msg: WriterMessage | None, nbytes: int = 0) -> None:
        with self.cv:
            while not self.failed and self.used > 0 and self.used + nbytes > self.limit:
                self.cv.wait()
            if self.failed:
                return
            self.used += nbytes
            self.items.append((msg, nbytes))
            self.cv.notify_all()

    def get(self) -> tuple[WriterMessage | None, int]:
        with self.cv:
            while not self.items and not self.failed:
                self.cv.wait()
            if self.failed:
                return None, 0
            return self.items.popleft()

    def done(self, nbytes: int) -> None:
        with self.cv:
            self.used -= nbytes
            self.cv.notify_all()

    def fail(self) -> None:
        with self.cv:
            self.failed = True
            self.items.clear()
            self.cv.notify_all()


# ---- the writer ------------------------------------------------------------------------------
class ShardWriter:
    """Writes output shards under ``out_prefix`` from :data:`WriterMessage`\\ s on its own thread.

    Args:
        out_storage: where shards are written (role ``output``).
        out_prefix: the staging folder or run prefix.
        queue_bytes: bound on the bytes of messages waiting to be written.
        base_file_uri: base shard URI of a file name (for error messages).
        on_close: called on the writer thread after a shard is closed (durable), with its name,
            ``{"size", "tree_sha256"}`` and its base tensors' SHA-256 (name -> hex).

    After :meth:`finish`: ``files`` maps each shard to ``{"size": bytes, "tree_sha256": hex}``
    and :meth:`base_tensor_sha256` gives the SHA-256 of every base tensor that passed through.

    Raises (from :meth:`send` or :meth:`finish`, whatever the thread raised):
        InputError: a base tensor's bytes differ from the catalog's SHA-256 (stale catalog).
        StorageError: a write failed.
    """

    def __init__(
        self,
        out_storage: Storage,
        out_prefix: str,
        queue_bytes: int,
        base_file_uri: Callable[[str], str],
        on_close: Callable[[str, dict, dict[str, str]], None] | None = None,
    ) -> None:
        self.out_storage, self.out_prefix, self.base_file_uri = out_storage, out_prefix, base_file_uri
        self.files: dict[str, dict] = {}
        self.on_close = on_close
        self._q = ByteQueue(queue_bytes)
        self._err: list[BaseException] = []
        self._writers: dict[str, Writer] = {}
        self._cur: Writer | None = None
        self._base_sha: dict[str, Digest] = {}
        self._out_sha: dict[str, Digest] = {}
        self._tree: dict[str, dict] = {}
        self._thread = threading.Thread(target=self._run, name="mergepipe-writer", daemon=True)
        self._thread.start()

    def send(self, msg: WriterMessage, nbytes: int = 0) -> None:
        """Queue ``msg`` holding ``nbytes`` (waits while the queue is full)."""
        self._raise()
        self._q.put(msg, nbytes)
        self._raise()

    def finish(self) -> None:
        """Wait until everything sent is written."""
        self._raise()
        self._q.put(None)
        self._thread.join()
        self._raise()

    def abort(self) -> None:
        """Stop the thread and discard every shard not closed; never raises."""
        self._q.fail()
        self._thread.join(timeout=60)
        for f, w in self._writers.items():
            if f not in self.files:
                w.abort()

    def base_tensor_sha256(self) -> dict[str, str]:
        return {k: v.hexdigest() for k, v in self._base_sha.items()}

    def _open(self) -> Writer:
        if self._cur is None:
            raise RuntimeError("writer protocol: tensor bytes before OpenShard")
        return self._cur

    def _raise(self) -> None:
        if self._err:
            raise self._err[0]

    def _run(self) -> None:
        try:
            while True:
                msg, nb = self._q.get()
                if msg is None:
                    break
                self._handle(msg)
                self._q.done(nb)
        except BaseException as e:  # surfaced to the main thread
            self._err.append(e)
            self._q.fail()  # the producer never blocks on a dead consumer

    def _handle(self, msg: WriterMessage) -> None:
        match msg:
            case OpenShard(name, header):
                uri = self.out_storage.join(self.out_prefix, name)
                self._cur = self.out_storage.open_writer(uri, "output")
                self._writers[name] = self._cur
                self._tree[name] = {"header_sha256": hashlib.sha256(header).hexdigest(), "tensors": []}
                self._cur.write(header)
            case BaseBytes(tensor, data):
                self._base_sha.setdefault(tensor, hashlib.sha256()).update(data)
            case TensorBytes(tensor, data):
                self._out_sha.setdefault(tensor, hashlib.sha256()).update(data)
                self._open().write(data)
            case CopyRange(tensor, sha256, src, start, end):
                self._out_sha[tensor] = _KnownHash(sha256)
                self._open().copy_range(src, start, end)
            case EndTensor(tp, copied):
                h = self._out_sha[tp.name]
                if copied:  # the output bytes are the base bytes
                    self._base_sha[tp.name] = h
                if (
                    tp.base_sha256
                    and tp.name in self._base_sha
                    and self._base_sha[tp.name].hexdigest() != tp.base_sha256
                ):
                    raise InputError(
                        f"{self.base_file_uri(tp.file)}: tensor {tp.name!r} of the base changed since it "
                        "was analyzed (content hash differs); re-run the merge to re-analyze it."
                    )
                self._tree[tp.file]["tensors"].append([tp.name, h.hexdigest()])
            case CloseShard(name):
                size = self._writers[name].close()
                self.files[name] = {"size": size, "tree_sha256": tree_digest(self._tree[name])}
                if self.on_close is not None:
                    tensors = [t for t, _ in self._tree[name]["tensors"]]
                    base = {t: self._base_sha[t].hexdigest() for t in tensors if t in self._base_sha}
                    self.on_close(name, self.files[name], base)
            case _:
                raise TypeError(f"unknown writer message {msg!r}")
