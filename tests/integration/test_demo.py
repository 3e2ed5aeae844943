"""`mergepipe demo`, the README's main job, end to end on its default (tiny) zoo: a real build of
trained experts, four committed merges, and a table whose full merge beats the base."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_default_runs_and_the_full_merge_helps(tiny_zoo_home):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    home = tiny_zoo_home  # the session's tiny zoo (conftest.tiny_zoo_home): the demo reuses it
    env = {**os.environ, "MERGEPIPE_HOME": str(home)}
    p = subprocess.run(
        [sys.executable, "-c", "from mergepipe.cli import main; main()", "demo", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout)
    # the zoo passed its build gates (checked when tiny_zoo_home built it; the demo reused it)
    from mergepipe_zoo import ZooConfig

    key = ZooConfig.tiny().key()
    assert "zoo ready in" in p.stderr and key in p.stderr
    assert json.loads((home / "zoo" / key / "zoo.json").read_text())["gates"]["passed"]
    models = [r["model"] for r in rows]
    assert models[0] == "base" and len(rows) == 1 + 4 + 4  # base, four experts, four budgets
    merges = rows[5:]
    domains = sorted(k.split(".", 1)[1] for k in rows[0] if k.startswith("loss."))
    full = merges[0]
    base_mean = sum(rows[0][f"loss.{d}"] for d in domains) / len(domains)
    full_mean = sum(full[f"loss.{d}"] for d in domains) / len(domains)
    assert full_mean < base_mean  # the testbed is one where merging helps
    # each budgeted merge read no more expert bytes than the one before it
    read = [m.get("expert_read_bytes") for m in merges]
    assert all(isinstance(b, int) for b in read), merges[0].keys()
    assert read == sorted(read, reverse=True)
    # every snapshot the demo reports was committed and verifies
    snaps = sorted((home / "demo").glob("*/task_arithmetic-*"))
    assert len(snaps) == 4
    ids = set()
    for snap in snaps:
        v = subprocess.run(
            [sys.executable, "-c", "from mergepipe.cli import main; main()", "verify", str(snap), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert v.returncode == 0, v.stdout + v.stderr
        ids.add(json.loads(v.stdout)["snapshot_id"])
    assert ids == {m["snapshot_id"] for m in merges}


def test_demo_size_is_checked():
    p = subprocess.run(
        [sys.executable, "-c", "from mergepipe.cli import main; main()", "demo", "--size", "huge"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "--size" in p.stderr and "Traceback" not in p.stderr
