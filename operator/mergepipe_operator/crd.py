"""The custom resources of the operator, defined once as pydantic models.

Four kinds in ``mergepipe.io/v1alpha1``:

- :class:`ModelMerge` (``mm``): what to merge (base, experts, method and parameters), under which
  expert-I/O ``budget`` or ``fidelity`` target, where to write the snapshot, with which resources.
- :class:`MergedSnapshot` (``msnap``): a committed snapshot; ``Ready=True`` only after the operator
  verified the committed manifest in object storage. Never owned by (so never garbage-collected
  with) the ModelMerge that produced it.
- :class:`MergeQuota` (``mq``): a ResourceQuota-like limit on expert-read bytes and merges per
  time window, enforced by ``Clamp`` (lower a merge's budget to what is left) or ``Reject``.
- :class:`MergeSearch` (``msearch``): a layer-wise multi-objective merge search (``mergepipe
  search``): one driver Job per generation whose candidates are child ModelMerges
  (:mod:`mergepipe_operator.search.decisions`); the status mirrors the driver's results.

``crdgen`` turns these models into the CRD YAML (``crds/*.yaml``, copied into the Helm chart).
Field names are the Kubernetes (camelCase) names; Python attribute names are snake_case.

How layer-wise parameter values are typed. A merge parameter (mergekit's syntax) is a scalar, a
list of numbers (a *gradient* interpolated over the layers) or a list of ``{filter, value}``
entries. A structural schema must give every node one ``type`` and forbids ``type`` inside
``anyOf``/``oneOf`` (except the exact int-or-string pattern), so this union cannot be typed in the
CRD. The parameter *maps* are typed (``type: object`` with ``maxProperties``), and each *value*
is the one node marked ``x-kubernetes-preserve-unknown-fields: true`` without a ``type``
(allowed for such nodes). The operator checks names, shapes and ranges of these values in
:func:`mergepipe_operator.modelmerge.spec.validate_merge_spec` and reports ``Ready=False`` with reason
``InvalidSpec`` naming the field. Everything else in the schemas is fully typed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from mergepipe.catalog.sketch import SKETCH_KINDS
from mergepipe.methods.registry import METHODS as CORE_METHODS

GROUP = "mergepipe.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: mergekit's names of the merge methods the CRD accepts: the core's registry
#: (:data:`mergepipe.methods.registry.METHODS`), in its order, except the methods that take no
#: experts (passthrough copies one checkpoint, optionally scaled: not a merge of experts, and a
#: ModelMerge has at least one expert).
METHODS: tuple[str, ...] = tuple(n for n, m in CORE_METHODS.items() if m.max_experts != 0)
#: every parameter name some method of the registry takes, in first-seen order
PARAMETER_NAMES: tuple[str, ...] = tuple(dict.fromkeys(p.name for m in CORE_METHODS.values() for p in m.params))


def expert_count_message(method: str) -> str:
    """Why a ``method`` merge has the wrong number of experts, from the core's registry
    (``min_experts``/``max_experts``), e.g. ``slerp takes exactly 1 expert (besides the base)``."""
    m = CORE_METHODS[method]
    many = m.max_experts != 1
    return f"{method} takes {m.experts_text} expert{'s' if many else ''} (besides the base)"


def expert_count_rules() -> list[dict[str, Any]]:
    """The CRD's CEL rules on ``size(self.experts)`` per method, generated from the core's
    registry: one ``{rule, message}`` per method whose expert count is bounded beyond "at least 1"."""
    out = []
    for name, m in CORE_METHODS.items():
        if name not in METHODS:
            continue
        if m.max_experts is not None and m.max_experts == m.min_experts:
            cond = f"size(self.experts) == {m.min_experts}"
        else:
            parts = [f"size(self.experts) >= {m.min_experts}"] if m.min_experts > 1 else []
            parts += [f"size(self.experts) <= {m.max_experts}"] if m.max_experts is not None else []
            if not parts:
                continue
            cond = " && ".join(parts)
        out.append({"rule": f"self.method != '{name}' || {cond}", "message": expert_count_message(name)})
    return out


# --- patterns (Go RE2 syntax: no look-around; also valid Python `re`) -------------------------

#: A byte quantity as a string: a decimal number and an optional unit. SI units (k/K, M, G, T, P,
#: E; optional "B") are powers of 1000, binary units (Ki, Mi, Gi, Ti, Pi, Ei; optional "B") are
#: powers of 1024, "B" or no unit means bytes. Examples: "512MiB", "10Gi", "1G", "1.5TB".
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?(B|[kK]B?|Ki|KiB|[MGTPE](i|iB|B)?)?$"
#: A Kubernetes resource quantity (the pattern kubebuilder emits for resource.Quantity).
K8S_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
#: An S3 URI: bucket name rules (3-63 chars, lowercase, digits, dots, hyphens), optional key prefix.
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$"
#: An S3 URI with a non-empty key prefix (outputs never go to a bucket root).
S3_PREFIX_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]*[^\s/][^\s]*$"
HTTP_URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: An extended resource name such as "nvidia.com/gpu" or "amd.com/gpu".
RESOURCE_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
#: A duration such as "30m", "24h", "7d", "1h30m" (s, m, h, d, w).
DURATION_PATTERN = r"^([0-9]+[smhdw])+$"
IMAGE_PATTERN = r"^[^\s]+$"
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class K8sModel(BaseModel):
    """Base: camelCase field names on the wire, unknown fields refused (the API server prunes
    them anyway; refusing them here catches typos in manifests validated offline)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# --- shared field types -----------------------------------------------------------------------

ByteQuantity = Annotated[
    Annotated[StrictInt, Field(ge=1)] | Annotated[str, StringConstraints(pattern=BYTES_PATTERN)],
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": BYTES_PATTERN,
            "minimum": 1,
        }
    ),
]

K8sQuantity = Annotated[
    Annotated[StrictInt, Field(ge=0)] | Annotated[str, StringConstraints(pattern=K8S_QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": K8S_QUANTITY_PATTERN,
        }
    ),
]

S3Uri = Annotated[str, StringConstraints(pattern=S3_URI_PATTERN, max_length=1024)]
S3PrefixUri = Annotated[str, StringConstraints(pattern=S3_PREFIX_URI_PATTERN, max_length=1024)]
Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]
DnsSubdomain = Annotated[str, StringConstraints(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]
Duration = Annotated[str, StringConstraints(pattern=DURATION_PATTERN, max_length=32)]
Timestamp = Annotated[datetime, WithJsonSchema({"type": "string", "format": "date-time"})]
NonNegInt = Annotated[int, Field(ge=0)]

#: The most pods one merge may run as (spec.parallelism); the chart's merges.parallelism.max bounds
#: it further. Kubernetes allows 100,000 completions for an Indexed Job with per-index backoff.
MAX_PARALLELISM = 1024

#: The largest seed the CRDs accept: 2**53 - 1, the largest integer every JSON reader keeps exactly
#: (JavaScript, Argo CD's UI, any float64 parser). A seed only names random streams (the DARE/DELLA
#: streams are keyed by a SHA-256 of its decimal string; the search seeds torch generators with it),
#: so this range is ample. 2**63 - 1 is not usable: the API server keeps schema bounds as float64,
#: where it rounds to 2**63, and refuses the CRD ("Maximum boundary value must be of type integer").
SEED_MAX = 2**53 - 1
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]

PARAM_VALUE_DESCRIPTION = (
    "A parameter value (mergekit syntax): a number or boolean; a list of numbers (a gradient, "
    "interpolated piecewise-linearly over the layers); or a list of {filter, value} entries where "
    "the first entry whose filter is a substring of the tensor name applies and an entry without "
    "filter matches every tensor (value: a number or a gradient). Checked by the operator "
    "(Ready=False, reason InvalidSpec), since a structural schema cannot type this union."
)

#: One parameter value: typed in Python, free-form in the CRD (see the module docstring).
ParamValue = Annotated[
    Any,
    WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True, "description": PARAM_VALUE_DESCRIPTION}),
]
ParamMap = Annotated[
    dict[str, ParamValue],
    Field(
        json_schema_extra={"maxProperties": 32},
        description=(
            f"Merge parameters by mergekit name ({', '.join(PARAMETER_NAMES)}); "
            "which names a method takes is checked by the operator."
        ),
    ),
]


class Condition(K8sModel):
    """A condition, following the Kubernetes API conventions (metav1.Condition)."""

    type: Annotated[str, StringConstraints(pattern=CONDITION_TYPE_PATTERN, max_length=316)] = Field(
        description="Condition type, e.g. Ready."
    )
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, StringConstraints(pattern=CONDITION_REASON_PATTERN, min_length=1, max_length=1024)] = Field(
        description="CamelCase reason for the last transition."
    )
    message: Annotated[str, StringConstraints(max_length=32768)] = Field(description="Human-readable details.")
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: NonNegInt | None = Field(
        default=None, description="metadata.generation this condition was computed from."
    )


class ObservedStatus(K8sModel):
    """Base of the three kinds' statuses: the generation observed and the conditions (the summary
    condition is Ready), first in every status, as the API conventions name them."""

    observed_generation: NonNegInt | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "maxItems": 16,
        },
        description="Observations of the object's state; the summary condition is Ready.",
    )


class IOBytes(K8sModel):
    """Bytes per role of a merge (base read, expert read, output write)."""

    base_read_bytes: NonNegInt | None = None
    expert_read_bytes: NonNegInt | None = None
    output_write_bytes: NonNegInt | None = None


# --- ModelMerge --------------------------------------------------------------------------------


class CheckpointRef(K8sModel):
    """A Hugging Face checkpoint (safetensors, config, tokenizer) under an S3 prefix."""

    uri: S3Uri = Field(description="s3://bucket/prefix of the checkpoint.")


class ExpertSpec(K8sModel):
    """One fine-tuned expert; its task vector is (expert - base)."""

    name: DnsLabel | None = Field(
        default=None, description="Short name used in plans, manifests and status (default expert-<index>)."
    )
    uri: S3Uri = Field(description="s3://bucket/prefix of the expert checkpoint (or PEFT LoRA adapter folder).")
    format: Literal["checkpoint", "lora"] | None = Field(
        default=None,
        description=(
            "checkpoint: a full Hugging Face checkpoint; lora: a PEFT LoRA adapter folder "
            "(adapter_config.json + adapter_model.safetensors) whose task vector is s*B*A on its "
            "modules, read as its factors only; unset: detected from the prefix's files."
        ),
    )
    weight: float | None = Field(
        default=None, description="Scale of this expert's task vector (method default when unset)."
    )
    parameters: ParamMap = Field(default_factory=dict)


class OutputSpec(K8sModel):
    """Where the merged snapshot is committed."""

    uri: S3PrefixUri = Field(description="s3://bucket/prefix (not a bucket root) for the snapshot.")


class GPUSpec(K8sModel):
    """GPUs of the merge Job (defaults from the operator's settings: 1 x nvidia.com/gpu)."""

    count: Annotated[int, Field(ge=0, le=64)] | None = Field(
        default=None, description="Number of GPUs; 0 runs the merge on CPU."
    )
    resource_name: Annotated[str, StringConstraints(pattern=RESOURCE_NAME_PATTERN, max_length=253)] | None = Field(
        default=None, description="Extended resource name, e.g. nvidia.com/gpu or amd.com/gpu."
    )


class ResourcesSpec(K8sModel):
    """Compute resources of the merge Job."""

    gpu: GPUSpec | None = None
    cpu: K8sQuantity | None = Field(default=None, description='CPU request, e.g. "4" or "500m".')
    memory: K8sQuantity | None = Field(default=None, description='Memory request and limit, e.g. "32Gi".')


class SecretRef(K8sModel):
    """A Secret in the merge's namespace holding S3 credentials (passed to the Job only through
    secretKeyRef environment variables)."""

    name: DnsSubdomain
    access_key_id_key: Annotated[str, StringConstraints(pattern=SECRET_KEY_PATTERN, max_length=253)] = Field(
        default="AWS_ACCESS_KEY_ID", description="Key of the access key id in the Secret."
    )
    secret_access_key_key: Annotated[str, StringConstraints(pattern=SECRET_KEY_PATTERN, max_length=253)] = Field(
        default="AWS_SECRET_ACCESS_KEY", description="Key of the secret access key in the Secret."
    )
    session_token_key: Annotated[str, StringConstraints(pattern=SECRET_KEY_PATTERN, max_length=253)] | None = Field(
        default=None, description="Key of an optional session token in the Secret."
    )


class S3Spec(K8sModel):
    """Object-storage access of the merge Job (defaults from the operator's settings)."""

    credentials_secret_ref: SecretRef | None = None
    endpoint: Annotated[str, StringConstraints(pattern=HTTP_URL_PATTERN, max_length=1024)] | None = Field(
        default=None, description="S3 endpoint URL (empty: the operator's default)."
    )
    region: Annotated[str, StringConstraints(pattern=r"^[a-z0-9-]+$", max_length=64)] | None = None


class CalibrationSpec(K8sModel):
    """A calibration set: text the base's per-block sensitivity (diagonal Fisher) is measured on,
    once per (base, calibration set) by the analyze Job; the planner then values blocks by it."""

    uri: S3Uri = Field(
        description=(
            's3://bucket/key of a JSON-lines file of {"text": ...} documents: a few dozen documents '
            "like the merge's target text (never its evaluation set). Its content digest is part of "
            "the catalog key and of the plan digest."
        )
    )


class ModelMergeSpec(K8sModel):
    """What to merge and under which expert-I/O budget."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.budget) && has(self.fidelity))",
                    "message": "set at most one of budget and fidelity",
                },
                *expert_count_rules(),
            ]
        }
    )

    base: CheckpointRef
    experts: list[ExpertSpec] = Field(min_length=1, max_length=64, description="The experts to merge.")
    method: Literal[METHODS] = Field(description="Merge method (mergekit name).")  # type: ignore[valid-type]
    parameters: ParamMap = Field(default_factory=dict)
    budget: ByteQuantity | None = Field(
        default=None,
        description=(
            "Expert-I/O budget: bytes the merge may read from expert checkpoints, e.g. 10Gi, "
            "512MiB, 1G or an integer. Mutually exclusive with fidelity; neither means the "
            "operator's default budget (or an unbounded read when it has none)."
        ),
    )
    fidelity: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None,
        description="Target fraction (0, 1] of the task-vector energy to retain; the planner reads the fewest bytes that reach it.",
    )
    calibration: CalibrationSpec | None = Field(
        default=None,
        description=(
            "Calibration set for the planner's fisher block value (default: the operator's, chart "
            "value merges.calibration.uri; none: energy only)."
        ),
    )
    block_value: Literal["energy", "fisher"] | None = Field(
        default=None,
        description=(
            "How the planner values an expert block: fisher (task-vector energy weighted by the base's "
            "Fisher sensitivity on the calibration set; the default when there is one) or energy."
        ),
    )
    sketch: Literal[SKETCH_KINDS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description=(
            "Fidelity tiers under a budget or fidelity target: signK lets the planner merge an expert "
            "block from the first k <= K (1-3) residual sign planes of its sketch (recorded by the "
            "analyze Job; their bytes count against the same budget) instead of reading it exactly "
            "or skipping it; none: read exactly or skip. Only the task-arithmetic family (linear, "
            "task_arithmetic, ties, dare_*, breadcrumbs*, della*) uses tiers; an unbounded merge reads "
            "every block exactly. Default: the namespace's (chart value merges.sketchByNamespace), else "
            "the operator's (merges.sketch), else sign3."
        ),
    )
    output: OutputSpec
    seed: Seed | None = Field(default=None, description="Seed of random sparsification (DARE, DELLA): 0 to 2^53-1.")
    resources: ResourcesSpec | None = None
    image: Annotated[str, StringConstraints(pattern=IMAGE_PATTERN, max_length=512)] | None = Field(
        default=None,
        description=(
            "Image of the merge Job (its pods hold the namespace's S3 keys): refused (Ready=False, "
            "InvalidSpec) unless the operator's merges.allowedImages admits it; unset: the operator's "
            "merger image. The analyze Job always runs the operator's image."
        ),
    )
    s3: S3Spec | None = None
    parallelism: Annotated[int, Field(ge=1, le=MAX_PARALLELISM)] | None = Field(
        default=None,
        description=(
            "Pods that execute the merge: N > 1 runs it as an Indexed Job of N pods, pod i "
            "executing part i of the plan (its output shards, balanced by bytes; mergepipe execute "
            "--part i/N) with retries per index, and the operator commits the parts when every "
            "index succeeded; 1 runs one pod. Unset: chosen from the plan's bytes (chart values "
            "merges.parallelism.bytesPerPart and max). At most the chart's merges.parallelism.max "
            "and the plan's number of output shards. Each pod gets spec.resources (GPUs included)."
        ),
    )
    queue_name: DnsLabel | None = Field(
        default=None,
        description=(
            "Kueue LocalQueue of the merge's (analyze and merge) Jobs (label kueue.x-k8s.io/queue-name): Kueue creates them "
            "suspended and starts them when it admits them. Default: the operator's (chart value "
            "kueue.queueName); none: no label."
        ),
    )


class AdmissionStatus(K8sModel):
    """How the merge was admitted under the namespace's MergeQuotas."""

    key: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        default=None, description="Ledger key of the reservation (uid.generation)."
    )
    budget_bytes: NonNegInt | None = None
    clamped: bool | None = None
    quotas: list[Annotated[str, StringConstraints(max_length=253)]] = Field(default_factory=list, max_length=32)
    admission_check: DnsSubdomain | None = Field(
        default=None,
        description=(
            "The Kueue AdmissionCheck (controllerName mergepipe.io/io-budget) that reserves this "
            "merge's plan in the namespace's MergeQuotas when Kueue admits its Job, instead of the "
            "operator before creating the Job."
        ),
    )
    started: bool | None = Field(
        default=None,
        description=(
            "A pod of the merge Job was seen running (it may have read expert bytes): its reservation is "
            "charged even if the Job's pods are gone later (Kueue eviction, foreground deletion)."
        ),
    )


class PlanStatus(K8sModel):
    """The plan of the current generation (planned in-process by the operator from the catalog):
    its digest, the I/O it will do per role, the task-vector energy it retains and where the full
    plan object is (the merge Job executes that object)."""

    digest: Sha256 = Field(
        description="Plan digest (SHA-256 hex of the canonical plan); also on the merge Job's annotation."
    )
    uri: Annotated[str, StringConstraints(max_length=2048)] | None = Field(
        default=None, description="Where the full plan object is: <plans.prefix>/<namespace>/<name>/<digest>.json."
    )
    estimated: IOBytes | None = Field(default=None, description="Bytes per role the plan will read and write.")
    retained_energy: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None,
        description="Fraction of the task-vector energy the selected blocks retain (1: every block of every expert is read).",
    )
    sketch: Literal[SKETCH_KINDS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description=(
            "Fidelity tiers the plan was made with (spec.sketch or the default); none when "
            "it reads every expert block exactly or skips it (no budget or fidelity target, a method "
            "outside the task-arithmetic family, or sketch none)."
        ),
    )
    sketch_read_bytes: NonNegInt | None = Field(
        default=None,
        description=(
            "Of estimated.expertReadBytes, the bytes of block sketches the plan reads (charged to the "
            "budget and the MergeQuota like any expert byte); 0 without tiers."
        ),
    )


class PartsStatus(K8sModel):
    """Progress of a partitioned merge (an Indexed Job; ModelMergeSpec.parallelism)."""

    total: Annotated[int, Field(ge=1, le=MAX_PARALLELISM)] = Field(description="N, the number of parts (Job indexes).")
    succeeded: NonNegInt = Field(default=0, description="Parts (indexes) that succeeded.")
    progress: Annotated[str, StringConstraints(max_length=16)] | None = Field(
        default=None, description="succeeded/total, e.g. 3/4 (the Parts printer column)."
    )
    completed_indexes: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="The Job's completedIndexes, e.g. 0-2,4."
    )
    failed_indexes: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="The Job's failedIndexes (indexes out of retries), e.g. 3."
    )
    failed_pods: NonNegInt | None = Field(
        default=None, description="Pods that failed, retries included (each index is retried on its own)."
    )


class ModelMergeStatus(ObservedStatus):
    """Observed state of a ModelMerge."""

    expert_count: NonNegInt | None = None
    method: Annotated[str, StringConstraints(max_length=64)] | None = None
    budget: Annotated[str, StringConstraints(max_length=32)] | None = Field(
        default=None, description="Effective budget after quota admission (human-readable)."
    )
    budget_bytes: NonNegInt | None = None
    plan: PlanStatus | None = Field(default=None, description="The plan the merge Job executes.")
    realized: IOBytes | None = Field(
        default=None, description="Bytes per role the committed merge read and wrote (its manifest)."
    )
    expert_read: Annotated[str, StringConstraints(max_length=32)] | None = Field(
        default=None, description="Realized expert read (human-readable)."
    )
    job_name: DnsLabel | None = None
    parts: PartsStatus | None = Field(
        default=None, description="Parts done / total of a partitioned merge (unset: one pod)."
    )
    snapshot: DnsSubdomain | None = Field(default=None, description="Name of the MergedSnapshot.")
    admission: AdmissionStatus | None = None


# --- MergedSnapshot ----------------------------------------------------------------------------


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


# --- MergeQuota --------------------------------------------------------------------------------


class QuotaHard(K8sModel):
    """Hard limits per window; an unset limit is unlimited."""

    expert_read_bytes: ByteQuantity | None = Field(
        default=None, description="Expert bytes all merges of the namespace may read per window."
    )
    merges: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        default=None, description="Merges that may be admitted per window."
    )


class MergeQuotaSpec(K8sModel):
    """Limits on the merges of this namespace."""

    hard: QuotaHard
    window: Duration | None = Field(
        default=None,
        description="Rolling window, e.g. 24h, 7d, 1h30m; charges older than this stop counting. Unset: charges never expire.",
    )
    enforcement: Literal["Clamp", "Reject"] = Field(
        default="Reject",
        description="Clamp lowers a merge's budget to what is left; Reject refuses a merge that does not fit.",
    )


class QuotaAmounts(K8sModel):
    """Amounts in bytes and merges."""

    expert_read_bytes: NonNegInt | None = None
    merges: NonNegInt | None = None


class LedgerEntry(K8sModel):
    """One merge's charge against the quota: Reserved at admission, Charged from the realized bytes in
    its manifest (or the reservation, if the Job failed)."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    merge: Annotated[str, StringConstraints(max_length=253)]
    bytes: NonNegInt
    state: Literal["Reserved", "Charged"]
    time: Timestamp


class QuotaCarry(K8sModel):
    """Charges folded out of the ledger to keep it small; they count until expires (forever when unset)."""

    expert_read_bytes: NonNegInt | None = None
    merges: NonNegInt | None = None
    expires: Timestamp | None = None


class MergeQuotaStatus(ObservedStatus):
    """Observed state of a MergeQuota: limits as bytes, usage in the current window, the ledger."""

    hard: QuotaAmounts | None = None
    used: QuotaAmounts | None = None
    ledger: list[LedgerEntry] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["key"], "maxItems": 512},
    )
    carry: QuotaCarry | None = None


# --- MergeSearch -------------------------------------------------------------------------------

#: ``mergepipe search --strategy`` (mergepipe.search.runner.STRATEGIES).
SEARCH_STRATEGIES: tuple[str, ...] = ("async", "sync", "random")
PARAM_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
METRIC_PATTERN = r"^[A-Za-z0-9_.:/-]+$"

_VARY_BOUNDS = "min must be below max"
_EVALS_VS_INITIAL = "evaluations must be at least initial (the Sobol design points come first)"
_REF_POINT_SIZE = "refPoint needs one value per objective"
_VARY_EXPERT = "vary[].expert must name one of spec.experts"
_ONE_EVALUATOR = "set at most one of command and zooBatches"


class VarySpec(K8sModel):
    """A parameter the search varies: one value per layer block, in [min, max] (the CLI's
    mergepipe search --vary [EXPERT:]NAME=MIN:MAX)."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{"rule": "self.min < self.max", "message": _VARY_BOUNDS}]}
    )

    name: Annotated[str, StringConstraints(pattern=PARAM_NAME_PATTERN, max_length=64)] = Field(
        description="Merge parameter (mergekit name), e.g. weight or density."
    )
    expert: DnsLabel | None = Field(
        default=None,
        description="Name of the expert (spec.experts[].name) it varies for; unset: every expert (or the merge, for a global parameter).",
    )
    min: float = Field(description="Lower bound.")
    max: float = Field(description="Upper bound (above min).")

    @model_validator(mode="after")
    def _bounds(self) -> VarySpec:
        if not self.min < self.max:
            raise ValueError(f"{_VARY_BOUNDS}: min={self.min:g}, max={self.max:g}")
        return self


class ObjectiveSpec(K8sModel):
    """A metric the evaluator reports, minimised or maximised."""

    metric: Annotated[str, StringConstraints(pattern=METRIC_PATTERN, min_length=1, max_length=128)] = Field(
        description="Metric name, e.g. loss:python (built-in evaluator: loss:<domain>) or a key of the command's JSON."
    )
    sense: Literal["min", "max"] = Field(default="min", description="min or max.")


class EvaluatorSpec(K8sModel):
    """How each candidate is scored; without command: the built-in eval losses on the demo zoo's
    held-out sets."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!(has(self.command) && has(self.zooBatches))", "message": _ONE_EVALUATOR}
            ]
        }
    )

    command: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = Field(
        default=None,
        description="Command run per candidate ({checkpoint} is replaced by the snapshot folder, else appended); it prints a JSON object of metrics.",
    )
    timeout_seconds: Annotated[int, Field(ge=1, le=7 * 86400)] | None = Field(
        default=None, description="Seconds per evaluation; a slower candidate is recorded failed."
    )
    zoo_batches: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        default=None, description="Built-in evaluator: score only the first N batches per domain."
    )

    @model_validator(mode="after")
    def _one(self) -> EvaluatorSpec:
        if self.command is not None and self.zoo_batches is not None:
            raise ValueError(_ONE_EVALUATOR)
        return self


class MergeSearchSpec(K8sModel):
    """A layer-wise multi-objective search over merge parameters: every candidate is a budgeted
    merge followed by an evaluation; the result is a Pareto set of snapshots."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.evaluations >= self.initial", "message": _EVALS_VS_INITIAL},
                {
                    "rule": "!has(self.refPoint) || size(self.refPoint) == size(self.objectives)",
                    "message": _REF_POINT_SIZE,
                },
                {
                    "rule": "self.vary.all(v, !has(v.expert) || self.experts.exists(e, has(e.name) && e.name == v.expert))",
                    "message": _VARY_EXPERT,
                },
            ]
        }
    )

    base: CheckpointRef
    experts: list[ExpertSpec] = Field(
        min_length=1,
        max_length=64,
        description="The source models; their weight and parameters are fixed for every candidate.",
    )
    method: Literal[METHODS] = Field(default="task_arithmetic", description="Merge method (mergekit name).")  # type: ignore[valid-type]
    parameters: ParamMap = Field(default_factory=dict)
    vary: list[VarySpec] = Field(min_length=1, max_length=16, description="The parameters searched, per layer block.")
    layer_blocks: Annotated[int, Field(ge=1, le=512)] = Field(
        default=1,
        description=(
            "Contiguous blocks of decoder layers; one value per block and varied parameter. Default 1 "
            "(model-level), as the CLI's: layer-wise did not beat it at 12 evaluations (docs/SEARCH.md)."
        ),
    )
    objectives: list[ObjectiveSpec] = Field(
        min_length=1,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["metric"]},
        description="Metrics to optimise (each metric once).",
    )
    evaluator: EvaluatorSpec | None = None
    evaluations: Annotated[int, Field(ge=1, le=10_000)] = Field(
        default=24, description="Candidates in total (a merge and an evaluation each, failed ones included)."
    )
    initial: Annotated[int, Field(ge=1, le=1_000)] = Field(
        default=8, description="Sobol design points before the optimizer."
    )
    workers: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="Candidates merged and evaluated at once (worker Jobs)."
    )
    strategy: Literal[SEARCH_STRATEGIES] = Field(  # type: ignore[valid-type]
        default="async",
        description="async (prior-guided, pending-aware), sync (batch qNEHVI, no prior) or random.",
    )
    prior: bool = Field(default=True, description="Use the parameter-discrepancy prior and frontier reranking (async).")
    ref_point: list[float] | None = Field(
        default=None,
        max_length=8,
        description="Hypervolume reference point, one value per objective in the metric's units (default: from the first observations).",
    )
    budget: ByteQuantity | None = Field(
        default=None, description="Expert-I/O budget of every candidate merge (charged to MergeQuotas per candidate)."
    )
    sketch: Literal[SKETCH_KINDS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description=(
            "Fidelity tiers of every candidate merge under its budget (the candidates' ModelMerge "
            "spec.sketch): signK lets the planner merge an expert block from the first k <= K (1-3) "
            "residual sign planes of its sketch instead of reading it exactly or skipping it; none: "
            "read exactly or skip. Default: the candidates' ModelMerge default (chart values "
            "merges.sketchByNamespace, merges.sketch), else sign3."
        ),
    )
    seed: Seed = Field(default=0, description="Seed of the design, proposals and merges: 0 to 2^53-1.")
    output: OutputSpec = Field(description="Prefix for the search state and the candidates' snapshots.")
    resources: ResourcesSpec | None = None
    image: Annotated[str, StringConstraints(pattern=IMAGE_PATTERN, max_length=512)] | None = Field(
        default=None,
        description=(
            "Image of the candidates' merge Jobs and of the evaluation Jobs: refused (Ready=False, "
            "InvalidSpec) unless the operator's merges.allowedImages admits it. The driver Job (which "
            "holds the search driver's ServiceAccount token) always runs the operator's merger image."
        ),
    )
    s3: S3Spec | None = None
    queue_name: DnsLabel | None = Field(
        default=None,
        description=(
            "Kueue LocalQueue of the search's (driver, evaluation; and its candidate ModelMerges') Jobs (label kueue.x-k8s.io/queue-name): Kueue creates them "
            "suspended and starts them when it admits them. Default: the operator's (chart value "
            "kueue.queueName); none: no label."
        ),
    )

    @model_validator(mode="after")
    def _cross_field(self) -> MergeSearchSpec:
        if self.evaluations < self.initial:
            raise ValueError(f"{_EVALS_VS_INITIAL}: evaluations={self.evaluations}, initial={self.initial}")
        if self.ref_point is not None and len(self.ref_point) != len(self.objectives):
            raise ValueError(
                f"{_REF_POINT_SIZE}: {len(self.ref_point)} value(s) for {len(self.objectives)} objective(s)"
            )
        names = {e.name for e in self.experts if e.name}
        for v in self.vary:
            if v.expert is not None and v.expert not in names:
                raise ValueError(f"{_VARY_EXPERT}: {v.expert!r} is not among {sorted(names)}")
        metrics = [o.metric for o in self.objectives]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"objectives: a metric is listed twice ({', '.join(metrics)})")
        return self


class ParetoPoint(K8sModel):
    """One candidate of the Pareto set."""

    candidate: NonNegInt = Field(description="Candidate number.")
    objectives: dict[str, float] = Field(
        default_factory=dict, json_schema_extra={"maxProperties": 8}, description="Its metric values, by objective."
    )
    snapshot: DnsSubdomain | None = Field(default=None, description="Name of its MergedSnapshot.")
    uri: Annotated[str, StringConstraints(max_length=2048)] | None = Field(
        default=None, description="Where its snapshot is."
    )


class MergeSearchStatus(ObservedStatus):
    """Observed state of a MergeSearch."""

    search_id: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, alias="searchID", description="The search's id (recorded in its candidates' manifests)."
    )
    evaluations: NonNegInt | None = Field(default=None, description="Candidates finished (failed ones included).")
    running: NonNegInt | None = Field(default=None, description="Candidates being merged or evaluated.")
    failed: NonNegInt | None = None
    hypervolume: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="Hypervolume of the Pareto set (minimised objectives) against refPoint."
    )
    ref_point: list[float] = Field(default_factory=list, max_length=8)
    pareto_size: NonNegInt | None = None
    pareto: list[ParetoPoint] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["candidate"],
            "maxItems": 64,
        },
    )
    state_uri: Annotated[str, StringConstraints(max_length=2048)] | None = Field(
        default=None, alias="stateURI", description="The search state (resume)."
    )
    driver_job: DnsLabel | None = Field(default=None, description="The driver Job of this generation.")
    expert_read: Annotated[str, StringConstraints(max_length=32)] | None = Field(
        default=None, description="Expert bytes read by all candidate merges (human-readable)."
    )


# --- resource table ----------------------------------------------------------------------------

READY_STATUS = '.status.conditions[?(@.type=="Ready")].status'
READY_REASON = '.status.conditions[?(@.type=="Ready")].reason'

#: Everything crdgen needs per kind.
RESOURCES: dict[str, dict[str, Any]] = {
    "ModelMerge": {
        "plural": "modelmerges",
        "singular": "modelmerge",
        "short_names": ["mm"],
        "spec": ModelMergeSpec,
        "status": ModelMergeStatus,
        "description": "A budget-aware merge of expert checkpoints into a base model.",
        "columns": [
            {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
            {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
            {"name": "Method", "type": "string", "jsonPath": ".spec.method"},
            {"name": "Experts", "type": "integer", "jsonPath": ".status.expertCount"},
            {"name": "Budget", "type": "string", "jsonPath": ".status.budget"},
            {"name": "ExpertRead", "type": "string", "jsonPath": ".status.expertRead"},
            {"name": "Parts", "type": "string", "jsonPath": ".status.parts.progress"},
            {"name": "Retained", "type": "number", "jsonPath": ".status.plan.retainedEnergy", "priority": 1},
            {"name": "Plan", "type": "string", "jsonPath": ".status.plan.digest", "priority": 1},
            {"name": "Snapshot", "type": "string", "jsonPath": ".status.snapshot", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
    "MergedSnapshot": {
        "plural": "mergedsnapshots",
        "singular": "mergedsnapshot",
        "short_names": ["msnap"],
        "spec": MergedSnapshotSpec,
        "status": MergedSnapshotStatus,
        "description": "A committed merged checkpoint, verified against its manifest.",
        "columns": [
            {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
            {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
            {"name": "Source", "type": "string", "jsonPath": ".spec.source.name"},
            {"name": "Size", "type": "string", "jsonPath": ".status.totalSize"},
            {"name": "ExpertRead", "type": "string", "jsonPath": ".status.expertRead"},
            {"name": "URI", "type": "string", "jsonPath": ".spec.uri", "priority": 1},
            {"name": "StorageURI", "type": "string", "jsonPath": ".status.storageUri", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
    "MergeQuota": {
        "plural": "mergequotas",
        "singular": "mergequota",
        "short_names": ["mq"],
        "spec": MergeQuotaSpec,
        "status": MergeQuotaStatus,
        "description": "Limits on expert-read bytes and merges of a namespace per time window.",
        "columns": [
            {"name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement"},
            {"name": "Window", "type": "string", "jsonPath": ".spec.window"},
            {"name": "ExpertReadUsed", "type": "integer", "jsonPath": ".status.used.expertReadBytes"},
            {"name": "ExpertReadHard", "type": "string", "jsonPath": ".spec.hard.expertReadBytes"},
            {"name": "MergesUsed", "type": "integer", "jsonPath": ".status.used.merges"},
            {"name": "MergesHard", "type": "integer", "jsonPath": ".spec.hard.merges"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
}

RESOURCES["MergeSearch"] = {
    "plural": "mergesearches",
    "singular": "mergesearch",
    "short_names": ["msearch"],
    "spec": MergeSearchSpec,
    "status": MergeSearchStatus,
    "description": "A layer-wise multi-objective search over merge parameters (a Pareto set of merged snapshots).",
    "columns": [
        {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
        {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
        {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy"},
        {"name": "Evaluated", "type": "integer", "jsonPath": ".status.evaluations"},
        {"name": "Pareto", "type": "integer", "jsonPath": ".status.paretoSize"},
        {"name": "Hypervolume", "type": "number", "jsonPath": ".status.hypervolume"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}

PLURALS = {kind: r["plural"] for kind, r in RESOURCES.items()}
