"""vLLM's request hashes lent to a probe.

A probe is a throw-away request: hashing its whole prompt from scratch costs
O(prompt) sha256 work per probe, which dominates at production scale (a
1M-token resend). Most of a probe's prompt is a prefix some live request
already hashed, and vLLM's hashes chain (hash i depends only on blocks
[0, i]), so the probe takes those hashes as they are (`shared_hashes`) and
vLLM's own hasher hashes only the rest (`continuing`). The hashes stay
vLLM's: nothing here computes or assumes one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def continuing(hasher: Any, known: list[Any]) -> Any:
    """vLLM's request hasher for a request whose first block hashes are `known`.

    A hasher returns the hashes of the request's full blocks past
    `len(request.block_hashes)`, chained from the last one; on its first call
    this one fills the empty list with `known`, so vLLM hashes on from there."""
    pending = [list(known)]

    def hash_new_full_blocks(request: Any) -> Any:
        if pending:
            request.block_hashes.extend(pending.pop())
        return hasher(request)

    return hash_new_full_blocks


def shared_hashes(tokens: list[int], donors: Iterable[Any], hash_block_size: int) -> list[Any]:
    """The hashes of the longest run of full blocks `tokens` shares with one of the
    `donors` (requests vLLM hashed), from their start."""
    best: list[Any] = []
    full = len(tokens) // hash_block_size
    for req in donors:
        n = min(full, len(req.block_hashes))
        if n <= len(best):
            continue
        ids = req.all_token_ids
        if ids[:hash_block_size] != tokens[:hash_block_size]:
            continue
        # Blocks [0, lo) agree, [0, hi) do not; each comparison reads only new tokens.
        lo, hi = 1, n + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            a, b = lo * hash_block_size, mid * hash_block_size
            if ids[a:b] == tokens[a:b]:
                lo = mid
            else:
                hi = mid
        if lo > len(best):
            best = list(req.block_hashes[:lo])
    return best
