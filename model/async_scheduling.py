"""Async scheduling: the scheduler runs one step ahead of the model runner (vLLM 0.33.0).

With async scheduling (`SchedulerConfig.async_scheduling`, vLLM's default where
the executor supports it) the engine schedules step N+1 before it processes
step N's output (`EngineCore.step_with_batch_queue`, a batch queue of two:
`schedule()`, then `update_from_output()` of the step before). A token a step
samples is unknown while the next step is scheduled; vLLM's `AsyncScheduler`
stands in for it with an output placeholder (`Request.num_output_placeholders`,
raised by `AsyncScheduler._update_after_schedule` for every request whose step
reaches the end of its known tokens, lowered as its tokens arrive in
`Scheduler._update_request_with_output`).

In kvretain's operations a `Sample(rid, token)` is the token of `rid`'s latest
step. Where that step's output has not been processed (no step was scheduled
since), the token is in flight: the scheduler receives it right after the next
step is scheduled. Otherwise (the request sat out the steps since, its output
held for the token) it arrives at once. What the allocator sees differs from
synchronous scheduling in four ways, and nowhere else:

1. What a step may schedule ahead: a running request whose sampled token is
   in flight is scheduled that token's position anyway, as a placeholder
   (`Scheduler.schedule`: `num_tokens_with_spec + num_output_placeholders -
   num_computed_tokens`): the same one token the model schedules once the
   token is sampled, so chunks and budgets are unchanged. A request is never
   named in a step before its `Sample` (as without async: `Checker.validate`),
   so no request runs more than one token ahead.
2. Caching at allocation stops at the known tokens: `allocate_slots` caches
   `min(computed + new, request.num_tokens)` (`KVCacheManager.allocate_slots`),
   and `request.num_tokens` leaves the in-flight token out
   (`caching_limit`).
3. A token's arrival caches: `update_from_output` calls `cache_blocks(request,
   num_computed_tokens - num_in_flight_tokens)` for a running request that had
   output placeholders when its sampled token arrives, so the blocks computed
   by the steps whose outputs have arrived are cached then, not at the
   request's next allocation (`arrival_limit`). This is documented semantics,
   not a finding: vLLM caches only tokens it knows, and caches them as soon as
   it knows them. A request preempted (inside a step, or by `Preempt`) or
   finished before its token arrives caches nothing then: its output is stale
   (`Scheduler._preempt_request` marks it, `update_from_output` skips
   `cache_blocks` for it) or dropped (a finished request's output is ignored).
4. Blocks leave a sliding window (and Mamba states are retired) on the
   processed tokens: `allocate_slots` calls `remove_skipped_blocks` with
   `num_computed_tokens - num_in_flight_tokens`, and while step N+1 is
   scheduled step N's tokens are still in flight (`processed_limit`), so a
   window lets go of its blocks one step later than without async.

5. Speculative decoding (`num_spec_tokens = k > 0`, `model.spec_decode`)
   one step ahead. The scheduler never sees a draft: the engine core does not
   pass the drafter's proposal to it under async scheduling
   (`EngineCore.post_step` skips `update_draft_token_ids`; the worker keeps
   the drafts), and `AsyncScheduler._update_after_schedule` gives every
   request whose step reached its known tokens k placeholder drafts instead.
   So the next step verifies k draft slots however many drafts the `Sample`
   proposed: its drafts fill the first slots, the rest are placeholders,
   never accepted (`draft_slots`). A sample's accepted drafts and its token
   all ride on the step's output (`Sample.accepted + 1` unknown tokens: they
   cap caching as the one token does in 2), and so does its rejection: while
   the next step is scheduled, the request's computed tokens still count the
   rejected drafts (`update_from_output` rolls `num_computed_tokens` and
   `num_output_placeholders` back when the output is processed), so that
   step's allocation, its window frees and its lookahead slots start from
   the optimistic position (`scheduler_position`). The chunk, the drafts it
   verifies and the arrival's caching are unchanged: the placeholders cover
   the rejected drafts, so they cancel out of the count.

6. With a KV connector (kvretain's plays both roles, `kv_role="kv_both"`, so
   vLLM counts it a consumer) two steps in flight make vLLM fence block frees
   (`Scheduler.__init__`: `defer_block_free` when `max_concurrent_batches > 1`
   and `is_kv_consumer`): a load may refill a freed block while the step in
   flight still writes it. vLLM counts the steps that scheduled tokens
   (`sched_step_seq`, raised at the end of `schedule()`) and the outputs of
   such steps it processed (`processed_step_seq`, raised first thing in
   `update_from_output`); a request remembers the last step that scheduled it
   (`last_sched_seq`). Freeing a request (a finish, a preemption, inside a
   step or not, the free a transfer's report ends) whose last step's output is
   unprocessed takes its tables away at once but holds its blocks, references
   and all (`KVCacheManager.pop_blocks_for_free`: every group's blocks, group
   after group, leading nulls dropped), until the output of the latest step
   then scheduled is processed (`_free_request_blocks`: fence `sched_step_seq`);
   they return then in one `free_blocks` over the reversed list
   (`_drain_deferred_frees`, first thing in `update_from_output`, before the
   arrivals of 3 cache anything). So the free queue's cached tail lists the
   last group's blocks first where the direct free lists the first group's.
   A step whose allocation fails preempts the last running request only
   where its free would not be fenced (`Scheduler.schedule`: "a deferred free
   will not help with immediate allocation"; kvretain's connector has no
   pending block frees to wait for instead, `has_pending_block_frees`):
   otherwise it preempts nobody, and that request and the running ones after
   it get nothing this step (`fenced_victim`). A preempted request's output
   in flight is delivered stale as without a connector (kvretain's connector
   does not ask to drop it: `requires_kv_delivery` is False). A CoW copy's retained endpoints (`model.fine_mamba`) wait
   likewise for the output of the step that runs the copy (fence
   `sched_step_seq + 1`, `_free_cow_retained_blocks`), freed in their order.
   Fences are drained front to back and stop at the first one not reached.
   A connector's report (`Loaded`, `Saved`) comes with a step output the
   engine processes before it schedules again (its batch queue waits on the
   oldest step when nothing else is scheduled): the latest step's output is
   processed there, its tokens arrive as in 3 and its fences are reached.
   `defer_async_loads` (an async load started only once the steps in flight
   are processed, `deferred_loads`) needs a HiSparse host pool
   (`kv_cache_config.hisparse_host_num_blocks`), which no kvretain layout
   has: an async load starts at its admission as without async scheduling.
   `FreeFences` is that bookkeeping.

`InFlight` is that bookkeeping; `AllocatorModel` (built with
`async_scheduling=True`) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import dropwhile

from model.spec_decode import PLACEHOLDER

# The pseudo request id whose table (group 0's, the others empty) lists the blocks the
# scheduler holds in fenced frees (6), front to back: a snapshot names them so that every
# reference a block carries has an entry (they belong to no request's table any more).
FENCED = "(fenced)"


def fenced_tables(in_flight: InFlight | None, num_groups: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The `FENCED` pseudo-table of a snapshot, if any block is held (6)."""
    if in_flight is None or in_flight.fences is None or not in_flight.fences.deferred:
        return {}
    held = tuple(b for _, blocks in in_flight.fences.deferred for b in blocks)
    return {FENCED: (held,) + ((),) * (num_groups - 1)}


def fenced_victim(in_flight: InFlight | None, rid: str) -> bool:
    """A step's allocation failed and `rid` is the request it would preempt: its free
    would be fenced, so it frees nothing now and the step preempts nobody (6;
    `Scheduler.schedule`: "a deferred free will not help with immediate allocation")."""
    return in_flight is not None and in_flight.fences is not None and in_flight.fences.defers(rid)


def caching_limit(num_computed: int, num_new: int, num_tokens: int, unknown: int) -> int:
    """Tokens an allocation caches up to: the chunk's end, at most the tokens the
    scheduler knows (`unknown`: the in-flight ones, not among them)."""
    return min(num_computed + num_new, num_tokens - unknown)


def scheduler_position(num_computed: int, unrolled: int) -> int:
    """The computed tokens the scheduler counts while a sample's rejection is in flight:
    the rolled-back count plus the `unrolled` rejected drafts (5)."""
    return num_computed + unrolled


def draft_slots(drafts: tuple[int, ...], num_spec_tokens: int) -> tuple[int, ...]:
    """The drafts the next step verifies under async scheduling: always k slots, the
    proposal first, then placeholders (5)."""
    return drafts + (PLACEHOLDER,) * (num_spec_tokens - len(drafts))


def arrival_limit(num_computed: int, scheduled_since: int) -> int:
    """Tokens cached when a request's sampled token arrives: those computed by the
    steps whose outputs arrived (`num_computed_tokens - num_in_flight_tokens`,
    where `scheduled_since` is what the step scheduled just before the arrival
    gave the request)."""
    return num_computed - scheduled_since


def processed_limit(num_computed: int, unprocessed: int) -> int:
    """Tokens whose blocks `remove_skipped_blocks` may free: the computed ones less
    those of the step whose output is unprocessed."""
    return max(0, num_computed - unprocessed)


@dataclass
class Arriving:
    """A sample riding on an unprocessed output: the tokens it appended (its accepted
    drafts and its token) and the verified drafts it rejected (not yet rolled back)."""

    tokens: int = 1
    rejected: int = 0


@dataclass
class FreeFences:
    """vLLM's fenced block frees with a consumer KV connector and two steps in flight (6).

    - `sched_seq`, `processed_seq`: the steps that scheduled tokens, and the outputs
      of such steps processed (`sched_step_seq`, `processed_step_seq`);
    - `last_sched`: rid -> the last such step that scheduled it (`last_sched_seq`);
    - `deferred`: (fence, blocks in allocation order), front to back (`deferred_frees`).
    """

    sched_seq: int = 0
    processed_seq: int = 0
    last_sched: dict[str, int] = field(default_factory=dict)
    deferred: list[tuple[int, list[int]]] = field(default_factory=list)

    def scheduled(self, step: dict[str, int]) -> None:
        """A step was scheduled (`step`: tokens per request)."""
        if sum(step.values()) > 0:
            self.sched_seq += 1
            self.last_sched.update({rid: self.sched_seq for rid, n in step.items() if n > 0})

    def defers(self, rid: str) -> bool:
        """Freeing `rid` now waits: its last step's output is unprocessed."""
        return self.last_sched.get(rid, 0) > self.processed_seq

    def defer(self, blocks: list[int], fence: int) -> None:
        """Hold `blocks` until the output of step `fence` is processed."""
        if blocks:
            self.deferred.append((fence, blocks))

    def processed(self, step_total: int) -> list[list[int]]:
        """A step output was processed (`step_total`: the tokens that step scheduled):
        the held lists now due, in order (each freed reversed)."""
        if step_total > 0:
            self.processed_seq += 1
        due = []
        while self.deferred and self.deferred[0][0] <= self.processed_seq:
            due.append(self.deferred.pop(0)[1])
        return due


@dataclass
class InFlight:
    """The step outputs a one-step-ahead scheduler has not processed yet.

    - `latest`: the requests the latest step scheduled (its output is still to
      be processed), with how many tokens each;
    - `tokens`: the running requests whose sample rides on that output, with
      what it appended and rejected (`Arriving`).
    """

    latest: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, Arriving] = field(default_factory=dict)
    # With a KV connector: the fenced frees (6); None without one.
    fences: FreeFences | None = None
    # The tokens the latest step scheduled, while its output is unprocessed (6).
    latest_total: int = 0

    @classmethod
    def fenced(cls, connector: bool) -> InFlight:
        """The bookkeeping of a scheduler with a KV connector (`connector`: fenced frees, 6) or not."""
        return cls(fences=FreeFences() if connector else None)

    def holds(self, rid: str, tables: list[list[int]]) -> bool:
        """Freeing `rid` (its per-group `tables`): True when the free waits for the output
        of its last step (6), holding every group's blocks after its leading nulls, group
        after group (`pop_blocks_for_free`); the caller frees them otherwise."""
        if self.fences is None or not self.fences.defers(rid):
            return False
        self.fences.defer([b for t in tables for b in dropwhile(lambda b: b == 0, t)], self.fences.sched_seq)
        return True

    def holds_copies(self, retained: list[int]) -> bool:
        """A step's CoW retained endpoints (`retained`, in free order): True when they wait
        for the output of the step that runs the copies (6)."""
        if self.fences is None:
            return False
        self.fences.defer(retained[::-1], self.fences.sched_seq + 1)
        return True

    def in_flight(self, rid: str) -> bool:
        """`rid`'s last sampled token has not reached the scheduler."""
        return rid in self.tokens

    def unknown(self, rid: str) -> int:
        """Tokens `rid` appended that the scheduler does not know yet."""
        return self.tokens[rid].tokens if rid in self.tokens else 0

    def unrolled(self, rid: str) -> int:
        """Rejected drafts of `rid` the scheduler has not rolled back yet."""
        return self.tokens[rid].rejected if rid in self.tokens else 0

    def unprocessed(self, rid: str) -> int:
        """Tokens of `rid` whose step output is still to be processed."""
        return self.latest.get(rid, 0)

    def sampled(self, rid: str, accepted: int = 0, rejected: int = 0) -> bool:
        """A `Sample` for `rid`: True when it rides on the latest step's output
        (it arrives after the next step is scheduled), False when it arrives now."""
        if rid in self.latest:
            self.tokens[rid] = Arriving(1 + accepted, rejected)
            return True
        return False

    def scheduled(self, step: dict[str, int] | None) -> tuple[list[tuple[str, int]], list[list[int]]]:
        """A step was scheduled (`step`: tokens per request; None: a connector's report,
        no step), then the previous step's output is processed. Returns the requests
        whose tokens arrive, each with what this step scheduled for it (for
        `arrival_limit`), and the fenced frees now due (6), freed first."""
        step = step or {}
        arrived = [(rid, step.get(rid, 0)) for rid in sorted(self.tokens, key=list(self.latest).index)]
        due: list[list[int]] = []
        if self.fences is not None:
            self.fences.scheduled(step)
            due = self.fences.processed(self.latest_total)
        self.latest = {rid: n for rid, n in step.items() if n > 0}
        self.latest_total = sum(self.latest.values())
        self.tokens = {}
        return arrived, due

    def forget(self, rid: str) -> None:
        """`rid` was finished or preempted: its output is dropped or stale (it caches nothing)."""
        self.latest.pop(rid, None)
        self.tokens.pop(rid, None)
