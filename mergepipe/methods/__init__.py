"""Merge methods: the method protocol (:mod:`.base`), one module per family (:mod:`.gta` with the
sparsifiers of :mod:`.sparsify`, :mod:`.linear`, :mod:`.slerp`, :mod:`.nuslerp`,
:mod:`.model_stock`, :mod:`.multislerp`, :mod:`.sce`, :mod:`.nearswap`, :mod:`.ram`,
:mod:`.arcee_fusion`, :mod:`.passthrough`), the registry (:mod:`.registry`), parameter settings and
their resolution per tensor (:mod:`.params`) and the torch kernels (:mod:`.kernels`)."""

from mergepipe.methods.params import ResolvedParams, resolve_params
from mergepipe.methods.registry import METHODS, MethodSpec, get_method, method_names

__all__ = ["METHODS", "MethodSpec", "ResolvedParams", "get_method", "method_names", "resolve_params"]
