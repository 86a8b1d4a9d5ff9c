"""Fine-grained Mamba hits and the copy-on-write copies they need (vLLM 0.33.0).

A Mamba state exists only where a chunk ended, so a Mamba block wider than the
hash block (bs = k * hbs, k > 1) can hold the state of a prefix that ends
inside it. vLLM then lets hits end at any hash-block boundary ("partial hash
hits", `kv_cache_utils.partial_hash_hits_enabled`,
`HybridKVCacheCoordinator.enable_partial_hash_hits`) when the model is hybrid,
caches prefixes, has a Mamba group in 'align' mode wider than the hash block,
and every other group can look up a boundary inside its blocks (full
attention, Mamba) or is exactly one hash block wide. Then:

- alignment: every group's hit alignment is the hash block, not the scheduler
  block, and cacheable lengths are no longer floored to the scheduler block
  (`_cache_hit_alignment_tokens`, `_align_cacheable`);
- hits (`fine_full_hit`, `fine_mamba_hit`): a hit may end at a keyed hash
  boundary inside a block; the block read there is the one keyed by that
  boundary's prefix (`KeyLayout` names each read by its key's length);
- keys: the state block at the prompt's reusable boundary is keyed by that
  boundary's prefix even when it lies inside the block
  (`MambaManager._cache_partial_tail_block`, `BlockPool.cache_partial_block`);
- copies (`Copy`): a block keyed at a boundary inside it is shared content
  that its reader goes on writing, so each such read gets a private block
  that a copy fills before the step's forward runs. A request admitted with a
  hit ending inside a block reads the shared block as the copy's source and
  writes the fresh destination, which replaces it in its table (consumer,
  `SingleTypeKVCacheManager._apply_cow`). A request that keyed its own state
  mid-block keeps writing that block: the keys move to the fresh destination
  (`BlockPool.move_block_hashes`), which the copy fills (producer). Both
  endpoints hold one reference beyond the tables' until the step's copies are
  taken and released (`KVCacheManager.take_kv_cache_block_copies`,
  `Scheduler._free_cow_retained_blocks`), so a same-step free cannot recycle
  either before the copy ran.
"""

from __future__ import annotations

from collections.abc import Callable

from model.contract.config import Config

KeyLayout = list[int | None]
"""Per table position of a hit, the length of the prefix whose key names the
block read there (None: the table holds the null block)."""

Copy = tuple[int, int]
"""A copy-on-write copy: (source block, destination block)."""

KeyedAt = Callable[[int], bool]
"""Whether the prefix of this many tokens is keyed in every group looked up."""


def fine_hits_enabled(cfg: Config) -> bool:
    """vLLM `partial_hash_hits_enabled` for the hybrid coordinator (caching on, >1 group)."""
    if not cfg.enable_caching or len(cfg.groups) < 2:
        return False
    hbs = cfg.hash_block_size
    if not any(
        g.kind == "mamba" and g.mamba_cache_mode == "align" and g.block_size > hbs for g in cfg.groups
    ):
        return False
    return all(g.kind in ("full", "mamba") or g.block_size == hbs for g in cfg.groups)


def is_fine_lookup(cfg: Config, kind: str, block_size: int) -> bool:
    """Whether a group of this kind and width probes boundaries inside its blocks."""
    return fine_hits_enabled(cfg) and kind in ("full", "mamba") and block_size > cfg.hash_block_size


def eagle_margin(cfg: Config, kind: str, block_size: int) -> int:
    """Tokens an Eagle group looks past the candidate before giving back its drop
    (vLLM `eagle_proof_margin`): one hash block for a fine lookup, else one block."""
    return cfg.hash_block_size if is_fine_lookup(cfg, kind, block_size) else block_size


def coarse_keys(layout: list[int | None], block_size: int) -> tuple[KeyLayout, int]:
    """A block-granular layout (`model.contract.lookup`) as keys: block j is read by the key of its end."""
    return [None if j is None else (j + 1) * block_size for j in layout], len(layout) * block_size


def fine_full_hit(
    keyed: KeyedAt, max_length: int, block_size: int, hbs: int, num_hashed: int, drop_eagle: bool
) -> tuple[KeyLayout, int]:
    """Full attention with fine lookups (`FullAttentionManager.find_longest_cache_hit`).

    The whole blocks keyed from block 0, then the longest keyed hash boundary
    strictly inside the next block (never past `max_length` or the hashed
    tokens). Eagle gives back one hash block (the tail block's KV still
    covers the shorter prefix), trimming the tail block if nothing of it is left.
    """
    limit = min(max_length, num_hashed)
    n = 0
    while (n + 1) * block_size <= limit and keyed((n + 1) * block_size):
        n += 1
    keys: KeyLayout = [(j + 1) * block_size for j in range(n)]
    hit = n * block_size
    inside = [e for e in range(hit + hbs, hit + block_size, hbs) if e <= limit and keyed(e)]
    if inside:
        hit = max(inside)
        keys.append(hit)
    if drop_eagle and hit > 0:
        hit -= hbs
    return keys[: -(-hit // block_size)], hit


def fine_mamba_hit(
    keyed: KeyedAt, max_length: int, block_size: int, hbs: int, num_hashed: int
) -> tuple[KeyLayout, int]:
    """Mamba with fine lookups (`MambaManager.find_longest_cache_hit`): the longest
    hash boundary whose state is keyed; the table is null up to the block holding it."""
    ends = [e for e in range(hbs, min(max_length, num_hashed) + 1, hbs) if keyed(e)]
    if not ends:
        return [], 0
    e = max(ends)
    return [None] * ((e - 1) // block_size) + [e], e


def ends_inside_block(num_hit_blocks: int, hit: int, block_size: int) -> bool:
    """A hit whose last block is read only in part: its reader needs a private copy
    (`SingleTypeKVCacheManager._has_partial_local_hit`)."""
    return num_hit_blocks > 0 and hit % block_size != 0


def retained_endpoints(copies: list[Copy]) -> list[int]:
    """The blocks the step's copies release, in vLLM's order: source, destination, ..."""
    return [b for pair in copies for b in pair]
