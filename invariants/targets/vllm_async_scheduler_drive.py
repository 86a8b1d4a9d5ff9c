"""kvretain's scheduling operations run by vLLM's real `AsyncScheduler`, one step ahead.

vLLM's engine core with async scheduling keeps two steps in flight
(`EngineCore.step_with_batch_queue`, batch queue of two): it schedules step
N+1, and only then processes step N's output (`update_from_output`). So a
`Step` here is `schedule()` first (as `RealStepScheduler.step` arranges the
queues and records the manager calls), then `update_from_output` of the step
before it, with the tokens `Sample` gave its requests. A request whose step
reached the end of its known tokens and has no `Sample` yet has its share of
that output held until its `Sample` (it arrives then), exactly as the
synchronous driver holds it. `model.machine.async_scheduling` states what the model
predicts of this order.

Operations between steps:
- `Sample(rid, token)`: the token of `rid`'s latest step; it rides on that
  step's output (processed after the next `schedule()`), or arrives at once
  when that output was already processed (a held share);
- `Preempt(rid)`: `Scheduler._preempt_request`, then `rid`'s share of the
  unprocessed output, now stale (its token is appended, nothing is cached),
  so the request waits with every token it sampled, as the model's `Preempt`
  keeps them;
- `Finish(rid)`: `finish_requests`; its share of the unprocessed output is
  ignored when that output is processed, as vLLM ignores a finished request's.

Speculative decoding (a configuration with lookahead slots builds the
`AsyncScheduler` with a `SpeculativeConfig`): as in vLLM's engine core with
async scheduling, the scheduler is never told the drafts
(`update_draft_token_ids` is not called: the worker keeps them and fills the
k placeholder drafts `AsyncScheduler` schedules). A `Sample(rid, token,
accepted, drafts)` only shapes the step output: its sampled tokens are the
first `accepted` drafts of `rid`'s previous `Sample` (the worker's drafts the
step verified) followed by `token`, and vLLM's `update_from_output` reads the
acceptance from their count and rolls the rejected placeholders back.

KV connectors (`Config.kv_connector`): kvretain's connector is a consumer, so
with two steps in flight vLLM fences block frees on the step outputs it has
processed (`defer_block_free`; `model.machine.async_scheduling`, 6): the first
`update_from_output` of a step with tokens counts it processed
(`processed_step_seq`) and frees what waited for it. The engine processes a
step's output once, after the next `schedule()`; this driver delivers it in
shares (a share held for its `Sample`, a preempted request's at once), so
only the share delivered when the engine would process the output reports
the step's tokens (`share_total`; a step whose every share is held reports
them alone, `_fence`), the others report none and move no fence. A
connector's report (`Loaded`, `Saved`) comes with an output processed before
the next `schedule()`: the latest step's output is processed first (`flush`),
as the engine's batch queue does when it waits on its oldest step; a sync
load's failed blocks ride on the output of the step that ran it
(`report_step`), processed then, and so do the shares held for a sample whose
requests hold a failed block (`riding`, as the synchronous driver delivers them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.contract.observation import StepResult
from model.contract.ops import Sample

from .base import TargetCrash
from .vllm_scheduler_drive import RealStepScheduler


class AsyncStepScheduler(RealStepScheduler):
    """`RealStepScheduler` in the engine's async order (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The requests of the unprocessed output (`pending`) whose share is still to be delivered.
        self.undelivered: list[str] = []
        # Those of them whose step reached the end of their known tokens (they owe a sample).
        self.samplers: set[str] = set()
        # rid -> the drafts its last `Sample` proposed (the worker's, verified by its next step).
        self.proposed: dict[str, tuple[int, ...]] = {}
        # rid -> the tokens its pending sample delivers: accepted drafts, then the token.
        self.generated: dict[str, list[int]] = {}
        # The step output being processed as the engine processes it: its share carries the fence.
        self.fencing: Any = None

    def step(self, rids: tuple[str, ...], budget: int) -> StepResult:
        """`schedule()` over `rids`, then `update_from_output` of the step before."""
        previous, undelivered, samplers = self.pending, self.undelivered, self.samplers
        self.pending = None  # `RealStepScheduler.step` would process it first
        result = super().step(rids, budget)
        out = self.pending
        self.undelivered = list(out.num_scheduled_tokens)
        self.samplers = {r for r in self.undelivered if self._reached_end(r)}
        if previous is not None:
            self._process(previous, undelivered, samplers)
        return result

    def add(self, req: Any) -> None:
        """A request reusing the id of a finished one whose share of the unprocessed output
        is still undelivered: that share was the finished request's, which vLLM ignores
        (vLLM's own ids are unique; here it would land on the new request)."""
        rid = req.request_id
        if rid in self.undelivered:
            self.undelivered.remove(rid)
            self.samplers.discard(rid)
            self.samples.pop(rid, None)
            self.generated.pop(rid, None)
        super().add(req)

    def _reached_end(self, rid: str) -> bool:
        req = self.s.requests[rid]
        return bool(req.num_computed_tokens >= req.num_tokens)

    def _process(self, out: Any, rids: list[str], samplers: set[str]) -> None:
        """`update_from_output` of `out` for `rids`; a sampler without its token is held."""
        running = self.s.v["RequestStatus"].RUNNING
        now = []
        for rid in rids:
            req = self.s.requests.get(rid)
            if rid in samplers and rid not in self.samples and req is not None and req.status == running:
                self.held[rid] = out
            else:
                now.append(rid)
        self.fencing = out
        try:
            if now:
                self._deliver(out, now)
            else:
                self._fence(out)
        finally:
            self.fencing = None

    def share_total(self, out: Any, scheduled: dict[str, int]) -> int:
        """The step's tokens on the share delivered when the engine processes `out`, else 0."""
        return int(out.total_num_scheduled_tokens) if out is self.fencing else 0

    def _fence(self, out: Any) -> None:
        """`out` processed with every share held for its `Sample`: an `update_from_output`
        with no request's share still counts the step (vLLM's fences, `defer_block_free`)."""
        if not (self.sched.defer_block_free and out.total_num_scheduled_tokens > 0):
            return
        empty = replace(out, num_scheduled_tokens={}, scheduled_spec_decode_tokens={})
        runner_out = self.m["ModelRunnerOutput"](req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        self.update(empty, runner_out)

    def flush(self) -> None:
        """The latest step's output, processed before the next `schedule()` (a connector's report)."""
        out, self.pending = self.pending, None
        if out is not None:
            rids, samplers, self.undelivered, self.samplers = self.undelivered, self.samplers, [], set()
            self._process(out, rids, samplers)

    def report_load(self, connector_output: Any, invalid: tuple[int, ...] = ()) -> None:
        """The latest step's output first (`flush`), then the report, with the shares held
        for a sample whose requests hold a failed block before it (`riding`): their
        placeholders are checked as a sync load's cut checks them."""
        self.flush()
        riding = self.riding(invalid)
        super().report_load(connector_output, invalid)
        self._check_placeholders(riding)

    def report_step(self, rid: str, connector_output: Any) -> None:
        """A sync load's failed blocks with the output of the step that ran it: its
        undelivered shares at once (`rid`'s without its token, which vLLM drops)."""
        out, self.pending = self.pending, None
        if out is None or rid not in out.num_scheduled_tokens:
            raise TargetCrash(f"the vLLM scheduler adapter holds no step output of {rid!r}'s sync load")
        self.samples.pop(rid, None)
        self.generated.pop(rid, None)
        rids, self.undelivered, self.samplers = self.undelivered, [], set()
        self.fencing = out
        try:
            self._deliver(out, rids, connector_output)
        finally:
            self.fencing = None
        self._check_placeholders(rids)

    def _check_placeholders(self, rids: list[str]) -> None:
        """After a step output delivered whole (or the shares riding on a report), a running
        request of it still holding output placeholders was skipped by a failed load's cut
        (`update_from_output` skips the requests `_handle_invalid_blocks` names before
        `_update_request_with_output` lowers them): nothing will consume them, and its next
        steps schedule them as tokens. The model states the cut request going on from its
        cut; this is a known finding
        ("async-load-cut-keeps-placeholders"), reported here as it happens."""
        for rid in rids:
            req = self.sched.requests.get(rid)
            if req is not None and not req.is_finished() and req.num_output_placeholders > 0:
                raise TargetCrash(
                    f"vLLM {self.s.version} kept {rid}'s {req.num_output_placeholders} output "
                    "placeholder(s) after a load's failed blocks cut it (its step output is "
                    "skipped: nothing consumes them, its next steps schedule them as tokens)"
                )

    def sample_op(self, req: Any, op: Sample) -> None:
        """`op`'s tokens for the step output: the accepted drafts, then the token."""
        rid = req.request_id
        self.generated[rid] = [*self.proposed.pop(rid, ())[: op.accepted], op.token]
        self.proposed[rid] = op.drafts
        self.sample(req, op.token)

    def sampled_tokens(self, out: Any, rid: str) -> list[int]:
        if rid not in self.samples:
            return []
        token = self.samples.pop(rid)
        return self.generated.pop(rid, [token])

    def sample(self, req: Any, token: int) -> None:
        rid = req.request_id
        if rid in self.undelivered:
            self.samples[rid] = token
            return
        super().sample(req, token)

    def finish(self, req: Any) -> None:
        self.proposed.pop(req.request_id, None)
        super().finish(req)
