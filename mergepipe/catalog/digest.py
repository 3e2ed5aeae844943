"""Content digests of blocks, shared by the statistics, the sketches and the engine's read checks."""

from __future__ import annotations

import hashlib

#: bytes of a block's content digest: a 128-bit SHA-256 prefix
BLOCK_DIGEST_BYTES = 16


def block_digest(data: bytes | memoryview) -> bytes:
    """The content digest of one block's bytes: the first :data:`BLOCK_DIGEST_BYTES` bytes of
    its SHA-256 (``hashlib`` releases the GIL while hashing, so reader threads hash in parallel)."""
    return hashlib.sha256(data).digest()[:BLOCK_DIGEST_BYTES]
