"""The plan: the executable object of a merge, and its digest.

A :class:`Plan` says, per tensor, which blocks of which experts the engine reads, with the
method parameters resolved per tensor and per expert (layer-wise settings are evaluated here, at
plan time: the engine only ever uses the per-tensor values), the magnitude thresholds fixed and
the coefficients that need whole-tensor statistics (slerp, nuslerp, model_stock) computed from
the catalog. Its **digest**
is the SHA-256 of the canonical JSON (sorted keys, no whitespace) of its semantic fields:
everything except ``created_at``, ``mergepipe_version``, the human explanations and the digest
itself. Two plans with the same digest produce bit-identical snapshots from the same inputs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator

from mergepipe.errors import InputError

#: the non-weight files of a checkpoint a plan copies from the base when present (config,
#: generation config, tokenizer and chat-template files); a stacked view serves them from its donor
EXTRA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)

PLAN_FORMAT = "mergepipe.plan/v2"  # v2: per-tensor parameters, out_dtype


class InputRef(BaseModel):
    """A checkpoint the merge reads: URI, identity digest, per-file ``[size, version]``."""

    uri: str
    identity: str
    signature: dict[str, list]
    total_bytes: int


class ExpertRef(InputRef):
    """An expert: its name, its parameter settings (scalars, gradients or filter lists; the
    per-tensor values are in :class:`TensorExpert`), and the SHA-256 over its tensors' content
    hashes recorded by the catalog's analysis. ``adapter``: for a PEFT LoRA adapter expert, what
    its ``adapter_config.json`` says (:meth:`mergepipe.lora.AdapterConfig.summary`); None for a
    full checkpoint (then absent from the digest)."""

    name: str
    params: dict[str, Any]
    content_digest: str = ""
    adapter: dict[str, Any] | None = None
    #: the expert's block sketches when the plan merges some blocks from them:
    #: ``{"kind": "sign-planes", "planes", "uri", "sha256", "bytes"}`` (:mod:`mergepipe.catalog.sketch`)
    sketch: dict[str, Any] | None = None


class LoraFactors(BaseModel):
    """Where a LoRA expert's factors of one tensor are, and its scale: the tensor's task vector
    is ``scale · B · A`` (:func:`mergepipe.lora.delta_rows`).

    Attributes:
        a_start, a_end: byte range of A ``(rank, in_features)`` in the adapter's
            ``TensorExpert.file`` (read whole for every chunk of the tensor).
        a_dtype, b_dtype: the factors' safetensors dtypes.
        rank: r of this module.
        scale: ``lora_alpha / r`` (rsLoRA: ``/ √r``).
        module: the module's key in the model (for messages).
    B ``(out_features, rank)`` starts at ``TensorExpert.start``; row ``i`` of the tensor needs
    row ``i`` of B.
    """

    a_start: int
    a_end: int
    a_dtype: str
    b_dtype: str
    rank: int
    scale: float
    module: str = ""


class TensorExpert(BaseModel):
    """One expert's part in one tensor.

    Attributes:
        expert: index into ``Plan.experts``.
        file, start: the expert's shard holding the tensor and the tensor's first data byte.
        weight, density, gamma, epsilon: the expert's parameters resolved for this tensor.
        min_key: magnitude threshold key: keep ``key >= min_key`` (0 = keep all).
        max_key: breadcrumbs' outlier bound: keep ``key < max_key`` (0x8000 = no bound).
        stream_key: key of the DARE / DELLA random stream.
        exact_rank: bf16/float16/float32 TIES: how many entries of the threshold key group
            (``key == min_key``) exact top-k keeps; the engine finds their float32 threshold
            among the group's read values (0: keep the whole group, the key rule). Breadcrumbs:
            the same for the window's lower end.
        exact_rank_hi: bf16/float16/float32 breadcrumbs: how many entries of the outlier bound's key
            group (``key == max_key − 1``) are outliers (0: the key rule ``key < max_key``).
        blocks: selected block runs ``[b0, b1)`` (block indices).
        bytes: expert bytes these blocks occupy (one pass).
        kept_energy: estimated ``w² Σ δ²`` kept from the selected blocks.
        full_energy: the same over all blocks (the full-budget value).
        lora: for a LoRA adapter expert, where its factors are (:class:`LoraFactors`); then
            ``file``/``start`` locate B, and the blocks are all of the tensor or none (a module
            is read whole: A once per chunk plus B). None for a full checkpoint.
        sketch_blocks: block runs ``[b0, b1)`` merged from the expert's sketch instead of its
            exact bytes (fidelity tiers; disjoint from ``blocks``), sorted.
        sketch_levels: per run, the sketch level read: ``k`` = 1..3 its first ``k`` sign planes,
            4 the rank-1 tier (factors + residual plane; :func:`mergepipe.catalog.sketch.level_sections`).
        sketch_start: first byte of this tensor's blocks in the expert's sketch blob (-1: none).
        sketch_bytes: sketch bytes of ``sketch_blocks`` (one pass); ``kept_energy`` includes
            the energy they keep.
        block_digests: hex, 32 characters per block of ``blocks`` (in run order): the content
            digest (:func:`mergepipe.catalog.stats.block_digest`) the catalog recorded for the
            block's expert bytes; the engine refuses a block read with other bytes. Empty for
            a LoRA expert (its factors are not block-aligned).
        sketch_digests: hex, 32 characters per (run, plane, block) of ``sketch_blocks`` in that
            order (the planes ``0..k-1`` of a run read at level ``k``): the digests of the sketch
            bytes the engine reads.
    """

    expert: int
    file: str
    start: int
    weight: float = 1.0
    density: float = 1.0
    gamma: float = 0.0
    epsilon: float = 0.0
    min_key: int = 0
    max_key: int = 0x8000
    stream_key: int = 0
    exact_rank: int = 0
    exact_rank_hi: int = 0
    blocks: list[tuple[int, int]]
    bytes: int
    kept_energy: float
    full_energy: float
    lora: LoraFactors | None = None
    sketch_blocks: list[tuple[int, int]] = Field(default_factory=list)
    sketch_levels: list[int] = Field(default_factory=list)
    sketch_start: int = -1
    sketch_bytes: int = 0
    block_digests: str = ""
    sketch_digests: str = ""

    @field_validator("sketch_levels")
    @classmethod
    def _levels_known(cls, v: list[int]) -> list[int]:
        from mergepipe.catalog.sketch import R1_LEVEL

        if any(not 1 <= k <= R1_LEVEL for k in v):
            raise ValueError(f"sketch levels must be 1..{R1_LEVEL} (sign planes 1-3, {R1_LEVEL}: rank-1 tier)")
        return v


class TensorPlan(BaseModel):
    """How one output tensor is produced.

    Attributes:
        name, dtype, shape, file: the tensor and its shard (output layout = base layout).
        start: first data byte of the tensor in the base shard ``file``.
        rows_per_block, n_blocks: the catalog's block grid for this tensor.
        chunk_rows: rows processed at once by the engine (a multiple of ``rows_per_block``).
        passes: 1 + the pre-passes over a tensor larger than one chunk whose merge needs
            statistics of the whole tensor's read data (an L1 rescale's sums, an exact
            bf16/float16/float32 trim threshold): 1, 2 or 3. The last pre-pass skips the first chunk,
            whose merge item adds its rows to that statistic before merging them, so the first
            chunk's rows (base and expert) are read ``passes − 1`` times and the others
            ``passes`` times (:func:`block_reads`).
        params: the merge-wide parameters resolved for this tensor (normalize, lambda, t, ...).
        weight_sum: sum of all experts' weights for this tensor (experts without a selected
            block included).
        derived: coefficients computed at plan time from whole-tensor catalog statistics:
            slerp ``c_base``/``c_expert``; nuslerp ``a``/``b``/``s``; model_stock ``t``;
            multislerp and karcher ``c_base`` and ``c<i>`` per expert (output ``c_base·base +
            Σ cᵢδᵢ``); sce ``w<i>`` per expert (its weights, with ``select_topk = 1``).
        out_dtype: dtype written (the base's unless the merge asks for another).
        experts: contributing experts (experts with no selected block are absent).
        copy_base: True when the output tensor is the base tensor byte for byte.
    """

    name: str
    dtype: str
    shape: list[int]
    file: str
    start: int
    rows_per_block: int
    n_blocks: int
    chunk_rows: int
    passes: int = 1
    params: dict[str, float | bool] = Field(default_factory=dict)
    weight_sum: float = 0.0
    derived: dict[str, float] = Field(default_factory=dict)
    out_dtype: str | None = None
    experts: list[TensorExpert] = Field(default_factory=list)
    copy_base: bool = False
    base_sha256: str = ""
    explain: str = ""


def fused_blocks(tp: TensorPlan) -> int:
    """Blocks of ``tp``'s first chunk (``chunk_rows // rows_per_block``) when the tensor has a
    pre-pass (``passes > 1``): its last pre-pass and its merge read them once between them.
    0 for a one-pass tensor."""
    return tp.chunk_rows // max(1, tp.rows_per_block) if tp.passes > 1 else 0


def block_reads(tp: TensorPlan) -> list[int]:
    """How many times the engine reads each of ``tp``'s ``n_blocks`` blocks (base rows, selected
    expert blocks and their sketches alike): ``passes`` times, once less in the first chunk of
    a multi-pass tensor (:func:`fused_blocks`)."""
    k = min(fused_blocks(tp), tp.n_blocks)
    return [tp.passes - 1] * k + [tp.passes] * (tp.n_blocks - k)


class IOEstimate(BaseModel):
    """Bytes per role. ``expert_read_bytes`` is exact for the plan's coalescing rule."""

    base_read_bytes: int = 0
    expert_read_bytes: int = 0
    output_write_bytes: int = 0
    #: of ``expert_read_bytes``, the bytes of block sketches (derived from experts: same budget)
    sketch_read_bytes: int = 0


class Plan(BaseModel):
    """A merge plan. See the module docstring for the digest."""

    format: str = PLAN_FORMAT
    method: str
    globals: dict[str, Any]
    seed: int = 0
    block_bytes: int
    coalesce_gap: int = 0
    work_bytes: int
    base: InputRef
    experts: list[ExpertRef]
    budget_bytes: int | None = None
    fidelity: float | None = None
    tensors: list[TensorPlan]
    io: IOEstimate
    expert_bytes_total: int
    retained_energy: float
    extra_files: list[str] = Field(default_factory=list)
    shard_metadata: dict[str, dict[str, str]] = Field(default_factory=dict)
    index_metadata: dict = Field(default_factory=dict)
    out_dtype: str | None = None
    n_layers: int = 0
    # the block value the selection maximised when it is not task-vector energy:
    # {"kind": "fisher", "calibration": <calibration digest>} (None: energy; then not in the digest)
    block_value: dict[str, str] | None = None
    # fidelity tiers: the --sketch setting some blocks are merged under ("sign3"); None: read or skip
    sketch: str | None = None
    # non-semantic
    requested_dtype: str | None = None
    source: dict = Field(default_factory=dict)
    #: predicted wall seconds by term (:func:`mergepipe.planner.cost.predict_seconds`) on the
    #: calibrated machine; None: not calibrated
    predicted_seconds: dict[str, float] | None = None
    created_at: float = 0.0
    mergepipe_version: str = ""
    explain: str = ""
    digest: str = ""

    NON_SEMANTIC: ClassVar[frozenset] = frozenset(
        {"created_at", "mergepipe_version", "explain", "digest", "requested_dtype", "source", "predicted_seconds"}
    )

    def semantic_json(self) -> str:
        d = self.model_dump(mode="json", exclude=set(self.NON_SEMANTIC))
        for t in d["tensors"]:
            t.pop("explain", None)
            for te in t["experts"]:
                for f in ("exact_rank", "exact_rank_hi"):  # (absent before exact thresholds: digests unchanged)
                    if not te.get(f):
                        te.pop(f, None)
                if te.get("lora") is None:  # (full checkpoints digest as before LoRA experts existed)
                    te.pop("lora", None)
                if not te.get("sketch_blocks"):  # plans without sketches digest as before tiers existed
                    for f in ("sketch_blocks", "sketch_levels", "sketch_start", "sketch_bytes", "sketch_digests"):
                        te.pop(f, None)
                if not te.get("block_digests"):
                    te.pop("block_digests", None)
        for e in d["experts"]:
            if e.get("adapter") is None:
                e.pop("adapter", None)
            if e.get("sketch") is None:
                e.pop("sketch", None)
            else:  # which blob, not where its catalog keeps it (see _sketch_digest_name)
                e["sketch"]["uri"] = _sketch_digest_name(d, e)
        if not d["io"].get("sketch_read_bytes"):
            d["io"].pop("sketch_read_bytes", None)
        if d.get("sketch") is None:
            d.pop("sketch", None)
        if d.get("block_value") is None:
            d.pop("block_value", None)  # energy plans digest as before the field existed
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def compute_digest(self) -> str:
        return hashlib.sha256(self.semantic_json().encode()).hexdigest()

    def seal(self) -> Plan:
        self.digest = self.compute_digest()
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        try:
            p = cls.model_validate_json(text)
        except Exception as e:
            raise InputError(f"{source}: not a valid mergepipe plan ({str(e).splitlines()[0]}).") from None
        if p.format != PLAN_FORMAT:
            raise InputError(f"{source}: plan format {p.format!r}, this mergepipe reads {PLAN_FORMAT!r}.")
        if p.digest and p.digest != p.compute_digest():
            raise InputError(f"{source}: plan digest does not match its content; the plan was edited or corrupted.")
        from mergepipe.paths import check_name

        for i, tp in enumerate(p.tensors):  # file names are joined under checkpoints and --out
            check_name(tp.file, f"{source}: tensors[{i}].file", flat=True)
            for j, te in enumerate(tp.experts):
                check_name(te.file, f"{source}: tensors[{i}].experts[{j}].file", flat=True)
        for i, f in enumerate(p.extra_files):
            check_name(f, f"{source}: extra_files[{i}]", flat=True)
        for i, ref in enumerate(p.experts):
            if ref.sketch is not None:
                sketch_location(p, i, f"{source}: experts[{i}].sketch.uri")
        return p


def sketch_name(base_identity: str, expert_identity: str, block_bytes: int, version: int, objects: bool) -> str:
    """The name of an expert's sketch blob under its catalog's root: ``sketches/<base
    identity>/<expert identity>-<block bytes>-v<version>.sketch`` (SQLite catalog: the root is
    the SQLite file's folder) or ``sketches/<base identity>/<expert identity>/<block
    bytes>-v<version>.sketch`` (object catalog: the root is its prefix)."""
    if objects:
        return f"sketches/{base_identity}/{expert_identity}/{block_bytes}-v{version}.sketch"
    return f"sketches/{base_identity}/{expert_identity}-{block_bytes}-v{version}.sketch"


def _sketch_digest_name(d: dict, e: dict) -> str:
    r"""What the plan digest holds of expert ``e``'s sketch ``uri`` (``d``: the plan as JSON data):
    the blob's name in the object-catalog layout (:func:`sketch_name` of the plan's base, this
    expert, the block size and the blob's stats version), not the catalog root it lies under nor
    that catalog's layout, so the same merge planned from two catalogs (two ``MERGEPIPE_HOME``\ s,
    a SQLite and an object catalog) has one digest and one snapshot id. Execution reads the blob
    at the plan's ``uri`` (:func:`sketch_location` refuses any other file) and checks its bytes
    against the per-block digests, which the plan digest holds. A ``uri`` of no catalog's shape
    is kept whole (loading the plan refuses it)."""
    uri = str(e["sketch"].get("uri", ""))
    base_id, expert_id, bb = str(d["base"]["identity"]), str(e["identity"]), int(d["block_bytes"])
    version = _stats_version(uri)
    for objects in (False, True):
        if uri.endswith("/" + sketch_name(base_id, expert_id, bb, version, objects)):
            return sketch_name(base_id, expert_id, bb, version, objects=True)
    return uri


def sketch_location(plan: Plan, i: int, where: str) -> tuple[str, str]:
    """``(catalog root, name)`` of expert ``i``'s sketch blob in ``plan``: its ``uri`` must be a
    catalog root followed by :func:`sketch_name` of this plan's base, this expert and the plan's
    block size (a sketch of another expert or checkpoint, or any other file, is refused), and the
    name passes the path policy (:func:`mergepipe.paths.check_name`) like every catalog name.
    The engine reads ``Storage.join(root, name)`` and checks the bytes against the plan's
    per-block digests.

    Raises:
        InputError: naming ``where``: the uri is not this expert's sketch location.
    """
    from mergepipe.paths import check_name

    e = plan.experts[i]
    uri = str((e.sketch or {}).get("uri", ""))
    for objects in (False, True):
        suffix = "/" + sketch_name(plan.base.identity, e.identity, plan.block_bytes, _stats_version(uri), objects)
        if uri.endswith(suffix) and len(uri) > len(suffix):
            root = uri[: -len(suffix)]
            check_name(suffix[1:], where)
            scheme, _, rest = root.partition("://") if "://" in root else ("", "", root)
            inner = rest.lstrip("/").split("/", 1)[1] if scheme and "/" in rest.lstrip("/") else rest.lstrip("/")
            if inner and ("//" in inner or any(seg in (".", "..") for seg in inner.split("/"))):
                break
            return root, suffix[1:]
    raise InputError(
        f"{where}: {uri[:200]!r} is not the catalog location of the sketches of expert {e.name!r} against this "
        "base (sketches/<base identity>/<expert identity>...); re-plan from the catalog."
    )


def _stats_version(uri: str) -> int:
    """The ``v<N>`` of a sketch blob name (0 when absent)."""
    tail = uri.rsplit("-v", 1)[-1]
    num = tail[: -len(".sketch")] if tail.endswith(".sketch") else ""
    return int(num) if num.isdigit() and len(num) < 6 else 0
