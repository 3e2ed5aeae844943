"""Budget input that cannot surprise (issue 24 item 6): a bare number is refused with the two
readings spelled out, and a budget that buys no block is refused -- through the CLI (exit 2, one
line, nothing written) and through the request model the operator uses."""

from __future__ import annotations

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.errors import InputError
from mergepipe.pipeline import build_plan
from mergepipe.request import ExpertRequest, MergeRequest, parse_bytes
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.harness import run_cli


@pytest.mark.parametrize("text", ["25", "0", "1e9", " 25 "])
def test_a_bare_budget_is_refused_naming_both_readings(text):
    with pytest.raises(InputError) as e:
        parse_bytes(text, total=100, bare=False)
    msg = str(e.value)
    assert "needs a unit" in msg and f"{text.strip()}%" in msg and f"{text.strip()}B" in msg
    assert "\n" not in msg
    assert parse_bytes("25B", total=100, bare=False) == 25
    assert parse_bytes("25%", total=100, bare=False) == 25
    assert parse_bytes("25", total=100) == 25  # other quantities (--work-memory ...) keep bare bytes


def _request(family, budget):
    base, experts = family
    return MergeRequest(
        base=str(base),
        experts=[ExpertRequest(name=f"e{i}", uri=str(e)) for i, e in enumerate(experts)],
        method="ties",
        parameters={"density": 0.5},
        budget=budget,
    )


def test_request_model_refuses_bare_and_useless_budgets(family, tmp_path):
    with pytest.raises(InputError) as e:
        _request(family, "25").resolve()
    assert e.value.loc == ("budget",) and "25%" in str(e.value)
    cat = Catalog(str(tmp_path / "c.sqlite"))
    st = open_storage(str(family[0]), IOCounters())
    for budget in (25, "25B", 0):  # an integer is bytes (typed), but 25 bytes buy no block
        with pytest.raises(InputError) as e:
            build_plan(cat, st, _request(family, budget).resolve())
        assert e.value.loc == ("budget",) and "buys no block" in str(e.value), budget
    plan = build_plan(cat, st, _request(family, "10%").resolve())
    assert 0 < plan.io.expert_read_bytes <= plan.budget_bytes


def test_cli_refuses_a_bare_budget_before_writing(family, tmp_path, monkeypatch, capsys):
    base, experts = family
    out = tmp_path / "out"
    args = ["merge", "--base", str(base), "--expert", str(experts[0]), "--expert", str(experts[1])]
    args += ["--method", "ties", "-p", "density=0.5", "--out", str(out), "--catalog", str(tmp_path / "c.sqlite")]
    code, stdout, err = run_cli([*args, "--budget", "25"], monkeypatch, capsys)
    assert code == 2 and "needs a unit" in err and "25%" in err and "25B" in err
    assert not out.exists()
    code, stdout, err = run_cli([*args, "--budget", "25B"], monkeypatch, capsys)
    assert code == 2 and "buys no block" in err
    assert not out.exists() or not any(out.iterdir())


def test_json_reports_realized_sketch_bytes_and_total_from_process_start(family, tmp_path, monkeypatch, capsys):
    """Costs in the open (issue 24 item 4): the realized sketch bytes are in ``--json`` and the
    manifest and equal the planned ones; ``total_s`` counts from process start (issue 23)."""
    import json
    import time

    from mergepipe import cli

    base, experts = family
    out = tmp_path / "out"
    args = ["merge", "--base", str(base)] + [a for e in experts for a in ("--expert", str(e))]
    args += ["--method", "ties", "-p", "density=0.5", "--budget", "10%", "--sketch", "sign3"]
    args += ["--out", str(out), "--catalog", str(tmp_path / "c.sqlite"), "--json"]
    t0 = time.perf_counter()
    age0 = cli._since_process_start()
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    s = json.loads(stdout)
    io = s["io"]
    assert io["planned_sketch_read_bytes"] > 0
    assert io["sketch_read_bytes"] == io["planned_sketch_read_bytes"]
    assert io["sketch_read_bytes"] < io["expert_read_bytes"] <= io["expert_budget_bytes"]
    manifest = (
        json.loads((out / "mergepipe_manifest.json").read_text())
        if (out / "mergepipe_manifest.json").exists()
        else None
    )
    if manifest is not None:
        assert manifest["io"]["realized"]["sketch_read_bytes"] == io["sketch_read_bytes"]
    # this process started before the test: total_s covers it, not only the merge call
    assert s["total_s"] >= age0 + (time.perf_counter() - t0) - 0.05
    assert s["total_s"] >= s["analyze_plan_s"] + s["wall_s"] - 0.05
