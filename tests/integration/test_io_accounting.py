"""The plan's I/O estimate is what the engine moves: a committed merge's manifest has
``io.estimated`` == ``io.realized`` for base reads, expert reads and output writes.

Base reads used to be estimated as the tensors' bytes only, while the engine also reads the
base's config and tokenizer files whole (role ``base``) to copy them into the snapshot: on the
tiny zoo a budgeted merge planned 463,488 base bytes and read 519,513 (the 56,025 bytes of
``config.json``, ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``).
Output writes likewise left out the shard headers as written, the index and those files.
The realized side comes from the storage layer's byte counters; the expected side here is
computed from the files on disk, independently of the planner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.formats.safetensors import DTYPES
from mergepipe.pipeline import merge
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage

ROLES = ("base_read_bytes", "expert_read_bytes", "output_write_bytes")
SIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _tensor_bytes(folder: Path) -> dict[str, int]:
    """Tensor name -> bytes of its data in the checkpoint ``folder`` (from the shard headers)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            hdr = json.loads(fh.read(n))
        for name, t in hdr.items():
            if name != "__metadata__":
                out[name] = t["data_offsets"][1] - t["data_offsets"][0]
    return out


def _side_bytes(folder: Path) -> int:
    return sum(os.path.getsize(folder / f) for f in SIDE if (folder / f).exists())


def _check(res, base: Path) -> dict:
    """Estimated == realized for every role; base reads = each tensor once per pass of the
    engine (a pre-pass reads the base rows again, the last one all but the first chunk's) + the
    side files, from the files themselves."""
    io = res.manifest["io"]
    for role in ROLES:
        assert io["realized"][role] == io["estimated"][role], (role, io)
    assert io["realized"]["output_copied_bytes"] == 0  # (no server-side copy: every byte is read)
    tb = _tensor_bytes(base)
    expected = _side_bytes(base)
    for t in res.plan.tensors:
        expected += tb[t.name]
        if t.experts and t.passes > 1:  # pre-passes re-read the base rows, except the first chunk's
            rows = t.shape[0]
            expected += (t.passes - 1) * tb[t.name] - min(t.chunk_rows, rows) * (tb[t.name] // rows)
    assert io["realized"]["base_read_bytes"] == expected
    assert io["realized"]["output_write_bytes"] == sum(o["size"] for o in res.manifest["outputs"].values())
    return io


CASES = {
    "task_arithmetic-25pct-read-or-skip": ("task_arithmetic", [], "25%", "none", None, {}),
    "ties-50pct-tiers": ("ties", ["density=0.5"], "50%", "sign3", None, {}),
    # a work memory below the largest tensor: the DARE L1 rescale needs a pre-pass (2 passes)
    "dare_ties-full-two-pass": (
        "dare_ties",
        ["density=0.5"],
        None,
        None,
        None,
        {"work_bytes": 32 * 1024, "block_bytes": 2048},
    ),
    # another output dtype: headers, index total_size and config.json's torch_dtype change size
    "ties-float16-out": ("ties", ["density=0.5"], "40%", "none", "F16", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimated_io_equals_realized_local(family, tmp_path, case):
    base, experts = family
    method, params, budget, sketch, out_dtype, kw = CASES[case]
    res = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        method,
        str(tmp_path / "out"),
        params,
        budget=budget,
        sketch=sketch,
        out_dtype=out_dtype,
        catalog=Catalog(tmp_path / "c.sqlite"),
        storage=open_storage(None, IOCounters()),
        **kw,
    )
    _check(res, base)
    assert _side_bytes(base) > 0  # the family has a config.json and a tokenizer_config.json
    if "two-pass" in case:
        assert any(t.passes == 2 and t.experts for t in res.plan.tensors)
    if out_dtype:
        cfg = json.loads((tmp_path / "out" / "config.json").read_text())
        assert cfg["torch_dtype"] == DTYPES[out_dtype][1]
        # the rewritten config.json has another size than the base's: the estimate sized it
        assert (tmp_path / "out" / "config.json").stat().st_size != (base / "config.json").stat().st_size


def _adapter(folder: Path, modules: dict[str, tuple[int, int]], r: int = 4, seed: int = 0) -> Path:
    """A PEFT LoRA adapter folder with random factors for ``modules`` (name -> (out, in))."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": sorted(modules), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    t = {}
    for m, (o, i) in modules.items():
        t[f"base_model.model.{m}.lora_A.weight"] = (0.05 * torch.randn(r, i, generator=g)).to(torch.bfloat16)
        t[f"base_model.model.{m}.lora_B.weight"] = (0.05 * torch.randn(o, r, generator=g)).to(torch.bfloat16)
    save_file(t, str(folder / "adapter_model.safetensors"))
    return folder


def test_estimated_io_equals_realized_with_a_two_pass_lora_expert(family, tmp_path):
    """A LoRA expert in a two-pass DARE rescale: A is read with every chunk of every pass, B's
    rows once per pass, the first chunk's once less (the last pre-pass leaves it to the merge)."""
    base, experts = family
    ad = _adapter(
        tmp_path / "ad",
        {"model.layers.0.mlp.gate_proj": (160, 64), "model.layers.1.self_attn.q_proj": (64, 64)},
    )
    res = merge(
        str(base),
        [(experts[0].name, str(experts[0])), ("ad", f"lora:{ad}")],
        "dare_ties",
        str(tmp_path / "out"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
        storage=open_storage(None, IOCounters()),
        work_bytes=16 * 1024,
        block_bytes=1024,
    )
    _check(res, base)
    lora = [(tp, te) for tp in res.plan.tensors for te in tp.experts if te.lora is not None]
    assert len(lora) == 2 and all(tp.passes == 2 and tp.chunk_rows < tp.shape[0] for tp, _ in lora)


def _tiny_zoo(request) -> Path:
    """The tiny zoo: from the user's cache when it holds it (so this test builds nothing),
    else the session's (``conftest.tiny_zoo_home``)."""
    from mergepipe_zoo import ZooConfig
    from mergepipe_zoo.zoo import default_zoo_root

    key = ZooConfig.tiny().key()
    cached = default_zoo_root() / key
    if (cached / "zoo.json").exists() and json.loads((cached / "zoo.json").read_text()).get("gates", {}).get("passed"):
        return cached
    return request.getfixturevalue("tiny_zoo_home") / "zoo" / key


@pytest.mark.slow
@pytest.mark.parametrize("sketch", ["none", "sign3"])
def test_estimated_io_equals_realized_on_the_tiny_zoo(request, tmp_path, sketch):
    """The merge the defect was seen on: the demo's task_arithmetic at a 25% expert budget."""
    pytest.importorskip("torch")
    pytest.importorskip("mergepipe_zoo")
    zoo = _tiny_zoo(request)
    spec = json.loads((zoo / "testbed.json").read_text())
    experts = [(n, str(zoo / p)) for n, p in spec["experts"].items()]
    res = merge(
        str(zoo / "base"),
        experts,
        "task_arithmetic",
        str(tmp_path / "out"),
        [],
        budget="25%",
        sketch=sketch,
        catalog=Catalog(tmp_path / "c.sqlite"),
        storage=open_storage(None, IOCounters()),
    )
    io = _check(res, zoo / "base")
    assert io["realized"]["expert_read_bytes"] <= io["expert_budget_bytes"]
    tb = sum(_tensor_bytes(zoo / "base").values())
    assert io["realized"]["base_read_bytes"] > tb  # the tokenizer and configs are base reads too


@pytest.mark.s3
@pytest.mark.slow
def test_estimated_io_equals_realized_on_s3(family, s3_env, tmp_path):
    """Base, experts and output on SeaweedFS (tensors below the server-side copy size, so the
    engine reads every base byte): the estimate is exact there too, coalescing gaps included."""
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("ioacct")

    def up(folder: Path, prefix: str) -> str:
        for f in sorted(os.listdir(folder)):
            c.upload_file(str(folder / f), bucket, f"{prefix}/{f}")
        return f"s3://{bucket}/{prefix}"

    b3 = up(base, "base")
    e3 = [(e.name, up(e, e.name)) for e in experts]
    for sketch in ("none", "sign3"):
        st = open_storage(None, IOCounters())
        res = merge(
            b3,
            e3,
            "dare_ties",
            f"s3://{bucket}/out-{sketch}",
            ["density=0.5"],
            budget="30%",
            sketch=sketch,
            catalog=Catalog(tmp_path / "s.sqlite"),
            storage=st,
            work_bytes=32 * 1024,
            block_bytes=2048,
        )
        io = _check(res, base)
        assert io["realized"]["expert_read_bytes"] <= io["expert_budget_bytes"]
