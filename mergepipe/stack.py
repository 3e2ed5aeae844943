"""Stacked views: a checkpoint assembled from layer ranges of other checkpoints, read in place.

mergekit's ``slices`` build a model from layer ranges of several models (frankenmerges,
SOLAR-style depth up-scaling) and merge aligned ranges of several models slice by slice.
mergepipe plans such a config as an ordinary merge over **stacked views**: for each input model
a view whose layer ``o`` is the source layer the config puts at output layer ``o``
(renumbered), whose non-layer tensors come from the config's first slice (embeddings: mergekit's
*pre*-weights) or last slice (final norm, ``lm_head``: its *post*-weights), and whose
``config.json`` is the donor's with ``num_hidden_layers`` set to the output's layer count.

A view is a read-only checkpoint under the URI ``stack://<digest>`` (``digest``: SHA-256 of its
:class:`StackSpec`'s canonical JSON, first 32 hex digits). Its shard files are synthesized:
a safetensors header (renamed tensors, contiguous offsets) followed by the source tensors'
bytes, which :class:`StackStorage` reads from the sources' files on demand — every byte of a
view read is a ranged read of a source file, counted once under the reader's role (the
catalog, the planner and the engine see an ordinary checkpoint; realized bytes are source
bytes). Nothing is copied or materialised. The view's non-weight files (tokenizer, generation
config) are the donor's.

Views are kept in a process registry and, content-addressed, as JSON under
``$MERGEPIPE_HOME/stacks/`` so that a saved plan over a view executes in another process on
the same machine.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointLayout,
    build_header,
    index_json,
    load_layout,
)
from mergepipe.storage.base import NotFoundError, ObjectStat, Role, Storage, StorageError, Writer

SCHEME = "stack://"
STACK_FORMAT = "mergepipe.stack/v1"
#: largest synthesized shard (bytes of tensor data); larger views get several shards and an index
MAX_SHARD_BYTES = 4 << 30
#: the non-weight files a view serves from its donor (mergepipe.planner.plan.EXTRA_FILES)
_LAYER_RE = re.compile(r"(^|\.)(layers|layer|h|blocks|block)\.(\d+)(\.|$)")


def is_stack(uri: str) -> bool:
    """Whether ``uri`` names a stacked view (``stack://...``)."""
    return str(uri).startswith(SCHEME)


def layer_of(name: str) -> int | None:
    """Layer index in a tensor name (``model.layers.12.mlp...`` -> 12); None for others."""
    m = _LAYER_RE.search(name)
    return int(m.group(3)) if m else None


def renumber(name: str, layer: int) -> str:
    """``name`` with its layer index replaced by ``layer``."""
    return _LAYER_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}.{layer}{m.group(4)}", name, count=1)


def is_pre_weight(name: str) -> bool:
    """A non-layer tensor mergekit plans before the layers (its architectures' *pre*-weights:
    token and position embeddings); the others (final norm, ``lm_head``) are *post*-weights."""
    leaf = name.lower()
    return "embed" in leaf or any(p in leaf.split(".") for p in ("wte", "wpe"))


@dataclass(frozen=True)
class StackSpec:
    """What a view holds, in output order.

    Attributes:
        pre: source checkpoint of the pre-weights (embeddings).
        post: source checkpoint of the post-weights (final norm, ``lm_head``).
        layers: ``(source URI, first layer, end layer)`` runs, concatenated into output layers
            ``0..n-1`` (mergekit's ``layer_range: [first, end)``).
        donor: checkpoint whose ``config.json`` (with ``num_hidden_layers`` = n) and tokenizer
            files the view carries.
        vocab: a merged vocabulary's row map (:mod:`mergepipe.vocab`), or None:
            ``{"tensors": [vocabulary tensor names], "rows": [run, ...], "vocab_size": V,
            "files": {name: sha256}}``; a run is ``["rows", uri, first, count]`` (rows of that
            checkpoint's same-named tensor), ``["mean", [[uri, row], ...]]`` (one row, the float32
            mean of those rows, rounded to the tensor's dtype), ``["zero", count]`` or ``["padmean",
            count]`` (rows equal to the mean of the rows before the padding). ``files``: the output
            tokenizer files (:func:`mergepipe.vocab.tokenizer_files`) by content digest.
    """

    pre: str
    post: str
    layers: tuple[tuple[str, int, int], ...]
    donor: str
    vocab: dict | None = None

    @property
    def n_layers(self) -> int:
        return sum(b - a for _, a, b in self.layers)

    def to_json(self) -> dict:
        d: dict = {
            "format": STACK_FORMAT,
            "pre": self.pre,
            "post": self.post,
            "layers": [list(r) for r in self.layers],
            "donor": self.donor,
        }
        if self.vocab is not None:
            d["vocab"] = self.vocab
        return d

    @classmethod
    def from_json(cls, d: dict, source: str) -> StackSpec:
        try:
            if d.get("format") != STACK_FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            layers = tuple((str(u), int(a), int(b)) for u, a, b in d["layers"])
            vocab = d.get("vocab")
            if vocab is not None and not isinstance(vocab, dict):
                raise ValueError("vocab is not a mapping")
            return cls(str(d["pre"]), str(d["post"]), layers, str(d["donor"]), vocab)
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{source}: not a mergepipe stacked view ({e}).") from None

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:32]

    @property
    def uri(self) -> str:
        return SCHEME + self.digest

    def sources(self) -> list[str]:
        """Every source checkpoint, in first-use order."""
        out: list[str] = []
        donors = [r[1] for r in (self.vocab or {}).get("rows", []) if r[0] == "rows"]
        donors += [u for r in (self.vocab or {}).get("rows", []) if r[0] == "mean" for u, _ in r[1]]
        for u in [self.pre, *(r[0] for r in self.layers), self.post, self.donor, *donors]:
            if u not in out:
                out.append(u)
        return out


@dataclass
class _Piece:
    vstart: int
    vend: int
    src_file: str  # the source shard's URI ("" for bytes computed when the view was built)
    src_start: int
    data: bytes | None = None


@dataclass
class _Shard:
    header: bytes
    pieces: list[_Piece]
    starts: list[int]
    size: int
    src_files: list[str]


@dataclass
class StackView:
    """A materialised-in-memory description of a view: synthesized shard headers and the source
    byte ranges behind them.

    Attributes:
        spec: the :class:`StackSpec`.
        shards: view shard name -> headers and pieces.
        files: other files by name: bytes (``config.json``, the index) or a source file URI.
        tensors: output tensor name -> ``(source URI, source tensor name)``.
    """

    spec: StackSpec
    shards: dict[str, _Shard] = field(default_factory=dict)
    files: dict[str, bytes | str] = field(default_factory=dict)
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return self.spec.uri


def _layout(storage: Storage, uri: str) -> CheckpointLayout:
    return load_layout(storage, uri, role="catalog")


def build_view(storage: Storage, spec: StackSpec, extra_files: Sequence[str] = ()) -> StackView:
    """The view ``spec`` describes, from its sources' shard headers (no tensor byte is read).

    Args:
        storage: where the sources are (headers read under role ``catalog``).
        extra_files: non-weight file names to serve from the donor when it has them.

    Raises:
        InputError: a source is not a checkpoint, a layer range is outside a source's layers, a
            source lacks a pre/post tensor, or two tensors of an output layer collide.
    """
    layouts: dict[str, CheckpointLayout] = {}
    for u in spec.sources():
        layouts[u] = _layout(storage, u)
    plan = _output_tensors(spec, layouts)
    groups = _shard_groups(plan, layouts)
    names = (
        [SINGLE_NAME]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    view = StackView(spec)
    weight_map: dict[str, str] = {}
    total = 0
    for fname, group in zip(names, groups):
        view.shards[fname], nb = _view_shard(storage, layouts, spec.vocab, group, view.tensors)
        total += nb
        weight_map.update({out: fname for out, _, _ in group})
    if len(names) > 1:
        view.files[INDEX_NAME] = index_json(weight_map, total)
    _add_view_files(storage, spec, extra_files, view)
    return view


def _output_tensors(spec: StackSpec, layouts: dict[str, CheckpointLayout]) -> list[tuple[str, str, str]]:
    """The view's tensors in output order, ``(output name, source URI, source name)``: the pre's
    pre-weights, each layer range's layers renumbered from 0, the post's post-weights.

    Raises:
        InputError: a layer range outside its source's layers, an output name twice.
    """
    plan: list[tuple[str, str, str]] = []
    for name in layouts[spec.pre].tensors:
        if layer_of(name) is None and is_pre_weight(name):
            plan.append((name, spec.pre, name))
    o = 0
    for u, a, b in spec.layers:
        lay = layouts[u]
        by_layer: dict[int, list[str]] = {}
        for name in lay.tensors:
            i = layer_of(name)
            if i is not None:
                by_layer.setdefault(i, []).append(name)
        n_src = max(by_layer) + 1 if by_layer else 0
        if not (0 <= a < b <= n_src):
            raise InputError(
                f"{u}: layer_range [{a}, {b}] is outside its {n_src} layers; give a range within [0, {n_src}]."
            )
        for i in range(a, b):
            for name in by_layer.get(i, []):
                plan.append((renumber(name, o), u, name))
            o += 1
    for name in layouts[spec.post].tensors:
        if layer_of(name) is None and not is_pre_weight(name):
            plan.append((name, spec.post, name))
    seen: set[str] = set()
    for out, _, _ in plan:
        if out in seen:
            raise InputError(f"{spec.uri}: tensor {out!r} would be written twice; the layer ranges overlap in output.")
        seen.add(out)
    return plan


def _shard_groups(
    plan: list[tuple[str, str, str]], layouts: dict[str, CheckpointLayout]
) -> list[list[tuple[str, str, str]]]:
    """``plan`` cut into shards of at most :data:`MAX_SHARD_BYTES` of (source) data, in order."""
    groups: list[list[tuple[str, str, str]]] = [[]]
    acc = 0
    for item in plan:
        info = layouts[item[1]].tensors[item[2]]
        nb = info.end - info.start
        if groups[-1] and acc + nb > MAX_SHARD_BYTES:
            groups.append([])
            acc = 0
        groups[-1].append(item)
        acc += nb
    return groups


def _view_shard(
    storage: Storage,
    layouts: dict[str, CheckpointLayout],
    vocab: dict | None,
    group: list[tuple[str, str, str]],
    tensors: dict[str, tuple[str, str]],
) -> tuple[_Shard, int]:
    """One view shard: its synthesized header and the pieces behind its data (source byte ranges,
    or rows computed for a remapped vocabulary, read under role ``catalog``); records each
    output tensor's source in ``tensors``. Returns the shard and its data bytes."""
    vnames = set((vocab or {}).get("tensors", []))
    infos = [layouts[u].tensors[n] for _, u, n in group]
    shapes = [
        (int(vocab["vocab_size"]), *i.shape[1:]) if (vocab and out in vnames) else tuple(i.shape)
        for (out, _, _), i in zip(group, infos)
    ]
    header = build_header([(out, i.dtype, shp) for (out, _, _), i, shp in zip(group, infos, shapes)], {"format": "pt"})
    pos = len(header)
    pieces = []
    total = 0
    computed_from: set[str] = set()  # files behind computed rows (their versions are the view's too)
    for (out, u, n), ti in zip(group, infos):
        if vocab and out in vnames:
            pcs, nb = _vocab_pieces(storage, layouts, vocab, n, ti, pos, computed_from)
            pieces += pcs
        else:
            nb = ti.end - ti.start
            if nb:
                pieces.append(_Piece(pos, pos + nb, storage.join(u, ti.file), ti.start))
        pos += nb
        tensors[out] = (u, n)
        total += nb
    shard = _Shard(
        header,
        pieces,
        [p.vstart for p in pieces],
        pos,
        sorted({p.src_file for p in pieces if p.src_file} | computed_from),
    )
    return shard, total


def _add_view_files(storage: Storage, spec: StackSpec, extra_files: Sequence[str], view: StackView) -> None:
    """The view's non-weight files: the donor's ``extra_files`` it has (``config.json`` rewritten
    for the view's layer count and vocabulary), the merged vocabulary's tokenizer files instead
    of the donor's when the spec has them."""
    vocab = spec.vocab
    for f in extra_files:
        src = storage.join(spec.donor, f)
        if not storage.exists(src):
            continue
        if f == "config.json":
            raw = storage.read_object(src, "catalog")
            view.files[f] = _config_with_layers(raw, spec.n_layers, src, int(vocab["vocab_size"]) if vocab else None)
        elif not (vocab and vocab.get("files")):
            view.files[f] = src
    if vocab and vocab.get("files"):  # the merged vocabulary's tokenizer files replace the donor's
        from mergepipe.vocab import tokenizer_file_bytes

        for f, digest in vocab["files"].items():
            view.files[f] = tokenizer_file_bytes(digest)


def _vocab_pieces(
    storage: Storage, layouts, vocab: dict, name: str, ti, pos: int, computed_from: set[str]
) -> tuple[list[_Piece], int]:
    """The pieces of a vocabulary tensor ``name`` remapped by ``vocab['rows']`` (see
    :class:`StackSpec`), starting at view offset ``pos``; computed rows are read (role
    ``catalog``), averaged in float32 and rounded to the tensor's dtype (round to nearest even);
    the files they are read from are added to ``computed_from``.

    Raises:
        InputError: a run names a row outside its checkpoint's tensor, or a checkpoint without
            the tensor or with another row width or dtype.
    """
    import numpy as np

    from mergepipe.numerics import decode

    rowb = (ti.end - ti.start) // max(1, ti.shape[0])
    pieces: list[_Piece] = []
    made: list[np.ndarray] = []  # float32 rows so far (padmean needs them)

    def src_info(u: str):
        t = layouts[u].tensors.get(name)
        if t is None or t.dtype != ti.dtype or tuple(t.shape[1:]) != tuple(ti.shape[1:]):
            raise InputError(f"{u}: tensor {name!r} is missing or of another row shape/dtype than {ti.shape}.")
        return t

    def read_rows(u: str, a: int, n: int) -> np.ndarray:
        t = src_info(u)
        computed_from.add(storage.join(u, t.file))
        raw = storage.read_range(storage.join(u, t.file), t.start + a * rowb, t.start + (a + n) * rowb, "catalog")
        return decode(raw, t.dtype).reshape(n, -1)

    def encode(rows: np.ndarray) -> bytes:
        import torch

        from mergepipe.engine.chunk import _encode

        return _encode(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)), ti.dtype)

    need_rows = any(r[0] == "padmean" for r in vocab["rows"])
    for run in vocab["rows"]:
        kind = run[0]
        if kind == "rows":
            u, a, n = str(run[1]), int(run[2]), int(run[3])
            t = src_info(u)
            if not (0 <= a and a + n <= t.shape[0]):
                raise InputError(f"{u}: rows [{a}, {a + n}) of {name!r} are outside its {t.shape[0]} rows.")
            pieces.append(_Piece(pos, pos + n * rowb, storage.join(u, t.file), t.start + a * rowb))
            if need_rows:
                made.append(read_rows(u, a, n))
        else:
            if kind == "mean":
                rows = np.stack([read_rows(str(u), int(r), 1)[0] for u, r in run[1]])
                block = (rows.sum(axis=0, dtype=np.float32) / np.float32(len(rows)))[None, :]
            elif kind == "zero":
                block = np.zeros((int(run[1]), rowb // ti.itemsize), dtype=np.float32)
            elif kind == "padmean":
                import torch

                allr = np.concatenate(made) if made else np.zeros((1, rowb // ti.itemsize), np.float32)
                mean = torch.mean(torch.from_numpy(allr), dim=0).numpy()  # (mergekit: torch.mean over the rows)
                block = np.repeat(mean[None, :], int(run[1]), axis=0)
            else:
                raise InputError(f"stacked view: unknown vocabulary run {kind!r}.")
            data = encode(block)
            if need_rows:
                made.append(decode(data, ti.dtype).reshape(block.shape))
            n = block.shape[0]
            pieces.append(_Piece(pos, pos + n * rowb, "", 0, data))
        pos += n * rowb
    return pieces, sum(p.vend - p.vstart for p in pieces)


def _config_with_layers(raw: bytes, n: int, source: str, vocab_size: int | None = None) -> bytes:
    """``config.json`` with ``num_hidden_layers`` (and ``n_layer``/``num_layers`` when present)
    set to ``n``, as mergekit writes a sliced model's config."""
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError):
        raise InputError(f"{source}: not valid JSON; a sliced model's config needs num_hidden_layers.") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: not a JSON object; a sliced model's config needs num_hidden_layers.")
    keys = [k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in cfg] or ["num_hidden_layers"]
    for k in keys:
        cfg[k] = n
    if vocab_size:
        cfg["vocab_size"] = vocab_size
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        lt = cfg["layer_types"]
        cfg["layer_types"] = (lt * (n // len(lt) + 1))[:n] if len(set(lt)) == 1 else lt[:n] + [lt[-1]] * (n - len(lt))
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


# --- the registry ------------------------------------------------------------------------
_VIEWS: dict[str, StackView] = {}


def _spec_dir() -> Path:
    from mergepipe.catalog.catalog import default_home

    return default_home() / "stacks"


def register_view(storage: Storage, spec: StackSpec, extra_files: Sequence[str] = ()) -> StackView:
    """Build ``spec``'s view (:func:`build_view`), keep it in this process and save its spec
    under ``$MERGEPIPE_HOME/stacks/<digest>.json`` (for ``mergepipe execute`` of a saved plan)."""
    view = build_view(storage, spec, extra_files)
    _VIEWS[spec.digest] = view
    try:
        d = _spec_dir()
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{spec.digest}.json"
        if not p.exists():
            from mergepipe.storage.local import replace_file

            data = json.dumps({**spec.to_json(), "extra_files": list(extra_files)}, sort_keys=True).encode()
            replace_file(p, data, what="stack view spec")
    except (OSError, InputError):
        pass  # the in-process registry still serves this run
    return view


def _split(uri: str) -> tuple[str, str]:
    rest = uri[len(SCHEME) :]
    digest, _, name = rest.partition("/")
    return digest, name


class StackStorage(Storage):
    """Read-only storage of ``stack://`` views over an inner storage (which reads the sources);
    bytes are counted once, in this storage's counters (share them with the inner's)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner.counters)
        self.inner = inner
        self.max_gap = 0

    def view(self, uri: str) -> StackView:
        digest, _ = _split(uri)
        v = _VIEWS.get(digest)
        if v is None:
            p = _spec_dir() / f"{digest}.json"
            try:
                d = json.loads(p.read_text())
            except (OSError, ValueError):
                raise NotFoundError(
                    f"{SCHEME}{digest}: unknown stacked view (no {p}); re-plan from the mergekit config."
                ) from None
            spec = StackSpec.from_json(d, str(p))
            if spec.digest != digest:
                raise InputError(f"{p}: its content does not match its name; delete it and re-plan.")
            v = build_view(self.inner, spec, [str(f) for f in d.get("extra_files", [])])
            _VIEWS[digest] = v
        return v

    @staticmethod
    def join(root: str, *names: str) -> str:
        return Storage.join(root, *names)

    def stat(self, uri: str) -> ObjectStat:
        v = self.view(uri)
        _, name = _split(uri)
        if name in v.shards:
            sh = v.shards[name]
            h = hashlib.sha256(v.spec.digest.encode())
            for f in sh.src_files:
                st = self.inner.stat(f)
                h.update(f"{f}\0{st.size}\0{st.version}\0".encode())
            return ObjectStat(size=sh.size, version=h.hexdigest()[:32])
        obj = v.files.get(name)
        if obj is None:
            raise NotFoundError(uri)
        if isinstance(obj, bytes):
            return ObjectStat(size=len(obj), version=hashlib.sha256(obj).hexdigest()[:32])
        return self.inner.stat(obj)

    def _fetch(self, uri: str, requests: Sequence[tuple[int, int]]) -> list[bytes]:
        v = self.view(uri)
        _, name = _split(uri)
        f = v.files.get(name)
        if isinstance(f, bytes):
            return [f[s:e] for s, e in requests]
        if isinstance(f, str):
            return [bytes(b) for b in self.inner._fetch(f, requests)]
        sh = v.shards.get(name)
        if sh is None:
            raise NotFoundError(uri)
        out = []
        for s, e in requests:
            if e > sh.size or s < 0:
                raise StorageError(f"{uri}: range [{s}, {e}) is past its end ({sh.size} bytes)")
            buf = bytearray()
            hl = len(sh.header)
            if s < hl:
                buf += sh.header[s : min(e, hl)]
            pos = max(s, hl)
            k = max(0, bisect.bisect_right(sh.starts, pos) - 1)
            by_file: dict[str, list[tuple[int, int]]] = {}
            order: list[tuple[str, int]] = []
            inline: list[bytes] = []
            while pos < e and k < len(sh.pieces):
                p = sh.pieces[k]
                if p.vend <= pos:
                    k += 1
                    continue
                a, b = max(pos, p.vstart), min(e, p.vend)
                if p.data is not None:
                    order.append(("", len(inline)))
                    inline.append(p.data[a - p.vstart : b - p.vstart])
                    pos = b
                    k += 1
                    continue
                rng = (p.src_start + a - p.vstart, p.src_start + b - p.vstart)
                by_file.setdefault(p.src_file, []).append(rng)
                order.append((p.src_file, len(by_file[p.src_file]) - 1))
                pos = b
                k += 1
            got = {f: (_merge_adjacent(r), self.inner._fetch(f, _merge_adjacent(r))) for f, r in by_file.items()}
            for f, j in order:
                buf += inline[j] if f == "" else _pick(by_file[f][j], *got[f])
            if len(buf) != e - s:
                raise StorageError(f"{uri}: short read at [{s}, {e}): got {len(buf)} bytes")
            out.append(bytes(buf))
        return out

    def list(self, prefix: str) -> Iterator[str]:
        v = self.view(prefix)
        d, _ = _split(prefix)
        yield from sorted(f"{SCHEME}{d}/{n}" for n in [*v.shards, *v.files])

    def open_writer(self, uri: str, role: Role = "output") -> Writer:
        raise InputError(f"{uri}: a stacked view is read-only; write the output elsewhere.")

    def put_object(self, uri: str, data: bytes, role: Role = "output", *, if_none_match=False, durable=False) -> None:
        raise InputError(f"{uri}: a stacked view is read-only; write the output elsewhere.")

    def delete(self, uri: str) -> None:
        raise InputError(f"{uri}: a stacked view is read-only.")


def _merge_adjacent(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Source ranges sorted, overlapping or adjacent ones as one request (a view may repeat a
    source layer, and stacks layers in any order)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(set(ranges)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        elif out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _pick(rng: tuple[int, int], merged: list[tuple[int, int]], bufs: Sequence[bytes | bytearray]) -> bytes:
    """The bytes of source range ``rng`` out of the fetched ``merged`` requests' buffers."""
    a, b = rng
    k = max(0, bisect.bisect_right([m[0] for m in merged], a) - 1)
    for (ma, mb), buf in zip(merged[k:], bufs[k:]):
        if ma <= a and b <= mb:
            return bytes(memoryview(buf)[a - ma : b - ma])
    raise StorageError("stacked view: a source range was not fetched")
