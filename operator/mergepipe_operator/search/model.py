"""The MergeSearch resource's models (``msearch``): a layer-wise multi-objective merge search
(``mergepipe search``): one driver Job per generation whose candidates are child ModelMerges
(:mod:`mergepipe_operator.search.decisions`); the status mirrors the driver's results."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from mergepipe.catalog.sketch import SKETCH_KINDS

from ..k8s.model import IMAGE_PATTERN, ByteQuantity, DnsLabel, DnsSubdomain, K8sModel, NonNegInt, ObservedStatus, Seed
from ..modelmerge.model import (
    METHODS,
    CalibrationSpec,
    CheckpointRef,
    ExpertSpec,
    OutputSpec,
    ParamMap,
    ResourcesSpec,
    S3Spec,
)
from ..quantities import parse_quantity

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
            "residual sign planes of its sketch instead of reading it exactly or skipping it; sign3+r1 "
            "adds a rank-1 tier (rank-1 factors + one residual sign plane); none: "
            "read exactly or skip. Default: the candidates' ModelMerge default (chart values "
            "merges.sketchByNamespace, merges.sketch), else sign3+r1."
        ),
    )
    block_value: Literal["energy", "fisher"] | None = Field(
        default=None,
        description=(
            "How the planner values an expert block in every candidate merge (the candidates' "
            "ModelMerge spec.blockValue): fisher (task-vector energy weighted by the base's Fisher "
            "sensitivity on the calibration set; the default when there is one) or energy."
        ),
    )
    calibration: CalibrationSpec | None = Field(
        default=None,
        description=(
            "Calibration set of the fisher block value of every candidate merge (the candidates' "
            "ModelMerge spec.calibration; default: the operator's, chart value "
            "merges.calibration.uri; none: energy only)."
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

    @property
    def budget_bytes(self) -> int | None:
        """``spec.budget`` (every candidate's) in bytes (:func:`~mergepipe_operator.quantities.parse_quantity`, the
        operator's one byte grammar); ``None`` when unset."""
        return None if self.budget is None else parse_quantity(self.budget, field="spec.budget")


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
