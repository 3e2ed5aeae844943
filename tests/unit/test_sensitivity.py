"""The base's Fisher sensitivity in the catalog and the planner's ``fisher`` block value, on a
real (tiny, randomly initialised) transformers Llama with a real BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergepipe.catalog.catalog import Catalog  # noqa: E402
from mergepipe.catalog.sensitivity import load_calibration  # noqa: E402
from mergepipe.errors import InputError  # noqa: E402
from mergepipe.formats.safetensors import rows_per_block  # noqa: E402
from mergepipe.pipeline import build_plan, register_and_analyze  # noqa: E402
from mergepipe.request import request_from_args  # noqa: E402
from mergepipe.storage.base import IOCounters  # noqa: E402
from mergepipe.storage.local import LocalStorage  # noqa: E402

TEXT = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n# the value of f{i} grows with x" for i in range(200)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from testkit.tiny_llm import tiny_llama_family

    root = tmp_path_factory.mktemp("sens")
    paths, model, tok = tiny_llama_family(root, TEXT, (("base", 0.0), ("e1", 0.01), ("e2", 0.02)))
    cal = root / "cal.jsonl"
    cal.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT[:60]))
    cal2 = root / "cal2.jsonl"
    cal2.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT[100:160]))
    return paths, cal, cal2, model, tok


def _direct_fisher(model, tok, texts, seq_len, max_seq, name):
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids + [2])
    n = min(len(ids) // seq_len, max_seq)
    x = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    p = dict(model.named_parameters())[name]
    acc = torch.zeros_like(p, dtype=torch.float64)
    for i in range(n):
        model.zero_grad()
        model(input_ids=x[i : i + 1], labels=x[i : i + 1]).loss.backward()
        acc += p.grad.double() ** 2
    return acc / n


@pytest.mark.slow
def test_fisher_recorded_once_and_matches_a_direct_computation(tiny, tmp_path, monkeypatch):
    paths, cal, cal2, model, tok = tiny
    st = LocalStorage(IOCounters())
    cat = Catalog(tmp_path / "c.sqlite")
    bb = 4096
    base, _recs, _ = register_and_analyze(
        cat, st, str(paths["base"]), [str(paths["e1"]), str(paths["e2"])], bb, calibration=str(cal)
    )
    c = load_calibration(st, str(cal))
    f = cat.find_sensitivity(base.identity, c.digest, bb)
    assert f is not None and set(f) == {n for n, _ in model.named_parameters()}
    name = "model.layers.1.mlp.down_proj.weight"
    bt = base.layout.tensors[name]
    want = _direct_fisher(model, tok, TEXT[:60], c.seq_len, c.max_sequences, name).reshape(bt.rows, -1)
    rpb = rows_per_block(bt, bb)
    blocks = [want[i : i + rpb].mean().item() for i in range(0, bt.rows, rpb)]
    np.testing.assert_allclose(f[name], blocks, rtol=1e-4)
    assert (f[name] > 0).all()

    # cached: a second analyze (and a plan) do not compute it again
    import mergepipe.catalog.sensitivity as sens

    monkeypatch.setattr(sens, "compute_fisher", lambda *a, **k: pytest.fail("Fisher recomputed"))
    register_and_analyze(cat, st, str(paths["base"]), [str(paths["e1"])], bb, calibration=str(cal))
    experts = [("e1", str(paths["e1"])), ("e2", str(paths["e2"]))]
    pf = build_plan(
        cat,
        st,
        request_from_args(str(paths["base"]), experts, "ties", ["density=0.5"], budget="30%").with_planning(
            block_bytes=bb, value="fisher", calibration=str(cal)
        ),
    )
    pe = build_plan(
        cat,
        st,
        request_from_args(str(paths["base"]), experts, "ties", ["density=0.5"], budget="30%").with_planning(
            block_bytes=bb
        ),
    )
    assert pf.block_value == {"kind": "fisher", "calibration": c.digest}
    # with a calibration set and no --value, the plan is the Fisher-valued one (the default)
    pd = build_plan(
        cat,
        st,
        request_from_args(str(paths["base"]), experts, "ties", ["density=0.5"], budget="30%").with_planning(
            block_bytes=bb, calibration=str(cal)
        ),
    )
    assert pd.digest == pf.digest
    assert pe.block_value is None and pf.digest != pe.digest
    assert pf.io.expert_read_bytes <= pf.budget_bytes
    # the calibration set's identity is part of the key: other text, another statistic
    monkeypatch.undo()
    pf2 = build_plan(
        cat,
        st,
        request_from_args(str(paths["base"]), experts, "ties", ["density=0.5"], budget="30%").with_planning(
            block_bytes=bb, value="fisher", calibration=str(cal2)
        ),
    )
    c2 = load_calibration(st, str(cal2))
    assert c2.digest != c.digest and pf2.block_value["calibration"] == c2.digest
    assert cat.find_sensitivity(base.identity, c2.digest, bb) is not None


def test_calibration_errors(tiny, tmp_path):
    paths, _, _, _, _ = tiny
    st = LocalStorage(IOCounters())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(InputError, match="line 2"):
        load_calibration(st, str(bad))
    with pytest.raises(InputError, match="cannot read"):
        load_calibration(st, str(tmp_path / "missing.jsonl"))
    cat = Catalog(tmp_path / "c.sqlite")
    with pytest.raises(InputError, match="--calibration"):
        build_plan(
            cat,
            st,
            request_from_args(str(paths["base"]), [("e1", str(paths["e1"]))], "ties", ["density=0.5"]).with_planning(
                value="fisher"
            ),
        )


def test_cli_value_fisher_without_calibration_exits_2(tiny, tmp_path, monkeypatch, capsys):
    from testkit.harness import run_cli

    paths, _, _, _, _ = tiny
    code, out, err = run_cli(
        [
            "plan",
            "--base",
            str(paths["base"]),
            "--expert",
            str(paths["e1"]),
            "--method",
            "ties",
            "--value",
            "fisher",
            "--catalog",
            str(tmp_path / "c.sqlite"),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and "--calibration" in err and out == ""


@pytest.mark.slow
def test_encoder_fisher_is_the_gaussian_output_fisher_and_plans_within_budget(tmp_path):
    """A real encoder (all-MiniLM-L6-v2, BertModel): the recorded statistic is the block mean of
    ``(J^T eps)^2`` averaged over the calibration sentences (eps the seeded per-sequence probe),
    checked against a direct computation; the pooler, unused by mean pooling, gets 0; the
    ``fisher`` plan stays within its budget and differs from the energy plan."""
    from mergepipe.catalog.sensitivity import compute_fisher
    from testkit.minilm import make_minilm_family

    base_dir, experts = make_minilm_family(tmp_path / "m", n_experts=2)
    cal = tmp_path / "cal.jsonl"
    sents = [
        "Return the message body as a string, decoding it when needed.",
        "The event loop runs coroutines until they complete.",
        "Create a new toplevel window with a title bar.",
        "Parse the header block of an email and return a dictionary.",
    ]
    cal.write_text("".join(json.dumps({"text": s}) + "\n" for s in sents))
    st = LocalStorage(IOCounters())
    cat = Catalog(tmp_path / "c.sqlite")
    bb = 64 * 1024
    base = cat.register(st, str(base_dir))
    c = load_calibration(st, str(cal), seq_len=32, max_sequences=4)
    f = compute_fisher(st, base, c, bb)

    from tokenizers import Tokenizer
    from transformers import AutoModel

    model = AutoModel.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=32)
    probes = torch.randn(4, 384, generator=torch.Generator().manual_seed(int(c.digest[:15], 16)))
    name = "encoder.layer.3.intermediate.dense.weight"
    p = dict(model.named_parameters())[name]
    acc = torch.zeros_like(p, dtype=torch.float64)
    for i, s in enumerate(sents):
        x = torch.tensor([tok.encode(s).ids])
        model.zero_grad()
        (model(input_ids=x).last_hidden_state[0].mean(0) * probes[i]).sum().backward()
        acc += p.grad.double() ** 2
    bt = base.layout.tensors[name]
    want = (acc / 4).reshape(bt.rows, -1)
    rpb = rows_per_block(bt, bb)
    np.testing.assert_allclose(f[name], [want[i : i + rpb].mean().item() for i in range(0, bt.rows, rpb)], rtol=1e-4)
    assert (f[name] > 0).all()
    assert not f["pooler.dense.weight"].any()
    # word-embedding rows of tokens the sentences lack get nothing, the others something
    wf = f["embeddings.word_embeddings.weight"]
    assert (wf == 0).any() and (wf > 0).any()

    register_and_analyze(cat, st, str(base_dir), [str(e) for e in experts], bb, calibration=str(cal))
    ex = [(f"e{i}", str(e)) for i, e in enumerate(experts)]
    req = request_from_args(str(base_dir), ex, "task_arithmetic", ["weight=0.5"], budget="20%")
    pf = build_plan(cat, st, req.with_planning(block_bytes=bb, value="fisher", calibration=str(cal)))
    pe = build_plan(cat, st, req.with_planning(block_bytes=bb, value="energy"))
    assert pf.io.expert_read_bytes <= pf.budget_bytes and pe.io.expert_read_bytes <= pe.budget_bytes
    assert pf.block_value["kind"] == "fisher" and pf.digest != pe.digest


def test_search_candidates_are_planned_with_the_fisher_value(tiny, tmp_path):
    """``mergepipe search --value fisher --calibration FILE`` (SearchConfig.value/calibration):
    every candidate's committed snapshot is the Fisher-valued plan of its settings, not the
    energy-valued one; ``fisher`` without a calibration set is refused before anything is read."""
    from mergepipe.request import PlanningOptions
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import SearchConfig, run_search

    paths, cal, _, _, _ = tiny

    def cfg(**kw):
        return SearchConfig(
            base=str(paths["base"]),
            experts=[["e1", str(paths["e1"])], ["e2", str(paths["e2"])]],
            method="ties",
            fixed={"parameters": {"density": 0.5}},
            vary=["weight=0:1"],
            objectives=["a"],
            evaluations=2,
            initial=2,
            layer_blocks=1,
            budget="30%",
            strategy="random",
            catalog=str(tmp_path / "cat.sqlite"),
            **kw,
        )

    with pytest.raises(InputError, match="--value fisher needs --calibration"):
        cfg(planning=PlanningOptions(value="fisher")).check()
    c = cfg(planning=PlanningOptions(value="fisher", calibration=str(cal)))
    res = run_search(tmp_path / "s", c, CallableEvaluator(lambda p: {"a": 1.0}))
    assert res["failed"] == 0
    cat, st = Catalog(tmp_path / "cat.sqlite"), LocalStorage(IOCounters())
    state = json.loads((tmp_path / "s" / "state.json").read_text())
    for cand in state["candidates"]:
        req = c.request(cand["params"])
        assert req.planning == c.planning  # the candidate's request carries the search's planning options
        fisher = build_plan(cat, st, req)
        energy = build_plan(cat, st, req.with_planning(value="energy", calibration=None))
        man = json.loads((Path(cand["snapshot"]) / "manifest.json").read_text())
        assert fisher.digest != energy.digest and man["plan_digest"] == fisher.digest
