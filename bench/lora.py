"""LoRA adapters as experts: expert bytes read vs adapter bytes (issue 16).

One command::

    .venv/bin/python bench/lora.py --shape tiny --k 2 --rank 16

builds (once, cached under ``--work``) a bf16 Llama base of the benchmark's ``tiny`` shape
(``bench/run.py``'s TINY_CONFIG: hidden 256, 4 layers, vocab 4096; seeded random weights), ``K``
PEFT LoRA adapters of rank ``r`` on every linear module of the decoder layers (q, k, v, o, gate,
up, down; made with ``peft``, both factors random: ``init_lora_weights=False``) and, for each,
the same adapter pre-merged into a full checkpoint (``merge_and_unload()``, what mergekit's
``model+lora`` does). Then it runs ``mergepipe analyze`` and ``mergepipe merge --json`` (TIES,
density 0.5) on the adapters and on the pre-merged checkpoints, at full budget and at 50%, each in
a fresh process with a fresh catalog per family, and records the storage layer's byte counters:
expert bytes planned and read (analysis and merge), the adapters' and checkpoints' sizes.

Results: ``--out`` (default ``bench/results/lora-<stamp>``): ``results.json`` and
``summary.md`` (the table docs/BENCHMARKS.md quotes). Wall times are recorded but the machine is
shared: the byte counts are the measurement.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from relpath import rel_path  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(shape: str) -> dict:
    if shape == "tiny":
        from run import TINY_CONFIG

        return dict(TINY_CONFIG)
    if shape == "zoo":
        from mergepipe_zoo.zoo import ZooConfig, _llama_config

        return _llama_config(ZooConfig.tiny()).to_dict()
    raise SystemExit(f"--shape {shape!r}: use tiny or zoo")


def build(work: Path, shape: str, k: int, rank: int) -> dict:
    """Base, adapters and pre-merged checkpoints under ``work`` (reused when present)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = work / f"{shape}-k{k}-r{rank}"
    done = root / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = LlamaConfig(**{k_: v for k_, v in _config(shape).items() if k_ not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    base = root / "base"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base, max_shard_size="5MB")
    adapters, fulls = [], []
    for i in range(k):
        torch.manual_seed(100 + i)
        m = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        pm = get_peft_model(m, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
        ad = root / f"adapter{i}"
        pm.save_pretrained(ad)
        mb = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        full = root / f"full{i}"
        PeftModel.from_pretrained(mb, str(ad)).merge_and_unload().save_pretrained(full, max_shard_size="5MB")
        adapters.append(str(ad))
        fulls.append(str(full))
    info = {"base": str(base), "adapters": adapters, "full": fulls}
    done.write_text(json.dumps(info))
    return info


def _size(p: Path, names: tuple[str, ...]) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.name.endswith(names))


def _run(cmd: list[str], home: Path) -> dict:
    env = {**os.environ, "MERGEPIPE_HOME": str(home)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", help="tiny (bench/run.py's TINY_CONFIG) or zoo [tiny]")
    ap.add_argument("--k", type=int, default=2, help="adapters [2]")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank [16]")
    ap.add_argument("--budgets", default="unlimited,50%", help="comma list [unlimited,50%%]")
    ap.add_argument("--work", type=Path, default=HERE / ".work" / "lora", help="model cache [bench/.work/lora]")
    ap.add_argument("--out", type=Path, default=None, help="results folder [bench/results/lora-<stamp>]")
    a = ap.parse_args(argv)
    out = a.out or HERE / "results" / f"lora-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}"
    out.mkdir(parents=True, exist_ok=True)
    fam = build(a.work, a.shape, a.k, a.rank)
    exe = str(Path(sys.executable).parent / "mergepipe")
    rows = []
    for family in ("lora", "full"):
        home = out / f"home-{family}"
        shutil.rmtree(home, ignore_errors=True)
        experts = [f"lora:{p}" for p in fam["adapters"]] if family == "lora" else list(fam["full"])
        ex_args = [x for e in experts for x in ("-e", e)]
        an = _run([exe, "analyze", "--base", fam["base"], *ex_args, "--json"], home)
        sizes = (
            [_size(Path(p), ("adapter_model.safetensors",)) for p in fam["adapters"]]
            if family == "lora"
            else [_size(Path(p), (".safetensors",)) for p in fam["full"]]
        )
        for budget in a.budgets.split(","):
            dest = out / f"m-{family}-{budget.rstrip('%')}"
            shutil.rmtree(dest, ignore_errors=True)
            r = _run(
                [exe, "merge", "--base", fam["base"], *ex_args, "--method", "ties", "--param", "density=0.5"]
                + ["--budget", budget, "--out", str(dest), "--json"],
                home,
            )
            io = r["io"]
            rows.append(
                {
                    "experts": family,
                    "budget": budget,
                    "expert_files_bytes": sum(sizes),
                    "expert_bytes_total": io["expert_bytes_total"],
                    "planned_expert_read_bytes": io["planned_expert_read_bytes"],
                    "expert_read_bytes": io["expert_read_bytes"],
                    "base_read_bytes": io["base_read_bytes"],
                    "analyze_expert_bytes": an["bytes_read"]["expert"],
                    "retained_energy": r["retained_energy"],
                    "wall_s": r["wall_s"],
                    "total_s": r["total_s"],
                }
            )
            shutil.rmtree(dest, ignore_errors=True)
    res = {
        "command": "python bench/lora.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": a.shape,
        "k": a.k,
        "rank": a.rank,
        "targets": TARGETS,
        "rows": rows,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [
        "| experts | budget | expert files (B) | planned expert read (B) | realized expert read (B) | "
        "realized / files | analysis expert read (B) | retained energy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'LoRA adapters' if r['experts'] == 'lora' else 'pre-merged checkpoints'} | {r['budget']} | "
            f"{r['expert_files_bytes']:,} | {r['planned_expert_read_bytes']:,} | {r['expert_read_bytes']:,} | "
            f"{r['expert_read_bytes'] / r['expert_files_bytes']:.3f} | {r['analyze_expert_bytes']:,} | "
            f"{r['retained_energy']:.4f} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {rel_path(out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
