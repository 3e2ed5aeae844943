"""Layer-wise multi-objective merge search (``mergepipe search``): the search space
(:mod:`~mergepipe.search.space`), the discrepancy prior (:mod:`~mergepipe.search.prior`), the
optimizer (:mod:`~mergepipe.search.optimizer`), evaluators (:mod:`~mergepipe.search.evaluators`),
the candidate loop and its state (:mod:`~mergepipe.search.runner`, :mod:`~mergepipe.search.state`)
and how front ends run it (:mod:`~mergepipe.search.driver`: state place, worker backends).

The package is also the public function :func:`mergepipe.api.search`: ``mergepipe.search(out,
config, evaluator)`` calls it. (``mergepipe.search`` names this package once any of its modules is
imported, so the package itself is callable rather than shadowed by the function.)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


class _CallableSearch(ModuleType):
    """This package, callable as :func:`mergepipe.api.search`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from mergepipe.api import search

        return search(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableSearch
