"""KV-cache coordinators: one hit length for all groups, one place for retention.

Contracts:
- the reconciled hit is a length every group can serve (full attention
  bounds it first; each other spec group may only lower it; iterate to a fixed
  point, or a single pass for "simple hybrid" = exactly two spec groups, the
  first full attention);
- `num_uncached_common_prefix_tokens` = longest single-group hit - reconciled
  hit: a shared prefix some group reached but a sparse-retention group has
  not cached (the "junction"); the manager reports hit + it as the request's
  `shared_prefix_boundary`;
- a hybrid model only caches up to a multiple of the scheduler block size
  (plus one Eagle peek block for Eagle groups), so every cached SWA / Mamba
  block ends at or before a boundary a hit can use;
- retention masks keep the tails of `replay_boundaries` (P-1, or the two
  Eagle resume points) and the request's shared-prefix boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .block import KVCacheBlock
from .block_pool import BlockPool
from .config import AllocatorConfig, KVCacheGroupConfig, validate_retention_interval
from .hashing import BlockHash
from .managers import MambaManager, SingleTypeKVCacheManager, cdiv
from .request import Request

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Positions a later request replaying this prompt can resume at.

    A resend is capped at P-1 (its last token is recomputed); with Eagle the
    last matched block is dropped, so the resend and a longer sibling resume
    one scheduler block earlier, at up to two distinct positions.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


class KVCacheCoordinator:
    """Owns the pool and one manager per group; fans every operation out in group order."""

    def __init__(
        self,
        config: AllocatorConfig,
        manager_classes: Mapping[str, type[SingleTypeKVCacheManager]],
        block_pool_cls: type[BlockPool] = BlockPool,
        enable_caching: bool = True,
    ) -> None:
        self.config = config
        self.scheduler_block_size = config.scheduler_block_size
        self.hash_block_size = config.hash_block_size
        self.enable_caching = enable_caching
        self.block_pool = block_pool_cls(
            config.num_blocks, enable_caching, config.hash_block_size, config.enable_kv_cache_events
        )
        # No group is flagged individually in our configs: Eagle flags them all.
        self.drop_eagle_group_ids: set[int] = set(range(len(config.groups))) if config.use_eagle else set()
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_classes[g.kind](
                g,
                self.block_pool,
                enable_caching,
                i,
                config.scheduler_block_size,
                config.pin_swa_on_drop,
                config.pin_min_drop_blocks,
            )
            for i, g in enumerate(config.groups)
        )
        if config.use_eagle:
            for m in self.single_type_managers:
                if isinstance(m, MambaManager):
                    m.drop_eagle_checkpoint_block = True
        self.retention_interval = config.retention_interval
        if self.retention_interval is not None:
            validate_retention_interval(
                self.retention_interval, self.scheduler_block_size, config.has_retention_group
            )

    # ------------------------------------------------------------- allocation
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[i],
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
            )
            for i, m in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
    ) -> None:
        """Adopt hit blocks in every group (a running request has none to adopt)."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            assert all(len(b) == 0 for b in new_computed_blocks)
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for m in self.single_type_managers
        )

    # ---------------------------------------------------------------- caching
    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """The prefix of the computed tokens group `kv_cache_group_id` may key."""
        return max(0, num_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        boundaries = replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size, bool(self.drop_eagle_group_ids)
        )
        for gid, m in enumerate(self.single_type_managers):
            if not m.enable_caching:
                continue
            m.cache_blocks(
                request,
                self.get_num_cacheable_tokens(num_computed_tokens, gid),
                self.retention_interval,
                boundaries,
            )

    # ------------------------------------------------------------------ other
    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        """(hit blocks per group, reconciled hit length, num_uncached_common_prefix_tokens)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching disabled: never a hit, every free goes to the queue head."""

    def __init__(
        self,
        config: AllocatorConfig,
        manager_classes: Mapping[str, type[SingleTypeKVCacheManager]],
        block_pool_cls: type[BlockPool] = BlockPool,
    ) -> None:
        super().__init__(config, manager_classes, block_pool_cls, enable_caching=False)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its own block size is the hit alignment; no junction."""

    def __init__(
        self,
        config: AllocatorConfig,
        manager_classes: Mapping[str, type[SingleTypeKVCacheManager]],
        block_pool_cls: type[BlockPool] = BlockPool,
    ) -> None:
        super().__init__(config, manager_classes, block_pool_cls, enable_caching=True)
        assert len(self.single_type_managers) == 1
        self.manager = self.single_type_managers[0]
        self.manager.use_eagle = 0 in self.drop_eagle_group_ids

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        m = self.manager
        blocks, hit = type(m).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, m.spec, m.use_eagle, m.block_size
        )
        return blocks, hit, 0


@dataclass
class SpecGroup:
    """Groups with one spec, looked up together (a hit must exist in each)."""

    spec: KVCacheGroupConfig
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool

    @property
    def is_full_attention(self) -> bool:
        return self.spec.kind == "full"


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: hits reconciled to a multiple of the scheduler block size."""

    def __init__(
        self,
        config: AllocatorConfig,
        manager_classes: Mapping[str, type[SingleTypeKVCacheManager]],
        block_pool_cls: type[BlockPool] = BlockPool,
    ) -> None:
        super().__init__(config, manager_classes, block_pool_cls, enable_caching=True)
        # Fine-grained (sub-sbs) hits are not modelled: alignment is always sbs.
        self.cache_hit_alignment_tokens = self.scheduler_block_size
        for m in self.single_type_managers:
            m.cache_hit_alignment_tokens = self.cache_hit_alignment_tokens
        self.spec_groups = self._split_spec_groups()
        self.is_simple_hybrid = len(self.spec_groups) == 2 and self.spec_groups[0].is_full_attention

    def _split_spec_groups(self) -> list[SpecGroup]:
        groups: list[SpecGroup] = []
        for i, m in enumerate(self.single_type_managers):
            eagle = i in self.drop_eagle_group_ids
            for sg in groups:
                if sg.spec.spec_key == m.spec.spec_key and sg.manager_cls is type(m):
                    sg.group_ids.append(i)
                    sg.use_eagle = sg.use_eagle or eagle
                    break
            else:
                groups.append(SpecGroup(m.spec, [i], type(m), eagle))
        groups.sort(key=lambda sg: not sg.is_full_attention)  # stable: full attention first
        for sg in groups:
            if sg.use_eagle:
                for gid in sg.group_ids:
                    self.single_type_managers[gid].use_eagle = True
        return groups

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        sbs = self.scheduler_block_size
        aligned = num_computed_tokens // sbs * sbs
        m = self.single_type_managers[kv_cache_group_id]
        if m.use_eagle and aligned > 0:
            # Eagle resumes one block before the boundary: keep the peek block after it.
            return min(num_computed_tokens, aligned + m.block_size)
        return aligned

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        n = len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * n
        hit_by_group = [0] * n
        eagle_verified: set[int] = set()
        max_hashed = len(block_hashes) * self.hash_block_size
        while True:
            curr = hit_length
            for idx, sg in enumerate(self.spec_groups):
                first = sg.group_ids[0]
                if sg.is_full_attention and blocks_by_group[first] is not None:
                    # Full-attention hits are downward closed: just re-bound.
                    curr = min(curr, hit_by_group[first])
                    continue
                drop = sg.use_eagle and idx not in eagle_verified
                max_length = curr
                if drop and sg.spec.kind != "mamba":
                    max_length = min(curr + sg.spec.block_size, max_hashed)
                blocks, new_hit = sg.manager_cls.find_longest_cache_hit(
                    block_hashes,
                    max_length,
                    sg.group_ids,
                    self.block_pool,
                    sg.spec,
                    drop,
                    self.cache_hit_alignment_tokens,
                )
                if drop:
                    eagle_verified.add(idx)
                elif new_hit < curr:
                    eagle_verified.clear()
                curr = new_hit
                for gid, lst in zip(sg.group_ids, blocks, strict=True):
                    blocks_by_group[gid] = lst
                    hit_by_group[gid] = new_hit
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.is_simple_hybrid:
                break
        for sg in self.spec_groups:
            if not sg.is_full_attention:
                continue
            keep = cdiv(hit_length, sg.spec.block_size)
            for gid in sg.group_ids:
                kept = blocks_by_group[gid]
                if kept is not None:
                    del kept[keep:]
                    hit_by_group[gid] = hit_length
        result = tuple(b if b is not None else [] for b in blocks_by_group)
        return result, hit_length, longest - hit_length


def get_kv_cache_coordinator(
    config: AllocatorConfig,
    manager_classes: Mapping[str, type[SingleTypeKVCacheManager]],
    block_pool_cls: type[BlockPool] = BlockPool,
    coordinator_classes: Mapping[str, type[KVCacheCoordinator]] | None = None,
) -> KVCacheCoordinator:
    classes = dict(DEFAULT_COORDINATOR_CLASSES, **(coordinator_classes or {}))
    if not config.enable_caching:
        kind = "no_prefix_cache"
    elif len(config.groups) == 1:
        kind = "unitary"
    else:
        kind = "hybrid"
    return classes[kind](config, manager_classes, block_pool_cls)  # type: ignore[call-arg]


DEFAULT_COORDINATOR_CLASSES: dict[str, type[KVCacheCoordinator]] = {
    "no_prefix_cache": KVCacheCoordinatorNoPrefixCache,
    "unitary": UnitaryKVCacheCoordinator,
    "hybrid": HybridKVCacheCoordinator,
}
