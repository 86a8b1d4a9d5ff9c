"""Regression test for vLLM's prefix-cache allocator (vllm/v1/core).

Known finding vllm-cow-copy-of-same-step-block: With fine-grained Mamba hits (Full16 +
Mamba8, hash block 4, Eagle) the engine's first step computes 4 tokens of r1's 8-token
prompt (the Mamba state at 4 is kept, a fine-grained checkpoint) and r1 is aborted; its
next step admits r7 (20 tokens, new) and then r8 (16 tokens, r7's first 16). r7's first
full-attention block (1; 3 through the Scheduler, whose first step also reserves r1's
Eagle lookahead slot) is allocated and keyed in this step, before r7's forward pass has
written it; attention allows a same-step hit on it (only Mamba has the same-step guard).
r8's reconciled hit is 4 tokens (that block and r1's Mamba state), which ends inside the
block, so r8 gets a private copy 1 -> 5 (3 -> 6 through the Scheduler). The worker runs
copies in _update_states, before the step's forward pass (after zeroing newly allocated
blocks), so the copy receives the source's zeroed content and r8 reads wrong KV for
tokens 0..3: a silent output corruption. The model predicts the same copy (it follows
vLLM), so both targets show it; the invariant copies_sound names it. The trace is the
engine's own steps (every request held, the built budget), so it replays on
KVCacheManager, vLLM's Scheduler and its AsyncScheduler alike. A fix: refuse (defer to
the next step) a partial hit whose source was cached in the current step, as
MambaManager.get_num_blocks_to_allocate does for Mamba states.

Property copies_sound: Every copy a step queued (fine-grained Mamba hits, vLLM 0.33.0
`_apply_cow` / `move_block_hashes`) writes a block nobody else reads and reads cached
state. A hit that ends inside a block is copied: its last hit block in that group is the
source, the first block the step hands the request there is the destination (the reader
never writes the shared block). No request that held a destination before the step still
holds it (but one admitted afresh in the step: a failed load's blocks were freed at its
promotion first), and at most one block-table entry reads it after; a destination a
table reads copies a source that carries a key (a hit on cached state); the source is
never handed out as a new block in the same step (the copy would read what another
request wrote); a key the source lost in the step moved to the destination (the key
follows the state it names). A hit followed by a KV connector's external tokens is cut
to its last whole scheduler block first, so it is not copied
(`model.machine.connector`). Runs on every operation: on the fast path from the step's
delta (the endpoints are touched blocks), in an audit from whole snapshots.
Asked for by: introducing PR: not identified (0.32.0 is the first release the matrix
reproduces it on); fixing PR: none found (vLLM's PR threads searched 2026-11-27);
https://github.com/vllm-project/vllm/pull/56525 (related, open: guard Mamba state-block
hits behind the writing step's commit fence; the same class, a hit on content its step
has not written yet).

Exported by kvretain from a 6-operation trace (target vllm-manager, seed 29); kvretain
reported: copies_sound: copy 1 -> 5: source was allocated in the same step (the copy runs before
its content is written)
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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus

HASH_BLOCK_SIZE = 4
SCHEDULER_BLOCK_SIZE = 16
USE_EAGLE = True
NUM_LOOKAHEAD_TOKENS = 1


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
        num_blocks=26,
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
                MambaSpec(
                    block_size=8, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
                ),
            ),
        ],
        prefix_cache_retention_interval=None,
    )


def make_manager() -> KVCacheManager:
    init_none_hash(sha256)
    return KVCacheManager(
        make_kv_cache_config(),
        max_model_len=4096,
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
        mamba_partial_cache_hit=True,
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


def run_chunk(
    manager: KVCacheManager, request: Request, num_new_tokens: int, left: int, step_budget: int
) -> list[int] | None:
    """Scheduler.schedule, running queue: allocate a running request's next chunk;
    the ids of the blocks it handed out, or None when there is no room."""
    split = mamba_chunk(request, min(request.num_tokens - request.num_computed_tokens, left), 0, step_budget)
    expect(f"{request.request_id}: Scheduler's Mamba split (tokens)", split, num_new_tokens)
    blocks = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS)
    if blocks is None:
        return None
    request.num_computed_tokens += num_new_tokens
    return [b for ids in blocks.get_block_ids() for b in ids if b]


def admit(
    manager: KVCacheManager,
    request: Request,
    expected_hit: int,
    num_new_tokens: int,
    left: int,
    step_budget: int,
) -> list[int] | None:
    """Scheduler.schedule, waiting queue: the prefix-cache lookup, then the first chunk."""
    computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
    expect(f"{request.request_id}: prefix-cache hit", hit, expected_hit)
    split = mamba_chunk(request, min(request.num_tokens - hit, left), hit, step_budget)
    expect(f"{request.request_id}: Scheduler's Mamba split (tokens)", split, num_new_tokens)
    if num_new_tokens <= 0:
        return None
    blocks = manager.allocate_slots(
        request,
        num_new_tokens,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
        num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS,
    )
    if blocks is None:
        return None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = hit + num_new_tokens
    return [b for ids in blocks.get_block_ids() for b in ids if b]


def take_copies(manager: KVCacheManager) -> list[tuple[int, int]]:
    """Scheduler.schedule: drain the copy-on-write copies, release their retained blocks."""
    copies, retained = manager.take_kv_cache_block_copies()
    if retained:
        manager.block_pool.free_blocks(retained)
    return [(c.src_block_id, c.dst_block_id) for c in copies]


def test_vllm_cow_copy_of_same_step_block():
    manager = make_manager()
    step_new: list[int] = []
    req_r1 = make_request("r1", [3, 3, 1, 2, 2, 2, 3, 1])
    # One scheduler step over ['r1'], token budget 4096 (Scheduler.schedule:
    # running requests first, the newest preempted when an allocation fails, then
    # waiting requests admitted in order, only if nobody was preempted).
    manager.new_step_starts()
    step_new.clear()  # the blocks this step hands out
    blocks = admit(manager, req_r1, expected_hit=0, num_new_tokens=4, left=4096, step_budget=4096)  # waiting, in order
    expect("r1: admitted (room for its first 4 token(s))", blocks is not None, True)
    step_new += blocks
    copies = take_copies(manager)  # once per step, as Scheduler.schedule does
    finish(manager, req_r1)
    req_r7 = make_request("r7", [3, 3, 1, 2, 2, 2, 3, 1, 3, 2, 2, 1, 2, 2, 3, 3, 2, 3, 3, 1])
    req_r8 = make_request("r8", [3, 3, 1, 2, 2, 2, 3, 1, 3, 2, 2, 1, 2, 2, 3, 3])
    # One scheduler step over ['r7', 'r8'], token budget 4096 (Scheduler.schedule:
    # running requests first, the newest preempted when an allocation fails, then
    # waiting requests admitted in order, only if nobody was preempted).
    manager.new_step_starts()
    step_new.clear()  # the blocks this step hands out
    blocks = admit(manager, req_r7, expected_hit=0, num_new_tokens=16, left=4096, step_budget=4096)  # waiting, in order
    expect("r7: admitted (room for its first 16 token(s))", blocks is not None, True)
    step_new += blocks
    blocks = admit(manager, req_r8, expected_hit=4, num_new_tokens=8, left=4080, step_budget=4096)  # waiting, in order
    expect("r8: admitted (room for its first 8 token(s))", blocks is not None, True)
    step_new += blocks
    copies = take_copies(manager)  # once per step, as Scheduler.schedule does
    # A copy runs before the step's forward pass: its source must hold cached
    # state, never a block this step handed out (nothing has written it yet).
    same_step = [(src, dst) for src, dst in copies if src in step_new]
    assert not same_step, (
        f"copies (source, destination) {same_step}: source was allocated in the same step "
        "(the copy runs before its content is written)"
    )
