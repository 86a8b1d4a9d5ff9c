"""Regression test for vLLM's prefix-cache allocator (vllm/v1/core).

Known finding vllm-blockstored-token-range: When cache_full_blocks skips blocks (a
retention mask: sparse SWA/Mamba retention, or the dense SWA mask when
scheduler_block_size > the SWA block size; or null table entries: SWA's skipped prefix,
Mamba align's non-state positions) BlockStored.block_hashes lists only the stored blocks
but token_ids covers the whole range all_token_ids[num_cached*bs : num_full*bs], masked
blocks included, and parent_block_hash is the hash of block num_cached-1 even if that
block was never stored. A consumer cannot tell which token chunk a hash stands for.
Here: Full16+SWA16(w=32), R=0, a 100-token prompt in one chunk: the SWA group stores
only blocks 4 and 5 (the tail before the replay boundary 99) but the event carries 96
token ids. The model reproduces it under the event profile 'vllm-0.33.0'. Under async
scheduling (vllm-async-scheduler) vLLM also caches when a sampled token arrives
(update_from_output's cache_blocks: model/machine/async_scheduling.py), so the same
event comes from a Sample too, and, with a KV connector, from its report (Loaded,
Saved): the engine processes the latest step's output before the report's, and that
output's arrivals cache (model/machine/async_scheduling.py 6;
tests/test_vllm_async_connector.py). The synchronous scheduler emits the same event at
the step.

Property stored_tokens_match_hashes: Each BlockStored names only stored blocks, and its
token ids chain from its parent to exactly its hashes (#42258 review: with masked SWA
blocks the token range must be filtered too). Two messages, judged apart: the count of
token ids against the hashes, and whether every hash names, in order, a block of the
event's token range. A release whose events carry the whole range (vLLM #44451, a known
finding) fails the first only; the second still holds it to hashes that chain.
Asked for by: https://github.com/vllm-project/vllm/pull/42258 (review: keep BlockStored
consistent with block_mask); https://github.com/vllm-project/vllm/issues/44451 (open:
BlockStored token_ids span skipped blocks);
https://github.com/vllm-project/vllm/pull/44488 (open fix: BlockStored.block_offsets).

Exported by kvretain from a 2-operation trace (target vllm-manager, seed 0); kvretain
reported: stored_tokens_match_hashes: BlockStored(group 1) has 2 hash(es) of 16 tokens but 96
token ids
It fails on the vLLM it was found on and passes once the allocator keeps the property.
Only the property is an `assert`: a setup step that no longer gives the value the trace
relies on raises SetupDiverged instead (the trace no longer reaches the finding's state).
Run with: pytest -q THIS_FILE (needs vllm and pytest only).
"""

from types import SimpleNamespace

import torch
from vllm.distributed.kv_events import BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

HASH_BLOCK_SIZE = 16
SCHEDULER_BLOCK_SIZE = 16
USE_EAGLE = False
NUM_LOOKAHEAD_TOKENS = 0


class SetupDiverged(Exception):
    """A setup step of the trace gave another value than on the vLLM the finding was
    found on: the trace no longer reaches the finding's state, so this test says
    nothing about the finding (re-derive it). Not an AssertionError on purpose: the
    expected failure is the property's assertion at the end, and nothing else."""


def expect(step: str, got: object, expected: object) -> None:
    """A value the rest of the trace relies on: raise SetupDiverged, naming the step
    and both values, unless `got == expected`."""
    if got != expected:
        raise SetupDiverged(
            f"{step}: got {got!r}, expected {expected!r} "
            "(the trace no longer reaches the finding's state: re-derive the finding)"
        )


def make_kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"],
                FullAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer1"],
                SlidingWindowSpec(
                    block_size=16, sliding_window=32, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
        ],
        prefix_cache_retention_interval=0,
    )


def make_manager() -> KVCacheManager:
    init_none_hash(sha256)
    return KVCacheManager(
        make_kv_cache_config(),
        max_model_len=1048576,
        scheduler_block_size=SCHEDULER_BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        enable_caching=True,
        use_eagle=USE_EAGLE,
        enable_kv_cache_events=True,
    )


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=1 << 30),
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
    )


def schedule_step(manager: KVCacheManager, request: Request, token_budget: int) -> SimpleNamespace:
    """One scheduler step for one request, as Scheduler.schedule() drives the manager."""
    manager.new_step_starts()
    hit, new_block_ids = None, None
    if request.status == RequestStatus.RUNNING:
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, token_budget)
        blocks = None
        if n > 0:
            blocks = manager.allocate_slots(request, n, num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS)
        if blocks is not None:
            request.num_computed_tokens += n
            new_block_ids = [list(ids) for ids in blocks.get_block_ids()]
    else:
        computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
        n = min(request.num_tokens - hit, token_budget)
        blocks = None
        if n > 0:
            blocks = manager.allocate_slots(
                request,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=computed,
                num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS,
            )
        if blocks is not None:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit + n
            new_block_ids = [list(ids) for ids in blocks.get_block_ids()]
    # Scheduler.schedule(): drain copy-on-write copies, release their retained blocks.
    _, retained = manager.take_kv_cache_block_copies()
    if retained:
        manager.block_pool.free_blocks(retained)
    num_scheduled = n if blocks is not None else 0
    return SimpleNamespace(num_hit_tokens=hit, num_scheduled=num_scheduled, new_block_ids=new_block_ids)


def finish(manager: KVCacheManager, request: Request) -> None:
    manager.free(request)
    request.status = RequestStatus.FINISHED_STOPPED


def preempt(manager: KVCacheManager, request: Request) -> None:
    """As Scheduler._preempt_request: free the blocks, wait again from token 0."""
    manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1


def stored_token_ids(events) -> dict[int, list[int]]:
    """Per group, the token ids of every BlockStored event, in order."""
    out: dict[int, list[int]] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            out.setdefault(ev.group_idx, []).extend(ev.token_ids)
    return out


def test_vllm_blockstored_token_range():
    manager = make_manager()
    req_A = make_request("A", list(range(1, 101)))
    manager.take_events()  # only this step's events count
    result = schedule_step(manager, req_A, token_budget=100)
    expect("A: prefix-cache hit", result.num_hit_tokens, 0)
    expect("A: tokens scheduled", result.num_scheduled, 100)
    stored = stored_token_ids(manager.take_events())
    # group 0: the tokens of the 6 block(s) this step put in the hash map
    expected_0 = list(range(1, 97))
    assert stored.get(0, []) == expected_0, (
        f"BlockStored events of group 0 carry {len(stored.get(0, []))} token ids; "
        f"the blocks stored in group 0 hold {len(expected_0)}: a consumer cannot tell "
        "which tokens a block hash stands for"
    )
    # group 1: the tokens of the 2 block(s) this step put in the hash map
    expected_1 = list(range(65, 97))
    assert stored.get(1, []) == expected_1, (
        f"BlockStored events of group 1 carry {len(stored.get(1, []))} token ids; "
        f"the blocks stored in group 1 hold {len(expected_1)}: a consumer cannot tell "
        "which tokens a block hash stands for"
    )
