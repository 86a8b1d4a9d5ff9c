"""How many tokens a scheduler step computes for one request.

A step caps a request's chunk at the long-prefill threshold when other requests
are queued beside it (`long_prefill_cap`; vLLM `Scheduler.schedule`: "there is
nobody to starve" otherwise), before the step's budget. The allocator only sees chunk sizes, but Mamba state exists only where a chunk
ends, so the hit a later request can get depends on the scheduler's split
(vLLM `Scheduler._mamba_block_aligned_split`). With fine-grained hits
(`model.contract.fine_mamba`) a chunk also stops at the prompt's reusable hash-block
boundary, so its state exists to be keyed. Internal prefill checkpoints are
not modeled; the admission gates (`scheduler_reserve_full_isl`, the watermark) are
`model.policy.admission`'s.

vLLM's policy, read from `Scheduler.schedule` and `_mamba_block_aligned_split` in
vLLM 0.33.0; predicted, no claim to be correct.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.contract.config import Config

if TYPE_CHECKING:
    from model.machine.seams import Observer
    from model.machine.state import RequestState


def long_prefill_cap(threshold: int, num_queued: int) -> int:
    """The cap on one request's chunk in a step over `num_queued` requests (running and
    waiting): the threshold when another request is queued, else none (0). Drafts and
    admission padding count towards it: the cap applies to every token the request
    would compute. The Mamba split's "block wider than the budget" escape reads the
    threshold itself, whatever the queue (`mamba_chunk`'s `budget`)."""
    return threshold if num_queued > 1 else 0


def seq_cap_reached(num_running: int, max_num_seqs: int) -> bool:
    """The waiting pass admits no request once `running` holds `max_num_seqs` requests
    (0: no cap). vLLM 0.33.0 `Scheduler.schedule`, before each waiting request is peeked:
    `if num_running >= self.max_num_active_reqs: break` (`max_num_active_seqs` unset:
    `max_num_seqs`); the running pass is not capped (every running request was admitted
    under it)."""
    return 0 < max_num_seqs <= num_running


def seq_cap(cfg: Config) -> int:
    """The most running requests an engine built for `cfg` holds: its `max_num_seqs`, or
    where none is stated the most vLLM accepts with its budget (`SchedulerConfig`:
    `max_num_batched_tokens >= max_num_seqs`)."""
    return cfg.max_num_seqs or build_budget(cfg)


def build_budget(cfg: Config) -> int:
    """The token budget of every step of an engine built for `cfg`: its
    `max_num_batched_tokens`, or `max_model_len` where the configuration states none
    (the budget kvretain builds vLLM with then, which no step reaches)."""
    return cfg.max_num_batched_tokens or cfg.max_model_len


def capped(num_tokens: int, cap: int) -> int:
    """`num_tokens` under a long-prefill cap (0: none)."""
    return cap if 0 < cap < num_tokens else num_tokens


def mamba_checkpoint_position(num_tokens: int, block_size: int, eagle: bool) -> int:
    """The last block-aligned position whose state a replay can reuse."""
    limit = num_tokens if eagle else num_tokens - 1
    position = limit // block_size * block_size
    if eagle:
        position -= block_size
    return max(position, 0)


def mamba_chunk(
    *,
    start: int,
    num_new: int,
    budget: int,
    num_prompt_tokens: int,
    num_tokens: int,
    shared_prefix_boundary: int,
    block_size: int,
    eagle: bool,
    fine_hash_block_size: int = 0,
) -> int:
    """Clip a prefill chunk so it ends where a Mamba state must be cached.

    Non-final prefill chunks end on a block boundary (unless a block is wider
    than the budget); a chunk never runs past the last cacheable boundary, past
    the next boundary when it starts mid-block, or past the block-floored
    shared-prefix junction. `fine_hash_block_size` (fine-grained hits on: the
    hash block size, else 0) adds the prompt-tail stop.
    """
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new
    end = start + num_new
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= budget:
            end = aligned_end
    junction = shared_prefix_boundary
    last_cache_position = mamba_checkpoint_position(num_tokens, block_size, eagle)
    tail = (
        mamba_checkpoint_position(num_prompt_tokens, fine_hash_block_size, eagle)
        if fine_hash_block_size
        else 0
    )
    stops = (
        (start // block_size + 1) * block_size if start % block_size else 0,
        last_cache_position,
        tail if last_cache_position < tail < num_prompt_tokens else 0,
        start + (junction - start) // block_size * block_size if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


class StepChunks:
    """The chunk a step computes for one request, one part of `AllocatorModel` (which
    inherits it and sets `cap`, the step's `long_prefill_cap`): the request's tokens
    capped, at most what is left of the budget, then the Mamba split."""

    cfg: Config
    fine: bool
    cap: int
    observer: Observer

    def _next_chunk(self, req: RequestState, left: int, budget: int) -> int:
        """Tokens a running request computes next: at most `left` of the step's `budget`."""
        wanted = self.long_prefill_capped(req.num_tokens + len(req.drafts) - req.num_computed)
        return self.chunk(req, req.num_computed, min(wanted, left), budget)

    def long_prefill_capped(self, num_tokens: int) -> int:
        n = capped(num_tokens, self.cap)
        if n < num_tokens:
            self.observer.fired("chunk capped by the long-prefill threshold")
        return n

    def chunk(self, req: RequestState, start: int, n: int, budget: int) -> int:
        if not self.cfg.has_mamba_align:
            return n
        threshold = self.cfg.long_prefill_token_threshold
        return mamba_chunk(
            start=start,
            num_new=n,
            budget=min(budget, threshold) if threshold else budget,
            num_prompt_tokens=len(req.prompt),
            num_tokens=req.num_tokens,
            shared_prefix_boundary=req.shared_prefix_boundary,
            block_size=self.cfg.scheduler_block_size,
            eagle=self.cfg.eagle_drop,
            fine_hash_block_size=self.cfg.hash_block_size if self.fine else 0,
        )
