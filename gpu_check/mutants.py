"""Allocator mutants that the equivalence check must catch (negative controls).

`ReuseWithoutEvictTarget`: the reference allocator whose `get_new_blocks`
hands out a free cached block without removing its hash from the hash map
(the bug class "block reused, stale hash still in the map"). The block itself
forgets its key, so the allocator's own assertions stay quiet and only the
data shows the bug: a later request hits a block whose storage was
overwritten by its new owner (or poisoned when it was handed out), so some
mode must report a mismatch against the no-cache run.

Built on `reference_impl`'s component seam (a `BlockPool` subclass for one
allocator instance); nothing is patched at module level.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from invariants.targets.reference import Mutant, ReferenceTarget
from model.config import Config
from reference_impl.block import KVCacheBlock
from reference_impl.block_pool import BlockPool
from reference_impl.components import AllocatorComponents


class ReuseWithoutEvictPool(BlockPool):
    """`get_new_blocks` keeps the hashes of the blocks it reuses."""

    _allocating = False

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        self._allocating = True
        try:
            return super().get_new_blocks(num_blocks)
        finally:
            self._allocating = False

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if self._allocating:
            # The bug: the block forgets its keys, but the hash map still maps
            # them to it, so a later lookup hits the block's new contents.
            block.reset_hash()
            self.cached_block_hashes_by_block.pop(block.block_id, None)
            return False
        return super()._maybe_evict_cached_block(block)


def _reuse_without_evict(components: AllocatorComponents) -> AllocatorComponents:
    return replace(components, block_pool_cls=ReuseWithoutEvictPool)


class ReuseWithoutEvictTarget(ReferenceTarget):
    """Reference target with `ReuseWithoutEvictPool` (its own mutant table: no global registration)."""

    name = "reference+reuse-without-evict"
    MUTANTS: ClassVar[dict[str, Mutant]] = {"reuse_without_evict": _reuse_without_evict}

    def __init__(self, config: Config) -> None:
        super().__init__(config, mutant="reuse_without_evict")
