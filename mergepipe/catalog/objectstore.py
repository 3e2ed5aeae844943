"""The catalog as small index objects under a storage prefix (for the cluster).

The operator plans in-process from these objects and never reads a checkpoint:

* ``<prefix>/checkpoints/<sha256(uri)[:32]>.json``: the latest registration of a checkpoint URI
  (identity, per-file ``[size, version]`` signature with S3 ETags, layout with all shard headers);
* ``<prefix>/analyses/<base identity>/<expert identity>/<block bytes>-v<stats version>.zip``: one
  zip with ``meta.json`` and one entry per tensor holding its
  :class:`~mergepipe.catalog.stats.TensorStats` (numpy ``.npz`` bytes);
* ``<prefix>/sensitivity/<base identity>/<calibration digest>/<block bytes>-<kind>.npz``: the base's
  per-block sensitivity on a calibration set (:mod:`mergepipe.catalog.sensitivity`), written by
  ``mergepipe analyze --calibration`` (the operator's analyze Job).
* ``<prefix>/sketches/<base identity>/<expert identity>/<block bytes>-v<stats version>.sketch``: the
  expert's block sketches (:mod:`mergepipe.catalog.sketch`), streamed while the expert is analysed
  (S3: a multipart upload, visible only once completed), published before the analysis object
  that names them (with their SHA-256) and read by merges through the storage layer.

Analyses are immutable and keyed by identities, so concurrent analyze Jobs writing the same
object write the same content; writes use a conditional create and a lost race is success.
The local SQLite catalog stays the embedded default; both share the logic of
:class:`~mergepipe.catalog.catalog.Catalog`.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import zipfile

from mergepipe.catalog.catalog import (
    STATS_VERSION,
    Analysis,
    Catalog,
    CheckpointRecord,
    LocalSketchSink,
    SketchSink,
    WriterSketchSink,
    record_layout_dict,
)
from mergepipe.catalog.stats import TensorStats
from mergepipe.storage.base import IOCounters, NotFoundError, PreconditionFailed, Storage, is_s3
from mergepipe.storage.routing import open_storage


class ObjectCatalog(Catalog):
    """A :class:`Catalog` persisted as index objects under ``prefix`` of ``storage``.

    Args:
        storage: where the index objects live (bytes counted under role ``catalog``).
        prefix: e.g. ``s3://models/mergepipe-catalog``.
    """

    def __init__(self, storage: Storage, prefix: str) -> None:  # noqa: D107 - no SQLite here
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self.path = self.prefix
        self._lock = threading.Lock()

    def close(self) -> None:
        pass

    def _ckpt_uri(self, uri: str) -> str:
        return self.storage.join(self.prefix, "checkpoints", hashlib.sha256(uri.encode()).hexdigest()[:32] + ".json")

    def _analysis_uri(self, base: str, expert: str, block_bytes: int) -> str:
        return self.storage.join(self.prefix, "analyses", base, expert, f"{block_bytes}-v{STATS_VERSION}.zip")

    def _cached(self, uri: str):
        try:
            d = json.loads(self.storage.read_object(self._ckpt_uri(uri), "catalog"))
        except NotFoundError:
            return []
        return [(d["identity"], d["signature"], d["layout"])]

    def _save_checkpoint(self, rec: CheckpointRecord) -> None:
        d = {
            "uri": rec.uri,
            "identity": rec.identity,
            "signature": rec.signature,
            "layout": record_layout_dict(rec),
            "registered_at": time.time(),
        }
        self.storage.put_object(self._ckpt_uri(rec.uri), json.dumps(d).encode(), "catalog")

    def checkpoints(self):
        out = []
        for u in self.storage.list(self.storage.join(self.prefix, "checkpoints") + "/"):
            d = json.loads(self.storage.read_object(u, "catalog"))
            out.append(
                (
                    d["uri"],
                    d["identity"],
                    sum(s["file_size"] for s in d["layout"]["shards"].values()),
                    d["registered_at"],
                )
            )
        return sorted(out, key=lambda r: r[3])

    def _digests_uri(self, identity: str) -> str:
        return self.storage.join(self.prefix, "digests", identity + ".json")

    def tensor_digests(self, identity: str) -> dict[str, str]:
        try:
            return json.loads(self.storage.read_object(self._digests_uri(identity), "catalog"))
        except NotFoundError:
            return {}

    def _store_digests(self, identity: str, digests: dict[str, str]) -> None:
        try:
            self.storage.put_object(
                self._digests_uri(identity), json.dumps(digests, sort_keys=True).encode(), "catalog", if_none_match=True
            )
        except PreconditionFailed:
            pass  # identity-keyed: the same content

    def has_analysis(self, base_identity: str, expert_identity: str, block_bytes: int) -> bool:
        return self.storage.exists(self._analysis_uri(base_identity, expert_identity, block_bytes))

    def find_analysis(self, base_identity: str, expert_identity: str, block_bytes: int) -> Analysis | None:
        try:
            data = self.storage.read_object(self._analysis_uri(base_identity, expert_identity, block_bytes), "catalog")
        except NotFoundError:
            return None
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            meta = json.loads(z.read("meta.json"))
            tensors = {
                n: TensorStats.from_bytes(n, z.read(f"t/{i}"), meta["sha256"][n]) for i, n in enumerate(meta["tensors"])
            }
        return Analysis(
            id=0,
            base_identity=base_identity,
            expert_identity=expert_identity,
            block_bytes=block_bytes,
            tensors=tensors,
            seconds=meta["seconds"],
            bytes_read=meta["bytes_read"],
            sketch=meta.get("sketch"),
        )

    def sketch_uri(self, base: str, expert: str, block_bytes: int) -> str:
        """``<prefix>/sketches/<base identity>/<expert identity>/<block bytes>-v<stats version>.sketch``."""
        return self.storage.join(self.prefix, "sketches", base, expert, f"{block_bytes}-v{STATS_VERSION}.sketch")

    def _open_sketch(self, base: str, expert: str, block_bytes: int, spill_bytes: int) -> SketchSink:
        """A sink for an expert's sketch blob, written while it is analysed: an S3 multipart
        upload (invisible until completed), or for a local prefix a hidden temporary file renamed
        into place. Concurrent analyzers of the same (identity-keyed) blob write the same bytes;
        the last to finish replaces the other's object with identical content."""
        uri = self.sketch_uri(base, expert, block_bytes)
        if is_s3(uri):
            return WriterSketchSink(self.storage, uri, spill_bytes)
        return LocalSketchSink(uri[len("file://") :] if uri.startswith("file://") else uri, spill_bytes)

    def _store(self, base, expert, block_bytes, stats, seconds, nread, sk: dict | None = None) -> int:
        buf = io.BytesIO()
        names = list(stats)
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(
                "meta.json",
                json.dumps(
                    {
                        "base_identity": base,
                        "expert_identity": expert,
                        "block_bytes": block_bytes,
                        "stats_version": STATS_VERSION,
                        "tensors": names,
                        "seconds": seconds,
                        "bytes_read": nread,
                        "sha256": {n: stats[n].content_sha256 for n in names},
                        "sketch": sk,
                    }
                ),
            )
            for i, n in enumerate(names):
                z.writestr(f"t/{i}", stats[n].to_bytes())
        try:
            self.storage.put_object(
                self._analysis_uri(base, expert, block_bytes), buf.getvalue(), "catalog", if_none_match=True
            )
        except PreconditionFailed:
            pass  # another analyzer stored the same (identity-keyed) analysis first
        return 0

    # pair statistics (model_stock, nuslerp): <prefix>/pairs/<base>/<a>-<b>-v<stats version>.json
    def _pair_uri(self, base: str, a: str, b: str) -> str:
        return self.storage.join(self.prefix, "pairs", base, f"{a}-{b}-v{STATS_VERSION}.json")

    def _find_pair(self, base_identity: str, a: str, b: str) -> dict | None:
        try:
            return json.loads(self.storage.read_object(self._pair_uri(base_identity, a, b), "catalog"))
        except NotFoundError:
            return None

    def _store_pair(self, base_identity: str, a: str, b: str, dots: dict) -> None:
        try:
            self.storage.put_object(
                self._pair_uri(base_identity, a, b), json.dumps(dots).encode(), "catalog", if_none_match=True
            )
        except PreconditionFailed:
            pass  # identity-keyed: another analyzer stored the same content first

    # sensitivity (planner value "fisher"): immutable, keyed by base and calibration identity
    def _sensitivity_uri(self, base: str, calibration: str, block_bytes: int, kind: str) -> str:
        return self.storage.join(self.prefix, "sensitivity", base, calibration, f"{block_bytes}-{kind}.npz")

    def find_sensitivity(self, base_identity: str, calibration: str, block_bytes: int, kind: str = "fisher"):
        from mergepipe.catalog.sensitivity import fisher_from_bytes

        try:
            data = self.storage.read_object(
                self._sensitivity_uri(base_identity, calibration, block_bytes, kind), "catalog"
            )
        except NotFoundError:
            return None
        return fisher_from_bytes(data)

    def _store_sensitivity(self, base_identity: str, calibration: str, block_bytes: int, kind: str, f, seconds) -> None:
        from mergepipe.catalog.sensitivity import fisher_to_bytes

        try:
            self.storage.put_object(
                self._sensitivity_uri(base_identity, calibration, block_bytes, kind),
                fisher_to_bytes(f),
                "catalog",
                if_none_match=True,
            )
        except PreconditionFailed:
            pass  # identity-keyed: another analyzer stored the same statistic first


def open_catalog(location: str | None):
    """``s3://…`` or an existing folder given as ``objects:PATH`` -> :class:`ObjectCatalog`; a file
    path (or None: the default) -> the SQLite :class:`Catalog`."""
    if location and (is_s3(location) or location.startswith("objects:")):
        loc = location[len("objects:") :] if location.startswith("objects:") else location
        return ObjectCatalog(open_storage(loc, IOCounters()), loc)
    return Catalog(location)
