"""mergepipe: budget-aware LLM merging — a catalog of per-block task-vector statistics, a planner
that picks expert blocks under an expert-I/O budget, a streaming engine and an atomic commit with
an immutable manifest.

The Python API (:mod:`mergepipe.api`; the CLI is a layer over it)::

    import mergepipe

    req = mergepipe.MergeRequest(base="./base", experts=[{"name": "math", "uri": "./math"}],
                                 method="ties", parameters={"density": 0.5}, budget="25%",
                                 output="./merged")
    plan = mergepipe.plan(req)      # a Plan (digest, estimated bytes, block choices)
    res = mergepipe.merge(req)      # a MergeResult (snapshot id, manifest, realized bytes)
    mergepipe.verify(res.out).ok    # the files re-hashed against the manifest

Names load on first use (``import mergepipe`` imports neither torch nor numpy).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> module defining it (imported on first attribute access, PEP 562)
_LAZY = {
    "plan": "mergepipe.api",
    "merge": "mergepipe.api",
    "analyze": "mergepipe.api",
    "verify": "mergepipe.api",
    "search": "mergepipe.search",  # the package, callable as mergepipe.api.search (see there)
    "load_config": "mergepipe.api",
    "Analysis": "mergepipe.api",
    "Verification": "mergepipe.api",
    "SearchResult": "mergepipe.api",
    "MergeRequest": "mergepipe.request",
    "ExpertRequest": "mergepipe.request",
    "RequestOptions": "mergepipe.request",
    "Plan": "mergepipe.planner.plan",
    "MergeResult": "mergepipe.result",
    "SearchConfig": "mergepipe.search.runner",
    "InputError": "mergepipe.errors",
    "MergepipeError": "mergepipe.errors",
    "CommitConflict": "mergepipe.errors",
    "method_names": "mergepipe.methods.registry",
}

__all__ = [
    "Analysis",
    "CommitConflict",
    "ExpertRequest",
    "InputError",
    "MergeRequest",
    "MergeResult",
    "MergepipeError",
    "Plan",
    "RequestOptions",
    "SearchConfig",
    "SearchResult",
    "Verification",
    "__version__",
    "analyze",
    "load_config",
    "merge",
    "method_names",
    "plan",
    "search",
    "verify",
]

if TYPE_CHECKING:
    from mergepipe.api import (
        Analysis,
        SearchResult,
        Verification,
        analyze,
        load_config,
        merge,
        plan,
        verify,
    )
    from mergepipe.errors import CommitConflict, InputError, MergepipeError
    from mergepipe.methods.registry import method_names
    from mergepipe.planner.plan import Plan
    from mergepipe.request import ExpertRequest, MergeRequest, RequestOptions
    from mergepipe.result import MergeResult
    from mergepipe.search.runner import SearchConfig


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use and cache the name in this package."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mergepipe' has no attribute {name!r}")
    mod = import_module(module)
    value = mod if module == f"{__name__}.{name}" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})
