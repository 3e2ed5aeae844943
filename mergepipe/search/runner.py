"""The search loop: a pool of workers, each candidate a real merge followed by an evaluation.

Strategies (``SearchConfig.strategy``):

* ``async`` (default; AP-BMM's loop): whenever a worker frees up it takes the next candidate —
  proposed one at a time, conditioned on the in-flight ones as ``X_pending``, with the prior and
  the frontier-coverage reranking of :func:`mergepipe.search.optimizer.propose` — and runs it.
  With ``lookahead`` (default) a proposer thread keeps one candidate queued ahead, so the freed
  worker starts at once; without it the freed worker proposes itself (serialised; a worker
  waiting for the proposer records a ``wait`` event). No worker waits for another worker's
  evaluation.
* ``sync`` (baseline): batches of ``workers`` candidates proposed jointly (qLogNEHVI, q = W,
  botorch's default priors, no reranking); a worker that finishes early waits at a barrier until
  the whole batch is evaluated (``barrier`` events).
* ``random`` (baseline): uniform random points, asynchronous dispatch.

The first ``initial`` candidates are a scrambled Sobol design (all strategies). A candidate is:
points → parameter settings (:class:`~mergepipe.search.space.SearchSpace`) → a merge request →
:func:`mergepipe.pipeline.build_plan` (optionally under an expert-I/O budget) →
:func:`mergepipe.pipeline.execute_and_commit` into ``<out>/snapshots/c<id>`` with the search's
lineage in the manifest (key ``search``) → evaluation. A failed merge or evaluation (crash,
timeout, non-finite metric) marks the candidate failed and the search goes on; an evaluator that
does not produce an objective stops the search with a clear error, as does a run where every one
of the first ``max(3, 2·workers)`` candidates failed. The state is saved after every event
(:mod:`mergepipe.search.state`); ``resume`` re-dispatches the candidates that were in flight.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mergepipe.catalog.objectstore import open_catalog
from mergepipe.errors import InputError
from mergepipe.pipeline import build_plan, execute_and_commit, register_and_analyze
from mergepipe.request import PlanningOptions
from mergepipe.search.evaluators import (
    EvaluationFailed,
    Evaluator,
    MissingObjective,
    Objective,
    call_with_timeout,
    evaluator_from_spec,
    objective_values,
)
from mergepipe.search.optimizer import default_ref_point, hypervolume, pareto_mask, propose, sobol
from mergepipe.search.prior import compute_prior, probe_ids
from mergepipe.search.space import SearchSpace, parse_vary, space_for_base
from mergepipe.search.state import STATE_FORMAT, STATE_NAME, load_state, save_state
from mergepipe.storage.base import IOCounters, NotFoundError
from mergepipe.storage.routing import open_storage

STRATEGIES = ("async", "sync", "random")
PRIOR_KINDS = ("scaled", "rank")
#: Layer blocks per varied parameter when a search names none: 1 (model-level). The default of
#: ``mergepipe search --layer-blocks`` and MergeSearch ``spec.layerBlocks`` too: layer-wise search
#: did not beat model-level search at 12 evaluations on development seeds, nor on the
#: pre-registered fresh seeds (docs/SEARCH.md, "Defaults").
DEFAULT_LAYER_BLOCKS = 1
#: Metrics the runner adds to every candidate's evaluator metrics (usable as objectives):
#: realized expert bytes read by its merge, and that as a fraction of the experts' total bytes.
IO_METRICS = ("io:expert_read_bytes", "io:expert_read_fraction")


def evaluation_delay(cfg: SearchConfig, worker: int, read_fraction: float | None) -> float:
    """Seconds an evaluation waits before it runs (simulated slow devices and costly candidates;
    benchmarks): ``worker_delays[worker]`` plus, with ``latency = [fixed_s, full_s]``,
    ``fixed_s + full_s · read_fraction`` (``read_fraction``: the candidate's realized expert bytes
    over the experts' total, clipped to [0, 1]; None, unknown: 1)."""
    delay = cfg.worker_delays[worker] if worker < len(cfg.worker_delays) else 0.0
    if cfg.latency:
        f = 1.0 if read_fraction is None else min(1.0, max(0.0, read_fraction))
        delay += cfg.latency[0] + cfg.latency[1] * f
    return delay


class SearchFailed(InputError):
    """The search cannot go on (every early candidate failed); the message has the last error."""


@dataclass
class SearchConfig:
    """Everything a search needs (recorded in its state).

    Attributes:
        base: base checkpoint; ``experts``: ``(name, uri)`` pairs; ``method``: merge method;
        fixed: settings applied to every candidate (``{"parameters": {...}, "experts": {name:
        {...}}}``; a list is read as ``--param`` strings); ``vary``: ``[EXPERT:]NAME=LO:HI``
        items; ``layer_blocks``: layer blocks per varied parameter (default
        :data:`DEFAULT_LAYER_BLOCKS`, model-level); ``objectives``: metric names
        (``NAME``/``NAME@min``/``NAME@max``); ``evaluations``: candidates in total (the budget,
        failed ones included); ``initial``: Sobol design points; ``workers``: parallel workers;
        ``budget``: expert-I/O budget of every merge (None: unlimited); ``planning``: the
        planning options of every candidate's request (:class:`mergepipe.request.PlanningOptions`:
        block value, calibration set, fidelity tiers, catalog block size), as ``mergepipe merge
        --value/--calibration/--sketch/--block-size``; ``seed``: seed of the
        design, the proposals and the merges; ``strategy``: ``async``/``sync``/``random``;
        ``prior``: use the discrepancy prior (``async`` only); ``probe``: texts for the
        activation part of the prior (None: parameter discrepancy only); ``ref_point``:
        hypervolume reference point, minimised form (None: from the first proposals' data);
        ``worker_delays``: seconds added to each worker's evaluations (simulates slower
        devices; benchmarks); ``catalog``: catalog location;
        ``design``: explicit unit-cube points used instead of the Sobol design for the first
        ``len(design)`` candidates (e.g. a grid; ``initial`` must equal ``len(design)``);
        ``prior_kind``: ``scaled`` (lengthscale multipliers on botorch's default prior) or
        ``rank`` (AP-BMM's rank → initial lengthscale 0.5/1/2/5), see :mod:`mergepipe.search.prior`;
        ``rerank``: frontier-coverage reranking (``async`` only; None: on when ``prior`` is);
        ``outer``: the embeddings and ``lm_head`` get coordinates of their own
        (:func:`mergepipe.search.space.outer_parts`);
        ``latency``: ``[fixed_s, full_s]``: each evaluation waits ``fixed_s + full_s·f`` seconds
        before it runs, ``f`` = the candidate's realized expert bytes / the experts' total bytes
        (a candidate-dependent cost, e.g. a device that streams what the merge read; benchmarks);
        ``lookahead``: ``async``/``random`` only: a proposer thread keeps one candidate queued
        ahead (proposed with every running one pending), so a freed worker starts at once instead
        of proposing itself (False: the freed worker proposes, AP-BMM's plain loop).
    """

    base: str
    experts: list
    method: str
    vary: list[str]
    objectives: list[str]
    evaluations: int
    initial: int
    workers: int = 1
    fixed: dict = field(default_factory=dict)
    layer_blocks: int = DEFAULT_LAYER_BLOCKS
    budget: str | None = None
    planning: PlanningOptions = field(default_factory=PlanningOptions)
    seed: int = 0
    strategy: str = "async"
    prior: bool = True
    probe: list[str] | None = None
    ref_point: list[float] | None = None
    worker_delays: list[float] = field(default_factory=list)
    catalog: str | None = None
    design: list[list[float]] | None = None
    lookahead: bool = True
    prior_kind: str = "scaled"
    rerank: bool | None = None
    outer: bool = False
    latency: list[float] | None = None

    def __post_init__(self) -> None:
        from mergepipe.search.space import as_params

        self.fixed = as_params(self.fixed, self.method, [n for n, _ in self.experts])
        if not isinstance(self.planning, PlanningOptions):  # (as recorded in a state: a mapping)
            self.planning = PlanningOptions.model_validate(self.planning)

    @classmethod
    def from_json(cls, d: dict) -> SearchConfig:
        """The config recorded in a search state (:meth:`to_json`); a state written before the
        planning options were one field (top-level ``sketch``, ``value``, ``calibration``,
        ``block_bytes``) is read too."""
        d = dict(d)
        old = {k: d.pop(k) for k in ("sketch", "value", "calibration", "block_bytes") if k in d}
        if old:
            d["planning"] = {**(d.get("planning") or {}), **{k: v for k, v in old.items() if v is not None}}
        return cls(**d)

    def to_json(self) -> dict:
        """The config as JSON data (recorded in the search state)."""
        return {**asdict(self), "planning": self.planning.model_dump()}

    @property
    def block_bytes(self) -> int:
        """The catalog block size of every candidate (bytes)."""
        from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES

        return self.planning.block_bytes or DEFAULT_BLOCK_BYTES

    def request(self, params: dict, output: str | None = None):
        """The :class:`mergepipe.request.MergeRequest` of a candidate whose settings are
        ``params`` (:data:`mergepipe.search.space.Params`), with the search's base, experts,
        method, budget, planning options and seed."""
        from mergepipe.request import ExpertRequest, MergeRequest

        own = params.get("experts") or {}
        return MergeRequest(
            base=self.base,
            method=self.method,
            parameters=dict(params.get("parameters") or {}),
            experts=[ExpertRequest(name=n, uri=u, parameters=dict(own.get(n) or {})) for n, u in self.experts],
            budget=params.get("budget", self.budget),
            planning=self.planning,
            seed=self.seed,
            output=output,
        )

    def check(self) -> None:
        """Raises InputError for counts and choices that cannot work (before anything is read)."""
        self.planning.check()
        if self.evaluations < 1:
            raise InputError(f"--evaluations {self.evaluations}: must be at least 1.")
        if self.initial < 1:
            raise InputError(f"--initial {self.initial}: must be at least 1 (the Sobol design).")
        if self.evaluations < self.initial:
            raise InputError(
                f"--evaluations {self.evaluations} is fewer than --initial {self.initial} design points; "
                "raise --evaluations or lower --initial."
            )
        if self.workers < 1:
            raise InputError(f"--workers {self.workers}: must be at least 1.")
        if self.strategy not in STRATEGIES:
            raise InputError(f"strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}.")
        if self.prior_kind not in PRIOR_KINDS:
            raise InputError(f"--prior {self.prior_kind!r}: use one of {', '.join(PRIOR_KINDS)} (or --no-prior).")
        if self.latency is not None and (len(self.latency) != 2 or any(not 0 <= v < 1e6 for v in self.latency)):
            raise InputError(f"latency {self.latency}: give [fixed seconds, seconds at a full read], both >= 0.")
        if not self.objectives:
            raise InputError("--objective: give at least one metric to optimise, e.g. --objective loss:python.")
        objs = [Objective.parse(o) for o in self.objectives]
        if len({o.metric for o in objs}) != len(objs):
            raise InputError(f"--objective: a metric is named twice ({', '.join(self.objectives)}).")
        if self.design is not None and len(self.design) != self.initial:
            raise InputError(f"design: {len(self.design)} points but --initial {self.initial}; they must agree.")
        if self.ref_point is not None and len(self.ref_point) != len(objs):
            raise InputError(f"--ref-point: {len(self.ref_point)} value(s) for {len(objs)} objective(s).")


@dataclass(frozen=True)
class Merged:
    """A candidate's committed merge: ``snapshot`` (folder or URI the evaluator reads),
    ``manifest_hash`` (SHA-256 hex of its manifest), ``expert_read_bytes`` (realized expert
    reads; None: unknown)."""

    snapshot: str
    manifest_hash: str
    expert_read_bytes: int | None = None


class CandidateMerger:
    """How a candidate's merge runs (the worker backend of a search). :meth:`merge` is called on a
    worker thread, once per candidate, and returns the committed snapshot or raises (any
    exception: the candidate is recorded failed with its message and the search goes on).

    :class:`LocalMerger` (default) plans and executes in this process. A backend that runs each
    merge elsewhere (e.g. as a Kubernetes ModelMerge, so quotas, planning and snapshots come from
    the operator) implements the same method and blocks until the merge is committed or failed.
    """

    def merge(self, cfg: SearchConfig, cand: dict, out: Path, lineage: dict, catalog) -> Merged:  # pragma: no cover
        """Merge candidate ``cand`` (``cand["params"]``: its settings, ``cand["id"]``)
        of search ``cfg``; ``out`` is the search folder, ``lineage`` goes into the manifest,
        ``catalog`` is the search's catalog."""
        raise NotImplementedError

    def validation_request(self, cfg: SearchConfig, params: dict):
        """The request the search plans once before its first candidate (the centre point
        ``params``): it refuses a configuration no candidate could merge and gives the experts'
        total bytes. Default: the candidate's own request (:meth:`SearchConfig.request`). A
        backend whose merges plan elsewhere may return a lighter request that checks the same
        inputs."""
        return cfg.request(params)


class LocalMerger(CandidateMerger):
    """In-process: :func:`mergepipe.pipeline.build_plan` (under ``cfg.budget``) then
    :func:`mergepipe.pipeline.execute_and_commit` into ``<root>/c<NNNN>`` (``root``: a folder or
    an ``s3://`` prefix; default ``<out>/snapshots``)."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root.rstrip("/") if root else None

    def merge(self, cfg: SearchConfig, cand: dict, out: Path, lineage: dict, catalog) -> Merged:
        name = f"c{cand['id']:04d}"
        snap = f"{self.root}/{name}" if self.root else out / "snapshots" / name
        st = open_storage(None, IOCounters())  # local folders and s3:// inputs
        plan = build_plan(
            catalog,
            st,
            cfg.request(cand["params"]),
        )
        res = execute_and_commit(plan, st, str(snap), lineage=lineage)
        return Merged(str(snap), res.manifest_hash, res.manifest["io"]["realized"]["expert_read_bytes"])


def dead_coordinates(cfg: SearchConfig, out: str | Path, *, delta: float = 0.4, rtol: float = 1e-3) -> list[str]:
    """The coordinates of ``cfg``'s search space that do not change the merged model.

    Merges the centre point ``x0 = (0.5, …)`` and, per coordinate ``i``, ``x0`` with ``x_i`` moved
    by ``delta`` (real merges: :func:`mergepipe.pipeline.build_plan` then
    :func:`mergepipe.pipeline.execute_and_commit` into ``<out>/x<i>``, float32 output so rounding
    to the base's dtype cannot hide or fake a change). Coordinate ``i`` is *dead* when the merged
    model moves by at most ``rtol`` × the centre merge's change from the base, both as the L2 norm
    over every floating tensor (e.g. a weight shared by every expert under a normalizing method:
    it cancels out, up to rounding and ties at the trimming threshold).
    A search over a space with a dead coordinate wastes its evaluations on a dimension that does
    nothing, so a baseline with one is not the search its name says.

    Args:
        cfg: the search (base, experts, method, vary, layer blocks, fixed, outer, budget, planning);
            local checkpoints.
        out: a scratch folder (created; the merges stay there).
        delta: the perturbation in unit-cube coordinates (``x_i ± delta``, towards the interior).
        rtol: the relative tolerance above.

    Returns:
        The labels (:attr:`mergepipe.search.space.Dim.label`) of the dead coordinates, in order.

    Raises:
        InputError: a bad configuration (as :func:`run_search`).
    """
    from safetensors.torch import load_file

    cfg.check()
    out = Path(out)
    cat = open_catalog(cfg.catalog)
    st = open_storage(None, IOCounters())
    base = cat.register(st, cfg.base)
    space = space_for_base(
        list(base.layout.tensors),
        cfg.method,
        [n for n, _ in cfg.experts],
        parse_vary(cfg.vary),
        cfg.layer_blocks,
        cfg.fixed,
        outer=cfg.outer,
    )

    def merged(x: list[float], name: str) -> dict:
        req = cfg.request(space.to_params(x))
        req = req.model_copy(update={"options": req.options.model_copy(update={"out_dtype": "F32"})})
        plan = build_plan(
            cat,
            st,
            req,
        )
        execute_and_commit(plan, st, str(out / name))
        t: dict = {}
        for f in sorted((out / name).glob("*.safetensors")):
            t.update(load_file(str(f)))
        return t

    x0 = [0.5] * space.d
    m0 = merged(x0, "centre")
    bt: dict = {}
    for f in sorted(Path(cfg.base).glob("*.safetensors")):
        bt.update(load_file(str(f)))
    floats = [n for n in m0 if m0[n].is_floating_point()]
    scale = sum(float(((m0[n] - bt[n].float()) ** 2).sum()) for n in floats) ** 0.5
    dead = []
    for i, dim in enumerate(space.dims):
        x = list(x0)
        x[i] = x0[i] + delta if x0[i] + delta <= 1.0 else x0[i] - delta
        mi = merged(x, f"x{i}")
        change = sum(float(((mi[n] - m0[n]) ** 2).sum()) for n in floats) ** 0.5
        if change <= rtol * max(scale, 1e-30):
            dead.append(dim.label)
    return dead


class StateMirror:
    """Copies of the search's ``state.json`` and ``results.json`` under an object-storage prefix,
    rewritten after every save, so a search survives the loss of its local folder (a driver pod
    restarted on another node resumes from the copy, :meth:`fetch`) and observers can read it.

    Args:
        prefix: ``s3://bucket/prefix`` (or a local folder, for tests).
        storage: a :class:`mergepipe.storage.base.Storage` (default: :func:`open_storage`).
    """

    def __init__(self, prefix: str, storage=None) -> None:
        self.prefix = prefix.rstrip("/")
        self.storage = storage if storage is not None else open_storage(None, IOCounters())

    def uri(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def put(self, name: str, data: bytes) -> None:
        """Upload ``data`` as ``<prefix>/<name>`` (one PUT: readers see the old or the new copy)."""
        self.storage.put_object(self.uri(name), data, role="other")

    def fetch(self, out: Path) -> bool:
        """Download the mirrored state into ``out`` (created); False when there is none."""
        try:
            data = self.storage.read_object(self.uri(STATE_NAME), role="other")
        except (NotFoundError, FileNotFoundError):
            return False
        from mergepipe.storage.local import ensure_folder, replace_file

        ensure_folder(out, what="search folder")
        replace_file(out / STATE_NAME, data, what="search state")
        return True


class _Abort(Exception):
    pass


class _Search:
    def __init__(
        self,
        out: Path,
        state: dict,
        evaluator: Evaluator,
        log: Callable[[str], None],
        merger: CandidateMerger | None = None,
    ) -> None:
        self.out, self.state, self.ev, self.log = out, state, evaluator, log
        self.merger = merger or LocalMerger()
        self.mirror: StateMirror | None = None
        self.cfg = SearchConfig.from_json(state["config"])
        self.space = SearchSpace.from_json(state["space"])
        self.objectives = [Objective.parse(o) for o in self.cfg.objectives]
        self.cv = threading.Condition()
        self.propose_lock = threading.Lock()
        self.error: BaseException | None = None
        self.design: list[list[float]] | None = None
        self._catalog = None
        self.path = out / STATE_NAME

    # -- helpers --------------------------------------------------------------------------------
    @property
    def cands(self) -> list[dict]:
        return self.state["candidates"]

    def save(self) -> None:
        save_state(self.path, self.state)
        if self.mirror:
            self.mirror.put(STATE_NAME, self.path.read_bytes())

    def publish(self) -> None:
        """Rewrite ``<out>/results.json`` (called with ``cv`` held when a candidate finished), so
        an observer (the operator's MergeSearch status) follows a running search."""
        save_state(self.out / "results.json", results(self.state))
        if self.mirror:
            self.mirror.put("results.json", (self.out / "results.json").read_bytes())

    def event(self, worker: int, kind: str, cand: int | None, t0: float, t1: float) -> None:
        self.state["events"].append(
            {"worker": worker, "kind": kind, "cand": cand, "t0": round(t0, 4), "t1": round(t1, 4)}
        )

    def catalog(self):
        if self._catalog is None:
            self._catalog = open_catalog(self.cfg.catalog)
        return self._catalog

    def _new(self, x, phase: str, info: dict | None = None) -> dict:
        c = {
            "id": len(self.cands),
            "x": [round(float(v), 8) for v in x],
            "params": self.space.to_params(x),
            "values": self.space.describe(x),
            "phase": phase,
            "status": "queued",
            "worker": None,
            "snapshot": None,
            "manifest_hash": None,
            "metrics": None,
            "objectives": None,
            "error": None,
            "proposal": info or {},
            "times": {"proposed": time.time()},
        }
        self.cands.append(c)
        return c

    def _design_point(self, i: int) -> list[float]:
        if self.cfg.design is not None and i < len(self.cfg.design):
            return list(self.cfg.design[i])
        if self.design is None:
            self.design = sobol(max(self.cfg.evaluations, 2), self.space.d, self.cfg.seed)
        return self.design[i]

    # -- proposing --------------------------------------------------------------------------------
    def _propose(self, k: int) -> list[dict]:
        """Propose ``k`` candidates (called with ``propose_lock`` held, ``cv`` not held)."""
        with self.cv:
            n = len(self.cands)
            done = [c for c in self.cands if c["status"] == "done"]
            X = [c["x"] for c in done]
            Y = [c["objectives"] for c in done]
            inflight = [c for c in self.cands if c["status"] in ("queued", "running")]
            pending = [c["x"] for c in inflight]
            pending_ids = [c["id"] for c in inflight]
            failed = [c["x"] for c in self.cands if c["status"] == "failed"]
        k = min(k, self.cfg.evaluations - n)
        if k <= 0:
            return []
        if n < self.cfg.initial or self.cfg.strategy == "random" or len(X) < 2:
            pts = []
            for i in range(n, n + k):
                if i < self.cfg.initial or len(X) < 2 and self.cfg.strategy != "random":
                    pts.append((self._design_point(i), "initial" if i < self.cfg.initial else "design"))
                else:
                    rng = random.Random(self.cfg.seed * 1_000_003 + i)
                    pts.append(([rng.random() for _ in range(self.space.d)], "random"))
            return [self._new(x, ph) for x, ph in pts]

        ref = self.cfg.ref_point or self.state.get("ref_point")
        if ref is None:
            ref = default_ref_point(Y)
            self.state["ref_point"] = ref
        if self.cfg.strategy == "sync":
            xs, info = propose(X, Y, ref, avoid=failed, q=k, rerank=False, seed=self.cfg.seed * 7919 + n)
            return [self._new(x, "bo-batch", info) for x in xs]
        prior = self.state.get("prior") if self.cfg.prior else None
        kind = self.cfg.prior_kind
        xs, info = propose(
            X,
            Y,
            ref,
            pending=pending,
            avoid=failed,
            multipliers=prior["multipliers"] if prior and kind == "scaled" else None,
            lengthscales=prior.get("lengthscales") if prior and kind == "rank" else None,
            rerank=self.cfg.prior if self.cfg.rerank is None else self.cfg.rerank,
            seed=self.cfg.seed * 7919 + n,
        )
        info["n_pending"] = len(pending)
        info["pending_ids"] = pending_ids
        info["n_observed"] = len(X)
        return [self._new(xs[0], "bo", info)]

    @property
    def lookahead(self) -> bool:
        return self.cfg.lookahead and self.cfg.strategy != "sync"

    def proposer(self) -> None:
        """Lookahead proposer (thread): keeps one candidate queued while the budget lasts."""
        try:
            while True:
                with self.cv:
                    while (
                        self.error is None
                        and len(self.cands) < self.cfg.evaluations
                        and any(c["status"] == "queued" for c in self.cands)
                    ):
                        self.cv.wait(0.5)
                    if self.error is not None or len(self.cands) >= self.cfg.evaluations:
                        return
                t0 = time.time()
                new = self._propose(1)
                with self.cv:
                    self.event(-1, "propose", new[0]["id"] if new else None, t0, time.time())
                    self.save()
                    self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced by run_search
            with self.cv:
                if self.error is None:
                    self.error = e
                self.cv.notify_all()

    def next_job(self, w: int) -> dict | None:
        """The next candidate for worker ``w`` (None: the budget is spent or the search aborts)."""
        while True:
            with self.cv:
                if self.error is not None:
                    return None
                q = [c for c in self.cands if c["status"] == "queued"]
                if q:
                    return self._take(q[0], w)
                if len(self.cands) >= self.cfg.evaluations:
                    return None
                if self.lookahead:  # the proposer is at work: wait for its candidate
                    t0 = time.time()
                    while (
                        self.error is None
                        and len(self.cands) < self.cfg.evaluations
                        and not any(c["status"] == "queued" for c in self.cands)
                    ):
                        self.cv.wait(0.5)
                    self.event(w, "wait", None, t0, time.time())
                    continue
                if self.cfg.strategy == "sync" and any(c["status"] == "running" for c in self.cands):
                    t0 = time.time()
                    while (
                        any(c["status"] == "running" for c in self.cands)
                        and self.error is None
                        and not any(c["status"] == "queued" for c in self.cands)
                    ):
                        self.cv.wait(0.5)
                    self.event(w, "barrier", None, t0, time.time())
                    continue
            t0 = time.time()
            with self.propose_lock:
                t1 = time.time()
                if t1 - t0 > 1e-3:
                    self.event(w, "wait", None, t0, t1)
                with self.cv:  # another worker may have proposed meanwhile
                    if any(c["status"] == "queued" for c in self.cands) or len(self.cands) >= self.cfg.evaluations:
                        continue
                k = self.cfg.workers if self.cfg.strategy == "sync" else 1
                try:
                    new = self._propose(k)
                except BaseException as e:  # noqa: BLE001 - surfaced by run_search
                    with self.cv:
                        self.error = e
                        self.cv.notify_all()
                    return None
                with self.cv:
                    self.event(w, "propose", new[0]["id"] if new else None, t1, time.time())
                    self.save()
                    self.cv.notify_all()

    def _take(self, c: dict, w: int) -> dict:
        c["status"] = "running"
        c["worker"] = w
        c["times"]["started"] = time.time()
        self.save()
        return c

    # -- running ------------------------------------------------------------------------------------
    def run_candidate(self, c: dict, w: int) -> None:
        t0 = time.time()
        try:
            lineage = {
                "search": {
                    "search_id": self.state["search_id"],
                    "candidate": c["id"],
                    "phase": c["phase"],
                    "point": c["x"],
                    "values": c["values"],
                    "state": self.mirror.uri(STATE_NAME) if self.mirror else str(self.path.resolve()),
                }
            }
            merged = self.merger.merge(self.cfg, c, self.out, lineage, self.catalog())
        except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the search
            t1 = time.time()
            with self.cv:
                self.event(w, "merge", c["id"], t0, t1)
                self._fail(c, f"merge failed: {type(e).__name__}: {e}")
            return
        t1 = time.time()
        snap = merged.snapshot if "://" in merged.snapshot else Path(merged.snapshot)  # a URI stays a string
        with self.cv:
            c["snapshot"] = merged.snapshot
            c["manifest_hash"] = merged.manifest_hash
            c["expert_read_bytes"] = merged.expert_read_bytes
            c["times"]["merged"] = t1
            self.event(w, "merge", c["id"], t0, t1)
            self.save()
        total = self.state.get("expert_bytes_total")
        frac = merged.expert_read_bytes / total if (merged.expert_read_bytes is not None and total) else None
        delay = evaluation_delay(self.cfg, w, frac)
        try:
            if delay:
                time.sleep(delay)
            if self.ev.in_process:
                metrics = call_with_timeout(lambda: self.ev.metrics(snap), self.ev.timeout)
            else:
                metrics = self.ev.metrics(snap)
            metrics = dict(metrics)
            if merged.expert_read_bytes is not None:
                metrics.setdefault(IO_METRICS[0], merged.expert_read_bytes)
            if frac is not None:
                metrics.setdefault(IO_METRICS[1], frac)
            objs = objective_values(self.objectives, metrics)
        except MissingObjective as e:
            with self.cv:
                self.event(w, "eval", c["id"], t1, time.time())
                self._fail(c, str(e))
                self.error = e
                self.cv.notify_all()
            return
        except (EvaluationFailed, Exception) as e:  # noqa: BLE001
            with self.cv:
                self.event(w, "eval", c["id"], t1, time.time())
                msg = str(e) if isinstance(e, EvaluationFailed) else f"evaluator crashed: {type(e).__name__}: {e}"
                self._fail(c, msg)
            return
        t2 = time.time()
        with self.cv:
            c["metrics"] = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
            c["objectives"] = objs
            c["status"] = "done"
            c["times"]["ended"] = t2
            self.event(w, "eval", c["id"], t1, t2)
            self.save()
            self.publish()
            self.cv.notify_all()
        self.log(
            f"[worker {w}] candidate {c['id']} ({c['phase']}): "
            + ", ".join(f"{o}={v:.4f}" for o, v in zip(self.cfg.objectives, objs))
        )

    def _fail(self, c: dict, msg: str) -> None:
        """Record a failed candidate (``cv`` held); abort when every early candidate failed."""
        c["status"] = "failed"
        c["error"] = msg
        c["times"]["ended"] = time.time()
        self.log(f"[worker {c['worker']}] candidate {c['id']} failed: {msg}")
        finished = [x for x in self.cands if x["status"] in ("done", "failed")]
        if not any(x["status"] == "done" for x in finished) and len(finished) >= max(3, 2 * self.cfg.workers):
            self.error = SearchFailed(f"the first {len(finished)} candidates all failed; the last error: {msg}")
        self.save()
        self.publish()
        self.cv.notify_all()

    def worker(self, w: int) -> None:
        try:
            while True:
                c = self.next_job(w)
                if c is None:
                    return
                self.run_candidate(c, w)
        except BaseException as e:  # noqa: BLE001 - e.g. KeyboardInterrupt raised in an evaluator
            with self.cv:
                if self.error is None:
                    self.error = e
                self.cv.notify_all()


# ------------------------------------------------------------------------------------------------
def _init_state(out: Path, cfg: SearchConfig, evaluator: Evaluator, log, merger: CandidateMerger) -> dict:
    cfg.check()
    vary = parse_vary(cfg.vary)
    objs = [Objective.parse(o) for o in cfg.objectives]
    known = evaluator.known_metrics()
    if known is not None:
        known = list(known) + [m for m in IO_METRICS if m not in known]
        miss = [str(o) for o in objs if o.metric not in known]
        if miss:
            raise MissingObjective(f"--objective {', '.join(miss)}: the evaluator produces {known}; name one of those.")
    names = [n for n, _ in cfg.experts]

    cat = open_catalog(cfg.catalog)
    st = open_storage(None, IOCounters())  # local folders and s3:// checkpoints
    base = cat.register(st, cfg.base)
    space = space_for_base(
        list(base.layout.tensors), cfg.method, names, vary, cfg.layer_blocks, cfg.fixed, outer=cfg.outer
    )
    # Validate a candidate (the centre point) exactly as every candidate will be planned; this
    # also analyzes the experts once (cached in the catalog), which the prior reads.
    plan = build_plan(cat, st, merger.validation_request(cfg, space.to_params([0.5] * space.d)))
    prior = None
    if cfg.prior and cfg.strategy == "async":
        _, recs, ans = register_and_analyze(cat, st, cfg.base, [u for _, u in cfg.experts], cfg.block_bytes)
        ids = None
        if cfg.probe:
            ids = probe_ids(cfg.base, cfg.probe)
        prior = compute_prior(
            space, [a.tensors for a in ans], base_dir=cfg.base, expert_dirs=[u for _, u in cfg.experts], input_ids=ids
        ).to_json()
        key = "multipliers" if cfg.prior_kind == "scaled" else "lengthscales"
        log(
            f"prior ({cfg.prior_kind}) lengthscale {key}: "
            + ", ".join(f"{lab}={m:.2f}" for lab, m in zip(prior["labels"], prior[key]))
        )
    return {
        "format": STATE_FORMAT,
        "search_id": uuid.uuid4().hex[:16],
        "config": cfg.to_json(),
        "space": space.to_json(),
        "prior": prior,
        "ref_point": cfg.ref_point,
        "expert_bytes_total": plan.expert_bytes_total,
        "evaluator": evaluator.spec(),
        "candidates": [],
        "events": [],
        "sessions": [],
    }


def _resumed_state(
    path: Path, evaluator: Evaluator | None, workers: int | None, evaluations: int | None
) -> tuple[dict, Evaluator]:
    """The state at ``path`` made ready to resume: in-flight candidates queued again, ``workers`` /
    ``evaluations`` changed when given; the evaluator rebuilt from the state when ``None``.

    Raises:
        InputError: an unreadable state, or ``evaluations`` below the candidates already proposed.
    """
    state = load_state(path)
    if evaluator is None:
        evaluator = evaluator_from_spec(state.get("evaluator"))
    for c in state["candidates"]:
        if c["status"] in ("running", "queued"):
            c["status"] = "queued"
            c["worker"] = None
    if workers is not None:
        state["config"]["workers"] = workers
    if evaluations is not None:
        if evaluations < len(state["candidates"]):
            raise InputError(
                f"--evaluations {evaluations}: the search already proposed {len(state['candidates'])} candidates."
            )
        state["config"]["evaluations"] = evaluations
    return state, evaluator


def _new_state(
    out: Path,
    path: Path,
    config: SearchConfig | None,
    evaluator: Evaluator | None,
    log: Callable[[str], None],
    merger: CandidateMerger,
) -> tuple[dict, Evaluator]:
    """The state of a new search into ``out`` (created), after :func:`_init_state` validated it
    (with ``merger``'s :meth:`CandidateMerger.validation_request`), and its evaluator.

    Raises:
        InputError: no configuration or evaluator, ``out`` already holds a search, or a bad configuration.
    """
    if config is None or evaluator is None:
        raise InputError("a new search needs its configuration and an evaluator.")
    if path.exists():
        raise InputError(
            f"--out {out}: already holds a search ({STATE_NAME}); add --resume to continue it, or choose another --out."
        )
    state = _init_state(out, config, evaluator, log, merger)
    out.mkdir(parents=True, exist_ok=True)
    return state, evaluator


def _run_session(s: _Search, sess: dict) -> None:
    """Run the search's worker threads (and its lookahead proposer) until they end; the session's
    end time is recorded and the state saved however they end. Re-raises a worker's error, and
    a ``KeyboardInterrupt`` (after telling the workers to stop)."""
    threads = [
        threading.Thread(target=s.worker, args=(w,), name=f"search-worker-{w}", daemon=True)
        for w in range(s.cfg.workers)
    ]
    if s.lookahead:
        threads.append(threading.Thread(target=s.proposer, name="search-proposer", daemon=True))
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        with s.cv:
            s.error = KeyboardInterrupt()
            s.cv.notify_all()
        raise
    finally:
        with s.cv:
            sess["ended"] = time.time()
            s.save()
    if s.error is not None:
        raise s.error


def run_search(
    out: str | Path,
    config: SearchConfig | None = None,
    evaluator: Evaluator | None = None,
    *,
    resume: bool = False,
    workers: int | None = None,
    evaluations: int | None = None,
    log: Callable[[str], None] = lambda m: None,
    merger: CandidateMerger | None = None,
    mirror: StateMirror | None = None,
) -> dict:
    """Run (or resume) a search into folder ``out``; returns the results (also written to
    ``<out>/results.json``, see :func:`results`).

    Args:
        config: the search (required unless ``resume``).
        evaluator: the evaluator (on resume: rebuilt from the state when omitted).
        resume: continue the search in ``out``: finished candidates are kept, in-flight ones
            re-dispatched; ``workers``/``evaluations`` may be changed (``evaluations`` not below
            the candidates already proposed).
        merger: the worker backend that merges each candidate (default :class:`LocalMerger`).
        mirror: also keep ``state.json``/``results.json`` under this object-storage prefix
            (:class:`StateMirror`; fetch it into ``out`` before resuming elsewhere).

    Raises:
        InputError: bad configuration (see :meth:`SearchConfig.check`, the space's validation,
            :class:`MissingObjective`), a new search into a folder that already holds one, or
            :class:`SearchFailed`.
    """
    out = Path(out)
    path = out / STATE_NAME
    if resume:
        state, evaluator = _resumed_state(path, evaluator, workers, evaluations)
    else:
        state, evaluator = _new_state(out, path, config, evaluator, log, merger or LocalMerger())
    sess = {"started": time.time(), "ended": None, "workers": state["config"]["workers"]}
    state["sessions"].append(sess)
    s = _Search(out, state, evaluator, log, merger)
    s.mirror = mirror
    s.save()
    _run_session(s, sess)
    res = results(state)
    save_state(out / "results.json", res)
    if mirror:
        mirror.put("results.json", (out / "results.json").read_bytes())
    return res


def _search_clock(sessions: list[dict]) -> Callable[[float], float]:
    """``t`` (a wall clock time, seconds) -> seconds of search time: the gaps between the
    ``sessions`` (``{started, ended}``; ``ended`` ``None`` for the running one) removed."""

    def rel(t: float) -> float:
        acc = 0.0
        for s in sessions:
            end = s["ended"] or t
            if t <= end:
                return acc + max(0.0, t - s["started"])
            acc += end - s["started"]
        return acc

    return rel


def _hypervolume_curve(done: list[dict], ref: list[float] | None, rel: Callable[[float], float]) -> list[dict]:
    """``[{evaluations, t, hv}]``: the hypervolume (w.r.t. ``ref``) of the first k finished
    candidates, k = 1..len(done) (``done`` in completion order); empty when ``ref`` is ``None``."""
    hv: list[dict] = []
    if ref is not None:  # None only when nothing is done
        for k in range(1, len(done) + 1):
            hv.append(
                {
                    "evaluations": k,
                    "t": round(rel(done[k - 1]["times"]["ended"]), 3),
                    "hv": hypervolume([c["objectives"] for c in done[:k]], ref),
                }
            )
    return hv


def _pareto_front(done: list[dict], objectives: list[str]) -> list[dict]:
    """The non-dominated finished candidates, each ``{id, values, params, metrics, objectives
    (name -> minimised value), snapshot, manifest_hash}``, in completion order."""
    mask = pareto_mask([c["objectives"] for c in done]) if done else []
    return [
        {
            "id": c["id"],
            "values": c["values"],
            "params": c["params"],
            "metrics": c["metrics"],
            "objectives": dict(zip(objectives, c["objectives"])),
            "snapshot": c["snapshot"],
            "manifest_hash": c["manifest_hash"],
        }
        for c, m in zip(done, mask)
        if m
    ]


def _worker_stats(events: list[dict], wall: float) -> tuple[dict, float]:
    """Per worker ``{jobs, busy_s, wait_s, propose_s, idle_fraction}`` (keyed by the worker number
    as a string) from the trace ``events``, and the lookahead proposer's seconds (worker -1);
    ``wall`` is the search's wall time in seconds (``idle_fraction`` ``None`` when 0)."""
    workers: dict = {}
    proposer_s = 0.0
    for e in events:
        if e["worker"] < 0:
            proposer_s += e["t1"] - e["t0"]
            continue
        w = workers.setdefault(str(e["worker"]), {"jobs": 0, "busy_s": 0.0, "wait_s": 0.0, "propose_s": 0.0})
        dt = e["t1"] - e["t0"]
        if e["kind"] in ("merge", "eval"):
            w["busy_s"] += dt
            w["jobs"] += int(e["kind"] == "eval")
        elif e["kind"] == "propose":
            w["propose_s"] += dt
        else:
            w["wait_s"] += dt
    for w in workers.values():
        w["idle_fraction"] = round(1 - w["busy_s"] / wall, 4) if wall > 0 else None
        for key in ("busy_s", "wait_s", "propose_s"):
            w[key] = round(w[key], 3)
    return workers, proposer_s


def results(state: dict) -> dict:
    """Results of a search state.

    Returns:
        ``{search_id, objectives, ref_point, evaluations, failed, running, points (objective values in
        completion order, minimised form), pareto: [{id, values, params,
        metrics, objectives, snapshot, manifest_hash}], hypervolume: [{evaluations, t, hv}]
        (in completion order; ``t`` seconds since the search started, sessions concatenated),
        workers: {w: {jobs, busy_s, wait_s, propose_s, idle_fraction}}, proposer_s (the lookahead
        proposer thread's seconds), wall_s, failures: [{id, error}], trace: events (t relative to
        the search start; worker -1 is the lookahead proposer)}``.
    """
    cfg = state["config"]
    done = sorted((c for c in state["candidates"] if c["status"] == "done"), key=lambda c: c["times"]["ended"])
    sessions = state["sessions"]
    rel = _search_clock(sessions)
    ref = (
        cfg.get("ref_point")
        or state.get("ref_point")
        or (default_ref_point([c["objectives"] for c in done]) if done else None)
    )
    hv = _hypervolume_curve(done, ref, rel)
    pareto = _pareto_front(done, cfg["objectives"])
    wall = sum((s["ended"] or s["started"]) - s["started"] for s in sessions)
    workers, proposer_s = _worker_stats(state["events"], wall)
    return {
        "search_id": state["search_id"],
        "strategy": cfg["strategy"],
        "objectives": cfg["objectives"],
        "ref_point": ref,
        "evaluations": len(done),
        "failed": sum(c["status"] == "failed" for c in state["candidates"]),
        "running": sum(c["status"] == "running" for c in state["candidates"]),
        "failures": [{"id": c["id"], "error": c["error"]} for c in state["candidates"] if c["status"] == "failed"],
        "points": [c["objectives"] for c in done],
        "pareto": pareto,
        "hypervolume": hv,
        "workers": workers,
        "proposer_s": round(proposer_s, 3),
        "wall_s": round(wall, 3),
        "trace": [{**e, "t0": round(rel(e["t0"]), 3), "t1": round(rel(e["t1"]), 3)} for e in state["events"]],
    }
