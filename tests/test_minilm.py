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


@pytest.mark.slow
def test_an_entry_built_before_the_calibration_set_gets_it_in_place(tmp_path):
    """build_minilm brings an older cache entry (no tokenizer in base/, no calibration.jsonl) up to
    date without retraining: the Fisher statistic needs base/tokenizer.json, the planner a
    calibration set of training text (never held-out text)."""
    import json
    import shutil

    from mergepipe.evaluate import load_testbed
    from mergepipe_zoo.minilm import CALIBRATION, build_minilm, minilm_folder

    cfg = MiniLMConfig(train_examples=64, eval_examples=32)
    entry = tmp_path / cfg.key()
    (entry / "base").mkdir(parents=True)
    (entry / "tokenizer").mkdir()
    (entry / "eval").mkdir()
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_folder() / f, entry / "tokenizer" / f)
    tasks = make_tasks(cfg)
    for t, (_, held) in tasks.items():
        (entry / "eval" / f"{t}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in held))
    meta = {
        "format": 1,
        "kind": "causal-lm",
        "seq_len": 40,
        "tasks": {t: {"probe": f"eval/{t}.jsonl"} for t in TASKS},
    }
    (entry / "testbed.json").write_text(json.dumps(meta))
    tb = build_minilm(tmp_path, cfg)
    assert tb.root == entry and (entry / "base" / "tokenizer.json").is_file()
    cal = [json.loads(line)["text"] for line in (entry / CALIBRATION).read_text().splitlines()]
    train = {e["text"] for t in TASKS for e in tasks[t][0]}
    held = {e["text"] for t in TASKS for e in tasks[t][1]}
    assert len(cal) == 36 and set(cal) <= train and not set(cal) & held
    assert load_testbed(entry).calibration == entry / CALIBRATION
    assert json.loads((entry / "testbed.json").read_text())["tasks"] == meta["tasks"]  # the rest unchanged


def test_recipe_fields_added_later_keep_the_keys_of_existing_entries():
    """probe_l2 and epochs enter the cache key only when set: entries built with format 1 keep
    their keys; a changed recipe gets a new entry."""
    import hashlib
    import json
    from dataclasses import asdict

    from mergepipe_zoo.minilm import FORMAT

    for cfg in (MiniLMConfig(), MiniLMConfig(seed=2)):
        old = {k: v for k, v in asdict(cfg).items() if k not in ("probe_l2", "epochs")}
        blob = json.dumps({"format": FORMAT, **old}, sort_keys=True)
        assert cfg.key() == hashlib.sha256(blob.encode()).hexdigest()[:16]
    keys = {MiniLMConfig().key(), MiniLMConfig(probe_l2=1e-2).key(), MiniLMConfig(epochs=2).key()}
    assert len(keys) == 3
