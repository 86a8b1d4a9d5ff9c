"""Regression test for vLLM's prefix-cache allocator (vllm/v1/core).

Known finding eagle-swa-short-run-double-pop: With Eagle and an SWA block size smaller
than the alignment (sbs), when no run of need blocks exists (the cached prefix is
shorter than the window), the run that reaches block 0 is popped back to alignment, then
the Eagle pop removes a block and the re-alignment removes the rest of that aligned
segment: the hit loses one aligned segment too many. Here: Full4 + SWA8(w=2) +
SWA4(w=10), Eagle, dense, a 17-token prompt fully computed: every needed block is
cached, the promised replay hit is 8, the reconciled hit is 0 because the SWA4 group
returns 0 instead of 8. The model reproduces vLLM's scan (model/contract/lookup.py
alignment_quirk).

Property promise_kept: Right after a request finishes, replaying its prompt hits at
least the latest retained boundary it reaches by design (`promised_boundary`), unless
blocks were reused since (#43447, #45845): every key serving that hit was cached at some
point, and if all are still cached the probe hit reaches the boundary. The serving keys
start at the request's own admission hit when that is higher: retention keeps the tails
the request computed, and below its hit it computed none (`promised_replay`).
Asked for by: https://github.com/vllm-project/vllm/pull/44082 (Eagle-aware SWA
mask/hit); https://github.com/vllm-project/vllm/issues/33270 (Eagle drop applied more
than once).

Exported by kvretain from a 3-operation trace (target vllm-manager, seed 0); kvretain
reported: promise_kept: Eagle SWA short run loses an extra aligned segment
It fails on the vLLM it was found on and passes once the allocator keeps the property.
Only the property is an `assert`: a setup step that no longer gives the value the trace
relies on raises SetupDiverged instead (the trace no longer reaches the finding's state).
Run with: pytest -q THIS_FILE (needs vllm and pytest only).
"""

from types import SimpleNamespace

import torch
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

HASH_BLOCK_SIZE = 4
SCHEDULER_BLOCK_SIZE = 8
USE_EAGLE = True
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
                    block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer1"],
                SlidingWindowSpec(
                    block_size=8, sliding_window=2, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer2"],
                SlidingWindowSpec(
                    block_size=4, sliding_window=10, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
        ],
        prefix_cache_retention_interval=None,
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


def test_eagle_swa_short_run_double_pop():
    manager = make_manager()
    req_a = make_request("a", [1] * 17)
    result = schedule_step(manager, req_a, token_budget=64)
    expect("a: prefix-cache hit", result.num_hit_tokens, 0)
    expect("a: tokens scheduled", result.num_scheduled, 17)
    finish(manager, req_a)
    # The replay boundary retention promises for this prompt: 8 tokens. Each
    # [group, tokens before the block's end, role] below must be in the hash map.
    needed = [
        [0, 4, "full block 0"],
        [0, 8, "full block 1"],
        [0, 12, "Eagle peek block"],
        [1, 8, "swa block 0"],
        [1, 16, "Eagle peek block"],
        [2, 4, "swa block 0"],
        [2, 8, "swa block 1"],
        [2, 12, "Eagle peek block"],
    ]
    pool = manager.block_pool
    missing = [
        (group, num_tokens, role)
        for group, num_tokens, role in needed
        if pool.get_cached_block(
            req_a.block_hashes[num_tokens // HASH_BLOCK_SIZE - 1], [group]
        )
        is None
    ]
    assert not missing, (
        f"right after request 'a' finished, blocks its replay needs for "
        f"the promised 8-token hit are not in the prefix cache: {missing}"
    )
    replay = make_request("a-replay", req_a.prompt_token_ids)
    _, num_hit_tokens, _ = manager.get_computed_blocks(replay)
    assert num_hit_tokens >= 8, (
        f"replaying the 17-token prompt of request 'a' right "
        f"after it finished hits {num_hit_tokens} tokens; retention promised 8 "
        "(every block the replay needs is cached and nothing was reused since)"
    )
