"""The catalog as small index objects under a storage prefix (for the cluster).

The operator plans in-process from these objects and never reads a checkpoint:

* ``<prefix>/checkpoints/<sha256(uri)[:32]>.json``: the latest registration of a checkpoint URI
  (identity, per-file ``[size, version]`` signature with S3 ETags, layout with all shard headers);
* ``<prefix>/analyses/<base identity>/<expert identity>/<block bytes>-v<stats version>.zip``: one
  zip with ``meta.json`` and ``stats``, every tensor's
  :class:`~mergepipe.catalog.stats.TensorStats` in one packed blob
  (:func:`~mergepipe.catalog.stats.pack_stats`);
* ``<prefix>/sensitivity/<base identity>/<calibration digest>/<block bytes>-<kind>-v2.npz``: the base's
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
from mergepipe.catalog.stats import TensorStats, pack_stats, unpack_stats
from mergepipe.errors import InputError
from mergepipe.storage.base import IOCounters, NotFoundError, PreconditionFailed, Storage, local_path
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

    def _older_version(self, base_identity: str, expert_identity: str, block_bytes: int) -> int | None:
        """The newest stats version below :data:`STATS_VERSION` of an analysis object of this key
        (versions 3 and later are looked for; None: none)."""
        for v in range(STATS_VERSION - 1, 2, -1):
            uri = self.storage.join(self.prefix, "analyses", base_identity, expert_identity, f"{block_bytes}-v{v}.zip")
            if self.storage.exists(uri):
                return v
        return None

    def find_analysis(self, base_identity: str, expert_identity: str, block_bytes: int) -> Analysis | None:
        try:
            data = self.storage.read_object(self._analysis_uri(base_identity, expert_identity, block_bytes), "catalog")
        except NotFoundError:
            return None
        uri = self._analysis_uri(base_identity, expert_identity, block_bytes)
        meta, tensors = read_analysis_zip(data, uri)
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
        from mergepipe.planner.plan import sketch_name

        return self.storage.join(self.prefix, sketch_name(base, expert, block_bytes, STATS_VERSION, objects=True))

    def _open_sketch(self, base: str, expert: str, block_bytes: int, spill_bytes: int) -> SketchSink:
        """A sink for an expert's sketch blob, written while it is analysed: an S3 multipart
        upload (invisible until completed), or for a local prefix a hidden temporary file renamed
        into place. Concurrent analyzers of the same (identity-keyed) blob write the same bytes;
        the last to finish replaces the other's object with identical content."""
        uri = self.sketch_uri(base, expert, block_bytes)
        if not self.storage.capabilities(uri).folders:
            return WriterSketchSink(self.storage, uri, spill_bytes)
        return LocalSketchSink(uri[len("file://") :] if uri.startswith("file://") else uri, spill_bytes)

    def _sketch_present(self, sk: dict) -> bool:
        try:
            return self.storage.stat(sk["uri"]).size == sk["bytes"]
        except (NotFoundError, InputError):
            return False

    def _store(self, base, expert, block_bytes, stats, seconds, nread, sk: dict | None = None, replace=False) -> int:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(
                "meta.json",
                json.dumps(
                    {
                        "base_identity": base,
                        "expert_identity": expert,
                        "block_bytes": block_bytes,
                        "stats_version": STATS_VERSION,
                        "seconds": seconds,
                        "bytes_read": nread,
                        "sketch": sk,
                    }
                ),
            )
            z.writestr("stats", pack_stats(stats))
        try:
            self.storage.put_object(
                self._analysis_uri(base, expert, block_bytes), buf.getvalue(), "catalog", if_none_match=not replace
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
        # -v2: names without pickle (mergepipe.catalog.sensitivity.fisher_to_bytes); older objects are ignored
        return self.storage.join(self.prefix, "sensitivity", base, calibration, f"{block_bytes}-{kind}-v2.npz")

    def find_sensitivity(self, base_identity: str, calibration: str, block_bytes: int, kind: str = "fisher"):
        from mergepipe.catalog.sensitivity import fisher_from_bytes

        try:
            data = self.storage.read_object(
                self._sensitivity_uri(base_identity, calibration, block_bytes, kind), "catalog"
            )
        except NotFoundError:
            return None
        return fisher_from_bytes(data, self._sensitivity_uri(base_identity, calibration, block_bytes, kind))

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


def read_analysis_zip(data: bytes, source: str) -> tuple[dict, dict[str, TensorStats]]:
    """Parse an analysis object (a zip of ``meta.json`` and the packed ``stats`` blob), read
    back from shared storage: untrusted. Before inflating anything, the member count is capped
    (:data:`~mergepipe.limits.MAX_ANALYSIS_MEMBERS`) and every member's declared size must stay
    within :data:`~mergepipe.limits.MAX_INFLATE_RATIO` times its compressed size plus
    :data:`~mergepipe.limits.ANALYSIS_MEMBER_SLACK` (``zipfile`` never inflates past the
    declared size); ``meta.json`` is checked field by field and the blob by
    :func:`~mergepipe.catalog.stats.unpack_stats` (format tag, content digest, sizes, values).

    Returns:
        (meta, ``{tensor: TensorStats}``).

    Raises:
        InputError: naming ``source``, what is wrong and the fix (delete the object, or
            ``mergepipe analyze --force``, which replaces it).
    """
    from mergepipe.limits import ANALYSIS_MEMBER_SLACK, MAX_ANALYSIS_MEMBERS, MAX_INFLATE_RATIO, loads_json

    fix = "; run `mergepipe analyze --force` for this base and expert to replace it"

    def bad(why: str) -> InputError:
        return InputError(f"{source}: not a valid analysis object ({why}){fix}.")

    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise bad(f"not a zip: {str(e)[:80]}") from None
    with z:
        infos = z.infolist()
        if len(infos) > MAX_ANALYSIS_MEMBERS:
            raise bad(f"{len(infos)} members, over the limit of {MAX_ANALYSIS_MEMBERS}")
        for info in infos:
            if info.file_size > MAX_INFLATE_RATIO * info.compress_size + ANALYSIS_MEMBER_SLACK:
                raise bad(
                    f"member {info.filename[:80]!r} inflates {info.compress_size} bytes to {info.file_size}, over "
                    f"{MAX_INFLATE_RATIO}x + {ANALYSIS_MEMBER_SLACK} bytes: a zip bomb or damaged"
                )
        try:
            meta = loads_json(z.read("meta.json"), f"{source}: meta.json")
            if not (
                isinstance(meta, dict)
                and isinstance(meta.get("seconds"), (int, float))
                and isinstance(meta.get("bytes_read"), int)
                and (meta.get("sketch") is None or isinstance(meta["sketch"], dict))
            ):
                raise ValueError("meta.json fields of the wrong type")
            if meta["sketch"] is not None and not (
                isinstance(meta["sketch"].get("uri"), str) and isinstance(meta["sketch"].get("bytes"), int)
            ):
                raise ValueError("meta.json sketch record of the wrong type")
            tensors = unpack_stats(z.read("stats"))
        except InputError:
            raise
        except (KeyError, ValueError, TypeError, zipfile.BadZipFile, OSError, EOFError) as e:
            raise bad(f"{type(e).__name__}: {str(e)[:80]}") from None
    return meta, tensors


def open_catalog(location: str | None):
    """``s3://…`` or an existing folder given as ``objects:PATH`` -> :class:`ObjectCatalog`; a file
    path (or None: the default) -> the SQLite :class:`Catalog`."""
    if location and (local_path(location) is None or location.startswith("objects:")):
        loc = location[len("objects:") :] if location.startswith("objects:") else location
        return ObjectCatalog(open_storage(loc, IOCounters()), loc)
    return Catalog(location)
