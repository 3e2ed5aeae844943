"""The docs agree with the repository and with themselves: every repository path that README.md,
docs/*.md and the scripts cite exists, and every figure quoted in several places (docs/figures.json)
reads the same everywhere it is quoted. Runs in the normal suite (fast, no network)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = json.loads((ROOT / "docs" / "figures.json").read_text())
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]
SCRIPTS = [ROOT / ".ci" / "run", *sorted((ROOT / "tests" / "k8s_apiserver").glob("*.sh"))]
TOP = {p.name for p in ROOT.iterdir()}
#: a path as docs cite it: starts at a top-level entry of the repository, slash-separated
PATH = re.compile(r"(?<![\w./~$-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*[A-Za-z0-9_-])")


def _flat(text: str) -> str:
    """Whitespace (and shell comment markers at line starts) collapsed: figures wrap across lines."""
    return re.sub(r"\s*\n\s*#?\s*", " ", text)


def cited_paths(text: str) -> set[str]:
    """Repository paths in ``text``: tokens whose first component is a top-level entry of the
    repository (README.md, mergepipe/, tests/, ...), minus placeholders; a glob ends in ``*``
    (what follows the ``*`` is not kept) and must match at least one file."""
    out = set()
    for m in PATH.finditer(text):
        if text[m.end() : m.end() + 1] == "(":  # `bench/synthetic_catalog.family(...)`: a call, not a path
            continue
        p = m.group(1).rstrip(".")
        if text[m.end() : m.end() + 1] == "*":  # `docs/benchmarks/issue23-*.json`: a glob, checked as one
            p += "*"
        first = p.split("/", 1)[0]
        if first not in TOP or first in (".", ".."):
            continue
        if any(c in p for c in "<>{}$") or "..." in p or "*" in p[:-1]:
            continue
        out.add(p)
    return out


#: folders .gitignore names: what commands write there (bench/results/, .ci/logs/) is output, not a citation
IGNORED = tuple(
    ln.strip() for ln in (ROOT / ".gitignore").read_text().splitlines() if ln.strip().endswith("/") and "*" not in ln
)
#: cited on purpose though absent, with the reason the doc gives
ABSENT = {
    "docs/quality/quality.json": "QUALITY.md: removed, cited as in the git history",
    "docs/search/raw-zoo8-fresh.jsonl.gz": "SEARCH.md: written by bench/search.py --collect after the pre-registered fresh run",
    "docs/quality/minilm.json": "QUALITY.md: the earlier-protocol MiniLM results, removed, cited as in the git history",
}


def _exists(doc: Path, p: str) -> bool:
    if p in ABSENT or p.startswith(IGNORED) or (p + "/").startswith(IGNORED):
        return True
    if p.endswith("*"):
        return any(ROOT.glob(p)) or any(doc.parent.glob(p))
    return (ROOT / p).exists() or (doc.parent / p).exists()


@pytest.mark.parametrize("doc", DOCS + SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in cited_paths(text) if not _exists(doc, p))
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"
    # markdown links relative to the document
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: link to missing {target}"


def test_the_path_finder_finds_paths():
    got = cited_paths("see tests/k8s_apiserver/README.md and docs/QUALITY.md; not ./merged, s3://b/x or bench/x.f(1)")
    assert got == {"tests/k8s_apiserver/README.md", "docs/QUALITY.md"}


@pytest.mark.parametrize("name", [k for k in FIGURES if k != "about"])
def test_repeated_figures_match(name):
    fig = FIGURES[name]
    for rel in fig["in"]:
        text = _flat((ROOT / rel).read_text())
        found = re.findall(fig["pattern"], text)
        assert found, f"{rel} does not quote {name} ({fig['pattern']!r})"
        assert set(found) == {fig["value"]}, (
            f"{rel} quotes {name} as {sorted(set(found))}, docs/figures.json {fig['value']!r}"
        )


def test_demo_help_agrees_with_the_readme_on_the_demo_size():
    """`demo --help` and the README give the same measured outcome of `--size demo`."""
    from mergepipe import cli

    info = next(i for i in cli.app.registered_commands if i.callback is cli.demo)
    assert info.callback is not None
    import typing

    helps = " ".join(
        getattr(m, "help", "") or ""
        for h in typing.get_type_hints(info.callback, include_extras=True).values()
        for m in getattr(h, "__metadata__", ())
    )
    assert f"after {FIGURES['demo_size_gates']['value']} of training" in helps
    assert "not measured" not in helps


def test_apiserver_skip_message_comes_from_the_figures():
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "operator"))
    try:
        from tests.operator.conftest import apiserver_cost
    finally:
        sys.path.pop(0)
    msg = apiserver_cost()
    assert FIGURES["apiserver_download"]["value"] in msg and FIGURES["apiserver_build"]["value"] in msg
