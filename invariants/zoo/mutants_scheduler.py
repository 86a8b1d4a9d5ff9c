"""Mutants of vLLM 0.33.0's `Scheduler` (`vllm/v1/core/sched/scheduler.py`), for the
"vllm-scheduler" target: monkeypatches inside a context manager, as
`mutants_vllm` patches the allocator.

Each re-creates a plausible one-line defect of the scheduler loop that only a
target driven by the real scheduler can meet (the "vllm" target re-creates the
scheduler's calls itself, so a defect in `scheduler.py` is invisible to it).
`activate(name)` patches `Scheduler`, yields the `VllmSchedulerTarget` factory
and restores every original on exit. PROCESS-GLOBAL WHILE ACTIVE: every vLLM
scheduler built in this process meanwhile is mutated.

Strategies: "scheduler" (generated configurations without speculative
decoding, which the target does not judge yet) and "scheduler-mamba" (the
same, Full+Mamba shapes only).
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


# ---------------------------------------------------------------- KV connector glue (model.connector)


@mutant("async_load_cached_at_admission", strategy="scheduler-connector")
def async_load_cached_at_admission(stack: contextlib.ExitStack, sched: Any) -> None:
    """Delayed caching lost: the waiting pass calls `allocate_slots(...,
    delay_cache_blocks=False)` for an async KV load, so its blocks are cached before
    the load has written them."""
    original = vars(sched)["schedule"]

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def eager(request: Any, *a: Any, **k: Any) -> Any:
            k["delay_cache_blocks"] = False
            return allocate(request, *a, **k)

        manager.allocate_slots = eager
        try:
            return original(self, *args, **kwargs)
        finally:
            manager.allocate_slots = allocate

    _set(stack, sched, "schedule", schedule)


@mutant("failed_load_keeps_computed_tokens", strategy="scheduler-connector")
def failed_load_keeps_computed_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_handle_failed_recving` forgets `request.num_computed_tokens = 0` under the
    "recompute" policy: the promotion caches the failed load's blocks as valid KV."""
    original = vars(sched)["_handle_failed_recving"]

    def handle(self: Any, failed_req_ids: set[str]) -> Any:
        computed = {r: self.requests[r].num_computed_tokens for r in failed_req_ids if r in self.requests}
        out = original(self, failed_req_ids)
        for rid, n in computed.items():
            self.requests[rid].num_computed_tokens = n
        return out

    _set(stack, sched, "_handle_failed_recving", handle)


@mutant("loading_request_freed_at_finish", strategy="scheduler-connector")
def loading_request_freed_at_finish(stack: contextlib.ExitStack, sched: Any) -> None:
    """`finish_requests` sets `delay_free_blocks = False` for a request in
    WAITING_FOR_REMOTE_KVS: the blocks an in-flight load writes go back to the pool."""
    original = vars(sched)["finish_requests"]

    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        out = original(self, request_ids, finished_status)
        for request in out:
            if self.requests.get(request.request_id) is request:  # its free was deferred
                self._free_blocks(request)
        return out

    _set(stack, sched, "finish_requests", finish_requests)


@mutant("async_load_ignores_in_flight_reserve", strategy="scheduler-connector")
def async_load_ignores_in_flight_reserve(stack: contextlib.ExitStack, sched: Any) -> None:
    """An async KV load is admitted on the whole free pool (`reserved_blocks=0`), taking
    the blocks the prefills already in flight still need
    (`_inflight_prefill_reserved_blocks` left out)."""
    _set(stack, sched, "_inflight_prefill_reserved_blocks", lambda self: 0)
