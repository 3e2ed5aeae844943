"""Extensions found through entry points, so the core never imports the packages that provide them.

Groups (declared in ``pyproject.toml``, ``[project.entry-points."GROUP"]``):

* ``mergepipe.worker_backends`` — ``mergepipe search --worker-backend NAME``: a module with
  ``KubernetesMerger``-style classes (``kubernetes``: :mod:`mergepipe_kube.search`, extra ``kube``).
* ``mergepipe.evaluators`` — search evaluators by kind (``zoo``: the demo zoo's per-domain eval
  loss, :class:`mergepipe_zoo.evaluator.ZooEvaluator`, extra ``zoo``), rebuilt from a search state's
  ``{"kind": NAME, ...}`` by :func:`mergepipe.search.evaluators.evaluator_from_spec`.
* ``mergepipe.demos`` — ``mergepipe demo`` (``zoo``: :func:`mergepipe_zoo.demo.run_demo`).
* ``mergepipe.testbed_kinds`` — ``mergepipe eval`` on a testbed whose ``kind`` the core does not
  score (``image-classification``: :func:`mergepipe_zoo.vision.evaluate`, extra ``zoo``).

An entry point takes effect when the distribution is (re)installed: ``pip install -e .`` after
editing ``pyproject.toml``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PluginMissing", "load_plugin"]


class PluginMissing(ImportError):
    """No entry point ``NAME`` in ``GROUP``, or its module failed to import (an extra that is not
    installed). The message says which; front ends add the install hint."""


def load_plugin(group: str, name: str) -> Any:
    """The object entry point ``name`` of ``group`` names (a module, class or function).

    Raises:
        PluginMissing: no such entry point is installed, or importing it failed (e.g. the
            extra it needs, such as torch or kubernetes, is missing); ``__cause__`` holds the
            import error.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise PluginMissing(f"no {group} entry point named {name!r} is installed")
    try:
        return found[0].load()
    except ImportError as e:
        raise PluginMissing(f"{group} {name!r} ({found[0].value}) cannot be imported: {e}") from e
