"""The vllm-scheduler target's reach: the scheduler mutants of each scheduler decision
(chunking under the budget, admission with a hit, preemption and replay, the block
tables a step ships), the shipped-table observation that catches the last, the
export of a vllm-scheduler finding, the production bench and the release matrix's
scheduler capability.

Negative controls: each mutant below is caught on a trace the unmutated scheduler
passes; the shipped-table reading flags a table that is not the allocation; a
source mutant whose line vLLM no longer has fails loudly. Skipped, with the reason,
when vLLM cannot be imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

if not vllm_available():  # pragma: no cover - depends on the environment
    pytest.skip("vLLM is not importable", allow_module_level=True)

from test_vllm_scheduler import Drive  # noqa: E402

from invariants.targets.vllm_scheduler_drive import shipped_admission  # noqa: E402
from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget  # noqa: E402
from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS, StaleMutant, _rewrite, activate  # noqa: E402
from model.config import Config, GroupSpec  # noqa: E402
from model.ops import AddRequest, Preempt, Step  # noqa: E402

pytestmark = pytest.mark.vllm

Factory = type[VllmSchedulerTarget]
FULL_SWA_SWA = Config(
    groups=(
        GroupSpec("full", 4),
        GroupSpec("swa", 8, sliding_window=18),
        GroupSpec("swa", 2, sliding_window=3),
    ),
    num_blocks=22,
    retention_interval=None,
    max_model_len=4096,
)
FULL2 = Config(groups=(GroupSpec("full", 2),), num_blocks=12, enable_caching=False, max_model_len=4096)
PROMPT8 = (1, 2, 2, 3, 1, 1, 1, 3)


def budget_trace(f: Factory) -> Drive:
    """Chunking under the budget: a step of 64 tokens over three Mamba prompts; the last
    one is left less than a Mamba block of it, so it must wait for an aligned chunk."""
    cfg = Config(
        groups=(GroupSpec("full", 16), GroupSpec("mamba", 8)),
        num_blocks=20,
        retention_interval=48,
        max_model_len=4096,
    )
    long = (*PROMPT8, *(i % 3 + 1 for i in range(41)))
    d = Drive(cfg, f).do(AddRequest("r3", PROMPT8), AddRequest("r5", long), AddRequest("r6", (*PROMPT8, 1)))
    return d.do(Step(("r3", "r5", "r6"), 64))


def hit_trace(f: Factory) -> Drive:
    """Admission with a hit: one request caches 8 tokens, the next is admitted on them
    and computes its last token; then a second step."""
    d = Drive(FULL_SWA_SWA, f).do(AddRequest("r1", PROMPT8), AddRequest("r3", (*PROMPT8, 2)))
    return d.do(Step(("r1",), 32), Step(("r3",), 16)).steps(("r3",), 16)


def replay_trace(f: Factory) -> Drive:
    """Preemption and replay: a request that generated two tokens is preempted and
    re-admitted (caching off: no hit), so its replay chunk spans prompt and outputs."""
    d = Drive(FULL2, f).do(AddRequest("r0", (1, 2, 3, 1, 2, 3)))
    d.steps(("r0",), 64, 3)
    return d.do(Preempt("r0")).steps(("r0",), 64, 2)


def table_trace(f: Factory) -> Drive:
    """The tables a step ships: an admission on a hit (its whole table), then decodes."""
    return hit_trace(f).steps(("r3",), 16, 2)


REACH_TRACES: dict[str, Callable[[Factory], Drive]] = {
    "mamba_split_budget_is_chunk": budget_trace,
    "admission_drops_hit_tokens": hit_trace,
    "resume_chunk_stops_at_prompt": replay_trace,
    "admission_ships_new_blocks_only": table_trace,
    "running_ships_whole_table": table_trace,
}


@pytest.mark.parametrize("name", sorted(REACH_TRACES))
def test_reach_mutant_is_caught(name: str) -> None:
    """Negative controls: each mutant of a scheduler decision is caught on a trace the
    unmutated scheduler passes."""
    assert name in SCHEDULER_MUTANTS
    assert REACH_TRACES[name](VllmSchedulerTarget).found == []
    with activate(name) as factory:
        assert REACH_TRACES[name](factory).found != []


def test_shipped_admission_reads_the_table_the_worker_gets() -> None:
    """A whole table = the hit (nulled where a window left it, or copied on write) then
    the new blocks; a table without the hit reads as a different hit."""
    hit, new = ((1, 2, 4), (5, 6)), ((7,), (8,))
    assert shipped_admission(((1, 2, 4, 7), (0, 6, 8)), hit, new, set()) == (hit, new)
    assert shipped_admission(((1, 2, 7), (5, 6, 8)), hit, ((7,), (8,)), {(4, 7)}) == (hit, ((7,), (8,)))
    got_hit, got_new = shipped_admission(((7,), (8,)), hit, new, set())
    assert got_hit != hit and got_new != new


def test_a_source_mutant_whose_line_is_gone_fails_loudly() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    with contextlib.ExitStack() as stack, pytest.raises(StaleMutant, match="found 0 times"):
        _rewrite(stack, Scheduler, "schedule", "no_such_line = 1", "pass")
    original: Any = Scheduler.schedule
    with contextlib.ExitStack() as stack:
        _rewrite(
            stack, Scheduler, "schedule", "token_budget = self.max_num_scheduled_tokens", "token_budget = 1"
        )
        assert Scheduler.schedule is not original
    assert Scheduler.schedule is original
