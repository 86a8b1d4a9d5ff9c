"""One continuous-batching scheduler loop over any `Target`, watched by observers.

The loop is vLLM v1's `Scheduler.schedule` reduced to what decides blocks. It
drives the allocator ONLY through `model.contract.ops` (AddRequest / Schedule / Sample /
Finish / Preempt / Probe), so every hit, block id and eviction is the
target's own. The serving simulator and gpu_check run this same loop and
differ only in what they attach:

- an `Executor` computes each step's batch and samples tokens: random draws
  in the simulator (`invariants.simulate.tokens`), a hybrid model over the
  paged KV cache in gpu_check;
- `Observer`s see every operation and scheduling decision. `BlockAccounting`
  (always attached) counts hits, admissions, preemptions and allocation
  failures; gpu_check's forward pass poisons freed blocks with NaN.

One step (FCFS, vLLM's default policy):
1. requests due this step arrive (`AddRequest`) and wait, first come first served;
2. running requests, in admission order, each get `Schedule(rid, budget left)`
   (their next prefill chunk or one decode token) while the token budget
   lasts. When one cannot be allocated, the most recently admitted running
   request is preempted (`Preempt`, back to the head of the waiting queue)
   and the request retried; if the victim is the request itself, the running
   pass ends. A chunk rounded to 0 under a budget smaller than one scheduler
   block (a Mamba-aligned split) is skipped this step, not a failure;
3. only if nothing was preempted this step (as vLLM), waiting requests are
   admitted in order while budget remains and fewer than `max_running` run;
   the first admission that fails ends admission for this step;
4. the executor computes the batch; every request that has computed all its
   tokens samples one (`Sample`), and one with `max_tokens` outputs finishes
   (`Finish`: its last token is never computed, as in vLLM).

Differences from vLLM, on purpose: each `Schedule` is its own allocator step
(`new_step_starts` per request, not per batch); no priorities, no async
scheduling, no speculative tokens.

A request refused by an idle pool, or preempted twice while running alone
without computing further, can never finish, and a loop that schedules
nothing for several steps makes no progress: each raises `SchedulerStalled`
instead of spinning.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from invariants.targets.base import Target, TargetCrash
from model.contract.observation import Observation, ProbeResult, ScheduleResult
from model.contract.ops import AddRequest, Finish, Op, Preempt, Probe, Sample, Schedule

# Steps in a row that schedule nothing while requests wait or run.
_STALLED_STEPS_LIMIT = 3


class SchedulerStalled(RuntimeError):
    """No request can make progress (the pool cannot hold what must run, or the step limit passed)."""


@dataclass(frozen=True)
class LoopConfig:
    """The scheduler's limits: tokens per step, concurrent requests, steps before giving up."""

    token_budget: int
    max_running: int
    max_steps: int = 10_000_000
    progress_every_s: float = 5.0

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_running < 1:
            raise ValueError("token_budget and max_running must be >= 1")


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it; identity is the object (rids are unique while live)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int = 1
    hit: int | None = None  # prefix-cache hit at its first admission
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    preemptions: int = 0
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.outputs)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, end) of `req`, computed in this step."""

    req: Request
    start: int
    end: int


class Executor(Protocol):
    def compute(self, step: int, batch: Sequence[ScheduledChunk]) -> None:
        """Compute the step's batch (in schedule order)."""

    def sampled(self, req: Request) -> int | None:
        """The token `req` samples after this step's batch, None if it has tokens left to compute."""


class Observer:
    """Hooks the loop calls; each does nothing unless a subclass overrides it."""

    def before_op(self, op: Op) -> None:
        """`op` is about to be applied (recorded even if the target then crashes)."""

    def after_op(self, op: Op, obs: Observation) -> None:
        """`op` was applied and the target answered `obs`."""

    def on_scheduled(self, chunk: ScheduledChunk) -> None:
        """`chunk` joins this step's batch."""

    def on_admitted(self, req: Request, hit: int) -> None:
        """`req` left the waiting queue with a prefix-cache hit of `hit` tokens."""

    def on_alloc_failure(self, req: Request) -> None:
        """The pool could not hold `req`'s next chunk."""

    def on_preempted(self, req: Request) -> None:
        """`req` lost its blocks and went back to the head of the waiting queue."""

    def on_sample(self, req: Request, position: int, token: int) -> None:
        """`req` is about to sample `token` at `position`."""

    def on_finish(self, req: Request) -> None:
        """`req` finished and freed its blocks."""


class OnFinish(Observer):
    """Calls `fn(request)` after each request finishes (e.g. to submit a session's next turn)."""

    def __init__(self, fn: Callable[[Request], None]) -> None:
        self.fn = fn

    def on_finish(self, req: Request) -> None:
        self.fn(req)


@dataclass
class BlockAccounting(Observer):
    """What the scheduler saw of the allocator: hits, admissions, preemptions, allocation failures."""

    scheduled_tokens: int = 0
    prefill_tokens: int = 0  # scheduled tokens that were prompt tokens
    hit_tokens: int = 0  # summed over every admission (a re-admission after preemption counts again)
    admissions: int = 0
    admissions_with_hit: int = 0
    alloc_failures: int = 0
    preemptions: int = 0
    finished: int = 0

    def on_scheduled(self, chunk: ScheduledChunk) -> None:
        self.scheduled_tokens += chunk.end - chunk.start
        self.prefill_tokens += max(0, min(chunk.end, len(chunk.req.prompt)) - chunk.start)

    def on_admitted(self, req: Request, hit: int) -> None:
        self.admissions += 1
        self.hit_tokens += hit
        self.admissions_with_hit += hit > 0

    def on_alloc_failure(self, req: Request) -> None:
        self.alloc_failures += 1

    def on_preempted(self, req: Request) -> None:
        self.preemptions += 1

    def on_finish(self, req: Request) -> None:
        self.finished += 1


class SchedulerLoop:
    """Runs submitted requests to completion on `target`; see the module docstring."""

    def __init__(
        self,
        target: Target,
        config: LoopConfig,
        executor: Executor,
        observers: Sequence[Observer] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self.config = config
        self.executor = executor
        self.accounting = BlockAccounting()
        self.observers: list[Observer] = [self.accounting, *observers]
        self.progress = progress
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.arrivals: dict[int, list[Request]] = {}
        self.step_no = 0
        self.seconds = 0.0
        self._sbs = target.config.scheduler_block_size
        self._preempted_alone_at: dict[str, int] = {}  # rid -> tokens computed when preempted alone

    def add_observer(self, observer: Observer) -> None:
        self.observers.append(observer)

    # ------------------------------------------------------------ requests
    def submit(self, req: Request, at_step: int | None = None) -> None:
        """`req` arrives now (`AddRequest`), or at the start of step `at_step`."""
        if at_step is None:
            self._arrive(req)
        else:
            self.arrivals.setdefault(at_step, []).append(req)

    def probe(self, tokens: tuple[int, ...]) -> ProbeResult:
        """The hit `tokens` would get now (changes nothing)."""
        obs = self._apply(Probe(tokens))
        assert isinstance(obs, ProbeResult)
        return obs

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.arrivals

    # ---------------------------------------------------------------- loop
    def run(self) -> BlockAccounting:
        """Step until every submitted request finished; raises `SchedulerStalled` if none can."""
        t0 = last_progress = time.perf_counter()
        stalled_steps = 0
        try:
            while not self.idle:
                if self.step_no >= self.config.max_steps:
                    raise SchedulerStalled(f"no completion after {self.step_no} steps ({self._state()})")
                scheduled = self.step()
                busy = bool(self.waiting or self.running)
                stalled_steps = stalled_steps + 1 if scheduled == 0 and busy else 0
                if stalled_steps > _STALLED_STEPS_LIMIT:
                    raise SchedulerStalled(f"nothing scheduled for {stalled_steps} steps ({self._state()})")
                now = time.perf_counter()
                if self.progress is not None and now - last_progress >= self.config.progress_every_s:
                    last_progress = now
                    self.progress(f"step {self.step_no}: {self._state()}")
        finally:
            self.seconds += time.perf_counter() - t0
        return self.accounting

    def step(self) -> int:
        """One scheduler step; returns the number of tokens scheduled."""
        self.step_no += 1
        for due in sorted(k for k in self.arrivals if k <= self.step_no):
            for req in self.arrivals.pop(due):
                self._arrive(req)
        budget = self.config.token_budget
        batch: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            obs = self._schedule(req, budget)
            if obs.scheduled > 0 or not self._alloc_failed(obs, budget):
                self._add_chunk(batch, req, req.computed, obs.scheduled)
                budget -= obs.scheduled
                i += 1
                continue
            self._notify_alloc_failure(req)
            victim = self.running[-1]  # the most recently admitted
            if victim is req and len(self.running) == 1:
                self._check_fits_alone(req)
            self._preempt(victim)
            preempted = True
            if victim is req:
                break
            # retry `req` with the victim's blocks freed
        if not preempted:
            budget = self._admit(batch, budget)
        if batch:
            self.executor.compute(self.step_no, batch)
            for chunk in batch:
                token = self.executor.sampled(chunk.req)
                if token is not None:
                    self._sample(chunk.req, token)
        return self.config.token_budget - budget

    def _admit(self, batch: list[ScheduledChunk], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            obs = self._schedule(req, budget)
            if not obs.admitted:
                if self._alloc_failed(obs, budget):
                    self._notify_alloc_failure(req)
                if not self.running:
                    raise SchedulerStalled(
                        f"{req.rid} ({req.num_tokens} tokens) is not admitted into an idle pool "
                        f"of {self.target.config.num_blocks} blocks (token budget {budget})"
                    )
                break
            self.waiting.popleft()
            self.running.append(req)
            hit = obs.hit or 0
            if req.hit is None:
                req.hit = hit
            for o in self.observers:
                o.on_admitted(req, hit)
            self._add_chunk(batch, req, hit, obs.scheduled)
            budget -= obs.scheduled
        return budget

    # ---------------------------------------------------------------- ops
    def _apply(self, op: Op) -> Observation:
        for o in self.observers:
            o.before_op(op)
        try:
            obs = self.target.apply(op)
        except TargetCrash:
            raise
        except Exception as exc:  # a target that does not wrap its errors
            raise TargetCrash(f"{type(exc).__name__}: {exc}") from exc
        for o in self.observers:
            o.after_op(op, obs)
        return obs

    def _arrive(self, req: Request) -> None:
        self._apply(AddRequest(req.rid, req.prompt))
        self.waiting.append(req)

    def _schedule(self, req: Request, budget: int) -> ScheduleResult:
        obs = self._apply(Schedule(req.rid, budget))
        assert isinstance(obs, ScheduleResult)
        return obs

    def _alloc_failed(self, obs: ScheduleResult, budget: int) -> bool:
        # scheduled == 0 is also a Mamba-aligned chunk rounded to 0 under a small budget.
        return obs.scheduled == 0 and obs.new_blocks is None and budget >= self._sbs

    def _check_fits_alone(self, req: Request) -> None:
        # Alone, `req` had every block but its own cached ones; a second time alone
        # without computing further, it never will (a livelock, not progress).
        reached = req.computed
        before = self._preempted_alone_at.get(req.rid)
        if before is not None and reached <= before:
            raise SchedulerStalled(
                f"{req.rid} ({req.num_tokens} tokens) does not fit the pool of "
                f"{self.target.config.num_blocks} blocks even alone: preempted twice at {reached} tokens computed"
            )
        self._preempted_alone_at[req.rid] = reached

    def _add_chunk(self, batch: list[ScheduledChunk], req: Request, start: int, n: int) -> None:
        req.computed = start + n
        if n == 0:
            return
        chunk = ScheduledChunk(req, start, start + n)
        batch.append(chunk)
        for o in self.observers:
            o.on_scheduled(chunk)

    def _notify_alloc_failure(self, req: Request) -> None:
        for o in self.observers:
            o.on_alloc_failure(req)

    def _preempt(self, victim: Request) -> None:
        self._apply(Preempt(victim.rid))
        self.running.remove(victim)
        victim.computed = 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        for o in self.observers:
            o.on_preempted(victim)

    def _sample(self, req: Request, token: int) -> None:
        for o in self.observers:
            o.on_sample(req, req.num_tokens, token)
        self._apply(Sample(req.rid, token))
        req.outputs.append(token)
        if len(req.outputs) >= req.max_tokens:
            self._apply(Finish(req.rid))
            self.running.remove(req)
            req.finished = True
            for o in self.observers:
                o.on_finish(req)

    def _state(self) -> str:
        a = self.accounting
        return (
            f"{a.finished} finished, {a.scheduled_tokens} tokens scheduled ({a.hit_tokens} from cache), "
            f"{len(self.running)} running, {len(self.waiting)} waiting"
        )
