"""The model's async-scheduling rules (`model.machine.async_scheduling`), without vLLM.

With `async_scheduling` a sampled token reaches the scheduler after the next
step is scheduled: allocation caches only known tokens, the token's arrival
caches what the processed steps computed, and windows free on processed
tokens. Each test compares the async model with the synchronous one on the
same trace, so each rule is seen to change what the model predicts (the
vLLM-driven controls are in tests/test_vllm_async_scheduler.py).
"""

from __future__ import annotations

from invariants.harness.observer import ModelObserver
from model.contract.config import Config, GroupSpec
from model.contract.observation import BlockStored
from model.contract.ops import AddRequest, Op, Preempt, Sample, Step
from model.machine.allocator import AllocatorModel
from model.machine.async_scheduling import (
    InFlight,
    arrival_limit,
    caching_limit,
    draft_slots,
    processed_limit,
    scheduler_position,
)

FULL = Config(groups=(GroupSpec("full", 2),), num_blocks=16)
FULL_SWA = Config(groups=(GroupSpec("full", 2), GroupSpec("swa", 2, sliding_window=2)), num_blocks=24)
R1 = ("r1",)


def stored_blocks_after_each_op(cfg: Config, ops: list[Op], async_scheduling: bool) -> list[int]:
    """How many blocks entered the hash map at each operation."""
    m = AllocatorModel(cfg, async_scheduling=async_scheduling)
    counts = []
    for op in ops:
        m.apply(op)
        counts.append(sum(len(e.block_hashes) for e in m.snapshot().events if isinstance(e, BlockStored)))
    return counts


def test_the_limits() -> None:
    assert caching_limit(3, 1, 4, 0) == 4
    assert caching_limit(3, 1, 4, 1) == 3  # the in-flight token is not known yet
    assert caching_limit(3, 3, 7, 3) == 4  # nor are the two accepted drafts riding with it
    assert arrival_limit(5, 1) == 4
    assert processed_limit(5, 1) == 4 and processed_limit(1, 3) == 0


def test_in_flight_tokens_arrive_after_the_next_step() -> None:
    f = InFlight()
    f.scheduled({"r1": 3})
    assert f.sampled("r1") and f.in_flight("r1")  # rides on the latest step's output
    assert f.unprocessed("r1") == 3
    assert f.scheduled({"r1": 1, "r2": 2}) == ([("r1", 1)], [])  # it arrives; r1 had 1 token scheduled since
    assert not f.in_flight("r1") and f.unprocessed("r2") == 2
    f.scheduled({"r2": 1})
    assert f.sampled("r2", accepted=1, rejected=2)
    assert (f.unknown("r2"), f.unrolled("r2")) == (2, 2)  # two tokens ride, two drafts to roll back
    assert (f.unknown("r1"), f.unrolled("r1")) == (0, 0)
    assert not f.sampled("r1")  # r1 sat out the last step: its token arrives at once
    f.sampled("r2")
    f.forget("r2")  # preempted or finished: nothing arrives
    assert f.scheduled({}) == ([], [])


def test_drafts_fill_k_slots_and_a_rejection_counts_until_it_arrives() -> None:
    assert draft_slots((7,), 3) == (7, -1, -1) and draft_slots((), 2) == (-1, -1)
    assert scheduler_position(5, 2) == 7


def test_an_async_step_allocates_from_the_optimistic_position() -> None:
    """k = 2 on one 2-token block group: r1's sample rejects both drafts (the step
    verified 3 positions), and the next step, scheduled before that rejection is
    known, allocates for 2 more positions than the synchronous scheduler would."""
    cfg = FULL.with_(num_lookahead_tokens=2, num_blocks=32)
    ops: list[Op] = [
        AddRequest("r1", (1, 2, 3)),
        Step(R1, 8),
        Sample("r1", 4, 0, (5, 6)),
        Step(R1, 8),
        Sample("r1", 7, 0, (8, 9)),
        Step(R1, 8),
    ]
    tables = []
    for async_scheduling in (False, True):
        m = AllocatorModel(cfg, num_spec_tokens=2, async_scheduling=async_scheduling)
        for op in ops:
            m.apply(op)
        tables.append(len(m.snapshot().tables["r1"][0]))
    # sync: 4 computed + 3 + 2 lookahead = 9 slots (5 blocks); async: + the 2 unrolled drafts (6 blocks).
    assert tables == [5, 6]


# r1 decodes position 3 before its token is known, then sits out r2's step, so its step-2
# output is held until its Sample (tests/test_vllm_async_scheduler.py drives it through vLLM).
HELD: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(R1, 8),
    Sample("r1", 4),
    Step(R1, 8),
    AddRequest("r2", (7,)),
    Step(("r2",), 8),
    Sample("r1", 5),
]


def test_a_token_sampled_ahead_is_cached_when_it_arrives() -> None:
    """On `HELD`, the block [2, 4) is cached when r1's token arrives (the Sample), not at step 2."""
    sync = stored_blocks_after_each_op(FULL, HELD, async_scheduling=False)
    asyn = stored_blocks_after_each_op(FULL, HELD, async_scheduling=True)
    assert sync == [0, 1, 0, 1, 0, 0, 0]
    assert asyn == [0, 1, 0, 0, 0, 0, 1]


def test_a_window_lets_go_one_step_later() -> None:
    """With a 2-token window, decoding frees the block that left it one step later
    under async scheduling (the previous step's tokens are still in flight)."""
    ops: list[Op] = [
        AddRequest("r1", (1, 2, 3, 4, 5)),
        Step(R1, 8),
        Sample("r1", 6),
        Step(R1, 8),
        Sample("r1", 7),
        Step(R1, 8),
    ]
    tables = {}
    for async_scheduling in (False, True):
        m = AllocatorModel(FULL_SWA, async_scheduling=async_scheduling)
        seen = []
        for op in ops:
            m.apply(op)
            if isinstance(op, Step):
                seen.append(m.snapshot().tables["r1"][1])
        tables[async_scheduling] = seen
    # After step 2 the synchronous model freed the blocks below the window; the async one
    # still holds them (step 1's tokens are unprocessed), and frees them at step 3.
    assert [sum(b != 0 for b in t) for t in tables[False]] == [3, 1, 2]
    assert [sum(b != 0 for b in t) for t in tables[True]] == [3, 3, 2]


def test_a_preempted_request_caches_nothing_when_its_token_arrives() -> None:
    ops: list[Op] = [
        AddRequest("r1", (1, 2, 3)),
        Step(R1, 8),
        Sample("r1", 4),
        Step(R1, 8),
        Sample("r1", 5),
        Preempt("r1"),
        AddRequest("r2", (9,)),
        Step(("r2",), 8),
    ]
    m = AllocatorModel(FULL, async_scheduling=True, observer=(m_seen := ModelObserver()))
    for op in ops:
        m.apply(op)
    assert m.in_flight is not None and not m.in_flight.in_flight("r1")
    assert m_seen.coverage["async: a sampled token's arrival cached blocks"] == 0
