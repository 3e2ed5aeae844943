"""Table-driven malformed-input suite (issue 12 item 7): every case is refused with exit code 2
and one line on stderr naming the file or field, creates nothing (not even --out's parent) and
reads no tensor byte (the storage counters see no base/expert read)."""

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.harness import run_cli
from testkit.synth import make_family

INDEX = "model.safetensors.index.json"


@dataclass
class Ctx:
    tmp: Path
    base: Path
    experts: list[Path]

    @property
    def out(self) -> Path:
        return self.tmp / "new-parent" / "out"

    def sparse(self, path: Path, size: int) -> list[str]:
        with open(path, "ab") as f:  # sparse: large by size, nothing to read
            f.truncate(size)
        return self.merge()

    def mkdir(self, name: str) -> bool:
        (self.tmp / name).mkdir()
        return True

    def shard(self, ckpt: Path, i: int = 0) -> Path:
        return sorted(ckpt.glob("*.safetensors"))[i]

    def merge(self, *extra: str, out: Path | str | None = None) -> list[str]:
        a = ["merge", "--base", str(self.base), "--out", str(out or self.out), "--method", "ties", "-p", "density=0.5"]
        for e in self.experts:
            a += ["-e", str(e)]
        return a + list(extra)

    def config(self, text: str, *extra: str) -> list[str]:
        p = self.tmp / "merge.yml"
        p.write_text(text)
        return ["merge", "--config", str(p), "--out", str(self.out), *extra]

    def config_bytes(self, data: bytes) -> list[str]:
        (self.tmp / "merge.yml").write_bytes(data)
        return ["merge", "--config", str(self.tmp / "merge.yml"), "--out", str(self.out)]

    def yaml_ok(self, **over) -> str:
        d = {
            "merge_method": "ties",
            "base_model": str(self.base),
            "models": [{"model": str(e), "parameters": {"density": 0.5, "weight": 0.5}} for e in self.experts],
        }
        d.update(over)
        return json.dumps(d)  # JSON is YAML


# --- header surgery ------------------------------------------------------------------------------
def _split(shard: Path) -> tuple[dict, bytes]:
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(shard: Path, header: bytes, data: bytes) -> None:
    shard.write_bytes(struct.pack("<Q", len(header)) + header + data)


def hdr(fn: Callable[[dict], object]):
    """Mutate the JSON header of the second expert's first shard (``fn`` edits it in place or
    returns a replacement object)."""

    def setup(c: Ctx):
        s = c.shard(c.experts[1])
        h, data = _split(s)
        r = fn(h)
        _write(s, json.dumps(h if r is None else r).encode(), data)
        return c.merge()

    return setup


def first_tensor(h: dict) -> dict:
    return h[next(k for k in h if k != "__metadata__")]


def by_offset(h: dict) -> list[dict]:
    return sorted((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])


def raw_shard(fn: Callable[[bytes], bytes]):
    def setup(c: Ctx):
        s = c.shard(c.experts[1])
        s.write_bytes(fn(s.read_bytes()))
        return c.merge()

    return setup


def idx(fn: Callable[[dict], object], which: str = "expert"):
    """Mutate a checkpoint's shard index (``fn`` edits it in place or returns a replacement)."""

    def setup(c: Ctx):
        ck = c.experts[1] if which == "expert" else c.base
        d = json.loads((ck / INDEX).read_text())
        r = fn(d)
        (ck / INDEX).write_text(json.dumps(d if r is None else r))
        return c.merge()

    return setup


def remap(name: str, which: str = "expert"):
    def fn(d):
        first = sorted(set(d["weight_map"].values()))[0]
        d["weight_map"] = {k: (name if v == first else v) for k, v in d["weight_map"].items()}

    return idx(fn, which)


def raw_index(data: bytes):
    def setup(c: Ctx):
        (c.experts[1] / INDEX).write_bytes(data)
        return c.merge()

    return setup


def big_index(c: Ctx):
    with open(c.experts[1] / INDEX, "r+b") as f:  # sparse: 101 MB by size, nothing to read
        f.truncate(101_000_000)
    return c.merge()


def retensor(fn: Callable[[dict], None], which: int = 1):
    """Rewrite expert ``which`` as a single-file checkpoint with edited tensors."""

    def setup(c: Ctx):
        from safetensors.torch import load_file, save_file

        ck = c.experts[which]
        ts = {}
        for s in sorted(ck.glob("*.safetensors")):
            ts.update(load_file(str(s)))
            s.unlink()
        (ck / INDEX).unlink()
        fn(ts)
        save_file(ts, str(ck / "model.safetensors"))
        return c.merge()

    return setup


def _extra(ts):
    import torch

    ts["extra.adapter.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)


def _missing(ts):
    ts.pop(sorted(ts)[0])


def _reshape(ts):
    k = next(k for k, v in ts.items() if v.dim() == 2)
    ts[k] = ts[k].reshape(-1, 2).contiguous()


def _redtype(ts):
    import torch

    k = sorted(ts)[0]
    ts[k] = ts[k].to(torch.float32)


def empty_base(c: Ctx):
    for s in c.base.glob("*.safetensors"):
        s.unlink()
    (c.base / INDEX).unlink()
    _write(c.base / "model.safetensors", b"{}      ", b"")
    return c.merge()


def out_symlink(target: str):
    def setup(c: Ctx):
        link = c.tmp / "link-out"
        if target == "empty":
            (c.tmp / "empty-dir").mkdir()
            os.symlink(c.tmp / "empty-dir", link)
        else:
            os.symlink(c.tmp / "nowhere", link)
        return c.merge(out=link)

    return setup


def out_file(c: Ctx):
    (c.tmp / "a-file").write_text("x")
    return c.merge(out=c.tmp / "a-file")


def out_under_file(c: Ctx):
    (c.tmp / "a-file").write_text("x")
    return c.merge(out=c.tmp / "a-file" / "out")


def out_nonempty(c: Ctx):
    (c.tmp / "full").mkdir()
    (c.tmp / "full" / "x").write_text("x")
    return c.merge(out=c.tmp / "full")


def shard_symlink_outside(c: Ctx):
    s = c.shard(c.experts[1])
    target = c.tmp / "elsewhere.safetensors"
    shutil.move(s, target)
    os.symlink(target, s)
    return c.merge()


def deep(n: int) -> str:
    return "[" * n + "]" * n


D = 100_000  # nesting depth of the "deeply nested" cases (RecursionError before the fix)

CASES: list[tuple[str, Callable[[Ctx], list[str]], list[str]]] = [
    # --- safetensors headers -------------------------------------------------------------------
    ("header-truncated-file", raw_shard(lambda r: r[:-100]), ["expert1", "truncated"]),
    ("header-length-past-eof", raw_shard(lambda r: struct.pack("<Q", len(r) * 2) + r[8:]), ["expert1", "past the end"]),
    ("header-length-over-100MB", raw_shard(lambda r: struct.pack("<Q", 200_000_000) + r[8:]), ["expert1", "100 MB"]),
    ("header-shorter-than-8-bytes", raw_shard(lambda r: r[:5]), ["expert1", "8-byte"]),
    ("header-empty-file", raw_shard(lambda r: b""), ["expert1", "8-byte"]),
    (
        "header-invalid-json",
        raw_shard(lambda r: r[:8] + b"{" * struct.unpack("<Q", r[:8])[0] + r[8 + struct.unpack("<Q", r[:8])[0] :]),
        ["expert1"],
    ),
    (
        "header-invalid-utf8",
        raw_shard(lambda r: r[:8] + b"\xff" * struct.unpack("<Q", r[:8])[0] + r[8 + struct.unpack("<Q", r[:8])[0] :]),
        ["expert1", "UTF-8"],
    ),
    (
        "header-deeply-nested",
        raw_shard(lambda r: struct.pack("<Q", 2 * D) + deep(D).encode() + r[8:]),
        ["expert1", "nested"],
    ),
    ("header-is-a-list", hdr(lambda h: [1, 2]), ["expert1", "list"]),
    ("header-entry-not-object", hdr(lambda h: h.update({"model.norm.weight": 3})), ["expert1", "model.norm.weight"]),
    ("header-unknown-dtype", hdr(lambda h: first_tensor(h).update(dtype="F12")), ["expert1", "dtype"]),
    ("header-dtype-not-string", hdr(lambda h: first_tensor(h).update(dtype=[1])), ["expert1", "dtype"]),
    ("header-negative-dim", hdr(lambda h: first_tensor(h).update(shape=[-1, 4])), ["expert1", "shape"]),
    ("header-float-dim", hdr(lambda h: first_tensor(h).update(shape=[1.5])), ["expert1", "shape"]),
    ("header-absurd-shape-2^70", hdr(lambda h: first_tensor(h).update(shape=[0, 2**70])), ["expert1", "shape"]),
    ("header-rank-65", hdr(lambda h: first_tensor(h).update(shape=[1] * 65)), ["expert1", "shape"]),
    ("header-offsets-one-value", hdr(lambda h: first_tensor(h).update(data_offsets=[0])), ["expert1", "data_offsets"]),
    (
        "header-offsets-reversed",
        hdr(lambda h: first_tensor(h).update(data_offsets=[8, 0])),
        ["expert1", "data_offsets"],
    ),
    ("header-offsets-wrong-size", hdr(lambda h: by_offset(h)[0].update(shape=[1])), ["expert1", "data_offsets"]),
    (
        "header-offsets-past-data",
        hdr(lambda h: by_offset(h)[-1]["data_offsets"].__setitem__(1, 10**12)),
        ["expert1", "data_offsets"],
    ),
    (
        "header-overlapping-tensors",
        hdr(
            lambda h: by_offset(h)[1].update(
                data_offsets=[
                    by_offset(h)[0]["data_offsets"][0],
                    by_offset(h)[0]["data_offsets"][0]
                    + by_offset(h)[1]["data_offsets"][1]
                    - by_offset(h)[1]["data_offsets"][0],
                ]
            )
        ),
        ["expert1", "overlaps"],
    ),
    ("header-metadata-not-strings", hdr(lambda h: h.update(__metadata__={"a": [1]})), ["expert1", "__metadata__"]),
    ("header-trailing-bytes", raw_shard(lambda r: r + b"\0" * 16), ["expert1", "trailing"]),
    (
        "header-name-with-rich-markup",
        hdr(lambda h: h.update({"evil[/]name[bold]": {**first_tensor(h), "dtype": "F12"}})),
        ["expert1", "evil[/]name[bold]"],
    ),
    ("header-empty-tensor-name", hdr(lambda h: h.update({"": first_tensor(h)})), ["expert1"]),
    # --- shard indexes --------------------------------------------------------------------------
    ("index-invalid-json", raw_index(b"{not json"), [INDEX, "JSON"]),
    ("index-not-utf8", raw_index(b"\xff\xfe{}"), [INDEX]),
    ("index-is-a-list", raw_index(b"[1, 2]"), [INDEX, "weight_map"]),
    ("index-no-weight-map", idx(lambda d: {"metadata": {}}), [INDEX, "weight_map"]),
    ("index-weight-map-list", idx(lambda d: {"weight_map": ["a"]}), [INDEX, "weight_map"]),
    ("index-weight-map-empty-expert", idx(lambda d: {"weight_map": {}}), [INDEX, "weight_map is empty"]),
    ("index-weight-map-empty-base", idx(lambda d: {"weight_map": {}}, "base"), [INDEX, "weight_map is empty"]),
    (
        "index-value-not-string",
        idx(lambda d: d["weight_map"].update({next(iter(d["weight_map"])): 7})),
        [INDEX, "weight_map"],
    ),
    ("index-traversal-expert", remap("../base/x.safetensors"), [INDEX, "weight_map", "normalised"]),
    ("index-traversal-base", remap("../../escape.safetensors", "base"), [INDEX, "weight_map", "normalised"]),
    ("index-absolute-path", remap("/etc/passwd"), [INDEX, "weight_map", "absolute"]),
    ("index-subfolder-name", remap("sub/x.safetensors"), [INDEX, "weight_map", "is a path"]),
    ("index-backslash", remap("..\\x.safetensors"), [INDEX, "weight_map", "backslash"]),
    ("index-nul-byte", remap("x\u0000.safetensors"), [INDEX, "weight_map", "control"]),
    ("index-name-too-long", remap("x" * 300), [INDEX, "weight_map", "longer than 255"]),
    ("index-missing-shard", remap("model-00009-of-00009.safetensors"), [INDEX, "does not exist"]),
    (
        "index-wrong-shard-for-tensor",
        idx(lambda d: d["weight_map"].update({next(iter(d["weight_map"])): sorted(set(d["weight_map"].values()))[-1]})),
        [INDEX, "weight_map maps"],
    ),
    ("index-over-size-cap", big_index, [INDEX, "limit"]),
    (
        "index-deeply-nested",
        raw_index(('{"weight_map": {"a": "b"}, "x": ' + deep(D) + "}").encode()),
        [INDEX, "nested"],
    ),
    ("index-metadata-not-object", idx(lambda d: d.update(metadata=[1])), [INDEX, "metadata"]),
    # --- compatibility (both directions) and empty checkpoints ---------------------------------
    ("expert-extra-tensor", retensor(_extra), ["expert1", "extra.adapter.weight", "not in the base"]),
    ("expert-missing-tensor", retensor(_missing), ["expert1", "missing"]),
    ("expert-shape-differs", retensor(_reshape), ["expert1", "shape"]),
    ("expert-dtype-differs", retensor(_redtype), ["expert1", "dtype"]),
    ("base-zero-tensors", empty_base, ["base", "no tensors"]),
    ("base-config-json-over-cap", lambda c: c.sparse(c.base / "config.json", 17 << 20), ["config.json", "limit"]),
    ("base-tokenizer-over-cap", lambda c: c.sparse(c.base / "tokenizer.json", 300 << 20), ["tokenizer.json", "limit"]),
    # --- mergekit YAML configs ------------------------------------------------------------------
    (
        "yaml-alias-bomb",
        lambda c: c.config(
            "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
            "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
            "merge_method: ties\nbase_model: *f\n"
        ),
        ["merge.yml", "aliases"],
    ),
    ("yaml-recursive-alias", lambda c: c.config("a: &a [*a]\nmerge_method: ties\n"), ["merge.yml"]),
    ("yaml-invalid", lambda c: c.config("merge_method: [ties\n"), ["merge.yml", "YAML"]),
    ("yaml-top-level-list", lambda c: c.config("- 1\n- 2\n"), ["merge.yml", "mapping"]),
    ("yaml-two-documents", lambda c: c.config("merge_method: ties\n---\nmerge_method: ties\n"), ["merge.yml"]),
    ("yaml-unknown-key", lambda c: c.config(c.yaml_ok(frobnicate=1)), ["merge.yml", "frobnicate"]),
    ("yaml-slices", lambda c: c.config(c.yaml_ok(slices=[{"sources": []}])), ["merge.yml", "slices"]),
    (
        "yaml-no-merge-method",
        lambda c: c.config(json.dumps({"base_model": str(c.base)})),
        ["merge.yml", "merge_method"],
    ),
    ("yaml-unknown-method", lambda c: c.config(c.yaml_ok(merge_method="frob")), ["merge.yml", "merge_method"]),
    ("yaml-model-not-folder", lambda c: c.config(c.yaml_ok(base_model="org/hub-name")), ["merge.yml", "base_model"]),
    ("yaml-model-is-a-list", lambda c: c.config(c.yaml_ok(base_model=list(range(1000)))), ["merge.yml", "base_model"]),
    ("yaml-lora-ref", lambda c: c.config(c.yaml_ok(base_model=str(c.base) + "+lora")), ["merge.yml", "LoRA"]),
    ("yaml-over-size-cap", lambda c: c.config(c.yaml_ok() + "\n#" + "x" * (1 << 20)), ["merge.yml", "limit"]),
    ("yaml-deeply-nested", lambda c: c.config("merge_method: ties\nx: " + deep(5000) + "\n"), ["merge.yml", "nested"]),
    ("yaml-bad-dtype", lambda c: c.config(c.yaml_ok(dtype="int3")), ["merge.yml", "dtype"]),
    ("yaml-fidelity-2", lambda c: c.config(c.yaml_ok(fidelity=2)), ["merge.yml", "fidelity"]),
    ("yaml-budget-garbage", lambda c: c.config(c.yaml_ok(budget="lots")), ["merge.yml", "budget"]),
    ("yaml-budget-inf", lambda c: c.config(c.yaml_ok(budget="1e999")), ["merge.yml", "budget"]),
    ("yaml-density-2", lambda c: c.config(c.yaml_ok(parameters={"density": 2.0})), ["merge.yml", "density"]),
    ("yaml-not-utf8", lambda c: c.config_bytes(b"\xff\xfe"), ["merge.yml", "UTF-8"]),
    # --- parameters -------------------------------------------------------------------------------
    ("param-budget-1e999", lambda c: c.merge("--budget", "1e999"), ["--budget"]),
    ("param-budget-overflow", lambda c: c.merge("--budget", "1e30B"), ["--budget", "2^63"]),
    ("param-budget-negative", lambda c: c.merge("--budget", "-5"), ["--budget"]),
    ("param-budget-over-100%", lambda c: c.merge("--budget", "200%"), ["--budget"]),
    ("param-budget-unit", lambda c: c.merge("--budget", "5 parsecs"), ["--budget"]),
    ("param-work-memory-1e999", lambda c: c.merge("--work-memory", "1e999"), ["--work-memory"]),
    ("param-work-memory-tiny", lambda c: c.merge("--work-memory", "10"), ["--work-memory"]),
    ("param-block-size-unlimited", lambda c: c.merge("--block-size", "unlimited"), ["--block-size"]),
    ("param-block-size-0", lambda c: c.merge("--block-size", "0"), ["--block-size"]),
    ("param-block-size-2GiB", lambda c: c.merge("--block-size", "2GiB"), ["--block-size"]),
    ("param-block-size-nan", lambda c: c.merge("--block-size", "nan"), ["--block-size"]),
    ("param-fidelity-nan", lambda c: c.merge("--fidelity", "nan"), ["--fidelity"]),
    ("param-fidelity-inf", lambda c: c.merge("--fidelity", "inf"), ["--fidelity"]),
    ("param-fidelity-0", lambda c: c.merge("--fidelity", "0"), ["--fidelity"]),
    ("param-seed-negative", lambda c: c.merge("--seed", "-1"), ["--seed"]),
    ("param-seed-huge", lambda c: c.merge("--seed", str(2**70)), ["--seed"]),
    ("param-density-2", lambda c: c.merge("-p", "density=2"), ["density"]),
    ("param-density-nan", lambda c: c.merge("-p", "density=nan"), ["density"]),
    ("param-deeply-nested", lambda c: c.merge("-p", "density=" + deep(D)), ["density", "nested"]),
    ("param-syntax", lambda c: c.merge("-p", "density"), ["--param"]),
    ("param-unknown-expert", lambda c: c.merge("-p", "nobody:weight=1"), ["--param", "nobody"]),
    ("param-unknown-name", lambda c: c.merge("-p", "frobnicity=1"), ["frobnicity"]),
    ("param-unknown-method", lambda c: c.merge("--method", "frob"), ["frob"]),
    ("cli-unknown-option", lambda c: c.merge("--frobnicate", "2"), ["--frobnicate"]),
    ("cli-unknown-command", lambda c: ["frobnicate"], ["frobnicate"]),
    ("cli-missing-value", lambda c: c.merge("--budget"), ["--budget"]),
    ("search-eval-timeout-nan", lambda c: ["search", "--out", str(c.out), "--eval-timeout", "nan"], ["--eval-timeout"]),
    ("cli-seed-not-int", lambda c: c.merge("--seed", "x"), ["--seed"]),
    # --- paths --------------------------------------------------------------------------------------
    ("out-is-a-file", out_file, ["--out", "a-file"]),
    ("out-under-a-file", out_under_file, ["--out", "a-file"]),
    ("out-not-empty", out_nonempty, ["--out", "not empty"]),
    ("out-symlink-to-empty-folder", out_symlink("empty"), ["--out", "symbolic link"]),
    ("out-dangling-symlink", out_symlink("dangling"), ["--out", "symbolic link"]),
    ("out-name-too-long", lambda c: c.merge(out=c.tmp / ("n" * 250)), ["--out", "too long"]),
    ("out-path-over-path-max", lambda c: c.merge(out=c.tmp / "/".join(["d" * 200] * 25)), ["--out", "PATH_MAX"]),
    ("out-inside-base", lambda c: c.merge(out=c.base / "merged"), ["--out", "inside the input"]),
    ("out-inside-expert", lambda c: c.merge(out=c.experts[0] / "sub" / "merged"), ["--out", "inside the input"]),
    (
        "base-missing",
        lambda c: ["merge", "--base", str(c.tmp / "nope"), "-e", str(c.experts[0]), "--out", str(c.out)],
        ["nope"],
    ),
    ("expert-not-a-checkpoint", lambda c: c.mkdir("emptyexp") and c.merge("-e", str(c.tmp / "emptyexp")), ["emptyexp"]),
    ("shard-symlink-leads-outside", shard_symlink_outside, ["expert1", "symbolic link"]),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    base, experts = make_family(root / "m", 2, seed=5)
    return root / "m", base, experts


def _tree(p: Path) -> set:
    return {str(x.relative_to(p)) for x in p.rglob("*") if x.relative_to(p).parts[0] != "mergepipe-home"}


def test_the_table_is_large_enough():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_refused_cleanly(case, pristine, tmp_path, monkeypatch, capsys):
    from mergepipe.storage.base import IOCounters

    name, setup, expect = case
    src, base, experts = pristine
    shutil.copytree(src, tmp_path / "m")
    c = Ctx(tmp_path, tmp_path / "m" / base.name, [tmp_path / "m" / e.name for e in experts])
    args = setup(c)
    before = _tree(tmp_path)
    roles = []
    real_add = IOCounters.add_read

    def spy(self, role, nbytes, requests=1):
        roles.append(role)
        return real_add(self, role, nbytes, requests)

    monkeypatch.setattr(IOCounters, "add_read", spy)
    code, out, err = run_cli(args, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for e in expect:
        assert e in lines[0], (e, lines[0])
    assert out == ""
    assert _tree(tmp_path) == before, "a refusal may create nothing"
    assert not {"base", "expert"} & set(roles), f"tensor bytes were read: {roles}"


def test_deeply_nested_config_json_is_copied_not_a_crash(pristine, tmp_path):
    """An unparseable config.json is copied unchanged; one nested deeper than the parser's
    recursion limit used to raise RecursionError after every tensor was written."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.commit.manifest import verify_snapshot
    from mergepipe.pipeline import merge

    src, base, experts = pristine
    shutil.copytree(src, tmp_path / "m")
    b = tmp_path / "m" / base.name
    doc = ("[" * D + "]" * D).encode()
    (b / "config.json").write_bytes(doc)
    r = merge(
        str(b),
        [(e.name, str(tmp_path / "m" / e.name)) for e in experts],
        "ties",
        str(tmp_path / "out"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
        out_dtype="F16",
    )
    assert verify_snapshot(r.out)["ok"] and (Path(r.out) / "config.json").read_bytes() == doc
