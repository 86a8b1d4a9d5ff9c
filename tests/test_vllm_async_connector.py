"""KV connectors on vLLM's real `AsyncScheduler` ("vllm-async-scheduler"): the rules
`model.machine.async_scheduling` (6) and `model.machine.connector` state for a consumer connector with two
steps in flight, each with its negative control (the rule reverted in the model: vLLM
disagrees), the known finding async-load-cut-keeps-placeholders, and the BlockStored
token-range findings reached through a connector's report."""

from __future__ import annotations

from typing import Any

import pytest
from drive import async_drive, async_violations, patched
from test_vllm_connector_spec import riding_samples_ops

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

import model.machine.allocator as allocator  # noqa: E402
import model.machine.connector as connector  # noqa: E402
from invariants.harness.checker import Checker, Violation  # noqa: E402
from invariants.harness.known_findings import explain, is_known_violation  # noqa: E402
from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget  # noqa: E402
from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.observation import LoadCut  # noqa: E402
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Op, Sample, Save, Saved, Step  # noqa: E402
from model.machine.async_scheduling import FENCED, InFlight  # noqa: E402

pytestmark = pytest.mark.vllm

CONN = Config(
    groups=(GroupSpec("full", 2), GroupSpec("swa", 2, sliding_window=2)),
    num_blocks=24,
    retention_interval=0,
    max_model_len=4096,
    kv_connector=True,
)
# 5 usable blocks of 2 tokens: r2 holds 2, r1 the other 3.
SMALL = Config(groups=(GroupSpec("full", 2),), num_blocks=6, max_model_len=4096, kv_connector=True)
SPEC = Config(groups=(GroupSpec("full", 4),), num_blocks=40, max_model_len=4096, kv_connector=True).with_(
    num_lookahead_tokens=2
)

# r1 finished while its step is in flight: its blocks wait for that step's output (r2's step).
FINISH_IN_FLIGHT: list[Op] = [
    AddRequest("r1", (1, 2, 3, 4, 5)),
    Step(("r1",), 8),
    Finish("r1"),
    AddRequest("r2", (9, 8)),
    Step(("r2",), 8),
]
# r2 decodes and r1 is admitted into the last blocks; r2's next decode does not fit, and the
# request vLLM would preempt (r1, the last running) ran in the step in flight: vLLM preempts
# nobody and both wait their turn.
FENCED_VICTIM: list[Op] = [
    AddRequest("r2", (7, 8, 9)),
    Step(("r2",), 8),
    Sample("r2", 11),
    AddRequest("r1", (1, 2, 3, 4, 5, 6)),
    Step(("r2", "r1"), 8),
    Sample("r2", 12),
    Sample("r1", 13),
    Step(("r2", "r1"), 8),
]
# A save's report processes the latest step's output first: r2's fenced free comes back then.
REPORT_PROCESSES: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(("r1",), 8),
    Save("r1"),
    Finish("r1"),
    AddRequest("r2", (4, 5, 6)),
    Step(("r2",), 8),
    Finish("r2"),
    Saved("r1"),
    AddRequest("r3", (7,)),
    Step(("r3",), 8),
]
# A finish with a rejected draft not rolled back yet: the saved blocks cover vLLM's count.
SAVE_WITH_DRAFTS: list[Op] = [
    AddRequest("r1", (2, 1)),
    Step(("r1",), 32),
    Sample("r1", 1, 0, (2,)),
    Step(("r1",), 32),
    Sample("r1", 1, 0, (1, 2)),
    Save("r1"),
    Finish("r1"),
]
# Fine-grained Mamba hits (a Mamba block wider than the hash block): r3's step copies its own
# partial tail (`move_block_hashes`); the copy's retained endpoints wait for that step's output.
FINE = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="align")),
    num_blocks=14,
    retention_interval=0,
    hash_block_size=2,
    scheduler_block_size=4,
    max_model_len=4096,
    kv_connector=True,
)
COPY_IN_FLIGHT: list[Op] = [AddRequest("r3", (2, 3, 1)), Step(("r3",), 3), Step(("r3",), 8)]
# Built with 3 tokens a step: the Mamba split reads the step budget (3, narrower than the block).
FINE_3 = FINE.with_(max_num_batched_tokens=3)
# The finding: a sync load's failed block cuts r0, whose step reached its end (1 placeholder).
PLACEHOLDER_CONFIG = Config(
    groups=(GroupSpec("full", 4),), num_blocks=8, max_model_len=4096, kv_connector=True
)
PLACEHOLDERS_KEPT: list[Op] = [
    AddRequest("r0", tuple(range(1, 10))),
    Offer("r0", 9, "sync"),
    Step(("r0",), 16),
    Loaded("r0", True, (2,)),
]


# A report processes the latest step's output first (6): r1's second token arrives with it and
# caches block 1, which the SWA group skips (MASKED: retention 0's mask; DENSE: an SWA block
# narrower than the scheduler block). The synchronous scheduler caches it at r1's second step.
MASKED = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=4)),
    num_blocks=24,
    retention_interval=0,
    max_model_len=4096,
    kv_connector=True,
)
DENSE = Config(
    groups=(GroupSpec("full", 8), GroupSpec("swa", 4, sliding_window=4)),
    num_blocks=24,
    max_model_len=4096,
    kv_connector=True,
)


# r1 sampled after its prompt, its next step (an engine's: every request held, `rids`), its
# second token (riding on that step's output).
def r1_decodes(rids: tuple[str, ...]) -> list[Op]:
    return [Sample("r1", 8), Step(rids, 32), Sample("r1", 9)]


REPORTS: dict[str, list[Op]] = {
    "loaded": [
        AddRequest("r1", (1, 2, 3, 4, 5, 6, 7)),
        AddRequest("r2", tuple(range(10, 20))),
        Offer("r2", 8, "async"),
        Step(("r1", "r2"), 32),
        *r1_decodes(("r1", "r2")),  # r2 waits for its load
        Loaded("r2", True),
    ],
    "saved": [
        AddRequest("r0", (9, 9, 9)),
        AddRequest("r1", (1, 2, 3, 4, 5, 6, 7)),
        Step(("r0", "r1"), 32),
        Save("r0"),
        Finish("r0"),
        *r1_decodes(("r1",)),
        Saved("r0"),
    ],
}


def test_a_free_while_the_step_is_in_flight_waits_for_its_output() -> None:
    d = async_drive(CONN).do(*FINISH_IN_FLIGHT[:3])
    assert d.found == []
    checker = d.checker
    held = checker.model.snapshot().tables[FENCED]
    assert held[0] and not any(held[1:])  # both groups' blocks, listed in group 0's entry
    assert checker.target.vllm_scheduler.deferred_frees  # type: ignore[attr-defined]
    assert d.do(*FINISH_IN_FLIGHT[3:]).found == []
    assert FENCED not in checker.model.snapshot().tables
    assert checker.observer.coverage[
        "async + connector: fenced frees returned as the step's output was processed"
    ]


def test_control_a_direct_free_disagrees_with_vllm() -> None:
    with patched(InFlight, "holds", lambda self, rid, tables: False):
        assert async_violations(CONN, FINISH_IN_FLIGHT) != []


def test_a_fenced_victim_is_not_preempted() -> None:
    assert async_violations(SMALL, FENCED_VICTIM) == []


def test_control_preempting_a_fenced_victim_disagrees_with_vllm() -> None:
    with patched(allocator, "fenced_victim", lambda in_flight, rid: False):
        found = async_violations(SMALL, FENCED_VICTIM)
    assert any("preempted" in v.message for v in found), found


def test_a_report_processes_the_latest_output_first() -> None:
    assert async_violations(CONN, REPORT_PROCESSES) == []


def test_control_a_report_leaving_the_output_in_flight_disagrees_with_vllm() -> None:
    original = allocator.AllocatorModel.outputs_arrive

    def only_steps(self: Any, scheduled: Any, *skipped: Any) -> None:
        if scheduled is not None:
            original(self, scheduled, *skipped)

    with patched(allocator.AllocatorModel, "outputs_arrive", only_steps):
        assert async_violations(CONN, REPORT_PROCESSES) != []


def test_a_finish_hands_the_blocks_of_the_schedulers_count() -> None:
    assert async_violations(SPEC, SAVE_WITH_DRAFTS) == []


def test_control_a_finish_on_the_rolled_back_count_disagrees_with_vllm() -> None:
    def rolled_back(m: Any, req: Any) -> tuple[int, int]:
        return req.num_computed, max(req.num_computed - m.undelivered.get(req.rid, 0), 0)

    with patched(connector, "finish_tokens", rolled_back):
        found = async_violations(SPEC, SAVE_WITH_DRAFTS)
    assert any(v.check == "observation" for v in found), found


def test_finding_a_cut_request_keeps_its_output_placeholders() -> None:
    checker = Checker(VllmAsyncSchedulerTarget(PLACEHOLDER_CONFIG), audit_every=1)
    for op in PLACEHOLDERS_KEPT[:-1]:
        assert checker.step(op) == []
    found = checker.step(PLACEHOLDERS_KEPT[-1])
    assert [explain("vllm-async-scheduler", v).id for v in found] == [  # type: ignore[union-attr]
        "async-load-cut-keeps-placeholders"
    ]
    # The synchronous scheduler keeps none: the same trace is clean there.
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    sync = Checker(VllmSchedulerTarget(PLACEHOLDER_CONFIG), audit_every=1)
    assert [v for op in PLACEHOLDERS_KEPT for v in sync.step(op)] == []


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "drafts"])
def test_samples_ride_on_a_sync_loads_report(drafts: bool) -> None:
    """The output's fenced frees, then the cut (on the scheduler's count: a rider's
    rejected drafts not rolled back yet), then the riders' tokens arrive but the cut ones'."""
    cfg = (SPEC if drafts else SPEC.with_(num_lookahead_tokens=0)).with_(kv_load_failure_policy="fail")
    ops = riding_samples_ops(drafts)
    m = allocator.AllocatorModel(cfg, num_spec_tokens=cfg.num_lookahead_tokens, async_scheduling=True)
    for op in ops[:9]:
        m.apply(op)
    assert m.sync_report is not None and m.sync_report.sampled == {"r1", "r2"}
    d = async_drive(cfg).do(*ops)
    assert d.found == []
    cut = d.seen[9]
    assert isinstance(cut, LoadCut) and cut.num_computed == 4
    assert cut.others == ((("r1", 12), ("r2", 11)) if drafts else (("r1", 12),))  # r2's rejection rolled back
    assert sorted(cut.ended) == ["r0", "r1"]
    assert d.checker.observer.coverage["connector: a sample riding on a sync load's failed blocks dropped"]


def test_control_a_cut_on_the_rolled_back_count_disagrees_with_vllm() -> None:
    cfg = SPEC.with_(kv_load_failure_policy="fail")
    original = connector._sync_cut

    def rolled_back(m: Any, rid: str, invalid: Any, report: Any, riders: Any) -> Any:
        return original(m, rid, invalid, report, {})

    with patched(connector, "_sync_cut", rolled_back):
        found = async_violations(cfg, riding_samples_ops(True))
    assert any("LoadCut" in v.message for v in found), found


def test_a_sync_loads_report_after_samples_under_recompute_is_the_placeholder_finding() -> None:
    """Under "recompute" the loading request r0, cut, keeps its output placeholder: the
    known finding, at the report and nowhere before."""
    d = async_drive(SPEC.with_(num_lookahead_tokens=0))
    ops = riding_samples_ops(False)
    assert [v for op in ops[:9] for v in d.checker.step(op)] == []
    found = d.checker.step(ops[9])
    assert [explain("vllm-async-scheduler", v).id for v in found] == [  # type: ignore[union-attr]
        "async-load-cut-keeps-placeholders"
    ]


def test_a_copys_retained_endpoints_wait_for_its_steps_output() -> None:
    d = async_drive(FINE_3).do(*COPY_IN_FLIGHT)
    assert d.found == []
    copies = sum(len(getattr(obs, "copies", ())) for obs in d.seen)
    assert copies and FENCED in d.checker.model.snapshot().tables


def test_control_releasing_a_copys_endpoints_at_once_disagrees_with_vllm() -> None:
    with patched(InFlight, "holds_copies", lambda self, retained: False):
        assert async_violations(FINE_3, COPY_IN_FLIGHT) != []


@pytest.mark.parametrize(
    ("cfg", "report", "finding"),
    [
        (MASKED, "loaded", "vllm-blockstored-token-range"),
        (MASKED, "saved", "vllm-blockstored-token-range"),
        (DENSE, "loaded", "vllm-blockstored-token-range-dense"),
    ],
)
def test_finding_a_reports_arrivals_store_the_whole_token_range(
    cfg: Config, report: str, finding: str
) -> None:
    """vLLM's BlockStored token-range defect (its token ids span the blocks a group skips),
    emitted by the arrival caching of the output a report processes first: the finding,
    at the report; the synchronous scheduler emits it at the step instead."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    ops = REPORTS[report]
    checker = Checker(VllmAsyncSchedulerTarget(cfg), audit_every=1)
    found = [(i, v) for i, op in enumerate(ops) for v in checker.step(op)]
    assert found and {i for i, _ in found} == {len(ops) - 1}, found
    assert {explain("vllm-async-scheduler", v).id for _, v in found} == {finding}  # type: ignore[union-attr]
    sync = Checker(VllmSchedulerTarget(cfg), audit_every=1)
    at = {type(op).__name__ for op in ops for v in sync.step(op)}
    assert at == {"Step"}
    # Controls: the claim stays the defect's shape on a report, and only on the operations it names.
    [(_, v)] = found[:1]
    assert not is_known_violation("vllm-async-scheduler", Violation(v.check, v.message, cfg, Finish("r1")))
    short = v.message.rsplit(" but ", 1)[0] + " but 2 token ids"  # fewer ids than a block: not the defect
    assert not is_known_violation("vllm-async-scheduler", Violation(v.check, short, cfg, v.op))
    full = v.message.replace("(group 1)", "(group 0)")  # the full-attention group skips nothing
    assert not is_known_violation("vllm-async-scheduler", Violation(v.check, full, cfg, v.op))


@pytest.mark.parametrize(
    "row",
    [
        "ASYNC_CONNECTOR_FAIL_ROW",
        "ASYNC_CONNECTOR_CACHING_OFF_ROW",
        "ASYNC_CONNECTOR_SPEC_ROW",
        "ASYNC_CONNECTOR_MAMBA_ROW",
        "ASYNC_CONNECTOR_SPEC_MAMBA_ROW",
        "ASYNC_CONNECTOR_BLOCKS_ROW",
        "ASYNC_CONNECTOR_BLOCKS_FAIL_ROW",
    ],
)
def test_control_each_async_connector_row_sees_direct_frees(row: str, tmp_path: Any) -> None:
    """Negative control of the conformance rows (tests/test_cli.py runs them at 1,500 steps):
    with the model freeing at once what vLLM fences, each row reports a finding."""
    from invariants.harness import conformance

    feature = getattr(conformance, row)
    with patched(InFlight, "holds", lambda self, rid, tables: False):
        result = conformance._fuzz_row(
            "vllm-async-scheduler",
            feature,
            conformance.ASYNC_SCHEDULER_FEATURES[feature],
            300,
            20.0,
            0,
            tmp_path,
        )
    assert not result.ok and result.verdict.startswith("FINDING"), result.verdict
