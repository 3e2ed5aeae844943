"""Merge methods: one registry of method objects, mergekit's names, parameters and defaults.

Most methods here are instances of generalized task arithmetic (mergekit's
``GeneralizedTaskArithmeticMerge``, kind ``gta``): per expert a task vector
``δᵢ = θᵢ − θ_base`` is *sparsified* (none / magnitude top-k / random Bernoulli / magnitude
window without outliers / DELLA's magnitude-ranked Bernoulli), optionally *rescaled* (L1-norm
matching), multiplied by its ``weight``, optionally passed through a *sign consensus* (TIES sign
election), summed, optionally *normalized* by the sum of (agreeing) weights, scaled by
``lambda`` and added to the base. ``linear`` is the weighted average of the models, which with a
base equals the base plus the weighted average of task vectors.

Three methods interpolate instead: ``model_stock`` (the base and the mean of the experts, with a
ratio from the experts' pairwise cosines), ``slerp`` (base and one expert along the great
circle) and ``nuslerp`` (two task vectors along the great circle). Their whole-tensor
statistics (norms, dot products) come from the catalog; see :mod:`mergepipe.numerics`.

Sources: Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089); TIES-Merging (Yadav et al.,
2023, arXiv:2306.01708); DARE (Yu et al., 2024, arXiv:2311.03099); Model Breadcrumbs
(Davari & Belilovsky, 2023, arXiv:2312.06795); DELLA-Merging (Deep et al., 2024,
arXiv:2406.11617); Model Stock (Jang et al., 2024, arXiv:2403.19522); SLERP (Shoemake, 1985);
mergekit 0.1.5 ``merge_methods/*.py`` and ``sparsify.py`` (names, parameters and defaults).

Each family lives in its own module (:mod:`.gta`, :mod:`.linear`, :mod:`.slerp`, ...) as a
:class:`~mergepipe.methods.base.MethodSpec` subclass holding its behaviour (the protocol is in
:mod:`.base`) and a ``METHODS`` tuple of its instances; :data:`FAMILIES` below lists the modules
in registration order (the order of :func:`method_names`). Adding a method: a module with its
class and instances, one line in :data:`FAMILIES`, and tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergepipe.errors import InputError
from mergepipe.methods import (
    arcee_fusion,
    gta,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    sce,
    slerp,
)
from mergepipe.methods.base import (  # noqa: F401 - re-exported: the registry's vocabulary
    DENSITY,
    INT8_MASK,
    LAMBDA,
    WEIGHT,
    Budget,
    Kind,
    MethodSpec,
    ParamSpec,
    Sparsify,
)

#: the family modules, in registration order (linear first, passthrough last, as mergekit lists them)
FAMILIES = (linear, gta, model_stock, slerp, nuslerp, multislerp, sce, nearswap, ram, arcee_fusion, passthrough)

METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to :data:`METHODS` under its name.

    Raises:
        ValueError: a method of that name is already registered.
    """
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} registered twice")
    METHODS[spec.name] = spec
    return spec


for _family in FAMILIES:
    for _spec in _family.METHODS:
        register(_spec)


def method_names() -> tuple[str, ...]:
    """mergekit's names of the registered merge methods, in registration order.

    The one list of methods in the core: front ends (the CLI's ``--method`` help, the operator's
    CRD enum) take theirs from here rather than keeping a copy.
    """
    return tuple(METHODS)


def budget_refusal(spec: MethodSpec, globals_: Mapping[str, Any]) -> str | None:
    """Why ``spec`` with the merge-wide settings ``globals_`` (as given: scalars, gradients or
    filter lists) cannot honour an expert-I/O budget or a fidelity target, or None when it can
    (:meth:`MethodSpec.budget_refusal`)."""
    return spec.budget_refusal(globals_)


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``.

    Raises:
        InputError: unknown method, listing the allowed names.
    """
    try:
        return METHODS[name]
    except KeyError:
        raise InputError(f"unknown merge method {name!r}; allowed: {', '.join(METHODS)}.") from None
