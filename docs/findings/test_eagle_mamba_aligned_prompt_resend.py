"""Regression test for vLLM's prefix-cache allocator (vllm/v1/core).

Known finding eagle-mamba-aligned-prompt-resend: With Eagle/MTP and a Mamba group in
align mode, a prompt whose length P is a multiple of the scheduler block size has two
replay boundaries: the resend boundary floor(P-1)-sbs and the extension boundary
floor(P)-sbs. The Mamba mask retains a state at both, but the scheduler's chunk split
only stops at get_mamba_prefill_checkpoint_position(num_tokens) = floor(P)-sbs, so the
state at the resend boundary is never computed: replaying the exact prompt hits 0. Here:
Full4+Mamba2, Eagle, retention 0, a 12-token prompt: the split stops at 8 only; the
resend needs the state at 4. The model and the reference follow vLLM's split
(docs/semantics.md), so all three targets show it. Not reproducible for P not
block-aligned (notes' P=100 case).

Property promise_kept: Right after a request finishes, replaying its prompt hits at the
latest retained boundary, unless blocks were reused since (#43447, #45845): every key
the replay needs was cached at some point, and if all are still cached the probe hit
reaches the promised boundary.
Asked for by: https://github.com/vllm-project/vllm/pull/52216 (review comment: mamba
prefix cache hit 0 when using eagle); https://github.com/vllm-project/vllm/pull/45845
(Mamba retention).

Exported by kvretain from a 4-operation trace (target vllm, seed 0); kvretain
reported: promise_kept: Eagle + Mamba, block-aligned prompt: resend boundary state never computed
It fails on the vLLM it was found on and passes once the allocator keeps the property.
Run with: pytest -q THIS_FILE (needs vllm and pytest only).
"""

from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus

HASH_BLOCK_SIZE = 2
SCHEDULER_BLOCK_SIZE = 4
USE_EAGLE = True
NUM_LOOKAHEAD_TOKENS = 0


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
                MambaSpec(
                    block_size=2, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
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


def mamba_chunk(request: Request, num_new_tokens: int, num_hit_tokens: int, token_budget: int) -> int:
    """The chunk Scheduler.schedule() computes: its Mamba block-aligned split, run on
    the scheduler settings of this configuration (align mode, no spec tokens)."""
    settings = SimpleNamespace(
        block_size=SCHEDULER_BLOCK_SIZE,
        cache_config=SimpleNamespace(block_size=SCHEDULER_BLOCK_SIZE),
        hash_block_size=HASH_BLOCK_SIZE,
        use_eagle_block_drop=USE_EAGLE,
        num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit=False,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,
        max_num_scheduled_tokens=token_budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )
    return Scheduler._mamba_block_aligned_split(settings, request, num_new_tokens, num_hit_tokens)


def schedule_step(manager: KVCacheManager, request: Request, token_budget: int) -> SimpleNamespace:
    """One scheduler step for one request, as Scheduler.schedule() drives the manager."""
    manager.new_step_starts()
    hit, new_block_ids = None, None
    if request.status == RequestStatus.RUNNING:
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, token_budget)
        n = mamba_chunk(request, n, 0, token_budget)
        blocks = None
        if n > 0:
            blocks = manager.allocate_slots(request, n, num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS)
        if blocks is not None:
            request.num_computed_tokens += n
            new_block_ids = [list(ids) for ids in blocks.get_block_ids()]
    else:
        computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
        n = min(request.num_tokens - hit, token_budget)
        n = mamba_chunk(request, n, hit, token_budget)
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
    return SimpleNamespace(num_hit_tokens=hit, new_block_ids=new_block_ids)


def finish(manager: KVCacheManager, request: Request) -> None:
    manager.free(request)
    request.status = RequestStatus.FINISHED_STOPPED


def preempt(manager: KVCacheManager, request: Request) -> None:
    """As Scheduler._preempt_request: free the blocks, wait again from token 0."""
    manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1


def test_eagle_mamba_aligned_prompt_resend():
    manager = make_manager()
    req_a = make_request("a", [1, 2, 3] * 4)
    schedule_step(manager, req_a, token_budget=16)
    schedule_step(manager, req_a, token_budget=16)
    finish(manager, req_a)
    # The replay boundary retention promises for this prompt: 4 tokens. Each
    # [group, tokens before the block's end, role] below must be in the hash map.
    needed = [
        [0, 4, "full block 0"],
        [0, 8, "Eagle peek block"],
        [1, 4, "mamba block 1"],
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
        f"the promised 4-token hit are not in the prefix cache: {missing}"
    )
    replay = make_request("a-replay", req_a.prompt_token_ids)
    _, num_hit_tokens, _ = manager.get_computed_blocks(replay)
    assert num_hit_tokens >= 4, (
        f"replaying the 12-token prompt of request 'a' right "
        f"after it finished hits {num_hit_tokens} tokens; retention promised 4 "
        "(every block the replay needs is cached and nothing was reused since)"
    )
