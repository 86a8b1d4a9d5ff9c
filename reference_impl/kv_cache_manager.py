"""KVCacheManager: the allocator's API to a scheduler.

Contracts (docs/semantics.md; vLLM 0.33.0 `KVCacheManager`):
- `get_computed_blocks` is pure; its hit is <= num_tokens - 1 and it reports
  the shared-prefix boundary (hit + uncached common prefix, or 0);
- `allocate_slots` effects, in order: free what the window no longer needs
  (even if the allocation then fails), check the need against the free
  blocks of both tiers, adopt hit blocks, allocate new blocks (group order;
  the pool demotes pinned blocks only for what the regular queue lacks), key the blocks full by the end of the
  step (capped at known tokens). It returns None and changes nothing else
  when the need does not fit;
- `free` releases each group's table (group order; each table reversed,
  leading nulls trimmed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .block import KVCacheBlock
from .block_pool import BlockPool
from .components import AllocatorComponents
from .config import AllocatorConfig, validate
from .coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from .kv_events import KVCacheEvent
from .request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV-cache group (null blocks included)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def is_empty(self) -> bool:
        return not any(self.blocks)


class KVCacheManager:
    def __init__(self, config: AllocatorConfig, components: AllocatorComponents | None = None) -> None:
        self.config = validate(config)
        self.components = components or AllocatorComponents()
        self.enable_caching = self.config.enable_caching
        self.max_model_len = self.config.max_model_len
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(
            self.config,
            self.components.manager_classes,
            self.components.block_pool_cls,
            self.components.coordinator_classes,
        )
        self.block_pool: BlockPool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(self.config.groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

    # ----------------------------------------------------------------- lookup
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks per group, hit tokens, shared_prefix_boundary); pure."""
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            # The last token is always recomputed: its logits are needed.
            max_cache_hit_length = request.num_tokens - 1
        blocks, hit, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        spb = hit + num_uncached if num_uncached else 0
        return self._make_blocks(blocks), hit, spb

    def _make_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Blocks newly allocated this step per group, or None if they do not fit.

        `num_lookahead_tokens` more slots are reserved for speculative tokens in
        the attention groups; Mamba sizes by the scheduled tokens only.
        """
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        hits = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        rid = request.request_id
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)
        # Out-of-window blocks go back first, whether or not this step fits.
        self.coordinator.remove_skipped_blocks(rid, total_computed)
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        need = self.coordinator.get_num_blocks_to_allocate(
            rid, num_tokens_need_slot, hits, num_local_computed, num_local_computed, num_tokens_main_model
        )
        if not self._make_room(need):
            return None
        if hits is not self.empty_kv_cache_blocks.blocks:
            self.coordinator.allocate_new_computed_blocks(rid, hits, num_local_computed)
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_tokens_need_slot, num_tokens_main_model)
        # Keyed at allocation time, before the step runs: capped at known tokens.
        self.coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return self._make_blocks(new_blocks)

    def _make_room(self, need: int) -> bool:
        """Whether `need` blocks fit; pinned blocks count (#40676): the pool demotes
        the shortfall when it hands blocks out."""
        return need <= self.block_pool.get_num_available_blocks()

    # ---------------------------------------------------------------- release
    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.coordinator.reset_prefix_cache()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    # ------------------------------------------------------------ inspection
    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def request_ids_with_blocks(self) -> list[str]:
        """Requests holding a non-empty table in some group (first-seen order)."""
        seen: dict[str, None] = {}
        for m in self.coordinator.single_type_managers:
            for rid, table in m.req_to_blocks.items():
                if table:
                    seen[rid] = None
        return list(seen)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
