"""Mutants of vLLM 0.33.0's fenced block frees, which only the `AsyncScheduler` with a
consumer KV connector runs (`model.machine.async_scheduling`, 6), registered with the other
async-scheduler mutants (`mutants_scheduler.ASYNC_SCHEDULER_MUTANTS`, which imports this
module) and run on the "vllm-async-scheduler" target with kvretain's connector.

Each is a one-line `_rewrite_inherited` of vLLM's own `Scheduler` method, patched on
`AsyncScheduler` only: the fence a request's free waits for, and when the fenced frees
come back.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .mutants_scheduler import _rewrite_inherited, async_mutant


@async_mutant("fence_on_scheduled_step", strategy="scheduler-connector")
def fence_on_scheduled_step(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_request_blocks_can_be_freed` compares a request's last step with the steps
    scheduled (`self.sched_step_seq`) instead of those processed (`processed_step_seq`):
    every free is direct, so a finished or preempted request's blocks return to the pool
    while the step in flight still writes them (the race the fence exists for)."""
    _rewrite_inherited(
        stack,
        sched,
        "_request_blocks_can_be_freed",
        "request.last_sched_seq <= self.processed_step_seq",
        "request.last_sched_seq <= self.sched_step_seq",
    )


@async_mutant("fenced_frees_one_step_late", strategy="scheduler-connector")
def fenced_frees_one_step_late(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_drain_deferred_frees` stops at a fence the processed steps have reached
    (`fence >= self.processed_step_seq` for `>`): fenced blocks come back one step output
    later than safe, so the next steps find the pool short and refuse or preempt."""
    _rewrite_inherited(
        stack,
        sched,
        "_drain_deferred_frees",
        "if fence > self.processed_step_seq:",
        "if fence >= self.processed_step_seq:",
    )
