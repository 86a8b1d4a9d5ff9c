"""Async scheduling: the scheduler runs one step ahead of the model runner.

A token a step samples is unknown while the next step is scheduled (vLLM's
`AsyncScheduler` and its output placeholders). In kvretain's operations a
`Sample(rid, token)` is in flight when no step was scheduled since, and arrives right
after the next one is. What the allocator sees differs from synchronous scheduling in
these ways, and nowhere else:

1. A step schedules an in-flight token's position anyway, as a placeholder: chunks and
   budgets are unchanged.
2. Caching at allocation stops at the known tokens (`caching_limit`).
3. A token's arrival caches the blocks of the processed steps (`arrival_limit`); a
   request preempted or finished before it arrives caches nothing then.
4. Windows let go of blocks, and Mamba states retire, on the processed tokens
   (`processed_limit`): one step later than without async.
5. With drafts the next step verifies k draft slots, placeholders past the sample's own
   drafts (`draft_slots`), and counts from the optimistic position until the rejection
   is processed (`scheduler_position`).
6. With a KV connector (a consumer) the free of a request whose last step is
   unprocessed is fenced: its blocks stay held until that output is processed, then
   return in one reversed free; a step never preempts a request whose free would be
   fenced (`fenced_victim`); a copy's retained endpoints wait for the step that runs
   the copy (`FreeFences`).

`InFlight` is that bookkeeping; `AllocatorModel(async_scheduling=True)` applies it.
vLLM 0.33.0's counters and call order that this module predicts (`sched_step_seq`,
`processed_step_seq`, `_drain_deferred_frees`, ...): docs/semantics.md, "vLLM 0.33.0's
order, as the machine predicts it".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import dropwhile

from model.policy.spec_decode import PLACEHOLDER

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
