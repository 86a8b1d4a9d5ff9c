"""Mutants of vLLM 0.33.0's `Scheduler` (`vllm/v1/core/sched/scheduler.py`), for the
"vllm-scheduler" target: monkeypatches inside a context manager, as
`mutants_vllm` patches the allocator.

Each re-creates a plausible one-line defect of the scheduler loop that only a
target driven by the real scheduler can meet (the "vllm" target re-creates the
scheduler's calls itself, so a defect in `scheduler.py` is invisible to it).
`activate(name)` patches `Scheduler`, yields the `VllmSchedulerTarget` factory
and restores every original on exit. PROCESS-GLOBAL WHILE ACTIVE: every vLLM
scheduler built in this process meanwhile is mutated.

Strategies: "scheduler" (the configurations the fuzzer generates for a real
scheduler), "scheduler-mamba" (Full+Mamba shapes only) and "scheduler-spec"
(speculative decoding: drafts, accepted counts, one-token admission padding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from invariants.targets.base import Target
from model.config import Config

from .mutants_vllm import _set

Factory = Callable[[Config], Target]


@dataclass(frozen=True)
class SchedulerMutant:
    name: str
    doc: str
    install: Callable[[contextlib.ExitStack, Any], None]
    strategy: str = "scheduler"

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0]


SCHEDULER_MUTANTS: dict[str, SchedulerMutant] = {}


def mutant(
    name: str, *, strategy: str = "scheduler"
) -> Callable[[Callable[[contextlib.ExitStack, Any], None]], Any]:
    def deco(fn: Callable[[contextlib.ExitStack, Any], None]) -> Callable[[contextlib.ExitStack, Any], None]:
        SCHEDULER_MUTANTS[name] = SchedulerMutant(name, fn.__doc__ or "", fn, strategy)
        return fn

    return deco


@contextlib.contextmanager
def activate(name: str) -> Iterator[Factory]:
    """Apply scheduler mutant `name` until exit; yields the vllm-scheduler target factory."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    m = SCHEDULER_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        m.install(stack, Scheduler)
        yield VllmSchedulerTarget


@mutant("mamba_split_skipped", strategy="scheduler-mamba")
def mamba_split_skipped(stack: contextlib.ExitStack, sched: Any) -> None:
    """Prefill chunks are not split at Mamba block boundaries (`_mamba_block_aligned_split`
    returns the chunk unchanged, as if `need_mamba_block_aligned_split` were False)."""
    _set(stack, sched, "_mamba_block_aligned_split", lambda self, request, n, *a, **k: n)


@mutant("preempt_keeps_computed_tokens")
def preempt_keeps_computed_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_preempt_request` frees the blocks but forgets `request.num_computed_tokens = 0`."""
    original = vars(sched)["_preempt_request"]

    def keeps(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        computed = request.num_computed_tokens
        original(self, request, *args, **kwargs)
        request.num_computed_tokens = computed

    _set(stack, sched, "_preempt_request", keeps)


@mutant("preempt_oldest")
def preempt_oldest(stack: contextlib.ExitStack, sched: Any) -> None:
    """FCFS preemption pops the oldest running request (`self.running.pop(0)`) instead of
    the newest (`self.running.pop()`)."""
    original = vars(sched)["schedule"]

    class OldestFirst(list):  # type: ignore[type-arg]
        def pop(self, index: int = 0) -> Any:  # type: ignore[override]
            return super().pop(index)

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.running = OldestFirst(self.running)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.running = list(self.running)

    _set(stack, sched, "schedule", schedule)


@mutant("in_flight_tokens_not_settled")
def in_flight_tokens_not_settled(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` forgets `request.num_in_flight_tokens -= num_tokens_scheduled`:
    sliding-window blocks are freed on a processed-token count that never advances."""
    original = vars(sched)["update_from_output"]

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        before = {
            rid: self.requests[rid].num_in_flight_tokens
            for rid in scheduler_output.num_scheduled_tokens
            if rid in self.requests
        }
        out = original(self, scheduler_output, model_runner_output)
        for rid, n in before.items():
            if rid in self.requests:
                self.requests[rid].num_in_flight_tokens = n
        return out

    _set(stack, sched, "update_from_output", update_from_output)


@mutant("mamba_split_ignores_hit", strategy="scheduler-mamba")
def mamba_split_ignores_hit(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass's Mamba split starts at 0 instead of after the prefix-cache hit
    (`num_new_local_computed_tokens` not passed to `_mamba_block_aligned_split`)."""
    original = vars(sched)["_mamba_block_aligned_split"]

    def split(
        self: Any, request: Any, n: int, num_new_local_computed_tokens: int = 0, *a: Any, **k: Any
    ) -> int:
        return int(original(self, request, n, 0, *a, **k))

    _set(stack, sched, "_mamba_block_aligned_split", split)


# Speculative decoding (`model.spec_decode`): strategy "scheduler-spec", Full/SWA shapes with drafts.


@mutant("admission_without_lookahead", strategy="scheduler-spec")
def admission_without_lookahead(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass reserves no lookahead slots for drafts: `limit_lookahead_tokens =
    self.num_lookahead_tokens > 0` (the `load_kv_async and` dropped), so every admission's
    `allocate_slots` gets `num_lookahead_tokens=0`."""
    original = vars(sched)["schedule"]

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def admission_without(request: Any, *a: Any, **k: Any) -> Any:
            if "new_computed_blocks" in k:  # only the waiting pass passes its hit
                k["num_lookahead_tokens"] = 0
            return allocate(request, *a, **k)

        manager.allocate_slots = admission_without
        try:
            return original(self, *args, **kwargs)
        finally:
            manager.allocate_slots = allocate

    _set(stack, sched, "schedule", schedule)


@mutant("rejected_drafts_not_rolled_back", strategy="scheduler-spec")
def rejected_drafts_not_rolled_back(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` forgets `request.num_computed_tokens -= num_rejected`: a rejected
    draft's position counts as computed, so the next step starts one draft too far."""
    original = vars(sched)["update_from_output"]

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        from dataclasses import replace

        # Without the verified drafts the rejection branch, the rollback's only home, never runs.
        blind = replace(scheduler_output, scheduled_spec_decode_tokens={})
        return original(self, blind, model_runner_output)

    _set(stack, sched, "update_from_output", update_from_output)


# ------------------------------------------------------------------ AsyncScheduler (vllm-async-scheduler)
# Mutants of the async path, run on the "vllm-async-scheduler" target: each patches
# `AsyncScheduler` (vLLM's subclass; the synchronous `Scheduler` is untouched) and
# `activate_async` yields that target's factory.
ASYNC_SCHEDULER_MUTANTS: dict[str, SchedulerMutant] = {}


def async_mutant(
    name: str, *, strategy: str = "scheduler"
) -> Callable[[Callable[[contextlib.ExitStack, Any], None]], Any]:
    def deco(fn: Callable[[contextlib.ExitStack, Any], None]) -> Callable[[contextlib.ExitStack, Any], None]:
        ASYNC_SCHEDULER_MUTANTS[name] = SchedulerMutant(name, fn.__doc__ or "", fn, strategy)
        return fn

    return deco


@contextlib.contextmanager
def activate_async(name: str) -> Iterator[Factory]:
    """Apply async-scheduler mutant `name` until exit; yields the vllm-async-scheduler target factory."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget

    m = ASYNC_SCHEDULER_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        m.install(stack, AsyncScheduler)
        yield VllmAsyncSchedulerTarget


@async_mutant("arrival_caches_in_flight_tokens")
def arrival_caches_in_flight_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` caches a request with output placeholders up to
    `request.num_computed_tokens` instead of `num_computed_tokens - num_in_flight_tokens`:
    a block is cached while the step that writes its last token is still in flight."""
    original = sched.update_from_output

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        manager = self.kv_cache_manager
        own = vars(manager).get("cache_blocks")
        cache_blocks = manager.cache_blocks
        manager.cache_blocks = lambda request, n: cache_blocks(request, request.num_computed_tokens)
        try:
            return original(self, scheduler_output, model_runner_output)
        finally:
            if own is None:
                del manager.cache_blocks  # the class's method again
            else:
                manager.cache_blocks = own

    _set(stack, sched, "update_from_output", update_from_output)
