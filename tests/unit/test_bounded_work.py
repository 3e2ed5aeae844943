"""Bounded work for every crafted input (issue 22): hostile LoRA pattern keys, analysis zip
bombs on the object catalog, and one rule for non-finite weights on both catalogs."""

import io
import json
import time
import zipfile
from pathlib import Path

import pytest

from mergepipe.errors import InputError
from testkit.harness import run_cli


def _adapter_config(**kw) -> bytes:
    d = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **kw}
    return json.dumps(d).encode()


@pytest.mark.timeout(30)
def test_hostile_rank_pattern_matches_in_linear_time():
    """``(.+.+)+X`` backtracks exponentially in Python's ``re`` (a 30-character module name
    takes hours); RE2 answers at once, with PEFT's result."""
    from mergepipe.lora import parse_adapter_config

    cfg = parse_adapter_config(
        _adapter_config(rank_pattern={"(.+.+)+X": 2, "q_proj": 8}, alpha_pattern={"(a|aa)+$": 3}), "cfg"
    )
    module = "model.layers.0.self_attn." + "a" * 40
    t0 = time.perf_counter()
    for _ in range(100):
        assert cfg.rank_alpha(module) == (4, 3.0)  # the a-run matches (a|aa)+$ for alpha
    assert cfg.rank_alpha("model.layers.0.self_attn.q_proj") == (8, 8.0)  # PEFT's suffix rule
    assert cfg.rank_alpha("model.layers.0.self_attn.q_projX") == (2, 8.0)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize(
    "key, why",
    [
        (r"(a)\1", "no backreferences"),
        (r"q(?=_proj)", "no backreferences or lookaround"),
        ("(", "missing"),
        ("x" * 2000, "longer than 1024"),
    ],
)
def test_pattern_keys_outside_re2_are_refused_in_one_line(key, why, capfd):
    from mergepipe.lora import parse_adapter_config

    with pytest.raises(InputError, match="rank_pattern") as ei:
        parse_adapter_config(_adapter_config(rank_pattern={key: 2}), "adapter_config.json")
    assert why in str(ei.value) and "\n" not in str(ei.value)
    assert capfd.readouterr().err == ""  # RE2 logs nothing of its own


def test_same_module_with_and_without_prefix_is_refused(tmp_path):
    from mergepipe.formats.safetensors import TensorInfo
    from mergepipe.lora import adapter_modules, parse_adapter_config

    cfg = parse_adapter_config(_adapter_config(), "cfg")

    def t(name, shape):
        return TensorInfo(name=name, dtype="F32", shape=shape, file="adapter_model.safetensors", start=0, end=0)

    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": t("base_model.model.layers.0.q_proj.lora_A.weight", (4, 8)),
        "base_model.model.layers.0.q_proj.lora_B.weight": t("base_model.model.layers.0.q_proj.lora_B.weight", (8, 4)),
        "layers.0.q_proj.lora_A.weight": t("layers.0.q_proj.lora_A.weight", (4, 8)),
        "layers.0.q_proj.lora_B.weight": t("layers.0.q_proj.lora_B.weight", (8, 4)),
    }
    with pytest.raises(InputError, match="are both lora_A of module 'layers.0.q_proj'"):
        adapter_modules(cfg, tensors, "adapter_model.safetensors")


def _objects_catalog_with_analysis(family, tmp_path):
    from mergepipe.catalog.objectstore import open_catalog
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    base, experts = family
    loc = "objects:" + str(tmp_path / "index")
    cat = open_catalog(loc)
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    e = cat.register(st, str(experts[0]))
    cat.analyze(st, b, [e], block_bytes=4096)
    obj = Path(cat._analysis_uri(b.identity, e.identity, 4096))
    assert obj.is_file()
    return loc, base, experts, obj


def test_analysis_zip_bomb_is_refused_before_inflating(family, tmp_path, monkeypatch, capsys):
    """A 0.3 MB analysis object that would inflate to 300 MB: refused from the zip directory,
    in one line naming the object and the fix; RSS does not grow by the inflated size."""
    import psutil

    loc, base, experts, obj = _objects_catalog_with_analysis(family, tmp_path)
    good = obj.read_bytes()
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("meta.json", src.read("meta.json"))
        z.writestr("t/0", b"\0" * (300 << 20))
    assert len(buf.getvalue()) < 1 << 20
    obj.write_bytes(buf.getvalue())
    rss0 = psutil.Process().memory_info().rss
    args = ["plan", "--base", str(base), "--expert", str(experts[0]), "--method", "ties", "-p", "density=0.5"]
    code, _, err = run_cli([*args, "--block-size", "4096", "--catalog", loc], monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "zip bomb" in err and str(obj) in err and "analyze --force" in err
    assert psutil.Process().memory_info().rss - rss0 < 200 << 20
    # the advice works: analyze --force replaces the object
    code, _, err = run_cli(
        [
            "analyze",
            "--base",
            str(base),
            "--expert",
            str(experts[0]),
            "--block-size",
            "4096",
            "--force",
            "--catalog",
            loc,
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    code, _, err = run_cli([*args, "--block-size", "4096", "--catalog", loc], monkeypatch, capsys)
    assert code == 0, err


@pytest.mark.parametrize("members", [0, 3])
def test_analysis_zip_with_other_content_is_one_line(family, tmp_path, members):
    from mergepipe.catalog.objectstore import read_analysis_zip

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(members):
            z.writestr(f"x{i}", b"{}")
    for data in (b"not a zip", buf.getvalue()):
        with pytest.raises(InputError, match="not a valid analysis object") as ei:
            read_analysis_zip(data, "s3://cat/analyses/a/b/4096-v4.zip")
        assert "\n" not in str(ei.value)


@pytest.mark.parametrize("catalog", ["sqlite", "objects"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_expert_is_refused_at_analyze_on_both_catalogs(tmp_path, monkeypatch, capsys, catalog, value):
    """One rule on both catalogs: a NaN or ±Inf in an expert is refused at analyze, naming the
    tensor and the count; no analysis, no sketch blob, no temporary file remains."""
    import torch
    from safetensors.torch import load_file, save_file

    from testkit.synth import make_family

    base, experts = make_family(tmp_path / "fam", 1, seed=3)
    shard = sorted(experts[0].glob("*.safetensors"))[0]
    ts = load_file(str(shard))
    name = next(n for n, t in ts.items() if t.dim() == 2)
    ts[name].view(-1)[[3, 17, 40]] = float(value)
    save_file(ts, str(shard), metadata={"format": "pt"})
    loc = str(tmp_path / "c.sqlite") if catalog == "sqlite" else "objects:" + str(tmp_path / "index")
    if catalog == "objects":
        (tmp_path / "index").mkdir()
    args = ["analyze", "--base", str(base), "--expert", str(experts[0]), "--block-size", "4096", "--catalog", loc]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1 and f"{name!r}" in line[0] and "3 non-finite value(s)" in line[0], err
    root = tmp_path if catalog == "sqlite" else tmp_path / "index"
    assert not [p for p in root.rglob("*") if p.is_file() and ("sketch" in p.name or p.suffix == ".zip")]
    code, _, err = run_cli(
        ["merge", *args[1:], "--out", str(tmp_path / "out"), "--method", "ties"], monkeypatch, capsys
    )
    assert code == 2 and not (tmp_path / "out").exists()
    assert torch.isnan(ts[name]).any() or torch.isinf(ts[name]).any()
