"""Chained prefix hashes over hash-block-size token chunks.

Contract: `block_hashes[i]` identifies the token prefix `tokens[:(i+1)*hbs]`
(the hash of chunk i chains its parent's hash), so equal hashes mean equal
prefixes with overwhelming probability. A group with block size `k*hbs` keys
its block j with `block_hashes[(j+1)*k - 1]`; the group id is appended to form
the map key, so one prefix hash can live in several groups.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
BlockHashWithGroupId = bytes

NONE_HASH: BlockHash = hashlib.sha256(b"kvretain-none-hash").digest()
_GROUP_ID_BYTES = 4


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 over (parent, tokens); the root chunk chains NONE_HASH."""
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    # Tokens are arbitrary Python ints: a length-prefixed decimal encoding is injective.
    payload = ",".join(map(str, token_ids)).encode()
    h.update(struct.pack(">I", len(token_ids)))
    h.update(payload)
    return h.digest()


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big", signed=False)


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-_GROUP_ID_BYTES]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big", signed=False)


def block_hash_for_group(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int, block_idx: int
) -> BlockHash:
    """Hash of group block `block_idx`: the fine hash at the block's last hbs boundary."""
    scale = block_size // hash_block_size
    return block_hashes[(block_idx + 1) * scale - 1]


def num_group_blocks_hashed(num_hashes: int, hash_block_size: int, block_size: int) -> int:
    """How many full group blocks the request's fine hashes cover."""
    return num_hashes // (block_size // hash_block_size)
