"""vLLM's scheduler, as far as it touches the KV-cache manager.

The adapter drives vLLM's own `KVCacheManager` the way `Scheduler.schedule`
(`v1/core/sched/scheduler.py`, synchronous scheduling, no connector, no spec
decode tokens) calls it:

- one request (`schedule`): `new_step_starts()`; a waiting request gets
  `get_computed_blocks`, its `shared_prefix_boundary` stored on the request,
  the chunk `min(num_tokens - hit, budget)` (Mamba split:
  `model.policy.scheduling.mamba_chunk`, the scheduler policy every target shares),
  `allocate_slots(req, n, hit, blocks)`; a running request `allocate_slots(req,
  n)`. Then, as `schedule()` does, `take_kv_cache_block_copies()` (reported as
  the result's `copies`) and `block_pool.free_blocks(retained)`.
- several requests (`step`): one `Scheduler.schedule` (running pass with
  preempt-the-newest-and-retry, waiting pass only without a preemption;
  docs/semantics.md lists how it differs from the real loop).

Every `allocate_slots` call passes `num_lookahead_tokens` from the config.
Fine-grained Mamba hits (a Mamba group wider than the hash block size next to
another group: `HybridKVCacheCoordinator.enable_partial_hash_hits`) run as the
scheduler runs them: the chunk split adds the prompt-tail stop
(`Scheduler.mamba_partial_cache_hit`), and every step's copies are reported.
A release without the shared-prefix junction returns no boundary (0), one
without CoW copies reports none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.contract.observation import ScheduleResult, StepResult
from model.policy.scheduling import mamba_chunk

from .vllm_names import HashLearner
from .vllm_session import VllmSession

Results = list[tuple[str, ScheduleResult]]


class StepScheduler:
    """`Scheduler.schedule`'s calls into the manager, for one request or a batch."""

    def __init__(self, session: VllmSession, names: HashLearner) -> None:
        self.s = session
        self.names = names
        # `Scheduler.mamba_partial_cache_hit`: fine-grained hits add the prompt-tail stop.
        self.fine = bool(getattr(session.manager.coordinator, "enable_partial_hash_hits", False))

    # ------------------------------------------------------------------ manager calls
    def computed_blocks(self, req: Any) -> tuple[Any, int, int]:
        """`get_computed_blocks`; a release without the junction returns no boundary (0)."""
        out = self.s.manager.get_computed_blocks(req)
        return out if self.s.caps.shared_prefix_junction else (*out, 0)

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """Scheduler.schedule(): drain the CoW copies, release their retained endpoints."""
        if not self.s.caps.cow_copies:
            return ()
        copies, retained = self.s.manager.take_kv_cache_block_copies()
        if retained:
            self.s.pool.free_blocks(retained)
        return tuple((c.src_block_id, c.dst_block_id) for c in copies)

    def preempt(self, req: Any) -> None:
        """`Scheduler._preempt_request`: free, PREEMPTED, nothing computed."""
        self.s.manager.free(req)
        req.status = self.s.v["RequestStatus"].PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def _allocate(self, req: Any, n: int) -> Any:
        return self.s.manager.allocate_slots(req, n, num_lookahead_tokens=self.s.config.num_lookahead_tokens)

    def _chunk(self, req: Any, start: int, n: int, budget: int) -> int:
        """The scheduler's split of `n` new tokens (Mamba groups in 'align' mode only:
        `Scheduler.need_mamba_block_aligned_split`)."""
        cfg = self.s.config
        if not cfg.has_mamba_align:
            return n
        return mamba_chunk(
            start=start,
            num_new=n,
            budget=budget,
            num_prompt_tokens=req.num_prompt_tokens,
            num_tokens=req.num_tokens,
            shared_prefix_boundary=getattr(req, "shared_prefix_boundary", 0),
            block_size=cfg.scheduler_block_size,
            eagle=cfg.eagle,
            fine_hash_block_size=self.s.hbs if self.fine else 0,
        )

    # ------------------------------------------------------------------ one request
    def schedule(self, req: Any, budget: int) -> ScheduleResult:
        """One step scheduling `req` alone, with `budget` tokens; the step's copies drained."""
        self.s.manager.new_step_starts()
        result, copies = self._schedule(req, budget), self.take_copies()
        return replace(result, copies=copies) if copies else result  # (no copies: the default)

    def _schedule(self, req: Any, budget: int) -> ScheduleResult:
        if req.status != self.s.v["RequestStatus"].RUNNING:
            return self.admit(req, budget, budget)
        start = req.num_computed_tokens
        n = self._chunk(req, start, min(req.num_tokens - start, budget), budget)
        if n <= 0:
            return ScheduleResult(scheduled=0, admitted=False)
        out = self._allocate(req, n)
        if out is None:
            return ScheduleResult(scheduled=0, admitted=False)
        req.num_computed_tokens += n
        self.names.learn_computed(req)
        return ScheduleResult(scheduled=n, admitted=False, new_blocks=block_ids(out))

    def admit(self, req: Any, left: int, budget: int, any_running: bool = False) -> ScheduleResult:
        """A WAITING or PREEMPTED request's admission (`Scheduler.schedule`'s
        waiting queue) with `left` tokens of the step's `budget` remaining; the
        admission gates as the scheduler sets them (`full_sequence_must_fit` =
        `Config.reserve_full_isl`, `has_scheduled_reqs`: `any_running`, a request
        of the step running; `model.policy.admission`)."""
        blocks, hit, spb = self.computed_blocks(req)
        req.shared_prefix_boundary = spb
        hit_blocks = block_ids(blocks)
        n = self._chunk(req, hit, min(req.num_tokens - hit, left), budget)
        result = ScheduleResult(0, False, hit, spb, hit_blocks, None)
        if n <= 0:
            return result
        out = self.s.manager.allocate_slots(
            req,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=self.s.config.num_lookahead_tokens,
            **self._gates(any_running),
        )
        if out is None:
            return result
        req.status = self.s.v["RequestStatus"].RUNNING
        req.num_computed_tokens = hit + n
        self.names.learn_computed(req)
        return ScheduleResult(n, True, hit, spb, hit_blocks, block_ids(out))

    def _gates(self, any_running: bool) -> dict[str, bool]:
        """The admission's gate arguments, passed only where the configuration sets a gate
        (a release without them is refused at build: `vllm_build.build_manager`)."""
        cfg = self.s.config
        gates = {"full_sequence_must_fit": True} if cfg.reserve_full_isl else {}
        return {**gates, "has_scheduled_reqs": any_running} if cfg.watermark else gates

    # ------------------------------------------------------------------ batched step
    def step(self, rids: tuple[str, ...], budget: int) -> StepResult:
        """`Scheduler.schedule` (FCFS) over the requests `rids`, as its loops run.

        Running pass (`_running_pass`), then the waiting pass only if nobody was
        preempted: `get_computed_blocks`, the chunk, `allocate_slots(...,
        num_new_computed_tokens, new_computed_blocks)`; None ends the pass. Then
        the CoW copies are drained once for the step.
        """
        requests, status = self.s.requests, self.s.v["RequestStatus"]
        self.s.manager.new_step_starts()
        running = [requests[r] for r in rids if requests[r].status == status.RUNNING]
        waiting = [requests[r] for r in rids if requests[r].status != status.RUNNING]
        results: Results = []
        preempted: list[str] = []
        token_budget = self._running_pass(running, budget, results, preempted)
        admitted = False  # `has_scheduled_reqs`: the running requests left, then each admission
        if not preempted:
            for req in waiting:
                if token_budget <= 0:
                    break
                result = self.admit(req, token_budget, budget, bool(running) or admitted)
                results.append((req.request_id, result))
                if not result.admitted:
                    break
                admitted = True
                token_budget -= result.scheduled
        return StepResult(tuple(results), tuple(preempted), self.take_copies())

    def _running_pass(self, running: list[Any], budget: int, results: Results, preempted: list[str]) -> int:
        """`num_new_tokens = min(num_tokens - num_computed_tokens, token_budget)`, the
        Mamba split, `allocate_slots`; on None preempt `running.pop()` and retry until it
        fits or the request preempted itself, then stop the pass. Returns the budget left."""
        token_budget = budget
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            req = running[req_index]
            start = req.num_computed_tokens
            n = self._chunk(req, start, min(req.num_tokens - start, token_budget), budget)
            if n == 0:
                results.append((req.request_id, ScheduleResult(scheduled=0, admitted=False)))
                req_index += 1
                continue
            out = self._allocate_or_preempt(req, n, running, preempted)
            if out is None:
                results.append((req.request_id, ScheduleResult(scheduled=0, admitted=False)))
                break
            req.num_computed_tokens += n
            self.names.learn_computed(req)
            token_budget -= n
            results.append(
                (req.request_id, ScheduleResult(scheduled=n, admitted=False, new_blocks=block_ids(out)))
            )
            req_index += 1
        return token_budget

    def _allocate_or_preempt(self, req: Any, n: int, running: list[Any], preempted: list[str]) -> Any:
        """`allocate_slots`, preempting the newest running request until it fits; None
        when `req` preempted itself."""
        while True:
            out = self._allocate(req, n)
            if out is not None:
                return out
            victim = running.pop()
            self.preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return None


def block_ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `KVCacheBlocks` as block ids per group."""
    return tuple(tuple(ids) for ids in blocks.get_block_ids())
