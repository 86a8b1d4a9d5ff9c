"""The KV connector judged by the shadow worker (`invariants.shadow.connector`): a load
writes its own request's blocks while they are held, the connector is told what the
request holds, a save reads its request's prefix until `finished_sending`, and a
failed load leaves its blocks without provenance for whoever reads them.

Each check is shown failing on a planted defect of the class it guards, next to the
same input clean: first on hand-written outputs (no vLLM), then on vLLM's real
`Scheduler` with kvretain's scripted connector, then by `run_fuzz`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from invariants.shadow import LOADS, READS, SAVES, TOLD, ShadowConnector, ShadowWorker, WorkerGroup

FULL4 = (WorkerGroup("full", 4),)
PROMPT8 = (1, 2, 3, 4, 5, 6, 7, 8, 9)

# ---------------------------------------------------------------------- the rules, by hand


def output(new: tuple[Any, ...] = (), scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    """A `SchedulerOutput` with new requests only, as the worker and the connector read it."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), all_token_ids={}, num_computed_tokens=[], new_block_ids=[]
        ),
        num_scheduled_tokens=scheduled or {},
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(),
        preempted_req_ids=set(),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=None,
    )


def new_req(rid: str, prompt: tuple[int, ...], blocks: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=list(prompt),
        prefill_token_ids=list(prompt),
        block_ids=(blocks,),
        num_computed_tokens=computed,
    )


def shadow(
    held: dict[str, tuple[tuple[int, ...], ...]] | None = None,
) -> tuple[ShadowWorker, ShadowConnector]:
    worker = ShadowWorker(FULL4)
    return worker, ShadowConnector(worker, lambda rid: (held or {}).get(rid))


def checks(worker: ShadowWorker) -> list[str]:
    return [check for check, _ in worker.take_problems()]


def sync_step(
    c: ShadowConnector, rid: str, told: int, computed: int, blocks: list[int], matched: int = 8
) -> SimpleNamespace:
    """One step running `rid`'s sync load of `told` tokens, shipped with `computed` computed."""
    c.told_load(rid, 0, matched, told, (tuple(blocks),), False, PROMPT8)
    out = output((new_req(rid, PROMPT8, blocks, computed),), {rid: len(PROMPT8) - computed})
    c.built_meta(out)
    c.worker.execute(out)
    return out


def test_a_sync_load_writes_its_prefix_before_its_step_reads_it() -> None:
    w, c = shadow()
    sync_step(c, "a", 8, 8, [1, 2, 3])
    assert checks(w) == []
    assert c.figures.slots_loaded == 8 and w.figures.reads == 9
    # Control: the same admission with no load told: the step reads 8 slots nobody wrote.
    w = ShadowWorker(FULL4)
    w.execute(output((new_req("a", PROMPT8, [1, 2, 3], 8),), {"a": 1}))
    assert checks(w) == [READS]


def test_the_connector_is_told_what_the_request_is_admitted_with() -> None:
    """One external token too many: more than the connector matched, and not what the step
    ships (control of the clean test above)."""
    w, c = shadow()
    sync_step(c, "a", 8, 7, [1, 2, 3], matched=7)
    assert checks(w) == [TOLD, TOLD]


def test_a_new_match_after_a_failed_async_load_supersedes_what_that_load_left() -> None:
    """A failed async load's request goes back to waiting; the connector may match it afresh
    (a sync load of more tokens): its admission is judged by that load, not the failed one."""

    def after_failed_load() -> tuple[ShadowWorker, ShadowConnector]:
        w, c = shadow({"a": ((1,),)})
        c.told_load("a", 0, 4, 4, ((1,),), True, PROMPT8)
        c.reported(("a",), ("a",), (), ())
        return w, c

    w, c = after_failed_load()
    sync_step(c, "a", 8, 8, [1, 2, 3])
    assert checks(w) == []
    # Control: admitted with as many tokens and no new match: more than the failed load left it.
    w, c = after_failed_load()
    out = output((new_req("a", PROMPT8, [1, 2, 3], 8),), {"a": 1})
    c.built_meta(out)
    assert checks(w) == [TOLD]


def test_a_failed_load_leaves_its_blocks_without_provenance_for_the_next_reader() -> None:
    def run(invalid: tuple[int, ...]) -> list[tuple[str, str]]:
        w, c = shadow()
        sync_step(c, "a", 8, 8, [1, 2, 3])
        c.reported((), (), invalid, ())
        # b hits the 8 loaded tokens (blocks 1, 2) before a recomputes them.
        w.execute(output((new_req("b", PROMPT8, [1, 2, 4], 8),), {"b": 1}))
        return w.take_problems()

    assert run(()) == []
    (problem,) = run((2,))
    assert problem[0] == READS
    assert "a slot a failed KV load left unwritten" in problem[1] and "each one a failed load" in problem[1]


def test_an_async_load_writes_at_its_report_into_the_blocks_still_held() -> None:
    def run(held: tuple[int, ...], admitted: int) -> list[str]:
        w, c = shadow({"a": (held,)})
        c.told_load("a", 0, 8, 8, ((1, 2, 3),), True, PROMPT8)
        c.built_meta(output())
        w.execute(output())
        c.check_held()
        c.reported({"a"}, (), (), ())
        out = output((new_req("a", PROMPT8, [1, 2, 3], admitted),), {"a": 9 - admitted})
        c.built_meta(out)
        w.execute(out)
        return checks(w)

    assert run((1, 2, 3), 8) == []
    assert LOADS in run((1, 5, 3), 8)  # control: block 2 handed on while the load is in flight
    assert TOLD in run((1, 2, 3), 7)  # control: admitted at another count than its load left


def finished_with_save(
    held: tuple[int, ...], handed: tuple[int, ...]
) -> tuple[ShadowWorker, ShadowConnector]:
    w, c = shadow({"a": (held,)})
    w.execute(output((new_req("a", PROMPT8, [1, 2, 3], 0),), {"a": 9}))
    w.returned("a", [7])
    c.finished("a", (handed,), True, 9, (*PROMPT8, 7))
    return w, c


def test_a_save_reads_its_prefix_until_finished_sending() -> None:
    w, c = finished_with_save((1, 2, 3), (1, 2, 3))
    c.check_held()
    c.reported((), (), (), {"a"})
    assert checks(w) == [] and c.figures.slots_saved == 9
    # Control: the save's block 2 handed on (and written) before finished_sending.
    w, c = finished_with_save((1, 2, 3), (1, 2, 3))
    w.execute(output((new_req("b", (5, 5, 5, 5, 5), [2, 4], 0),), {"b": 5}))
    c.reported((), (), (), {"a"})
    assert checks(w) == [SAVES]


def test_a_save_whose_blocks_are_freed_before_finished_sending_is_reported() -> None:
    w, c = finished_with_save((1, 2, 3), (1, 2, 3))
    c.holds = lambda rid: None  # the scheduler freed it at the finish
    c.check_held()
    assert checks(w) == [SAVES]


def test_request_finished_hands_the_blocks_the_request_holds() -> None:
    w, c = finished_with_save((1, 2, 3), (1, 2, 3))
    assert checks(w) == []
    w, c = finished_with_save((1, 2, 3), (1, 3, 2))  # control: another table handed over
    assert TOLD in checks(w)


# ---------------------------------------------------------------------- on vLLM's real scheduler

from invariants.targets.vllm_env import vllm_available  # noqa: E402

_OK, _REASON = vllm_available()
vllm_only = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

sys.path.insert(0, str(Path(__file__).parent))
from drive import Drive, async_drive  # noqa: E402
from engine_drive_steps import engine_steps  # noqa: E402

from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Save, Saved  # noqa: E402

ONE_FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=24, max_model_len=4096, kv_connector=True)
PROMPT = tuple(range(1, 14))


def lifecycle(one_step_ahead: bool = False) -> Drive:
    """A sync load, an async load beside the first request's decodes, a save, and an
    async load whose request finishes while it is in flight; every step the engine's own
    (`engine_steps`: each names every request vLLM holds); `one_step_ahead`: on vLLM's
    `AsyncScheduler`."""
    d = async_drive(ONE_FULL) if one_step_ahead else Drive(ONE_FULL)
    engine_steps(d.do(AddRequest("r0", PROMPT), Offer("r0", 12, "sync")), 2)
    engine_steps(d.do(AddRequest("r1", tuple(range(20, 30))), Offer("r1", 8, "async")))
    engine_steps(d.do(Loaded("r1", True)), 2)
    engine_steps(d.do(Save("r0"), Finish("r0"))).do(Saved("r0"))
    engine_steps(d.do(AddRequest("r2", (9, 9, 9, 9, 9, 9, 9)), Offer("r2", 6, "async")))
    return d.do(Finish("r2"), Loaded("r2", True), Finish("r1"))


def found(d: Drive) -> set[str]:
    return {v.check for v in d.audited()}


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["vllm", "vllm-async-scheduler"])
def test_vllm_as_released_keeps_the_connector_contract(one_step_ahead: bool) -> None:
    d = lifecycle(one_step_ahead)
    assert found(d) == set()
    figures = d.checker.target.engine_figures()
    assert figures is not None
    assert figures["connector loads written"] == 3 and figures["connector saves read"] == 1
    assert figures["connector slots loaded"] >= 12 + 8 and figures["worker steps"] >= 5


@contextlib.contextmanager
def planted(
    owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def one_token_too_many(tell: Callable[..., Any]) -> Callable[..., Any]:
    """The scheduler tells the connector one external token more than it admits."""

    def wrapped(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        return tell(self, request, blocks, num_external_tokens + 1 if num_external_tokens else 0)

    return wrapped


def save_freed_at_finish(finished: Callable[..., Any]) -> Callable[..., Any]:
    """The scheduler frees a finished request's blocks though its connector defers the free."""

    def wrapped(self: Any, request: Any) -> Any:
        _, params = finished(self, request)
        return False, params

    return wrapped


def load_freed_at_finish(free: Callable[..., Any]) -> Callable[..., Any]:
    """The scheduler frees a request's blocks at its finish though its async load is in flight."""

    def wrapped(self: Any, request: Any, delay_free_blocks: bool = False) -> Any:
        return free(self, request, delay_free_blocks=False)

    return wrapped


def plants() -> dict[str, tuple[Any, str, Callable[..., Any], str]]:
    """name -> (owner, method, wrapper, the check that reports it)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from invariants.targets.vllm_connector import KvretainConnector

    return {
        "external_token_too_many": (KvretainConnector, "update_state_after_alloc", one_token_too_many, TOLD),
        "save_freed_before_sent": (Scheduler, "_connector_finished", save_freed_at_finish, SAVES),
        "load_freed_in_flight": (Scheduler, "_free_request", load_freed_at_finish, LOADS),
    }


PLANTS = ("external_token_too_many", "save_freed_before_sent", "load_freed_in_flight")


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", PLANTS)
def test_a_planted_connector_defect_is_reported_on_the_lifecycle(name: str) -> None:
    """Each planted defect breaks the check that guards it; unplanted, the same trace keeps
    the contract (`test_vllm_as_released_keeps_the_connector_contract`)."""
    owner, method, wrap, check = plants()[name]
    with planted(owner, method, wrap):
        d = Drive(ONE_FULL)
        with contextlib.suppress(Exception):  # a defect may also derail the rest of the trace
            lifecycle_into(d)
        assert check in {v.check for v in d.found}


def lifecycle_into(d: Drive) -> None:
    d.do(AddRequest("r0", PROMPT), Offer("r0", 12, "sync")).steps(("r0",), 64, 2)
    d.do(Save("r0"), Finish("r0"))
    d.do(AddRequest("r2", (9, 9, 9, 9, 9, 9, 9)), Offer("r2", 6, "async")).steps(("r2",), 64)
    d.do(Finish("r2"), Loaded("r2", True), Saved("r0"))


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["external_token_too_many", "save_freed_before_sent"])
def test_a_planted_connector_defect_is_found_by_fuzzing(name: str, tmp_path: Path) -> None:
    """`kvretain fuzz --target vllm` with a budget finds each planted defect as the check
    that guards it (generated configurations, the known findings tolerated)."""
    from invariants.harness.fuzz import run_fuzz

    owner, method, wrap, check = plants()[name]
    with planted(owner, method, wrap):
        report = run_fuzz("vllm", budget_s=40, seed=1, out_dir=tmp_path, progress=False)
    assert report.failure is not None, f"{name}: not found in {report.stats.steps} steps"
    assert check in {v.check for v in report.failure.violations}, report.failure


# ---------------------------------------------------------------------- known findings, as the worker sees them


@vllm_only
@pytest.mark.vllm
def test_a_failed_sync_loads_block_read_is_the_known_finding_and_nothing_else_is() -> None:
    """The shadow worker reports the read of a block a failed sync load left unwritten
    (sync-load-failed-block-read-before-recompute): tolerated as that finding, under its
    precondition only; an unrelated wrong read in the same run is a new violation."""
    from dataclasses import replace

    from invariants.harness.known_findings import explain, load_known_findings

    finding = next(f for f in load_known_findings() if f.id == "sync-load-failed-block-read-before-recompute")
    d = Drive(finding.trace.config)
    reads = [v for op in finding.trace.ops for v in d.checker.step(op) if v.check == READS]
    assert len(reads) == 1, "the shadow worker does not see the failed block's read"
    read = reads[0]
    assert explain("vllm", read) is finding
    # Controls: another prefix's KV read in the same step; the same read without a connector.
    other = read.message.replace("a slot a failed KV load left unwritten", "which holds another prefix's KV")
    assert (
        explain("vllm", replace(read, message=other.replace(", each one a failed load left unwritten", "")))
        is None
    )
    assert read.config is not None
    assert explain("vllm", replace(read, config=replace(read.config, kv_connector=False))) is None


def test_a_save_copying_out_a_kept_failed_block_is_the_hash_kept_finding_only_at_a_finish() -> None:
    """A save that copies out a block whose failed load's hash vLLM kept
    (sync-load-failed-block-hash-kept: the hit served it first) is that finding's third view,
    judged where a save is read (a finish, finished_sending); the same message at a step, a
    save holding another prefix's KV, or a run without a connector is a new violation."""
    from dataclasses import replace

    from invariants.harness.checker import Violation
    from invariants.harness.known_findings import explain, load_known_findings
    from model.contract.ops import Finish, Saved, Step

    finding = next(f for f in load_known_findings() if f.id == "sync-load-failed-block-hash-kept")
    config = replace(finding.trace.config, kv_connector=True, kv_load_failure_policy="recompute")
    message = (
        "r6's save reads, at its finish: position 0 in block 1 of group 0 holds a slot a failed KV load "
        "left unwritten (1 block(s) wrong)"
    )
    save = Violation(SAVES, message, config=config, op=Finish("r6"))
    assert explain("vllm", save) is finding
    sent = message.replace("at its finish", "at finished_sending")
    assert explain("vllm", replace(save, message=sent, op=Saved("r6"))) is finding
    # Controls.
    assert explain("vllm", replace(save, op=Step(("r6",), 8))) is None
    other = message.replace("a slot a failed KV load left unwritten", "another prefix's KV")
    assert explain("vllm", replace(save, message=other)) is None
    assert explain("vllm", replace(save, config=replace(config, kv_connector=False))) is None


@vllm_only
@pytest.mark.vllm
def test_a_block_the_window_left_behind_does_not_make_a_request_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync load fails on a block id a running SWA request's table held before its window
    moved past it (vLLM freed it; another request reused it): vLLM does not cut that request
    and keeps its sample, so neither does the shadow worker (fuzz --target vllm seed 1 found
    the false report: a worker one sample behind vLLM). Control: every block of the table
    counted, the worker drops the sample and its positions disagree with vLLM's."""
    import invariants.shadow.worker as shadow_worker
    from invariants.harness.known_findings import explain
    from invariants.harness.trace import read_trace

    trace = read_trace(str(Path(__file__).parent / "data" / "shadow_swa_cut_reused_window_block.json"))

    def new_violations() -> list[Any]:
        d = Drive(trace.config)
        found = [v for op in trace.ops for v in d.checker.step(op)]
        return [v for v in found if explain("vllm", v) is None]

    assert new_violations() == []
    monkeypatch.setattr(shadow_worker, "_window_start", lambda spec, start: 0)
    assert [v.check for v in new_violations()] == ["worker_positions_consistent"]
