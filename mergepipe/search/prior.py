"""The search prior: how much each coordinate of the search space is expected to matter.

AP-BMM (Asynchronous Prior-Guided Bayesian Model Merging, MiLab-HITSZ/AP-BMM) guides the
surrogate with discrepancies between the source models: where experts differ more from the base
(and from each other), the merge parameters of that layer move the merged model more, so the
surrogate should treat that coordinate as more relevant (a shorter lengthscale). mergepipe
measures two discrepancies per layer block:

* **parameter discrepancy** (free: read from the catalog, no expert byte is read): for expert
  ``e`` and layer block ``b``, the relative task-vector energy
  ``Σ_{tensors t in b} ‖δ_e,t‖² / Σ_t ‖θ_base,t‖²`` from the catalog's per-tensor statistics
  (``TensorStats.delta_sq``, ``base_sq``). A global parameter's coordinate sums over experts.
* **activation discrepancy** (optional; runs the models once on a small probe set): with the
  decoder's hidden states ``h^ℓ`` (output of layer ℓ), ``r_e(ℓ) = mean_tokens ‖h_e^ℓ − h_base^ℓ‖ /
  ‖h_base^ℓ‖`` and the layer's own share ``|r_e(ℓ) − r_e(ℓ−1)|`` (``r_e(−1)`` from the
  embeddings), summed over the block's layers.

Each discrepancy is normalised to geometric mean 1 over the coordinates; the relevance of a
coordinate is the geometric mean of the available ones, and its lengthscale multiplier
``m = clip(relevance^(−1/2), 1/4, 4)`` (renormalised to geometric mean 1). Two ways to use it
(``SearchConfig.prior_kind``; the optimizer is :mod:`mergepipe.search.optimizer`):

* ``scaled``: the log-normal lengthscale prior of each ARD dimension is botorch's default
  (dimension-scaled, wide) times ``m``, and the fit starts at its mode;
* ``rank`` (AP-BMM's mapping): coordinates are ranked by relevance and the rank quartile sets the
  initial lengthscale, 0.5 / 1 / 2 / 5 (most relevant quarter → 0.5), with a narrower log-normal
  prior (σ = 0.5 in log space) whose mode is that value — a prior with a real spread.

Either is a prior, not a constraint: the marginal-likelihood fit may move any lengthscale.
Coordinates without a discrepancy of their own (the ``budget`` coordinate) are neutral (the
geometric mean of the others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import InputError
from mergepipe.methods.params import layer_index
from mergepipe.search.space import BUDGET, SHARED, Dim, SearchSpace

_CLIP = 4.0
#: AP-BMM's initial lengthscales by relevance-rank quartile (most relevant first).
RANK_LENGTHSCALES = (0.5, 1.0, 2.0, 5.0)


@dataclass
class Prior:
    """Per-coordinate discrepancies and the resulting lengthscale multipliers.

    Attributes:
        labels: coordinate labels (:attr:`mergepipe.search.space.Dim.label`), length ``d``.
        param: parameter discrepancy per coordinate (relative task-vector energy, unitless).
        activation: activation discrepancy per coordinate, or None when not measured.
        multipliers: lengthscale multiplier per coordinate (geometric mean 1; < 1 = more relevant).
        lengthscales: initial lengthscale per coordinate of the ``rank`` prior
            (:data:`RANK_LENGTHSCALES` by relevance quartile).
    """

    labels: list[str]
    param: list[float | None]
    activation: list[float | None] | None = None
    multipliers: list[float] = field(default_factory=list)
    lengthscales: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.multipliers:
            self.multipliers = lengthscale_multipliers(self.param, self.activation)
        if not self.lengthscales:
            self.lengthscales = rank_lengthscales(self.param, self.activation)

    def to_json(self) -> dict:
        return {
            "labels": self.labels,
            "param": self.param,
            "activation": self.activation,
            "multipliers": self.multipliers,
            "lengthscales": self.lengthscales,
        }

    @classmethod
    def from_json(cls, d: dict) -> Prior:
        return cls(
            d["labels"], d["param"], d.get("activation"), d.get("multipliers") or [], d.get("lengthscales") or []
        )


def _gnorm(v: Sequence[float]) -> list[float]:
    """Normalise positive values to geometric mean 1 (zeros are floored at 1e-12 first)."""
    v = [max(float(x), 1e-12) for x in v]
    g = math.exp(sum(math.log(x) for x in v) / len(v))
    return [x / g for x in v]


def _neutral(v: Sequence[float | None]) -> list[float]:
    """``None`` entries (coordinates without a discrepancy) become the geometric mean of the rest."""
    known = [max(float(x), 1e-12) for x in v if x is not None]
    g = math.exp(sum(math.log(x) for x in known) / len(known)) if known else 1.0
    return [g if x is None else float(x) for x in v]


def relevance(param: Sequence[float | None], activation: Sequence[float | None] | None = None) -> list[float]:
    """Relevance per coordinate: the geometric mean of its normalised discrepancies (geometric
    mean 1 over the coordinates; ``None``: neutral)."""
    parts = [_gnorm(_neutral(param))]
    if activation is not None:
        parts.append(_gnorm(_neutral(activation)))
    return [math.exp(sum(math.log(p[i]) for p in parts) / len(parts)) for i in range(len(param))]


def rank_lengthscales(param: Sequence[float | None], activation: Sequence[float | None] | None = None) -> list[float]:
    """AP-BMM's rank → initial-lengthscale map: coordinate ``i`` of relevance rank ``r`` (0 = most
    relevant; ties keep coordinate order) of ``d`` gets ``RANK_LENGTHSCALES[⌊4r/d⌋]``.

    Example: relevances ``[3, 1, 2, 0.5]`` give ``[0.5, 2, 1, 5]``."""
    rel = relevance(param, activation)
    order = sorted(range(len(rel)), key=lambda i: (-rel[i], i))
    out = [0.0] * len(rel)
    for r, i in enumerate(order):
        out[i] = RANK_LENGTHSCALES[r * len(RANK_LENGTHSCALES) // len(rel)]
    return out


def lengthscale_multipliers(
    param: Sequence[float | None], activation: Sequence[float | None] | None = None
) -> list[float]:
    """Lengthscale multiplier per coordinate from its discrepancies (see the module docstring):
    relevance = geometric mean of the normalised discrepancies; ``m = clip(relevance^-1/2, 1/4, 4)``,
    renormalised to geometric mean 1."""
    rel = relevance(param, activation)
    m = [min(_CLIP, max(1 / _CLIP, r**-0.5)) for r in rel]
    return [round(x, 6) for x in _gnorm(m)]


def parameter_discrepancy(space: SearchSpace, tensor_stats: Sequence[dict]) -> list[float]:
    """Per coordinate, the relative task-vector energy of its expert(s) in its layer block.

    Args:
        space: the search space.
        tensor_stats: per expert (order of ``space.experts``), ``{tensor name: TensorStats}``
            (``Analysis.tensors`` from the catalog).

    Returns:
        float per coordinate of ``space.dims``: ``Σ‖δ‖² / Σ‖θ_base‖²`` over the block's tensors
        (an outer part's: over its tensors); None for the budget coordinate (neutral).
    """

    def block_energy(stats: dict, dm: Dim) -> float:
        num = den = 0.0
        for name, s in stats.items():
            li = layer_index(name)
            if (name in dm.tensors) if dm.part else (li is not None and li in dm.layers):
                num += s.delta_sq if s.sums is not None else s.energy
                den += s.base_sq if s.sums is not None else 0.0
        return num / den if den > 0 else num

    out: list = []
    for dm in space.dims:
        if dm.name == BUDGET:
            out.append(None)
            continue
        out.append(sum(block_energy(tensor_stats[i], dm) for i in _expert_idx(space, dm)))
    return out


def _expert_idx(space: SearchSpace, dm: Dim) -> list[int]:
    """The experts a coordinate acts on (all for a global or shared coordinate)."""
    if dm.expert and dm.expert != SHARED:
        return [space.experts.index(dm.expert)]
    return list(range(len(space.experts)))


def hidden_state_discrepancy(base_dir: str | Path, expert_dirs: Sequence[str | Path], input_ids) -> list[list[float]]:
    """Per expert and decoder layer, the layer's share of the hidden-state discrepancy from the
    base on a probe batch (see the module docstring).

    Args:
        base_dir, expert_dirs: Hugging Face causal-LM checkpoint folders (loaded as float32 on CPU,
            one expert at a time).
        input_ids: int64 tensor ``[batch, seq]`` of probe token ids.

    Returns:
        ``[expert][layer]`` floats (unitless).
    """
    import torch
    from transformers import AutoModelForCausalLM

    def hidden(path):
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        m.eval()
        with torch.inference_mode():
            hs = m(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
        # hidden_states: embeddings, then each layer's output (the last one after the final norm
        # in transformers' Llama; its relative difference is still the last layer's).
        return [h.float() for h in hs]

    hb = hidden(base_dir)
    out = []
    for ed in expert_dirs:
        he = hidden(ed)
        r = [float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean()) for a, b in zip(he, hb)]
        out.append([abs(r[i + 1] - r[i]) for i in range(len(r) - 1)])
    return out


def activation_discrepancy(space: SearchSpace, per_layer: Sequence[Sequence[float]]) -> list[float]:
    """Per coordinate, the sum over its block's layers of its expert(s)' per-layer activation
    discrepancy (``per_layer[expert][layer]``, from :func:`hidden_state_discrepancy`); None
    (neutral) for the budget and outer coordinates, which have no layer of their own."""
    out: list = []
    for dm in space.dims:
        if dm.name == BUDGET or dm.part:
            out.append(None)
            continue
        idx = _expert_idx(space, dm)
        out.append(sum(per_layer[i][ell] for i in idx for ell in dm.layers if ell < len(per_layer[i])))
    return out


def probe_ids(tokenizer_dir: str | Path, texts: Sequence[str], n_seq: int = 4, seq_len: int = 64):
    """Tokenize probe texts (joined) into ``[n_seq, seq_len]`` int64 windows with the tokenizer
    in ``tokenizer_dir``.

    Raises:
        InputError: no tokenizer there, or the texts are too short for one window.
    """
    import torch

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loading problem means "no usable tokenizer"
        raise InputError(
            f"{tokenizer_dir}: no usable tokenizer for the activation prior ({type(e).__name__}); "
            "use --no-activation-prior or a base checkpoint with tokenizer files."
        ) from None
    ids = tok("\n".join(texts))["input_ids"]
    n = min(n_seq, len(ids) // seq_len)
    if n < 1:
        raise InputError(f"--probe: the probe texts give {len(ids)} tokens, fewer than one window of {seq_len}.")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def compute_prior(
    space: SearchSpace, tensor_stats: Sequence[dict], *, base_dir=None, expert_dirs=None, input_ids=None
) -> Prior:
    """The :class:`Prior` of ``space``: parameter discrepancy from the catalog statistics and,
    when ``input_ids`` is given, activation discrepancy from running base and experts."""
    param = parameter_discrepancy(space, tensor_stats)
    act = None
    if input_ids is not None:
        act = activation_discrepancy(space, hidden_state_discrepancy(base_dir, expert_dirs, input_ids))

    def r9(v):
        return [None if x is None else round(x, 9) for x in v]

    return Prior([d.label for d in space.dims], r9(param), None if act is None else r9(act))
