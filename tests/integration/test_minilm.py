"""The MiniLM testbed's tasks (mergepipe_zoo.minilm): deterministic, balanced, held out."""

from __future__ import annotations

from collections import Counter

import pytest

from mergepipe_zoo.minilm import TASKS, MiniLMConfig, make_tasks


@pytest.mark.slow
def test_tasks_are_deterministic_balanced_and_held_out():
    cfg = MiniLMConfig(train_examples=64, eval_examples=32)
    a = make_tasks(cfg)
    assert a == make_tasks(cfg)
    assert make_tasks(MiniLMConfig(train_examples=64, eval_examples=32, seed=1)) != a
    assert list(a) == list(TASKS)
    for task, (train, held) in a.items():
        assert (len(train), len(held)) == (64, 32), task
        for split in (train, held):
            counts = Counter(e["label"] for e in split)
            assert sorted(counts) == [0, 1], task
            assert max(counts.values()) - min(counts.values()) <= 1, (task, counts)
        assert not {e["text"] for e in train} & {e["text"] for e in held}, task
    # order: an original is a sentence as written; shuffled examples are never one of the originals
    originals = {e["text"] for e in a["order"][0] if e["label"] == 1}
    assert all(t.split()[0][0].isupper() and t[-1] in ".!?" for t in originals)
    assert not originals & {e["text"] for e in a["order"][0] if e["label"] == 0}
    # the calibration set (Fisher statistic): training texts of every task, never held-out ones
    from mergepipe_zoo.minilm import calibration_texts

    cal = calibration_texts(a, per_task=12)
    train = {e["text"] for t in TASKS for e in a[t][0]}
    held = {e["text"] for t in TASKS for e in a[t][1]}
    assert len(cal) == 12 * len(TASKS) and set(cal) <= train and not set(cal) & held
    # match: a copy repeats segment A exactly; "other" pairs two different sentences
    for e in a["match"][0] + a["match"][1]:
        first, second = e["text"].split(" [SEP] ")
        assert (first == second) == (e["label"] == 1), e
    # rotate: an original is a sentence as written (capitalised, ends in . ! ?); a rotated example
    # is not, and one rotation by 2..n-2 words turns it back into one
    for e in a["rotate"][0] + a["rotate"][1]:
        w = e["text"].split()
        is_sentence = w[0][0].isupper() and w[-1][-1] in ".!?"
        if e["label"] == 1:
            assert is_sentence, e
        else:
            back = [w[k:] + w[:k] for k in range(2, len(w) - 1)]
            assert any(b[0][0].isupper() and b[-1][-1] in ".!?" for b in back), e


def test_every_recipe_field_and_the_format_enter_the_cache_key():
    """A changed recipe or testbed format gets a new cache entry, never an old entry's weights."""
    import dataclasses

    from mergepipe_zoo import minilm

    base = MiniLMConfig()
    keys = {base.key()}
    for f in dataclasses.fields(MiniLMConfig):
        v = getattr(base, f.name)
        keys.add(dataclasses.replace(base, **{f.name: v * 2 if v else 1}).key())
    assert len(keys) == 1 + len(dataclasses.fields(MiniLMConfig))
    old = minilm.FORMAT
    try:
        minilm.FORMAT = old + 1
        assert base.key() not in keys
    finally:
        minilm.FORMAT = old
