"""Chained hashes of token blocks: the shared language of the radix cache and the prefix-aware router.

`chained_block_hashes(ids, block_size)[k]` identifies the whole prefix `ids[:(k+1)*block_size]`
(each hash folds in its parent's), so equal hashes mean equal prefixes with overwhelming
probability. Only full blocks are hashed. Deterministic across processes (no Python `hash`)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = 0


def chained_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Returns one 63-bit int per full block of `block_size` tokens, each chained on the previous."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    hashes: list[int] = []
    parent = _ROOT
    for k in range(n_blocks):
        block = token_ids[k * block_size : (k + 1) * block_size]
        digest = hashlib.blake2b(struct.pack(f"<q{len(block)}q", parent, *block), digest_size=8).digest()
        parent = int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
        hashes.append(parent)
    return hashes
