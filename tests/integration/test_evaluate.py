"""``mergepipe eval``: testbed validation and the classification path on a real (tiny) encoder."""

from __future__ import annotations

import json

import pytest

from mergepipe.errors import InputError
from mergepipe.evaluate import evaluate_checkpoint, load_testbed
from testkit.harness import run_cli


def test_testbed_errors_name_the_field(tmp_path):
    with pytest.raises(InputError, match="no testbed description"):
        load_testbed(tmp_path)
    (tmp_path / "testbed.json").write_text("{not json")
    with pytest.raises(InputError, match="unreadable"):
        load_testbed(tmp_path)
    (tmp_path / "testbed.json").write_text(json.dumps({"kind": "regression", "tasks": {}}))
    with pytest.raises(InputError, match="kind 'regression'"):
        load_testbed(tmp_path)
    (tmp_path / "testbed.json").write_text(json.dumps({"kind": "causal-lm", "seq_len": 8, "tasks": {"a": {}}}))
    with pytest.raises(InputError, match=r"tasks\.a\.probe"):
        load_testbed(tmp_path)
    (tmp_path / "testbed.json").write_text(
        json.dumps({"kind": "sequence-classification", "seq_len": 8, "tasks": {"a": {"probe": "a.jsonl", "head": "h"}}})
    )
    with pytest.raises(InputError, match=r"tasks\.a\.probe = 'a.jsonl' does not exist"):
        load_testbed(tmp_path)


def test_cli_eval_bad_input_exits_2(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["eval", str(tmp_path), "--testbed", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and out == "" and "testbed" in err


def test_cli_eval_a_kind_no_plugin_scores_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "testbed.json").write_text(json.dumps({"kind": "regression", "tasks": {}}))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    code, out, err = run_cli(["eval", str(tmp_path / "m"), "--testbed", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and out == "" and "kind 'regression'" in err and "no installed plugin" in err
    (tmp_path / "testbed.json").write_text(json.dumps({"kind": 3}))
    code, out, err = run_cli(["eval", str(tmp_path / "m"), "--testbed", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and "kind must be a string" in err


def test_classification_accuracy_with_the_tasks_head(tmp_path, monkeypatch, capsys):
    """A tiny BERT encoder and a head that reads one pooled feature: accuracy and loss are what
    the head's logits give on the probe set, and the CLI prints them as JSON."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "good": 4, "bad": 5, "day": 6}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")
    hf.save_pretrained(tmp_path / "tokenizer")
    torch.manual_seed(0)
    enc = BertModel(
        BertConfig(
            vocab_size=7,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            max_position_embeddings=16,
        ),
        add_pooling_layer=False,
    )
    enc.eval()
    enc.save_pretrained(tmp_path / "enc")
    texts = ["good day", "bad day", "good good", "bad bad day"]
    (tmp_path / "probe.jsonl").write_text(
        "".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts))
    )
    W = torch.zeros(2, 8)
    W[1, 0] = 1.0  # class 1 iff pooled feature 0 > 0
    save_file({"weight": W, "bias": torch.zeros(2)}, str(tmp_path / "head.safetensors"))
    (tmp_path / "testbed.json").write_text(
        json.dumps(
            {
                "format": 1,
                "kind": "sequence-classification",
                "tokenizer": "tokenizer",
                "seq_len": 8,
                "batch_size": 3,
                "tasks": {"t": {"probe": "probe.jsonl", "head": "head.safetensors"}},
            }
        )
    )
    # expected, computed directly
    with torch.no_grad():
        feats = []
        for t in texts:
            ids = hf(t, return_tensors="pt")
            feats.append(enc(**ids).last_hidden_state.mean(1)[0])
        logits = torch.stack(feats) @ W.T
        y = torch.tensor([0, 1, 0, 1])
        acc = float((logits.argmax(-1) == y).float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits, y))
    r = evaluate_checkpoint(tmp_path / "enc", tmp_path)
    assert r["t"]["n"] == 4
    assert r["t"]["accuracy"] == pytest.approx(acc)
    assert r["t"]["loss"] == pytest.approx(loss, rel=1e-5)
    # per item (the probe-set bootstrap's unit): one hit per example, in order
    ri = evaluate_checkpoint(tmp_path / "enc", tmp_path, per_item=True)
    assert ri["t"]["items"] == (logits.argmax(-1) == y).int().tolist() and "items" not in r["t"]
    code, out, err = run_cli(
        ["eval", str(tmp_path / "enc"), "--testbed", str(tmp_path), "--tasks", "t"], monkeypatch, capsys
    )
    assert code == 0, err
    assert json.loads(out)["tasks"]["t"]["accuracy"] == pytest.approx(acc)
    code, out, err = run_cli(
        ["eval", str(tmp_path / "enc"), "--testbed", str(tmp_path), "--tasks", "nope"], monkeypatch, capsys
    )
    assert code == 2 and "unknown task" in err


def test_causal_lm_per_window_losses():
    """per_item: each window's mean next-token loss, in order; their mean is the task loss (every
    window predicts seq_len - 1 tokens), across batch boundaries."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergepipe.evaluate import causal_lm_losses

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    w = {"a": torch.randint(0, 50, (5, 9))}
    r = causal_lm_losses(model, w, batch_size=2, per_item=True)
    items = r["a"]["items"]
    assert len(items) == 5 and r["a"]["n"] == 40
    assert sum(items) / 5 == pytest.approx(r["a"]["loss"], rel=1e-9)
    with torch.no_grad():
        for i in range(5):
            lg = model(input_ids=w["a"][i : i + 1]).logits.float()
            want = float(torch.nn.functional.cross_entropy(lg[0, :-1], w["a"][i, 1:]))
            assert items[i] == pytest.approx(want, rel=1e-5)
    assert "items" not in causal_lm_losses(model, w, batch_size=2)["a"]
