"""Kubernetes object names and label values, shared by the operator (``mergepipe_operator``) and
the search driver's Kubernetes backend (:mod:`mergepipe_kube.search`), which must name the same
objects alike (a candidate's ModelMerge, its evaluation Job, the search label on both).

Rules: `DNS-1123 labels <https://kubernetes.io/docs/concepts/overview/working-with-objects/names/>`_
(≤ 63 characters, lower-case alphanumerics and ``-``, alphanumeric at both ends) and label values
(≤ 63 characters, alphanumerics, ``-_.``, alphanumeric at both ends). Pure standard library.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["DNS_LABEL_RE", "dns_label", "label_value"]

DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _sanitize(name: str) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", name.lower())
    s = re.sub(r"-{2,}", "-", s).strip("-")
    return s or "merge"


def dns_label(prefix: str, suffix: str, limit: int = 63) -> str:
    """``<prefix>-<suffix>`` as a DNS-1123 label of at most ``limit`` chars. A prefix that had to
    be changed (invalid characters) or truncated is tagged with 8 hex of its SHA-256, so distinct
    prefixes give distinct names.

    Raises:
        ValueError: ``suffix`` leaves fewer than 10 characters for the prefix.
    """
    room = limit - len(suffix) - 1
    if room < 10:
        raise ValueError(f"suffix {suffix!r} leaves no room for a name")
    base = _sanitize(prefix)
    if base != prefix or len(base) > room:
        tag = hashlib.sha256(prefix.encode()).hexdigest()[:8]
        head = base[: room - 9].rstrip("-")
        base = f"{head}-{tag}" if head else tag
    name = f"{base}-{suffix}"
    assert len(name) <= limit and DNS_LABEL_RE.match(name), name
    return name


def label_value(value: str) -> str:
    """A label value (<= 63 chars, alphanumeric at both ends) standing for ``value``: ``value``
    itself when it is one, else a DNS label tagged with 6 hex of its SHA-256."""
    if len(value) <= 63 and _LABEL_VALUE_RE.match(value):
        return value
    return dns_label(value, hashlib.sha256(value.encode()).hexdigest()[:6])
