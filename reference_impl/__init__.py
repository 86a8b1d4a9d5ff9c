"""kvretain's reference allocator: the seeds' prefix-cache retention design as engineered code.

vLLM-shaped (KVCacheBlock, FreeKVCacheBlockQueue, BlockPool, *Manager,
*Coordinator, KVCacheManager, Request, Scheduler) so that vLLM engineers can
read it, but written independently: it imports nothing from vLLM, `model/` or
`invariants/` (it is what they judge). What differs from vLLM 0.33.0 on purpose:
the #40676 pinned tier, the seeds' KV-event profile, and the simplifications
listed in docs/semantics.md (no fine-grained hits, no Mamba checkpoints/CoW).
"""

from .block import KVCacheBlock
from .block_pool import BlockPool
from .components import AllocatorComponents
from .config import AllocatorConfig, KVCacheGroupConfig, validate
from .coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    replay_boundaries,
)
from .free_queue import FreeKVCacheBlockQueue
from .kv_cache_manager import KVCacheBlocks, KVCacheManager
from .managers import FullAttentionManager, MambaManager, SingleTypeKVCacheManager, SlidingWindowManager
from .request import Request, RequestStatus
from .scheduler import ProbeOutcome, ScheduleOutcome, Scheduler

__all__ = [
    "AllocatorComponents",
    "AllocatorConfig",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheGroupConfig",
    "KVCacheManager",
    "MambaManager",
    "ProbeOutcome",
    "Request",
    "RequestStatus",
    "ScheduleOutcome",
    "Scheduler",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "UnitaryKVCacheCoordinator",
    "replay_boundaries",
    "validate",
]
