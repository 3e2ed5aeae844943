"""Merged vocabularies (mergekit's ``tokenizer_source``, ``tokenizer:`` block, ``chat_template``)
against mergekit 0.1.5 itself, on tiny real Llamas whose experts add different chat tokens."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergepipe.config import load_config  # noqa: E402
from mergepipe.errors import InputError  # noqa: E402
from testkit.harness import merged_tensors, same_bits  # noqa: E402
from testkit.mergekit_run import _mergekit, _ours, _write  # noqa: E402

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """base (the BPE vocabulary's ``n`` tokens in 300 embedding rows), ``a`` adding
    ``<|im_start|>``/``<|im_end|>`` (ids n, n+1) with a chat template, ``b`` adding ``<tool>``
    (id n); float32, 2 layers. ``n`` is under key ``"n"``."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from testkit.tiny_llm import bpe_tokenizer, tiny_llama_config

    root = tmp_path_factory.mktemp("vocab")
    raw = bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20)
    cfg = tiny_llama_config()
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    out = {}
    for name, scale, added in (("base", 0.0, []), ("a", 0.02, ["<|im_start|>", "<|im_end|>"]), ("b", 0.03, ["<tool>"])):
        m = LlamaForCausalLM(cfg)
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            for q in m.parameters():
                q.add_(scale * torch.randn_like(q))
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        if added:
            tok.add_tokens(added, special_tokens=True)
        if name == "a":
            tok.chat_template = TEMPLATE
        m.save_pretrained(root / name, max_shard_size="40KB")
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
        out.setdefault("n", len(raw.get_vocab()))
    return out


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home"))


def _cfg(m, **extra):
    return {
        "models": [
            {"model": m["base"]},
            {"model": m["a"], "parameters": {"weight": 0.6, "density": 0.5}},
            {"model": m["b"], "parameters": {"weight": 0.4, "density": 0.5}},
        ],
        "merge_method": "ties",
        "base_model": m["base"],
        "dtype": "float32",
        **extra,
    }


def test_union_with_added_tokens_matches_mergekit(family, tmp_path):
    """tokenizer_source: union over experts with different added tokens, chat_template: auto:
    every tensor bit-identical to mergekit 0.1.5, token by token (embed_tokens and lm_head
    re-indexed to the n + 3 output tokens, each added token's row from the one expert that has
    it), the same vocabulary and chat template, and the output loads in transformers and encodes
    the added tokens."""
    p = _write(tmp_path, _cfg(family, tokenizer_source="union", chat_template="auto"))
    ref = _mergekit(p, tmp_path / "mk")
    res, got = _ours(tmp_path, p, tmp_path / "out")
    n = family["n"]
    assert set(got) == set(ref) and got["model.embed_tokens.weight"].shape == (n + 3, 32)
    out = tmp_path / "out"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    mk_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "mk")
    # mergekit orders the union's added tokens by iterating a set of models (hash order, varies
    # from run to run); mergepipe by the config's model order. Compare rows token by token.
    ours, theirs = tok.get_vocab(), mk_tok.get_vocab()
    assert set(ours) == set(theirs) and len(ours) == n + 3
    order = torch.tensor([theirs[t] for t, _ in sorted(ours.items(), key=lambda kv: kv[1])])
    for k in ref:
        r = ref[k][order] if k in ("lm_head.weight", "model.embed_tokens.weight") else ref[k]
        assert same_bits(got[k], r), k
    assert [ours[t] for t in ("<|im_start|>", "<|im_end|>", "<tool>")] == [n, n + 1, n + 2]  # config order
    assert json.loads((out / "config.json").read_text())["vocab_size"] == n + 3
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    ids = tok.encode("<|im_start|>the<tool><|im_end|>", add_special_tokens=False)
    assert ids[0] == n and ids[-2:] == [n + 2, n + 1]
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert torch.isfinite(model(torch.tensor([ids])).logits).all()
    # <tool> only b has: its row is b's own row 283 in every view, so the merge leaves it b's
    b = merged_tensors(family["b"])["model.embed_tokens.weight"]
    assert same_bits(got["model.embed_tokens.weight"][n + 2], b[n])
    # a budget: the experts' rows (their added tokens' included) are budgeted blocks like any other
    res, _ = _ours(tmp_path, p, tmp_path / "budget", budget="50%")
    io = res.manifest["io"]
    assert 0 < io["realized"]["expert_read_bytes"] <= io["estimated"]["expert_read_bytes"] <= io["expert_budget_bytes"]


def test_tokenizer_block_sources_force_and_padding_match_mergekit(family, tmp_path):
    """The tokenizer: block: base vocabulary plus <tool> taken from b, <|im_start|> forced to
    zero, padded to a multiple of 64 (pad rows: each model's mean row): equal to mergekit
    0.1.5 (bit for bit outside the pad rows, float32 rounding there)."""
    tk = {
        "source": "base",
        "tokens": {"<tool>": {"source": family["b"]}, "<|im_start|>": {"source": {"kind": "zero"}, "force": True}},
        "pad_to_multiple_of": 64,
    }
    p = _write(tmp_path, _cfg(family, tokenizer=tk))
    ref = _mergekit(p, tmp_path / "mk")
    _, got = _ours(tmp_path, p, tmp_path / "out")
    n = family["n"]
    padded = -(-(n + 2) // 64) * 64
    assert set(got) == set(ref) and got["lm_head.weight"].shape == (padded, 32)
    for k in ref:
        if k in ("lm_head.weight", "model.embed_tokens.weight"):
            assert same_bits(got[k][: n + 2], ref[k][: n + 2]), k
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7)
        else:
            assert same_bits(got[k], ref[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == padded


def test_base_tokenizer_crops_experts_with_added_tokens(family, tmp_path):
    """tokenizer_source: base with experts whose vocabularies are larger: no longer refused; the
    output has the base's n tokens and its tokenizer files."""
    p = _write(tmp_path, _cfg(family, tokenizer_source="base"))
    _, got = _ours(tmp_path, p, tmp_path / "out")
    assert got["model.embed_tokens.weight"].shape == (family["n"], 32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(tok) == family["n"]


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            {"tokenizer_source": "union", "tokenizer": {"source": "union"}},
            r"give either tokenizer_source or a tokenizer",
        ),
        ({"tokenizer": {"source": "union", "padding": 8}}, r"tokenizer\.padding: unknown key"),
        ({"chat_template": "{x}"}, r"chat_template: not a chat template"),
        (
            {"tokenizer": {"tokens": {"<x>": {"source": {"kind": "model_token", "model": "."}}}}},
            r"tokenizer\.tokens\['<x>'\]\.source\.model: .* is not an input model of the merge",
        ),
        (
            {
                "merge_method": "passthrough",
                "models": None,
                "base_model": None,
                "slices": [{"sources": [{"model": ".", "layer_range": [0, 1]}]}],
                "tokenizer_source": "union",
            },
            r"tokenizer: a merged vocabulary together with slices is not supported",
        ),
    ],
)
def test_tokenizer_refusals_name_the_key(family, tmp_path, extra, match):
    import re

    cfg = {k: v for k, v in _cfg(family, **extra).items() if v is not None}
    if "slices" in cfg:
        cfg["slices"][0]["sources"][0]["model"] = family["a"]
    p = _write(tmp_path, cfg)
    with pytest.raises(InputError) as ei:
        load_config(p)
    assert str(ei.value).startswith(str(p)) and re.search(match, str(ei.value)), str(ei.value)
