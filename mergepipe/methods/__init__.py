"""Merge methods: the registry (:mod:`.registry`), parameter settings and their resolution per
tensor (:mod:`.params`) and block-wise kernels (:mod:`.kernels`)."""

from mergepipe.methods.params import ResolvedParams, resolve_params
from mergepipe.methods.registry import METHODS, MethodSpec, get_method, method_names

__all__ = ["METHODS", "MethodSpec", "ResolvedParams", "get_method", "method_names", "resolve_params"]
