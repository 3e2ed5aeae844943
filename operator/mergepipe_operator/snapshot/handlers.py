"""kopf handlers of MergedSnapshots."""

from __future__ import annotations

from typing import Any

import kopf

from ..controller import controller, run
from ..k8s.api import SNAPSHOTS


@kopf.on.resume(*SNAPSHOTS)
@kopf.on.create(*SNAPSHOTS)
@kopf.on.update(*SNAPSHOTS, field="spec")
def snapshot_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    run(lambda: controller().verify_snapshot(dict(body)), patch, body)
