"""Running a search from its front ends (``mergepipe search``, :func:`mergepipe.search`, the
MergeSearch driver pod): where its state lives, which worker backend merges the candidates, how
an interrupted search is picked up, and the call to :func:`mergepipe.search.runner.run_search`.

* :class:`SearchPlace` — a folder, or an ``s3://`` prefix whose state is mirrored into a local
  work folder (so ``--resume`` works from any machine).
* :class:`KubernetesWorkers` — the ``kubernetes`` worker backend's settings: each candidate a
  child ModelMerge of a MergeSearch, optionally each evaluation a Job; its templates come from the
  operator through environment variables (:meth:`KubernetesWorkers.from_environment`). The backend's
  code is :mod:`mergepipe_kube.search`, loaded through the entry point
  ``mergepipe.worker_backends`` / ``kubernetes`` (the core never imports the kubernetes client).
* :func:`run` — one search, new or resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError
from mergepipe.search.evaluators import CommandEvaluator, Evaluator
from mergepipe.search.runner import CandidateMerger, LocalMerger, SearchConfig, StateMirror, run_search
from mergepipe.search.state import STATE_NAME, load_state

__all__ = [
    "CANDIDATE_TEMPLATE_ENV",
    "EVAL_JOB_TEMPLATE_ENV",
    "POLL_SECONDS_ENV",
    "KubernetesWorkers",
    "SearchPlace",
    "run",
    "worker_backend",
]

#: ModelMerge template of the candidates (JSON object; the operator sets it on the driver pod)
CANDIDATE_TEMPLATE_ENV = "MERGEPIPE_CANDIDATE_TEMPLATE"
#: Job template of the evaluations (JSON object, or unset/``null``: evaluate in the driver)
EVAL_JOB_TEMPLATE_ENV = "MERGEPIPE_EVAL_JOB_TEMPLATE"
#: seconds between two polls of the candidates' ModelMerges and Jobs (default 10)
POLL_SECONDS_ENV = "MERGEPIPE_SEARCH_POLL_SECONDS"


class SearchPlace:
    """Where a search keeps ``state.json``, ``results.json`` and (local backend) its snapshots.

    Args:
        out: a folder, or an ``s3://`` prefix: then the state is worked on in a local folder
            (``$TMPDIR/mergepipe-search/<sha256(out)[:16]>``) and mirrored under the prefix after
            every save (:class:`~mergepipe.search.runner.StateMirror`), and candidates merged
            locally are committed under ``<out>/snapshots``.
    """

    def __init__(self, out: str | Path) -> None:
        self.uri = str(out)
        self.mirror: StateMirror | None = None
        if self.uri.startswith("s3://"):
            self.mirror = StateMirror(self.uri)
            key = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
            self.folder = Path(tempfile.gettempdir()) / "mergepipe-search" / key
        else:
            self.folder = Path(out)

    @property
    def has_state(self) -> bool:
        """Whether the local folder holds a search state."""
        return (self.folder / STATE_NAME).exists()

    def fetch(self) -> None:
        """Copy a mirrored state into the local folder unless one is there (no-op for a folder)."""
        if self.mirror is not None and not self.has_state:
            self.mirror.fetch(self.folder)

    def resumes(self, resume: bool, resume_existing: bool) -> bool:
        """Whether the search continues a recorded one: ``resume`` (it must exist), or
        ``resume_existing`` and a state is there (a restarted driver pod runs the same command);
        fetches a mirrored state first."""
        if resume or resume_existing:
            self.fetch()
        return resume or (resume_existing and self.has_state)


def worker_backend(name: str) -> Any:
    """The module of worker backend ``name`` (entry-point group ``mergepipe.worker_backends``).

    Raises:
        InputError: it is not installed (``kubernetes`` needs the ``kube`` extra).
    """
    from mergepipe.plugins import PluginMissing, load_plugin

    try:
        return load_plugin("mergepipe.worker_backends", name)
    except PluginMissing:
        raise InputError(f"--worker-backend {name} is not installed: pip install 'mergepipe[kube]'.") from None


def _json_env(name: str, default: str) -> Any:
    try:
        return json.loads(os.environ.get(name) or default)
    except ValueError as e:
        raise InputError(f"{name} is not JSON ({e}).") from None


@dataclass(frozen=True)
class KubernetesWorkers:
    """The ``kubernetes`` worker backend: every candidate a child ModelMerge of the MergeSearch
    ``search_name`` (owned by ``search_uid``) in ``namespace``, merged by the operator.

    Attributes:
        candidate_template: fields every candidate ModelMerge gets (image, resources, ...).
        eval_job_template: a Job template: each evaluation runs as its own Job
            (``mergepipe search-eval``) instead of in the driver; None: in the driver.
        poll_seconds: seconds between two polls of the candidates and Jobs.
    """

    namespace: str
    search_name: str
    search_uid: str
    candidate_template: dict = field(default_factory=dict)
    eval_job_template: dict | None = None
    poll_seconds: float = 10.0

    @classmethod
    def from_environment(cls, namespace: str, search_name: str, search_uid: str) -> KubernetesWorkers:
        """The backend with the templates the operator sets on the driver pod
        (:data:`CANDIDATE_TEMPLATE_ENV`, :data:`EVAL_JOB_TEMPLATE_ENV`, :data:`POLL_SECONDS_ENV`).

        Raises:
            InputError: the backend is not installed, or a template is not JSON.
        """
        worker_backend("kubernetes")  # refuse early when the kube extra is missing
        template = _json_env(CANDIDATE_TEMPLATE_ENV, "{}")
        poll = float(os.environ.get(POLL_SECONDS_ENV) or 10)
        eval_template = _json_env(EVAL_JOB_TEMPLATE_ENV, "null")
        return cls(namespace, search_name, search_uid, template, eval_template, poll)

    def merger(self, out: str) -> CandidateMerger:
        """The candidate merger writing the search's candidates under ``out`` (an ``s3://`` prefix)."""
        kube = worker_backend("kubernetes")
        return kube.KubernetesMerger(
            kube.kube_api(),
            self.namespace,
            self.search_name,
            self.search_uid,
            out,
            template=self.candidate_template,
            poll_seconds=self.poll_seconds,
        )

    def job_evaluator(self, spec: dict | None, out: str) -> Evaluator:
        """Evaluations as Jobs of the evaluator command ``spec`` records (``{"command", "timeout"}``).

        Raises:
            InputError: no command (the zoo or a Python function cannot run in a Job).
        """
        if not spec or not spec.get("command"):
            raise InputError(
                "--worker-backend kubernetes evaluates in Jobs: give --eval-command (a command that reads the "
                "snapshot URI {checkpoint})."
            )
        from mergepipe.storage.base import IOCounters
        from mergepipe.storage.routing import open_storage

        kube = worker_backend("kubernetes")
        return kube.KubernetesJobEvaluator(
            kube.kube_batch_api(),
            self.namespace,
            self.search_name,
            self.search_uid,
            self.eval_job_template,
            spec["command"],
            out,
            open_storage(None, IOCounters()),
            timeout=spec.get("timeout"),
            poll_seconds=self.poll_seconds,
        )


def run(
    place: SearchPlace,
    config: SearchConfig | None = None,
    evaluator: Evaluator | None = None,
    *,
    resume: bool = False,
    workers: int | None = None,
    evaluations: int | None = None,
    kubernetes: KubernetesWorkers | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> dict:
    """Run a new search (``config`` and ``evaluator``) or continue the one recorded at ``place``
    (``resume``: :meth:`SearchPlace.resumes` decides it), with the local or Kubernetes workers.

    Returns:
        the results (:func:`mergepipe.search.runner.results`; also ``results.json`` at ``place``).

    Raises:
        InputError: Kubernetes workers without an ``s3://`` place; evaluations as Jobs without a
            command evaluator; anything :func:`~mergepipe.search.runner.run_search` refuses.
    """
    merger: CandidateMerger | None = None
    job_evaluator = None
    if kubernetes is not None:
        if place.mirror is None:
            raise InputError("--worker-backend kubernetes needs an s3:// --out.")
        merger = kubernetes.merger(place.uri)
        if kubernetes.eval_job_template:
            if resume:
                spec = load_state(place.folder / STATE_NAME).get("evaluator")
            else:
                spec = evaluator.spec() if isinstance(evaluator, CommandEvaluator) else None
            job_evaluator = kubernetes.job_evaluator(spec, place.uri)
    elif place.mirror is not None:  # local merges of an s3:// search commit beside its state, not in /tmp
        merger = LocalMerger(place.uri.rstrip("/") + "/snapshots")
    if resume:
        return run_search(
            place.folder,
            evaluator=job_evaluator or evaluator,
            resume=True,
            workers=workers,
            evaluations=evaluations,
            log=log,
            merger=merger,
            mirror=place.mirror,
        )
    return run_search(place.folder, config, job_evaluator or evaluator, log=log, merger=merger, mirror=place.mirror)
