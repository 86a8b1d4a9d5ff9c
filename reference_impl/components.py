"""Which classes make up an allocator: the seam for subclass-based variants.

A variant (e.g. a bug-zoo mutant) swaps one class for a subclass on one
allocator instance, never by patching the module: `dataclasses.replace(
AllocatorComponents(), block_pool_cls=MyPool)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import BlockPool
from .coordinator import DEFAULT_COORDINATOR_CLASSES, KVCacheCoordinator
from .managers import DEFAULT_MANAGER_CLASSES, SingleTypeKVCacheManager


@dataclass(frozen=True)
class AllocatorComponents:
    block_pool_cls: type[BlockPool] = BlockPool
    manager_classes: dict[str, type[SingleTypeKVCacheManager]] = field(
        default_factory=lambda: dict(DEFAULT_MANAGER_CLASSES)
    )
    coordinator_classes: dict[str, type[KVCacheCoordinator]] = field(
        default_factory=lambda: dict(DEFAULT_COORDINATOR_CLASSES)
    )

    def with_manager(self, kind: str, cls: type[SingleTypeKVCacheManager]) -> AllocatorComponents:
        return AllocatorComponents(
            self.block_pool_cls, {**self.manager_classes, kind: cls}, self.coordinator_classes
        )

    def with_coordinator(self, kind: str, cls: type[KVCacheCoordinator]) -> AllocatorComponents:
        return AllocatorComponents(
            self.block_pool_cls, self.manager_classes, {**self.coordinator_classes, kind: cls}
        )
