"""The cost model in seconds (issue 23 item 2): exact prediction arithmetic on a synthetic
throughput, ``--deadline`` choosing a budget that fits and refusing an impossible one, the
throughput cache refusing malformed files, and one measured predicted-vs-realized comparison."""

from __future__ import annotations

import json

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.errors import InputError
from mergepipe.pipeline import build_plan
from mergepipe.planner.cost import (
    Throughput,
    engine_rates,
    load_throughput,
    method_family,
    parse_duration,
    plan_requests,
    predict_seconds,
    save_throughput,
    sketched_entry_bytes,
)
from mergepipe.request import ExpertRequest, MergeRequest, PlanningOptions
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.harness import run_cli

# powers of two: the prediction's divisions are exact in binary floating point
SLOW = Throughput(
    read_bytes_per_s=2.0**20,
    write_bytes_per_s=2.0**21,
    request_s=2.0**-10,
    decode_bytes_per_s=2.0**19,
    merge_bytes_per_s={"consensus": 2.0**18, "sum": 2.0**17, "whole": 2.0**16},
)


def _request(family, budget=None, deadline=None, sketch="none"):
    base, experts = family
    return MergeRequest(
        base=str(base),
        experts=[ExpertRequest(name=f"e{i}", uri=str(e)) for i, e in enumerate(experts)],
        method="ties",
        parameters={"density": 0.5},
        budget=budget,
        planning=PlanningOptions(deadline=deadline, sketch=sketch),
    )


def _plan(family, tmp_path, **kw):
    cat = Catalog(str(tmp_path / "c.sqlite"))
    st = open_storage(str(family[0]), IOCounters())
    return build_plan(cat, st, _request(family, **kw).resolve())


def test_prediction_is_the_documented_sum(family, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))
    plan = _plan(family, tmp_path, budget="40%", sketch="sign3")
    io = plan.io
    assert plan.predicted_seconds is None  # not calibrated: no guess
    pred = predict_seconds(plan, SLOW)
    assert pred is not None
    exact = io.base_read_bytes + io.expert_read_bytes - io.sketch_read_bytes
    n = plan_requests(plan)
    assert n >= len(plan.tensors)
    assert pred["read"] == exact / 2**20 + n / 1024
    sk = sketched_entry_bytes(plan)
    # a sketch is smaller than the bf16 entries it stands for, which are not read exactly
    assert io.sketch_read_bytes < sk < plan.expert_bytes_total
    assert pred["decode"] == sk / 2**19
    assert pred["merge"] == (exact + sk) / 2**18  # ties: the "consensus" family
    assert pred["write"] == io.output_write_bytes / 2**21
    assert pred["total"] == pred["read"] + pred["decode"] + pred["merge"] + pred["write"]


@pytest.mark.parametrize(("text", "seconds"), [("60s", 60.0), ("2m", 120.0), ("1.5h", 5400.0), ("500ms", 0.5)])
def test_durations_need_a_unit(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["60", "0s", "-5s", "soon", "5 parsecs"])
def test_bad_durations_are_refused(text):
    with pytest.raises(InputError) as e:
        parse_duration(text)
    assert "--deadline" in str(e.value) and "\n" not in str(e.value)


def test_deadline_picks_a_budget_that_fits_and_refuses_an_impossible_one(family, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))
    save_throughput(SLOW)
    full = _plan(family, tmp_path)
    assert full.predicted_seconds is not None
    t_full = full.predicted_seconds["total"]
    # half the expert bytes' read + merge time off: only a budget below the full plan fits
    target = t_full - 0.5 * full.io.expert_read_bytes * (1 / 2**20 + 1 / 2**18)
    p = _plan(family, tmp_path, deadline=f"{target:.6f}s")
    assert p.budget_bytes is not None and 0 < p.budget_bytes < full.expert_bytes_total
    assert p.predicted_seconds is not None and p.predicted_seconds["total"] <= target
    assert 0 < p.io.expert_read_bytes < full.io.expert_read_bytes
    # a generous deadline keeps the unlimited plan
    assert _plan(family, tmp_path, deadline=f"{t_full * 2:.6f}s").digest == full.digest
    with pytest.raises(InputError) as e:
        _plan(family, tmp_path, deadline="1ms")
    assert e.value.loc == ("planning", "deadline") and "cheapest plan" in str(e.value)


def test_deadline_with_fidelity_is_refused():
    with pytest.raises(InputError) as e:
        MergeRequest(
            base="b", experts=[ExpertRequest(name="a", uri="a")], fidelity=0.9, planning=PlanningOptions(deadline="60s")
        ).resolve()
    assert e.value.loc == ("fidelity",)
    with pytest.raises(InputError) as e:
        MergeRequest(
            base="b", experts=[ExpertRequest(name="a", uri="a")], planning=PlanningOptions(deadline="60")
        ).resolve()
    assert e.value.loc == ("planning", "deadline") and "--deadline" in str(e.value)


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        json.dumps({**SLOW.model_dump(), "format": "other/v9"}).encode(),
        json.dumps({**SLOW.model_dump(), "merge_bytes_per_s": -1.0}).encode(),
        json.dumps({**SLOW.model_dump(), "merge_bytes_per_s": {"consensus": -1.0}}).encode(),
        json.dumps({**SLOW.model_dump(), "merge_bytes_per_s": {"bogus": 1.0}}).encode(),
        json.dumps({**SLOW.model_dump(), "format": "mergepipe.throughput/v1", "merge_bytes_per_s": 1.0}).encode(),
        json.dumps({**SLOW.model_dump(), "read_bytes_per_s": 0}).encode(),
        json.dumps({k: v for k, v in SLOW.model_dump().items() if k != "request_s"}).encode(),
        json.dumps({**SLOW.model_dump(), "surprise": 1}).encode(),
        b"{" + b" " * 70000 + b"}",
    ],
)
def test_throughput_cache_refuses_malformed_files(tmp_path, content):
    p = tmp_path / "throughput.json"
    p.write_bytes(content)
    with pytest.raises(InputError) as e:
        load_throughput(p)
    assert str(p) in str(e.value) and "mergepipe calibrate" in str(e.value) and "\n" not in str(e.value)
    save_throughput(SLOW, p)
    assert load_throughput(p) == SLOW


def test_cli_deadline_errors_are_one_line_and_write_nothing(family, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("MERGEPIPE_HOME", str(home))
    base, experts = family
    out = tmp_path / "out"
    args = ["merge", "--base", str(base), "--expert", str(experts[0]), "--expert", str(experts[1])]
    args += ["--method", "ties", "-p", "density=0.5", "--out", str(out), "--catalog", str(tmp_path / "c.sqlite")]
    code, _, err = run_cli([*args, "--deadline", "60"], monkeypatch, capsys)
    assert code == 2 and "--deadline" in err and "unit" in err and len(err.strip().splitlines()) == 1
    home.mkdir()
    (home / "throughput.json").write_text("{broken")
    code, _, err = run_cli([*args, "--deadline", "60s"], monkeypatch, capsys)
    assert code == 2 and "throughput.json" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_predicted_vs_realized_seconds_measured(family, tmp_path, monkeypatch, capsys):
    """Calibrate this machine, merge the small synthetic family, report predicted vs realized
    (the execute's wall seconds). Reported, not asserted tightly: a shared machine's load moves both."""
    home = tmp_path / "home"
    monkeypatch.setenv("MERGEPIPE_HOME", str(home))
    code, out, err = run_cli(["calibrate", "--json"], monkeypatch, capsys)
    assert code == 0, err
    tp = json.loads(out)
    assert tp["read_bytes_per_s"] > 0 and (home / "throughput.json").exists()
    base, experts = family
    args = ["merge", "--base", str(base), "--expert", str(experts[0]), "--expert", str(experts[1])]
    args += ["--method", "ties", "-p", "density=0.5", "--out", str(tmp_path / "o"), "--json"]
    code, out, err = run_cli([*args, "--catalog", str(tmp_path / "c.sqlite")], monkeypatch, capsys)
    assert code == 0, err
    s = json.loads(out)
    assert s["predicted_s"] is not None and s["predicted_s"] > 0
    with capsys.disabled():
        print(f"\n[cost model] predicted {s['predicted_s']:.3f} s, realized execute wall {s['wall_s']:.3f} s")


def test_method_families_and_engine_rates():
    """Every method maps to a family with a measured rate; the rates come from the engine's own
    kernels (positive, finite) and a TIES merge with sign election is slower than a plain sum."""
    from mergepipe.methods.registry import method_names

    assert method_family("ties") == "consensus" and method_family("dare_ties") == "consensus"
    assert method_family("task_arithmetic") == "sum" and method_family("linear") == "sum"
    assert method_family("della") == "whole" and method_family("model_stock") == "whole"
    assert {method_family(m) for m in method_names()} <= set(SLOW.merge_bytes_per_s)
    decode, merge = engine_rates(repeat=1)
    assert set(merge) == {"consensus", "sum", "whole"}
    assert all(0 < r < 1e12 for r in [decode, *merge.values()])
    assert merge["consensus"] < merge["sum"]
