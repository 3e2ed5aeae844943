"""The MiniLM testbed's tasks (mergepipe_zoo.minilm): deterministic, balanced, held out."""

from __future__ import annotations

from collections import Counter

import pytest

from mergepipe_zoo.minilm import TASKS, TOPICS, MiniLMConfig, make_tasks


@pytest.mark.slow
def test_tasks_are_deterministic_balanced_and_held_out():
    cfg = MiniLMConfig(train_examples=64, eval_examples=32)
    a = make_tasks(cfg)
    assert a == make_tasks(cfg)
    assert make_tasks(MiniLMConfig(train_examples=64, eval_examples=32, seed=1)) != a
    assert list(a) == list(TASKS)
    for task, (train, held) in a.items():
        assert (len(train), len(held)) == (64, 32), task
        n_classes = len(TOPICS) if task == "topic" else 2
        for split in (train, held):
            counts = Counter(e["label"] for e in split)
            assert sorted(counts) == list(range(n_classes)), task
            assert max(counts.values()) - min(counts.values()) <= 1, (task, counts)
        assert not {e["text"] for e in train} & {e["text"] for e in held}, task
    # next: every example is a pair
    assert all(" [SEP] " in e["text"] for e in a["next"][0] + a["next"][1])
