"""The vLLM target with vLLM's real `Scheduler` driving the allocator.

`VllmSchedulerTarget(config)` ("vllm-scheduler") builds vLLM's own `Scheduler`
offline (`vllm_scheduler_build`) and drives it with kvretain's operations
(`vllm_scheduler_drive`): a bug in `vllm/v1/core/sched/scheduler.py` is now
inside what is checked, where `VllmTarget` ("vllm") re-creates the scheduler's
calls (`vllm_schedule`). The allocator is the scheduler's `KVCacheManager`,
read by the same snapshot, partial-state and hash-naming parts as "vllm".

| operation | vLLM |
|---|---|
| `AddRequest` | `Scheduler.add_request` (a WAITING request, hashed as `VllmTarget` hashes it) |
| `Step`, `Schedule` | `update_from_output` of the previous step, then `Scheduler.schedule` (`RealStepScheduler.step`) |
| `Sample` | the token of the step's synthetic `ModelRunnerOutput` |
| `Finish` | `Scheduler.finish_requests(rid, FINISHED_ABORTED)` |
| `Preempt` | `Scheduler._preempt_request`, as `reset_prefix_cache(reset_running_requests=True)` preempts |
| `ResetPrefixCache` | `Scheduler.reset_prefix_cache()` |
| `Probe`, `EvictBlocks` | the manager's `get_computed_blocks` / `evict_blocks`, as for "vllm" |

KV events come from the scheduler's publisher (`update_from_output` publishes
them) and then the manager (`RealStepScheduler.take_events`).

Not judged yet: speculative decoding. A configuration with lookahead slots (and
so Eagle, which always drafts) raises `SchedulerUnsupported`: vLLM's scheduler
then pads a newly admitted one-token request to `1 + num_spec_tokens` tokens
(`Scheduler.schedule`, `pad_spec_decode`) and rolls rejected drafts back in
`update_from_output`, and the model's steps describe neither (the
`KVCacheManager`-driven "vllm" target covers these configurations).
`vllm_scheduler_build` builds such schedulers, and `AsyncScheduler` too,
which is not driven yet: driven in lockstep (each step's output delivered
before the next schedule) it agreed with the model for a few thousand fuzzing
steps, then cached a block when a held step output's token arrived
(`update_from_output` calls `cache_blocks` for a request with output
placeholders, as it does with spec tokens), where the model caches at the next
allocation.
"""

from __future__ import annotations

from typing import Any

from model.config import Config
from model.observation import Done, Observation, ResetResult
from model.ops import AddRequest, Finish, Loaded, Offer, Op, Preempt, ResetPrefixCache, Sample

from .base import TargetFeatures
from .vllm_capabilities import Capabilities
from .vllm_drive import OpDriver
from .vllm_scheduler_build import SchedulerUnsupported, build_scheduler, scheduler_modules
from .vllm_scheduler_drive import RealStepScheduler
from .vllm_snapshot import EventTranslator, SnapshotReader
from .vllm_target import VLLM_EVENT_PROFILE, VllmTarget

NO_SPEC_DECODE_STEPS = (
    "num_lookahead_tokens/eagle: the vllm-scheduler target does not judge speculative decoding yet "
    "(vLLM's scheduler pads new decode requests with draft slots and rolls rejected drafts back; the "
    "model's steps describe neither); use --target vllm for such configurations"
)


class SchedulerOpDriver(OpDriver):
    """`OpDriver` with the request lifecycle going through the real scheduler."""

    def __init__(self, session: Any, names: Any, scheduler: RealStepScheduler) -> None:
        super().__init__(session, names, scheduler)
        self.real = scheduler
        # Finished while their connector load was in flight: kept (with their blocks) until it reports.
        self.held_by_load: set[str] = set()

    def check_well_formed(self, op: Op) -> None:
        if isinstance(op, (Offer, Loaded)) and self.real.sched.connector is None:
            raise ValueError(
                f"{type(op).__name__.lower()}: the configuration has no KV connector (kv_connector)"
            )
        if isinstance(op, Loaded) and op.rid in self.held_by_load:
            return
        super().check_well_formed(op)
        if isinstance(op, Sample) and self.real.awaits_sample(op.rid):
            raise ValueError(f"sample: {op.rid!r} is not waiting for a sample")

    def dispatch(self, op: Op) -> Observation:
        requests = self.s.requests
        if isinstance(op, AddRequest):
            requests[op.rid] = self.new_request(op.rid, op.prompt)
            self.real.add(requests[op.rid])
            return Done()
        if isinstance(op, Sample):
            self.real.sample(requests[op.rid], op.token)
            return Done()
        if isinstance(op, Finish):
            req = requests[op.rid]
            loading = req.status == self.s.v["RequestStatus"].WAITING_FOR_REMOTE_KVS
            self.real.finish(req)
            if loading and op.rid in self.real.sched.requests:
                # vLLM defers the free until the load reports (`model.connector`): the
                # request stays, so its table stays observed.
                self.held_by_load.add(op.rid)
            else:
                requests.pop(op.rid)
                self.names.forget(op.rid)
            self.finished = req
            return Done()
        if isinstance(op, Offer):
            self.real.sched.connector.offer(op.rid, op.num_tokens, op.load == "async")
            return Done()
        if isinstance(op, Loaded):
            from .vllm_connector import connector_output

            self.real.report_load(connector_output(op.rid, op.ok))
            # Its free deferred, or ended with an error ('fail' policy): gone from vLLM.
            if op.rid in self.held_by_load or op.rid not in self.real.sched.requests:
                self.held_by_load.discard(op.rid)
                requests.pop(op.rid)
                self.names.forget(op.rid)
            return Done()
        if isinstance(op, Preempt):
            self.real.preempt(requests[op.rid])
            return Done()
        if isinstance(op, ResetPrefixCache):
            return ResetResult(bool(self.real.sched.reset_prefix_cache()))
        return super().dispatch(op)


class SchedulerEventTranslator(EventTranslator):
    """Events published by `update_from_output`, then those still in the manager."""

    def __init__(self, session: Any, keys: Any, scheduler: RealStepScheduler) -> None:
        super().__init__(session, keys)
        self.scheduler = scheduler

    def drain(self) -> tuple[Any, ...]:
        return tuple(e for ev in self.scheduler.take_events() for e in self.translate(ev))


class VllmSchedulerTarget(VllmTarget):
    """vLLM's real `Scheduler` driving its `KVCacheManager` (see the module docstring)."""

    name = "vllm-scheduler"
    features = TargetFeatures(partial=True, fine_mamba=True, real_scheduler=True, connector=True)

    def __init__(self, config: Config, events: str = VLLM_EVENT_PROFILE, track_prefixes: bool = True) -> None:
        if config.num_lookahead_tokens or config.eagle:
            raise SchedulerUnsupported(NO_SPEC_DECODE_STEPS)
        self.vllm_scheduler: Any = None
        super().__init__(config, events, track_prefixes)
        self.steps = RealStepScheduler(self.session, self.names, self.vllm_scheduler, scheduler_modules())
        self.scheduler = self.steps
        self.driver = SchedulerOpDriver(self.session, self.names, self.steps)
        self.event_translator = SchedulerEventTranslator(self.session, self.keys, self.steps)
        self.reader = SnapshotReader(self.session, self.keys, self.event_translator)

    def build_manager(self, config: Config, v: dict[str, Any], caps: Capabilities) -> Any:
        """The real scheduler's `KVCacheManager` (the scheduler is kept as `vllm_scheduler`)."""
        self.vllm_scheduler = build_scheduler(config, v, caps, self.version)
        return self.vllm_scheduler.kv_cache_manager
