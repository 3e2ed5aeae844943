"""bench/search_report.py: every figure of docs/SEARCH.md's search measurement is re-derived from
the committed raw results (issue 27); a changed figure or a changed raw file fails."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("botorch")

ROOT = Path(__file__).resolve().parent.parent


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
    assert "no search-report block" in check(doc, tmp_path)[0]


def test_search_md_matches_the_committed_raw_results():
    from bench.search_report import RAW, check

    raws = sorted(RAW.glob("raw-*.jsonl.gz"))
    assert [p.name for p in raws] == ["raw-zoo8.jsonl.gz"]
    assert all(p.stat().st_size < 4 * 2**20 for p in raws)  # compact: a few MB at most
    assert check() == []
