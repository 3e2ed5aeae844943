"""MergedSnapshot decisions as pure functions: the snapshot's name, the facts of a committed
manifest (:func:`manifest_facts`) and their verification (:func:`snapshot_ready`). From the core
it uses only the manifest format of :mod:`mergepipe.commit.manifest` (stdlib-only)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergepipe.commit.manifest import MANIFEST_FORMAT, manifest_bytes as _core_manifest_bytes, snapshot_id

from ..k8s.conditions import Reason
from ..k8s.names import DIGEST_RE, dns_label
from ..quantities import human_bytes, is_number

TERMINAL_SNAPSHOT_REASONS = frozenset(
    {
        Reason.MANIFEST_INVALID,
        Reason.MANIFEST_HASH_MISMATCH,
        Reason.PLAN_DIGEST_MISMATCH,
        Reason.OUTPUT_MISMATCH,
        Reason.BUDGET_EXCEEDED,
    }
)


def snapshot_name(merge_name: str, manifest_hash: str) -> str:
    """Deterministic MergedSnapshot name: ModelMerge name + 12 hex of the manifest hash."""
    h = manifest_hash.removeprefix("sha256:")
    if not DIGEST_RE.match(h):
        raise ValueError(f"manifest hash must be 64 lowercase hex characters, got {manifest_hash!r}")
    return dns_label(merge_name, h[:12])


def manifest_hash(raw: bytes | str) -> str:
    """SHA-256 (hex) of the manifest object's bytes as stored (as ``mergepipe.commit``)."""
    if isinstance(raw, str):
        raw = raw.encode()
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class ManifestFacts:
    """What the operator reads from a committed manifest (written by
    ``mergepipe.result.build_manifest``, format ``mergepipe.manifest/v1``)::

        {"format": "mergepipe.manifest/v1", "snapshot_id": "snap-<16 hex>", "plan_digest": "<64 hex>",
         "files_prefix": "runs/<id>",                      # outputs live under <out>/<files_prefix>/
         "outputs": {"model.safetensors": {"size": int, "sha256": "<hex>"}, ...},   # or "tree_sha256"
         "io": {"expert_budget_bytes": int | null, "fidelity": float | null,
                "estimated": {"base_read_bytes", "expert_read_bytes", "output_write_bytes"},
                "realized":  {"base_read_bytes", "expert_read_bytes", "output_write_bytes", ...},
                "earlier_attempts": {...}},   # only after a resume: what earlier attempts moved
         ...}

    ``earlier`` holds ``io.earlier_attempts`` (all ``None`` when the run was not resumed): bytes
    that attempts before a resume had moved (see :mod:`mergepipe.parts`).
    """

    plan_digest: str | None
    snapshot_id: str | None
    files_prefix: str
    budget_bytes: int | None
    outputs: dict[str, dict[str, Any]]
    estimated: dict[str, int | None]
    realized: dict[str, int | None]
    earlier: dict[str, int | None] = field(default_factory=dict)

    @property
    def spent_expert_bytes(self) -> int | None:
        """Expert bytes the snapshot cost in all: the final attempts' (``realized``) plus what
        earlier attempts had read before a resume; ``None`` when the manifest has no realized
        expert bytes."""
        rx = self.realized.get("expertReadBytes")
        return None if rx is None else rx + int(self.earlier.get("expertReadBytes") or 0)

    @property
    def total_bytes(self) -> int:
        return sum(int(o.get("size") or 0) for o in self.outputs.values())


_ROLES = (
    ("base_read_bytes", "baseReadBytes"),
    ("expert_read_bytes", "expertReadBytes"),
    ("output_write_bytes", "outputWriteBytes"),
)


def _io(d: Any, where: str) -> dict[str, int | None]:
    """Byte counts of one ``io`` section; a count that is present must be an integer >= 0 (a
    negative realized count would refund a MergeQuota). Raises ValueError naming the field."""
    d = d if isinstance(d, dict) else {}
    out: dict[str, int | None] = {}
    for snake, camel in _ROLES:
        v = d.get(snake)
        if v is None:
            out[camel] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"manifest io.{where}.{snake} is {v!r}, not a byte count (an integer >= 0)")
        out[camel] = v
    return out


def manifest_facts(doc: Mapping[str, Any]) -> ManifestFacts:
    """Extract :class:`ManifestFacts` (raises ValueError naming what is wrong)."""
    if not isinstance(doc, Mapping):
        raise ValueError("the manifest is not a JSON object")
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest format {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    outputs = doc.get("outputs")
    if not isinstance(outputs, dict) or not outputs:
        raise ValueError("the manifest lists no outputs")
    for path, o in outputs.items():
        # the content key: SHA-256 of the file, or (shards partly written by server-side copy)
        # the tree digest over its header and per-tensor SHA-256s (mergepipe.commit.manifest)
        if not isinstance(o, dict) or not any(DIGEST_RE.match(str(o.get(k, ""))) for k in ("sha256", "tree_sha256")):
            raise ValueError(f"output {path} has no SHA-256 or tree digest")
        if not is_number(o.get("size")) or o["size"] < 0:
            raise ValueError(f"output {path} has no size")
    io_doc = doc.get("io")
    io: dict[str, Any] = io_doc if isinstance(io_doc, dict) else {}
    budget = io.get("expert_budget_bytes")
    prefix = doc.get("files_prefix") or ""
    if not isinstance(prefix, str) or prefix.startswith("/") or ".." in prefix.split("/"):
        raise ValueError(f"files_prefix {prefix!r} is not a relative prefix")
    return ManifestFacts(
        plan_digest=doc.get("plan_digest"),
        snapshot_id=doc.get("snapshot_id"),
        files_prefix=prefix,
        budget_bytes=int(budget) if is_number(budget) else None,
        outputs={str(k): dict(v) for k, v in outputs.items()},
        estimated=_io(io.get("estimated"), "estimated"),
        realized=_io(io.get("realized"), "realized"),
        earlier=_io(io.get("earlier_attempts"), "earlier_attempts"),
    )


def output_path(facts: ManifestFacts, name: str) -> str:
    """Path of an output file relative to the snapshot URI."""
    return f"{facts.files_prefix.strip('/')}/{name}" if facts.files_prefix else name


def storage_uri(snapshot_uri: str, facts: ManifestFacts) -> str:
    """The committed Hugging Face model folder of a snapshot, ending in ``/``: ``snapshot_uri``
    itself, or its ``files_prefix`` folder (object stores: ``runs/<run id>/``, where the commit
    wrote the shards, config.json and the tokenizer files before publishing the manifest). What
    a model server loads, e.g. KServe's ``storageUri``."""
    base = snapshot_uri.rstrip("/") + "/"
    prefix = facts.files_prefix.strip("/")
    return base + prefix + "/" if prefix else base


def snapshot_ready(  # noqa: C901, PLR0912 - one verdict per way a committed manifest can fail, each its own Reason
    manifest: bytes | str | Mapping[str, Any] | None,
    expected_plan_digest: str | None,
    expected_manifest_hash: str | None,
    *,
    object_sizes: Mapping[str, int | None] | None = None,
) -> tuple[bool, str, str]:
    """Is a committed snapshot verified? ``(ready, reason, message)`` for its Ready condition.

    ``manifest`` is the manifest object as read from storage (bytes; hashed as stored), a parsed
    dict (hashed as the core serializes it), or ``None`` when no manifest exists yet. Checks: it
    parses as a ``mergepipe.manifest/v1``; its hash equals ``expected_manifest_hash`` (if given);
    its plan digest equals ``expected_plan_digest`` (if given); its ``snapshot_id`` matches the
    plan digest and output hashes; realized expert reads <= planned <= budget; and, when
    ``object_sizes`` (``{output path relative to the snapshot URI: size, or None if absent}``,
    from HEAD requests) is given, every output exists with its listed size. Output contents are
    not re-hashed here (that reads the whole snapshot; ``mergepipe verify`` does it).
    """
    if manifest is None:
        return False, Reason.MANIFEST_MISSING, "no committed manifest yet"
    if isinstance(manifest, (bytes, str)):
        h = manifest_hash(manifest)
        try:
            doc = json.loads(manifest)
        except (ValueError, UnicodeDecodeError) as e:
            return False, Reason.MANIFEST_INVALID, f"the manifest is not valid JSON: {e}"
    else:
        doc = dict(manifest)
        h = manifest_hash(_core_manifest_bytes(doc))
    if expected_manifest_hash:
        want = expected_manifest_hash.removeprefix("sha256:")
        if h != want:
            return False, Reason.MANIFEST_HASH_MISMATCH, f"manifest hash is {h[:16]}…, expected {want[:16]}…"
    try:
        facts = manifest_facts(doc)
    except ValueError as e:
        return False, Reason.MANIFEST_INVALID, str(e)
    if expected_plan_digest and facts.plan_digest != expected_plan_digest:
        return (
            False,
            Reason.PLAN_DIGEST_MISMATCH,
            f"the manifest's plan digest is {str(facts.plan_digest)[:16]}…, expected {expected_plan_digest[:16]}…",
        )
    if facts.snapshot_id != snapshot_id(str(facts.plan_digest or ""), facts.outputs):
        return False, Reason.MANIFEST_INVALID, "snapshot_id does not match the plan digest and the output hashes"
    rx, px = facts.realized.get("expertReadBytes"), facts.estimated.get("expertReadBytes")
    if rx is not None and px is not None and rx > px:
        return False, Reason.BUDGET_EXCEEDED, f"realized expert reads {rx} B exceed the planned {px} B"
    if rx is not None and facts.budget_bytes is not None and rx > facts.budget_bytes:
        return False, Reason.BUDGET_EXCEEDED, f"realized expert reads {rx} B exceed the budget {facts.budget_bytes} B"
    if object_sizes is not None:
        for name, o in sorted(facts.outputs.items()):
            path = output_path(facts, name)
            size = object_sizes.get(path)
            if size is None:
                return False, Reason.OUTPUT_MISMATCH, f"output {path} listed in the manifest does not exist"
            if int(size) != int(o["size"]):
                return False, Reason.OUTPUT_MISMATCH, f"output {path} has {size} B, the manifest says {o['size']} B"
    msg = f"manifest {h[:12]} verified: {len(facts.outputs)} file(s), {human_bytes(facts.total_bytes)}"
    if rx is not None:
        msg += f", {human_bytes(rx)} expert reads"
    return True, Reason.VERIFIED, msg
