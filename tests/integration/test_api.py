"""The public Python API (``import mergepipe``; issue 25 item 4): the README's example runs as
written, ``import mergepipe`` stays cheap, and the functions build what the CLI builds (same plan
digest, same snapshot id on the same inputs), with typed results and refusals naming the field."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.errors import InputError
from testkit.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _readme_python_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def _env(tmp_path: Path) -> dict:
    env = {**os.environ, "MERGEPIPE_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_readme_python_example_runs(tmp_path):
    pytest.importorskip("torch")
    code = _readme_python_example()
    assert "mergepipe.merge(" in code and "mergepipe.plan(" in code
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan_line, snap_line = r.stdout.strip().splitlines()
    m = re.fullmatch(r"plan [0-9a-f]{12}: reads (\d+) of (\d+) expert bytes", plan_line)
    assert m and 0 < int(m.group(1)) <= int(m.group(2)) // 2  # the 50% budget held
    assert re.fullmatch(r"snapshot snap-[0-9a-f]+ at merged, retained energy \d+\.\d%", snap_line)
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert snap_line.split()[1] == manifest["snapshot_id"]
    assert manifest["io"]["realized"]["expert_read_bytes"] <= int(m.group(2)) // 2


def test_import_mergepipe_loads_neither_torch_nor_numpy():
    code = (
        "import sys, mergepipe; heavy = [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules]; "
        "print(heavy, sorted(mergepipe.__all__) == sorted(set(mergepipe.__all__)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(Path("/nonexistent")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] True"


def test_every_exported_name_resolves_and_is_documented():
    import mergepipe

    for name in mergepipe.__all__:
        obj = getattr(mergepipe, name)
        if name != "__version__":
            assert (obj.__doc__ or "").strip(), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mergepipe.nope  # noqa: B018


def test_mergepipe_search_is_callable_even_after_its_package_is_imported():
    import mergepipe
    import mergepipe.search.runner  # binds the package as the attribute mergepipe.search

    assert callable(mergepipe.search)
    with pytest.raises(InputError, match="needs its configuration and an evaluator"):
        mergepipe.search(Path("/nonexistent/never-written"))


@pytest.fixture
def family(tmp_path):
    pytest.importorskip("torch")
    from testkit.synth import make_family

    return make_family(tmp_path / "fam", n_experts=2, n_shards=1)


def test_plan_and_merge_build_what_the_cli_builds(family, tmp_path, monkeypatch, capsys):
    import mergepipe

    base, experts = family
    cat = tmp_path / "cat.sqlite"
    args = ["--base", str(base), "-e", f"a={experts[0]}", "-e", f"b={experts[1]}", "-m", "ties"]
    args += ["-p", "density=0.5", "--budget", "40%", "--catalog", str(cat)]
    code, out, err = run_cli(["plan", *args, "--json"], monkeypatch, capsys)
    assert code == 0, err
    cli_plan = json.loads(out)
    code, out, err = run_cli(["merge", *args, "--out", str(tmp_path / "cli"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    cli_merge = json.loads(out)

    req = {
        "base": str(base),
        "experts": [{"name": "a", "uri": str(experts[0])}, {"name": "b", "uri": str(experts[1])}],
        "method": "ties",
        "parameters": {"density": 0.5},
        "budget": "40%",
    }
    p = mergepipe.plan(req, catalog=cat)
    assert isinstance(p, mergepipe.Plan)
    assert p.digest == cli_plan["plan_digest"] and p.io.model_dump() == cli_plan["io"]
    res = mergepipe.merge(req, output=tmp_path / "api", catalog=str(cat))
    assert isinstance(res, mergepipe.MergeResult) and res.plan.digest == p.digest
    s = res.summary()
    assert s["snapshot_id"] == cli_merge["snapshot_id"] and s["io"] == cli_merge["io"]
    v = mergepipe.verify(res.out)
    assert v.ok and v.snapshot_id == s["snapshot_id"] and v.files >= 1 and v.problems == []
    # a rerun commits nothing new
    assert mergepipe.merge(req, output=tmp_path / "api", catalog=cat).already_committed


def test_analyze_reports_what_it_read_and_caches(family, tmp_path):
    import mergepipe

    base, experts = family
    cat = tmp_path / "cat.sqlite"
    a = mergepipe.analyze(str(base), [str(e) for e in experts], catalog=cat, pairs=True)
    assert isinstance(a, mergepipe.Analysis) and len(a.experts) == 2
    assert a.bytes_read["expert"] > 0 and all(e["energy"] > 0 and e["blocks"] > 0 for e in a.experts)
    assert a.pairs and a.pairs[0]["tensors"] > 0
    again = mergepipe.analyze(str(base), [str(e) for e in experts], catalog=cat)
    assert again.bytes_read["expert"] == 0 and again.experts == a.experts  # cached by identity
    with pytest.raises(InputError, match="two distinct experts"):
        mergepipe.analyze(str(base), [str(experts[0])], catalog=cat, pairs=True)


def test_verify_names_a_changed_file(family, tmp_path):
    import mergepipe

    base, experts = family
    req = mergepipe.MergeRequest(
        base=str(base), experts=[{"name": "a", "uri": str(experts[0])}], method="task_arithmetic"
    )
    res = mergepipe.merge(req, output=tmp_path / "m", catalog=tmp_path / "cat.sqlite")
    f = next(Path(res.out).glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    v = mergepipe.verify(res.out)
    assert not v and not v.ok and any(f.name in pr for pr in v.problems)


def test_bad_requests_name_the_field(tmp_path):
    import mergepipe

    with pytest.raises(InputError) as e:
        mergepipe.plan({"base": "b", "experts": [{"name": "a"}]}, catalog=tmp_path / "c.sqlite")
    assert e.value.loc == ("experts", 0, "uri") and "experts.0.uri" in str(e.value)
    with pytest.raises(InputError, match="no output"):
        mergepipe.merge({"base": "b", "experts": [{"name": "a", "uri": "a"}]}, catalog=tmp_path / "c.sqlite")
    with pytest.raises(InputError, match="expected a MergeRequest"):
        mergepipe.plan(42)
    with pytest.raises(InputError, match="density"):
        mergepipe.plan(
            {"base": "b", "experts": [{"name": "a", "uri": "a"}], "method": "ties", "parameters": {"density": 7}},
            catalog=tmp_path / "c.sqlite",
        )
    assert not (tmp_path / "b").exists()


def test_the_export_list_is_the_lazy_table():
    import mergepipe

    assert sorted(mergepipe.__all__) == sorted(["__version__", *mergepipe._LAZY])
