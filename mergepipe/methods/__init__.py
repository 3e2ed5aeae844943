"""Merge methods: the registry (:mod:`.registry`), block-wise kernels (:mod:`.kernels`) and a
dense whole-tensor reference implementation (:mod:`.reference`) used by the tests."""

from mergepipe.methods.registry import METHODS, MethodSpec, get_method, resolve_params

__all__ = ["METHODS", "MethodSpec", "get_method", "resolve_params"]
