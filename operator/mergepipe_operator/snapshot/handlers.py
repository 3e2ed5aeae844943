"""kopf handlers of MergedSnapshots."""

from __future__ import annotations

from typing import Any

import kopf

from ..k8s.api import SNAPSHOTS
from ..kopfglue import Bound, run
from .controller import SnapshotVerifier

#: the MergedSnapshot verifier (bound by :mod:`mergepipe_operator.main`)
snapshots: Bound[SnapshotVerifier] = Bound("MergedSnapshot verifier")


@kopf.on.resume(*SNAPSHOTS)
@kopf.on.create(*SNAPSHOTS)
@kopf.on.update(*SNAPSHOTS, field="spec")
def snapshot_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    run(lambda: snapshots().verify_snapshot(dict(body)), patch, body)
