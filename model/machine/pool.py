"""The block pool: ref counts, the hash map, the free queue(s) and KV events.

Invariants this module maintains (and `invariants/` checks on every target):
- every block other than the null block 0 is in exactly one of: active
  (ref > 0), the regular free queue, the pinned tier;
- a block in a free queue has ref 0; no ref count is negative;
- `cached[key]` lists exactly the blocks carrying `key` (primary or
  secondary), in insertion order; a block's keys are dropped when it is reused;
- freed blocks are routed: pinned -> pinned tier; uncached (or caching off) ->
  head of the regular queue; cached -> tail (vLLM `BlockPool.free_blocks`).

Events follow a named profile: "seed" (what the #42258 review asked for: one
BlockStored per contiguous run of stored blocks, token ids exactly those
blocks') or "vllm-0.33.0" (one BlockStored per caching call over the whole
token range, masked blocks included: `block_pool.py` `cache_full_blocks`).
Either profile fills the rest of vLLM 0.33.0's event fields as vLLM does
(`model.contract.observation.BlockStored`): the group's spec kind and window
(`spec_metadata`), the extra keys of each hashed block and the LoRA adapter of
the request that stored it (`model.contract.extra_keys`: `event_keys`, `event_lora`; one
None per hash without salt, LoRA or multimodal items), and the defaults for the
GPU medium, no lookahead hashing, no session.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from model.contract.config import GroupSpec
from model.contract.extra_keys import Identity, event_keys, event_lora, identity_of, lookahead_token_ids
from model.contract.free_queue import LinkedFreeQueue, demote_n
from model.contract.observation import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Event,
    Tokens,
    block_key,
)
from model.contract.prefix import Prefix, block_name

EVENT_PROFILES = ("seed", "vllm-0.33.0")

# vLLM's `get_kv_cache_spec_kind` of the spec each group kind stands for
# (FullAttentionSpec, SlidingWindowSpec, MambaSpec: `KVCacheSpecKind` values).
SPEC_KINDS = {"full": "full_attention", "swa": "sliding_window", "mamba": "mamba"}


def spec_metadata(groups: Sequence[GroupSpec]) -> tuple[tuple[str, int | None], ...]:
    """Per group, the (kind, sliding window) its events carry: `KVCacheManager.__init__`'s
    `kv_cache_event_metadata` (`get_kv_cache_spec_sliding_window`: SWA specs only)."""
    return tuple((SPEC_KINDS[g.kind], g.sliding_window if g.kind == "swa" else None) for g in groups)


def no_extra_keys(num_hashes: int) -> tuple[None, ...] | None:
    """`extra_keys` of an event of `num_hashes` hashes without salt, LoRA or multimodal
    inputs: one None per hash, None for none (`to_event_extra_keys`)."""
    return (None,) * num_hashes or None


class Pool:
    def __init__(
        self,
        num_blocks: int,
        hash_block_size: int,
        enable_caching: bool,
        events: str = "seed",
        caching_off_to_head: bool = True,
        groups: Sequence[GroupSpec] = (),
        lookahead: int = 0,
    ) -> None:
        assert events in EVENT_PROFILES
        # Tokens past each block its hash covers (`Config.hash_lookahead`): keys, parents and
        # events name them (`model.contract.prefix.block_name`, `lookahead_token_ids`).
        self.lookahead = lookahead
        # Per group, the spec kind and window its BlockStored events carry.
        self.spec_meta = spec_metadata(groups)
        # Caching off: freed blocks to the head (#51482) or, before it, the tail (model.contract.profile).
        self.caching_off_to_head = caching_off_to_head
        self.num_blocks = num_blocks
        self.hbs = hash_block_size
        self.enable_caching = enable_caching
        self.event_profile = events
        self.ref = [0] * num_blocks
        self.primary: dict[int, BlockKey] = {}
        self.primary_tokens: dict[int, int] = {}
        self.secondary: dict[int, list[BlockKey]] = {}
        self.cached: dict[BlockKey, list[int]] = {}
        # O(1) per block at 156k blocks; `model.contract.free_queue.FreeQueue` is its definition.
        self.queue = LinkedFreeQueue(range(1, num_blocks))
        self.pinned_tier = LinkedFreeQueue()
        self.pinned: set[int] = set()
        self.events: list[Event] = []

    # -- counts -------------------------------------------------------------
    def num_free(self) -> int:
        return len(self.queue) + len(self.pinned_tier)

    # -- hash map -----------------------------------------------------------
    def keys_of(self, block: int) -> list[BlockKey]:
        first = [self.primary[block]] if block in self.primary else []
        return first + self.secondary.get(block, [])

    def lookup(self, key: BlockKey) -> int | None:
        blocks = self.cached.get(key)
        return blocks[0] if blocks else None

    def _insert(self, key: BlockKey, block: int) -> None:
        if self.primary.get(block) == key or block in self.cached.get(key, []):
            return
        if block not in self.primary:
            self.primary[block] = key
            self.primary_tokens[block] = len(key.tokens)
        else:
            self.secondary.setdefault(block, []).append(key)
        self.cached.setdefault(key, []).append(block)

    def drop_keys(self, block: int) -> None:
        """Remove every key of `block` from the map (one BlockRemoved per key)."""
        for key in self.keys_of(block):
            holders = self.cached.get(key, [])
            if block in holders:
                holders.remove(block)
                if not holders:
                    del self.cached[key]
                self.events.append(BlockRemoved(key.group, key.tokens))  # medium: the GPU default
        self.primary.pop(block, None)
        self.primary_tokens.pop(block, None)
        self.secondary.pop(block, None)

    # -- allocation ---------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.num_free():
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        if n > len(self.queue):
            for b in demote_n(self.pinned_tier, self.queue, n - len(self.queue)):
                self.pinned.discard(b)
        taken = self.queue.popleft_n(n)
        for b in taken:
            if self.enable_caching and b in self.primary:  # secondary keys come after a primary
                self.drop_keys(b)
            assert self.ref[b] == 0
            self.ref[b] = 1
        return taken

    def touch(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b == 0:
                continue
            if self.ref[b] == 0:
                (self.pinned_tier if b in self.pinned_tier else self.queue).remove(b)
            self.ref[b] += 1

    def free(self, ordered: Iterable[int], append_all: bool = False) -> None:
        """Route freed blocks; `append_all`: every one to the tail (releases before #42656)."""
        to_head: list[int] = []
        to_tail: list[int] = []
        to_pinned: list[int] = []
        for b in ordered:
            if b == 0:
                continue
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"negative ref count on block {b}"
            if self.ref[b] == 0:
                if b in self.pinned:
                    to_pinned.append(b)
                elif append_all:
                    to_tail.append(b)
                elif not self.enable_caching:
                    (to_head if self.caching_off_to_head else to_tail).append(b)
                elif b not in self.primary:
                    to_head.append(b)
                else:
                    to_tail.append(b)
        self.queue.prepend_n(to_head)
        self.queue.append_n(to_tail)
        self.pinned_tier.append_n(to_pinned)

    def pin(self, blocks: Iterable[int]) -> None:
        """Mark hashed blocks as pinned: when freed they go to the pinned tier."""
        self.pinned |= {b for b in blocks if b in self.primary}

    # -- caching ------------------------------------------------------------
    def cache_full_blocks(
        self,
        tokens: Tokens,
        table: Sequence[int],
        num_cached: int,
        num_full: int,
        block_size: int,
        group: int,
        kept: set[int] | None,
    ) -> None:
        if num_cached >= num_full:
            return
        stored: list[int] = []
        for i in range(num_cached, num_full):
            b = table[i]
            if b == 0 or (kept is not None and i not in kept):
                continue
            n_tok = (i + 1) * block_size
            if b in self.primary:
                assert self.primary_tokens[b] < n_tok, "re-caching a block with a longer key"
                self.drop_keys(b)
            self._insert(block_key(group, tokens, n_tok, self.lookahead), b)
            stored.append(i)
        L = self.lookahead
        if self.event_profile == "vllm-0.33.0":
            self.events.append(
                self._stored(
                    group,
                    tuple(block_name(tokens, (i + 1) * block_size, L) for i in stored),
                    block_name(tokens, num_cached * block_size, L) if num_cached else None,
                    tokens[num_cached * block_size : num_full * block_size],
                    block_size,
                    _keys(tokens, [i * block_size for i in stored], block_size, L),
                    identity_of(tokens),
                    _ahead(tokens, [(i + 1) * block_size for i in stored], L),
                )
            )
            return
        for run in _runs(stored):
            lo, hi = run[0], run[-1] + 1
            self.events.append(
                self._stored(
                    group,
                    tuple(block_name(tokens, (i + 1) * block_size, L) for i in run),
                    block_name(tokens, lo * block_size, L) if lo else None,
                    tokens[lo * block_size : hi * block_size],
                    block_size,
                    _keys(tokens, [i * block_size for i in run], block_size, L),
                    identity_of(tokens),
                    _ahead(tokens, [(i + 1) * block_size for i in run], L),
                )
            )

    def _stored(
        self,
        group: int,
        hashes: tuple[Prefix, ...],
        parent: Prefix | None,
        tokens: Tokens,
        block_size: int,
        keys: tuple[tuple[object, ...] | None, ...] | None,
        identity: Identity,
        ahead: tuple[Tokens, ...] | None = None,
    ) -> BlockStored:
        """A BlockStored with vLLM's other fields: `KVCacheManager.take_events` names the
        group's spec (None for a group it does not know), `to_event_extra_keys` the
        hashed blocks' `keys`, and the request's adapter (`event_lora`)."""
        kind, window = self.spec_meta[group] if group < len(self.spec_meta) else (None, None)
        lora_id, lora_name = event_lora(identity)
        extra = keys if keys is not None and any(k is not None for k in keys) else no_extra_keys(len(hashes))
        return BlockStored(
            group,
            hashes,
            parent,
            tokens,
            block_size,
            kind,
            window,
            extra,
            lora_id=lora_id,
            lora_name=lora_name,
            lookahead_token_ids=ahead,
        )

    def cache_partial_block(self, tokens: Tokens, block: int, num_tokens: int, group: int) -> BlockKey | None:
        """Key `block` also by the prefix of `num_tokens` (a multiple of hbs)."""
        if block == 0:
            return None
        key = block_key(group, tokens, num_tokens, self.lookahead)
        already = self.primary.get(block) == key or block in self.cached.get(key, [])
        if not already and block in self.primary and self.primary_tokens[block] < num_tokens:
            self.drop_keys(block)
        self._insert(key, block)
        if not already:
            lo = num_tokens - self.hbs
            self.events.append(
                self._stored(
                    group,
                    (key.tokens,),
                    block_name(tokens, lo, self.lookahead) if lo else None,
                    tokens[lo:num_tokens],
                    self.hbs,
                    _keys(tokens, [lo], self.hbs, self.lookahead),
                    identity_of(tokens),
                    _ahead(tokens, [num_tokens], self.lookahead),
                )
            )
        return key

    def move_keys(self, src: int, dst: int) -> None:
        """Every key of `src` now names the unkeyed `dst` instead (primary first);
        no events: the entries stay live (vLLM `BlockPool.move_block_hashes`)."""
        assert dst not in self.primary and dst not in self.secondary, f"block {dst} already keyed"
        keys, num_tokens = self.keys_of(src), self.primary_tokens.get(src)
        self.primary.pop(src, None)
        self.primary_tokens.pop(src, None)
        self.secondary.pop(src, None)
        for key in keys:
            self.cached[key].remove(src)
            if not self.cached[key]:
                del self.cached[key]
            self._insert(key, dst)
        if num_tokens is not None:
            self.primary_tokens[dst] = num_tokens

    # -- maintenance --------------------------------------------------------
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        for b in set(block_ids):
            self.drop_keys(b)
            if b in self.pinned_tier:
                self.pinned_tier.remove(b)
                self.queue.prepend_n([b])
            self.pinned.discard(b)

    def reset_prefix_cache(self) -> bool:
        if self.num_free() != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.primary.clear()
        self.primary_tokens.clear()
        self.secondary.clear()
        demote_n(self.pinned_tier, self.queue, len(self.pinned_tier))
        self.pinned.clear()
        self.events.append(AllBlocksCleared())
        return True


def _keys(
    tokens: Tokens, starts: Sequence[int], block_size: int, lookahead: int = 0
) -> tuple[tuple[object, ...] | None, ...] | None:
    """Per stored block (its first token in `starts`), its event's extra keys
    (`model.contract.extra_keys.event_keys`, over the hash's window); None for a request without
    an identity."""
    identity = identity_of(tokens)
    if not identity:
        return None
    return tuple(event_keys(identity, s, s + block_size, lookahead) for s in starts)


def _ahead(tokens: Tokens, ends: Sequence[int], lookahead: int) -> tuple[Tokens, ...] | None:
    """Per stored block (its end in `ends`), the tokens past it its hash covers: the event's
    `lookahead_token_ids` (`BlockPool._lookahead_token_ids`); None without lookahead hashes."""
    if not lookahead:
        return None
    return tuple(lookahead_token_ids(tokens, e, lookahead) for e in ends)


def _runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
