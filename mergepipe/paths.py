"""One path policy for every name that comes from a checkpoint, an index, a plan or a manifest.

Names such as a shard index's ``weight_map`` values, a plan's shard files or a manifest's output
files are data written by whoever made the file; mergepipe joins them under a root (a checkpoint
folder, an ``s3://`` prefix, a staging folder). :func:`check_name` accepts only names that stay
inside that root on every backend:

* a non-empty ``str`` of at most :data:`MAX_NAME_BYTES` UTF-8 bytes, each ``/``-separated segment
  at most :data:`MAX_SEGMENT_BYTES` (the common filesystem limit);
* relative (no leading ``/``), already normalised: no empty, ``.`` or ``..`` segment (so
  ``a//b``, ``./a``, ``a/..`` are refused, not rewritten);
* no backslash, NUL or other control character (a backslash is a separator on Windows and some
  S3 gateways; control characters make names that print as something else).

On object storage a name is a key suffix: with the rules above ``join(prefix, name)`` is always
a key under ``prefix/`` (S3 itself does not resolve ``..``, but some gateways and every local
mirror of the bucket do). On local storage the joined path must moreover *resolve* inside the
resolved root (:func:`check_inside`): a symlink inside a checkpoint may not lead out of it. The
one exception is the Hugging Face hub cache layout, where ``models--org--name/snapshots/<rev>/``
holds symlinks into ``models--org--name/blobs/``: for a root inside such a ``snapshots`` folder
the containment root is the repository's cache folder.

:meth:`mergepipe.storage.base.Storage.join` applies this policy to every name it joins, so no
name reaches a read or a write unchecked; readers of indexes, plans and manifests call
:func:`check_name` first as well, to name the file and field in the message.
"""

from __future__ import annotations

import os
import re

from mergepipe.errors import InputError

#: longest accepted name, in UTF-8 bytes (S3's key limit is 1024 bytes; PATH_MAX is 4096)
MAX_NAME_BYTES = 1024
#: longest accepted path segment, in UTF-8 bytes (NAME_MAX of ext4, xfs, btrfs, ...)
MAX_SEGMENT_BYTES = 255

_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def name_problem(name: object) -> str | None:
    """Why ``name`` breaks the policy (a short phrase), or None when it is acceptable."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if n > MAX_NAME_BYTES:
        return f"is {n} bytes long (limit {MAX_NAME_BYTES})"
    if _BAD_CHARS.search(name):
        return "contains a backslash or a control character"
    if name.startswith("/"):
        return "is an absolute path"
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            return "is not a normalised relative path (empty, '.' or '..' segment)"
        if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"has a path segment longer than {MAX_SEGMENT_BYTES} bytes"
    return None


def check_name(name: object, where: str, *, flat: bool = False) -> str:
    """Return ``name`` when it satisfies the policy (and, with ``flat``, is a single segment:
    a file name, not a path).

    Args:
        name: the name as read from a file.
        where: how to name its origin in the message, e.g. ``"ckpt/model.safetensors.index.json:
            weight_map['lm_head.weight']"``.

    Raises:
        InputError: naming ``where`` and the offending name (shortened to 120 characters).
    """
    why = name_problem(name)
    if why is None and flat and "/" in name:  # type: ignore[operator]
        why = "is a path; a shard file name is one file name in the checkpoint folder"
    if why is not None:
        shown = repr(name)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        raise InputError(f"{where}: name {shown} {why}; names must stay inside their folder or prefix.")
    return name  # type: ignore[return-value]


def containment_root(root: str) -> str:
    """The folder a local root's files must resolve into: ``realpath(root)``, or for a root
    inside a Hugging Face hub cache ``.../models--*/snapshots/<rev>`` the repository's cache
    folder (whose ``blobs/`` the snapshot's symlinks point into)."""
    real = os.path.realpath(root)
    parts = os.path.abspath(root).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--")):
            repo = os.sep.join(parts[:i])
            return os.path.realpath(repo or os.sep)
    return real


def check_inside(root: str, path: str, where: str) -> None:
    """Refuse a local ``path`` (a name joined under ``root``) that resolves outside
    :func:`containment_root` of ``root`` (through a symlink). Paths that do not exist yet
    resolve through their existing parents.

    Raises:
        InputError: naming ``where``, the path and where it leads.
    """
    base = containment_root(root)
    real = os.path.realpath(path)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise InputError(
            f"{where}: {path} resolves to {real} through a symbolic link, outside {base}; "
            "names must stay inside their folder."
        )
