"""Mutants of the failed-block cut in vLLM 0.33.0's `Scheduler` (`invalid_block_ids`:
a KV connector's load failed on some blocks; `model.machine.connector`), registered with the
other scheduler mutants (`mutants_scheduler.SCHEDULER_MUTANTS`, which imports this module).

Each is a one-line `_rewrite` of vLLM's own method: where a request is cut, which
policy ends it, which blocks "fail" evicts, which tokens the scan counts as computed,
which queues it scans and whom it names as affected. The scan order's own mutants are
with the queue order (`mutants_queues`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .mutants_scheduler import _rewrite, mutant


@mutant("invalid_block_cut_keeps_failed_block", strategy="scheduler-connector")
def invalid_block_cut_keeps_failed_block(stack: contextlib.ExitStack, sched: Any) -> None:
    """A load failed on some blocks: `_update_requests_with_invalid_blocks` cuts the computed
    tokens at the END of the first failed block (`(idx + 1) * self.block_size`), so that
    block's unloaded KV counts as computed (and is cached at promotion)."""
    _rewrite(
        stack,
        sched,
        "_update_requests_with_invalid_blocks",
        "request.num_computed_tokens = idx * self.block_size",
        "request.num_computed_tokens = (idx + 1) * self.block_size",
    )


@mutant("invalid_blocks_policy_inverted", strategy="scheduler-connector")
def invalid_blocks_policy_inverted(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_handle_invalid_blocks` reads the failure policy backwards
    (`should_fail = self.recompute_kv_load_failures`): under "recompute" a load failed on
    some blocks ends its request with an error, under "fail" the request is resumed."""
    _rewrite(
        stack,
        sched,
        "_handle_invalid_blocks",
        "should_fail = not self.recompute_kv_load_failures",
        "should_fail = self.recompute_kv_load_failures",
    )


@mutant("sync_fail_evicts_failed_blocks_only", strategy="scheduler-connector")
def sync_fail_evicts_failed_blocks_only(stack: contextlib.ExitStack, sched: Any) -> None:
    """A sync load failed on some blocks, "fail" policy: `_update_requests_with_invalid_blocks`
    collects only the failed block for eviction (`blocks_to_evict.add(block_id)`), not the
    blocks after it, whose cached KV was computed on the failed one: a later request hits
    them (through their hashes, once the failed block is recomputed and cached again)."""
    _rewrite(
        stack,
        sched,
        "_update_requests_with_invalid_blocks",
        "blocks_to_evict.update(req_block_ids[idx:])",
        "blocks_to_evict.add(block_id)",
    )


@mutant("sync_invalid_scan_keeps_step_tokens", strategy="scheduler-connector")
def sync_invalid_scan_keeps_step_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """A sync load's failed blocks, reported with its step's output: `_update_requests_with_invalid_blocks`
    forgets to take the step's scheduled tokens off (`req_num_computed_tokens =
    request.num_computed_tokens`), so a request whose failed blocks another one recomputes
    keeps the chunk the step computed on them instead of going back to its hit."""
    _rewrite(
        stack,
        sched,
        "_update_requests_with_invalid_blocks",
        "request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)",
        "request.num_computed_tokens",
    )


@mutant("shared_failed_block_running_not_scanned", strategy="scheduler-connector")
def shared_failed_block_running_not_scanned(stack: contextlib.ExitStack, sched: Any) -> None:
    """Failed blocks (`invalid_block_ids`): `_handle_invalid_blocks` scans the async loads
    only, not `self.running`, so a running request holding a failed block (by a prefix
    hit, or its own sync load) keeps the tokens computed on it."""
    _rewrite(
        stack,
        sched,
        "_handle_invalid_blocks",
        "self.running, invalid_block_ids, num_scheduled_tokens, evict_blocks=True",
        "(), invalid_block_ids, num_scheduled_tokens, evict_blocks=True",
    )


@mutant("fail_spares_holder_of_marked_blocks", strategy="scheduler-connector-one-group")
def fail_spares_holder_of_marked_blocks(stack: contextlib.ExitStack, sched: Any) -> None:
    """Failed blocks under "fail": `_update_requests_with_invalid_blocks` names as affected
    only the requests that marked a failed block themselves, so one whose failed blocks an
    earlier request marked is not ended: it runs on with KV never loaded (its hashes are
    evicted, its table keeps the block)."""
    _rewrite(
        stack,
        sched,
        "_update_requests_with_invalid_blocks",
        "affected_req_ids.add(request.request_id)",
        "affected_req_ids.update((request.request_id,) if marked_invalid_block else ())",
    )
