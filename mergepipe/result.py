"""What a finished merge produces: its manifest (:mod:`mergepipe.commit.manifest` format
``mergepipe.manifest/v1``), the bytes it moved, and the :class:`MergeResult` the CLI prints.

Shared by the single-process pipeline (:mod:`mergepipe.pipeline`) and partitioned runs
(:mod:`mergepipe.parts`), which both compose a manifest from a plan and an execution result;
it sits below both so that neither imports the other at module level.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mergepipe.commit.manifest import snapshot_id
from mergepipe.formats.safetensors import FLOAT_DTYPES as floating
from mergepipe.planner.plan import Plan
from mergepipe.storage.base import Storage, local_path
from mergepipe.storage.routing import open_storage

if TYPE_CHECKING:
    from mergepipe.engine.executor import ExecResult


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("mergepipe", "numpy", "torch", "safetensors", "pydantic"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception:
            pass
    return out


@dataclass
class MergeResult:
    """Outcome of a committed merge (also the ``--json`` output)."""

    out: str
    manifest: dict
    manifest_hash: str
    plan: Plan
    already_committed: bool = False
    analyze_s: float = 0.0
    total_s: float | None = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        m = self.manifest
        return {
            "snapshot_id": m["snapshot_id"],
            "manifest_hash": self.manifest_hash,
            "plan_digest": m["plan_digest"],
            "out": self.out,
            "method": m["method"],
            "already_committed": self.already_committed,
            "io": {
                "base_read_bytes": m["io"]["realized"]["base_read_bytes"],
                "expert_read_bytes": m["io"]["realized"]["expert_read_bytes"],
                "output_write_bytes": m["io"]["realized"]["output_write_bytes"],
                "expert_budget_bytes": m["io"]["expert_budget_bytes"],
                "planned_expert_read_bytes": m["io"]["estimated"]["expert_read_bytes"],
                "expert_bytes_total": m["io"]["expert_bytes_total"],
                **(
                    {"planned_sketch_read_bytes": m["io"]["estimated"]["sketch_read_bytes"]}
                    if m["io"]["estimated"].get("sketch_read_bytes")
                    else {}
                ),
                "sketch_read_bytes": m["io"]["realized"].get("sketch_read_bytes", 0),
            },
            "retained_energy": m["retained_energy"],
            "wall_s": m["time"]["wall_s"],
            "predicted_s": (self.plan.predicted_seconds or {}).get("total"),
            **(
                {"analyze_plan_s": round(self.analyze_s, 3), "total_s": round(self.total_s, 3)}
                if self.total_s is not None
                else {}
            ),
        }


def realized_io(before: dict, after: dict) -> dict[str, int]:
    """Bytes moved between two :meth:`IOCounters.snapshot` results, as the manifest's
    ``io.realized`` records them (base/expert/catalog read, output written/copied)."""

    def d(kind: str, role: str) -> int:
        return after[kind].get(role, 0) - before[kind].get(role, 0)

    return {
        "base_read_bytes": d("read", "base"),
        "expert_read_bytes": d("read", "expert"),
        "output_write_bytes": d("written", "output"),
        "output_copied_bytes": d("copied", "output"),
        "catalog_read_bytes": d("read", "catalog"),
        # the part of expert_read_bytes that was block-sketch planes
        "sketch_read_bytes": after.get("detail", {}).get("sketch", 0) - before.get("detail", {}).get("sketch", 0),
    }


def build_manifest(
    plan: Plan,
    res: ExecResult,
    before: dict | None,
    after: dict | None,
    started: float,
    device: str,
    files_prefix: str = "",
    lineage: dict | None = None,
    realized: dict | None = None,
    parts: list | None = None,
    worker_versions: dict | None = None,
) -> dict:
    """The manifest of a finished execution (see :mod:`mergepipe.commit.manifest`); ``lineage``
    (e.g. ``{"search": {...}}`` for a candidate of ``mergepipe search``) is merged in as
    top-level keys. ``realized`` (default: :func:`realized_io` of ``before``/``after``) is the
    bytes moved; ``parts`` (a partitioned run's parts) adds a ``parts`` entry;
    ``worker_versions`` (default: this process's :func:`versions`) are the versions of the
    processes that did the arithmetic (a partitioned run may commit in a process without torch,
    such as the Kubernetes operator)."""
    if realized is None:
        if before is None or after is None:
            raise ValueError("build_manifest needs `realized` or both counter snapshots")
        realized = realized_io(before, after)

    out = {
        "format": "mergepipe.manifest/v1",
        "snapshot_id": snapshot_id(plan.digest, res.files),
        "plan_digest": plan.digest,
        "method": plan.method,
        "parameters": {"globals": plan.globals, "experts": {e.name: e.params for e in plan.experts}},
        "seed": plan.seed,
        "inputs": _manifest_inputs(plan, res),
        "files_prefix": files_prefix,
        "outputs": res.files,
        "touched_blocks": res.touched_blocks,
        "blocks_total": {e.name: sum(t.n_blocks for t in plan.tensors if t.dtype in floating) for e in plan.experts},
        "io": {
            "expert_budget_bytes": plan.budget_bytes,
            "fidelity": plan.fidelity,
            "expert_bytes_total": plan.expert_bytes_total,
            "estimated": plan.io.model_dump(),
            "realized": realized,
        },
        "retained_energy": plan.retained_energy,
        "dtype": {"compute": "float32", "requested": plan.requested_dtype, "out": plan.out_dtype},
        "config": plan.source or None,
        "time": {"started_at": started, "wall_s": round(res.wall_s, 3)},
        "device": device,
        "versions": worker_versions or versions(),
    }
    if plan.sketch:  # fidelity tiers: blocks merged from the experts' sketches (bytes in io, like expert bytes)
        out["sketch"] = _manifest_sketch(plan)
    if parts is not None:
        out["parts"] = parts
    if lineage:
        clash = set(lineage) & set(out)
        if clash:
            raise ValueError(f"lineage keys {sorted(clash)} would overwrite manifest fields")
        out.update(lineage)
    return out


def _manifest_inputs(plan: Plan, res: ExecResult) -> dict:
    """The manifest's ``inputs``: the base and each expert by URI, identity, file signatures and
    content digest (the base's from the bytes the execution hashed), with an expert's sketch blob
    when the plan reads one."""
    return {
        "base": {
            "uri": plan.base.uri,
            "identity": plan.base.identity,
            "files": plan.base.signature,
            "content_digest": res.base_content_digest(),
        },
        "experts": [
            {
                "name": e.name,
                "uri": e.uri,
                "identity": e.identity,
                "files": e.signature,
                "content_digest": e.content_digest,
                **({"sketch": e.sketch} if e.sketch else {}),
            }
            for e in plan.experts
        ],
    }


def _manifest_sketch(plan: Plan) -> dict:
    """The manifest's ``sketch`` entry of a plan with fidelity tiers: its kind, the blocks merged
    from each expert's sketch, and the blocks per sketch level (as a string)."""
    sk: dict[str, int] = {}
    lv: dict[str, int] = {}
    for tp in plan.tensors:
        for te in tp.experts:
            nm = plan.experts[te.expert].name
            for (a, b), k in zip(te.sketch_blocks, te.sketch_levels, strict=True):
                sk[nm] = sk.get(nm, 0) + b - a
                lv[str(k)] = lv.get(str(k), 0) + b - a
    return {"kind": plan.sketch, "sketched_blocks": sk, "blocks_by_level": lv}


def output_storage(plan: Plan, storage: Storage, out: str) -> Storage:
    """The storage to write ``out`` with: ``storage`` itself when it can (a routing storage, or
    input and output of the same kind), else one for ``out`` sharing ``storage``'s counters."""
    if storage.backend(out) is not storage or (local_path(out) is None) == (local_path(plan.base.uri) is None):
        return storage
    return open_storage(out, storage.counters)
