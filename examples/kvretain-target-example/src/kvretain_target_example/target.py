"""The adapter: kvretain's Target contract over the fork's allocator.

The fork is kvretain's reference allocator (`reference_impl`, vLLM-shaped)
with its block pool's free queue replaced; `ReferenceTarget` already
translates configs, operations, hashes and events for that allocator, so the
adapter only says which components the fork uses. A fork of vLLM itself
would subclass `invariants.targets.vllm_target.VllmManagerTarget` (or `vllm_scheduler_target.VllmSchedulerTarget`) the same way.

Contract (docs/targets.md): `ExampleTarget(config)` raises
`model.contract.config.ConfigError` for a config the allocator rejects; `apply(op)`
returns the operation's `Observation` and raises `TargetCrash` when the
allocator fails on a well-formed sequence; `snapshot()` returns the
observable state and drains the KV events since the last call. Optional
capabilities are stated, never probed for: `features` below, and the
`Target` protocol's defaults (inherited through `ReferenceTarget`) for the rest.
"""

from __future__ import annotations

from dataclasses import replace

from invariants.targets.base import TargetFeatures
from invariants.targets.reference import ReferenceTarget
from model.contract.config import Config
from reference_impl.block_pool import BlockPool
from reference_impl.components import AllocatorComponents

from .free_queue import DictFreeQueue


class DictQueueBlockPool(BlockPool):
    free_queue_cls = DictFreeQueue  # type: ignore[assignment]


def fork_components(components: AllocatorComponents) -> AllocatorComponents:
    return replace(components, block_pool_cls=DictQueueBlockPool)


class ExampleTarget(ReferenceTarget):
    name = "example"
    # What the adapter can do beyond the required members (docs/targets.md): it
    # reports deltas (the checker's fast path), and the fork keeps the #40676
    # pinned tier of the reference allocator, so generated configurations include it.
    features = TargetFeatures(partial=True, pinning=True)
    MUTANTS = {"fork": fork_components}

    def __init__(self, config: Config) -> None:
        super().__init__(config, mutant="fork")
