"""Mutants of the order vLLM 0.33.0's `Scheduler.schedule` leaves its queues in
(`model.policy.queues`; judged through `StepResult.queues`), registered with the other
scheduler mutants (`mutants_scheduler.SCHEDULER_MUTANTS`, which imports this module).

Each is a one-line `_rewrite` of vLLM's own method: where a preempted request
waits, and where and in which order a request the waiting pass skipped comes back;
and the order the failed-block cut reads the queues in (`model.machine.connector`: of the
requests holding a failed block the first in scan order marks it and is cut there;
judged through `LoadCut`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .mutants_scheduler import _rewrite, mutant


@mutant("preempted_to_queue_back")
def preempted_to_queue_back(stack: contextlib.ExitStack, sched: Any) -> None:
    """Preemption: `_preempt_request` puts the preempted request at the back of `waiting`
    (`self.waiting.add_request(request)`) instead of its front, so it waits behind the
    requests that arrived after it (FCFS lost for every preempted request)."""
    _rewrite(
        stack,
        sched,
        "_preempt_request",
        "self.waiting.prepend_request(request)",
        "self.waiting.add_request(request)",
    )


@mutant("skipped_holding_reversed", strategy="scheduler-connector-one-group")
def skipped_holding_reversed(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass's skip: `skip_request` appends a request holding blocks to
    `step_skipped_kv_holding` (`append` for `appendleft`), so `prepend_requests` puts the
    skipped requests back in reverse order: two async loads swap places every step."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "step_skipped_kv_holding.appendleft(request_to_skip)",
        "step_skipped_kv_holding.append(request_to_skip)",
    )


@mutant("skipped_holding_to_waiting", strategy="scheduler-connector-one-group")
def skipped_holding_to_waiting(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass's skip: the skipped requests holding blocks (async loads) go back
    to `waiting` (`self.waiting.prepend_requests(step_skipped_kv_holding)`) instead of
    `kv_holding_waiting`, so they are no longer drained before the other waiting requests."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "self.kv_holding_waiting.prepend_requests(step_skipped_kv_holding)",
        "self.waiting.prepend_requests(step_skipped_kv_holding)",
    )


@mutant("invalid_scan_running_reversed", strategy="scheduler-connector-one-group")
def invalid_scan_running_reversed(stack: contextlib.ExitStack, sched: Any) -> None:
    """Failed blocks (`invalid_block_ids`): `_handle_invalid_blocks` scans `running` back
    to front (`reversed(self.running)`), so of several running requests holding a failed
    block the last one marks it and is cut there, and the first keeps it as computed
    (`model.machine.connector`: the first in queue order marks it)."""
    _rewrite(
        stack,
        sched,
        "_handle_invalid_blocks",
        "self.running, invalid_block_ids, num_scheduled_tokens, evict_blocks=True",
        "reversed(self.running), invalid_block_ids, num_scheduled_tokens, evict_blocks=True",
    )


@mutant("invalid_block_marks_ignored", strategy="scheduler-connector-one-group")
def invalid_block_marks_ignored(stack: contextlib.ExitStack, sched: Any) -> None:
    """Failed blocks: `_update_requests_with_invalid_blocks` ignores the blocks an earlier
    request marked (`if False:` for `if block_id in marked_invalid_block_ids:`), so every
    request holding a failed block is cut at it, not only the first in scan order."""
    _rewrite(
        stack,
        sched,
        "_update_requests_with_invalid_blocks",
        "if block_id in marked_invalid_block_ids:",
        "if False:",
    )
