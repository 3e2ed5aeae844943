"""docs/QUALITY.md's pre-registered tables are what the committed raw results give."""

import copy
import json
from pathlib import Path

import numpy as np

from bench import quality_report as qr

REPO = Path(__file__).resolve().parents[2]


def test_quality_doc_matches_committed_raw_results():
    """Re-derive every generated figure of docs/QUALITY.md from docs/quality/fresh-*.json; a
    mismatch (a hand-edited figure, raw data changed without re-deriving) fails."""
    assert sorted((REPO / "docs" / "quality").glob("fresh-*.json")), "no committed fresh results"
    assert qr.main(["--check"]) == 0


def _seed(full_q: dict, point_q: dict) -> dict:
    items = {t: [v] * 4 for t, v in {"a": 2.0, "b": 2.0}.items()}
    return {
        "seed": 0,
        "metric": "loss",
        "base": {"a": 2.0, "b": 2.0},
        "experts": {"ea": {"a": 1.0, "b": 2.0}, "eb": {"a": 2.0, "b": 1.0}},
        "expert_task": {"ea": "a", "eb": "b"},
        "base_items": items,
        "expert_items": {"ea": {"a": [1.0] * 4, "b": [2.0] * 4}, "eb": {"a": [2.0] * 4, "b": [1.0] * 4}},
        "methods": {
            "ties": {
                "full": {"quality": full_q, "items": {t: [v] * 4 for t, v in full_q.items()}},
                "points": [
                    {
                        "value": "energy+sign3",
                        "budget": "10%",
                        "read_fraction": 0.1,
                        "quality": point_q,
                        "items": {t: [v] * 4 for t, v in point_q.items()},
                    }
                ],
            }
        },
    }


def test_kept_share_floor_lists_small_gains_apart():
    """A task whose full merge keeps less than the floor of its expert's gain has no kept share
    (0.05 -> 0.08 would read as 160%); it is listed apart and the worst task is taken over the
    others."""
    # full merge: NG a = 0.5, NG b = 0.05 (below the 0.2 floor); budgeted: NG a = 0.45, b = 0.08
    s = _seed({"a": 1.5, "b": 1.95}, {"a": 1.55, "b": 1.92})
    out = qr.seed_points(s, 0.2, 50, np.random.default_rng(0))["ties"]
    p = out["points"][("energy+sign3", 10.0)]
    assert abs(p["worst_kept"] - 0.9) < 1e-9
    assert [t for t, _, _ in p["below"]] == ["b"]
    assert np.allclose(p["boot"], 0.9)  # constant items: every replicate is the point estimate
    s2 = copy.deepcopy(s)
    s2["methods"]["ties"]["full"]["quality"]["b"] = 1.5  # now above the floor: b's share counts
    s2["methods"]["ties"]["full"]["items"]["b"] = [1.5] * 4
    p2 = qr.seed_points(s2, 0.2, 10, np.random.default_rng(0))["ties"]["points"][("energy+sign3", 10.0)]
    assert abs(p2["worst_kept"] - 0.16) < 1e-9 and not p2["below"]


def test_preregistration_is_committed_shape():
    pr = json.loads((REPO / "docs" / "quality" / "preregistration.json").read_text())
    dev = set(pr["development_seeds"])
    for tb in pr["testbeds"].values():
        assert len(tb["fresh_seeds"]) >= 5 and not dev & set(tb["fresh_seeds"] + tb["replacement_seeds"])
    assert 0 < pr["floor"] < 1


def _fresh(seeds: list[dict], registered: list[int], label: str = "tb") -> dict:
    pr = {
        "testbeds": {label: {"fresh_seeds": registered, "primary_setting": "energy+sign3"}},
        "floor": 0.2,
        "targets": {"10": 0.9},
        "statistics": {"test_set": "bootstrap"},
    }
    return {
        "testbed": label,
        "testbed_label": label,
        "size": "tiny",
        "command": "python bench/quality.py --fresh --testbed tb --work /tmp/x",
        "code_commit": "0" * 40,
        "preregistration_commit": "0" * 40,
        "wall_s": 1.0,
        "machine": "m",
        "loadavg_start": "1",
        "loadavg_end": "1",
        "preregistration": pr,
        "seeds": seeds,
    }


def test_summary_states_target_gap_and_missing_seeds():
    """A seed that did not finish is named and every n says 'of' the registered seeds; the
    summary states the target's gap in points and the monotone check per testbed."""
    s0 = _seed({"a": 1.5, "b": 1.5}, {"a": 1.55, "b": 1.6})  # kept a 0.9, b 0.8 -> worst 0.8
    s1 = copy.deepcopy(s0)
    s1["seed"] = 1
    md, summ = qr.derive_with_summary(_fresh([s0, s1], [0, 1, 2]), n_boot=20)
    assert "**2 of the 3 registered fresh seeds**: seeds [2] did not finish" in md
    (m, b, mean, mn, n, tgt) = summ["targets"][0]
    assert (m, b, n, tgt) == ("ties", 10.0, 2, 0.9) and abs(mean - 0.8) < 1e-9
    out = qr.summary_md([summ])
    assert "| tb | not recorded | ties | 10% | 80.0% | 90% | missed by 10.0 pt | 80.0% | 2 (of 3) |" in out
    assert "| tb | yes: every step raises" in out  # 10% -> 100%: 0.8 -> 1.0
    # a registered method no seed finished is named, never silently absent
    res = _fresh([s0], [0, 1, 2])
    res["preregistration"]["methods"] = {"ties": "density=0.5", "dare_ties": "density=0.5"}
    md, summ = qr.derive_with_summary(res, n_boot=5)
    assert "**Methods not run**: ['dare_ties']" in md
    assert "| tb | not recorded | dare_ties | | not run | | | | 0 (of 3) |" in qr.summary_md([summ])


def test_testbed_entry_overrides_primary_setting():
    """A testbed's registration entry names its own primary setting (MiniLM: amendment 2)."""
    res = _fresh([_seed({"a": 1.5, "b": 1.5}, {"a": 1.55, "b": 1.6})], [0])
    res["preregistration"]["primary_setting"] = "energy+sign3+r1"
    assert qr.registration(res)["primary"] == "energy+sign3"


def test_fresh_run_refuses_an_unregistered_seed():
    """``--fresh --seeds`` runs only seeds the committed registration names for the testbed
    (development seed 0 is not one): one clear line, before anything is built or written."""
    import pytest

    from bench import quality

    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the registration's commit cannot be checked")
    with pytest.raises(SystemExit) as e:
        quality.main(["--fresh", "--testbed", "minilm", "--seeds", "0", "--no-report"])
    assert "--seeds [0]: not registered for minilm" in str(e.value.code)


def test_monotone_check_names_a_flat_step():
    """A step whose paired mean difference is exactly 0 (the 10% merge already scores as the full
    one) is 'flat', never 'up'; the summary says no step lowers the mean and names the flat step."""
    s = _seed({"a": 1.5, "b": 1.5}, {"a": 1.5, "b": 1.5})  # 10% keeps 100% of the full merge's gain
    md, summ = qr.derive_with_summary(_fresh([s], [0]), n_boot=5)
    assert "| ties | energy+sign3 | 10→100%: +0.0 pt (flat) |" in md
    out = qr.summary_md([summ])
    assert (
        "| tb | yes: no step lowers the mean worst-task kept share; flat (equal means): ties energy+sign3 10→100% |"
        in out
    )
