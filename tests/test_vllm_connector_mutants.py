"""Negative controls of the connector checks: each connector mutant of vLLM's scheduler
(`invariants.zoo.mutants_scheduler`) is caught on a trace the unmutated scheduler passes,
on engine steps (each names every request vLLM holds; chunks come from the configuration
built), and every one of them is in the zoo."""

from __future__ import annotations

import pytest
from drive import Drive
from test_vllm_connector import (
    FULL,
    FULL_SWA,
    SHARED_CUT,
    SYNC_CUT,
    invalid_ops,
    needs_vllm,
    reserve_trace,
    save_ops,
    shared_invalid_ops,
    sync_invalid_ops,
    trace_ops,
)

CONNECTOR_MUTANTS = (
    "async_load_cached_at_admission",
    "failed_load_keeps_computed_tokens",
    "loading_request_freed_at_finish",
    "async_load_ignores_in_flight_reserve",
    "save_free_not_deferred",
    "saved_blocks_cover_prompt_only",
    "invalid_block_cut_keeps_failed_block",
    "invalid_blocks_policy_inverted",
    "admission_counts_external_as_local",
    "sync_fail_evicts_failed_blocks_only",
    "sync_invalid_scan_keeps_step_tokens",
    "shared_failed_block_running_not_scanned",
)


@needs_vllm
@pytest.mark.vllm
def test_every_connector_mutant_is_in_the_zoo() -> None:
    # The queue mutants and the failed-block scan-order ones (hunted on one group) have their traces there.
    from test_vllm_connector_holders import FAIL_MUTANTS, HOLDER_MUTANTS
    from test_vllm_scheduler_queues import QUEUE_TRACES

    from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS

    def hunted_with(strategy: str) -> set[str]:
        return {n for n, m in SCHEDULER_MUTANTS.items() if m.strategy == strategy}

    assert hunted_with("scheduler-connector") == set(CONNECTOR_MUTANTS)
    one_group = hunted_with("scheduler-connector-one-group")
    assert one_group and one_group <= set(QUEUE_TRACES) | set(HOLDER_MUTANTS) | set(FAIL_MUTANTS)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", CONNECTOR_MUTANTS)
def test_connector_mutant_is_caught(name: str) -> None:
    """Negative controls: each connector mutant of vLLM's scheduler is caught on a
    trace the unmutated scheduler passes."""
    from invariants.zoo.mutants_scheduler import activate

    reserve = SHARED_CUT.with_(num_blocks=9)  # r0's first chunk in flight beside r1's load
    cfg, ops = (reserve, reserve_trace()) if "reserve" in name else (FULL_SWA, trace_ops())
    if "save" in name:
        ops = save_ops()
    if "invalid" in name:
        cfg, ops = FULL, invalid_ops()
    if name.startswith("shared_"):
        cfg, ops = SHARED_CUT, shared_invalid_ops()
    if name.startswith("sync_"):
        policy = "fail" if "fail" in name else "recompute"
        built = SYNC_CUT if policy == "recompute" else FULL  # the configurations vLLM passes them on
        cfg, ops = built.with_(kv_load_failure_policy=policy), sync_invalid_ops(policy)  # type: ignore[arg-type]

    # `attempt`: the mutant may change a request's state under the trace (invalid).
    assert Drive(cfg).attempt(*ops).found == []
    with activate(name) as factory:
        assert Drive(cfg, factory).attempt(*ops).found != []
