"""A failed load's cut skips only the samples processed with its report (issue #38).

vLLM's `update_from_output` skips the output of a request `_handle_invalid_blocks` cuts in
the same call; a sample processed by an earlier call stands, and the model runner keeps it
(the V2 runner appends what it samples to its own `all_token_ids`), so the recompute step
reads it. The shadow worker skips a cut request's sample only when it was returned in the
processing that carried the report (`ShadowWorker.processed`, `fail_blocks`'s `output`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from invariants.shadow import POSITIONS, ShadowConnector, ShadowWorker, WorkerGroup
from invariants.targets.vllm_env import vllm_available

sys.path.insert(0, str(Path(__file__).parent))
from drive import Drive, patched  # noqa: E402
from test_shadow_connector import PROMPT8, checks, shadow, sync_step  # noqa: E402
from test_vllm_connector_spec import FULL  # noqa: E402

from model.contract.ops import AddRequest, Loaded, Offer, Sample, Step  # noqa: E402

FULL4 = (WorkerGroup("full", 4),)


def recompute(rid: str, scheduled: int) -> SimpleNamespace:
    """A step shipping cached `rid` cut to 0 computed, recomputing `scheduled` tokens."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid],
            resumed_req_ids=set(),
            all_token_ids={},
            num_computed_tokens=[0],
            new_block_ids=[None],
        ),
        num_scheduled_tokens={rid: scheduled},
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(),
        preempted_req_ids=set(),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=None,
    )


def cut_after_sample(processed_between: bool, scheduled: int) -> list[str]:
    """`a` loads 8 tokens (blocks 1, 2), computes its 9th and is sampled; a report fails
    block 1 (with the sample, or after its processing); a step recomputes `scheduled`."""
    w, c = shadow()
    sync_step(c, "a", 8, 8, [1, 2, 3])
    w.returned("a", [7])
    if processed_between:
        w.processed()
    c.reported((), (), (1,), ())
    w.processed()
    w.execute(recompute("a", scheduled))
    return checks(w)


def test_a_cut_skips_the_sample_processed_with_its_report_and_keeps_an_earlier_one() -> None:
    # Processed with the report: vLLM skips the sample, so the recompute covers the 9 prompt tokens.
    assert cut_after_sample(False, 9) == []
    assert cut_after_sample(False, 10) == [POSITIONS]  # control: a token the worker dropped
    # Processed before the report: the sample stands and the recompute covers it too.
    assert cut_after_sample(True, 10) == []
    assert cut_after_sample(True, 11) == [POSITIONS]  # control: one token past what it knows


def test_worker_keeps_its_sample_across_a_report_it_was_not_part_of() -> None:
    """The connector captures the processing at the report, not when its action runs."""
    w = ShadowWorker(FULL4)
    c = ShadowConnector(w, lambda rid: None)
    sync_step(c, "a", 8, 8, [1, 2, 3])
    w.returned("a", [7])
    w.processed()
    c.reported((), (), (1,), ())
    assert len(w.own_ids("a")) == len(PROMPT8) + 1


# ---------------------------------------------------------------------- on vLLM's real scheduler

_OK, _REASON = vllm_available()
vllm_only = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

R1 = (*range(1, 9), 20, 21, 22, 23, 24)
# FULL (2 drafts): r0 decodes beside r1's async load and is sampled (10, processed at once);
# r1's load then fails on block 1, r0's first block too, which cuts r0 to 0; r0 recomputes
# positions [0, 10), token 10 among them.
TRACE = (
    AddRequest("r0", tuple(range(1, 9))),
    Step(("r0",), 64),
    Sample("r0", 9),
    AddRequest("r1", R1),
    Offer("r1", 12, "async"),
    Step(("r0", "r1"), 64),
    Sample("r0", 10),
    Loaded("r1", True, (1,)),
    AddRequest("r2", (5,)),
    Step(("r0", "r1", "r2"), 64),
)


def shadow_found() -> list[str]:
    return [v.check for v in Drive(FULL).attempt(*TRACE).audited()]


@vllm_only
def test_a_sample_processed_before_a_cutting_report_stands_on_vllm() -> None:
    assert shadow_found() == []


@vllm_only
def test_a_worker_missing_that_sample_is_reported_on_vllm() -> None:
    """Controls: a worker dropping r0's second sample, and one that treats every sample as
    processed with the report (the false positive of issue #38), both miss token 10."""
    returned = ShadowWorker.returned

    def drops(self: ShadowWorker, rid: str, tokens: Any) -> None:
        returned(self, rid, [] if list(tokens) == [10] else tokens)

    with patched(ShadowWorker, "returned", drops):
        assert POSITIONS in shadow_found()
    with patched(ShadowWorker, "processed", lambda self: None):
        assert POSITIONS in shadow_found()
