"""vLLM's real scheduler as the engine of the equivalence check.

In this mode kvretain decides nothing: vLLM's `Scheduler` admits, chunks,
preempts and finishes each request (after its `max_tokens`), built with
batch caps that bind (`max_num_batched_tokens`, `max_num_seqs`). The paged
kernels read the block tables the shadow worker keeps from the
`SchedulerOutput`s vLLM ships (`VllmSchedulerTarget.shadow_worker`): the
tables a GPU model runner would hold, not the allocator's. Each sampled token
returns through `update_from_output`. So the bitwise-identity claim covers
what vLLM's scheduler actually ships: a stale or wrong table makes a mode's
outputs differ from the no-cache run (or fault on a block the table lacks).

Poisoning as in `forward_pass`: every block a step places in a table past the
computed tokens is NaN before it is written, and after every step every block
with ref count 0 and no hash is NaN.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpu_check.forward_pass import OutputObserver, StorageFigures
from gpu_check.hybrid import EngineFault, HybridModel, SeqChunk
from gpu_check.workload import Session, Workload
from invariants.simulate.loop import BlockAccounting

MAX_STEPS = 20_000


@dataclass
class EngineRun:
    """What one mode's run saw: accounting, storage figures, steps, the shadow worker's problems."""

    accounting: BlockAccounting = field(default_factory=BlockAccounting)
    storage: StorageFigures = field(default_factory=StorageFigures)
    steps: int = 0
    seconds: float = 0.0
    problems: list[tuple[str, str]] = field(default_factory=list)


class RealSchedulerEngine:
    """`workload` through `target.vllm_scheduler` as an engine core drives it
    (see the module docstring); `outputs` sees every layer's output and token."""

    def __init__(self, target: Any, model: HybridModel, outputs: OutputObserver) -> None:
        self.target = target
        self.sched = target.vllm_scheduler
        self.model = model
        self.outputs = outputs
        self.shadow = target.shadow_worker()
        if self.shadow is None:
            raise EngineFault("the vLLM scheduler target follows no model runner for this configuration")
        self.storage = model.new_storage(target.config.num_blocks)
        self.clean_poisoned: set[int] = set(range(target.config.num_blocks))
        self.run = EngineRun()
        self.live: dict[str, Any] = {}  # rid -> vLLM Request
        self.turn_of: dict[str, tuple[Session, int]] = {}
        self.arrivals: dict[int, list[tuple[str, tuple[int, ...], int]]] = {}

    def replay(self, workload: Workload) -> EngineRun:
        """Every session's turns, each next turn `think_steps` after the previous finished."""
        t0 = time.perf_counter()
        try:
            for s in workload.sessions:
                self._submit(s, 0, s.system, s.arrival_step)
            while self.arrivals or self.live:
                if self.run.steps >= MAX_STEPS:
                    raise EngineFault(f"no completion after {self.run.steps} steps")
                self._step()
        finally:
            self.run.seconds += time.perf_counter() - t0
        return self.run

    def _submit(self, session: Session, turn: int, history: tuple[int, ...], at: int) -> None:
        t = session.turns[turn]
        rid = f"s{session.sid}t{turn}"
        self.turn_of[rid] = (session, turn)
        self.arrivals.setdefault(at, []).append((rid, history + t.user, t.max_tokens))

    def _step(self) -> None:
        run = self.run
        run.steps += 1
        for due in sorted(k for k in self.arrivals if k <= run.steps):
            for rid, prompt, max_tokens in self.arrivals.pop(due):
                req = self.target.engine_request(rid, prompt, max_tokens)
                self.live[rid] = req
                self.sched.add_request(req)
        out = self.sched.schedule()
        self.shadow.execute(out)
        run.problems += self.shadow.take_problems()
        self._account(out)
        chunks = self._chunks(out.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {}
        if chunks:
            fresh = [b for b in self.shadow.fresh if b]
            self.storage.poison(fresh)
            self.clean_poisoned.update(fresh)
            run.storage.blocks_handed_out += len(fresh)
            res = self.model.forward(chunks, self.storage)
            self.clean_poisoned.difference_update(res.written_blocks)
            run.storage.batch_sizes.add(int(res.layer_out.shape[0]))
            self.outputs.on_tokens(run.steps, chunks, res.layer_out)
            for c in chunks:
                if c.sample:
                    token = res.next_tokens[c.rid]
                    self.outputs.on_sample(run.steps, c.rid, len(c.tokens), token)
                    sampled[c.rid] = [token]
        rids = list(out.num_scheduled_tokens)
        for rid in rids:
            self.shadow.returned(rid, sampled.get(rid, []))
        runner_out = self.target.runner_output(rids, [sampled.get(r, []) for r in rids])
        self.sched.update_from_output(out, runner_out)
        run.problems += self.shadow.take_problems()
        self._finish()
        self._poison_freed()
        run.storage.evictions += self.target.evicted_since()

    def _chunks(self, scheduled: dict[str, int]) -> list[SeqChunk]:
        chunks = []
        for rid in scheduled:
            view = self.shadow.requests.get(rid)
            if view is None:
                raise EngineFault(f"{rid} was scheduled but the worker holds no state for it")
            if view.last is None:
                raise EngineFault(f"{rid} was scheduled but the worker could not run its step")
            tables = tuple(tuple(t) for t in view.tables)
            start, end = view.last.start, view.last.end
            chunks.append(SeqChunk(rid, tuple(view.tokens), start, end, tables, end == len(view.tokens)))
        return chunks

    def _account(self, out: Any) -> None:
        acc = self.run.accounting
        acc.scheduled_tokens += out.total_num_scheduled_tokens
        for data in out.scheduled_new_reqs:
            acc.admissions += 1
            if data.num_computed_tokens:
                acc.admissions_with_hit += 1
                acc.hit_tokens += data.num_computed_tokens
        acc.preemptions += len(out.preempted_req_ids or ())

    def _finish(self) -> None:
        for rid, req in list(self.live.items()):
            if not req.is_finished():
                continue
            del self.live[rid]
            self.run.accounting.finished += 1
            session, turn = self.turn_of.pop(rid)
            if turn + 1 < len(session.turns):
                at = self.run.steps + 1 + session.turns[turn + 1].think_steps
                self._submit(session, turn + 1, tuple(req.all_token_ids), at)

    def _poison_freed(self) -> None:
        stale = [b for b in self.target.unheld_unhashed_blocks() if b not in self.clean_poisoned]
        if stale:
            self.storage.poison(stale)
            self.clean_poisoned.update(stale)
