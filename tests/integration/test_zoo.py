"""Tests of :mod:`mergepipe_zoo` (the offline model zoo of real trained models).

The slow test builds the tiny zoo (a few seconds of CPU training per model) three times:
once into root ``a`` and twice concurrently into root ``b`` (the file lock must make one process
build and the other reuse it); ``a`` and ``b`` must be byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe_zoo.zoo as zoo_mod
from mergepipe_zoo import DOMAINS, Zoo, ZooConfig, build_zoo, check_gates, default_zoo_root, evaluate
from mergepipe_zoo.zoo import ZooGateError

ROOT = Path(__file__).resolve().parents[2]


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _checkpoints(z: Zoo) -> dict[str, Path]:
    return {"base": z.base, **z.experts}


# ---------------------------------------------------------------------------- fast unit tests


def test_import_is_cheap():
    code = "import sys, mergepipe_zoo; print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_config_key_and_validation():
    assert ZooConfig().key() == ZooConfig().key()
    assert len(ZooConfig().key()) == 16
    assert ZooConfig().key() != ZooConfig(seed=1).key() != ZooConfig.tiny().key()
    assert ZooConfig.tiny(seed=3).seed == 3
    assert ZooConfig(n_experts_per_domain=2).expert_names() == [*DOMAINS, *(f"{d}-2" for d in DOMAINS)]
    with pytest.raises(ValueError, match="num_heads"):
        ZooConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="base_steps"):
        ZooConfig(base_steps=-1)
    with pytest.raises(ValueError, match="lr"):
        ZooConfig(lr=0.0)


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "h"))
    assert default_zoo_root() == tmp_path / "h" / "zoo"
    monkeypatch.delenv("MERGEPIPE_HOME")
    assert default_zoo_root() == Path.home() / ".mergepipe" / "zoo"


def test_demo_weights_are_big_enough():
    """Every 2-D weight of the demo model is >= 128 KiB in bf16 (the planner's row-block size)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(zoo_mod._llama_config(ZooConfig()))
    two_d = {k: v for k, v in model.state_dict().items() if v.dim() == 2}
    assert "lm_head.weight" in two_d  # untied
    assert min(v.numel() * 2 for v in two_d.values()) >= 128 * 1024


def test_data_is_deterministic_and_held_out():
    cfg = ZooConfig.tiny()
    a, b = zoo_mod._corpora(cfg), zoo_mod._corpora(cfg)
    assert a == b
    for d in DOMAINS:
        train, held = a[d]
        assert train and held
        assert not set(train) & set(held), d
    # arithmetic problems are partitioned: no held-out problem appears in training
    problems = lambda docs: {ln.split(" : ")[0] for doc in docs for ln in doc.splitlines()}  # noqa: E731
    assert not problems(a["arithmetic"][0]) & problems(a["arithmetic"][1])
    # prose is prose, not code
    assert not any(doc.lstrip().startswith(("import ", "def ", "class ")) for doc in a["prose"][0])


def test_gates_judge_per_expert():
    base = {"python": 4.0, "prose": 4.0, "arithmetic": 1.0, "json": 1.0}
    experts = {
        "python": {"python": 3.0, "prose": 4.1, "arithmetic": 1.1, "json": 1.1},
        "prose": {"python": 4.1, "prose": 3.0, "arithmetic": 1.1, "json": 1.1},
        "arithmetic": {"python": 4.1, "prose": 4.1, "arithmetic": 0.5, "json": 1.1},
        "json": {"python": 4.1, "prose": 4.1, "arithmetic": 1.1, "json": 0.5},
    }
    good = {"python": 3.5, "prose": 3.6, "arithmetic": 0.8, "json": 0.8}
    g = check_gates(base, experts, good)
    assert g["passed"] and g["normalised_gain"] == pytest.approx(
        {"python": 0.5, "prose": 0.4, "arithmetic": 0.4, "json": 0.4}
    )
    # a better mean that leaves one expert's gain behind fails (the mean cannot hide it)
    g = check_gates(base, experts, {**good, "json": 0.9, "python": 3.0})
    assert not g["passed"] and any("expert json" in f for f in g["failures"])
    # an expert that is not the best on its own domain fails
    bad = {**experts, "prose": {**experts["prose"], "python": 2.9}}
    g = check_gates(base, bad, good)
    assert not g["passed"] and any("expert python is not the best" in f for f in g["failures"])
    # a merge worse than the base on the mean fails
    g = check_gates(base, experts, {"python": 3.5, "prose": 3.6, "arithmetic": 0.8, "json": 2.5})
    assert not g["passed"] and any("mean loss" in f for f in g["failures"])


def test_failing_gates_stop_the_build(tmp_path):
    """A zoo whose experts are not fine-tuned (0 steps: each expert is the base) fails the gates:
    the build raises and publishes nothing."""
    pytest.importorskip("torch")
    cfg = ZooConfig.tiny(base_steps=2, expert_steps=0, eval_sequences=2, corpus_chars=40_000, vocab_size=400)
    with pytest.raises(ZooGateError, match="gates failed"):
        build_zoo(tmp_path, cfg)
    assert not (tmp_path / cfg.key()).exists() and not list(tmp_path.glob(f".{cfg.key()}.tmp-*"))


def test_failed_build_leaves_nothing(monkeypatch, tmp_path):
    """A build that dies midway leaves neither a cache entry nor its temp dir."""

    def boom(fn):
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo_mod, "_with_torch_settings", boom)
    cfg = ZooConfig.tiny()
    with pytest.raises(KeyboardInterrupt):
        build_zoo(tmp_path, cfg)
    assert not (tmp_path / cfg.key()).exists()
    assert not list(tmp_path.glob(f".{cfg.key()}.tmp-*"))


# ---------------------------------------------------------------------------- the real build

# cache, lock and byte-identity do not depend on training length: a cheap recipe (no gates)
CHEAP = dict(base_steps=20, expert_steps=4, eval_sequences=4, enforce_gates=False)
_BUILD = """
import sys
from tests.integration.test_zoo import CHEAP
from pathlib import Path
from mergepipe_zoo import ZooConfig, build_zoo
z = build_zoo(Path(sys.argv[1]), ZooConfig.tiny(**CHEAP), log=lambda m: print(m, flush=True))
print("ROOT", z.root)
"""


@pytest.mark.slow
@pytest.mark.timeout(1500)  # one tiny build (620 steps, shared), a merge and 12 evaluations; slow on a loaded machine
def test_tiny_zoo_end_to_end(tmp_path, monkeypatch, capsys, tiny_zoo_home):
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg = ZooConfig.tiny()
    root_a = tiny_zoo_home / "zoo"  # built once per session (conftest.tiny_zoo_home), gates checked then
    z = build_zoo(root_a, cfg)
    assert z.root == root_a / cfg.key() and z.config == cfg
    assert list(z.experts) == list(DOMAINS)
    assert set(z.eval_sets) == set(DOMAINS)
    assert all(p.is_file() and p.stat().st_size > 0 for p in z.eval_sets.values())
    # the calibration set: training text of every domain, none of it held out
    tb = z.testbed
    assert tb.calibration == z.root / "calibration.jsonl"
    cal = [json.loads(line)["text"] for line in tb.calibration.read_text().splitlines()]
    held = {json.loads(line)["text"] for p in z.eval_sets.values() for line in p.read_text().splitlines()}
    assert len(cal) == 4 * zoo_mod.CALIBRATION_DOCS and not set(cal) & held

    # --- files: >= 2 bf16 shards + index + configs + tokenizer in every checkpoint
    for name, ckpt in _checkpoints(z).items():
        shards = sorted(ckpt.glob("*.safetensors"))
        assert len(shards) >= 2, name
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {s.name for s in shards}
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (ckpt / f).is_file(), (name, f)
        tok_conf = json.loads((ckpt / "tokenizer_config.json").read_text())
        assert tok_conf["tokenizer_class"] == "PreTrainedTokenizerFast"
        conf = json.loads((ckpt / "config.json").read_text())
        assert conf["model_type"] == "llama" and conf["tie_word_embeddings"] is False
        assert conf["dtype"] == "bfloat16"
        names = set()
        for s in shards:
            with safe_open(str(s), "pt") as f:
                for k in f.keys():
                    assert f.get_slice(k).get_dtype() == "BF16", (name, k)
                    names.add(k)
        assert names == set(index["weight_map"]) and "lm_head.weight" in names

    # --- loadable with plain transformers; tokenizer round-trips
    model = LlamaForCausalLM.from_pretrained(z.experts["python"], dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == cfg.vocab_size and model.config.num_hidden_layers == cfg.num_layers
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(z.base)
    text = "def f(x):\n    return 37 + 58  # é"
    assert tok.decode(tok(text)["input_ids"]) == text

    # --- evaluate: finite losses; each expert beats the base on its own domain
    losses = {name: evaluate(ckpt, z) for name, ckpt in _checkpoints(z).items()}
    for name, row in losses.items():
        assert set(row) == set(DOMAINS)
        assert all(math.isfinite(v) and v > 0 for v in row.values()), (name, row)
    for d in DOMAINS:
        assert losses[d][d] < losses["base"][d], (d, losses)
    assert evaluate(z.base, z) == losses["base"]  # deterministic

    # --- the gates: recorded at build time, and re-checked here through the product's own
    # task_arithmetic merge (bf16 snapshot, pipeline) rather than the build's in-memory one
    assert z.gates["passed"], z.gates["failures"]
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge

    w = json.loads((z.root / "testbed.json").read_text())["recommended_params"]["task_arithmetic"]["weight"]
    res = merge(
        str(z.base),
        [(n, str(p)) for n, p in z.experts.items()],
        "task_arithmetic",
        str(tmp_path / "ta"),
        [f"weight={w}"],
        catalog=Catalog(tmp_path / "c.sqlite"),
    )
    merged = evaluate(Path(res.out), z)
    g = check_gates(losses["base"], {n: losses[n] for n in z.experts}, merged)
    assert g["passed"], g["failures"]
    assert all(v >= 0.30 for v in g["normalised_gain"].values())

    # --- mergepipe eval prints the same numbers as JSON
    from testkit.harness import run_cli

    capsys.readouterr()
    code, out, err = run_cli(
        ["eval", str(z.experts["json"]), "--testbed", str(z.root), "--tasks", "json,python"], monkeypatch, capsys
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "causal-lm" and list(doc["tasks"]) == ["json", "python"]
    assert doc["tasks"]["json"]["loss"] == losses["json"]["json"]
    assert doc["tasks"]["python"]["loss"] == losses["json"]["python"]
    quick = evaluate(z.base, z, max_batches=1)
    assert set(quick) == set(DOMAINS) and all(math.isfinite(v) for v in quick.values())


@pytest.mark.slow
def test_two_experts_per_domain(tmp_path):
    """``n_experts_per_domain=2`` gives 8 experts; replicas differ (own seed) from the first."""
    cfg = ZooConfig.tiny(n_experts_per_domain=2, base_steps=4, expert_steps=4, eval_sequences=4, enforce_gates=False)
    z = build_zoo(tmp_path, cfg)
    assert list(z.experts) == [*DOMAINS, *(f"{d}-2" for d in DOMAINS)]
    assert z.expert_domain("json-2") == "json" and z.expert_domain("json") == "json"
    for d in DOMAINS:
        a = sorted(z.experts[d].glob("*.safetensors"))
        b = sorted(z.experts[f"{d}-2"].glob("*.safetensors"))
        assert len(a) == len(b) >= 2
        assert [_sha256(p) for p in a] != [_sha256(p) for p in b]
    assert all(math.isfinite(v) for v in evaluate(z.experts["python-2"], z, max_batches=1).values())


@pytest.mark.slow
def test_zoo_cache_lock_and_identical_rebuild(tmp_path):
    """A cached zoo is returned without building; two concurrent builders into one root build once;
    two builds of one config are byte-identical (a cheap recipe: this is about the cache)."""
    import torch

    cfg = ZooConfig.tiny(**CHEAP)
    root_a = tmp_path / "a"
    stale = root_a / f".{cfg.key()}.tmp-999999"  # as left by a killed build
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    z = build_zoo(root_a, cfg)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, det)
    assert not stale.exists()
    # --- second call: cached (no build step runs), nothing rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in z.root.rglob("*")}

    def no_build(*a, **k):
        raise AssertionError("a cached zoo was rebuilt")

    orig, zoo_mod._build_into = zoo_mod._build_into, no_build
    try:
        z2 = build_zoo(root_a, cfg)
    finally:
        zoo_mod._build_into = orig
    assert z2 == z
    assert {p: p.stat().st_mtime_ns for p in z.root.rglob("*")} == mtimes
    assert not list(root_a.glob(f".{cfg.key()}.tmp-*"))

    # --- two concurrent builders into a second root: one builds, the other waits and reuses it
    root_b = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(root_b)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted("building zoo" in o for o in outs) == [False, True], outs
    zb = build_zoo(root_b, cfg)
    assert all(f"ROOT {zb.root}" in o for o in outs)

    # --- byte-identical rebuild (same machine, same config)
    files_a = sorted(p.relative_to(z.root) for p in z.root.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(zb.root) for p in zb.root.rglob("*") if p.is_file())
    assert files_a == files_b
    shards = [f for f in files_a if f.suffix == ".safetensors"]
    assert len(shards) >= 2 * (1 + len(DOMAINS))
    for f in files_a:
        assert _sha256(z.root / f) == _sha256(zb.root / f), f
