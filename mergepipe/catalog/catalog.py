"""The catalog: registered checkpoints (layout + identity) and per-block task-vector statistics.

Embedded default: one SQLite file, ``$MERGEPIPE_HOME/catalog.sqlite`` (``~/.mergepipe``).

* ``register`` records a checkpoint's layout (all shard headers) and its **identity digest**:
  SHA-256 of, per shard file, its size, its storage version token (local ``mtime_ns``, device and inode, S3
  ETag) and the SHA-256 of its header. Re-registering an unchanged checkpoint only stats its
  files (no byte is read); any change gives a new identity.
* ``analyze`` streams an expert and its base once, with bounded memory (row chunks of at most
  ``chunk_bytes``), and stores :class:`~mergepipe.catalog.stats.TensorStats` per tensor, keyed
  by (base identity, expert identity, block size). A cached analysis is reused without reading.
* **pair statistics** (``analyze(..., pairs=True)``, for model_stock, nuslerp, multislerp and karcher): per tensor,
  the exact cross term ``⟨δᵢ,δⱼ⟩`` between two experts' task vectors (``math.fsum`` of per-row
  float64 sums, like the per-expert sums), keyed by (base identity, the two expert identities
  in sorted order) and independent of the block size. A per-expert analysis cannot give them,
  so they are computed in the same streaming pass as the analyses of the experts that are new;
  when a pair involves an expert analyzed earlier, that expert is streamed again once (counted
  as expert bytes of the analysis) and the pair is cached from then on.
* **sensitivity** (``analyze(..., calibration=...)``, :mod:`mergepipe.catalog.sensitivity`): per
  tensor and block, the mean diagonal empirical Fisher of the *base* on a calibration set, keyed
  by (base identity, calibration identity, block size, kind): computed once, then reused by every
  plan whose block value is ``fisher``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mergepipe.catalog.digest import BLOCK_DIGEST_BYTES, block_digest
from mergepipe.catalog.sketch import PLANES, TIERS, SketchWriter
from mergepipe.catalog.stats import TensorStats, TensorStatsBuilder, pack_stats, unpack_stats
from mergepipe.errors import InputError
from mergepipe.formats.safetensors import (
    FLOAT_DTYPES,
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointLayout,
    layout_from_dict,
    layout_to_dict,
    load_layout,
    read_shard_header,
    rows_per_block,
)
from mergepipe.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_ADAPTER_CONFIG_BYTES,
    AdapterConfig,
    LoraModule,
    adapter_modules,
    delta_rows,
    map_modules,
    parse_adapter_config,
)
from mergepipe.numerics import decode, exact_total, segment_dots
from mergepipe.storage.base import NotFoundError, Storage

DEFAULT_BLOCK_BYTES = 128 * 1024
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
#: bytes of memory one tensor element of a row chunk takes while analyze computes its statistics
#: against one expert: the raw, float32 and float64 copies of base and expert, δ, |δ|, δ², the
#: magnitude keys, octaves and block ids (int64) and the float64 products of the exact sums
#: (counted in ``_analyze_stream`` and ``TensorStatsBuilder.add``: ~86; measured 43 bytes per
#: bf16 base byte, docs/CONCEPTS.md), rounded up
ANALYZE_BYTES_PER_ELEMENT = 96
STATS_VERSION = 6  # 2: exact whole-tensor sums of products; pair statistics; 3: block sketches (sign planes);
# 4: per-block content digests of expert blocks and sketch planes (checked by the engine);
# 5: the rank-1 sketch tier (factors + residual sign plane after the three planes of each tensor);
# 6: one packed statistics blob per expert (stats.pack_stats) instead of one .npz per tensor

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    uri TEXT NOT NULL,
    identity TEXT NOT NULL,
    signature TEXT NOT NULL,
    layout_json TEXT NOT NULL,
    total_bytes INTEGER NOT NULL,
    registered_at REAL NOT NULL,
    PRIMARY KEY (uri, identity)
);
CREATE TABLE IF NOT EXISTS analyses (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    base_identity TEXT NOT NULL,
    expert_identity TEXT NOT NULL,
    block_bytes INTEGER NOT NULL,
    stats_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    seconds REAL NOT NULL,
    bytes_read INTEGER NOT NULL,
    UNIQUE (base_identity, expert_identity, block_bytes, stats_version)
);
CREATE TABLE IF NOT EXISTS expert_stats (
    analysis_id INTEGER PRIMARY KEY REFERENCES analyses(id) ON DELETE CASCADE,
    stats BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS sketches (
    analysis_id INTEGER PRIMARY KEY REFERENCES analyses(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    planes INTEGER NOT NULL,
    uri TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tensor_digests (
    identity TEXT NOT NULL,
    tensor TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (identity, tensor)
);
CREATE TABLE IF NOT EXISTS pair_stats (
    base_identity TEXT NOT NULL,
    expert_a TEXT NOT NULL,
    expert_b TEXT NOT NULL,
    stats_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    dots TEXT NOT NULL,
    PRIMARY KEY (base_identity, expert_a, expert_b, stats_version)
);
CREATE TABLE IF NOT EXISTS sensitivity (
    base_identity TEXT NOT NULL,
    calibration TEXT NOT NULL,
    block_bytes INTEGER NOT NULL,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    seconds REAL NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (base_identity, calibration, block_bytes, kind)
);
"""


def default_home() -> Path:
    """``$MERGEPIPE_HOME`` or ``~/.mergepipe``."""
    return Path(os.environ.get("MERGEPIPE_HOME") or Path.home() / ".mergepipe")


def default_catalog_path() -> Path:
    return default_home() / "catalog.sqlite"


@dataclass
class CheckpointRecord:
    """A registered checkpoint.

    Attributes:
        uri: where it lives.
        identity: identity digest (hex SHA-256), see module docstring.
        signature: per-file ``{name: [size, version]}`` JSON used to detect changes by stat.
        layout: shard headers and tensor locations (of a LoRA adapter: its
            ``adapter_model.safetensors``).
        adapter: for a PEFT LoRA adapter expert, its parsed ``adapter_config.json``
            (:mod:`mergepipe.lora`); None for a full checkpoint.
    """

    uri: str
    identity: str
    signature: dict
    layout: CheckpointLayout
    adapter: AdapterConfig | None = None

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes


@dataclass
class Analysis:
    """Statistics of one expert's task vector against one base, per tensor."""

    id: int
    base_identity: str
    expert_identity: str
    block_bytes: int
    tensors: dict[str, TensorStats]
    seconds: float = 0.0
    bytes_read: int = 0
    #: the expert's block sketches (:mod:`mergepipe.catalog.sketch`): ``{"kind": "sign-planes",
    #: "planes", "uri", "sha256", "bytes"}``; None when the analysis has none
    sketch: dict | None = None


def _signature(storage: Storage, uri: str, files: Sequence[str]) -> dict:
    sig = {}
    for f in files:
        st = storage.stat(storage.join(uri, f))
        sig[f] = [st.size, st.version]
    return sig


def _identity(signature: dict, layout: CheckpointLayout) -> str:
    mat = {
        f: {"size": signature[f][0], "version": signature[f][1], "header_sha256": sh.header_sha256}
        for f, sh in sorted(layout.shards.items())
    }
    return hashlib.sha256(json.dumps(mat, sort_keys=True).encode()).hexdigest()


class Catalog:
    """SQLite catalog. Thread-safe for the simple use here (one connection, a lock).

    Args:
        path: SQLite file; created with its parent folder if missing.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        file = Path(path) if path else default_catalog_path()
        #: Where the catalog lives: the SQLite file (an object-store catalog: its prefix URI).
        self.path: Path | str = file
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(file), check_same_thread=False, timeout=60)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise InputError(
                f"{self.path}: cannot open the catalog ({e}); set MERGEPIPE_HOME or --catalog to a writable location."
            ) from None
        self._lock = threading.Lock()

    def close(self) -> None:
        self.db.close()

    # --- checkpoints ------------------------------------------------------------------------
    def _cached(self, uri: str) -> list[tuple[str, dict, dict]]:
        with self._lock:
            rows = self.db.execute(
                "SELECT identity, signature, layout_json FROM checkpoints WHERE uri=? ORDER BY registered_at DESC",
                (uri,),
            ).fetchall()
        return [(i, json.loads(s), json.loads(lj)) for i, s, lj in rows]

    def register(self, storage: Storage, uri: str, kind: str | None = None) -> CheckpointRecord:
        """Register ``uri`` (idempotent). An unchanged checkpoint costs only ``stat`` calls.

        Args:
            kind: ``"lora"``: a PEFT LoRA adapter folder (``adapter_config.json`` +
                ``adapter_model.safetensors``); ``"checkpoint"``: a full checkpoint; None:
                detected (a folder with an ``adapter_config.json`` and no ``model.safetensors``
                or index is an adapter).

        Raises:
            InputError: not a safetensors checkpoint (nor an adapter), any header/index error, or
                an adapter mergepipe does not support (:func:`mergepipe.lora.parse_adapter_config`).
        """
        uri = uri.rstrip("/") if uri != "/" else uri
        for ident, sig, ld in self._cached(uri):
            files = list(sig)
            if (kind == "lora") != (ADAPTER_CONFIG in sig) and kind is not None:
                continue
            try:
                now = _signature(storage, uri, files)
            except NotFoundError:
                continue
            idx_uri = storage.join(uri, INDEX_NAME)
            idx_known = INDEX_NAME in sig
            if now == sig and (idx_known or ADAPTER_CONFIG in sig or not storage.exists(idx_uri)):
                adapter = None
                if ld.get("adapter_config") is not None:
                    adapter = parse_adapter_config(ld["adapter_config"].encode(), storage.join(uri, ADAPTER_CONFIG))
                return CheckpointRecord(uri, ident, sig, layout_from_dict(ld, root=uri), adapter)
        if kind == "lora" or (
            kind is None
            and storage.exists(storage.join(uri, ADAPTER_CONFIG))
            and not storage.exists(storage.join(uri, SINGLE_NAME))
            and not storage.exists(storage.join(uri, INDEX_NAME))
        ):
            return self._register_adapter(storage, uri)
        layout = load_layout(storage, uri, role="catalog")
        files = list(layout.shards) + ([INDEX_NAME] if layout.sharded else [])
        sig = _signature(storage, uri, files)
        ident = _identity(sig, layout)
        rec = CheckpointRecord(uri, ident, sig, layout)
        self._save_checkpoint(rec)
        return rec

    def _register_adapter(self, storage: Storage, uri: str) -> CheckpointRecord:
        """Register a PEFT LoRA adapter folder: its config (checked) and its weights' header.
        Its identity covers the weights file (as for a checkpoint) and the config's bytes (the
        scale lives there)."""
        cfg_uri = storage.join(uri, ADAPTER_CONFIG)
        try:
            raw = storage.read_object(cfg_uri, "catalog", MAX_ADAPTER_CONFIG_BYTES)
        except NotFoundError:
            raise InputError(
                f"{uri}: no {ADAPTER_CONFIG}; a LoRA expert (lora:PATH) is a PEFT adapter folder saved with "
                "save_pretrained()."
            ) from None
        cfg = parse_adapter_config(raw, cfg_uri)
        w_uri = storage.join(uri, ADAPTER_WEIGHTS)
        if not storage.exists(w_uri):
            raise InputError(
                f"{uri}: no {ADAPTER_WEIGHTS}; save the adapter with safetensors (save_pretrained(..., "
                "safe_serialization=True); adapter_model.bin is not read)."
            )
        sh = read_shard_header(storage, w_uri, ADAPTER_WEIGHTS, "catalog")
        layout = CheckpointLayout(root=uri, shards={ADAPTER_WEIGHTS: sh}, tensors=dict(sh.tensors))
        adapter_modules(cfg, layout.tensors, w_uri)
        sig = _signature(storage, uri, [ADAPTER_WEIGHTS, ADAPTER_CONFIG])
        ident = hashlib.sha256(
            json.dumps({"weights": _identity(sig, layout), "adapter_config": cfg.sha256}).encode()
        ).hexdigest()
        rec = CheckpointRecord(uri, ident, sig, layout, cfg)
        self._save_checkpoint(rec)
        return rec

    def _save_checkpoint(self, rec: CheckpointRecord) -> None:
        with self._lock, self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?)",
                (
                    rec.uri,
                    rec.identity,
                    json.dumps(rec.signature),
                    json.dumps(record_layout_dict(rec)),
                    rec.total_bytes,
                    time.time(),
                ),
            )

    def checkpoints(self) -> list[tuple[str, str, int, float]]:
        """(uri, identity, total bytes, registered_at) of every registered checkpoint."""
        with self._lock:
            return self.db.execute(
                "SELECT uri, identity, total_bytes, registered_at FROM checkpoints ORDER BY registered_at"
            ).fetchall()

    # --- analyses ---------------------------------------------------------------------------
    def find_analysis(self, base_identity: str, expert_identity: str, block_bytes: int) -> Analysis | None:
        """The cached analysis, or None. Loads every tensor's statistics."""
        with self._lock:
            row = self.db.execute(
                "SELECT id, seconds, bytes_read FROM analyses WHERE base_identity=? AND expert_identity=? "
                "AND block_bytes=? AND stats_version=?",
                (base_identity, expert_identity, block_bytes, STATS_VERSION),
            ).fetchone()
            if row is None:
                return None
            blob = self.db.execute("SELECT stats FROM expert_stats WHERE analysis_id=?", (row[0],)).fetchone()
            sk = self.db.execute(
                "SELECT kind, planes, uri, sha256, bytes FROM sketches WHERE analysis_id=?", (row[0],)
            ).fetchone()
        return Analysis(
            id=row[0],
            base_identity=base_identity,
            expert_identity=expert_identity,
            block_bytes=block_bytes,
            tensors=self._parse_stats(blob[0] if blob else b"", expert_identity),
            seconds=row[1],
            bytes_read=row[2],
            sketch=dict(zip(("kind", "planes", "uri", "sha256", "bytes"), sk, strict=True)) if sk else None,
        )

    def _parse_stats(self, blob: bytes, expert_identity: str) -> dict[str, TensorStats]:
        """``{tensor: TensorStats}`` from an expert's packed statistics blob (untrusted,
        :func:`~mergepipe.catalog.stats.unpack_stats`).

        Raises:
            InputError: the blob is missing or damaged, naming the catalog, the expert and the fix.
        """
        try:
            return unpack_stats(blob)
        except ValueError as e:
            raise InputError(
                f"{self.path}: the statistics of expert {expert_identity[:12]} are damaged ({e}); run "
                "`mergepipe analyze --force` for this base and expert to recompute them."
            ) from None

    def has_analysis(self, base_identity: str, expert_identity: str, block_bytes: int) -> bool:
        with self._lock:
            return (
                self.db.execute(
                    "SELECT 1 FROM analyses WHERE base_identity=? AND expert_identity=? AND block_bytes=? AND stats_version=?",
                    (base_identity, expert_identity, block_bytes, STATS_VERSION),
                ).fetchone()
                is not None
            )

    def sketch_uri(self, base: str, expert: str, block_bytes: int) -> str:
        """Where the catalog keeps an expert's block sketches: ``sketches/<base identity>/<expert
        identity>-<block bytes>-v<stats version>.sketch`` beside the SQLite file (an absolute
        path: a plan made with a relative catalog path must name the blob as a catalog location,
        :func:`mergepipe.planner.plan.sketch_location`)."""
        from mergepipe.planner.plan import sketch_name

        return str(
            Path(self.path).absolute().parent / sketch_name(base, expert, block_bytes, STATS_VERSION, objects=False)
        )

    def _open_sketch(self, base: str, expert: str, block_bytes: int, spill_bytes: int) -> SketchSink:
        """A sink for an expert's sketch blob, written while it is analysed (see
        :class:`SketchSink`): a hidden temporary file beside the blob's final path."""
        return LocalSketchSink(self.sketch_uri(base, expert, block_bytes), spill_bytes)

    def _store(
        self,
        base: str,
        expert: str,
        block_bytes: int,
        stats: dict[str, TensorStats],
        seconds: float,
        nread: int,
        sk: dict | None = None,
        replace: bool = False,
    ) -> int:
        """Record an analysis; ``sk``: its published sketch blob (:meth:`SketchSink.publish`);
        ``replace``: an analysis of the same key is replaced (SQLite always replaces)."""
        with self._lock, self.db:
            cur = self.db.execute(
                "INSERT OR REPLACE INTO analyses (base_identity, expert_identity, block_bytes, stats_version, created_at, seconds, bytes_read) "
                "VALUES (?,?,?,?,?,?,?)",
                (base, expert, block_bytes, STATS_VERSION, time.time(), seconds, nread),
            )
            aid = cur.lastrowid
            assert aid is not None  # set by the INSERT above
            self.db.execute("INSERT OR REPLACE INTO expert_stats VALUES (?,?)", (aid, pack_stats(stats)))
            if sk is not None:
                self.db.execute(
                    "INSERT OR REPLACE INTO sketches VALUES (?,?,?,?,?,?)",
                    (aid, sk["kind"], sk["planes"], sk["uri"], sk["sha256"], sk["bytes"]),
                )
        return aid

    def analyze(
        self,
        storage: Storage,
        base: CheckpointRecord,
        experts: Sequence[CheckpointRecord],
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[int], None] | None = None,
        pairs: bool = False,
        calibration=None,
        device: str | None = None,
        work_bytes: int | None = None,
        force: bool = False,
        repair: bool = True,
    ) -> list[Analysis]:
        """Analyze each expert against ``base`` (cached ones are not read again, unless ``force``
        or their sketch blob is missing or of the wrong size: then they are analysed again and
        the blob re-created).

        The base is read once for all uncached experts; each chunk of at most ``chunk_bytes``
        base bytes is paired with the same rows of every expert. Memory is bounded by
        ``(1 + K) * chunk_bytes`` plus the float32/float64 temporaries of one chunk (one expert: ~40
        bytes per bf16 base byte of the chunk: ~600 MiB at the default 16 MiB), plus per expert
        ``chunk_bytes`` + 1 MiB for its sketch planes (:class:`~mergepipe.catalog.sketch.SketchWriter`:
        the blob is streamed to storage as blocks are analysed and spills the later planes of a
        large tensor to a temporary file), whatever the experts' size.

        Args:
            work_bytes: memory target in bytes (``mergepipe analyze --work-memory``): row chunks
                of ``work_bytes / ANALYZE_BYTES_PER_ELEMENT`` elements (at least one block;
                fewer with pair statistics, which hold every expert's δ of a chunk) and
                ``work_bytes / 8`` of sketch planes in memory per expert; replaces
                ``chunk_bytes``. The statistics do not depend on the chunking.
            progress: called with the number of bytes read after each chunk.
            pairs: also make sure the pair statistics ``⟨δᵢ,δⱼ⟩`` of every two experts exist
                (see the module docstring; read them with :meth:`pair_dots`).
            calibration: a :class:`~mergepipe.catalog.sensitivity.Calibration`: also make sure
                the base's Fisher sensitivity on it exists (:meth:`sensitivity`).
            device: torch device the sensitivity is computed on (``"cuda"``, ``"cpu"``; default
                CPU).

            force: analyse every expert again (replacing its statistics and sketch blob).
            repair: analyse again the cached analyses whose sketch blob is missing (False: return
                them as they are; :meth:`lost_sketches` names them).

        Raises:
            InputError: an expert lacks a base tensor, or shape/dtype differ (checked for all
                experts before any tensor byte is read); a base or expert tensor holds
                non-finite values (nothing is recorded).
        """

        def run(redo: set[str], cal) -> list[Analysis]:
            return self._analyze(
                storage, base, experts, block_bytes, redo, chunk_bytes=chunk_bytes, progress=progress,
                pairs=pairs, calibration=cal, device=device, work_bytes=work_bytes,
            )  # fmt: skip

        out = run({e.identity for e in experts} if force else set(), calibration)
        lost = {e.identity for e, a in zip(experts, out) if a.sketch and not self._sketch_present(a.sketch)}
        if lost and repair:  # a cached analysis whose sketch blob went missing: analysed again, blob re-created
            out = run(lost, None)
        return out

    def lost_sketches(self, experts: Sequence[CheckpointRecord], analyses: Sequence[Analysis]) -> list[str]:
        """URIs of the experts whose analysis names a sketch blob that is missing or of the wrong
        size (:meth:`analyze` with ``repair`` re-creates them)."""
        return [e.uri for e, a in zip(experts, analyses) if a.sketch and not self._sketch_present(a.sketch)]

    def _sketch_present(self, sk: dict) -> bool:
        """The sketch blob ``sk`` (an analysis' ``sketch`` record) exists with its recorded size."""
        try:
            return os.path.getsize(sk["uri"]) == sk["bytes"]
        except OSError:
            return False

    def _analyze(
        self,
        storage: Storage,
        base: CheckpointRecord,
        experts: Sequence[CheckpointRecord],
        block_bytes: int,
        redo: set[str],
        *,
        chunk_bytes: int,
        progress: Callable[[int], None] | None,
        pairs: bool,
        calibration,
        device: str | None,
        work_bytes: int | None,
    ) -> list[Analysis]:
        """:meth:`analyze`, analysing again the identities in ``redo`` even when cached."""
        todo = [
            e for e in experts if e.identity in redo or not self.has_analysis(base.identity, e.identity, block_bytes)
        ]
        first: dict[str, CheckpointRecord] = {}  # one per identity, the first, in order
        for e in todo:
            first.setdefault(e.identity, e)
        todo = list(first.values())
        self._say_older([e for e in todo if e.identity not in redo], base.identity, block_bytes)
        missing_pairs = self._missing_pairs(base, experts) if pairs else []
        if todo or missing_pairs:
            self._analyze_and_store(
                storage, base, todo, missing_pairs, block_bytes, redo, chunk_bytes, progress, work_bytes
            )
        if not self.tensor_digests(base.identity):
            self._store_digests(base.identity, _hash_tensors(storage, base, list(base.layout.tensors)))
        if calibration is not None:
            self.sensitivity(storage, base, calibration, block_bytes, device=device)
        out = []
        for e in experts:
            found = self.find_analysis(base.identity, e.identity, block_bytes)
            assert found is not None
            out.append(found)
        return out

    def _older_version(self, base_identity: str, expert_identity: str, block_bytes: int) -> int | None:
        """The newest stats version below :data:`STATS_VERSION` of an analysis of this key in
        the catalog (None: none)."""
        with self._lock:
            row = self.db.execute(
                "SELECT MAX(stats_version) FROM analyses WHERE base_identity=? AND expert_identity=? "
                "AND block_bytes=? AND stats_version<?",
                (base_identity, expert_identity, block_bytes, STATS_VERSION),
            ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _say_older(self, todo: Sequence[CheckpointRecord], base_identity: str, block_bytes: int) -> None:
        """One line on stderr when experts about to be analysed have statistics in this catalog
        from an older mergepipe (another stats version): the user sees why a ``plan`` of a
        cached family reads every byte again (once)."""
        old = [v for e in todo if (v := self._older_version(base_identity, e.identity, block_bytes)) is not None]
        if old:
            print(
                f"mergepipe: {self.path} holds the statistics of {len(old)} of these experts in an older format "
                f"(stats version {max(old)}; this mergepipe reads version {STATS_VERSION}): analysing them again, "
                "once (every byte of those experts and of the base is read).",
                file=sys.stderr,
                flush=True,
            )

    def _missing_pairs(
        self, base: CheckpointRecord, experts: Sequence[CheckpointRecord]
    ) -> list[tuple[CheckpointRecord, CheckpointRecord]]:
        """The pairs of distinct experts (first of each identity, in order) without pair statistics."""
        missing: list[tuple[CheckpointRecord, CheckpointRecord]] = []
        uniq = []
        ids = set()
        for e in experts:
            if e.identity not in ids:
                ids.add(e.identity)
                uniq.append(e)
        for i, a in enumerate(uniq):
            for b in uniq[i + 1 :]:
                if self._find_pair(base.identity, *sorted((a.identity, b.identity))) is None:
                    missing.append((a, b))
        return missing

    def _analyze_and_store(
        self,
        storage: Storage,
        base: CheckpointRecord,
        todo: list[CheckpointRecord],
        missing_pairs: list[tuple[CheckpointRecord, CheckpointRecord]],
        block_bytes: int,
        redo: set[str],
        chunk_bytes: int,
        progress: Callable[[int], None] | None,
        work_bytes: int | None,
    ) -> None:
        """One stream over the base and the experts of ``todo`` and ``missing_pairs``
        (:func:`_analyze_stream`); stores each analysis after its sketch blob is published,
        the pair statistics, and the base's tensor digests when not yet known."""
        readers = list(todo)
        for a, b in missing_pairs:
            for e in (a, b):
                if all(e.identity != r.identity for r in readers):
                    readers.append(e)
        check_compatible(base, readers)
        t0 = time.perf_counter()
        before = storage.counters.snapshot()["read"]
        sinks: dict[str, SketchSink] = {}
        try:
            for e in todo:
                spill = chunk_bytes if work_bytes is None else max(1 << 20, work_bytes // 8)
                sinks[e.identity] = self._open_sketch(base.identity, e.identity, block_bytes, spill)
            results, dots, bdig = _analyze_stream(
                storage,
                base,
                readers,
                {e.identity for e in todo},
                block_bytes,
                chunk_bytes,
                progress,
                missing_pairs,
                {i: s.writer for i, s in sinks.items()},
                work_bytes,
            )
            after = storage.counters.snapshot()["read"]
            secs = time.perf_counter() - t0
            nread = sum(after.values()) - sum(before.values())
            for e in todo:
                # the blob is published before the rows that name it: a reader finds an
                # analysis only once its sketch is whole
                sk = sinks.pop(e.identity).publish()
                self._store(
                    base.identity, e.identity, block_bytes, results[e.identity], secs, nread, sk,
                    replace=e.identity in redo,
                )  # fmt: skip
        finally:
            for s in sinks.values():
                s.abort()
        for (a, b), d in dots.items():
            self._store_pair(base.identity, a, b, d)
        if not self.tensor_digests(base.identity):
            bdig.update(_hash_tensors(storage, base, [n for n in base.layout.tensors if n not in bdig]))
            self._store_digests(base.identity, bdig)

    def tensor_digests(self, identity: str) -> dict[str, str]:
        """``{tensor: SHA-256 of its raw bytes}`` of a checkpoint (recorded for bases at analyze
        time, when every base byte is read anyway); ``{}`` when unknown."""
        with self._lock:
            rows = self.db.execute("SELECT tensor, sha256 FROM tensor_digests WHERE identity=?", (identity,)).fetchall()
        return dict(rows)

    def _store_digests(self, identity: str, digests: dict[str, str]) -> None:
        with self._lock, self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO tensor_digests VALUES (?,?,?)", [(identity, n, h) for n, h in digests.items()]
            )

    def pair_dots(
        self, base: CheckpointRecord, experts: Sequence[CheckpointRecord], analyses: Sequence[Analysis] | None = None
    ) -> dict[tuple[int, int], dict[str, float]]:
        """``{(i, j): {tensor: ⟨δᵢ,δⱼ⟩}}`` for expert indices ``i < j`` (after
        ``analyze(..., pairs=True)``). The same checkpoint given twice pairs with itself:
        ``‖δ‖²`` from its analysis.

        Raises:
            InputError: a pair was never computed (run analyze with pairs).
        """
        out = {}
        for i, a in enumerate(experts):
            for j in range(i + 1, len(experts)):
                b = experts[j]
                if a.identity == b.identity and analyses is not None:
                    out[(i, j)] = {n: s.delta_sq for n, s in analyses[i].tensors.items()}
                    continue
                d = self._find_pair(base.identity, *sorted((a.identity, b.identity)))
                if d is None:
                    raise InputError(
                        f"catalog: no pair statistics for {a.uri} and {b.uri}; re-run the merge "
                        "(analyze computes them for model_stock, nuslerp, multislerp and karcher)."
                    )
                out[(i, j)] = d
        return out

    def _find_pair(self, base_identity: str, a: str, b: str) -> dict[str, float] | None:
        with self._lock:
            row = self.db.execute(
                "SELECT dots FROM pair_stats WHERE base_identity=? AND expert_a=? AND expert_b=? AND stats_version=?",
                (base_identity, a, b, STATS_VERSION),
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def _store_pair(self, base_identity: str, a: str, b: str, dots: dict[str, float]) -> None:
        with self._lock, self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO pair_stats VALUES (?,?,?,?,?,?)",
                (base_identity, a, b, STATS_VERSION, time.time(), json.dumps(dots)),
            )

    # --- sensitivity ------------------------------------------------------------------------
    def find_sensitivity(
        self, base_identity: str, calibration: str, block_bytes: int, kind: str = "fisher"
    ) -> dict[str, np.ndarray] | None:
        """``{tensor: float64[n_blocks]}`` recorded for (base, calibration digest, block size,
        kind), or None."""
        from mergepipe.catalog.sensitivity import fisher_from_bytes

        with self._lock:
            row = self.db.execute(
                "SELECT data FROM sensitivity WHERE base_identity=? AND calibration=? AND block_bytes=? AND kind=?",
                (base_identity, calibration, block_bytes, kind),
            ).fetchone()
        if row is None:
            return None
        try:
            return fisher_from_bytes(row[0], f"{self.path}: sensitivity of base {base_identity[:12]}")
        except InputError:
            return None  # unreadable (an older format, or damaged): recomputed and replaced

    def _store_sensitivity(
        self, base_identity: str, calibration: str, block_bytes: int, kind: str, f: dict, seconds: float
    ) -> None:
        from mergepipe.catalog.sensitivity import fisher_to_bytes

        with self._lock, self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO sensitivity VALUES (?,?,?,?,?,?,?)",
                (base_identity, calibration, block_bytes, kind, time.time(), seconds, fisher_to_bytes(f)),
            )

    def sensitivity(
        self,
        storage: Storage,
        base: CheckpointRecord,
        calibration,
        block_bytes: int,
        kind: str = "fisher",
        device: str | None = None,
    ) -> dict[str, np.ndarray]:
        """The base's per-block sensitivity on ``calibration`` (a
        :class:`~mergepipe.catalog.sensitivity.Calibration`): from the catalog, or computed once
        (:func:`~mergepipe.catalog.sensitivity.compute_fisher`, reads the base: torch and
        transformers needed) and stored.

        Raises:
            InputError: unknown ``kind``, or the base is neither a causal LM nor an encoder
                checkpoint (:func:`~mergepipe.catalog.sensitivity.model_kind`).
        """
        from mergepipe.catalog.sensitivity import compute_fisher

        if kind != "fisher":
            raise InputError(f"sensitivity kind {kind!r}: only 'fisher' is recorded.")
        got = self.find_sensitivity(base.identity, calibration.digest, block_bytes, kind)
        if got is not None:
            return got
        t0 = time.perf_counter()
        f = compute_fisher(storage, base, calibration, block_bytes, device=device)
        self._store_sensitivity(base.identity, calibration.digest, block_bytes, kind, f, time.perf_counter() - t0)
        return f


def record_layout_dict(rec: CheckpointRecord) -> dict:
    """The stored form of a record's layout (:func:`layout_to_dict`), with an adapter's
    ``adapter_config.json`` text under ``adapter_config``."""
    d = layout_to_dict(rec.layout)
    if rec.adapter is not None:
        d["adapter_config"] = rec.adapter.raw_text
    return d


_LORA_MAPS: dict[tuple[str, str], dict[str, LoraModule]] = {}


def lora_map(base: CheckpointRecord, expert: CheckpointRecord) -> dict[str, LoraModule]:
    """``{base tensor: LoraModule}`` of a LoRA expert against ``base`` (cached per identities).

    Raises:
        InputError: the adapter does not fit the base (:func:`mergepipe.lora.map_modules`).
    """
    assert expert.adapter is not None
    key = (base.identity, expert.identity)
    got = _LORA_MAPS.get(key)
    if got is None:
        src = f"{expert.uri}/{ADAPTER_WEIGHTS}"
        factors = adapter_modules(expert.adapter, expert.layout.tensors, src)
        got = map_modules(expert.adapter, factors, base.layout.tensors, expert.uri, base.uri)
        if len(_LORA_MAPS) > 256:
            _LORA_MAPS.clear()
        _LORA_MAPS[key] = got
    return got


def check_compatible(base: CheckpointRecord, experts: Sequence[CheckpointRecord]) -> None:
    """Every base tensor must exist in each expert with the same shape and dtype, and each
    expert may hold no tensor the base lacks (it would be dropped from the merge silently).
    A LoRA adapter expert must map every adapted module onto a base tensor of its shape
    (:func:`lora_map`).

    Raises:
        InputError: naming the expert, the tensor and what differs.
    """
    if not base.layout.tensors:
        raise InputError(f"{base.uri}: the base checkpoint holds no tensors; nothing to merge.")
    for e in experts:
        if e.adapter is not None:
            lora_map(base, e)
            continue
        extra = [n for n in e.layout.tensors if n not in base.layout.tensors]
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise InputError(
                f"{e.uri}: tensor {extra[0][:200]!r}{more} is not in the base ({base.uri}); experts must have "
                "exactly the base's tensors (a merge would drop it): remove it from the expert or pick its true base."
            )
        for name, bt in base.layout.tensors.items():
            et = e.layout.tensors.get(name)
            if et is None:
                raise InputError(
                    f"{e.uri}: tensor {name!r} of the base ({base.uri}) is missing from this expert; "
                    "experts must be fine-tunes of the same base architecture."
                )
            if et.shape != bt.shape or et.dtype != bt.dtype:
                raise InputError(
                    f"{e.uri}: tensor {name!r} is {et.dtype}{list(et.shape)} but the base has "
                    f"{bt.dtype}{list(bt.shape)}; experts must share the base's shapes and dtypes "
                    "(convert the expert, or pick its true base)."
                )


class SketchSink:
    """Where one expert's sketch blob goes while it is analysed.

    ``writer`` (a :class:`~mergepipe.catalog.sketch.SketchWriter`) receives the blob in order;
    nothing a reader takes for a sketch exists until :meth:`publish`; :meth:`abort` discards
    what was written (no-op after publish). Subclasses: :class:`LocalSketchSink` (a file) and
    :class:`WriterSketchSink` (a :class:`~mergepipe.storage.base.Writer`, e.g. an S3 multipart
    upload).
    """

    uri: str
    writer: SketchWriter

    def _meta(self) -> dict:
        return {
            "kind": "sign-planes",
            "planes": PLANES,
            "uri": self.uri,
            "sha256": self.writer.sha256.hexdigest(),
            "bytes": self.writer.nbytes,
        }

    def publish(self) -> dict | None:
        """Make the blob visible at ``uri``; returns the analysis' ``sketch`` record
        (``{"kind", "planes", "uri", "sha256", "bytes"}``), or None when the expert has no
        sketched tensor (nothing is published)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Discard the unpublished blob; never raises."""
        raise NotImplementedError


class LocalSketchSink(SketchSink):
    """A sketch blob at local path ``uri``: written to a hidden temporary file in the same folder
    (fsynced), renamed into place by :meth:`publish`, so a reader sees no blob or all of it.

    Args:
        uri: the blob's final path (its folder is created).
        spill_bytes: the writer's memory for later planes (:class:`SketchWriter`); spill files go
            to the same folder.
    """

    def __init__(self, uri: str, spill_bytes: int) -> None:
        self.uri = uri
        p = Path(uri)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._path = p
        self._tmp = p.with_name(f".{p.name}.tmp{os.getpid()}.{threading.get_ident()}")
        from mergepipe.storage.local import open_for_write

        if self._tmp.is_symlink() or self._tmp.is_file():
            self._tmp.unlink()  # a crashed writer's (same pid and thread), or a planted link
        self._f = os.fdopen(open_for_write(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="sketch file"), "wb")
        self.writer = SketchWriter(self._f.write, spill_bytes, spill_dir=str(p.parent))
        self._done = False

    def publish(self) -> dict | None:
        from mergepipe.storage.local import fsync_folder

        if self.writer.nbytes == 0:
            self.abort()
            return None
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self._path)
        self._done = True
        fsync_folder(self._path.parent, strict=False)
        return self._meta()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self.writer.discard()
        try:
            self._f.close()
        except OSError:
            pass
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


class WriterSketchSink(SketchSink):
    """A sketch blob written through a storage :class:`~mergepipe.storage.base.Writer` whose
    ``close`` publishes the object whole (S3: a multipart upload, visible only once completed;
    an object smaller than one part is one PutObject at close).

    Args:
        storage, uri: where the blob goes (bytes counted as written under role ``catalog``).
        spill_bytes: the writer's memory for later planes (:class:`SketchWriter`; spill files
            in the system temporary folder).
    """

    def __init__(self, storage: Storage, uri: str, spill_bytes: int) -> None:
        self.uri = uri
        self._w = storage.open_writer(uri, "catalog")
        self.writer = SketchWriter(self._w.write, spill_bytes)
        self._done = False

    def publish(self) -> dict | None:
        if self.writer.nbytes == 0:
            self.abort()
            return None
        self._w.close()
        self._done = True
        return self._meta()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self.writer.discard()
        self._w.abort()


#: BLAS threads of an analysis (numpy's OpenBLAS/MKL pool, set by :func:`analysis_blas_threads`)
ANALYZE_BLAS_THREADS = 1


def analysis_blas_threads():
    """Context manager: numpy's BLAS/LAPACK pools limited to :data:`ANALYZE_BLAS_THREADS` (one)
    thread while an analysis runs (``threadpoolctl.threadpool_limits(user_api="blas")``), restored
    on exit.

    Why one: the analysis' linear algebra is many small problems (a rank-1 SVD of every
    ``rows × row_numel`` block of at most 128 KiB, LoRA ``B·A`` products of a few rows), far too
    small to split; OpenBLAS's threads spin-wait for work, so with more threads than idle cores
    they only steal CPU. Measured on the 2-core machine under load (docs/BENCHMARKS.md, issue 23):
    20 SVDs of a 170 × 384 block took 185 s wall / 20 s CPU with OpenBLAS's 2 threads and
    4.8 s / 0.29 s with one.

    The limit is process-wide (OpenBLAS has one pool): BLAS calls of other threads of the same
    process during the analysis run on one thread too. Torch's own pool (the Fisher sensitivity)
    is not touched.
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=ANALYZE_BLAS_THREADS, user_api="blas")


def _analyze_stream(
    storage, base, readers, stat_ids, block_bytes, chunk_bytes, progress, pairs=(), sketches=None, work_bytes=None
):
    """Stream the base and ``readers`` once; per-expert statistics for identities in
    ``stat_ids``, and for each pair of ``pairs`` the exact per-tensor ``⟨δᵢ,δⱼ⟩``, with numpy's
    BLAS on one thread (:func:`analysis_blas_threads`).

    ``sketches`` (``{identity: SketchWriter}``, one per identity of ``stat_ids``) receive the
    sign planes of every floating tensor of two or more dimensions, in base tensor order
    (:mod:`mergepipe.catalog.sketch`), as the blocks are analysed; each tensor's statistics
    record where its planes start (``sketch_start``) and their residual energies.

    Returns:
        ``({identity: {tensor: TensorStats}}, {(id_a, id_b) sorted: {tensor: dot}},
        {tensor: base SHA-256})``.
    """
    with analysis_blas_threads():
        return _analyze_stream_body(
            storage, base, readers, stat_ids, block_bytes, chunk_bytes, progress, pairs, sketches, work_bytes
        )


def _analyze_stream_body(
    storage, base, readers, stat_ids, block_bytes, chunk_bytes, progress, pairs, sketches, work_bytes
):
    """:func:`_analyze_stream` (its arguments and result), in the caller's BLAS threading."""
    builders: dict[str, dict[str, TensorStats]] = {i: {} for i in stat_ids}
    sketches = sketches if sketches is not None else {}
    pair_ids = [tuple(sorted((a.identity, b.identity))) for a, b in pairs]
    dots: dict[tuple[str, str], dict[str, float]] = {p: {} for p in pair_ids}
    held = {i for p in pair_ids for i in p}
    stat_readers = [e for e in readers if e.identity in stat_ids]
    base_digests: dict[str, str] = {}
    for name, bt in base.layout.tensors.items():
        if bt.dtype not in FLOAT_DTYPES or bt.numel == 0:
            continue
        tp = _TensorPass(name, bt, readers, stat_ids, stat_readers, held, pair_ids, sketches, block_bytes)
        chunk_rows = tp.chunk_rows(chunk_bytes, work_bytes)
        for r0 in range(0, bt.rows, chunk_rows):
            tp.chunk(storage, base, readers, r0, min(bt.rows, r0 + chunk_rows), progress)
        _refuse_nonfinite(base, name, tp.base_nonfinite, "base")
        for e in readers:
            _refuse_nonfinite(e, name, tp.nonfinite[e.identity], "expert")
        base_digests[name] = tp.bh.hexdigest()
        for e in stat_readers:
            builders[e.identity][name] = tp.stats(e.identity)
        for p in pair_ids:
            dots[p][name] = exact_total(np.concatenate(tp.prow[p])) if tp.prow[p] else 0.0
    return builders, dots, base_digests


class _TensorPass:
    """One base tensor's pass of :func:`_analyze_stream`: its statistics builders, sketch
    writers, content digests, non-finite counts and pair dot segments, fed chunk by chunk."""

    def __init__(self, name, bt, readers, stat_ids, stat_readers, held, pair_ids, sketches, block_bytes) -> None:
        self.name, self.bt, self.held, self.pair_ids = name, bt, held, pair_ids
        self.stat_readers = stat_readers
        self.rpb = rows_per_block(bt, block_bytes)
        self.row_numel = bt.numel // max(1, bt.rows)
        lora_ids = {e.identity for e in stat_readers if e.adapter is not None}
        self.bs = {e.identity: TensorStatsBuilder(name, bt.rows, self.row_numel, self.rpb) for e in stat_readers}
        self.sks = {i: w for i, w in sketches.items() if i in stat_ids} if len(bt.shape) >= 2 else {}
        self.sk_start = {
            i: w.begin(bt.rows, self.row_numel, self.rpb) for i, w in self.sks.items() if i not in lora_ids
        }
        self.hashes = {e.identity: hashlib.sha256() for e in stat_readers}
        self.blk_sha: dict[str, list] = {e.identity: [] for e in stat_readers if e.adapter is None}  # per block
        self.nonfinite = {e.identity: 0 for e in readers}
        self.base_nonfinite = 0
        self.prow: dict[tuple[str, str], list[np.ndarray]] = {p: [] for p in pair_ids}
        self.lora_a: dict[str, np.ndarray] = {}  # per LoRA expert: this tensor's A, read once
        self.bh = hashlib.sha256()

    def chunk_rows(self, chunk_bytes: int, work_bytes: int | None) -> int:
        """Rows per chunk: whole blocks within ``chunk_bytes`` (or, under a memory target
        ``work_bytes``, the per-element working set's share), divided among held deltas."""
        bt = self.bt
        if work_bytes is not None:  # a memory target: chunk elements from the per-element working set
            chunk_bytes = work_bytes // ANALYZE_BYTES_PER_ELEMENT * max(1, bt.row_bytes // max(1, self.row_numel))
        cb = chunk_bytes // max(1, len(self.held)) if self.held else chunk_bytes  # pairs hold every delta of a chunk
        return max(self.rpb, (cb // max(1, bt.row_bytes)) // self.rpb * self.rpb)

    def chunk(self, storage, base, readers, r0: int, r1: int, progress) -> None:
        """Read rows ``[r0, r1)`` of the base (role ``base``) and every reader, and feed them."""
        bt = self.bt
        s, t = bt.row_range(r0, r1)
        braw = storage.read_range(storage.join(base.uri, bt.file), s, t, "base")
        self.bh.update(braw)
        b = decode(braw, bt.dtype)
        if not np.isfinite(b).all():
            self.base_nonfinite += int(np.count_nonzero(~np.isfinite(b)))
        b64: np.ndarray | None = None
        bsq: np.ndarray | None = None
        if self.stat_readers:
            b64 = b.astype(np.float64)
            bsq = (b64 * b64).reshape(-1, self.row_numel).sum(axis=1)
        deltas = {}
        for e in readers:
            if e.adapter is not None:
                d = self._lora_chunk(storage, base, e, r0, r1, b64 if b64 is not None else b, bsq)
            else:
                d = self._expert_chunk(storage, e, r0, r1, b, b64, bsq)
            if e.identity in self.held:
                deltas[e.identity] = d
        for p in self.pair_ids:
            self.prow[p].append(segment_dots(deltas[p[0]], deltas[p[1]], self.row_numel))
        if progress:
            progress((t - s) * (1 + len(readers)))

    def _lora_chunk(self, storage, base, e, r0: int, r1: int, b, bsq):
        """A LoRA expert's rows: δ from its factors, one block at a time (returned when held)."""
        i = e.identity
        d = _lora_blocks(
            storage, base, e, self.name, r0, r1, self.rpb, self.row_numel, b,
            bsq, self.lora_a, self.hashes.get(i), self.bs.get(i), i in self.held,
        )  # fmt: skip
        if d is not None:
            self.nonfinite[i] += int(np.count_nonzero(~np.isfinite(d)))
        elif i in self.bs:  # δ is not kept: its blocks' Σδ² tell whether it is finite
            self.nonfinite[i] += int(np.count_nonzero(~np.isfinite(self.bs[i].sq[r0 // self.rpb :])))
        return d

    def _expert_chunk(self, storage, e, r0: int, r1: int, b, b64, bsq):
        """A checkpoint expert's rows (role ``expert``): δ = x − base, its statistics, block
        digests and sketch planes; returns δ (float32)."""
        i, rpb = e.identity, self.rpb
        et = e.layout.tensors[self.name]
        es, ee = et.row_range(r0, r1)
        raw = storage.read_range(storage.join(e.uri, et.file), es, ee, "expert")
        x = decode(raw, et.dtype)
        d = (x - b).astype(np.float32, copy=False)
        if not np.isfinite(d).all():
            self.nonfinite[i] += int(np.count_nonzero(~np.isfinite(d)))
        if i in self.bs:
            self.hashes[i].update(raw)
            mv, rb = memoryview(raw), et.row_bytes
            self.blk_sha[i] += [
                block_digest(mv[(q - r0) * rb : (min(q + rpb, r1) - r0) * rb]) for q in range(r0, r1, rpb)
            ]
            self.bs[i].add(r0, d, expert=x, base=b64, base_sq_rows=bsq)
            if i in self.sks:
                self.sks[i].add(r0, d)
        return d

    def stats(self, i: str) -> TensorStats:
        """Expert ``i``'s finished statistics of this tensor (digests and sketch extent set)."""
        st = self.bs[i].finish(self.hashes[i].hexdigest())
        if i in self.blk_sha:
            st.block_sha = np.frombuffer(b"".join(self.blk_sha[i]), dtype=np.uint8).reshape(-1, BLOCK_DIGEST_BYTES)
        w = self.sks.get(i)
        if w is not None and i in self.sk_start:
            st.sketch_start, st.sketch_sq = self.sk_start[i], w.end()
            st.sketch_sha = w.digests
        elif w is not None:  # a LoRA expert: no planes are coded (as before streaming)
            st.sketch_start, st.sketch_sq = w.nbytes, np.zeros((0, TIERS))
        return st


def _refuse_nonfinite(rec: CheckpointRecord, tensor: str, count: int, role: str) -> None:
    """Non-finite weights are refused at analyze, on every catalog (the rule of
    docs/SECURITY.md): a NaN or ±Inf in a base or expert tensor (or a task vector overflowing
    float32) would make the statistics, the plan and the merged tensor NaN.

    Raises:
        InputError: naming the checkpoint, the tensor and how many values are not finite.
    """
    if not count:
        return
    what = (
        f"{count} non-finite value(s) (NaN or ±Inf)"
        if not (role == "expert" and rec.adapter is not None)
        else "non-finite values (NaN or ±Inf) in its LoRA delta"
    )
    raise InputError(
        f"{rec.uri}: {role} tensor {tensor[:200]!r} holds {what} in its task vector; mergepipe refuses "
        "non-finite weights (the merge would be NaN): fix or re-export the checkpoint, or leave it out."
    )


def _lora_blocks(storage, base, e, name, r0, r1, rpb, row_numel, b64, bsq, a_cache, h, builder, keep):
    """Statistics of rows ``[r0, r1)`` of a LoRA expert ``e`` on base tensor ``name``, from its
    factors, never holding more than one block of δ (unless ``keep``: pair statistics need the
    chunk's δ, which is then returned).

    ``δ = s·B·A`` (:func:`mergepipe.lora.delta_rows`): A is read once per tensor (into
    ``a_cache``), the chunk's rows of B in one read (role expert; the factor bytes are fed to
    ``h``, the tensor's content hash), then δ and ``θ_e = θ_b + δ`` (float64) are formed block by
    block (``rpb`` rows; ``r0`` is a block boundary) and added to ``builder``. Tensors the
    adapter does not touch have δ = 0 and read nothing.

    Returns:
        float32 flat δ of the chunk when ``keep``, else None.
    """
    mod = lora_map(base, e).get(name)
    a = bm = None
    if mod is not None:
        a = a_cache.get(e.identity)
        if a is None:
            raw_a = storage.read_range(storage.join(e.uri, mod.a.file), mod.a.start, mod.a.end, "expert")
            if h is not None:
                h.update(raw_a)
            a = a_cache[e.identity] = decode(raw_a, mod.a.dtype).reshape(mod.a.shape)
        s, t = mod.b.row_range(r0, r1)
        raw_b = storage.read_range(storage.join(e.uri, mod.b.file), s, t, "expert")
        if h is not None:
            h.update(raw_b)
        bm = decode(raw_b, mod.b.dtype).reshape(r1 - r0, mod.rank)
    parts = []
    for q0 in range(r0, r1, rpb):
        q1 = min(r1, q0 + rpb)
        lo, hi = (q0 - r0) * row_numel, (q1 - r0) * row_numel
        bq = np.asarray(b64[lo:hi], dtype=np.float64)
        if mod is None:
            d = np.zeros(hi - lo, dtype=np.float32)
        else:
            d = delta_rows(a, bm[q0 - r0 : q1 - r0], mod.scale).reshape(-1)
        if builder is not None:
            bsq_q = bsq[q0 - r0 : q1 - r0] if bsq is not None else None
            builder.add(q0, d, expert=bq + d, base=bq, base_sq_rows=bsq_q)
        if keep:
            parts.append(d)
    return np.concatenate(parts) if keep else None


def _hash_tensors(storage, rec: CheckpointRecord, names: Sequence[str], step: int = 16 << 20) -> dict[str, str]:
    """SHA-256 of the raw bytes of ``names`` (read in pieces of ``step`` bytes, role base)."""
    out = {}
    for n in names:
        t = rec.layout.tensors[n]
        h = hashlib.sha256()
        uri = storage.join(rec.uri, t.file)
        for s in range(t.start, t.end, step):
            h.update(storage.read_range(uri, s, min(t.end, s + step), "base"))
        out[n] = h.hexdigest()
    return out
