"""The vLLM target with vLLM's real `AsyncScheduler`, driven one step ahead.

`VllmAsyncSchedulerTarget(config)` ("vllm-async-scheduler") is the
"vllm" target with async scheduling on: `vllm_scheduler_build`
builds `AsyncScheduler` (`SchedulerConfig(async_scheduling=True)`, the class
`SchedulerConfig.get_scheduler_cls` picks for it), and
`vllm_async_scheduler_drive` runs each `Step` in the engine core's async
order: `schedule()` of this step, then `update_from_output` of the step
before (`EngineCore.step_with_batch_queue`). Its requests carry output
placeholders (`num_output_placeholders`) between the two. The Checker judges
it against the model built with `async_scheduling` (`model.machine.async_scheduling`:
allocation caches only known tokens, a token's arrival caches what the
processed steps computed).

A target of its own rather than a flag: every command already takes
`--target` (fuzz, replay, zoo, conformance), the engine loop is the driver's
job, and a finding or conformance row names the target it came from; vLLM
itself makes the same choice by class (`AsyncScheduler` is a `Scheduler`
subclass the configuration selects).

Speculative decoding: a configuration with lookahead slots builds the
`AsyncScheduler` with a `SpeculativeConfig` (Eagle/MTP, or a draft model, as
for "vllm"); the driver runs it as the engine core does under async
scheduling (the scheduler schedules placeholder drafts and never sees the
drafter's; `vllm_async_scheduler_drive`), and the model states what that
changes (`model.machine.async_scheduling`, 5).

KV connectors: with `Config.kv_connector` the `AsyncScheduler` gets kvretain's
scripted connector as "vllm" does (`vllm_scheduler_build`). It is a consumer
(`kv_role="kv_both"`) and two steps are in flight, so vLLM fences block frees
(`defer_block_free`, `model.machine.async_scheduling`, 6): `FencedSnapshotReader` names
the blocks held in `Scheduler.deferred_frees` as the `FENCED` pseudo-table, and
the driver counts each step's output processed once, when the engine would
(`vllm_async_scheduler_drive`). A connector's report (`Loaded`, `Saved`) rides
on an output processed before the next `schedule()`; its `KVConnectorOutput`
comes after the latest step's output, as for "vllm".
"""

from __future__ import annotations

from typing import Any

from invariants.shadow import ShadowWorker
from model.contract.config import Config
from model.machine.async_scheduling import FENCED

from .base import TargetFeatures
from .vllm_async_scheduler_drive import AsyncStepScheduler
from .vllm_capabilities import Capabilities
from .vllm_scheduler_build import build_scheduler, scheduler_modules
from .vllm_scheduler_target import SchedulerEventTranslator, SchedulerOpDriver, VllmSchedulerTarget
from .vllm_snapshot import SnapshotReader
from .vllm_target import VLLM_EVENT_PROFILE, VllmManagerTarget


class FencedSnapshotReader(SnapshotReader):
    """`SnapshotReader` that also names the blocks the scheduler holds in fenced frees
    (`Scheduler.deferred_frees`, front to back) as the `FENCED` pseudo-table
    (`model.machine.async_scheduling`, 6)."""

    def __init__(self, session: Any, keys: Any, events: Any, scheduler: Any) -> None:
        super().__init__(session, keys, events)
        self.sched = scheduler

    def table_ids(self) -> list[str]:
        return [FENCED, *super().table_ids()]

    def table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        if rid != FENCED:
            return super().table(rid)
        held = tuple(b.block_id for _, blocks in self.sched.deferred_frees for b in blocks)
        return (held,) + ((),) * (len(self.s.manager.kv_cache_config.kv_cache_groups) - 1) if held else ()


class VllmAsyncSchedulerTarget(VllmSchedulerTarget):
    """vLLM's real `AsyncScheduler` driving its `KVCacheManager` (see the module docstring)."""

    name = "vllm-async-scheduler"
    features = TargetFeatures(
        partial=True,
        fine_mamba=True,
        real_scheduler=True,
        async_scheduling=True,
        connector=True,
        queues=True,
        engine_steps=True,
    )

    def __init__(self, config: Config, events: str = VLLM_EVENT_PROFILE, track_prefixes: bool = True) -> None:
        self.vllm_scheduler: Any = None
        # The synchronous target's driver is not built: this one replaces it.
        VllmManagerTarget.__init__(self, config, events, track_prefixes)
        self.steps = self.stepper(config)(self.session, self.names, self.vllm_scheduler, scheduler_modules())
        self.scheduler = self.steps
        self.driver = SchedulerOpDriver(self.session, self.names, self.steps)
        self.event_translator = SchedulerEventTranslator(self.session, self.keys, self.steps)
        self.reader = FencedSnapshotReader(
            self.session, self.keys, self.event_translator, self.vllm_scheduler
        )
        self.queue_checks = 0
        self.queue_found: list[tuple[str, str]] = []
        self.steps.shadow = self.shadow_worker()

    def stepper(self, config: Config) -> type[AsyncStepScheduler]:  # type: ignore[override]
        """The async step driver, whatever the configuration (`VllmSchedulerTarget.stepper`)."""
        return AsyncStepScheduler

    def shadow_worker(self) -> ShadowWorker | None:
        """The shadow worker one step ahead: a step runs once the tokens it reads are
        returned (`ShadowWorker.synchronous` off), a KV connector's side with it, drafts
        included (the runner's correction of the shipped positions: docs/shadow-worker.md)."""
        worker = super().shadow_worker()
        if worker is not None:
            worker.synchronous = False
        return worker

    def build_manager(self, config: Config, v: dict[str, Any], caps: Capabilities) -> Any:
        """The real `AsyncScheduler`'s `KVCacheManager` (the scheduler is kept as `vllm_scheduler`)."""
        self.vllm_scheduler = build_scheduler(
            config, v, caps, self.version, async_scheduling=True, speculative_blocks=self.speculative_blocks
        )
        return self.vllm_scheduler.kv_cache_manager
