"""A continuous-batching engine driving an allocator target and the hybrid model.

One engine step:
1. arrivals join the waiting queue (`AddRequest`);
2. running requests, in admission order, get their next prefill chunk or one
   decode token (`Schedule(rid, remaining budget)`); when one cannot be
   allocated, the most recently admitted running request is preempted
   (`Preempt`) and the schedule retried, as vLLM's scheduler does;
3. if nothing was preempted, waiting requests are admitted FIFO while budget
   and the concurrency cap allow (`Schedule`: the target decides the hit);
4. the tables are read from `snapshot()`, the model computes every scheduled
   chunk in one batch, and each request that computed all its known tokens
   gets its greedy token (`Sample`); a request with all its tokens `Finish`es
   and its session's next turn is scheduled to arrive.

Poisoning (so a stale read cannot hide): every block a `Schedule` hands out is
filled with NaN before it is written, and after every operation every block
with ref count 0 and no hash is filled with NaN (freed without a hash: its
content may never be read again). Null block 0 stays NaN forever.

The engine never decides a hit or a block id: the target does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_check.hybrid import EngineFault, HybridModel, PagedStorage, SeqChunk
from gpu_check.workload import Workload
from invariants.targets.base import Target, TargetCrash
from model.observation import BlockRemoved, Observation, ScheduleResult, Snapshot
from model.ops import AddRequest, Finish, Op, Preempt, Sample, Schedule


@dataclass(frozen=True)
class EngineConfig:
    token_budget: int = 48
    max_running: int = 4
    max_steps: int = 20_000
    progress_every_s: float = 5.0


@dataclass
class Req:
    rid: str
    sid: int
    turn: int
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    computed: int = 0
    n_out: int = 0
    preemptions: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    requests_done: int = 0
    tokens_computed: int = 0
    prefill_tokens: int = 0
    hit_tokens: int = 0
    admissions: int = 0
    admissions_with_hit: int = 0
    preemptions: int = 0
    evictions: int = 0
    blocks_handed_out: int = 0
    max_pinned: int = 0
    batch_sizes: set[int] = field(default_factory=set)
    seconds: float = 0.0


class Observer(Protocol):
    def on_tokens(self, step: int, chunks: list[SeqChunk], layer_out: torch.Tensor) -> None: ...

    def on_sample(self, step: int, rid: str, position: int, token: int) -> None: ...


class Engine:
    """Runs `workload` to completion on `target`; see the module docstring."""

    def __init__(
        self,
        target: Target,
        model: HybridModel,
        workload: Workload,
        ecfg: EngineConfig = EngineConfig(),
        observer: Observer | None = None,
        log: Callable[[str], None] | None = None,
        label: str = "",
    ) -> None:
        self.target = target
        self.model = model
        self.workload = workload
        self.ecfg = ecfg
        self.observer = observer
        self.log = log
        self.label = label
        self.num_blocks = target.config.num_blocks
        self.storage: PagedStorage = model.new_storage(self.num_blocks)
        self.clean_poisoned: set[int] = set(range(self.num_blocks))  # NaN and not written since
        self.stats = EngineStats()
        self.ops: list[Op] = []
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.arrivals: dict[int, list[Req]] = {}
        self.step_no = 0
        for s in workload.sessions:
            t0 = s.turns[0]
            self._arrive(
                s.arrival_step, Req(f"s{s.sid}t0", s.sid, 0, [*s.system, *t0.user], 0, t0.max_tokens)
            )

    # ------------------------------------------------------------------ ops
    def _arrive(self, step: int, req: Req) -> None:
        req.prompt_len = len(req.tokens)
        self.arrivals.setdefault(step, []).append(req)

    def _arrive_now(self, req: Req) -> None:
        self._apply(AddRequest(req.rid, tuple(req.tokens)))
        self.waiting.append(req)

    def _apply(self, op: Op) -> Observation:
        self.ops.append(op)
        try:
            obs = self.target.apply(op)
        except TargetCrash:
            raise
        except Exception as exc:  # a target that does not wrap its errors
            raise TargetCrash(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(op, (AddRequest, Sample)):
            handed = []
            if isinstance(obs, ScheduleResult) and obs.new_blocks:
                handed = [b for grp in obs.new_blocks for b in grp if b]
            self._after_op(self.target.snapshot(), handed)
        return obs

    def _after_op(self, snap: Snapshot, handed: list[int]) -> None:
        if handed:
            self.storage.poison(handed)
            self.clean_poisoned.update(handed)
            self.stats.blocks_handed_out += len(handed)
        stale = [
            b
            for b in range(1, self.num_blocks)
            if snap.ref_cnt[b] == 0 and b not in snap.block_hash and b not in self.clean_poisoned
        ]
        if stale:
            self.storage.poison(stale)
            self.clean_poisoned.update(stale)
        self.stats.evictions += sum(1 for e in snap.events if isinstance(e, BlockRemoved))
        self.stats.max_pinned = max(self.stats.max_pinned, len(snap.pinned_queue))

    def _preempt(self, req: Req) -> None:
        self._apply(Preempt(req.rid))
        self.running.remove(req)
        req.computed = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    # ----------------------------------------------------------------- loop
    def run(self) -> EngineStats:
        t_start = time.perf_counter()
        try:
            self._loop(t_start)
        finally:
            self.stats.steps = self.step_no
            self.stats.seconds = time.perf_counter() - t_start
        return self.stats

    def _loop(self, t_start: float) -> None:
        last_log = t_start
        pending = self.workload.num_requests
        while self.stats.requests_done < pending:
            if self.step_no >= self.ecfg.max_steps:
                raise EngineFault(
                    f"no completion after {self.step_no} steps ({self.stats.requests_done}/{pending} done)"
                )
            self._step()
            now = time.perf_counter()
            if self.log and now - last_log >= self.ecfg.progress_every_s:
                last_log = now
                self.log(
                    f"  [{self.label}] step {self.step_no}: {self.stats.requests_done}/{pending} requests done, "
                    f"{self.stats.tokens_computed} tokens computed, {self.stats.hit_tokens} from cache"
                )

    def _step(self) -> None:
        self.step_no += 1
        for due in sorted(k for k in self.arrivals if k <= self.step_no):
            for req in self.arrivals.pop(due):
                self._arrive_now(req)
        budget = self.ecfg.token_budget
        plan: list[tuple[Req, int, int]] = []
        done: set[str] = set()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            res = self._apply(Schedule(req.rid, budget))
            assert isinstance(res, ScheduleResult)
            if res.scheduled > 0:
                plan.append((req, req.computed, res.scheduled))
                req.computed += res.scheduled
                budget -= res.scheduled
                done.add(req.rid)
                i += 1
                continue
            victim = self.running[-1]
            if victim.rid in done:  # cannot happen: scheduled ones precede i
                raise EngineFault(f"preemption victim {victim.rid} was already scheduled")
            self._preempt(victim)
            preempted = True
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.ecfg.max_running:
                req = self.waiting[0]
                res = self._apply(Schedule(req.rid, budget))
                assert isinstance(res, ScheduleResult)
                if not res.admitted or res.scheduled == 0:
                    if not self.running and not plan:
                        raise EngineFault(
                            f"stall: {req.rid} ({len(req.tokens)} tokens) is not admitted into an idle pool "
                            f"of {self.num_blocks} blocks"
                        )
                    break
                self.waiting.popleft()
                self.running.append(req)
                hit = res.hit or 0
                self.stats.admissions += 1
                self.stats.hit_tokens += hit
                self.stats.admissions_with_hit += hit > 0
                plan.append((req, hit, res.scheduled))
                req.computed = hit + res.scheduled
                budget -= res.scheduled
        if plan:
            self._compute(plan)

    def _compute(self, plan: list[tuple[Req, int, int]]) -> None:
        snap_tables = self.target.snapshot().tables
        chunks = []
        for req, start, n in plan:
            tables = snap_tables.get(req.rid)
            if tables is None:
                raise EngineFault(f"request {req.rid} was scheduled but has no block table in the snapshot")
            end = start + n
            chunks.append(SeqChunk(req.rid, req.tokens, start, end, tables, end == len(req.tokens)))
            self.stats.tokens_computed += n
            self.stats.prefill_tokens += max(0, min(end, req.prompt_len) - start)
        res = self.model.forward(chunks, self.storage)
        self.clean_poisoned.difference_update(res.written_blocks)
        self.stats.batch_sizes.add(int(res.layer_out.shape[0]))
        if self.observer:
            self.observer.on_tokens(self.step_no, chunks, res.layer_out)
        for req, _start, _n in plan:
            if req.rid not in res.next_tokens:
                continue
            tok = res.next_tokens[req.rid]
            if self.observer:
                self.observer.on_sample(self.step_no, req.rid, len(req.tokens), tok)
            self._apply(Sample(req.rid, tok))
            req.tokens.append(tok)
            req.n_out += 1
            if req.n_out >= req.max_tokens:
                self._finish(req)

    def _finish(self, req: Req) -> None:
        self._apply(Finish(req.rid))
        self.running.remove(req)
        self.stats.requests_done += 1
        session = self.workload.sessions[req.sid]
        nxt = req.turn + 1
        if nxt < len(session.turns):
            t = session.turns[nxt]
            self._arrive(
                self.step_no + 1 + t.think_steps,
                Req(f"s{req.sid}t{nxt}", req.sid, nxt, [*req.tokens, *t.user], 0, t.max_tokens),
            )
