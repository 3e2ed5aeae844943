"""mergepipe vs mergekit benchmark harness: one command, same inputs, same machine, one run.

Example (the smoke run of docs/BENCHMARKS.md)::

    .venv/bin/python bench/run.py --models tiny --k 2,4 --runs 1 --cache warm

The full measurement::

    .venv/bin/python bench/run.py --models zoo,qwen3 --k 2,4,8,16 --runs 3 --cache cold,warm

Systems: ``mergekit`` (mergekit 0.1.5 from PyPI, ``mergekit-yaml``, in its own venv
``bench/.venv-mergekit`` that this script creates), ``mp-full`` (mergepipe, unlimited expert
budget), ``mp-50``, ``mp-25``, ``mp-10`` (50/25/10% of the K experts' bytes, so these budgets
grow with K), and ``mp-fixed`` (one byte budget for every K, by default 10% of 8 experts' bytes:
the "expert bytes flat in K at a fixed budget" target). Every system merges the
same base and the first K experts with TIES, density 0.5, weight 1, normalize true, bf16.

Per K: a fresh ``MERGEPIPE_HOME`` (catalog) shared by the mergepipe systems; ``mergepipe
analyze`` runs once (measured and reported separately: the one-time cost); then for each cache
state and each repetition the systems run one after the other, each as its own process measured
by :mod:`bench.measure`, with the page cache dropped (cold) or pre-read (warm) before each run.
Outputs are deleted after each run (one pair is kept for the equality check). Results go to
``--out``: ``results.json`` (every run, written as it goes), ``summary.md``, and the plots
(see ``bench/report.py``, which can also regenerate them from ``results.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import measure  # noqa: E402
from relpath import rel_argv, rel_path, rel_paths_in  # noqa: E402
from report import _rss_kib  # noqa: E402

MERGEKIT_VERSION = "0.1.5"
TORCH_VERSION = "2.13.0"
SYSTEMS = ("mergekit", "mp-full", "mp-50", "mp-25", "mp-10", "mp-fixed")
BUDGETS = {
    "mp-full": "unlimited",
    "mp-50": "50%",
    "mp-25": "25%",
    "mp-10": "10%",
}  # mp-fixed: bytes, see --fixed-budget
DENSITY = 0.5
TINY_CONFIG = {  # bench/synthetic.py's tiny shape as a usable Llama config (see _complete_synthetic)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# environment


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].split()[0])
        mem = f"{kb / 2**20:.1f} GiB"
    except OSError:
        pass
    disk = subprocess.run(["df", "-h", str(REPO)], capture_output=True, text=True).stdout.strip().splitlines()
    dev = disk[-1].split()[0] if disk else ""
    rot = ""
    try:
        name = Path(dev).name.rstrip("0123456789") if dev.startswith("/dev/") else ""
        if name:
            rot = Path(f"/sys/block/{name}/queue/rotational").read_text().strip()
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total": mem,
        "disk": disk[-1] if disk else "",
        "disk_rotational": rot,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def git_rev() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    d = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "mergepipe"], capture_output=True, text=True
    )
    return r.stdout.strip() + (" (mergepipe/ modified)" if d.stdout.strip() else "")


def ensure_mergekit_venv(venv: Path) -> Path:
    """Create ``venv`` with torch==2.13.0 (the CPU wheel on this machine's disk) and
    mergekit==0.1.5 from PyPI, once; return the ``mergekit-yaml`` path."""
    exe = venv / "bin" / "mergekit-yaml"
    py = venv / "bin" / "python"
    if exe.exists():
        r = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
            capture_output=True,
            text=True,
        )
        if r.stdout.strip() == MERGEKIT_VERSION:
            return exe
        log(f"{venv}: mergekit {r.stdout.strip() or '?'} found, reinstalling {MERGEKIT_VERSION}")
    log(f"creating {venv} (torch=={TORCH_VERSION} from local disk, mergekit=={MERGEKIT_VERSION} from PyPI)")
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", f"mergekit=={MERGEKIT_VERSION}"], check=True
    )
    return exe


def mergepipe_exe() -> Path:
    p = Path(sys.executable).parent / "mergepipe"
    if not p.exists():
        raise SystemExit(f"{p} not found: run this script with the python of the venv where mergepipe is installed")
    return p


# ------------------------------------------------------------------------------------------
# inputs


def _write_tokenizer(folders: list[Path], vocab: int) -> None:
    """A WordLevel tokenizer of ``vocab`` tokens (mergekit's ``tokenizer_source: base`` needs a
    tokenizer in every input; bench/synthetic.py writes none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    for f in folders:
        if not (f / "tokenizer.json").exists():
            fast.save_pretrained(str(f))


def _complete_synthetic(shape: str, folders: list[Path]) -> None:
    """Make bench/synthetic.py's checkpoints loadable by mergekit: the tiny shape's config.json
    names only the architecture (transformers would assume Llama-7B's 32 layers), and no shape
    gets a tokenizer. Writes neither into shard files, so catalog identities do not change."""
    if shape == "tiny":
        for f in folders:
            cfg = json.loads((f / "config.json").read_text())
            if cfg.get("num_hidden_layers") != TINY_CONFIG["num_hidden_layers"]:
                (f / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    vocab = TINY_CONFIG["vocab_size"] if shape == "tiny" else 151936
    _write_tokenizer(folders, vocab)


def prepare_family(model: str, kmax: int, workdir: Path, zoo_root: Path | None) -> dict:
    """Base and ``kmax`` experts for ``model`` (zoo | qwen3 | tiny), created once under
    ``workdir``. Returns {base, experts, note}."""
    if model == "zoo":
        from mergepipe_zoo import ZooConfig, build_zoo

        per = max(1, math.ceil(kmax / 4))
        cfg = ZooConfig(n_experts_per_domain=per)
        log(f"zoo: building/reusing the demo zoo with {per} expert(s) per domain (up to {4 * per} experts)")
        z = build_zoo(zoo_root, cfg, log=log)
        names = cfg.expert_names()
        note = (
            f"mergepipe demo zoo (ZooConfig(n_experts_per_domain={per}), key {cfg.key()}): trained "
            f"Llama-architecture experts; first K of {names}"
        )
        return {"base": Path(z.base), "experts": [Path(z.experts[n]) for n in names[:kmax]], "note": note}
    sys.path.insert(0, str(HERE))
    from synthetic import make_family

    shape = {"qwen3": "qwen3-0.6b", "tiny": "tiny"}[model]
    shard = 500_000_000 if model == "qwen3" else 4_000_000
    out = workdir / "families" / f"{model}-seed0"
    log(f"{model}: generating/reusing bench/synthetic.py family ({shape}, {kmax} experts) at {out}")
    base, experts = make_family(out, kmax, shape, shard, 0)
    _complete_synthetic(shape, [base, *experts])
    return {
        "base": base,
        "experts": experts,
        "note": f"bench/synthetic.py make_family(shape={shape!r}, shard_bytes={shard}, seed=0)",
    }


def ckpt_bytes(folder: Path) -> int:
    """Bytes of the safetensors shards (what a merge reads at most from this checkpoint)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def dir_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in measure.files_under([folder]))


def mergekit_yaml(base: Path, experts: list[Path], path: Path) -> Path:
    lines = ["merge_method: ties", f"base_model: {base}", "models:"]
    for e in experts:
        lines += [f"  - model: {e}", f"    parameters: {{weight: 1.0, density: {DENSITY}}}"]
    lines += ["parameters:", "  normalize: true", "dtype: bfloat16", "tokenizer_source: base", ""]
    path.write_text("\n".join(lines))
    return path


def mergepipe_args(base: Path, experts: list[Path]) -> list[str]:
    a = ["--base", str(base)]
    for e in experts:
        a += ["--expert", str(e)]
    return a


# ------------------------------------------------------------------------------------------
# runs


class Harness:
    def __init__(self, args) -> None:
        self.a = args
        self.out: Path = args.out
        self.work: Path = args.workdir
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.mp = mergepipe_exe()
        self.results: dict = {
            "format": "mergepipe.bench/v1",
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "argv": rel_argv(sys.argv),
            "git": git_rev(),
            "machine": machine_info(),
            "settings": {},
            "inputs": {},
            "bandwidth": {},
            "analysis": [],
            "startup": [],
            "runs": [],
            "equality": [],
            "help": None,
            "plan": [],
            "notes": [],
        }
        self.cold_mode = None
        if "cold" in args.cache:
            if args.cold == "auto":
                self.cold_mode = "drop" if measure.drop_caches_permitted() else "fadvise"
                if self.cold_mode == "fadvise":
                    self.note(
                        "drop_caches is not permitted here: cold runs evict only the input files and catalog "
                        "(posix_fadvise DONTNEED); libraries may stay cached."
                    )
            else:
                self.cold_mode = args.cold
        self.results["settings"] = {
            "models": args.models,
            "k": args.k,
            "runs": args.runs,
            "cache": args.cache,
            "systems": args.systems,
            "cold_method": self.cold_mode,
            "method": "ties",
            "density": DENSITY,
            "weight": 1.0,
            "normalize": True,
            "mergekit": MERGEKIT_VERSION,
            "workdir": rel_path(self.work),
        }
        self.mk = ensure_mergekit_venv(args.mk_venv) if "mergekit" in args.systems else None
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.warm_paths = [Path(sys.prefix) / "lib", REPO / "mergepipe", Path(sys.base_prefix) / "lib"]
        if self.mk:
            self.warm_paths.append(args.mk_venv / "lib")

    def note(self, msg: str) -> None:
        log("NOTE " + msg)
        self.results["notes"].append(msg)

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(rel_paths_in(self.results), indent=1))
        tmp.replace(self.out / "results.json")

    def prepare_cache(self, cache: str, inputs: list[Path]) -> dict:
        t = time.perf_counter()
        if cache == "cold":
            method = measure.make_cold(self.cold_mode, inputs)
            return {"method": method, "prep_s": time.perf_counter() - t}
        os.sync()
        n = measure.warm([*inputs, *self.warm_paths])
        return {"method": "pre-read", "prep_s": time.perf_counter() - t, "warm_bytes": n}

    def measured(self, tag: str, cmd: list[str], env: dict) -> dict:
        res = self.logs / f"{tag}.measure.json"
        shim = [
            sys.executable,
            str(HERE / "measure.py"),
            "--result",
            str(res),
            "--stdout",
            str(self.logs / f"{tag}.out"),
            "--stderr",
            str(self.logs / f"{tag}.err"),
            "--timeout",
            str(self.a.timeout),
            "--",
            *map(str, cmd),
        ]
        p = subprocess.run(shim, env=env, cwd=str(self.work))
        if p.returncode != 0 or not res.exists():
            raise SystemExit(f"{tag}: the measurement shim failed (exit {p.returncode})")
        r = json.loads(res.read_text())
        res.unlink()
        t = time.perf_counter()
        os.sync()  # flush what the process left dirty (mergekit does not fsync; mergepipe does)
        r["sync_after_s"] = time.perf_counter() - t
        if r["rc"] != 0:
            err = (self.logs / f"{tag}.err").read_text(errors="replace")[-2000:]
            log(f"{tag}: exit {r['rc']}\n{err}")
        return r

    def run_family(self, model: str) -> None:
        ks = self.a.k
        fam = prepare_family(model, max(ks), self.work, self.a.zoo_root)
        base, experts = fam["base"], fam["experts"]
        if len(experts) < max(ks):
            raise SystemExit(f"{model}: only {len(experts)} experts available, --k asks for {max(ks)}")
        self.results["inputs"][model] = {
            "note": fam["note"],
            "base": rel_path(base),
            "base_bytes": ckpt_bytes(base),
            "expert_bytes": [ckpt_bytes(e) for e in experts],
            "experts": [rel_path(e) for e in experts],
        }
        eb = self.results["inputs"][model]["expert_bytes"]
        self.fixed_budget = (
            int(self.a.fixed_budget) if self.a.fixed_budget != "auto" else int(0.1 * 8 * sum(eb) / len(eb))
        )
        self.results["inputs"][model]["fixed_budget_bytes"] = self.fixed_budget
        self.save()
        # disk bandwidth, once per input family (cold sequential read of its shards; write + fsync)
        shards = sorted(Path(base).glob("*.safetensors")) + [
            f for e in experts for f in sorted(Path(e).glob("*.safetensors"))
        ]
        rb = measure.read_bandwidth(shards, max_bytes=self.a.bandwidth_bytes)
        wb = measure.write_bandwidth(self.work / "out", min(self.a.bandwidth_bytes, max(ckpt_bytes(base), 64 << 20)))
        self.results["bandwidth"][model] = {"read": rb, "write": wb}
        log(
            f"{model}: disk read {rb['bytes_per_s'] / 1e6:.0f} MB/s over {rb['bytes'] / 1e6:.0f} MB cold; "
            f"write+fsync {wb['bytes_per_s'] / 1e6:.0f} MB/s over {wb['bytes'] / 1e6:.0f} MB"
        )
        self.save()
        self.startup_bench(model, [base, *experts[: max(ks)]])
        for k in ks:
            self.run_k(model, base, experts[:k], k)
        if self.a.plan_k and model == self.a.plan_model:
            self.plan_bench(model)

    def run_k(self, model: str, base: Path, experts: list[Path], k: int) -> None:
        if self.a.catalog:  # a catalog analyzed beforehand: kept; the analyze run below finds it cached
            home = self.a.catalog.absolute()
            home.mkdir(parents=True, exist_ok=True)
            self.note(
                f"K={k}: catalog {rel_path(home)} reused (analysis done beforehand); the analysis row is the cached "
                "re-check, not the one-time cost"
            )
        else:
            home = self.work / "home" / f"{model}-K{k}"
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
        env_mp = dict(self.env, MERGEPIPE_HOME=str(home))
        inputs = [base, *experts]
        mp_systems = [s for s in self.a.systems if s != "mergekit"]
        if mp_systems:
            # one-time analysis, measured (cold if cold runs are asked for, else warm)
            cache = "cold" if "cold" in self.a.cache else "warm"
            prep = self.prepare_cache(cache, [*inputs, home])
            tag = f"{model}-K{k}-analyze"
            log(f"{tag} ({cache})")
            r = self.measured(tag, [str(self.mp), "analyze", *mergepipe_args(base, experts), "--json"], env_mp)
            try:
                r["result"] = json.loads(r["stdout"])
            except ValueError:
                r["result"] = None
            r.update(model=model, k=k, cache=cache, **prep)
            r.pop("stdout", None)
            self.results["analysis"].append(r)
            self.save()
            if r["rc"] != 0:
                raise SystemExit(f"{tag} failed; see {self.logs / (tag + '.err')}")
        yml = mergekit_yaml(base, experts, self.work / f"mergekit-{model}-K{k}.yml") if self.mk else None
        compare_k = self.a.compare_k or (8 if 8 in self.a.k else min(self.a.k))
        keep_for_compare = (
            self.mk is not None
            and "mp-full" in self.a.systems
            and k == compare_k
            and not any(e["model"] == model for e in self.results["equality"])
        )
        kept: dict[str, Path] = {}
        outroot = self.work / "out"
        outroot.mkdir(parents=True, exist_ok=True)
        for cache in self.a.cache:
            for rep in range(self.a.runs):
                for system in self.a.systems:
                    tag = f"{model}-K{k}-{cache}-r{rep}-{system}"
                    out = outroot / tag
                    shutil.rmtree(out, ignore_errors=True)
                    if system == "mergekit":
                        cmd, env = [str(self.mk), str(yml), str(out)], self.env
                    else:
                        cmd = [
                            str(self.mp),
                            "merge",
                            *mergepipe_args(base, experts),
                            "--method",
                            "ties",
                            "--param",
                            f"density={DENSITY}",
                            "--param",
                            "weight=1",
                            "--param",
                            "normalize=true",
                            "--budget",
                            BUDGETS.get(system, "unlimited"),
                            "--out",
                            str(out),
                            "--json",
                        ]
                        if system == "mp-fixed":
                            cmd[cmd.index("--budget") + 1] = str(self.fixed_budget)
                        env = env_mp
                    prep = self.prepare_cache(cache, [*inputs, home])
                    log(f"{tag} ({prep['method']})")
                    r = self.measured(tag, cmd, env)
                    r.update(model=model, k=k, system=system, cache=cache, rep=rep, **prep)
                    r["output_bytes"] = dir_bytes(out) if out.exists() else 0
                    r["input_bytes"] = {"base": ckpt_bytes(base), "experts": sum(ckpt_bytes(e) for e in experts)}
                    if system != "mergekit":
                        try:
                            r["result"] = json.loads(r["stdout"])
                        except ValueError:
                            r["result"] = None
                        if r["result"] and r["result"].get("already_committed"):
                            self.note(f"{tag}: mergepipe reported already_committed (output not deleted?)")
                    r.pop("stdout", None)
                    self.results["runs"].append(r)
                    self.save()
                    log(
                        f"  wall {r['wall_s']:.2f} s, peak RSS {_rss_kib(r) / 1024:.0f} MiB, "
                        f"read_bytes {r['io'].get('read_bytes', 0) / 1e6:.1f} MB, write_bytes "
                        f"{r['io'].get('write_bytes', 0) / 1e6:.1f} MB, rc {r['rc']}"
                    )
                    if keep_for_compare and system in ("mergekit", "mp-full") and system not in kept and r["rc"] == 0:
                        kept[system] = out
                    else:
                        shutil.rmtree(out, ignore_errors=True)
                if len(kept) == 2:
                    self.equality(model, k, base, experts, kept["mergekit"], kept["mp-full"])
                    for p in kept.values():
                        shutil.rmtree(p, ignore_errors=True)
                    kept = {}
                    keep_for_compare = False

    def equality(self, model: str, k: int, base: Path, experts: list[Path], mk_out: Path, mp_out: Path) -> None:
        log(f"{model}-K{k}: output equality mergekit vs mp-full")
        attribute = self.a.attribute if self.a.attribute is not None else model in ("tiny", "zoo")
        cmd = [sys.executable, str(HERE / "compare_outputs.py"), str(mk_out), str(mp_out), "--json"]
        if attribute:
            cmd += ["--ties", str(base), *map(str, experts), "--density", str(DENSITY)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        try:
            r = json.loads(p.stdout)
        except ValueError:
            r = {"error": p.stderr[-2000:]}
        r.update(model=model, k=k, n_tensors=len(r.get("tensors", [])))
        (self.out / f"equality-{model}-K{k}.json").write_text(json.dumps(r, indent=1))
        r.pop("tensors", None)
        if "attribution" in r:
            r["attribution"].pop("tensors", None)
        self.results["equality"].append(r)
        self.save()

    def plan_bench(self, model: str) -> None:
        """Plan a merge of ``plan_k`` experts from the catalog: process wall of ``mergepipe plan
        --json`` and the in-process time of ``build_plan`` (bench/plan_time.py)."""
        k = self.a.plan_k
        fam = prepare_family(model, k, self.work, self.a.zoo_root)
        base, experts = fam["base"], fam["experts"][:k]
        home = self.work / "home" / f"{model}-plan-K{k}"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        env = dict(self.env, MERGEPIPE_HOME=str(home))
        log(f"plan benchmark: analyze {k} experts of {model}")
        an = self.measured(
            f"{model}-plan-K{k}-analyze", [str(self.mp), "analyze", *mergepipe_args(base, experts), "--json"], env
        )
        an.pop("stdout", None)
        rows = {"model": model, "k": k, "analyze": an, "cli": [], "inproc": None}
        for budget in ("unlimited", "10%"):
            for i in range(self.a.plan_runs):
                measure.warm([base, *experts, home])
                r = self.measured(
                    f"{model}-plan-K{k}-{budget.replace('%', 'pct')}-{i}",
                    [
                        str(self.mp),
                        "plan",
                        *mergepipe_args(base, experts),
                        "--method",
                        "ties",
                        "--param",
                        f"density={DENSITY}",
                        "--budget",
                        budget,
                        "--json",
                    ],
                    env,
                )
                r.pop("stdout", None)
                r["budget"] = budget
                rows["cli"].append(r)
        p = subprocess.run(
            [
                sys.executable,
                str(HERE / "plan_time.py"),
                "--base",
                str(base),
                *sum((["--expert", str(e)] for e in experts), []),
                "--repeat",
                str(self.a.plan_runs),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        try:
            rows["inproc"] = json.loads(p.stdout)
        except ValueError:
            rows["inproc"] = {"error": p.stderr[-2000:]}
        self.results["plan"].append(rows)
        self.save()

    def startup_bench(self, model: str, inputs: list[Path]) -> None:
        """Start-up alone (interpreter + imports, no merge), per cache state: what the cold
        runs' /proc read_bytes contain besides the tensors. mergekit: ``mergekit-yaml --help``
        (click imports the whole merge module first); mergepipe: importing the modules a merge
        imports (the CLI imports them lazily)."""
        cmds = []
        if self.mk:
            cmds.append(("mergekit", [str(self.mk), "--help"]))
        if any(s != "mergekit" for s in self.a.systems):
            cmds.append(
                (
                    "mergepipe",
                    [
                        sys.executable,
                        "-c",
                        "import torch, mergepipe.cli, mergepipe.pipeline, "
                        "mergepipe.engine.executor, mergepipe.catalog.catalog",
                    ],
                )
            )
        for cache in self.a.cache:
            for rep in range(self.a.runs):
                for system, cmd in cmds:
                    prep = self.prepare_cache(cache, inputs)
                    r = self.measured(f"{model}-startup-{cache}-r{rep}-{system}", cmd, self.env)
                    r.pop("stdout", None)
                    r.update(model=model, system=system, cache=cache, rep=rep, **prep)
                    self.results["startup"].append(r)
        self.save()

    def help_bench(self) -> None:
        rs = []
        for i in range(self.a.help_runs):
            r = self.measured(f"help-{i}", [str(self.mp), "--help"], self.env)
            r.pop("stdout", None)
            rs.append(r)
        self.results["help"] = rs
        self.save()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--models", type=csv, default=["tiny"], help="comma list of zoo, qwen3, tiny [tiny]")
    ap.add_argument("--k", type=lambda s: [int(x) for x in csv(s)], default=[2, 4], help="expert counts [2,4]")
    ap.add_argument("--runs", type=int, default=3, help="repetitions per system x K x cache [3]")
    ap.add_argument("--cache", type=csv, default=["cold", "warm"], help="cold,warm [both]")
    ap.add_argument("--systems", type=csv, default=list(SYSTEMS), help=f"comma list of {','.join(SYSTEMS)} [all]")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=HERE / ".work",
        help="inputs (synthetic families), catalogs and outputs [bench/.work]",
    )
    ap.add_argument("--out", type=Path, default=None, help="results folder [bench/results/<stamp>]")
    ap.add_argument(
        "--mk-venv", type=Path, default=HERE / ".venv-mergekit", help="mergekit venv [bench/.venv-mergekit]"
    )
    ap.add_argument("--zoo-root", type=Path, default=None, help="zoo cache [$MERGEPIPE_HOME/zoo or ~/.mergepipe/zoo]")
    ap.add_argument(
        "--cold",
        choices=["auto", "drop", "fadvise", "none"],
        default="auto",
        help="cold-cache method: drop_caches, else per-file fadvise [auto]",
    )
    ap.add_argument(
        "--fixed-budget", default="auto", help="mp-fixed's expert budget in bytes [auto: 10%% of 8 experts' bytes]"
    )
    ap.add_argument(
        "--compare-k",
        type=int,
        default=None,
        help="K of the mergekit vs mp-full equality check [8 if run, else the smallest K]",
    )
    ap.add_argument(
        "--attribute",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attribute output differences (ties / arithmetic) [on for tiny and zoo]",
    )
    ap.add_argument(
        "--catalog",
        type=Path,
        default=None,
        help="MERGEPIPE_HOME to reuse for every K (experts analyzed beforehand with `mergepipe analyze`) "
        "instead of a fresh catalog per K whose one-time analysis is measured",
    )
    ap.add_argument("--plan-k", type=int, default=16, help="experts in the planning benchmark, 0 to skip [16]")
    ap.add_argument("--plan-model", default="tiny", help="family of the planning benchmark [tiny]")
    ap.add_argument("--plan-runs", type=int, default=5)
    ap.add_argument("--help-runs", type=int, default=10)
    ap.add_argument("--bandwidth-bytes", type=int, default=2 << 30, help="bytes read for the bandwidth probe [2 GiB]")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="per-run timeout, seconds")
    ap.add_argument(
        "--report-only",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="only regenerate summary.md and plots from a results.json",
    )
    a = ap.parse_args(argv)
    for m in a.models:
        if m not in ("zoo", "qwen3", "tiny"):
            ap.error(f"--models: unknown {m!r}")
    for s in a.systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: unknown {s!r}")
    for c in a.cache:
        if c not in ("cold", "warm"):
            ap.error(f"--cache: unknown {c!r}")
    if a.out is None:
        a.out = HERE / "results" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out = a.out.absolute()
    a.workdir = a.workdir.absolute()
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    import report

    if a.report_only:
        report.write_all(json.loads(a.report_only.read_text()), a.report_only.parent)
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    h = Harness(a)
    log(f"results -> {a.out}")
    t0 = time.perf_counter()
    try:
        h.help_bench()
        for m in a.models:
            h.run_family(m)
        if a.plan_k and a.plan_model not in a.models:
            h.plan_bench(a.plan_model)
    finally:
        h.results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
        h.results["total_s"] = time.perf_counter() - t0
        h.results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        h.save()
        report.write_all(rel_paths_in(h.results), a.out)
        shutil.rmtree(a.workdir / "out", ignore_errors=True)
    log(f"done in {time.perf_counter() - t0:.0f} s: {a.out}/summary.md")


if __name__ == "__main__":
    main()
