"""What a KV connector may do to the allocator: external hits, async loads, deferred frees.

A KV connector (vLLM `vllm/distributed/kv_transfer/kv_connector/v1/base.py`,
`KVConnectorBase_V1`) holds KV outside the pool. The scheduler asks it, at a
waiting request's admission lookup, how many tokens past the local
prefix-cache hit it can load (`get_num_new_matched_tokens`), and whether the
load is synchronous (done before the step's forward pass) or asynchronous
(between steps). kvretain states the connector's answer as operations
(`model.ops.Offer`, `model.ops.Loaded`); this module states what the
allocator then does, as vLLM 0.33.0's `Scheduler.schedule` and
`KVCacheManager.allocate_slots` do (`vllm/v1/core/sched/scheduler.py`,
`vllm/v1/core/kv_cache_manager.py`):

- **External hit.** An offer of the first `n` tokens gives
  `external_tokens(n, num_tokens, hit)` tokens past the local hit `hit` (never
  the last token, which is always computed). The admission's allocation holds
  the hit blocks, then one fresh block per group for each external block inside
  the window (`allocate_external_computed_blocks`, every group's after every
  group's hit blocks), then the chunk's blocks; the chunk starts after the
  external tokens. A sync load caches hit, external and chunk tokens at once,
  as a local hit would. An offer stands until the request's next admission
  succeeds (`update_state_after_alloc` consumes it).
- **Async load (delayed caching).** The admission allocates for the hit and the
  external tokens only (`allocate_slots(num_new_tokens=0,
  delay_cache_blocks=True)`), caches nothing, and the request waits
  (`WAITING_FOR_REMOTE_KVS`) with its computed tokens set; the step goes on to
  the next waiting request. Its allocation must leave free the blocks every
  in-flight prefill still needs (`in_flight_reserve`,
  `Scheduler._inflight_prefill_reserved_blocks`). Its blocks are cached when
  the step that first reaches it after the load reported promotes it
  (`Scheduler._update_waiting_for_remote_kv`: `cache_blocks(num_computed)`);
  it then takes its next chunk without a lookup.
- **Order.** Requests holding blocks while waiting (a load in flight or
  reported, or a promotion whose chunk did not fit) are reached before the
  other waiting requests (`Scheduler.kv_holding_waiting`); one whose load has
  not reported is passed over and the step goes on.
- **Failed load** (`kv_load_failure_policy="recompute"`, reported as
  `failed_recving`): nothing loaded is kept. At promotion every block of the
  request is freed (`KVCacheManager.free`), its computed tokens are 0 and it is
  admitted afresh in the same turn (a new lookup; the consumed offer is gone).
- **Deferred free.** A request finished while its load is in flight keeps its
  blocks until the load reports (`Scheduler.finish_requests`:
  `delay_free_blocks`, then `_update_from_kv_xfer_finished`). With a connector,
  every finish first frees the blocks that left the request's windows
  (`Scheduler._connector_finished`: `remove_skipped_blocks` on its processed
  tokens: computed, less those of the latest step when no step or load report
  has delivered its output yet, `Request.num_in_flight_tokens`), then the rest.

Not stated (generation avoids them): Mamba groups (vLLM's Mamba managers claim
a ring block for external tokens), block-level load failures
(`invalid_block_ids`, single-group only), the "fail" policy, and connectors
that defer a finished request's free to save it (`request_finished` returning
True).
"""

from __future__ import annotations

from collections.abc import Iterable

# The states of a request's connector load (`RequestLoad`), "" = none.
LOADING, LOADED, FAILED = "loading", "loaded", "failed"


def external_tokens(offered: int, num_tokens: int, hit: int) -> int:
    """Tokens an offer of the first `offered` tokens adds past a local hit of `hit`:
    never the request's last token (it is computed to sample the next one)."""
    return max(0, min(offered, num_tokens - 1) - hit)


def remaining_blocks(num_tokens: int, block_sizes: Iterable[int], held: Iterable[int]) -> int:
    """Blocks a request holding `held` blocks per group still needs for its whole
    sequence (`Scheduler._request_remaining_blocks` for a request with blocks)."""
    return sum(max(-(-num_tokens // bs) - h, 0) for bs, h in zip(block_sizes, held))
