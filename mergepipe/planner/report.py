"""A plan in plain words and pictures: ``mergepipe explain PLAN [--html OUT.html] [--plot OUT.png]``.

Where a plan's bytes go, at a glance: per layer and per expert, how many of the experts' blocks
are read exactly, merged from a sketch (fidelity tiers) or skipped; the expert bytes per layer and
per expert against the budget; after a merge, the estimated bytes per role beside what the
storage counters realized (from the snapshot's manifest); and one paragraph of plain words that
says the same. Pure Python over the :class:`~mergepipe.planner.plan.Plan` (no numpy, no torch):
the HTML page is self-contained (inline SVG and CSS, no script, no external asset);
the PNG needs matplotlib (the ``bench`` extra).

Counting rules (the page states them): a block is one of the catalog's blocks of a floating-point
tensor (``TensorPlan.n_blocks``), counted once per expert; "exact" are ``TensorExpert.blocks``,
"sketch" ``TensorExpert.sketch_blocks``, "skipped" the rest (unread: the expert counts as equal
to the base there; blocks whose task vector is zero are among them). Bytes per block are one
pass over the selected blocks (``TensorExpert.bytes`` + ``sketch_bytes``); the plan's expert-read
estimate (``Plan.io.expert_read_bytes``) also counts the gaps its coalesced reads bridge and the
extra passes of multi-pass tensors, so it can be larger than their sum.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from mergepipe.formats.safetensors import FLOAT_DTYPES
from mergepipe.methods.params import layer_index
from mergepipe.planner.plan import Plan

#: row label of the tensors without a layer index (embeddings, final norm, lm_head)
OUTER = "outside layers"

#: colours of the three block fates (colour-blind-safe: dark teal, orange, light grey)
COLOURS = {"exact": "#1b7f79", "sketch": "#f28e2b", "skipped": "#d9d9d9"}


@dataclass
class Cell:
    """Blocks of one (layer, expert) pair by fate, and the expert bytes they cost (one pass)."""

    exact: int = 0
    sketch: int = 0
    skipped: int = 0
    exact_bytes: int = 0
    sketch_bytes: int = 0

    @property
    def blocks(self) -> int:
        return self.exact + self.sketch + self.skipped

    @property
    def bytes(self) -> int:
        return self.exact_bytes + self.sketch_bytes

    def add(self, other: Cell) -> None:
        for f in ("exact", "sketch", "skipped", "exact_bytes", "sketch_bytes"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class BlockGrid:
    """The plan's blocks as rows (layers in order, then :data:`OUTER`) x experts.

    Attributes:
        rows: row labels (``"layer 0"`` ...; :data:`OUTER` last when present).
        experts: expert names, in the plan's order.
        cells: ``cells[row][expert index]``.
    """

    rows: list[str]
    experts: list[str]
    cells: dict[str, list[Cell]] = field(default_factory=dict)

    def row_total(self, row: str) -> Cell:
        t = Cell()
        for c in self.cells[row]:
            t.add(c)
        return t

    def expert_total(self, i: int) -> Cell:
        t = Cell()
        for r in self.rows:
            t.add(self.cells[r][i])
        return t

    def total(self) -> Cell:
        t = Cell()
        for r in self.rows:
            t.add(self.row_total(r))
        return t


def block_grid(plan: Plan) -> BlockGrid:
    """Count ``plan``'s floating-point blocks per (layer, expert) by fate (module docstring)."""
    names = [e.name for e in plan.experts]
    acc: dict[int | None, list[Cell]] = {}
    for tp in plan.tensors:
        if tp.dtype not in FLOAT_DTYPES:
            continue
        row = acc.setdefault(layer_index(tp.name), [Cell() for _ in names])
        by = {te.expert: te for te in tp.experts}
        for i in range(len(names)):
            te = by.get(i)
            c = Cell()
            if te is not None:
                c.exact = sum(b1 - b0 for b0, b1 in te.blocks)
                c.sketch = sum(b1 - b0 for b0, b1 in te.sketch_blocks)
                c.exact_bytes, c.sketch_bytes = te.bytes, te.sketch_bytes
            c.skipped = tp.n_blocks - c.exact - c.sketch
            row[i].add(c)
    layers = sorted(k for k in acc if k is not None)
    grid = BlockGrid([f"layer {k}" for k in layers] + ([OUTER] if None in acc else []), names)
    for k in layers:
        grid.cells[f"layer {k}"] = acc[k]
    if None in acc:
        grid.cells[OUTER] = acc[None]
    return grid


def human(n: float | None) -> str:
    """Bytes in binary units (``12.3 MiB``); ``unlimited`` for None."""
    if n is None:
        return "unlimited"
    x = float(n)
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or u == "TiB":
            return f"{x:.0f} {u}" if u == "B" else f"{x:.1f} {u}"
        x /= 1024
    return str(x)


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def terms(plan: Plan) -> list[tuple[str, str]]:
    """The words :func:`summary` and the per-tensor explanations use, each defined once."""
    out = [
        (
            "block",
            f"a run of whole rows of one tensor, about {human(plan.block_bytes)} of the base, the unit the "
            "planner reads, sketches or skips; counted once per expert",
        ),
        ("exact", "the expert's bytes of the block are read and merged as they are"),
        (
            "sketch",
            "the block is merged from the first 1-3 sign planes of its sketch (recorded by `analyze`; "
            "its bytes count against the budget like expert bytes)",
        ),
        (
            "skipped",
            "not read: the merge treats the expert as equal to the base there (blocks whose task vector "
            "is zero are always skipped)",
        ),
        (
            "retained energy",
            "the estimated share of the task-vector energy (sum of squared deltas, weighted) the full-budget "
            "merge keeps that this plan keeps",
        ),
    ]
    texts = " ".join(tp.explain for tp in plan.tensors)
    if "trim key>=" in texts:
        out.append(
            (
                "trim key>=K",
                "magnitude trim (TIES' density): an entry is kept when its magnitude key, |delta| rounded to "
                "bfloat16 read as a 15-bit integer, is at least K; K is fixed at plan time from the catalog's "
                "histograms so that the density's share of entries survives",
            )
        )
    if "keep keys in [" in texts:
        out.append(
            (
                "keep keys in [a, b)",
                "breadcrumbs' window of magnitude keys: below a is trimmed, from b up are dropped as outliers",
            )
        )
    if "pre-pass" in texts:
        out.append(
            (
                "pre-pass",
                "an extra read of a tensor's selected blocks for a whole-tensor statistic "
                "(L1 rescale sums, an exact threshold) before the merge pass",
            )
        )
    return out


def summary(plan: Plan, manifest: dict | None = None) -> str:
    """One paragraph of plain words: what the plan merges, under which budget, how many blocks
    it reads exactly / from sketches / skips, where the bytes go, what it keeps, and (with the
    manifest of its snapshot) what the merge realized."""
    g = block_grid(plan)
    t = g.total()
    k = len(plan.experts)
    names = ", ".join(e.name for e in plan.experts)
    if plan.budget_bytes is None:
        budget = "With no expert-I/O budget"
    else:
        budget = (
            f"Under an expert-I/O budget of {human(plan.budget_bytes)} "
            f"({_pct(plan.budget_bytes, plan.expert_bytes_total)} of the experts' {human(plan.expert_bytes_total)})"
        )
    reads = (
        f"{budget}, it reads {t.exact:,} of the experts' {t.blocks:,} blocks exactly ({human(t.exact_bytes)})"
        + (f", merges {t.sketch:,} from their sketches ({human(t.sketch_bytes)})" if t.sketch else "")
        + (f" and skips the other {t.skipped:,}." if t.skipped else " and skips none.")
    )
    words = [
        f"This plan merges {k} expert{'s' if k != 1 else ''} ({names}) into the base with {plan.method}.",
        reads,
        f"In all it expects to read {human(plan.io.expert_read_bytes)} from the experts "
        f"({_pct(plan.io.expert_read_bytes, plan.expert_bytes_total)} of their size), "
        f"{human(plan.io.base_read_bytes)} from the base, and to write {human(plan.io.output_write_bytes)}.",
    ]
    layered = [r for r in g.rows if r != OUTER]
    if layered and t.bytes:
        top = max(layered, key=lambda r: g.row_total(r).bytes)
        least = min(layered, key=lambda r: g.row_total(r).bytes)
        if top != least:
            words.append(
                f"The most expert bytes go to {top} ({human(g.row_total(top).bytes)}), the fewest to {least} "
                f"({human(g.row_total(least).bytes)})."
            )
    words.append(
        f"It keeps an estimated {plan.retained_energy:.1%} of the task-vector energy the full-budget merge keeps."
    )
    if manifest is not None:
        est, real = manifest["io"]["estimated"], manifest["io"]["realized"]
        words.append(
            f"The merge then read {human(real['expert_read_bytes'])} from the experts (estimated "
            f"{human(est['expert_read_bytes'])}) and wrote {human(real['output_write_bytes'])}, counted by the "
            "storage layer."
        )
    return " ".join(words)


def io_rows(plan: Plan, manifest: dict | None) -> list[tuple[str, int, int | None]]:
    """``(role, estimated bytes, realized bytes or None)`` for base read, expert read (and its
    sketch part), output write: the estimate from the manifest when given (it is the plan's),
    else from the plan."""
    est: dict[str, Any] = manifest["io"]["estimated"] if manifest else plan.io.model_dump()
    real: dict[str, Any] | None = manifest["io"]["realized"] if manifest else None
    rows: list[tuple[str, int, int | None]] = []
    for key, label in (
        ("base_read_bytes", "base read"),
        ("expert_read_bytes", "expert read"),
        ("output_write_bytes", "output write"),
    ):
        rows.append((label, int(est.get(key, 0)), None if real is None else int(real.get(key, 0))))
    return rows


# ---- HTML ----------------------------------------------------------------------------------------

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.4em;margin-bottom:.2em} h2{font-size:1.1em;margin-top:1.8em}
p.summary{font-size:1.05em;background:#f6f8f8;border-left:4px solid #1b7f79;padding:.7em 1em}
dl.terms{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em;font-size:.92em}
dl.terms dt{font-weight:600} dl.terms dd{margin:0}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border-bottom:1px solid #e3e3e3;padding:.25em .7em;text-align:right}
th:first-child,td:first-child{text-align:left}
.legend span{display:inline-block;width:.9em;height:.9em;margin:0 .3em 0 1em;vertical-align:-.1em}
svg text{font:12px system-ui,sans-serif;fill:#333}
.muted{color:#666;font-size:.88em}
"""


def _svg_heatmap(g: BlockGrid) -> str:
    """Rows x experts; each cell a bar split into exact / sketch / skipped by block count."""
    lw, cw, ch, pad = 120, max(90, min(180, 720 // max(1, len(g.experts)))), 18, 4
    w, h = lw + cw * len(g.experts) + 10, 28 + ch * len(g.rows) + 6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" id="heatmap">']
    for j, name in enumerate(g.experts):
        x = lw + j * cw + cw / 2
        out.append(f'<text x="{x:.1f}" y="16" text-anchor="middle">{html.escape(name)}</text>')
    for i, row in enumerate(g.rows):
        y = 26 + i * ch
        out.append(f'<text x="{lw - 8}" y="{y + ch - 5}" text-anchor="end">{html.escape(row)}</text>')
        for j, c in enumerate(g.cells[row]):
            x0, width = lw + j * cw + pad / 2, cw - pad
            tip = (
                f"{row}, {g.experts[j]}: {c.exact} exact, {c.sketch} sketch, {c.skipped} skipped of "
                f"{c.blocks} blocks; {c.bytes} B"
            )
            out.append(
                f'<g class="cell" data-row="{html.escape(row)}" data-expert="{html.escape(g.experts[j])}" '
                f'data-exact="{c.exact}" data-sketch="{c.sketch}" data-skipped="{c.skipped}"><title>'
                f"{html.escape(tip)}</title>"
            )
            x = x0
            for fate, n in (("exact", c.exact), ("sketch", c.sketch), ("skipped", c.skipped)):
                if n and c.blocks:
                    ww = width * n / c.blocks
                    out.append(
                        f'<rect x="{x:.2f}" y="{y + 1}" width="{ww:.2f}" height="{ch - 3}" fill="{COLOURS[fate]}"/>'
                    )
                    x += ww
            out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _svg_bars(labels: list[str], parts: list[tuple[int, int]], limit: int | None, limit_label: str, ident: str) -> str:
    """Horizontal bars of (exact, sketch) bytes per label, with a dashed line at ``limit``."""
    lw, bw, bh = 120, 640, 16
    top = max([a + b for a, b in parts] + [limit or 0, 1])
    h = 12 + bh * len(labels) + (22 if limit else 6)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{lw + bw + 120}" height="{h}" role="img" id="{ident}">']
    for i, (lab, (a, b)) in enumerate(zip(labels, parts)):
        y = 8 + i * bh
        out.append(f'<text x="{lw - 8}" y="{y + bh - 4}" text-anchor="end">{html.escape(lab)}</text>')
        wa, wb = bw * a / top, bw * b / top
        out.append(f'<rect x="{lw}" y="{y + 1}" width="{wa:.2f}" height="{bh - 3}" fill="{COLOURS["exact"]}"/>')
        if b:
            out.append(
                f'<rect x="{lw + wa:.2f}" y="{y + 1}" width="{wb:.2f}" height="{bh - 3}" fill="{COLOURS["sketch"]}"/>'
            )
        tx = lw + max(wa + wb, bw * limit / top + 2 if limit else 0) + 6  # clear of the budget line
        out.append(f'<text x="{tx:.2f}" y="{y + bh - 4}">{human(a + b)}</text>')
    if limit:
        x = lw + bw * limit / top
        y1 = 8 + bh * len(labels)
        out.append(f'<line x1="{x:.2f}" y1="4" x2="{x:.2f}" y2="{y1}" stroke="#c0392b" stroke-dasharray="4 3"/>')
        out.append(
            f'<text x="{x:.2f}" y="{y1 + 14}" text-anchor="middle" fill="#c0392b">{html.escape(limit_label)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _table(ident: str, head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table id="{ident}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def render_html(plan: Plan, manifest: dict | None = None) -> str:
    """The self-contained page (module docstring). Every number in its tables is exact (bytes as
    integers beside the binary-unit figure), so a reader, or a test, can check it against the plan
    and the manifest."""
    g = block_grid(plan)
    t = g.total()
    budget = plan.budget_bytes
    legend = "".join(f'<span style="background:{COLOURS[f]}"></span>{f}' for f in ("exact", "sketch", "skipped"))
    per_layer = [g.row_total(r) for r in g.rows]
    per_expert = [g.expert_total(i) for i in range(len(g.experts))]
    share = None if budget is None else budget / max(1, len(g.experts))
    io_tbl = [
        [
            role,
            f"{est:,}",
            "-" if real is None else f"{real:,}",
            "-" if real is None else _pct(real, est) if est else "-",
        ]
        for role, est, real in io_rows(plan, manifest)
    ]
    io_note = (
        "Realized: the storage layer's byte counters, from the snapshot's manifest "
        f"(snapshot {html.escape(str(manifest.get('snapshot_id', '')))})."
        if manifest
        else "No manifest given (<code>--manifest</code>): estimates only. Realized bytes appear after a merge."
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>mergepipe plan {plan.digest[:16]}</title><style>{_CSS}</style></head><body>",
        f"<h1>Plan {plan.digest[:16]}: {html.escape(plan.method)}, {len(plan.experts)} experts</h1>",
        f'<p class="muted">plan digest {plan.digest}; expert-I/O budget {human(budget)}'
        + (f" ({budget:,} B)" if budget is not None else "")
        + f"; experts' size {human(plan.expert_bytes_total)} ({plan.expert_bytes_total:,} B)</p>",
        f'<p class="summary" id="summary">{html.escape(summary(plan, manifest))}</p>',
        '<dl class="terms">'
        + "".join(f"<dt>{html.escape(a)}</dt><dd>{html.escape(b)}</dd>" for a, b in terms(plan))
        + "</dl>",
        "<h2>Blocks per layer and expert</h2>",
        f'<p class="legend">{legend}</p>',
        _svg_heatmap(g),
        f'<p class="muted">Each bar is one layer of one expert, split by how many of its {t.blocks:,} '
        "blocks (all experts) are read exactly, merged from a sketch, or skipped. Hover for the counts.</p>",
        "<h2>Expert bytes per layer</h2>",
        _svg_bars(g.rows, [(c.exact_bytes, c.sketch_bytes) for c in per_layer], None, "", "bytes-per-layer"),
        "<h2>Expert bytes per expert, against the budget</h2>",
        _svg_bars(
            g.experts,
            [(c.exact_bytes, c.sketch_bytes) for c in per_expert],
            int(share) if share else None,
            f"budget / {len(g.experts)} = {human(share)}",
            "bytes-per-expert",
        ),
        f'<p class="muted">Selected blocks, one pass: {t.bytes:,} B of a budget of {human(budget)}. The plan\'s '
        f"expert-read estimate, {plan.io.expert_read_bytes:,} B, also counts the gaps its coalesced reads bridge "
        "and the extra passes of multi-pass tensors.</p>",
        _table(
            "layers",
            ["layer", "exact blocks", "sketch blocks", "skipped blocks", "exact bytes", "sketch bytes"],
            [
                [r, f"{c.exact:,}", f"{c.sketch:,}", f"{c.skipped:,}", f"{c.exact_bytes:,}", f"{c.sketch_bytes:,}"]
                for r, c in zip(g.rows, per_layer)
            ],
        ),
        _table(
            "experts",
            ["expert", "exact blocks", "sketch blocks", "skipped blocks", "exact bytes", "sketch bytes"],
            [
                [n, f"{c.exact:,}", f"{c.sketch:,}", f"{c.skipped:,}", f"{c.exact_bytes:,}", f"{c.sketch_bytes:,}"]
                for n, c in zip(g.experts, per_expert)
            ],
        ),
        "<h2>Estimated and realized bytes</h2>",
        _table("io", ["role", "estimated bytes", "realized bytes", "realized / estimated"], io_tbl),
        f'<p class="muted">{io_note}</p>',
        f'<p class="muted">retained energy (estimated) {plan.retained_energy:.4f}</p>',
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def render_png(plan: Plan, path: str, manifest: dict | None = None) -> None:
    """The heat map and the bytes per layer as a PNG (matplotlib, the ``bench`` extra).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    g = block_grid(plan)
    img = []
    for r in g.rows:
        line = []
        for c in g.cells[r]:
            n = max(1, c.blocks)
            mix = [
                sum(
                    to_rgb(COLOURS[f])[k] * v / n
                    for f, v in (("exact", c.exact), ("sketch", c.sketch), ("skipped", c.skipped))
                )
                for k in range(3)
            ]
            line.append(mix)
        img.append(line)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.32 * len(g.rows) + 2), gridspec_kw={"width_ratios": [1, 1.3]})
    a1.imshow(img, aspect="auto")
    a1.set_xticks(range(len(g.experts)), g.experts)
    a1.set_yticks(range(len(g.rows)), g.rows)
    a1.set_title("blocks: exact / sketch / skipped (colour mix)")
    ex = [g.row_total(r).exact_bytes / 2**20 for r in g.rows]
    sk = [g.row_total(r).sketch_bytes / 2**20 for r in g.rows]
    a2.barh(g.rows, ex, color=COLOURS["exact"], label="exact")
    a2.barh(g.rows, sk, left=ex, color=COLOURS["sketch"], label="sketch")
    a2.invert_yaxis()
    a2.set_xlabel("expert MiB")
    a2.legend(loc="lower right")
    a2.set_title(f"expert bytes per layer (budget {human(plan.budget_bytes)})")
    fig.suptitle(f"plan {plan.digest[:16]}: {plan.method}, {len(g.experts)} experts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # by name: the CLI writes to OUT.png.tmp, then renames
    plt.close(fig)
