"""Multi-stage mergekit configs (``mergekit-multi``'s format), run locally.

A multi-stage config is a YAML stream of mergekit configs, each with a ``name`` (at most one
without: the final merge, written to ``--out``). A model reference equal to another stage's name
(``model: stage1``, ``base_model: stage1``, ``tokenizer_source: stage1``) is that stage's output,
``<intermediate dir>/<name>`` (mergekit 0.1.5 ``scripts/multimerge.py``: the same layout). Stages
run in dependency order (a cycle is refused), each as an ordinary ``mergepipe merge --config``
whose config is the stage's document with the names resolved (written beside the intermediates
as ``.configs/<name>.yml``, so each snapshot's plan records the config it came from).

Cached intermediates: a stage whose folder already holds a committed snapshot of the same plan
digest is not executed again (the commit step finds it: :func:`mergepipe.pipeline.merge_request`
returns ``already_committed``), so a rerun after changing a later stage recomputes only the
stages whose plans changed; the catalog keeps each intermediate's analysis too. (mergekit-multi
skips a stage whose folder merely has weights; mergepipe checks the plan digest.) A stage folder
holding a snapshot of another plan is refused by the commit step, naming the folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError
from mergepipe.limits import MAX_YAML_BYTES, load_yaml_all, read_file

_REF_KEYS = ("model", "base_model", "tokenizer_source", "source")


@dataclass
class Stage:
    """One stage: its name (None: the final merge), its config with names resolved, the stages it
    uses."""

    name: str | None
    config: dict
    deps: list[str] = field(default_factory=list)


def _resolve(value: Any, names: set[str], folder: str, used: list[str]) -> Any:
    """``value`` with every model reference naming a stage replaced by that stage's folder."""
    if isinstance(value, list):
        return [_resolve(v, names, folder, used) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in _REF_KEYS and isinstance(v, str):
                head, plus, tail = v.partition("+")
                if head in names:
                    if head not in used:
                        used.append(head)
                    v = os.path.join(folder, head) + plus + tail
                out[k] = v
            else:
                out[k] = _resolve(v, names, folder, used)
        return out
    return value


def load_stages(path: str | os.PathLike, intermediate_dir: str | os.PathLike) -> list[Stage]:
    """The stages of a multi-stage config in the order they run.

    Raises:
        InputError: unreadable file or YAML; a document that is not a mapping; a name that is
            not a non-empty string without ``/``; two stages with one name (or two unnamed);
            a dependency cycle — each message starts with the config path.
    """
    p = str(path)
    try:
        text = read_file(p, MAX_YAML_BYTES, "config").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{p}: the config is not UTF-8 text.") from None
    docs = [d for d in load_yaml_all(text, p) if d is not None]
    if not docs:
        raise InputError(f"{p}: no merge configurations; a multi-stage config is YAML documents separated by ---.")
    byname: dict[str | None, dict] = {}
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise InputError(f"{p}: document {i + 1}: a merge configuration is a mapping.")
        d = dict(d)
        name = d.pop("name", None)
        if name is not None and (not isinstance(name, str) or not name or "/" in name or name.startswith(".")):
            raise InputError(
                f"{p}: document {i + 1}: name: {name!r} must be a folder name (no '/', not starting with '.')."
            )
        if name in byname:
            what = f"two stages are named {name!r}" if name else "two documents have no name (one final merge)"
            raise InputError(f"{p}: document {i + 1}: name: {what}; give each stage its own name.")
        byname[name] = d
    names = {n for n in byname if n is not None}
    folder = os.path.abspath(str(intermediate_dir))
    stages: dict[str | None, Stage] = {}
    for n, d in byname.items():
        used: list[str] = []
        cfg = _resolve(d, names, folder, used)
        stages[n] = Stage(n, cfg, used)
    order: list[Stage] = []
    state: dict[str | None, int] = {}

    def visit(n: str | None, chain: list[str | None]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cyc = " -> ".join(str(x) for x in [*chain[chain.index(n) :], n])
            raise InputError(f"{p}: stages depend on each other in a cycle ({cyc}); a stage may use earlier ones only.")
        state[n] = 1
        for dep in stages[n].deps:
            visit(dep, [*chain, n])
        state[n] = 2
        order.append(stages[n])

    for n in byname:
        visit(n, [])
    return order


def merge_multi(
    path: str | os.PathLike, intermediate_dir: str | os.PathLike, out: str | None = None, **kw: Any
) -> list[tuple[str | None, Any]]:
    """Run every stage of the multi-stage config at ``path`` in dependency order: named stages
    into ``intermediate_dir/<name>``, the unnamed final stage into ``out``.

    Args:
        kw: passed to :func:`mergepipe.pipeline.merge_request` (``catalog``, ``storage``, ...).

    Returns:
        ``(stage name, MergeResult)`` per stage, in the order run; ``already_committed`` is True
        for a stage whose snapshot (same plan digest) was already there.

    Raises:
        InputError: see :func:`load_stages`; an unnamed final stage without ``out``; any stage's
            config error (message names the stage's config file).
    """
    import yaml

    from mergepipe.config import load_config
    from mergepipe.pipeline import merge_request, with_options

    stages = load_stages(path, intermediate_dir)
    if any(s.name is None for s in stages) and not out:
        raise InputError(f"{path}: the config has an unnamed final merge; give --out for it.")
    cfg_dir = Path(intermediate_dir) / ".configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str | None, Any]] = []
    for s in stages:
        cp = cfg_dir / f"{s.name or 'final'}.yml"
        text = yaml.safe_dump(s.config, sort_keys=False)
        if not cp.exists() or cp.read_text() != text:
            tmp = cp.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(cp)
        c = load_config(cp)
        target = os.path.join(os.path.abspath(str(intermediate_dir)), s.name) if s.name else str(out)
        req, rest = with_options(c.with_overrides(output=target), **kw)
        res = merge_request(req, where=c.where, **rest)
        results.append((s.name, res))
    return results
