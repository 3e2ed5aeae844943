"""Planning a merge in-process: ``mergepipe.pipeline.build_plan`` over the catalog's index objects
(numpy only: shard headers and catalog objects are read, never a tensor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mergepipe.catalog.objectstore import ObjectCatalog
from mergepipe.catalog.sensitivity import load_calibration
from mergepipe.errors import InputError
from mergepipe.parts import max_useful_parts
from mergepipe.pipeline import MissingAnalysis, build_plan
from mergepipe.request import PlanningOptions
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage

from .decisions import ANALYZE_BLOCK_BYTES, analysis_id
from .request import merge_request, spec_where


@dataclass(frozen=True)
class PlanSummary:
    """What the operator needs from planning a merge.

    Attributes:
        digest: plan digest (64 hex); empty when planning could not finish.
        plan_json: the full plan (canonical JSON bytes) for the worker; the operator writes it to
            ``decisions.plan_uri(...)``.
        base_read_bytes, expert_read_bytes, output_write_bytes: the plan's I/O estimate.
        budget_bytes: the budget the plan was made under (``None``: unbounded).
        retained_energy: fraction of the task-vector energy the plan retains (``status.plan.retainedEnergy``).
        missing_experts: URIs the catalog has no statistics for (an analyze Job must run first).
        missing_sensitivity: the catalog has no sensitivity of the base on the calibration set
            (the analyze Job records it too).
        analysis_id: content address of that missing analysis (``decisions.analysis_id``).
        shards: the plan's output shards, the most parts it can be split into
            (:func:`mergepipe.parts.max_useful_parts`).
        calibration_uri: the calibration set the plan uses (``spec.calibration.uri``), or None.
        block_value: the planner's block value (``"energy"`` or ``"fisher"``).
        sketch: the fidelity tiers the plan was made with (``"none"``, ``"sign1"``..``"sign3"``, ``"sign3+r1"``:
            ``"none"`` when the plan reads or skips every block, see :attr:`mergepipe.planner.plan.Plan.sketch`).
        sketch_read_bytes: of ``expert_read_bytes``, the bytes of block sketches the plan reads.
    """

    digest: str = ""
    plan_json: bytes = b""
    base_read_bytes: int = 0
    expert_read_bytes: int = 0
    output_write_bytes: int = 0
    budget_bytes: int | None = None
    retained_energy: float | None = None
    missing_experts: tuple[str, ...] = field(default_factory=tuple)
    missing_sensitivity: bool = False
    analysis_id: str = ""
    shards: int = 1
    calibration_uri: str | None = None
    block_value: str = "energy"
    sketch: str = "none"
    sketch_read_bytes: int = 0

    @property
    def needs_analysis(self) -> bool:
        """The catalog lacks expert statistics or the base's sensitivity: analyze first."""
        return bool(self.missing_experts or self.missing_sensitivity)


class PlanInputError(Exception):
    """The core refused the merge's inputs (a checkpoint that is missing, unreadable or
    incompatible with the base; a parameter that fits no tensor): ``field`` is the spec field it
    names, the message the core's explanation with the fix."""

    def __init__(self, message: str, field: str = "spec"):
        super().__init__(message)
        self.field = field


def plan_merge(spec: dict[str, Any], catalog_uri: str | None, *, storage: Any = None) -> PlanSummary:
    """Plan a merge in-process from the catalog's index objects (numpy, no torch).

    ``spec`` is the ModelMerge spec with ``budget`` replaced by the admitted budget in bytes (or
    absent for an unbounded/fidelity-driven plan), ``calibration`` filled in with the
    operator's default calibration set when the merge names none, and ``sketch`` (the fidelity
    tiers) with the operator's default when the merge sets none (unset: the core's default). With a calibration set the
    plan's block value is ``spec.blockValue`` (default ``fisher``): the base's sensitivity on it
    must be in the catalog (else ``missing_sensitivity``; the calibration file itself is read, a
    few kB, for its digest). Calls
    ``mergepipe.pipeline.build_plan(ObjectCatalog(storage, catalog_uri), storage,
    merge_request(spec, planning=...), analyze=False)``: only shard headers and catalog objects are read, never
    a tensor. The core's errors name the request field, rendered as the spec field
    (:func:`mergepipe_operator.modelmerge.request.spec_where`).

    Returns:
        the plan, or (``missing_experts``, ``analysis_id``) when the catalog lacks statistics.

    Raises:
        PlanInputError: the core refused the inputs (names the field and the fix).
        mergepipe.storage.base.StorageError: object storage failed (transient: retry).
    """
    if not catalog_uri:
        raise PlanInputError("the operator has no catalog; set values catalog.uri (MERGEPIPE_CATALOG_URI)")
    storage = storage if storage is not None else open_storage(None, IOCounters())
    budget = spec.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        # the admitted budget, already read by the one byte grammar (requested_budget, the quota)
        raise TypeError(f"plan_merge takes the admitted budget in bytes (int), got {budget!r}")
    where = spec_where(spec)
    cal_uri = ((spec.get("calibration") or {}).get("uri") or "").strip() or None
    planning = PlanningOptions(value=spec.get("blockValue"), calibration=cal_uri, block_bytes=ANALYZE_BLOCK_BYTES)
    value = planning.block_value
    if value == "fisher" and not cal_uri:
        raise PlanInputError(
            "blockValue fisher needs a calibration set: set spec.calibration.uri (or the operator's "
            "merges.calibration.uri), or use blockValue energy",
            "spec.blockValue",
        )
    try:
        plan = build_plan(
            ObjectCatalog(storage, catalog_uri),
            storage,
            merge_request(spec, budget=budget, planning=planning),
            where=where,
            analyze=False,
        )
    except MissingAnalysis as e:
        cal_digest = e.calibration
        if cal_uri and cal_digest is None:  # experts missing: the same Job records the sensitivity too
            cal_digest = load_calibration(storage, cal_uri).digest
        return PlanSummary(
            missing_experts=tuple(e.uris),
            missing_sensitivity=e.calibration is not None,
            analysis_id=analysis_id(e.base_identity, e.identities, catalog_uri, spec.get("method"), cal_digest),
            calibration_uri=cal_uri,
            block_value=value,
        )
    except InputError as e:  # the core names the request field (e.loc); message without that prefix
        raise PlanInputError(e.problem, where(e.loc) if e.loc else "spec") from None
    fid = plan.retained_energy
    return PlanSummary(
        digest=plan.digest,
        plan_json=plan.to_json().encode(),
        base_read_bytes=int(plan.io.base_read_bytes),
        expert_read_bytes=int(plan.io.expert_read_bytes),
        output_write_bytes=int(plan.io.output_write_bytes),
        budget_bytes=plan.budget_bytes,
        retained_energy=None if fid is None or fid != fid else min(1.0, max(0.0, float(fid))),
        shards=max_useful_parts(plan),
        calibration_uri=cal_uri,
        block_value=value,
        sketch=plan.sketch or "none",
        sketch_read_bytes=int(plan.io.sketch_read_bytes),
    )
