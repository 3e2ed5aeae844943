"""`mergepipe explain PLAN --html OUT.html`: the plan page's numbers are the plan's and the
manifest's (checked by parsing the page, against sums computed here from the raw plan JSON), the
page is self-contained, and the text explain leads with the same summary and defines its terms."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from testkit.harness import run_cli
from testkit.synth import make_family

FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


class Page(HTMLParser):
    """Tables by id (rows of cell texts), heat-map cells (their data-* attributes), the summary,
    and every tag and attribute seen (for the self-containment checks)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.cells: list[dict[str, str]] = []
        self.tags: list[tuple[str, dict]] = []
        self.summary = ""
        self._table: str | None = None
        self._row: list[str] | None = None
        self._text: list[str] | None = None
        self._in_summary = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._text = []
        elif tag == "g" and a.get("class") == "cell":
            self.cells.append(a)
        elif tag == "p" and a.get("id") == "summary":
            self._in_summary = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._text is not None and self._row is not None:
            self._row.append("".join(self._text).strip())
            self._text = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "p":
            self._in_summary = False

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)
        if self._in_summary:
            self.summary += data


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def expected(plan: dict) -> tuple[dict, dict]:
    """Per row (layer) and per expert: [exact, sketch, skipped, exact bytes, sketch bytes],
    summed straight from the plan JSON."""
    names = [e["name"] for e in plan["experts"]]
    rows: dict[str, list[int]] = {}
    experts = {n: [0, 0, 0, 0, 0] for n in names}
    for t in plan["tensors"]:
        if t["dtype"] not in FLOAT:
            continue
        m = LAYER.search(t["name"])
        row = rows.setdefault(f"layer {m.group(1)}" if m else "outside layers", [0, 0, 0, 0, 0])
        by = {te["expert"]: te for te in t["experts"]}
        for i, n in enumerate(names):
            te = by.get(i)
            ex = sum(b - a for a, b in te["blocks"]) if te else 0
            sk = sum(b - a for a, b in te.get("sketch_blocks", [])) if te else 0
            add = [ex, sk, t["n_blocks"] - ex - sk, te["bytes"] if te else 0, te.get("sketch_bytes", 0) if te else 0]
            for acc in (row, experts[n]):
                for k in range(5):
                    acc[k] += add[k]
    return rows, experts


def check_page(page_file: Path, plan_file: Path, manifest: dict | None) -> Page:
    text = page_file.read_text()
    pg = Page()
    pg.feed(text)
    plan = json.loads(plan_file.read_text())
    # self-contained: no script, no stylesheet link, no external URL (the SVG namespace is a name)
    assert not [t for t, _ in pg.tags if t in ("script", "link", "img", "iframe")]
    assert not [a for _, attrs in pg.tags for k, a in attrs.items() if k in ("src", "href")]
    assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", text)
    rows, experts = expected(plan)
    layers = {r[0]: [_num(c) for c in r[1:]] for r in pg.tables["layers"][1:]}
    assert layers == rows
    per_expert = {r[0]: [_num(c) for c in r[1:]] for r in pg.tables["experts"][1:]}
    assert per_expert == experts
    # the heat map draws the same counts, one cell per (layer, expert)
    assert len(pg.cells) == len(rows) * len(experts)
    for c in pg.cells:
        want = expected_cell(plan, c["data-row"], c["data-expert"])
        assert [int(c["data-exact"]), int(c["data-sketch"]), int(c["data-skipped"])] == want
    io = {r[0]: r[1:] for r in pg.tables["io"][1:]}
    src = manifest["io"]["estimated"] if manifest else plan["io"]
    for role, key in (
        ("base read", "base_read_bytes"),
        ("expert read", "expert_read_bytes"),
        ("output write", "output_write_bytes"),
    ):
        assert _num(io[role][0]) == src[key]
        if manifest:
            assert _num(io[role][1]) == manifest["io"]["realized"][key]
        else:
            assert io[role][1] == "-"
    assert f"{plan['retained_energy']:.1%}" in pg.summary
    tot = [sum(v[k] for v in experts.values()) for k in range(3)]
    assert f"reads {tot[0]:,} of the experts' {sum(tot):,} blocks exactly" in pg.summary
    assert (f"skips the other {tot[2]:,}." if tot[2] else "skips none.") in pg.summary
    return pg


def expected_cell(plan: dict, row: str, expert: str) -> list[int]:
    i = [e["name"] for e in plan["experts"]].index(expert)
    out = [0, 0, 0]
    for t in plan["tensors"]:
        m = LAYER.search(t["name"])
        if t["dtype"] not in FLOAT or (f"layer {m.group(1)}" if m else "outside layers") != row:
            continue
        te = next((x for x in t["experts"] if x["expert"] == i), None)
        ex = sum(b - a for a, b in te["blocks"]) if te else 0
        sk = sum(b - a for a, b in te.get("sketch_blocks", [])) if te else 0
        out[0], out[1], out[2] = out[0] + ex, out[1] + sk, out[2] + t["n_blocks"] - ex - sk
    return out


def _plan_and_merge(base, experts, tmp, monkeypatch, capsys, *params):
    plan = tmp / "plan.json"
    ex = [a for n, e in experts for a in ("-e", f"{n}={e}")]
    code, _, err = run_cli(["plan", "--base", str(base), *ex, *params, "-o", str(plan), "--json"], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(["execute", str(plan), "--out", str(tmp / "snap"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    return plan, json.loads((tmp / "snap" / "manifest.json").read_text())


def test_plan_page_numbers_match_plan_and_manifest_synthetic(tmp_path, monkeypatch, capsys):
    base, experts = make_family(tmp_path / "m", 3, seed=5)
    named = [(f"x{i}", e) for i, e in enumerate(experts)]
    plan, manifest = _plan_and_merge(
        base, named, tmp_path, monkeypatch, capsys, "-m", "ties", "-p", "density=0.5", "-b", "25%"
    )
    page = tmp_path / "page.html"
    code, out, err = run_cli(["explain", str(plan), "--html", str(page)], monkeypatch, capsys)
    assert code == 0, err
    check_page(page, plan, None)  # no manifest beside the plan, none given: estimates only
    code, out, err = run_cli(
        ["explain", str(plan), "--html", str(page), "--manifest", str(tmp_path / "snap")], monkeypatch, capsys
    )
    assert code == 0, err
    check_page(page, plan, manifest)
    # text explain: the same summary first, its terms defined once, no per-tensor lines by default
    lines = out.splitlines()
    summary = Page()
    summary.feed(page.read_text())
    assert " ".join(" ".join(lines[1:6]).split()).startswith(summary.summary.split(".")[0])
    assert sum("trim key>=K:" in ln for ln in lines) == 1  # ties: the term is defined, once
    n_tensors = len(json.loads(plan.read_text())["tensors"])
    assert "per tensor" not in out and "of its energy" not in out and "--tensors" in out
    code, out2, _ = run_cli(["explain", str(plan), "--tensors"], monkeypatch, capsys)
    assert code == 0 and "per tensor" in out2 and "of its energy" in out2
    assert len(out2.splitlines()) > len(lines) + n_tensors
    # a manifest of another plan is refused, naming the option; nothing is written
    other = tmp_path / "other.json"
    m2 = dict(manifest, plan_digest="0" * 64)
    other.write_text(json.dumps(m2))
    (tmp_path / "p2.html").unlink(missing_ok=True)
    code, out, err = run_cli(
        ["explain", str(plan), "--html", str(tmp_path / "p2.html"), "--manifest", str(other)], monkeypatch, capsys
    )
    assert code == 2 and "--manifest" in err and not (tmp_path / "p2.html").exists()


@pytest.mark.slow
def test_plan_page_of_a_tiny_zoo_merge(tiny_zoo_home, tmp_path, monkeypatch, capsys):
    """The demo's 25% plan (task_arithmetic, its recommended weight, default fidelity tiers) on
    the real tiny zoo: heat map, per-layer and per-expert tables and realized bytes all check
    against the plan and the manifest; the PNG renders too."""
    pytest.importorskip("torch")
    from mergepipe_zoo import ZooConfig

    root = tiny_zoo_home / "zoo" / ZooConfig.tiny().key()
    tb = json.loads((root / "testbed.json").read_text())
    rec = tb.get("recommended_params", {}).get("task_arithmetic", {})
    params = [a for k, v in rec.items() for a in ("-p", f"{k}={v:g}")]
    experts = [(n, root / p) for n, p in tb["experts"].items()]
    plan, manifest = _plan_and_merge(
        root / tb["base"], experts, tmp_path, monkeypatch, capsys, "-m", "task_arithmetic", *params, "-b", "25%"
    )
    page = tmp_path / "page.html"
    args = ["explain", str(plan), "--html", str(page), "--manifest", str(tmp_path / "snap")]
    png = tmp_path / "plan.png"
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        png = None
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    pg = check_page(page, plan, manifest)
    assert any(int(c["data-sketch"]) for c in pg.cells)  # the default tiers sketch some blocks at 25%
    assert manifest["io"]["realized"]["expert_read_bytes"] <= manifest["io"]["estimated"]["expert_read_bytes"]
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
