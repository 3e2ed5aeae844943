"""mergepipe search: space, prior, asynchronous dispatch, failures, resume, CLI (issue 7).

The candidates are real merges of the small synthetic family (testkit/synth.py); the evaluators
are fakes whose metrics come from the merged weights (distance to expert 0 and to expert 1: a
genuine trade-off), with injected latencies, crashes and timeouts.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

import pytest

from mergepipe.errors import InputError
from testkit.harness import run_cli

pytest.importorskip("botorch")


def _distances(ckpt: Path, experts) -> dict:
    """Mean squared distance of the merged float tensors to expert 0 and expert 1."""
    import torch

    from testkit.harness import merged_tensors

    m = merged_tensors(ckpt)
    out = {}
    for k, e in enumerate(experts[:2]):
        ex = merged_tensors(e)
        num = sum(float(((m[n].float() - ex[n].float()) ** 2).sum()) for n in m if m[n].is_floating_point())
        den = sum(m[n].numel() for n in m if m[n].is_floating_point())
        out[f"dist{k}"] = num / den * 1e6
    del torch
    return out


def _config(family, tmp_path, **kw):
    from mergepipe.search.runner import SearchConfig

    base, experts = family
    d = dict(
        base=str(base),
        experts=[[f"e{i}", str(e)] for i, e in enumerate(experts[:2])],
        method="task_arithmetic",
        vary=["weight=0:1"],
        objectives=["dist0", "dist1"],
        evaluations=6,
        initial=3,
        workers=2,
        layer_blocks=2,
        catalog=str(tmp_path / "cat.sqlite"),
    )
    d.update(kw)
    return SearchConfig(**d)


# -- space ------------------------------------------------------------------------------------------
def test_space_maps_points_to_layer_block_filter_lists():
    from mergepipe.methods.params import layer_t, resolve_params
    from mergepipe.search.space import SearchSpace, layer_blocks, parse_vary

    assert layer_blocks(5, 2) == [(0, 1, 2), (3, 4)]
    sp = SearchSpace(
        "ties", ["a", "b"], parse_vary(["weight=0.2:1.2", "a:density=0.1:0.9"]), 4, 2, {"parameters": {"lambda": 1.0}}
    )
    assert sp.d == 2 * 2 + 2  # weight for a and b per block, density for a per block
    x = [0.0, 1.0, 0.5, 0.5, 0.25, 1.0]
    params = sp.to_params(x)
    assert params["parameters"]["lambda"] == 1.0 and set(params["experts"]) == {"a", "b"}  # structured, no strings
    rp = resolve_params("ties", params["parameters"], [params["experts"].get(n, {}) for n in ("a", "b")])
    # layer 3 is in block 1 -> a's weight = 0.2 + 1.0 * 1.0; layer 0 -> 0.2; embeddings take the mean
    assert rp.for_tensor("model.layers.3.mlp.up_proj.weight", layer_t("model.layers.3.x", 4)).experts[0][
        "weight"
    ] == pytest.approx(1.2)
    assert rp.for_tensor("model.layers.0.mlp.up_proj.weight", 0.0).experts[0]["weight"] == pytest.approx(0.2)
    assert rp.for_tensor("model.embed_tokens.weight", 0.0).experts[0]["weight"] == pytest.approx(0.7)
    assert rp.for_tensor("model.layers.1.self_attn.q_proj.weight", 0.0).experts[0]["density"] == pytest.approx(0.3)
    assert rp.for_tensor("model.layers.1.self_attn.q_proj.weight", 0.0).experts[1]["density"] == 1.0  # default
    assert [d.label for d in sp.dims][:2] == ["a:weight@L0-1", "a:weight@L2-3"]


@pytest.mark.parametrize(
    "vary, match",
    [
        (["weight=1:0"], "reversed"),
        (["weight=0.5:0.5"], "reversed"),
        (["weight=a:b"], "must be numbers"),
        (["weight"], "LO:HI"),
        (["density=0:1"], r"outside \(0, 1\]"),
        (["zeta=0:1"], "takes no parameter 'zeta'"),
        (["c:weight=0:1"], "no expert named 'c'"),
        (["weight=0:1", "a:weight=0:1"], "already varies"),
    ],
)
def test_bad_search_spaces_are_refused(vary, match):
    from mergepipe.search.space import SearchSpace, parse_vary

    with pytest.raises(InputError, match=match):
        SearchSpace("ties", ["a", "b"], parse_vary(vary), 4, 2, [])


def test_bad_counts_are_refused(family, tmp_path):
    with pytest.raises(InputError, match="fewer than --initial"):
        _config(family, tmp_path, evaluations=2, initial=3).check()
    with pytest.raises(InputError, match="design: 1 points but --initial 3"):
        _config(family, tmp_path, design=[[0.5, 0.5, 0.5, 0.5]]).check()
    with pytest.raises(InputError, match="named twice"):
        _config(family, tmp_path, objectives=["dist0", "dist0@max"]).check()
    with pytest.raises(InputError, match="between 1 and the base's 2 layers"):
        from mergepipe.search.evaluators import CallableEvaluator
        from mergepipe.search.runner import run_search

        run_search(tmp_path / "s", _config(family, tmp_path, layer_blocks=3), CallableEvaluator(lambda p: {}))
    assert not (tmp_path / "s").exists()


# -- prior ------------------------------------------------------------------------------------------
def test_parameter_prior_from_catalog_statistics(family, tmp_path):
    """The parameter discrepancy is each expert's relative task-vector energy per layer block,
    read from the catalog (checked against the checkpoints), and more discrepancy gives a shorter
    lengthscale."""
    import torch

    from mergepipe.catalog.catalog import Catalog
    from mergepipe.methods.params import layer_index
    from mergepipe.pipeline import register_and_analyze
    from mergepipe.search.optimizer import _kernel
    from mergepipe.search.prior import compute_prior
    from mergepipe.search.space import SearchSpace, parse_vary
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from testkit.harness import merged_tensors

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    _, _, ans = register_and_analyze(cat, st, str(base), [str(e) for e in experts[:2]])
    before = st.counters.snapshot()["read"]["expert"]
    sp = SearchSpace("task_arithmetic", ["a", "b"], parse_vary(["weight=0:1"]), 2, 2, [])
    pr = compute_prior(sp, [a.tensors for a in ans])
    assert st.counters.snapshot()["read"]["expert"] == before  # no expert read: catalog only
    bt = merged_tensors(base)
    for i, dm in enumerate(sp.dims):
        et = merged_tensors(experts[sp.experts.index(dm.expert)])
        names = [n for n in bt if layer_index(n) in dm.layers]
        want = sum(float(((et[n].float() - bt[n].float()) ** 2).sum()) for n in names) / sum(
            float((bt[n].float() ** 2).sum()) for n in names
        )
        assert pr.param[i] == pytest.approx(want, rel=1e-4)
    m = pr.multipliers
    assert math.exp(sum(map(math.log, m)) / len(m)) == pytest.approx(1.0, abs=1e-4)
    order_disc = sorted(range(len(m)), key=lambda i: pr.param[i])
    order_len = sorted(range(len(m)), key=lambda i: -m[i])
    assert order_disc == order_len  # more discrepancy -> shorter lengthscale
    k = _kernel(len(m), m)
    ls = k.lengthscale.detach().view(-1)
    assert torch.argmin(ls) == max(range(len(m)), key=lambda i: pr.param[i])


@pytest.mark.slow
def test_activation_prior_locates_the_changed_layer(tmp_path):
    """An expert that differs from the base only in decoder layer 1 has ~zero activation
    discrepancy in layer 0 and a positive one in layer 1."""
    import torch
    from transformers import LlamaForCausalLM

    from mergepipe.search.prior import hidden_state_discrepancy
    from testkit.tiny_llm import tiny_llama_config

    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_llama_config())
    m.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.add_(0.2 * torch.randn_like(m.model.layers[1].mlp.up_proj.weight))
    m.save_pretrained(tmp_path / "exp")
    ids = torch.randint(0, 300, (2, 16))
    (d,) = hidden_state_discrepancy(tmp_path / "base", [tmp_path / "exp"], ids)
    assert len(d) == 2
    assert d[0] < 1e-6 < d[1]


# -- dispatch ---------------------------------------------------------------------------------------
def _jobs(res):
    return {w: v["jobs"] for w, v in res["workers"].items()}


def test_async_dispatch_keeps_workers_busy_sync_waits(family, tmp_path):
    """Heterogeneous workers: asynchronously, a freed worker starts its next candidate without
    waiting for the other's evaluation (no barrier), so the fast worker runs more candidates;
    synchronously it waits at the batch barrier and both run the same number."""
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import run_search

    experts = family[1]
    ev = CallableEvaluator(lambda p: _distances(p, experts))
    ra = run_search(
        tmp_path / "a",
        _config(family, tmp_path, strategy="random", evaluations=10, initial=2, worker_delays=[0.0, 1.0]),
        ev,
    )
    assert ra["evaluations"] == 10 and ra["failed"] == 0
    assert not [e for e in ra["trace"] if e["kind"] == "barrier"]
    for w in ("0", "1"):  # between two of a worker's candidates only proposing/queueing for the proposer
        ev_w = sorted((e for e in ra["trace"] if e["worker"] == int(w)), key=lambda e: e["t0"])
        assert {e["kind"] for e in ev_w} <= {"propose", "wait", "merge", "eval"}
    assert _jobs(ra)["0"] > _jobs(ra)["1"]
    rb = run_search(
        tmp_path / "b",
        _config(family, tmp_path, strategy="sync", evaluations=6, initial=6, worker_delays=[0.0, 1.0]),
        ev,
    )
    assert [e for e in rb["trace"] if e["kind"] == "barrier" and e["worker"] == 0]
    assert abs(_jobs(rb)["0"] - _jobs(rb)["1"]) <= 0
    assert rb["workers"]["0"]["idle_fraction"] > ra["workers"]["0"]["idle_fraction"]


def test_async_bo_conditions_on_pending_and_commits_lineage(family, tmp_path):
    """Prior-guided asynchronous BO: proposals after the design see the in-flight candidate as
    pending; every snapshot is a verified commit whose manifest names the search."""
    from mergepipe.commit.manifest import read_manifest, verify_snapshot
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import run_search

    experts = family[1]
    res = run_search(
        tmp_path / "bo",
        _config(family, tmp_path, evaluations=6, initial=3, worker_delays=[1.0, 2.0]),
        CallableEvaluator(lambda p: _distances(p, experts)),
    )
    state = json.loads((tmp_path / "bo" / "state.json").read_text())
    cands = state["candidates"]
    bo = [c for c in cands if c["phase"] == "bo"]
    assert bo
    for c in bo:  # the pending set is exactly what was in flight while this candidate was proposed
        ev = next(e for e in state["events"] if e["kind"] == "propose" and e["cand"] == c["id"])
        inflight_at_start = {
            o["id"]
            for o in cands
            if o["id"] < c["id"] and o["times"]["proposed"] <= ev["t0"] and o["times"]["ended"] > ev["t1"]
        }
        assert inflight_at_start <= set(c["proposal"]["pending_ids"])
        for i in c["proposal"]["pending_ids"]:
            assert cands[i]["times"]["ended"] >= ev["t0"]
    assert any(c["proposal"]["pending_ids"] for c in bo)
    assert state["prior"] and len(state["prior"]["multipliers"]) == 4
    assert res["pareto"]
    for p in res["pareto"]:
        assert verify_snapshot(p["snapshot"])["ok"]
        m, _ = read_manifest(p["snapshot"])
        assert m["search"]["search_id"] == state["search_id"] and m["search"]["candidate"] == p["id"]
    hv = [h["hv"] for h in res["hypervolume"]]
    assert hv == sorted(hv) and hv[-1] > 0


# -- failures ---------------------------------------------------------------------------------------
def test_evaluator_crash_and_timeout_are_recorded_and_the_search_goes_on(family, tmp_path):
    import time

    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import run_search

    experts = family[1]
    calls = {"n": 0}
    lock = threading.Lock()

    def ev(p):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        if n == 3:
            time.sleep(3)
        return _distances(p, experts)

    res = run_search(
        tmp_path / "f",
        _config(family, tmp_path, strategy="random", evaluations=6, initial=2),
        CallableEvaluator(ev, timeout=1.5),
    )
    assert res["failed"] == 2 and res["evaluations"] == 4
    errs = sorted(f["error"] for f in res["failures"])
    assert "CUDA out of memory" in errs[0] and errs[1].startswith("timeout")


def test_missing_objective_is_a_clear_error(family, tmp_path):
    from mergepipe.search.evaluators import CallableEvaluator, MissingObjective
    from mergepipe.search.runner import run_search

    with pytest.raises(
        MissingObjective,
        match=r"did not produce metric 'dist1'; it printed \['accuracy', 'dist0', 'io:expert_read_bytes', 'io:expert_read_fraction'\]",
    ):
        run_search(
            tmp_path / "m",
            _config(family, tmp_path, strategy="random"),
            CallableEvaluator(lambda p: {"dist0": 1.0, "accuracy": 0.5}),
        )
    state = json.loads((tmp_path / "m" / "state.json").read_text())
    assert any(c["status"] == "failed" and "dist1" in c["error"] for c in state["candidates"])
    # known metrics: refused before anything is written
    with pytest.raises(MissingObjective, match="produces"):
        run_search(tmp_path / "m2", _config(family, tmp_path), CallableEvaluator(lambda p: {}, known=["dist0"]))
    assert not (tmp_path / "m2").exists()


def test_command_evaluator(tmp_path):
    from mergepipe.search.evaluators import CommandEvaluator, EvaluationFailed

    script = tmp_path / "ev.py"
    script.write_text(
        "import json, sys, time\nmode = sys.argv[1]\nprint('loading', sys.argv[2])\n"
        "if mode == 'crash': sys.exit('boom')\nif mode == 'slow': time.sleep(30)\n"
        "if mode == 'garbage': print('no json'); sys.exit(0)\n"
        "print(json.dumps({'acc': 0.5, 'path': sys.argv[2]}))\n"
    )
    ok = CommandEvaluator(f"{sys.executable} {script} ok {{checkpoint}}").metrics(tmp_path / "a b")
    assert ok == {"acc": 0.5, "path": str(tmp_path / "a b")}
    with pytest.raises(EvaluationFailed, match="exited with code 1: boom"):
        CommandEvaluator(f"{sys.executable} {script} crash").metrics(tmp_path)
    with pytest.raises(EvaluationFailed, match="no JSON object"):
        CommandEvaluator(f"{sys.executable} {script} garbage").metrics(tmp_path)
    with pytest.raises(EvaluationFailed, match="timeout"):
        CommandEvaluator(f"{sys.executable} {script} slow", timeout=1).metrics(tmp_path)


# -- resume -----------------------------------------------------------------------------------------
def test_resume_after_interruption(family, tmp_path):
    """Interrupted during an evaluation: finished candidates are kept as they were, the in-flight
    one is re-dispatched with the same point, and the search completes its budget."""
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import run_search

    experts = family[1]
    calls = {"n": 0}

    def dying(p):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return _distances(p, experts)

    cfg = _config(family, tmp_path, strategy="random", evaluations=5, initial=2, workers=1)
    with pytest.raises(KeyboardInterrupt):
        run_search(tmp_path / "r", cfg, CallableEvaluator(dying))
    st1 = json.loads((tmp_path / "r" / "state.json").read_text())
    done1 = {c["id"]: c for c in st1["candidates"] if c["status"] == "done"}
    running = [c for c in st1["candidates"] if c["status"] == "running"]
    assert len(done1) == 2 and len(running) == 1
    with pytest.raises(InputError, match="--resume"):
        run_search(tmp_path / "r", cfg, CallableEvaluator(dying))
    res = run_search(tmp_path / "r", evaluator=CallableEvaluator(lambda p: _distances(p, experts)), resume=True)
    st2 = json.loads((tmp_path / "r" / "state.json").read_text())
    assert res["evaluations"] == 5 and len(st2["candidates"]) == 5 and len(st2["sessions"]) == 2
    for i, c in done1.items():
        assert st2["candidates"][i]["metrics"] == c["metrics"] and st2["candidates"][i]["x"] == c["x"]
    again = st2["candidates"][running[0]["id"]]
    assert again["status"] == "done" and again["x"] == running[0]["x"]


# -- CLI --------------------------------------------------------------------------------------------
def test_cli_search_end_to_end(family, tmp_path, monkeypatch, capsys):
    base, experts = family
    script = tmp_path / "ev.py"
    script.write_text(
        "import json, sys\nfrom safetensors.torch import load_file\nimport glob, os\n"
        "def load(d):\n    out = {}\n    for f in glob.glob(os.path.join(d, '*.safetensors')):\n"
        "        out.update({k: v.float() for k, v in load_file(f).items()})\n    return out\n"
        "m = load(sys.argv[1])\n"
        f"es = [load({str(experts[0])!r}), load({str(experts[1])!r})]\n"
        "r = {f'dist{i}': float(sum(((m[k] - e[k]) ** 2).sum() for k in m) * 1e3) for i, e in enumerate(es)}\n"
        "print(json.dumps(r))\n"
    )
    out = tmp_path / "search"
    args = [
        "search",
        "--base",
        str(base),
        "-e",
        f"a={experts[0]}",
        "-e",
        f"b={experts[1]}",
        "--vary",
        "weight=0:1",
        "--layer-blocks",
        "1",
        "--objective",
        "dist0",
        "--objective",
        "dist1",
        "--eval-command",
        f"{sys.executable} {script} {{checkpoint}}",
        "--evaluations",
        "4",
        "--initial",
        "2",
        "--workers",
        "2",
        "--budget",
        "50%",
        "--out",
        str(out),
        "--catalog",
        str(tmp_path / "c.sqlite"),
        "--json",
    ]
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    res = json.loads(stdout)
    assert res["evaluations"] == 4 and res["pareto"]
    for p in res["pareto"]:
        m = json.loads((Path(p["snapshot"]) / "manifest.json").read_text())
        assert m["search"]["candidate"] == p["id"]
        assert m["io"]["realized"]["expert_read_bytes"] <= m["io"]["expert_budget_bytes"]
    code, _, err = run_cli(args[:-1], monkeypatch, capsys)
    assert code == 2 and "--resume" in err
    code, stdout, err = run_cli(
        ["search", "--out", str(out), "--resume", "--evaluations", "5", "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    assert json.loads(stdout)["evaluations"] == 5
    code, _, err = run_cli(
        [
            "search",
            "--base",
            str(base),
            "-e",
            str(experts[0]),
            "--vary",
            "weight=1:0",
            "--objective",
            "x",
            "--out",
            str(tmp_path / "bad"),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and "reversed" in err and not (tmp_path / "bad").exists()


def test_seeds_beyond_64_bits_seed_torch():
    """The search derives torch seeds as ``seed * 7919 + n``: with the largest seed the CRDs accept
    (2^53 - 1) that exceeds torch's 64-bit seed range, where ``torch.manual_seed`` raises; the
    optimizer seeds through ``torch_seed`` (modulo 2^64, unchanged below), so the design and the
    proposals stay deterministic for every seed."""
    import torch

    from mergepipe.search.optimizer import sobol, torch_seed

    big = (2**53 - 1) * 7919 + 3
    with pytest.raises((RuntimeError, ValueError)):  # "Overflow when unpacking long long"
        torch.manual_seed(big)
    torch.manual_seed(torch_seed(big))
    assert torch_seed(12345) == 12345 and torch_seed(big) == big % 2**64 != big
    assert sobol(4, 2, 2**70) == sobol(4, 2, 2**70 % 2**64) != sobol(4, 2, 1)


# -- issue 17: statistics, outer/shared/budget coordinates, rank prior, latency -------------------
def test_hypervolume_and_igd_on_known_fronts():
    from mergepipe.search.optimizer import hypervolume
    from mergepipe.search.stats import igd

    # boxes [1,4]x[3,4] + [2,4]x[2,3] + [3,4]x[1,2] = 3 + 2 + 1; a point beyond ref adds nothing
    assert hypervolume([[1, 3], [2, 2], [3, 1], [5, 0]], [4, 4]) == pytest.approx(6.0)
    assert hypervolume([[4, 4]], [4, 4]) == 0.0
    ref = [[0, 1], [1, 0]]
    assert igd([[0, 0]], ref) == pytest.approx(1.0)
    assert igd([[0, 0]], ref, scale=[2, 2]) == pytest.approx(0.5)
    assert igd(ref, ref) == 0.0
    assert igd([[0, 1]], ref) == pytest.approx(math.sqrt(2) / 2)  # (0 + √2) / 2
    assert igd([], ref) == math.inf


def test_bootstrap_and_paired_wilcoxon_on_known_samples():
    from mergepipe.search.stats import bootstrap_ci, paired_test, time_to_target

    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    # resampled means of [0, 10] are 0, 5, 10 with probabilities 1/4, 1/2, 1/4
    m, lo, hi = bootstrap_ci([0.0, 10.0])
    assert (m, lo, hi) == (5.0, 0.0, 10.0)
    m, lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0 and 1.0 < lo < 3.0 < hi < 5.0
    # all five differences positive: exact two-sided p = 2 / 2^5
    r = paired_test([2, 3, 4, 5, 6], [1, 1, 1, 1, 1])
    assert r["p"] == pytest.approx(2 / 32) and r["wins"] == 5 and r["mean_diff"] == 3.0
    # differences 1,-2,3,4,5,6: W- = 2; rank sums <= 2 come from {}, {1}, {2}: p = 2 * 3 / 64
    r = paired_test([1, -2, 3, 4, 5, 6], [0] * 6)
    assert r["p"] == pytest.approx(6 / 64) and (r["wins"], r["losses"]) == (5, 1)
    assert paired_test([1, 2], [1, 2])["p"] == 1.0
    with pytest.raises(ValueError):
        paired_test([1], [1, 2])
    tr = [(1, 0.1), (2, 0.5), (3, 0.7)]
    assert time_to_target(tr, 0.5) == 2 and time_to_target(tr, 0.8) is None


_NAMES = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    *[f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)],
]


def test_outer_coordinates_give_embeddings_and_lm_head_their_own_values():
    from mergepipe.methods.params import resolve_params
    from mergepipe.search.space import SearchSpace, outer_parts, parse_vary, space_for_base

    assert outer_parts(_NAMES) == [["embed", ["model.embed_tokens.weight"]], ["head", ["lm_head.weight"]]]
    sp = space_for_base(_NAMES, "task_arithmetic", ["a", "b"], parse_vary(["weight=0:1"]), 2, outer=True)
    assert sp.d == 2 * (2 + 2)
    assert [d.label for d in sp.dims][:4] == ["a:weight@L0-1", "a:weight@L2-3", "a:weight@embed", "a:weight@head"]
    x = [0.2, 0.4, 0.9, 0.1, 0.5, 0.5, 0.5, 0.5]
    params = sp.to_params(x)
    rp = resolve_params("task_arithmetic", params["parameters"], [params["experts"][n] for n in ("a", "b")])
    w = lambda name: rp.for_tensor(name, 0.0).experts[0]["weight"]  # noqa: E731
    assert w("model.embed_tokens.weight") == pytest.approx(0.9)
    assert w("lm_head.weight") == pytest.approx(0.1)
    assert w("model.norm.weight") == pytest.approx(0.3)  # mean of the layer blocks
    assert w("model.layers.3.mlp.up_proj.weight") == pytest.approx(0.4)
    assert SearchSpace.from_json(sp.to_json()).dims == sp.dims
    with pytest.raises(InputError, match="--search-outer"):
        space_for_base(_NAMES[2:], "task_arithmetic", ["a"], parse_vary(["weight=0:1"]), 2, outer=True)


def test_shared_and_budget_coordinates(family, tmp_path):
    from mergepipe.search.space import SearchSpace, parse_vary

    sp = SearchSpace("ties", ["a", "b"], parse_vary(["*:weight=0:1", "*:density=0.1:0.9", "budget=0.2:1"]), 4, 1)
    assert [d.label for d in sp.dims] == ["*:weight@L0-3", "*:density@L0-3", "budget"]
    p = sp.to_params([0.5, 0.5, 0.5])
    assert p["experts"]["a"] == p["experts"]["b"] and p["experts"]["a"]["density"][-1]["value"] == pytest.approx(0.5)
    assert p["budget"] == "60%"
    assert _config(family, tmp_path).request(p).budget == "60%"
    with pytest.raises(InputError, match="0 < LO < HI <= 1"):
        SearchSpace("ties", ["a"], parse_vary(["budget=0:2"]), 4, 1)
    with pytest.raises(InputError, match="ramplus_tl cannot honour an expert-I/O budget"):
        SearchSpace("ramplus_tl", ["a", "b"], parse_vary(["r=0:1", "budget=0.2:1"]), 4, 1)


def test_rank_prior_maps_relevance_quartiles_to_lengthscales():
    from mergepipe.search.optimizer import _kernel
    from mergepipe.search.prior import Prior, rank_lengthscales

    assert rank_lengthscales([3, 1, 2, 0.5]) == [0.5, 2.0, 1.0, 5.0]
    assert rank_lengthscales([1, 1, 1, 1, 1, 1, 1, 1]) == [0.5, 0.5, 1, 1, 2, 2, 5, 5]  # ties: coordinate order
    assert rank_lengthscales([2.0, None, 1.0, 4.0]) == [1.0, 2.0, 5.0, 0.5]  # None: neutral (geometric mean 2)
    pr = Prior.from_json(Prior(["a", "b"], [1.0, 4.0]).to_json())
    assert pr.lengthscales == [2.0, 0.5] and pr.multipliers[0] > pr.multipliers[1]
    k = _kernel(4, None, [0.5, 2.0, 1.0, 5.0])
    assert k.lengthscale.view(-1).tolist() == pytest.approx([0.5, 2.0, 1.0, 5.0])


def test_latency_and_io_metrics_plumbed(family, tmp_path):
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import evaluation_delay, run_search

    cfg = _config(family, tmp_path, worker_delays=[0.0, 2.0], latency=[0.5, 4.0])
    assert evaluation_delay(cfg, 0, 0.25) == pytest.approx(1.5)
    assert evaluation_delay(cfg, 1, 0.25) == pytest.approx(3.5)
    assert evaluation_delay(cfg, 0, None) == pytest.approx(4.5)  # unknown cost: a full read
    with pytest.raises(InputError, match="latency"):
        _config(family, tmp_path, latency=[1.0]).check()
    base, experts = family
    res = run_search(
        tmp_path / "io",
        _config(
            family,
            tmp_path,
            strategy="random",
            vary=["weight=0:1", "budget=0.1:1"],
            objectives=["dist0", "io:expert_read_fraction"],
            latency=[0.0, 0.01],
        ),
        CallableEvaluator(lambda p: _distances(p, experts)),
    )
    state = json.loads((tmp_path / "io" / "state.json").read_text())
    done = [c for c in state["candidates"] if c["status"] == "done"]
    assert len(done) == 6
    for c in done:
        frac = c["metrics"]["io:expert_read_fraction"]
        assert 0 < frac <= float(c["params"]["budget"].rstrip("%")) / 100 + 1e-9  # realized <= budget
        assert c["metrics"]["io:expert_read_bytes"] == c["expert_read_bytes"]
    assert res["pareto"]


def test_search_sketch_is_every_candidates_fidelity_tiers(family, tmp_path):
    """``SearchConfig.planning.sketch`` (``mergepipe search --sketch``, MergeSearch ``spec.sketch``)
    is each candidate's ``MergeRequest.planning.sketch``, so its plan has the tiers the search asked for; None
    leaves the planner's default; a bad kind is refused before anything is read."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.catalog.sketch import DEFAULT_SKETCH
    from mergepipe.pipeline import build_plan
    from mergepipe.request import PlanningOptions
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    cat, st = Catalog(tmp_path / "cat.sqlite"), open_storage(None, IOCounters())
    params = {"experts": {"e0": {"weight": 0.5}, "e1": {"weight": 0.5}}}
    plans = {}
    for sk in (None, "none", "sign1", DEFAULT_SKETCH):
        cfg = _config(family, tmp_path, budget="20%", planning=PlanningOptions(sketch=sk))
        cfg.check()
        req = cfg.request(params)
        assert req.planning.sketch == sk
        plans[sk] = build_plan(cat, st, req)
    assert plans["none"].sketch is None and plans["none"].io.sketch_read_bytes == 0
    levels = {k for t in plans["sign1"].tensors for e in t.experts for k in e.sketch_levels}
    assert levels == {1} and 0 < plans["sign1"].io.sketch_read_bytes <= plans["sign1"].io.expert_read_bytes
    assert plans["sign1"].retained_energy > plans["none"].retained_energy
    assert plans[None].digest == plans[DEFAULT_SKETCH].digest != plans["sign1"].digest
    with pytest.raises(InputError, match="--sketch 'sign4'"):
        _config(family, tmp_path, planning=PlanningOptions(sketch="sign4")).check()


def test_holm_and_paired_t_intervals_on_known_samples():
    from mergepipe.search.stats import holm, paired_test

    # Holm (1979): sorted p 0.01, 0.02, 0.04 with m = 3 -> 0.03, 0.04, 0.04 (monotone step-down)
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        holm([1.2])
    # differences 1, 2, 3, 4, 5: mean 3, sd sqrt(2.5), t(4) 97.5% = 2.776 -> half width 1.963
    r = paired_test([2, 4, 6, 8, 10], [1, 2, 3, 4, 5])
    assert r["t_ci"] == pytest.approx([3 - 1.9632, 3 + 1.9632], abs=1e-3)
    assert r["dz"] == pytest.approx(3 / 2.5**0.5)
    assert r["t_p"] == pytest.approx(0.0132, abs=5e-4)  # t = 4.243, 4 df
    assert r["p"] == pytest.approx(0.0625)  # exact Wilcoxon, 5/5 positive
