"""The two gates of an admission: the whole sequence must fit, and the watermark.

An admission is an allocation for a request the scheduler's waiting loop takes
(status WAITING or PREEMPTED: a new request, a preempted one coming back, one
whose async load was promoted). Read from vLLM 0.33.0 (`Scheduler.schedule`'s
waiting loop passes `full_sequence_must_fit=scheduler_reserve_full_isl` and
`has_scheduled_reqs=bool(self.running)`; `KVCacheManager.allocate_slots`;
`SchedulerConfig.scheduler_reserve_full_isl`, default True, and `watermark`,
default 0.0). A running request's allocation passes neither gate.

- Watermark: `watermark_blocks` = int(watermark * num_blocks) free blocks an
  admission leaves, only while some request is running (`watermark_applies`).
- Full sequence (`Config.reserve_full_isl`): before anything is freed or
  allocated, the blocks the request's whole sequence (its tokens, at most
  max_model_len, no lookahead) would take, counted as the chunk's are but with
  each sliding-window group capped (`admission_cap_blocks`), plus the
  watermark, must fit the free pool (`full_sequence_fits`); else the admission
  fails as an allocation failure does.
- The chunk itself: its blocks plus the watermark must fit the free pool less
  an async load's reserve (`chunk_fits`).

A release table is not needed: every release the real-scheduler target drives
has both settings (`invariants.targets.vllm_capabilities.SCHEDULER_API`).

vLLM's policy, read from `Scheduler.schedule` and `KVCacheManager.allocate_slots` in
vLLM 0.33.0; predicted, no claim to be correct.
"""

from __future__ import annotations

from model.contract.config import Config
from model.contract.masks import cdiv
from model.policy.scheduling import build_budget, seq_cap

# At most this many sequences in kvretain's builds of vLLM's scheduler
# (`invariants.targets.vllm_scheduler_build.MAX_NUM_SEQS`; a test ties the two).
BUILD_MAX_NUM_SEQS = 128


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """The blocks a watermark fraction keeps free: int(watermark * num_blocks)
    (vLLM `KVCacheManager.__init__`, `self.watermark_blocks`)."""
    return int(watermark * num_blocks)


def watermark_applies(admission: bool, any_running: bool) -> bool:
    """The watermark binds an allocation iff it is an admission (WAITING or PREEMPTED)
    and a request is running when it is made (`has_scheduled_reqs=bool(self.running)`:
    the step's running requests, its admissions so far included)."""
    return admission and any_running


def full_sequence_tokens(num_tokens: int, max_model_len: int) -> int:
    """The tokens the full-sequence gate counts: the request's, at most max_model_len."""
    return min(num_tokens, max_model_len)


def admission_cap_blocks(window: int, block_size: int, in_flight_tokens: int, max_model_len: int) -> int:
    """A sliding-window group's cap on the full-sequence count, in blocks: the window's
    last `window - 1` tokens plus the tokens in flight, at most max_model_len, and one block
    more (the window may start inside a block) (vLLM
    `SlidingWindowSpec.max_admission_blocks_per_request`, without multi-module MTP's
    extra retained tokens). `in_flight_tokens`: `VllmConfig.max_in_flight_tokens`."""
    return cdiv(min(window - 1 + in_flight_tokens, max_model_len), block_size) + 1


def in_flight_tokens(cfg: Config, async_scheduling: bool) -> int:
    """vLLM's `VllmConfig.max_in_flight_tokens` for the engine built for `cfg`: its concurrent
    batches (2 under async scheduling, else 1: `max_concurrent_batches`, no pipeline
    parallelism) times its `max_num_batched_tokens`: the step budget (`build_budget`), for a
    draft model plus one drafting slot per sequence (`vllm_scheduler_build.vllm_config`)."""
    batched = build_budget(cfg)
    if cfg.num_lookahead_tokens and not cfg.eagle:
        batched += min(BUILD_MAX_NUM_SEQS, seq_cap(cfg))
    return (2 if async_scheduling else 1) * batched


def full_sequence_fits(full_blocks: int, watermark: int, num_free: int) -> bool:
    """Admitted past the first gate iff the whole sequence's blocks plus the watermark
    fit the free pool (no async-load reserve on this gate)."""
    return full_blocks + watermark <= num_free


def chunk_fits(chunk_blocks: int, watermark: int, num_free: int, reserve: int) -> bool:
    """The chunk is allocated iff its blocks plus the watermark fit the free pool less
    the reserve an async load leaves for the in-flight prefills."""
    return chunk_blocks + watermark <= num_free - reserve
