"""A block-level serving simulator: a scheduler loop over any `Target`, no model math.

The loop is vLLM-shaped and drives the allocator ONLY through `model.ops`
(AddRequest / Schedule / Sample / Finish / Preempt / Probe): all allocation,
caching and eviction logic is the target's own.

One engine step:
1. running requests, in admission order, each get `Schedule(rid, budget_left)`
   (their next prefill chunk, or one decode token) while the step's token
   budget lasts; a running request whose allocation fails preempts the
   most recently admitted running request (vLLM's default victim), which goes
   back to the head of the waiting queue;
2. waiting requests are admitted FIFO while fewer than `max_running` run and
   budget remains; an admission whose allocation fails stops admission for
   this step (it stays waiting);
3. every request with all its tokens computed samples one token
   (`Sample`); a request that reached `max_tokens` outputs finishes (`Finish`:
   the last sampled token is never computed, as in vLLM).

Differences from vLLM, on purpose: each `Schedule` op is its own allocator step
(`new_step_starts` per request, not per batch); no priorities, no async
scheduling, no speculative tokens.
"""

from __future__ import annotations

import random
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from invariants.targets.base import Target
from model.observation import ProbeResult, ScheduleResult
from model.ops import AddRequest, Finish, Preempt, Probe, Sample, Schedule


class SimulationStalled(RuntimeError):
    """No request can make progress (the pool cannot hold the running set)."""


@dataclass
class SimRequest:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int = 1
    # filled in by the engine
    hit: int | None = None  # prefix-cache hit at first admission
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


@dataclass
class EngineStats:
    steps: int = 0
    scheduled_tokens: int = 0
    alloc_failures: int = 0
    preemptions: int = 0
    finished: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(
        self,
        target: Target,
        *,
        token_budget: int,
        max_running: int,
        rng: random.Random,
        vocab: int = 1 << 20,
        progress: Callable[[str], None] | None = None,
        on_finish: Callable[[SimRequest], None] | None = None,
    ) -> None:
        if token_budget < 1 or max_running < 1:
            raise ValueError("token_budget and max_running must be >= 1")
        self.target = target
        self.token_budget = token_budget
        self.max_running = max_running
        self.rng = rng
        self.vocab = vocab
        self.progress = progress
        self.on_finish = on_finish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self._sbs = target.config.scheduler_block_size
        self._last_progress = time.monotonic()

    # ------------------------------------------------------------ requests
    def submit(self, req: SimRequest) -> None:
        self.target.apply(AddRequest(req.rid, req.prompt))
        self.waiting.append(req)

    def probe(self, tokens: tuple[int, ...]) -> ProbeResult:
        obs = self.target.apply(Probe(tokens))
        assert isinstance(obs, ProbeResult)
        return obs

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---------------------------------------------------------------- loop
    def run(self, max_steps: int = 10_000_000) -> EngineStats:
        t0 = time.monotonic()
        stalled = 0
        while not self.idle:
            if self.stats.steps >= max_steps:
                raise SimulationStalled(f"no completion after {max_steps} steps")
            done = self.step()
            stalled = 0 if done else stalled + 1
            if stalled > 3:
                raise SimulationStalled(
                    f"stalled: {len(self.running)} running, {len(self.waiting)} waiting, "
                    f"{self.stats.alloc_failures} allocation failures (pool too small?)"
                )
        self.stats.seconds += time.monotonic() - t0
        return self.stats

    def _schedule(self, req: SimRequest, budget: int) -> ScheduleResult:
        obs = self.target.apply(Schedule(req.rid, budget))
        assert isinstance(obs, ScheduleResult)
        return obs

    def _failed(self, obs: ScheduleResult, budget: int) -> bool:
        # scheduled == 0 is also a Mamba chunk rounded to 0 under a tiny budget.
        return obs.scheduled == 0 and obs.new_blocks is None and budget >= self._sbs

    def _preempt_victim(self) -> SimRequest:
        victim = self.running.pop()
        self.target.apply(Preempt(victim.rid))
        victim.computed = 0
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def step(self) -> int:
        """One engine step; returns the number of tokens scheduled."""
        self.stats.steps += 1
        budget = self.token_budget
        scheduled = 0
        # 1. running requests
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.computed >= req.num_tokens:
                i += 1
                continue
            obs = self._schedule(req, budget)
            if self._failed(obs, budget):
                self.stats.alloc_failures += 1
                victim = self._preempt_victim()
                if victim is req:
                    break
                continue  # retry `req` with the victim's blocks freed
            req.computed += obs.scheduled
            budget -= obs.scheduled
            scheduled += obs.scheduled
            i += 1
        # 2. admissions
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            obs = self._schedule(req, budget)
            if not obs.admitted:
                if self._failed(obs, budget):
                    self.stats.alloc_failures += 1
                break
            self.waiting.popleft()
            if req.hit is None:
                req.hit = obs.hit or 0
            req.computed = (obs.hit or 0) + obs.scheduled
            budget -= obs.scheduled
            scheduled += obs.scheduled
            self.running.append(req)
        # 3. sampling and completion
        for req in list(self.running):
            if req.computed < req.num_tokens:
                continue
            token = self.rng.randrange(self.vocab)
            req.outputs.append(token)
            self.target.apply(Sample(req.rid, token))
            if len(req.outputs) >= req.max_tokens:
                self.running.remove(req)
                self.target.apply(Finish(req.rid))
                req.finished = True
                self.stats.finished += 1
                if self.on_finish is not None:
                    self.on_finish(req)
        self.stats.scheduled_tokens += scheduled
        if self.progress is not None and time.monotonic() - self._last_progress > 5.0:
            self._last_progress = time.monotonic()
            self.progress(
                f"step {self.stats.steps}: {self.stats.scheduled_tokens} tokens scheduled, "
                f"{len(self.running)} running, {len(self.waiting)} waiting, {self.stats.finished} finished"
            )
        return scheduled


def random_tokens(rng: random.Random, n: int, vocab: int = 1 << 20) -> tuple[int, ...]:
    """`n` token ids drawn from `rng` (uniform over `vocab`, a power of two)."""
    if vocab & (vocab - 1):
        return tuple(rng.randrange(vocab) for _ in range(n))
    # one draw of 4n bytes: ~50x faster than n randrange calls at 1M tokens
    return tuple(x & (vocab - 1) for x in array("I", rng.randbytes(4 * n)))
