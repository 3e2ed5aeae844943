"""The glue from a reconciler to kopf, shared by every resource's handlers: a reconciliation's
outcome as a status patch, Events and retries (:func:`run`, :func:`post_events`), and
:class:`Bound`, the slot through which a handlers module reaches its reconciler (bound by the
composition root, :mod:`mergepipe_operator.main`), so no resource imports the controller that
assembles them all."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import kopf

from .k8s.conditions import transition_events
from .reconcile import Retry, RetryWithStatus

T = TypeVar("T")


class Bound(Generic[T]):
    """A reconciler (or other service) a handlers module uses, provided by the composition root.

    Args:
        what: what is provided, for the error when nothing was bound.

    Calling it returns the bound getter's value (the getter runs each call, so a process-wide
    controller created on first use, or reset by a test, is seen).

    Raises:
        RuntimeError: nothing bound (the handlers module was imported without
            :mod:`mergepipe_operator.main`).
    """

    def __init__(self, what: str):
        self.what = what
        self._get: Callable[[], T] | None = None

    def bind(self, get: Callable[[], T]) -> None:
        """Provide the value through ``get`` (called on every use)."""
        self._get = get

    def __call__(self) -> T:
        if self._get is None:
            raise RuntimeError(f"no {self.what} bound; import mergepipe_operator.main, which wires the handlers")
        return self._get()


#: the last transition posted per (object uid, condition type): (status, reason, observedGeneration)
_POSTED: OrderedDict[tuple[str, str], tuple[Any, ...]] = OrderedDict()
_POSTED_MAX = 10_000
_POSTED_LOCK = threading.Lock()


def _first_post(obj: Any, cond_type: str, transition: tuple[Any, ...]) -> bool:
    """Record that this process posts ``cond_type -> transition`` (status, reason,
    observedGeneration) on ``obj``; ``False``
    when that is already the last transition it posted for the object and condition.

    Two handlers of one object can run at once (a Job event and the owner's timer or resume
    handler), each from the same old status, and both see the same transition: without this the
    object gets the Event twice. A real repeat (A -> B -> A -> B) still posts every Event, since
    the last posted transition differs each time. Objects without a uid are never deduplicated;
    the record keeps the newest 10,000 (object, condition) pairs.
    """
    uid = ((obj.get("metadata") if hasattr(obj, "get") else None) or {}).get("uid")
    if not uid:
        return True
    key, value = (str(uid), cond_type), transition
    with _POSTED_LOCK:
        if _POSTED.get(key) == value:
            return False
        _POSTED[key] = value
        _POSTED.move_to_end(key)
        while len(_POSTED) > _POSTED_MAX:
            _POSTED.popitem(last=False)
    return True


def post_events(obj: Any, old_status: dict[str, Any] | None, new_status: dict[str, Any] | None) -> None:
    """Post a Kubernetes Event on ``obj`` for each condition transition between the two statuses
    (:func:`~mergepipe_operator.k8s.conditions.transition_events`), through kopf's event poster
    (never blocks). A transition this process already posted last for the object and condition
    is not posted again (two handlers racing on one object; :func:`_first_post`)."""
    if not new_status or "conditions" not in new_status:
        return
    old_conditions = (old_status or {}).get("conditions")
    for ev in transition_events(old_conditions, new_status["conditions"]):
        same = [c for c in new_status["conditions"] if c.get("reason") == ev.reason]
        cond = next((c for c in same if c.get("type") == "Ready"), same[0] if same else {})
        if _first_post(obj, str(cond.get("type", "")), (cond.get("status"), ev.reason, cond.get("observedGeneration"))):
            kopf.event(obj, type=ev.type, reason=ev.reason, message=ev.message)


def run(fn: Callable[[], dict[str, Any] | None], patch: kopf.Patch, body: kopf.Body) -> None:
    """Run one reconciliation for a kopf handler: patch the status it returns (and post its
    Events); :class:`RetryWithStatus` patches first, then both retries become
    ``kopf.TemporaryError`` with their delay."""
    old = copy.deepcopy(dict(body.get("status") or {}))
    try:
        result = fn()
    except RetryWithStatus as e:
        patch.status.update(e.status)
        post_events(body, old, e.status)
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    if result:
        patch.status.update(result)
        post_events(body, old, result)
