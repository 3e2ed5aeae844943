"""docs/BENCHMARKS.md's planning figure (issue 23 item 3) is what the committed raw results of
``bench/plan_time.py --record`` give, and its target is judged from the measured runs."""

from bench import plan_report as pr


def test_benchmarks_doc_matches_committed_raw_results():
    """Re-render the block from docs/benchmarks/planning-*.json; a hand-edited figure or raw data
    changed without re-rendering fails."""
    assert sorted(pr.RAW.glob("planning-*.json")), "no committed raw results"
    assert pr.main(["--check"]) == 0


def _run(cpu: dict[str, float], load: float = 1.0) -> dict:
    t = {"cpu_s": 0.5, "wall_s": 0.6}
    return {
        "loadavg_before": [load, 0, 0],
        "loadavg_after": [load, 0, 0],
        "in_process": {
            "cases": {c: {"cpu_s": v, "wall_s": v, "make_plan_cpu_s": v / 2} for c, v in cpu.items()},
        },
        "process_10pct_sign3": t,
        "floor_imports": t,
        "floor_interpreter": t,
    }


def test_the_target_is_the_slowest_cases_median():
    fast = {"unlimited none": 0.1, "10% sign3": 0.15, "10% sign3+r1": 0.12}
    slow = {"unlimited none": 0.1, "10% sign3": 0.25, "10% sign3+r1": 0.12}
    res = {"runs": [_run(fast), _run(fast), _run(slow)]}
    assert pr.target(res) == ("0.150 s", True)  # one slow repetition does not decide
    res = {"runs": [_run(slow), _run(slow), _run(fast)]}
    assert pr.target(res) == ("0.250 s", False)
    rows = dict((label, (cpu, wall)) for label, cpu, wall in pr.rows(res))
    assert rows["`api.plan` in process, 10% `--sketch sign3`"][0] == [0.25, 0.25, 0.15]
