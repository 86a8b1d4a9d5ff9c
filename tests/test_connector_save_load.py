"""A request saved while its async load is in flight (`model.machine.connector`, "Saves").

A kv_both connector may save a request finished while its load is in flight
(or ended by its failed load under "fail"): the contract holds its blocks until
both the load and the save have reported, in either order. vLLM 0.33.0 frees
them at the first report (and asserts at the second): the known finding
"save-during-load-freed-at-first-report", tolerated only as its claim states.

Model tests need no vLLM; the vLLM tests replay the finding's trace through the
real `Scheduler` (every violation explained by that finding, nothing else) and
show the tolerance matches nothing else: the same trace without the save is
clean, and the same crash message off its precondition, or another crash on the
same operation, is a new violation.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from invariants.harness.checker import Checker, Violation
from invariants.harness.crash_site import ADAPTER, OBSERVED, CrashSite, Frame
from invariants.harness.known_findings import explain, known_finding
from invariants.harness.observer import ModelObserver
from invariants.harness.trace import Trace
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import Done, Saving
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Op, Save, Saved, Step
from model.machine.allocator import AllocatorModel

FULL4 = Config(groups=(GroupSpec("full", 4),), num_blocks=8, max_model_len=4096, kv_connector=True)
PROMPT = tuple(range(1, 14))  # 13 tokens: 12 loaded into blocks 1-3
FINDING = "save-during-load-freed-at-first-report"

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def loading_ops(save: bool = True) -> list[Op]:
    """r0 (saved, if `save`) admitted to an async load of 12 tokens, then aborted."""
    ops: list[Op] = [AddRequest("r0", PROMPT)]
    ops += [Save("r0")] if save else []
    return ops + [Offer("r0", 13, "async"), Step(("r0",), 64), Finish("r0")]


def reports(load_first: bool) -> list[Op]:
    load, saved = Loaded("r0", True), Saved("r0")
    return [load, saved] if load_first else [saved, load]


# ------------------------------------------------------------------ the contract, on the model
@pytest.mark.parametrize("load_first", [True, False], ids=["load-first", "save-first"])
def test_blocks_held_until_both_the_load_and_the_save_report(load_first: bool) -> None:
    m = AllocatorModel(FULL4, observer=(m_seen := ModelObserver()))
    obs = [m.apply(op) for op in loading_ops()]
    table = m.snapshot().tables["r0"][0]
    assert obs[-1] == Saving((table,)) and table == (1, 2, 3)
    assert m.held == {"r0"} and m.sending == {"r0"}
    first, second = reports(load_first)
    assert m.apply(first) == Done()
    # One report is not enough: the other transfer may still use the blocks.
    assert m.snapshot().tables["r0"] == (table,) and not set(table) & set(m.snapshot().free_queue)
    m.apply(AddRequest("r1", tuple(range(40, 53))))
    m.apply(Step(("r1",), 64))
    assert not set(table) & set(m.snapshot().tables["r1"][0])
    m.apply(second)
    assert "r0" not in m.snapshot().tables and not m.held and not m.sending
    assert set(table) <= set(m.snapshot().free_queue)
    assert m_seen.coverage["connector: free deferred until both the load and the save report"] == 1


def test_a_failed_load_ending_a_saved_request_keeps_it_for_the_save() -> None:
    """ "fail": the failed load ends the request; its save defers the free to its report."""
    m = AllocatorModel(FULL4.with_(kv_load_failure_policy="fail"))
    for op in loading_ops()[:-1]:
        m.apply(op)
    m.apply(Loaded("r0", False))
    assert "r0" not in m.requests and m.sending == {"r0"} and m.snapshot().tables["r0"] == ((1, 2, 3),)
    m.apply(Saved("r0"))
    assert "r0" not in m.snapshot().tables and not m.sending


def test_without_a_save_the_load_report_frees() -> None:
    m = AllocatorModel(FULL4)
    for op in loading_ops(save=False):
        m.apply(op)
    assert m.held == {"r0"} and not m.sending
    m.apply(Loaded("r0", True))
    assert "r0" not in m.snapshot().tables and not m.held


def test_model_target_is_clean_in_either_order() -> None:
    for load_first in (True, False):
        c = Checker(ModelTarget(FULL4), audit_every=1)
        assert [v for op in loading_ops() + reports(load_first) for v in c.step(op)] == []
        assert c.audit() == []


# ------------------------------------------------------------------ vLLM 0.33.0: the known finding
def run_vllm(ops: list[Op], cfg: Config = FULL4) -> list[tuple[int, Violation]]:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    c = Checker(VllmSchedulerTarget(cfg), audit_every=1)
    return [(i, v) for i, op in enumerate(ops) for v in c.step(op)]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("load_first", [True, False], ids=["load-first", "save-first"])
def test_vllm_frees_at_the_first_report_and_asserts_at_the_second(load_first: bool) -> None:
    found = run_vllm(loading_ops() + reports(load_first))
    first, other = ("load", "save") if load_first else ("save", "load")
    # The first report: vLLM forgot r0 (freed its blocks) while the other transfer is in flight.
    assert [(i, v.check) for i, v in found] == [(5, "crash"), (6, "crash")]
    assert f"freed r0's blocks at its {first}'s report while its {other} is in flight" in found[0][1].message
    assert explain("vllm", found[0][1]) is not None and explain("vllm", found[0][1]).id == FINDING  # type: ignore[union-attr]
    # Delivered anyway, the second report hits vLLM's own assert (not the finding's message).
    assert "raised on" in found[1][1].message and "AssertionError" in found[1][1].message
    assert explain("vllm", found[1][1]) is None


@needs_vllm
@pytest.mark.vllm
def test_vllm_fail_policy_frees_a_saved_request_at_its_failed_load() -> None:
    found = run_vllm(loading_ops()[:-1] + [Loaded("r0", False)], FULL4.with_(kv_load_failure_policy="fail"))
    assert len(found) == 1 and found[0][0] == 4
    assert explain("vllm", found[0][1]).id == FINDING  # type: ignore[union-attr]


@needs_vllm
@pytest.mark.vllm
def test_the_findings_trace_replays_explained_by_it_alone() -> None:
    from invariants.harness.known_findings import load_known_findings, recheck_known_findings
    from invariants.harness.replay import replay

    finding = next(f for f in load_known_findings() if f.id == FINDING)
    trace: Trace = finding.trace
    assert trace.target == "vllm" and len(trace.ops) <= 6
    result = replay(trace, "vllm")
    assert result.violations == [] and len(result.known) == 1
    assert all(explain("vllm", v) is finding for _, v in result.known)
    assert (FINDING, "vllm-manager", True) in recheck_known_findings({"vllm-manager"})
    # Negative control: the same trace without the save is clean on vLLM.
    assert run_vllm(loading_ops(save=False) + [Loaded("r0", True)]) == []


@needs_vllm
@pytest.mark.vllm
def test_the_tolerance_matches_nothing_else() -> None:
    from invariants.targets.vllm_env import vllm_version

    version = vllm_version()
    message = (
        f"TargetCrash: vLLM {version} freed r0's blocks at its load's report while its save is in "
        "flight (the save's report would assert: req_id in self.requests)"
    )
    # Raised by the adapter's check of the report (`crash_site.OBSERVATION_SITES`).
    site = CrashSite(
        OBSERVED,
        "TargetCrash",
        (Frame("invariants.targets.vllm_scheduler_target", "SchedulerOpDriver.dispatch"),),
    )
    hit = Violation("crash", message, config=FULL4, op=Loaded("r0", True), crash=site)
    assert known_finding("vllm-manager", version, hit) is not None
    for other in (
        Violation(
            "crash", message, config=FULL4.with_(kv_connector=False), op=Loaded("r0", True), crash=site
        ),
        Violation("crash", message, config=FULL4, op=Step(("r0",), 64), crash=site),
        Violation("snapshot", message, config=FULL4, op=Loaded("r0", True)),
        Violation(
            "crash",
            f"TargetCrash: vLLM {version} raised on Loaded: AssertionError: ",
            FULL4,
            Loaded("r0", True),
            crash=site,
        ),
        Violation("crash", message, config=FULL4, op=Loaded("r0", True)),  # no site: never known
        Violation(
            "crash", message, config=FULL4, op=Loaded("r0", True), crash=replace(site, raised_by=ADAPTER)
        ),
    ):
        assert known_finding("vllm-manager", version, other) is None, other
    assert known_finding("vllm-manager", "0.32.0", hit) is None  # another release: not claimed


def count_deferrals(mp: pytest.MonkeyPatch, sched: object) -> None:
    """A fix of vLLM, as a monkeypatch: a free deferred both for a load in flight and by
    the connector's save waits for the last of the two reports."""
    cls = type(sched)
    free_request, free_blocks = cls._free_request, cls._free_blocks  # type: ignore[attr-defined]
    pending: dict[str, int] = {}

    def _free_request(self: object, request: object, delay_free_blocks: bool = False) -> object:
        out = free_request(self, request, delay_free_blocks)
        rid = request.request_id  # type: ignore[attr-defined]
        if delay_free_blocks and rid in self.connector.deferred:  # type: ignore[attr-defined]
            pending[rid] = 2
        return out

    def _free_blocks(self: object, request: object) -> None:
        rid = request.request_id  # type: ignore[attr-defined]
        if pending.get(rid, 0) > 1:
            pending[rid] -= 1
            return
        pending.pop(rid, None)
        free_blocks(self, request)

    mp.setattr(cls, "_free_request", _free_request)
    mp.setattr(cls, "_free_blocks", _free_blocks)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("policy", "load_first"),
    [("recompute", True), ("recompute", False), ("fail", True)],
    ids=["load-first", "save-first", "fail"],
)
def test_a_vllm_freeing_at_the_last_report_agrees_with_the_model(
    monkeypatch: pytest.MonkeyPatch, policy: str, load_first: bool
) -> None:
    """The contract is vLLM's own with the deferrals counted: a fixed scheduler is clean
    (the driver's check stays quiet, every snapshot agrees), in either order and policy."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    cfg = FULL4.with_(kv_load_failure_policy=policy)  # type: ignore[arg-type]
    target = VllmSchedulerTarget(cfg)
    count_deferrals(monkeypatch, target.vllm_scheduler)
    c = Checker(target, audit_every=1)
    if policy == "fail":  # the failed load ends r0, its save keeps it
        ops = loading_ops()[:-1] + [Loaded("r0", False), Saved("r0")]
    else:
        ops = loading_ops() + reports(load_first)
    ops += [AddRequest("r1", tuple(range(40, 53))), Step(("r1",), 64)]
    assert [v for op in ops for v in c.step(op)] == [] and c.audit() == []
    assert "r0" not in target.vllm_scheduler.requests
