"""mergepipe's Python API: what the command line does, callable from a notebook or a pipeline.

Every function takes the same typed :class:`~mergepipe.request.MergeRequest` the CLI, the YAML
loader, the operator and the search build, and returns a typed result::

    import mergepipe

    req = mergepipe.MergeRequest(
        base="./llama-base",
        experts=[{"name": "math", "uri": "./math"}, {"name": "code", "uri": "./code"}],
        method="ties",
        parameters={"density": 0.5},
        budget="25%",
        output="./merged",
    )
    plan = mergepipe.plan(req)          # Plan: which blocks are read, estimated bytes, digest
    res = mergepipe.merge(req)          # MergeResult: snapshot id, manifest, realized bytes
    assert mergepipe.verify(res.out).ok  # Verification: files re-hashed against the manifest

A request may also be a mapping of the same fields, or the path of a mergekit YAML config
(:func:`load_config`). Bad input raises :class:`~mergepipe.errors.InputError` (``loc`` is the
request field at fault, the message names it and the fix) before anything is written; the CLI
prints the same message and exits 2. Catalog and storage default to the CLI's
(``$MERGEPIPE_HOME/catalog.sqlite``; local folders and ``s3://`` URIs).

This module imports torch only when a merge runs (``import mergepipe`` stays cheap).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergepipe.errors import InputError
from mergepipe.request import MergeRequest, Where

if TYPE_CHECKING:
    from mergepipe.catalog.catalog import Analysis as CatalogAnalysis, Catalog, CheckpointRecord
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.config import LoadedConfig
    from mergepipe.planner.plan import Plan
    from mergepipe.result import MergeResult
    from mergepipe.search.evaluators import Evaluator
    from mergepipe.search.runner import SearchConfig
    from mergepipe.storage.base import Storage

__all__ = [
    "Analysis",
    "SearchResult",
    "Verification",
    "analyze",
    "load_config",
    "merge",
    "plan",
    "search",
    "verify",
]

if TYPE_CHECKING:
    from typing import TypeAlias

    #: What the functions accept as a request: a :class:`MergeRequest`, a mapping of its fields,
    #: a loaded mergekit config, or the path of one (``.yml``/``.yaml``).
    RequestLike: TypeAlias = MergeRequest | Mapping[str, Any] | LoadedConfig | str | os.PathLike[str]

#: ``progress(stage, advance_bytes, total_bytes_or_None)``; stages ``analyze`` and ``merge``
Progress = Callable[[str, int, "int | None"], None]


def load_config(path: str | os.PathLike[str]) -> LoadedConfig:
    """Read and validate a mergekit YAML config (``mergepipe merge --config``); its ``request``
    is the :class:`MergeRequest` (no output: set one with ``merge(cfg, output=...)``).

    Raises:
        InputError: unreadable file, invalid YAML, an unknown key or a bad model reference,
            method or parameter; the message starts with the path and the key path.
    """
    from mergepipe.config import load_config as load

    return load(path)


def _request(
    request: RequestLike, output: str | os.PathLike[str] | None = None, where: Where | None = None
) -> tuple[MergeRequest, Where | None]:
    """``request`` as a :class:`MergeRequest` (with ``output`` when given) and how its fields
    are named in messages (``where`` when given, else a config's keys, else the CLI's terms),
    validated (:meth:`MergeRequest.resolve`) before the caller opens a catalog or reads a file."""
    from mergepipe.config import LoadedConfig

    if isinstance(request, (str, os.PathLike)):
        request = load_config(request)
    if isinstance(request, LoadedConfig):
        where = where or request.where
        request = request.request
    elif isinstance(request, Mapping):
        from pydantic import ValidationError

        try:
            request = MergeRequest.model_validate(dict(request))
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            loc = tuple(err["loc"])
            raise InputError(
                f"merge request {'.'.join(map(str, loc)) or '(top level)'}: {err['msg']}", loc=loc
            ) from None
    elif not isinstance(request, MergeRequest):
        raise InputError(
            f"expected a MergeRequest, a mapping of its fields or a config path, not {type(request).__name__}."
        )
    if output is not None:
        request = request.model_copy(update={"output": str(output)})
    request.resolve(where)  # every field checked before a catalog is opened or a file read
    return request, where


def _catalog(catalog: Catalog | ObjectCatalog | str | os.PathLike[str] | None) -> Catalog | ObjectCatalog:
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.catalog.objectstore import ObjectCatalog, open_catalog

    if isinstance(catalog, (Catalog, ObjectCatalog)):
        return catalog
    return open_catalog(None if catalog is None else str(catalog))


def _storage(storage: Storage | None) -> Storage:
    if storage is not None:
        return storage
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    return open_storage(None, IOCounters())


def _bytes(value: int | str, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    from mergepipe.pipeline import parse_bytes

    n = parse_bytes(str(value), what=what)
    if not n:
        raise InputError(f"{what} {value!r}: give a byte quantity with a unit, e.g. 128KiB.")
    return n


def plan(
    request: RequestLike,
    *,
    catalog: Catalog | ObjectCatalog | str | os.PathLike[str] | None = None,
    storage: Storage | None = None,
    progress: Callable[[int], None] | None = None,
    where: Where | None = None,
) -> Plan:
    """Plan a merge (``mergepipe plan``): register the checkpoints, analyze the experts once
    (cached in the catalog by identity), and choose the expert blocks to read under the request's
    budget or fidelity.

    Everything that shapes the plan is in the request: method, parameters, ``budget``,
    ``fidelity``, ``seed``, ``planning`` (:class:`~mergepipe.request.PlanningOptions`: block value
    ``energy``/``fisher`` with a ``calibration`` file, fidelity tiers ``sketch``, ``block_bytes``)
    and ``run.work_bytes`` (:class:`~mergepipe.request.RunOptions`: the engine's float32 working
    set per chunk, which sets the plan's chunk rows).

    Args:
        request: a :class:`MergeRequest`, a mapping of its fields, or a mergekit config (path or
            :func:`load_config`); its ``output`` is not used.
        catalog: a catalog, its SQLite path or ``s3://`` prefix (default:
            ``$MERGEPIPE_HOME/catalog.sqlite``).
        storage: how checkpoints are read (default: local folders and ``s3://``).
        progress: called with the bytes analyzed so far.
        where: renders request field paths in messages in a front end's terms (default: a
            config's keys, else the command line's).

    Returns:
        the sealed :class:`~mergepipe.planner.plan.Plan` (``digest``, ``io`` estimates in bytes,
        ``retained_energy`` in [0, 1], per-tensor block choices); ``plan.to_json()`` is what
        ``mergepipe plan --out`` writes and ``mergepipe execute`` runs.

    Raises:
        InputError: an invalid request (``loc`` names the field), or a checkpoint missing,
            unreadable or incompatible.
    """
    from mergepipe.pipeline import build_plan

    req, where = _request(request, None, where)
    return build_plan(_catalog(catalog), _storage(storage), req, where=where, progress=progress)


def merge(
    request: RequestLike,
    *,
    output: str | os.PathLike[str] | None = None,
    catalog: Catalog | ObjectCatalog | str | os.PathLike[str] | None = None,
    storage: Storage | None = None,
    progress: Progress | None = None,
    where: Where | None = None,
) -> MergeResult:
    """Merge and commit a snapshot (``mergepipe merge``): register, analyze, plan, execute in
    bounded memory, then publish the files and the manifest atomically at the request's output.
    A rerun of the same plan into the same output commits nothing new
    (``result.already_committed``).

    How it runs is the request's ``run`` (:class:`~mergepipe.request.RunOptions`): ``device``
    (``"cpu"``, ``"cuda"``), ``workers`` (parts in parallel processes, then one commit; a rerun
    resumes), ``resume`` (one process, resumable: a rerun after a crash keeps the finished files,
    their digests checked), ``work_bytes``.

    Args:
        request: as :func:`plan`; needs an ``output`` (folder or ``s3://`` prefix), or give it
            here as ``output``.
        catalog, storage, where: as :func:`plan`.
        progress: ``progress(stage, advance_bytes, total_bytes_or_None)`` for the ``analyze``
            and ``merge`` stages.

    Returns:
        :class:`~mergepipe.result.MergeResult`: ``out``, ``manifest`` (format
        ``mergepipe.manifest/v1``: ``snapshot_id``, ``plan_digest``, ``io.estimated`` and
        ``io.realized`` bytes), ``manifest_hash``, the ``plan``; ``summary()`` is the CLI's
        ``--json`` object.

    Raises:
        InputError: no output, an invalid request, an unusable output path, or bad inputs.
        CommitConflict: the output holds a different snapshot, or another writer won.
        MergepipeError: a part process of ``run.workers`` failed.
    """
    from mergepipe.pipeline import merge_request

    req, where = _request(request, output, where)
    return merge_request(req, where=where, catalog=_catalog(catalog), storage=_storage(storage), progress=progress)


@dataclass(frozen=True)
class Analysis:
    """What :func:`analyze` recorded (the CLI's ``analyze --json``).

    Attributes:
        base: ``{"uri", "identity"}`` of the base.
        experts: per expert ``{"uri", "identity", "tensors", "blocks", "energy"}`` (``energy``:
            the squared Frobenius norm of its task vector, summed over tensors).
        bytes_read: bytes read from ``base``, ``expert`` and ``catalog`` (0: cached).
        block_bytes: the catalog's block size.
        pairs: with ``pairs=True``, ``{"experts": [uri, uri], "tensors": n}`` per expert pair.
        calibration: with a calibration file, ``{"uri", "digest"}``.
    """

    base: dict
    experts: list[dict]
    bytes_read: dict[str, int]
    block_bytes: int
    calibration: dict | None = None
    pairs: list[dict] | None = None


def analyze(
    base: str,
    experts: Sequence[str],
    *,
    block_size: int | str = "128KiB",
    pairs: bool = False,
    calibration: str | None = None,
    device: str = "cpu",
    work_memory: int | str | None = None,
    force: bool = False,
    catalog: Catalog | ObjectCatalog | str | os.PathLike[str] | None = None,
    storage: Storage | None = None,
    progress: Callable[[int], None] | None = None,
) -> Analysis:
    """Analyze experts against their base once (``mergepipe analyze``): per-block task-vector
    statistics and sign sketches, cached in the catalog by checkpoint identity, so later plans
    read no expert byte to decide.

    Args:
        base, experts: checkpoint folders or ``s3://`` prefixes.
        pairs: also record ``<δᵢ, δⱼ>`` per tensor for every two experts (model_stock, nuslerp,
            multislerp, karcher plan with them); needs two distinct experts.
        calibration: JSON-lines file of ``{"text": ...}``: also record the base's per-block
            Fisher sensitivity on it (on torch ``device``), for ``value="fisher"`` plans.
        work_memory: the analysis' memory target (default: 16 MiB row chunks).
        force: analyze again even when cached (replaces the statistics and sketches).

    Raises:
        InputError: a checkpoint missing or incompatible, or ``pairs`` with fewer than two experts.
    """
    from mergepipe.pipeline import parse_block_size, register_and_analyze

    cat = _catalog(catalog)
    st = _storage(storage)
    bb = block_size if isinstance(block_size, int) else parse_block_size(block_size)
    uris = [str(u) for u in experts]
    if pairs and len({u.rstrip("/") for u in uris}) < 2:
        raise InputError("pairs: needs at least two distinct experts (pair statistics relate two experts).")
    before = st.counters.snapshot()["read"]
    b, recs, ans = register_and_analyze(
        cat,
        st,
        base,
        uris,
        bb,
        progress=progress,
        pairs=pairs,
        calibration=calibration,
        device=device,
        work_bytes=None if work_memory is None else _bytes(work_memory, "work_memory"),
        force=force,
    )
    rd = st.counters.snapshot()["read"]
    return Analysis(
        base={"uri": b.uri, "identity": b.identity},
        experts=[
            {
                "uri": r.uri,
                "identity": r.identity,
                "tensors": len(a.tensors),
                "blocks": int(sum(s.n_blocks for s in a.tensors.values())),
                "energy": float(sum(s.energy for s in a.tensors.values())),
            }
            for r, a in zip(recs, ans)
        ],
        bytes_read={k: rd[k] - before.get(k, 0) for k in ("base", "expert", "catalog")},
        block_bytes=bb,
        calibration=None if not calibration else _calibration_record(st, calibration),
        pairs=_pair_records(cat, b, recs, ans) if pairs else None,
    )


def _calibration_record(st: Storage, calibration: str) -> dict:
    """``{"uri", "digest"}`` of the calibration set at ``calibration``."""
    from mergepipe.catalog.sensitivity import load_calibration

    return {"uri": calibration, "digest": load_calibration(st, calibration).digest}


def _pair_records(
    cat: Catalog | ObjectCatalog,
    base: CheckpointRecord,
    recs: Sequence[CheckpointRecord],
    analyses: Sequence[CatalogAnalysis],
) -> list[dict]:
    """``{"experts": [uri, uri], "tensors": n}`` for each two experts of distinct identity whose
    pair statistics the catalog holds."""
    dots = cat.pair_dots(base, recs, analyses)
    return [
        {"experts": [recs[i].uri, recs[j].uri], "tensors": len(d)}
        for (i, j), d in sorted(dots.items())
        if recs[i].identity != recs[j].identity
    ]


@dataclass(frozen=True)
class Verification:
    """Outcome of :func:`verify` (the CLI's ``verify --json``).

    Attributes:
        ok: every file listed in the manifest is there with its size and digest, nothing
            unlisted is there, and the snapshot id matches the plan digest and the outputs.
        snapshot_id, manifest_hash: of the manifest read (None when it is unreadable).
        files: files the manifest lists.
        problems: one line per difference (empty when ``ok``).
    """

    ok: bool
    snapshot_id: str | None
    manifest_hash: str | None
    files: int
    problems: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok


def verify(snapshot: str | os.PathLike[str], *, storage: Storage | None = None) -> Verification:
    """Re-hash a committed snapshot's files against its manifest (``mergepipe verify``): a local
    folder or an ``s3://`` prefix.

    Raises:
        InputError: no snapshot (no manifest) there.
    """
    from mergepipe.commit.target import verify_any

    r = verify_any(_storage(storage), str(snapshot))
    return Verification(
        ok=bool(r["ok"]),
        snapshot_id=r.get("snapshot_id"),
        manifest_hash=r.get("manifest_hash"),
        files=int(r.get("files") or 0),
        problems=list(r.get("problems") or []),
    )


@dataclass(frozen=True)
class SearchResult:
    """Outcome of :func:`search` (``results.json``; the CLI's ``search --json``).

    Attributes:
        objectives: the objective names (``NAME``, ``NAME@max``).
        pareto: the Pareto set: per candidate ``{"id", "values", "params", "metrics",
            "objectives", "snapshot", "manifest_hash"}``.
        evaluations, failed: candidates evaluated, and how many of them failed.
        hypervolume: ``[{"evaluations", "t", "hv"}]`` after each completed candidate.
        ref_point: the hypervolume reference point (minimised form).
        wall_s: seconds the search ran (sessions summed).
        raw: the whole results document (:func:`mergepipe.search.runner.results`).
    """

    objectives: list[str]
    pareto: list[dict]
    evaluations: int
    failed: int
    hypervolume: list[dict]
    ref_point: list[float] | None
    wall_s: float
    raw: dict = field(repr=False)

    @classmethod
    def from_results(cls, res: dict) -> SearchResult:
        """From :func:`mergepipe.search.runner.results`' document."""
        return cls(
            objectives=list(res["objectives"]),
            pareto=list(res["pareto"]),
            evaluations=int(res["evaluations"]),
            failed=int(res["failed"]),
            hypervolume=list(res["hypervolume"]),
            ref_point=res.get("ref_point"),
            wall_s=float(res["wall_s"]),
            raw=res,
        )


def search(
    out: str | os.PathLike[str],
    config: SearchConfig | None = None,
    evaluator: Evaluator | Callable[[Path], dict] | None = None,
    *,
    resume: bool = False,
    workers: int | None = None,
    evaluations: int | None = None,
    log: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search layer-wise merge parameters with multi-objective Bayesian optimisation
    (``mergepipe search``; asynchronous and prior-guided, after AP-BMM). Every candidate is a
    committed merge followed by an evaluation.

    Args:
        out: the search folder (``state.json``, ``snapshots/``, ``results.json``) or an
            ``s3://`` prefix (state mirrored there, snapshots under ``<out>/snapshots``).
        config: the search (:class:`~mergepipe.search.runner.SearchConfig`: base, experts,
            method, ``vary``, ``objectives``, ``evaluations``, ...); not needed with ``resume``.
        evaluator: scores a candidate checkpoint: an
            :class:`~mergepipe.search.evaluators.Evaluator` (``CommandEvaluator``,
            :func:`~mergepipe.search.evaluators.zoo_evaluator`), or a function
            ``fn(checkpoint: Path) -> {metric: float}``; on ``resume`` default: the recorded one.
        resume: continue the search recorded at ``out``; ``workers`` and ``evaluations`` may
            change.
        log: called with one progress line at a time.

    Raises:
        InputError: a bad configuration, a new search into a folder holding one, or an
            objective the evaluator does not produce.
    """
    from mergepipe.search import driver
    from mergepipe.search.evaluators import CallableEvaluator, Evaluator

    ev = evaluator
    if ev is not None and not isinstance(ev, Evaluator):
        ev = CallableEvaluator(ev)
    place = driver.SearchPlace(os.fspath(out))
    res = driver.run(
        place,
        config,
        ev,
        resume=place.resumes(resume, False),
        workers=workers,
        evaluations=evaluations,
        log=log or (lambda m: None),
    )
    return SearchResult.from_results(res)
