"""bench/search_report.py: every figure of docs/SEARCH.md's search measurement is re-derived from
the committed raw results (issue 27); a changed figure or a changed raw file fails."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("botorch")

ROOT = Path(__file__).resolve().parents[2]


def _raw(path: Path, seeds: int = 4) -> None:
    doms = ["p", "q"]
    rng = random.Random(0)
    arms = ["lw-bo", "ml-bo", "ml-grid"]
    meta = {
        "testbed": "toy",
        "arms": arms,
        "evaluations": 5,
        "initial": 2,
        "blocks": 2,
        "search_windows": 4,
        "domains": doms,
        "objectives": [f"loss:{d}" for d in doms],
        "zoo": {"key": "k", "format": 3, "config": "toy", "layers": 2},
        "reference": {
            "metrics": {
                n: {
                    f"{pre}loss:{d}": (1.0 if n == d else 2.0) + (0.1 if pre else 0.0)
                    for d in doms
                    for pre in ("", "heldout:")
                }
                for n in ["base", *doms]
            }
        },
        "machine": {"python": "3", "cpus": 2, "torch": "t", "botorch": "b", "load_start": [1.0], "load_end": [2.0]},
        "total_s": 1.0,
        "seeds": {a: list(range(seeds)) for a in arms},
    }
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(meta) + "\n")
        for s in range(seeds):
            for a in arms:
                cands = []
                for _ in range(5):
                    y = [rng.uniform(1.0, 2.0), rng.uniform(1.0, 2.0)]
                    cands.append({"x": [0.5], "y": y, "h": [v + rng.uniform(0, 0.2) for v in y]})
                f.write(
                    json.dumps({"arm": a, "seed": s, "run_s": 1.0, "load": [1.0], "failed": 0, "cands": cands}) + "\n"
                )


def test_report_round_trip_and_mismatch(tmp_path):
    from bench.search_report import analyse, blocks, check, load

    _raw(tmp_path / "raw-toy.jsonl.gz")
    meta, runs = load(tmp_path / "raw-toy.jsonl.gz")
    an = analyse(meta, runs)
    assert an["family"] == 4  # lw-bo − ml-bo and lw-bo − ml-grid, each on HV and held-out HV
    holm = [p[k]["holm"] for p in an["pairs"] for k in ("hv", "held")]
    raw_p = [p[k]["p"] for p in an["pairs"] for k in ("hv", "held")]
    assert all(h >= p for h, p in zip(holm, raw_p))
    block = blocks(tmp_path)["toy"]
    doc = tmp_path / "DOC.md"
    doc.write_text(f"intro\n<!-- search-report:toy:begin -->\n{block}\n<!-- search-report:toy:end -->\nrest\n")
    assert check(doc, tmp_path) == []
    # a figure edited by hand is caught
    line = next(x for x in block.splitlines() if x.startswith("| lw-bo |"))
    doc.write_text(doc.read_text().replace(line, line.replace("| 5 |", "| 6 |", 1)))
    assert check(doc, tmp_path) and "differs" in check(doc, tmp_path)[0]
    # so is a block with no markers
    doc.write_text("nothing\n")
    assert "no generated block" in check(doc, tmp_path)[0]


def test_search_md_matches_the_committed_raw_results():
    from bench.search_report import RAW, check

    raws = sorted(RAW.glob("raw-*.jsonl.gz"))
    names = {p.name for p in raws}
    assert {"raw-zoo8-dev.jsonl.gz", "raw-zoo8-fresh.jsonl.gz", "raw-zoo8-amendment1.jsonl.gz"} <= names
    assert all(p.stat().st_size < 4 * 2**20 for p in raws)  # compact: a few MB at most
    assert check() == []


def test_preregistered_family_is_fixed_and_primary_stated(tmp_path):
    """A pre-registered run keeps its registered family: a comparison that did not run stays in
    Holm's family with p = 1 (so it cannot make the others look stronger), comparisons outside
    the registration are left out, and the primary endpoint is stated."""
    from bench.search_report import analyse, blocks, load

    path = tmp_path / "raw-toy-fresh.jsonl.gz"
    _raw(path)
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    meta = json.loads(lines[0])
    meta["preregistration_commit"] = "0" * 40
    meta["preregistration"] = {"family": {"comparisons": [["lw-bo", "ml-bo"], ["lw-bo", "lw-nsga2"]]}}
    with gzip.open(path, "wt") as f:
        f.write("\n".join([json.dumps(meta), *lines[1:]]) + "\n")
    meta, runs = load(path)
    an = analyse(meta, runs)
    assert an["family"] == 4  # lw-bo − ml-grid ran but was not registered; lw-bo − lw-nsga2 did not run
    missing = next(p for p in an["pairs"] if p["b"] == "lw-nsga2")
    assert missing["hv"]["p"] == 1.0 and missing["held"]["holm"] == 1.0
    ran = next(p for p in an["pairs"] if p["b"] == "ml-bo")
    ph, pv = ran["held"]["p"], ran["hv"]["p"]  # Holm over 4 tests, two of them p = 1
    assert ran["held"]["holm"] == pytest.approx(min(1.0, 4 * ph if ph <= pv else max(4 * pv, 3 * ph)))
    block = blocks(tmp_path)["toy-fresh"]
    assert "| lw-bo − lw-nsga2 | BO vs NSGA-II, layer-wise | 0 | held-out HV | not run |" in block
    assert (
        "Primary endpoint (pre-registered, commit `0000000`): held-out HV of lw-bo − ml-bo over 4 fresh seeds" in block
    )


def test_fresh_run_refuses_an_uncommitted_preregistration(tmp_path, monkeypatch):
    """bench/search.py --fresh runs only from a committed, unchanged pre-registration of its
    testbed and takes seeds, arms (zoo8: main arms first, NSGA-II second; minilm: the registered
    seed-major pass, split by --part) and budget from it."""
    import subprocess
    from types import SimpleNamespace

    import bench.search as bs

    regs = {}
    (tmp_path / "docs" / "search").mkdir(parents=True)
    for tb, name in (("zoo8", "preregistration.json"), ("minilm", "preregistration-minilm.json")):
        regs[tb] = json.loads((ROOT / "docs" / "search" / name).read_text())
        (tmp_path / "docs" / "search" / name).write_text(json.dumps(regs[tb]))
    f = tmp_path / "docs" / "search" / "preregistration.json"
    monkeypatch.setattr(bs, "ROOT", tmp_path)
    monkeypatch.setattr(
        bs,
        "PREREGS",
        {
            tb: tmp_path / "docs" / "search" / n
            for tb, n in (("zoo8", "preregistration.json"), ("minilm", "preregistration-minilm.json"))
        },
    )
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    args = SimpleNamespace(testbed="zoo8", part=None)
    with pytest.raises(SystemExit, match="not committed"):
        bs._preregistered(args)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "prereg"], check=True)
    pr = regs["zoo8"]
    passes = bs._preregistered(args)
    assert passes[0] == (pr["fresh_seeds"], ["lw-bo", "ml-bo", "ml-bo-default", "lw-random", "ml-random", "ml-grid"])
    assert passes[1] == (pr["fresh_seeds"], ["lw-nsga2", "ml-nsga2"])
    assert (args.evaluations, args.initial, args.blocks, args.search_windows) == (12, 6, 4, 16)
    assert len(args.prereg_commit) == 40
    mini = SimpleNamespace(testbed="minilm", part="2/2")
    passes = bs._preregistered(mini)
    arms = ["lw-bo", "ml-bo", "lw-random", "ml-random", "ml-grid", "lw-nsga2", "ml-nsga2"]
    assert passes == [([105, 106, 107, 108, 109], arms)]
    assert (mini.evaluations, mini.initial, mini.blocks, mini.minilm_seed, mini.examples) == (12, 6, 3, 100, 128)
    f.write_text(json.dumps(pr | {"fresh_seeds": [0]}))  # edited after the commit: refused
    with pytest.raises(SystemExit, match="not committed"):
        bs._preregistered(args)
    with pytest.raises(SystemExit, match="registers testbed 'minilm', not 'zoo8'"):  # the wrong file
        bs.PREREGS["zoo8"] = bs.PREREGS["minilm"]
        bs._preregistered(args)


def test_minilm_cost_figures_are_re_derived_from_the_raw_measurement(tmp_path):
    """docs/SEARCH.md's MiniLM cost block is rendered from docs/search/minilm-eval-cost.json: a
    changed raw timing changes the block (so --check fails on the committed doc), and a stored
    projection that the raw timings do not give is refused."""
    import shutil

    from bench.search_report import DOC, MINILM_COST, RAW, check, minilm_cost

    cost = json.loads((RAW / MINILM_COST).read_text())
    block = minilm_cost(cost)
    assert "**10.3 CPU s**" in block and "**635 CPU s per" in block and "| 1236 | 249 |" in block
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(RAW / MINILM_COST, raw / MINILM_COST)
    assert check(DOC, raw) == []
    edited = json.loads(json.dumps(cost))
    edited["catalog_analysis"]["cpu_s"] = 300.0
    (raw / MINILM_COST).write_text(json.dumps(edited))
    assert any("MiniLM cost" in b and "differs" in b for b in check(DOC, raw))
    edited = json.loads(json.dumps(cost))
    edited["candidates"][0]["score_cpu_s"] += 4.0  # the stored projection no longer follows
    with pytest.raises(ValueError, match="projection.cpu"):
        minilm_cost(edited)


def test_amendment_runs_only_when_committed_and_amending_the_registration(tmp_path, monkeypatch):
    """bench/search.py --fresh --amendment FILE: the committed amendment's passes replace the
    registered ones at the registered settings, its commit is recorded; an uncommitted or edited
    amendment, one outside the checkout, one that amends another commit and ``--part`` are refused."""
    import subprocess
    from types import SimpleNamespace

    import bench.search as bs

    d = tmp_path / "docs" / "search"
    d.mkdir(parents=True)
    reg = (ROOT / "docs" / "search" / "preregistration.json").read_text()
    (d / "preregistration.json").write_text(reg)
    monkeypatch.setattr(bs, "ROOT", tmp_path)
    monkeypatch.setattr(bs, "PREREGS", {"zoo8": d / "preregistration.json"})
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "prereg"], check=True)
    registered = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    am = json.loads((ROOT / "docs" / "search" / "preregistration-zoo8-amendment1.json").read_text())
    am["amends"]["commit"] = registered
    f = d / "preregistration-zoo8-amendment1.json"
    f.write_text(json.dumps(am))
    args = SimpleNamespace(testbed="zoo8", part=None, amendment=f)
    with pytest.raises(SystemExit, match="not committed"):
        bs._preregistered(args)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "amendment"], check=True)
    passes = bs._preregistered(args)
    assert passes == [
        ([106, 107, 108, 109], ["lw-nsga2", "ml-nsga2"]),
        (list(range(100, 110)), ["lw-cmaes", "ml-cmaes"]),
    ]
    assert (args.evaluations, args.initial, args.blocks, args.search_windows) == (12, 6, 4, 16)
    assert args.prereg_commit == registered and len(args.amendment_commit) == 40
    assert args.amendment_commit != registered
    with pytest.raises(SystemExit, match="an amendment runs its passes in one process"):
        bs._preregistered(SimpleNamespace(testbed="zoo8", part="1/2", amendment=f))
    outside = tmp_path.parent / "amendment-elsewhere.json"
    outside.write_text(json.dumps(am))
    with pytest.raises(SystemExit, match="not in the checkout"):
        bs._preregistered(SimpleNamespace(testbed="zoo8", part=None, amendment=outside))
    other = d / "preregistration-zoo8-amendment2.json"
    other.write_text(json.dumps(am | {"amends": {"file": "docs/search/preregistration.json", "commit": "0" * 40}}))
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "amendment 2"], check=True)
    with pytest.raises(SystemExit, match="amends docs/search/preregistration.json@0000000000"):
        bs._preregistered(SimpleNamespace(testbed="zoo8", part=None, amendment=other))
    f.write_text(json.dumps(am | {"passes": []}))  # edited after the commit: refused
    with pytest.raises(SystemExit, match="not committed"):
        bs._preregistered(args)


def test_an_amendment_block_applies_the_amendments_family_not_the_registered_one(tmp_path):
    """A raw file collected under an amendment: Holm runs over the amendment's family (the
    registered family's comparisons outside it are left out, one that did not run counts with
    p = 1), the block names the amendment's runs and the registered runs reused, and states the
    registered primary endpoint unchanged instead of re-testing it."""
    from bench.search_report import blocks, load

    path = tmp_path / "raw-toy-amendment1.jsonl.gz"
    _raw(path)
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    meta = json.loads(lines[0])
    runs = [json.loads(x) for x in lines[1:]]
    for r in runs:
        if r["arm"] == "ml-grid":
            r["amendment"] = "a" * 40  # the amendment's runs; lw-bo and ml-bo registered, reused
    meta |= {
        "phase": "amendment",
        "preregistration_commit": "0" * 40,
        "preregistration": {"family": {"comparisons": [["lw-bo", "ml-bo"], ["lw-bo", "ml-grid"]]}},
        "amendment_file": "docs/search/x.json",
        "amendment_commit": "a" * 40,
        "amendment": {"family": {"comparisons": [["lw-bo", "ml-grid"], ["lw-cmaes", "ml-cmaes"]]}},
        "registered_seeds": {"lw-bo": [0, 1, 2, 3], "ml-bo": [0, 1, 2, 3]},
    }
    with gzip.open(path, "wt") as f:
        f.write("\n".join([json.dumps(meta), *map(json.dumps, runs)]) + "\n")
    meta, runs = load(path)
    block = blocks(tmp_path)["toy-amendment1"]
    assert "4 runs of it (ml-grid s0–3), and the registered runs its comparisons need" in block
    assert "(lw-bo s0–3, ml-bo s0–3)" in block
    assert "| lw-bo − ml-grid |" in block and "| lw-bo − ml-bo |" not in block
    assert "| lw-cmaes − ml-cmaes | layer-wise vs model-level, CMA-ES | 0 | held-out HV | not run |" in block
    assert "over the family of these 4 tests" in block
    assert "Primary endpoint" not in block and "primary endpoint (lw-bo − ml-bo, held-out HV) are unchanged" in block
