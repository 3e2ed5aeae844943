"""The ModelMerge resource's models (``mm``): what to merge (base, experts, method and
parameters), under which expert-I/O ``budget`` or ``fidelity`` target, where to write the
snapshot, with which resources; and its status. ``crdgen`` turns them into the CRD.

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

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, WithJsonSchema

from mergepipe.catalog.sketch import SKETCH_KINDS
from mergepipe.methods.registry import METHODS as CORE_METHODS

from ..k8s.model import (
    HTTP_URL_PATTERN,
    IMAGE_PATTERN,
    MAX_PARALLELISM,
    RESOURCE_NAME_PATTERN,
    SECRET_KEY_PATTERN,
    ByteQuantity,
    DnsLabel,
    DnsSubdomain,
    IOBytes,
    K8sModel,
    K8sQuantity,
    NonNegInt,
    ObservedStatus,
    S3PrefixUri,
    S3Uri,
    Seed,
    Sha256,
)
from ..quantities import parse_quantity

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
            "or skipping it; sign3+r1 adds a rank-1 tier (the block's rank-1 factors + one residual sign "
            "plane); none: read exactly or skip. Only the task-arithmetic family (linear, "
            "task_arithmetic, ties, dare_*, breadcrumbs*, della*) uses tiers; an unbounded merge reads "
            "every block exactly. Default: the namespace's (chart value merges.sketchByNamespace), else "
            "the operator's (merges.sketch), else sign3+r1."
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

    @property
    def budget_bytes(self) -> int | None:
        """``spec.budget`` in bytes (:func:`~mergepipe_operator.quantities.parse_quantity`, the
        operator's one byte grammar); ``None`` when unset."""
        return None if self.budget is None else parse_quantity(self.budget, field="spec.budget")


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
