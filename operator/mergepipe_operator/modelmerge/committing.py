"""Committing a partitioned merge in the operator's process, with the core's own code: when every
index of an Indexed merge Job has succeeded, :func:`commit_parts` does what ``mergepipe commit
PLAN --out OUT --parts N`` does (:func:`mergepipe.parts.commit_run`): check each part record
against the plan and the stored objects, compose the manifest (realized bytes summed over the
parts) and create it conditionally (``If-None-Match: *``). The operator image has no torch; this
path imports none (``tests/operator/test_operator_commit.py`` runs it with torch made
unimportable)."""

from __future__ import annotations

from typing import Any

from mergepipe.parts import commit_run
from mergepipe.planner.plan import Plan


def commit_parts(storage: Any, plan_uri: str, out_uri: str, parts: int) -> str:
    """Commit the ``parts``-part run of the plan at ``plan_uri`` to the snapshot ``out_uri``.

    Args:
        storage: the core's storage (:class:`mergepipe.storage.base.Storage`) reaching both URIs.
        plan_uri: the plan object the Job's pods executed (``s3://...json``).
        out_uri: the ModelMerge's ``spec.output.uri``.
        parts: N, the Job's completions.

    Returns:
        The manifest hash (SHA-256 hex) of the snapshot now committed at ``out_uri`` (also when
        another process committed the same snapshot first).

    Raises:
        mergepipe.errors.CommitConflict: a part record is missing or does not match the plan
            or its objects (the message names the part), or ``out_uri`` holds another snapshot.
        mergepipe.errors.InputError: the plan is unreadable or invalid; the store ignores
            conditional writes.
        mergepipe.storage.base.StorageError: object storage failed (transient: retry).
    """
    plan = Plan.from_json(storage.read_object(plan_uri, "other").decode(), plan_uri)
    return commit_run(plan, storage, out_uri, parts=parts).manifest_hash
