"""Size and shape limits for everything mergepipe reads whole or parses, in one place.

A checkpoint, index, config or plan is data from whoever made it; a small crafted file must not
make mergepipe allocate without bound. Every file or object read whole goes through
:func:`read_file` or :meth:`mergepipe.storage.base.Storage.read_object` with one of the caps
below (checked against the size *before* reading), every JSON document through
:func:`loads_json` (nesting depth bounded before parsing) and every YAML document through
:func:`load_yaml` (aliases may not expand past :data:`MAX_YAML_NODES` values). Error messages
quote values through :func:`short_repr`, never whole.

The caps are far above what real files need (a 671B-parameter model's shard index is ~9 MB; a
mergekit config a few KB) and of the order of the safetensors reference loader's 100 MB header
cap.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from mergepipe.errors import InputError

#: ``model.safetensors.index.json`` (bytes): as the safetensors header cap
MAX_INDEX_BYTES = 100_000_000
#: ``config.json``, ``generation_config.json`` and other small JSON files of a checkpoint (bytes)
MAX_CONFIG_JSON_BYTES = 16 << 20
#: a tokenizer file copied from the base (``tokenizer.json`` of a 256k vocabulary is ~35 MB) (bytes)
MAX_EXTRA_FILE_BYTES = 256 << 20
#: a mergekit YAML config (bytes)
MAX_YAML_BYTES = 1 << 20
#: a snapshot's ``manifest.json`` (bytes)
MAX_MANIFEST_BYTES = 256 << 20
#: a saved plan (``plan --out``) (bytes)
MAX_PLAN_BYTES = 1 << 30
#: any other object read whole (catalog index objects, search state, probe texts) (bytes)
MAX_OBJECT_BYTES = 1 << 30
#: members of an analysis zip of the object catalog (one per tensor, plus ``meta.json``)
MAX_ANALYSIS_MEMBERS = 1 << 20
#: inflated bytes an analysis zip member may declare per compressed byte (statistics compress
#: 1-5x; a zip bomb 1000x), beyond :data:`ANALYSIS_MEMBER_SLACK`
MAX_INFLATE_RATIO = 64
#: inflated bytes every member of an analysis zip may take whatever its compressed size
ANALYSIS_MEMBER_SLACK = 1 << 20
#: deepest accepted JSON nesting (headers need 3, plans and configs under 10)
MAX_JSON_DEPTH = 64
#: most values a YAML document may expand to once its aliases are resolved
MAX_YAML_NODES = 100_000


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (without building a huge repr first for
    containers: those are described by type and length)."""
    if isinstance(value, (list, tuple, dict, set)):
        return f"<{type(value).__name__} of {len(value)} items>"
    r = repr(value) if not isinstance(value, str) or len(value) <= 4 * limit else repr(value[: 4 * limit])
    return r if len(r) <= limit else r[: limit - 3] + "..."


def check_size(size: int, cap: int, source: str, what: str) -> None:
    """Raise :class:`InputError` when ``size`` (bytes) exceeds ``cap``."""
    if size > cap:
        raise InputError(
            f"{source}: {what} is {size} bytes, over the {cap}-byte limit; "
            "the file is corrupt or not what mergepipe expects."
        )


def read_file(path: str | os.PathLike, cap: int, what: str = "file") -> bytes:
    """Read a local file whole, refusing one larger than ``cap`` bytes before reading it.

    Raises:
        InputError: unreadable, not a regular file, or too large.
    """
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            if not os.path.isfile(p):
                raise InputError(f"{p}: not a regular file; give the path of a {what}.")
            check_size(st.st_size, cap, p, what)
            data = f.read(cap + 1)
    except InputError:
        raise
    except OSError as e:
        raise InputError(f"{p}: cannot read the {what} ({e.strerror}).") from None
    check_size(len(data), cap, p, what)  # grew while reading
    return data


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(data: bytes | str) -> int:
    """Deepest nesting of arrays/objects in a JSON text (strings ignored), computed without
    parsing (so without recursion)."""
    b = data.encode() if isinstance(data, str) else bytes(data)
    br = _STRINGS.sub(b"", b).translate(None, _NOT_BRACKETS)
    depth = best = 0
    for c in br:
        if c in (91, 123):
            depth += 1
            if depth > best:
                best = depth
        else:
            depth -= 1
    return best


def loads_json(data: bytes | str, source: str, *, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """``json.loads`` with the nesting depth bounded first.

    Raises:
        InputError: invalid UTF-8/JSON, or nested deeper than ``max_depth``.
    """
    import json

    d = json_depth(data)
    if d > max_depth:
        raise InputError(f"{source}: {what} is nested {d} levels deep (limit {max_depth}); the file is corrupt.")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"{source}: {what} is not valid UTF-8 JSON ({short_repr(str(e), 160)}).") from None


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` refusing documents whose aliases expand past :data:`MAX_YAML_NODES`
    values or refer to themselves (the "billion laughs" alias bomb), and several documents.

    Raises:
        InputError: invalid YAML (with line and column) or an alias bomb.
    """
    import yaml

    return _checked(_compose(source, lambda: yaml.compose(text, Loader=yaml.SafeLoader)), source)


def _compose(source: str, compose: Callable[[], Any]) -> Any:
    """``compose()`` (a PyYAML compose call), its errors turned into one-line InputErrors naming
    ``source`` (with line and column where PyYAML gives them)."""
    import yaml

    try:
        return compose()
    except RecursionError:
        raise InputError(f"{source}: the YAML is nested too deeply.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(
            f"{source}: not valid YAML{at} ({getattr(e, 'problem', None) or short_repr(str(e))})."
        ) from None


def load_yaml_all(text: str, source: str) -> list:
    """Every document of a multi-document YAML stream (mergekit-multi configs), each checked as
    :func:`load_yaml` checks one.

    Raises:
        InputError: invalid YAML (with line and column), an alias bomb, or a deep document.
    """
    import yaml

    nodes = _compose(source, lambda: list(yaml.compose_all(text, Loader=yaml.SafeLoader)))
    return [_checked(n, source) for n in nodes]


def _checked(node: Any, source: str) -> Any:
    """The value of a composed YAML ``node`` after the alias and depth checks of :func:`load_yaml`."""
    import yaml

    if node is None:
        return None
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:  # expanded size of every node, iteratively (no recursion on deep documents)
        n, done = stack.pop()
        k = id(n)
        if done:
            active.discard(k)
            kids = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else n.value
            sizes[k] = 1 + sum(sizes[id(c)] for c in kids)
            if sizes[k] > MAX_YAML_NODES:
                raise InputError(
                    f"{source}: the YAML expands to more than {MAX_YAML_NODES} values through "
                    "aliases (*name); write the values out or use fewer aliases."
                )
            continue
        if k in sizes:
            continue
        if k in active:
            raise InputError(
                f"{source}: a YAML alias refers to the node that contains it (a recursive structure); remove the alias."
            )
        if isinstance(n, yaml.ScalarNode):
            sizes[k] = 1
            continue
        active.add(k)
        stack.append((n, True))
        if len(active) > MAX_JSON_DEPTH:  # active = the path from the root to n
            raise InputError(f"{source}: the YAML is nested more than {MAX_JSON_DEPTH} levels deep.")
        kids = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else n.value
        for c in kids:
            stack.append((c, False))
    try:
        return _construct(node)
    except yaml.YAMLError as e:
        raise InputError(f"{source}: not valid YAML ({getattr(e, 'problem', None) or short_repr(str(e))}).") from None


def _construct(node):
    import yaml

    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()
