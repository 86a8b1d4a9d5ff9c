"""The vLLM target with vLLM's real `Scheduler` driving the allocator.

`VllmSchedulerTarget(config)` ("vllm") builds vLLM's own `Scheduler`
offline (`vllm_scheduler_build`) and drives it with kvretain's operations
(`vllm_scheduler_drive`): a bug in `vllm/v1/core/sched/scheduler.py` is now
inside what is checked, where `VllmManagerTarget` ("vllm-manager") re-creates the scheduler's
calls (`vllm_schedule`). The allocator is the scheduler's `KVCacheManager`,
read by the same snapshot, partial-state and hash-naming parts as "vllm-manager".

| operation | vLLM |
|---|---|
| `AddRequest` | `Scheduler.add_request` (a WAITING request, hashed as `VllmManagerTarget` hashes it) |
| `Step`, `Schedule` | `update_from_output` of the previous step, then `Scheduler.schedule` over vLLM's own queues with the built budget (`RealStepScheduler.step`; another set of requests or budget is refused) |
| `Sample` | the token (and accepted drafts) of the step's synthetic `ModelRunnerOutput`; its drafts go to `update_draft_token_ids` |
| `Finish` | `Scheduler.finish_requests(rid, FINISHED_ABORTED)` |
| `Preempt` | refused (no client can ask it: vLLM preempts under pool pressure) |
| `ResetPrefixCache` | `Scheduler.reset_prefix_cache()` |
| `Offer`, `Save` | kvretain's connector's script (`vllm_connector`) |
| `Loaded`, `Saved` | `update_from_output` with no request's share and the worker's `KVConnectorOutput`; a sync load's failed blocks, with the output of the step that ran it (`RealStepScheduler.report_step`) |
| `Probe`, `EvictBlocks` | the manager's `get_computed_blocks` / `evict_blocks`, as for "vllm-manager" |

KV events come from the scheduler's publisher (`update_from_output` publishes
them) and then the manager (`RealStepScheduler.take_events`).

"vllm" acts only as an engine core and a client do: every `Step` is the
engine's own (`TargetFeatures.engine_steps`: it names every request vLLM holds,
with the budget built from `Config.max_num_batched_tokens`, or a budget that
does not bind), and nothing of the scheduler is written after construction
(tests/test_steering_ledger.py reads the adapters' source for a write). A
configuration stating no budget is built with `max_model_len` tokens a step,
which no step reaches; the fuzzer draws a budget for every example
(`invariants.harness.machine.engine_caps`).

Speculative decoding: a configuration with lookahead slots builds the scheduler
with a `SpeculativeConfig` (Eagle/MTP, or a draft model) and is driven by
`vllm_scheduler_spec.SpecStepScheduler`: `Sample` carries the accepted drafts
and the drafter's next proposal, vLLM pads and rolls back (`model.policy.spec_decode`
states the contract). An Eagle configuration without lookahead slots cannot be
built (`SchedulerUnsupported`: vLLM's Eagle drafts at least one token).
`vllm_scheduler_build` builds `AsyncScheduler` too,
which "vllm-async-scheduler" drives one step ahead
(`vllm_async_scheduler_target`): there a token's arrival caches blocks
(`update_from_output` calls `cache_blocks` for a request with output
placeholders), which the model states as async scheduling's semantics
(`model.machine.async_scheduling`), not a finding.
"""

from __future__ import annotations

from typing import Any

from invariants.shadow import QUEUES, ShadowConnector, ShadowWorker, WorkerGroup, queue_problems
from model.contract.config import Config
from model.contract.observation import Done, LoadCut, Observation, ResetResult, Saving
from model.contract.ops import (
    AddRequest,
    Finish,
    Loaded,
    Offer,
    Op,
    Preempt,
    ResetPrefixCache,
    Sample,
    Save,
    Saved,
)

from .base import TargetCrash, TargetFeatures
from .vllm_capabilities import Capabilities
from .vllm_drive import OpDriver
from .vllm_scheduler_build import build_scheduler, scheduler_modules
from .vllm_scheduler_drive import RealStepScheduler
from .vllm_scheduler_spec import SpecStepScheduler
from .vllm_snapshot import EventTranslator, SnapshotReader
from .vllm_target import VLLM_EVENT_PROFILE, VllmManagerTarget


class SchedulerOpDriver(OpDriver):
    """`OpDriver` with the request lifecycle going through the real scheduler."""

    def __init__(self, session: Any, names: Any, scheduler: RealStepScheduler) -> None:
        super().__init__(session, names, scheduler)
        self.real = scheduler
        # Finished while their connector load was in flight, or with a save: kept (with their
        # blocks) until it reports.
        self.held_by_load: set[str] = set()
        self.held_by_save: set[str] = set()

    def check_well_formed(self, op: Op) -> None:
        if isinstance(op, (Offer, Loaded, Save, Saved)) and self.real.sched.connector is None:
            raise ValueError(
                f"{type(op).__name__.lower()}: the configuration has no KV connector (kv_connector)"
            )
        if isinstance(op, Saved) and op.rid not in self.held_by_save:
            raise ValueError(f"saved: {op.rid!r} has no connector save pending")
        if isinstance(op, Loaded) and op.rid in self.held_by_load or isinstance(op, Saved):
            return
        super().check_well_formed(op)
        if isinstance(op, Sample) and self.real.awaits_sample(op.rid):
            raise ValueError(f"sample: {op.rid!r} is not waiting for a sample")

    def dispatch(self, op: Op) -> Observation:
        requests = self.s.requests
        if not isinstance(op, (Sample, Loaded)):
            self.real.close_window()
        if isinstance(op, AddRequest):
            requests[op.rid] = self.new_request(op.rid, op.tokens())
            self.real.add(requests[op.rid])
            return Done()
        if isinstance(op, Sample):
            self.real.sample_op(requests[op.rid], op)
            return Done()
        if isinstance(op, Finish):
            return self.finish(op.rid)
        if isinstance(op, Offer):
            self.real.sched.connector.offer(op.rid, op.num_tokens, op.load == "async")
            return Done()
        if isinstance(op, Save):
            self.real.sched.connector.save(op.rid)
            return Done()
        if isinstance(op, Loaded) and self.runs(op.rid):
            return self.sync_load_failed(op)
        if isinstance(op, (Loaded, Saved)):
            from .vllm_connector import connector_output, sent_output

            if isinstance(op, Loaded):
                report = connector_output(op.rid, op.ok, op.invalid)
            else:
                report = sent_output(op.rid)
            self.real.flush()  # the last step's output first, then the report's
            sched = self.real.sched
            scanned = [*sched.kv_holding_waiting, *sched.running]  # what the cut scans
            before = {r.request_id: r.num_computed_tokens for r in scanned if r.request_id != op.rid}
            self.real.report_load(report, op.invalid if isinstance(op, Loaded) else ())
            req = requests.get(op.rid)
            (self.held_by_load if isinstance(op, Loaded) else self.held_by_save).discard(op.rid)
            ended = self.ended(op) if isinstance(op, Loaded) else ()
            gone = op.rid not in self.real.sched.requests
            if gone and op.rid in self.held_by_load | self.held_by_save:
                raise TargetCrash(self.freed_early(op))
            # Its deferred free done: gone from vLLM.
            if op.rid in requests and gone:
                requests.pop(op.rid)
                self.names.forget(op.rid)
            # Failed blocks cut the request's computed tokens, and those of the other async
            # loads and running requests holding one (`model.machine.connector`).
            if not (isinstance(op, Loaded) and op.invalid) or req is None:
                return Done()
            cut = ((r.request_id, r.num_computed_tokens) for r in scanned if r.request_id in before)
            others = tuple(sorted((r, n) for r, n in cut if n != before[r]))
            return LoadCut(req.num_computed_tokens, others, ended, self.real.take_dropped())
        if isinstance(op, Preempt):
            self.real.preempt(requests[op.rid])
            return Done()
        if isinstance(op, ResetPrefixCache):
            return ResetResult(bool(self.real.sched.reset_prefix_cache()))
        return super().dispatch(op)

    def runs(self, rid: str) -> bool:
        """Is `rid` running in vLLM (not finished, held for a transfer)?"""
        if rid in self.held_by_load | self.held_by_save:
            return False
        return bool(self.s.requests[rid].status == self.s.v["RequestStatus"].RUNNING)

    def freed_early(self, op: Loaded | Saved) -> str:
        """vLLM freed a finished request's blocks (and forgot it) at one transfer's report
        while its other transfer, which deferred the same free, is still in flight: the
        adapter cannot deliver that report (vLLM asserts `req_id in self.requests`)."""
        first, other = ("load", "save") if isinstance(op, Loaded) else ("save", "load")
        return (
            f"vLLM {self.s.version} freed {op.rid}'s blocks at its {first}'s report while its "
            f"{other} is in flight (the {other}'s report would assert: req_id in self.requests)"
        )

    def sync_load_failed(self, op: Loaded) -> Observation:
        """A sync load's failed blocks, reported with the output of the step that ran it:
        the cut of `op.rid` and of every other request whose computed tokens changed.
        Ended ('fail'): gone from vLLM, or kept while the connector saves it."""
        from .vllm_connector import invalid_output

        sched, requests = self.real.sched, self.s.requests
        scans = [*sched.kv_holding_waiting, *sched.running]
        before = {r.request_id: r.num_computed_tokens for r in scans}
        self.real.report_step(op.rid, invalid_output(op.invalid))
        own = requests[op.rid].num_computed_tokens
        others = tuple(
            sorted(
                (r.request_id, r.num_computed_tokens)
                for r in scans
                if r.request_id != op.rid and r.num_computed_tokens != before[r.request_id]
            )
        )
        return LoadCut(own, others, self.ended(op), self.real.take_dropped())

    def ended(self, op: Loaded) -> tuple[str, ...]:
        """The requests `op`'s report ended with an error ("fail"), in the order vLLM ended
        them: gone from vLLM, or kept while the connector saves one or its load is in flight."""
        sched, connector = self.real.sched, self.real.sched.connector
        ended = self.real.take_errored()
        for rid in ended:
            if rid in connector.deferred:
                self.held_by_save.add(rid)  # its save defers the free
            if rid in sched.requests:
                if rid in connector.loading:
                    self.held_by_load.add(rid)  # vLLM defers it until its load reports
                continue
            if rid in self.held_by_load | self.held_by_save:
                raise TargetCrash(
                    self.freed_early(op)
                    if rid == op.rid
                    else f"vLLM {self.s.version} freed {rid}'s blocks when {op.rid}'s failed load "
                    "ended it, while its save is in flight"
                )
            self.s.requests.pop(rid, None)
            self.names.forget(rid)
        return ended

    def finish(self, rid: str) -> Observation:
        """`Finish`: with a load in flight or a save (or both), vLLM defers the free
        (`model.machine.connector`): the request stays, so its table stays observed. A request
        the connector saves shows what it was handed (`Saving`)."""
        req, connector = self.s.requests[rid], self.real.sched.connector
        saves = connector is not None and rid in connector.saving
        self.real.finish(req)
        self.finished = req
        if rid in self.real.sched.requests:
            # Deferred by the connector (a save), by vLLM for the load in flight, or both.
            if rid in connector.deferred:
                self.held_by_save.add(rid)
            if rid in connector.loading or rid not in connector.deferred:
                self.held_by_load.add(rid)
        else:
            self.s.requests.pop(rid)
            self.names.forget(rid)
        return Saving(connector.handed[rid]) if saves else Done()


class SchedulerEventTranslator(EventTranslator):
    """Events published by `update_from_output`, then those still in the manager."""

    def __init__(self, session: Any, keys: Any, scheduler: RealStepScheduler) -> None:
        super().__init__(session, keys)
        self.scheduler = scheduler

    def drain(self) -> tuple[Any, ...]:
        return tuple(e for ev in self.scheduler.take_events() for e in self.translate(ev))


class VllmSchedulerTarget(VllmManagerTarget):
    """vLLM's real `Scheduler` driving its `KVCacheManager` (see the module docstring)."""

    name = "vllm"
    features = TargetFeatures(
        partial=True, fine_mamba=True, real_scheduler=True, connector=True, queues=True, engine_steps=True
    )
    # Mamba specs keep their draft blocks when the scheduler speculates (`vllm_scheduler_spec`);
    # False only in the tests' planted defect.
    speculative_blocks = True
    # Set by the constructor; the class defaults serve subclasses that build otherwise.
    engine_contract = True
    batch_caps: tuple[int, int] | None = None
    shadow_connector: ShadowConnector | None = None

    def __init__(
        self,
        config: Config,
        events: str = VLLM_EVENT_PROFILE,
        track_prefixes: bool = True,
        engine_contract: bool = True,
        batch_caps: tuple[int, int] | None = None,
    ) -> None:
        """`engine_contract=False` leaves the shadow worker and the queue checks out
        (the bench's baseline for what they cost); `batch_caps`: vLLM's
        (`max_num_batched_tokens`, `max_num_seqs`) for an engine loop that runs the
        scheduler as an engine core does (`engine_request`; gpu_check)."""
        self.vllm_scheduler: Any = None
        self.engine_contract = engine_contract
        self.batch_caps = batch_caps
        super().__init__(config, events, track_prefixes)
        self.steps = self.stepper(config)(self.session, self.names, self.vllm_scheduler, scheduler_modules())
        self.scheduler = self.steps
        self.driver = SchedulerOpDriver(self.session, self.names, self.steps)
        self.event_translator = SchedulerEventTranslator(self.session, self.keys, self.steps)
        self.reader = SnapshotReader(self.session, self.keys, self.event_translator)
        self.steps.shadow = self.shadow_worker()
        self.queue_checks = 0
        self.queue_found: list[tuple[str, str]] = []

    def stepper(self, config: Config) -> type[RealStepScheduler]:
        """The step driver: with lookahead slots the scheduler speculates (`vllm_scheduler_spec`).
        The engine decides every step whatever the configuration: one that states no budget
        (`Config.max_num_batched_tokens` 0) is built with `build_budget`'s."""
        return SpecStepScheduler if config.num_lookahead_tokens else RealStepScheduler

    def shadow_worker(self) -> ShadowWorker | None:
        """The shadow worker that follows this scheduler's outputs, as the model runner
        vLLM pairs with it (`use_v2_model_runner`), with a KV connector's side
        (`invariants.shadow.connector`) told what kvretain's connector is told; None
        without the engine contract (docs/shadow-worker.md)."""
        if not self.engine_contract:
            return None
        sched = self.vllm_scheduler
        groups = tuple(WorkerGroup(g.kind, g.block_size, g.sliding_window) for g in self.config.groups)
        worker = ShadowWorker(
            groups,
            runner="v2" if getattr(sched, "use_v2_model_runner", False) else "v1",
            zeroing=bool(getattr(sched, "needs_kv_cache_zeroing", False)),
            lookahead=int(getattr(sched, "num_hash_lookahead_tokens", 0)),
        )
        self.shadow_connector = None
        if sched.connector is not None:
            self.shadow_connector = ShadowConnector(worker, self.held_blocks)
            sched.connector.watch = self.shadow_connector
        return worker

    def held_blocks(self, rid: str) -> tuple[tuple[int, ...], ...] | None:
        """The blocks vLLM's scheduler holds for `rid`, per group (None: it holds no such request)."""
        sched = self.vllm_scheduler
        if rid not in sched.requests:
            return None
        return tuple(tuple(g) for g in sched.kv_cache_manager.get_block_ids(rid))

    def apply(self, op: Op) -> Observation:
        """The operation, then the scheduler's queues judged as it left them (`invariants.shadow.queues`)."""
        obs = super().apply(op)
        if not self.engine_contract:
            return obs
        if self.shadow_connector is not None:
            self.shadow_connector.check_held()
        status = self.session.v["RequestStatus"]
        self.queue_checks += 1
        self.queue_found += [
            (QUEUES, line)
            for line in queue_problems(
                self.vllm_scheduler, status.is_finished, status.RUNNING, status.PREEMPTED
            )
        ]
        return obs

    def engine_problems(self) -> list[tuple[str, str]]:
        found, self.queue_found = self.queue_found, []
        if self.steps.shadow is not None:
            found += self.steps.shadow.take_problems()
        return found

    def engine_settings(self) -> tuple[str, ...]:
        """vLLM's scheduler settings as built (`vllm_scheduler_build`), each against
        vLLM's default: what a user's deployment runs that this run did not."""
        sched = self.vllm_scheduler
        sc = sched.scheduler_config
        spec = sched.vllm_config.speculative_config
        runner = "V2" if getattr(sched, "use_v2_model_runner", False) else "V1"
        # Each line at most ~80 characters: the fuzz summary's feature table is as wide as its longest.
        lines = [
            f"model runner {runner} (vLLM's pick here; VLLM_USE_V2_MODEL_RUNNER=0: V1)",
            _setting("scheduler_reserve_full_isl", getattr(sc, "scheduler_reserve_full_isl", None), True),
            _setting("watermark", getattr(sc, "watermark", None), 0.0),
            _setting("policy", sc.policy, "fcfs"),
            self.batch_caps_setting(),
            "steps: vLLM's own, nothing written to the scheduler",
        ]
        if spec is not None and hasattr(spec, "disable_lookahead_block_hashes"):
            lines.append(
                _setting("disable_lookahead_block_hashes", spec.disable_lookahead_block_hashes, False)
            )
        if self.steps.shadow is None and self.engine_contract:
            lines.append("shadow worker off (async speculative positions: not followed yet)")
        if not sc.async_scheduling:
            lines.append("async_scheduling=False (vLLM's default: on; see vllm-async-scheduler)")
        return tuple(line for line in lines if line)

    def batch_caps_setting(self) -> str:
        """The batch caps as built: the engine's steps run under them."""
        sc = self.vllm_scheduler.scheduler_config
        budget = self.vllm_scheduler.max_num_scheduled_tokens
        if budget >= self.config.max_model_len:
            return f"max_num_seqs={sc.max_num_seqs}; no token budget binds (max_model_len)"
        return f"max_num_batched_tokens={budget} max_num_seqs={sc.max_num_seqs} (vLLM's: 2048 / 256)"

    def engine_figures(self) -> dict[str, int] | None:
        shadow = self.steps.shadow
        figures = {
            "queue checks": self.queue_checks,
            "steps whose queue order vLLM held otherwise": self.steps.reordered_steps,
        }
        if shadow is not None:
            f = shadow.figures
            figures |= {"worker steps": f.steps, "slots read": f.reads, "slots written": f.writes}
        if self.shadow_connector is not None:
            figures |= self.shadow_connector.take_figures()
        return figures

    def build_manager(self, config: Config, v: dict[str, Any], caps: Capabilities) -> Any:
        """The real scheduler's `KVCacheManager` (the scheduler is kept as `vllm_scheduler`)."""
        self.vllm_scheduler = build_scheduler(
            config,
            v,
            caps,
            self.version,
            speculative_blocks=self.speculative_blocks,
            batch_caps=self.batch_caps,
        )
        return self.vllm_scheduler.kv_cache_manager

    def runner_output(self, rids: list[str], sampled: list[list[int]]) -> Any:
        """The `ModelRunnerOutput` a model runner returns for a step of `rids`, with
        each one's sampled tokens (empty: a prefill chunk)."""
        return scheduler_modules()["ModelRunnerOutput"](
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)}, sampled_token_ids=sampled
        )

    def evicted_since(self) -> int:
        """How many cached blocks vLLM evicted since the last call (its `BlockRemoved`
        events), for an engine loop's figures; the events are consumed."""
        return sum(
            len(e.block_hashes) for e in self.steps.take_events() if type(e).__name__ == "BlockRemoved"
        )

    def unheld_unhashed_blocks(self) -> list[int]:
        """The blocks no request holds and no hash names (their KV may never be read
        again), for an engine loop that poisons them; the null block excluded."""
        return [
            b.block_id
            for b in self.session.pool.blocks
            if not b.is_null and b.ref_cnt == 0 and b.block_hash is None
        ]

    def engine_request(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> Any:
        """A vLLM `Request` for an engine loop that drives `vllm_scheduler` itself, as
        an engine core does (`add_request`, `schedule`, `update_from_output`): hashed
        as this target hashes, finishing after `max_tokens` sampled tokens."""
        req = self.driver.new_request(rid, prompt)
        req.sampling_params.max_tokens = max_tokens
        req.max_tokens = max_tokens
        return req


def _setting(name: str, value: object, default: object) -> str:
    """`name=value`, marked where it is not vLLM's default (empty where the release lacks it)."""
    if value is None:
        return ""
    return f"{name}={value}" + ("" if value == default else f" (not vLLM's default, {default})")
