"""A synthetic catalog of a model family: checkpoint layouts and per-block task-vector
statistics made without any tensor, for timing the planner at sizes this machine cannot analyze
(a 7B-shaped base and K experts would be ~13.5 GB each in bf16).

Shapes: ``llama-7b`` is Llama-2-7B (32 layers, hidden 4096, intermediate 11008, 32 heads,
vocab 32000, untied ``lm_head``): 6.74 G parameters, 13.5 GB in bf16, 291 tensors, cut into
shards of at most 5 GB as ``save_pretrained`` does; ``tiny`` is bench/synthetic.py's tiny shape.

Statistics: per tensor a prototype task vector, ``N(0, σ²)`` with σ set by layer depth and
tensor kind, is drawn (16 Ki entries, float32) and its magnitude keys counted
(:func:`mergepipe.numerics.magnitude_keys`); every block is that prototype times ``2^s`` for a
block shift ``s`` in {-2, ..., 2} (mostly 0), so its octave histogram is the prototype's shifted
by ``s`` octaves and its energy ``4^s`` times, and the tensor's key histogram is the sum of the
shifted prototypes, exactly as :class:`mergepipe.catalog.stats.TensorStatsBuilder` would count
them for such data (counts scaled by the block's entries and rounded). 2-D tensors get a
three-plane sketch whose residual energy after planes 1, 2, 3 is about 36%, 13%, 5% of the
block's (a sign plane with per-row scale keeps ``2/π`` of a Gaussian block's energy). The plans
are real plans of the planner; only the numbers they are made from are drawn, deterministically
from the seed.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Analysis, CheckpointRecord
from mergepipe.catalog.digest import BLOCK_DIGEST_BYTES
from mergepipe.catalog.sketch import PLANES, SECTIONS, tensor_sketch_bytes
from mergepipe.catalog.stats import TensorStats
from mergepipe.formats.safetensors import CheckpointLayout, build_header, n_blocks, parse_header, rows_per_block
from mergepipe.numerics import OCT_SHIFT, magnitude_keys

MAX_SHARD_BYTES = 5 * 10**9
PROTO = 1 << 14


def llama_7b_shapes() -> dict[str, tuple[int, ...]]:
    """Llama-2-7B's tensor names and shapes, in checkpoint order (the test suite's Llama layout,
    :func:`testkit.synth.llama_like_shapes`, at 7B sizes)."""
    from testkit.synth import llama_like_shapes

    return llama_like_shapes(hidden=4096, inter=11008, layers=32, vocab=32000)


def _tiny_shapes() -> dict[str, tuple[int, ...]]:
    from bench.synthetic import tiny_shapes

    return tiny_shapes()


def _llama_110m_shapes() -> dict[str, tuple[int, ...]]:
    from bench.synthetic import llama_110m_shapes

    return llama_110m_shapes()


SHAPES = {"llama-7b": llama_7b_shapes, "llama-110m": _llama_110m_shapes, "tiny": _tiny_shapes}


def layout(shapes: dict[str, tuple[int, ...]], root: str, dtype: str = "BF16") -> CheckpointLayout:
    """The sharded layout of a checkpoint of ``shapes`` (headers built and parsed as a real one's)."""
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nb = math.prod(shape) * 2
        if groups[-1] and size + nb > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += nb
    n = len(groups)
    shards, tensors = {}, {}
    for k, g in enumerate(groups):
        f = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        raw = build_header(g, {"format": "pt"})
        data = sum(math.prod(s) * 2 for _, _, s in g)
        sh = parse_header(raw, f, len(raw) + data)
        shards[f] = sh
        tensors.update(sh.tensors)
    return CheckpointLayout(root=root, shards=shards, tensors=tensors, index_metadata={}, sharded=True)


def record(lay: CheckpointLayout) -> CheckpointRecord:
    ident = hashlib.sha256(repr(sorted(lay.identity_material().items())).encode() + lay.root.encode()).hexdigest()
    sig = {f: [sh.file_size, "0"] for f, sh in lay.shards.items()}
    return CheckpointRecord(lay.root, ident, sig, lay)


def _tensor_stats(
    name: str, shape: tuple[int, ...], rpb: int, nb: int, sigma: float, rng: np.random.Generator, sketch_at: int
) -> TensorStats:
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    proto = np.abs(rng.standard_normal(PROTO).astype(np.float32) * np.float32(sigma))
    keys = magnitude_keys(proto)
    octs = keys >> OCT_SHIFT
    lo, hi = int(octs.min()) - 2, int(octs.max()) + 3  # room for shifts of ±2 octaves
    c0 = np.bincount(octs - lo, minlength=hi - lo) / PROTO
    e0 = np.bincount(octs - lo, weights=proto.astype(np.float64) ** 2, minlength=hi - lo) / PROTO
    h0 = np.bincount(keys, minlength=0x8000) / PROTO
    bn = (np.minimum((np.arange(nb) + 1) * rpb, rows) - np.arange(nb) * rpb) * row_numel
    shift = rng.choice(np.arange(-2, 3), size=nb, p=[0.05, 0.2, 0.5, 0.2, 0.05])
    oc = np.zeros((nb, hi - lo), dtype=np.int64)
    oe = np.zeros((nb, hi - lo))
    hist = np.zeros(0x8000)
    for s in range(-2, 3):
        m = shift == s
        if not m.any():
            continue
        oc[m] = np.rint(np.roll(c0, s)[None, :] * bn[m, None]).astype(np.int64)
        oe[m] = np.roll(e0, s)[None, :] * bn[m, None] * 4.0**s
        hist += np.roll(h0, s << OCT_SHIFT) * bn[m].sum()
    hc = np.rint(hist).astype(np.int64)
    nz = np.nonzero(hc)[0]
    sq = oe.sum(axis=1)
    sketch_sq = None
    if len(shape) >= 2 and sketch_at >= 0:
        r = np.cumprod(rng.uniform(0.33, 0.39, size=(nb, PLANES)), axis=1)
        # the rank-1 tier (factors + one residual plane): a little below one plane's residual
        r1 = r[:, :1] * rng.uniform(0.85, 1.0, size=(nb, 1))
        sketch_sq = sq[:, None] * np.concatenate([r, r1], axis=1)
    numel = int(bn.sum())
    return TensorStats(
        name=name,
        numel=numel,
        rows_per_block=rpb,
        block_numel=bn.astype(np.int64),
        sq_norm=sq,
        l1=bn * float(proto.mean()) * 2.0**shift,
        max_abs=(float(proto.max()) * 2.0**shift).astype(np.float32),
        oct_lo=lo,
        oct_count=oc,
        oct_energy=oe,
        hist_keys=nz.astype(np.int32),
        hist_counts=hc[nz],
        content_sha256=hashlib.sha256(f"{name}/{sigma}".encode()).hexdigest(),
        sums=np.array([float(sq.sum()), numel * 4e-4, numel * 4e-4 + float(sq.sum()), numel * 4e-4]),
        sketch_start=sketch_at if sketch_sq is not None else -1,
        sketch_sq=sketch_sq,
        # content digests of blocks and sketch planes (the plan carries the selected ones)
        block_sha=np.zeros((nb, BLOCK_DIGEST_BYTES), dtype=np.uint8),
        sketch_sha=np.zeros((nb, SECTIONS, BLOCK_DIGEST_BYTES), dtype=np.uint8) if sketch_sq is not None else None,
    )


def family(
    shape: str = "llama-7b", experts: int = 4, block_bytes: int = DEFAULT_BLOCK_BYTES, seed: int = 0
) -> tuple[CheckpointRecord, list[CheckpointRecord], list[Analysis]]:
    """A base, ``experts`` experts of the same layout and one analysis per expert.

    Returns:
        (base record, expert records, analyses): what :class:`mergepipe.planner.planner.PlanInputs`
        takes. Nothing is written anywhere (the URIs name folders that do not exist).
    """
    shapes = SHAPES[shape]()
    base = record(layout(shapes, f"synthetic://{shape}/base"))
    recs = [record(layout(shapes, f"synthetic://{shape}/expert{i}")) for i in range(experts)]
    n_layers = 1 + max((int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")), default=0)
    analyses = []
    for i, rec in enumerate(recs):
        rng = np.random.default_rng([seed, i])
        tensors, at = {}, 0
        for name, ti in base.layout.tensors.items():
            rpb, nb = rows_per_block(ti, block_bytes), n_blocks(ti, block_bytes)
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
            kind = 0.3 if "norm" in name else 1.0
            sigma = 1e-3 * kind * (1.0 + layer / n_layers) * float(rng.uniform(0.5, 2.0))
            tensors[name] = _tensor_stats(name, ti.shape, rpb, nb, sigma, rng, at if len(ti.shape) >= 2 else -1)
            if len(ti.shape) >= 2:
                at += tensor_sketch_bytes(ti.rows, ti.numel // ti.rows, rpb, nb)
        sk = {
            "kind": "sign-planes",
            "planes": PLANES,
            "uri": f"synthetic://{shape}/sketches/expert{i}.sketch",
            "sha256": hashlib.sha256(f"{shape}/{seed}/{i}".encode()).hexdigest(),
            "bytes": at,
        }
        analyses.append(Analysis(i + 1, base.identity, rec.identity, block_bytes, tensors, sketch=sk))
    return base, recs, analyses


def write_family(shape: str, experts: int, folder, seed: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES):
    """A family on disk that ``mergepipe plan`` can plan from a cached catalog, end to end, with
    no analysis: sparse checkpoint files (real safetensors headers, data of zeros never written),
    a SQLite catalog at ``folder/home/catalog.sqlite`` holding :func:`family`'s statistics under
    the checkpoints' real identities, and sparse sketch blobs of the recorded sizes.

    Only planning may use it: the tensor data and sketches are zeros, not what the statistics
    describe (a merge of it would fail the block digests, by design).

    Returns:
        (base folder, expert folders, ``MERGEPIPE_HOME`` folder).
    """
    import json
    from pathlib import Path

    from mergepipe.catalog.catalog import Catalog
    from mergepipe.formats.safetensors import INDEX_NAME, index_json
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    folder = Path(folder)
    shapes = SHAPES[shape]()
    lay = layout(shapes, "x")
    _, _, analyses = family(shape, experts, block_bytes=block_bytes, seed=seed)

    def write_ckpt(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        weight_map, total = {}, 0
        for f, sh in lay.shards.items():
            g = [(n, t.dtype, t.shape) for n, t in sh.tensors.items()]
            raw = build_header(g, {"format": "pt"})
            data = sum(math.prod(s) * 2 for _, _, s in g)
            with open(d / f, "wb") as fh:
                fh.write(raw)
                fh.truncate(len(raw) + data)
            weight_map.update({n: f for n, _, _ in g})
            total += data
        (d / INDEX_NAME).write_bytes(index_json(weight_map, total))
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))

    base_dir, expert_dirs = folder / "base", [folder / f"expert{i}" for i in range(experts)]
    for d in (base_dir, *expert_dirs):
        write_ckpt(d)
    home = folder / "home"
    cat = Catalog(home / "catalog.sqlite")
    st = LocalStorage(IOCounters())
    base = cat.register(st, str(base_dir))
    cat._store_digests(base.identity, {n: hashlib.sha256(n.encode()).hexdigest() for n in base.layout.tensors})
    for d, an in zip(expert_dirs, analyses, strict=True):
        e = cat.register(st, str(d))
        uri = cat.sketch_uri(base.identity, e.identity, block_bytes)
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        with open(uri, "wb") as fh:
            fh.truncate(an.sketch["bytes"])
        sk = dict(an.sketch, uri=uri)
        cat._store(base.identity, e.identity, block_bytes, an.tensors, 0.0, 0, sk)
    cat.close()
    return base_dir, expert_dirs, home
