"""Which container images a tenant may choose (``ModelMerge.spec.image``, ``MergeSearch.spec.image``).

A worker pod holds the namespace's S3 keys, which can rewrite the shared catalog, part records and
manifests: the image it runs is code running with those keys. So a tenant's image is refused
unless the platform listed it in the chart's ``merges.allowedImages`` (``MERGEPIPE_ALLOWED_IMAGES``).
Pods that carry more than the namespace's keys never run a tenant's image at all: the search
driver (which holds the search driver's ServiceAccount token) and the analyze Job (which writes
the shared catalog) always run the operator's configured merger image.

Allowlist entries (pure string matching on the image reference; the registry is not contacted):

- an entry containing ``@sha256:`` is a digest pin: the image must equal it exactly;
- any other entry is a glob over the whole reference: ``*`` matches within one path segment (not
  ``/``), ``**`` matches across segments, ``?`` one character other than ``/``; e.g.
  ``registry.example/team-a/*`` admits ``registry.example/team-a/merger:1.2`` but not
  ``registry.example/team-a/x/y:1`` nor ``registry.example/team-a-evil/merger:1``, and
  ``registry.example/team-a/merger@sha256:*`` admits only digest references of that repository.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: The chart value that lists the admitted images (named in every refusal).
ALLOWED_IMAGES_VALUE = "merges.allowedImages"


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def image_allowed(image: str, allowed: Iterable[str]) -> str | None:
    """The allowlist entry that admits ``image``, or ``None`` when none does.

    Args:
        image: an image reference as a spec gives it (``repo[:tag][@sha256:<64 hex>]``).
        allowed: the chart's ``merges.allowedImages`` entries (digest pins or globs, see the
            module docstring).
    """
    for entry in allowed:
        entry = str(entry).strip()
        if not entry:
            continue
        if "@sha256:" in entry and not any(c in entry for c in "*?"):
            if image == entry:
                return entry
        elif _glob_regex(entry).fullmatch(image):
            return entry
    return None


def image_issue(image: str | None, allowed: Iterable[str], field: str) -> str | None:
    """Why a spec's image override cannot run (``None``: it is unset, or allowed).

    Args:
        image: ``spec.image`` (``None`` or empty: the operator's merger image, always allowed).
        allowed: the chart's ``merges.allowedImages`` (empty: per-merge images are off).
        field: the spec field named in the message (``spec.image``).

    Returns:
        one line naming the field, the rule (the chart value) and the fix, for a Ready=False
        ``InvalidSpec`` condition.
    """
    if not image:
        return None
    allowed = [a for a in allowed if str(a).strip()]
    if not allowed:
        return (
            f"{field}: image {image!r} refused: per-merge images are disabled on this operator "
            f"({ALLOWED_IMAGES_VALUE} is empty: every worker runs the operator's merger image); "
            f"remove {field}, or ask the platform team to list the image in {ALLOWED_IMAGES_VALUE}"
        )
    if image_allowed(image, allowed) is None:
        shown = ", ".join(allowed[:5]) + (f" and {len(allowed) - 5} more" if len(allowed) > 5 else "")
        return (
            f"{field}: image {image!r} refused: it matches no entry of {ALLOWED_IMAGES_VALUE} ({shown}); "
            f"use an allowed image, or remove {field} to run the operator's merger image"
        )
    return None
