"""The MergedSnapshot resource's models (``msnap``): a committed snapshot; ``Ready=True`` only
after the operator verified the committed manifest in object storage. Never owned by (so never
garbage-collected with) the ModelMerge that produced it."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from ..k8s.model import (
    DnsSubdomain,
    IOBytes,
    K8sModel,
    NonNegInt,
    ObservedStatus,
    S3PrefixUri,
    S3Uri,
    Sha256,
    Timestamp,
)


class SourceRef(K8sModel):
    """The ModelMerge a snapshot came from (a reference, not an owner)."""

    name: DnsSubdomain
    uid: Annotated[str, StringConstraints(max_length=64)] | None = None
    generation: NonNegInt | None = None


class SnapshotSizes(K8sModel):
    """Size of the committed output files."""

    total_bytes: NonNegInt | None = None
    files: NonNegInt | None = None


class MergedSnapshotSpec(K8sModel):
    """A committed snapshot: where it is and which manifest identifies it."""

    uri: S3PrefixUri = Field(description="s3://bucket/prefix of the snapshot (holds its manifest).")
    manifest_hash: Sha256 = Field(description="SHA-256 (hex) of the committed manifest.")
    plan_digest: Sha256 | None = Field(default=None, description="Expected plan digest (hex).")
    source: SourceRef | None = None


class MergedSnapshotStatus(ObservedStatus):
    """Observed state of a MergedSnapshot: what the operator verified in its manifest."""

    verified_time: Timestamp | None = None
    plan_digest: Sha256 | None = None
    sizes: SnapshotSizes | None = None
    total_size: Annotated[str, StringConstraints(max_length=32)] | None = Field(
        default=None, description="Total output size (human-readable)."
    )
    estimated: IOBytes | None = None
    realized: IOBytes | None = None
    expert_read: Annotated[str, StringConstraints(max_length=32)] | None = None
    storage_uri: S3Uri | None = Field(
        default=None,
        description=(
            "The committed Hugging Face model folder (config.json, tokenizer, *.safetensors): "
            "spec.uri joined with the manifest's files_prefix, ending in '/'. Set once verified; "
            "what a server such as KServe (InferenceService storageUri) loads."
        ),
    )
