"""Speculative decoding through vLLM's real `Scheduler` (the "vllm" target).

Where the configuration reserves lookahead slots, `vllm_scheduler_build`
builds the scheduler with a `SpeculativeConfig` (Eagle/MTP, or a draft model,
`num_speculative_tokens = num_lookahead_tokens`), and the target drives it
with these subclasses. Everything that decides is vLLM's own code: the
running pass schedules a request's drafts (`num_tokens_with_spec`), the
waiting pass pads a one-token admission (`pad_spec_decode`), every
`allocate_slots` reserves the lookahead, and `update_from_output` rolls
rejected drafts back and caches the request's blocks. The model states the
same contract (`model.policy.spec_decode`).

A `Sample(rid, token, accepted, drafts)` is the model runner's output for
`rid`'s step and the drafter's next proposal, delivered at once (not at the
next `schedule()`, as the plain driver does), because `update_from_output`
then caches blocks and the model caches them at the sample:

- `update_from_output` with the request's share of its step's output, whose
  sampled tokens are the first `accepted` drafts the step verified
  (`scheduled_spec_decode_tokens`, placeholders never accepted) followed by
  `token`;
- then `Scheduler.update_draft_token_ids(DraftTokenIds([rid], [drafts]))`, as
  `EngineCore.post_step` does after a step.

But where the step ran a sync KV load, its output may still report the load's
failed blocks, and a sample of the step rides on it
(`model.machine.failed_blocks.output_waits`): its share waits for the next operation,
which delivers it (the report itself, with the whole output, or, before any
other operation, the waiting shares), then proposes its drafts.

A Mamba group speculates too: `vllm_scheduler_build` gives its `MambaSpec`
`num_speculative_blocks = num_lookahead_tokens`, as a real Mamba layer
declares (`MambaBase.get_kv_cache_spec`; 0 only under ReplaySSM, which
kvretain does not build), and the model keeps the same draft state blocks
(`model.contract.mamba`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.contract.observation import StepResult
from model.contract.ops import Sample

from .base import TargetCrash
from .vllm_scheduler_drive import RealStepScheduler


class SpecStepScheduler(RealStepScheduler):
    """`RealStepScheduler` whose samples carry drafts (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # rid -> the verified drafts its waiting sample accepts.
        self.accepted: dict[str, int] = {}
        # Did the last step run a sync load? Its output may still report failed blocks.
        self.sync_loads = False
        # rid -> the drafts of a sample riding on that output, proposed once it is processed.
        self.drafting: dict[str, tuple[int, ...]] = {}

    def step(self, rids: tuple[str, ...], budget: int) -> StepResult:
        connector = self.sched.connector
        before = len(connector.loads) if connector is not None else 0
        result = super().step(rids, budget)
        new = connector.loads[before:] if connector is not None else []
        self.sync_loads = any(load.rid not in connector.loading for load in new)
        return result

    def flush(self) -> None:
        """The last step's output, then the drafts of the samples that rode on it."""
        super().flush()
        self.propose()

    def report_step(self, rid: str, connector_output: Any) -> None:
        super().report_step(rid, connector_output)
        self.accepted.pop(rid, None)
        self.propose()

    def propose(self) -> None:
        """`update_draft_token_ids` with the drafts of the samples that rode on the processed
        output, as `EngineCore.post_step` proposes them after `update_from_output`."""
        drafting, self.drafting, self.sync_loads = self.drafting, {}, False
        if drafting:
            from vllm.v1.outputs import DraftTokenIds

            self.sched.update_draft_token_ids(
                DraftTokenIds(list(drafting), [list(d) for d in drafting.values()])
            )

    def close_window(self) -> None:
        """An operation other than a sample or the sync load's report: the shares of the
        samples that rode on the step's output are delivered first, then their drafts
        proposed (the rest of the output waits, as without a sync load)."""
        out, riding = self.pending, set(self.drafting)
        if riding and out is not None:
            rest = {r: n for r, n in out.num_scheduled_tokens.items() if r not in riding}
            self.pending = replace(
                out, num_scheduled_tokens=rest, total_num_scheduled_tokens=sum(rest.values())
            )
            self._deliver(out, [r for r in out.num_scheduled_tokens if r in riding])
        self.propose()

    def sample_drafts(self, req: Any, op: Sample) -> None:
        """`op`'s output for `req`, delivered now, then its drafts proposed; but where the
        step ran a sync load, it rides on the step's output with the load's report
        (`model.machine.failed_blocks.output_waits`), processed at the next operation."""
        rid = req.request_id
        out = self.pending
        if self.sync_loads and out is not None and rid in out.num_scheduled_tokens:
            self.samples[rid] = op.token
            self.accepted[rid] = op.accepted
            self.drafting[rid] = op.drafts
            return
        self.close_window()
        out = self.pending
        if out is not None and rid in out.num_scheduled_tokens:
            rest = {r: n for r, n in out.num_scheduled_tokens.items() if r != rid}
            self.pending = replace(
                out, num_scheduled_tokens=rest, total_num_scheduled_tokens=sum(rest.values())
            )
        else:
            out = self.held.pop(rid, None)
            if out is None:
                raise TargetCrash(f"the vLLM scheduler adapter holds no step output for {rid!r}'s sample")
        self.samples[rid] = op.token
        self.accepted[rid] = op.accepted
        self._deliver(out, [rid])
        from vllm.v1.outputs import DraftTokenIds

        self.sched.update_draft_token_ids(DraftTokenIds([rid], [list(op.drafts)]))

    def sample_op(self, req: Any, op: Sample) -> None:
        self.sample_drafts(req, op)

    def sampled_tokens(self, out: Any, rid: str) -> list[int]:
        """The accepted drafts of `rid`'s step, then its sampled token (none if unsampled)."""
        if rid not in self.samples:
            return []
        verified = out.scheduled_spec_decode_tokens.get(rid, ())
        return [*verified[: self.accepted.pop(rid, 0)], self.samples.pop(rid)]
