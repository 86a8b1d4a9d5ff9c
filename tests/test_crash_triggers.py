"""Crash findings name their trigger (issue #38, item 6).

A crash finding tolerates a crash only when its trigger happened in the crashing
operation (`invariants.harness.claims.TRIGGERS`, read from the crash's site,
`invariants.harness.crash_site`), and a crash raised by kvretain's own adapter
is never a known finding, whatever its message. Each check here has its
control: the registered finding's own trace is still tolerated, and the claim
without its trigger (what kvretain matched before) would have waved the planted
crash through.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from invariants.harness.checker import Checker, Violation
from invariants.harness.claims import TRIGGERS
from invariants.harness.crash_site import (
    ADAPTER,
    ENGINE,
    OBSERVATION_SITES,
    OBSERVED,
    CrashSite,
    Frame,
    crash_site,
)
from invariants.harness.known_findings import (
    KnownFinding,
    KnownFindingsError,
    KnownLedger,
    crash_counts,
    explain,
    format_known,
    load_known_findings,
    parse_known_findings,
)
from invariants.harness.replay import replay
from invariants.targets.base import TargetCrash
from invariants.targets.vllm_env import vllm_available
from model.contract.ops import AddRequest, Loaded, Offer, Op, Step

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

MAMBA_EXTERNAL = "vllm-mamba-external-state-uncounted"
SAVE_DURING_LOAD = "save-during-load-freed-at-first-report"
PLACEHOLDERS = "async-load-cut-keeps-placeholders"


def finding(fid: str) -> KnownFinding:
    return next(f for f in load_known_findings() if f.id == fid)


def untriggered(f: KnownFinding) -> KnownFinding:
    """The claim as kvretain matched it before triggers: the same finding, no trigger."""
    return replace(f, precondition=replace(f.precondition, trigger=None))


def old_claim_matches(f: KnownFinding, v: Violation) -> bool:
    return untriggered(f).claims(v.check, v.message, v.config, v.op, v.crash)


@pytest.fixture
def full_undercount() -> Iterator[None]:
    """A planted defect in vLLM: the full-attention manager counts two blocks fewer than it
    allocates, so `allocate_slots` admits what the pool cannot hold and `get_new_blocks`
    raises out of blocks, a crash that has nothing to do with a connector's Mamba state."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    original = FullAttentionManager.get_num_blocks_to_allocate

    def undercount(self: Any, *args: Any, **kwargs: Any) -> int:
        return max(original(self, *args, **kwargs) - 2, 0)

    FullAttentionManager.get_num_blocks_to_allocate = undercount  # type: ignore[method-assign]
    try:
        yield
    finally:
        FullAttentionManager.get_num_blocks_to_allocate = original  # type: ignore[method-assign]


def crash_of(ops: list[Op]) -> Violation:
    """The crash the finding's own configuration (Full4 + align Mamba4, a KV connector,
    4 usable blocks) meets on `ops` through vLLM's real scheduler."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    checker = Checker(VllmSchedulerTarget(finding(MAMBA_EXTERNAL).trace.config))
    for op in ops:
        crashes = [v for v in checker.step(op) if v.check == "crash"]
        if crashes:
            return crashes[0]
    raise AssertionError("the planted undercount did not crash vLLM")


PROMPT = tuple(range(1, 18))  # 17 tokens: 5 full blocks, counted 3


@needs_vllm
@pytest.mark.vllm
def test_unrelated_out_of_blocks_crash_without_an_offer_is_new(full_undercount: None) -> None:
    """The issue's planted defect: an undercount in the full-attention manager under a
    connector configuration, no connector offer made. vLLM raises `Cannot get 1 free
    blocks` (the Mamba manager's allocation finds the pool emptied by the full group's
    uncounted blocks): a new violation, not the known finding. Control: the claim
    without its trigger matches it (message, configuration, operation kind all fit)."""
    v = crash_of([AddRequest("r0", PROMPT), Step(("r0",), 64)])
    assert v.crash is not None and v.crash.raised_by == ENGINE
    admission = v.crash.enclosing("KVCacheManager", "allocate_slots")
    assert admission is not None and admission.int("num_external_computed_tokens") == 0
    assert explain("vllm", v) is None
    assert old_claim_matches(finding(MAMBA_EXTERNAL), v)  # control: what was tolerated before


@needs_vllm
@pytest.mark.vllm
def test_out_of_blocks_crash_of_the_full_manager_at_an_external_admission_is_new(
    full_undercount: None,
) -> None:
    """The other half of the trigger: a sync offer of 8 external tokens, and the group
    that ran short is the full-attention one (the planted undercount), not the Mamba
    group: new. Control: the claim without its trigger matches it."""
    v = crash_of([AddRequest("r0", PROMPT), Offer("r0", 8, "sync"), Step(("r0",), 64)])
    assert v.crash is not None and v.crash.raised_by == ENGINE
    manager = v.crash.nearest("SingleTypeKVCacheManager")
    assert manager is not None and "FullAttentionManager" in manager.classes
    admission = v.crash.enclosing("KVCacheManager", "allocate_slots")
    assert admission is not None and (admission.int("num_external_computed_tokens") or 0) > 0
    assert explain("vllm", v) is None
    assert old_claim_matches(finding(MAMBA_EXTERNAL), v)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("fid", [MAMBA_EXTERNAL, SAVE_DURING_LOAD, PLACEHOLDERS])
def test_the_registered_crash_traces_are_still_their_findings(fid: str) -> None:
    """Control: each 0.33.0 crash finding's own trace replays as that finding and nothing
    else, its trigger met (vLLM's frames, or the adapter's check of the engine), and the
    replay counts it as one tolerated crash."""
    f = finding(fid)
    result = replay(f.trace, f.trace.target or "vllm")
    assert result.violations == []
    assert [explain(result.target, v) for _, v in result.known] == [f]
    (_, v), *_ = result.known
    assert v.crash is not None and v.crash.raised_by == TRIGGERS[f.precondition.trigger or ""][1]
    assert result.crashes == {"tolerated_crashes": 1, "adapter_crashes": 0, "new_crashes": 0}


def _raise_as_adapter(message: str) -> Any:
    def apply(*args: Any, **kwargs: Any) -> Any:
        raise TargetCrash(message)

    return apply


@needs_vllm
@pytest.mark.vllm
def test_an_adapter_crash_with_the_findings_message_is_not_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash raised by kvretain's adapter code (here a planted gap in the step driver)
    whose message is word for word the finding's, on the finding's own trace: new, and
    counted as an adapter crash. Control: the message meets the finding's pattern."""
    from invariants.targets.vllm_scheduler_drive import RealStepScheduler

    f = finding(MAMBA_EXTERNAL)
    message = "vLLM 0.33.0 raised on Step(rids=('r0',), budget=64): ValueError: Cannot get 1 free blocks from the pool"
    monkeypatch.setattr(RealStepScheduler, "step", _raise_as_adapter(message))
    result = replay(f.trace, "vllm")
    assert [str(v) for _, v in result.violations] == [f"crash: TargetCrash: {message}"]
    (_, v), *_ = result.violations
    assert v.crash is not None and v.crash.raised_by == ADAPTER
    assert explain("vllm", v) is None and result.known == []
    assert result.crashes == {"tolerated_crashes": 0, "adapter_crashes": 1, "new_crashes": 0}
    assert f._compiled.fullmatch(v.message)  # control: only who raised it tells it apart


@needs_vllm
@pytest.mark.vllm
def test_an_adapter_crash_outside_its_observation_sites_is_not_tolerated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The save-during-load finding is the adapter's own observation of vLLM: the same
    sentence raised anywhere else in the adapter (a planted gap in the load report) is
    an adapter crash, not the finding. Control: at its site, the same trace is the finding
    (`test_the_registered_crash_traces_are_still_their_findings`), and the message meets
    the pattern."""
    from invariants.targets.vllm_scheduler_drive import RealStepScheduler

    f = finding(SAVE_DURING_LOAD)
    message = (
        "vLLM 0.33.0 freed r0's blocks at its load's report while its save is in flight "
        "(the save's report would assert: req_id in self.requests)"
    )
    monkeypatch.setattr(RealStepScheduler, "report_load", _raise_as_adapter(message))
    result = replay(f.trace, "vllm")
    assert [(i, v.check) for i, v in result.violations] == [(len(f.trace.ops) - 1, "crash")]
    (_, v), *_ = result.violations
    assert v.crash is not None and v.crash.raised_by == ADAPTER
    assert explain("vllm", v) is None
    assert f._compiled.fullmatch(v.message)


def test_the_origin_is_told_by_where_it_was_raised() -> None:
    """An exception wrapped by a `TargetCrash` is the engine's only when its innermost frame
    runs in an engine package; a `TargetCrash` raised directly is the adapter's unless
    raised at an observation site. (A raise in this test module is neither.)"""

    def wrapped() -> TargetCrash:
        try:
            try:
                raise ValueError("Cannot get 1 free blocks from the pool")
            except ValueError as exc:
                raise TargetCrash("vLLM 0.33.0 raised on Step(...): ValueError: ...") from exc
        except TargetCrash as crash:
            return crash

    site = crash_site(wrapped())
    assert site.raised_by == ADAPTER and site.error == "ValueError"
    try:
        raise TargetCrash("direct")
    except TargetCrash as crash:
        assert crash_site(crash).raised_by == ADAPTER
    # An engine's own raise: the model (an engine package) refusing a configuration.
    from model.contract.config import Config, ConfigError, GroupSpec, validate

    with pytest.raises(ConfigError) as raised:
        validate(Config(groups=(GroupSpec("full", 4),), num_blocks=1))
    assert crash_site(raised.value).raised_by == ENGINE


def test_every_observation_site_exists() -> None:
    """Each registered observation site names a function that exists: a rename leaves
    no stale entry (its finding would silently stop matching)."""
    import importlib

    for module, qualname in sorted(OBSERVATION_SITES):
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        assert callable(obj), (module, qualname)


def _site(error: str, *frames: tuple[str, str, tuple[str, ...]]) -> CrashSite:
    return CrashSite(ENGINE, error, tuple(Frame(m, q, c) for m, q, c in frames))


def test_the_swa_fine_grained_trigger_reads_the_asserting_manager() -> None:
    """vllm-swa-fine-grained-mamba-assert (vLLM 0.26.0 to 0.27.1, whose releases may not be
    installed): its trigger holds of SlidingWindowManager's own assertion, and not of an
    AssertionError raised elsewhere with the same message (control), nor of another error."""
    f = finding("vllm-swa-fine-grained-mamba-assert")
    trigger, origin, _ = TRIGGERS[f.precondition.trigger or ""]
    stm = "vllm.v1.core.single_type_kv_cache_manager"
    own = _site(
        "AssertionError",
        ("vllm.v1.core.kv_cache_coordinator", "HybridKVCacheCoordinator.find_longest_cache_hit", ()),
        (stm, "SlidingWindowManager.find_longest_cache_hit", ("SlidingWindowManager", "object")),
    )
    elsewhere = _site(
        "AssertionError", (stm, "MambaManager.find_longest_cache_hit", ("MambaManager", "object"))
    )
    cfg = f.trace.config
    assert origin == ENGINE
    assert trigger(own, {}, f.trace.ops[0], cfg)
    assert not trigger(elsewhere, {}, f.trace.ops[0], cfg)
    assert not trigger(replace(own, error="ValueError"), {}, f.trace.ops[0], cfg)
    message = (
        "TargetCrash: vLLM 0.26.0 raised on Probe(tokens=(1,)): AssertionError: "
        "SlidingWindowManager does not support fine-grained (partial) cache hits"
    )
    assert f.matches("vllm-manager", "0.26.0", "crash", message, cfg, f.trace.ops[0], own)
    assert not f.matches("vllm-manager", "0.26.0", "crash", message, cfg, f.trace.ops[0], elsewhere)
    assert not f.matches(
        "vllm-manager", "0.26.0", "crash", message, cfg, f.trace.ops[0], replace(own, raised_by=ADAPTER)
    )


def test_observed_triggers_need_their_report() -> None:
    """The adapter's observations are their findings only at the report that fires them:
    save-during-load for the reporting request itself, placeholders after failed blocks."""
    save = finding(SAVE_DURING_LOAD)
    cfg = save.trace.config
    site = CrashSite(
        OBSERVED,
        "TargetCrash",
        (Frame("invariants.targets.vllm_scheduler_target", "SchedulerOpDriver.dispatch"),),
    )
    message = (
        "TargetCrash: vLLM 0.33.0 freed r0's blocks at its load's report while its save is in flight "
        "(the save's report would assert: req_id in self.requests)"
    )
    assert save.claims("crash", message, cfg, Loaded("r0", True, ()), site)
    assert not save.claims("crash", message, cfg, Loaded("r1", True, ()), site)  # another request's report
    cut = finding(PLACEHOLDERS)
    placeholders = CrashSite(
        OBSERVED,
        "TargetCrash",
        (Frame("invariants.targets.vllm_async_scheduler_drive", "AsyncStepScheduler._check_placeholders"),),
    )
    message = (
        "TargetCrash: vLLM 0.33.0 kept r0's 1 output placeholder(s) after a load's failed blocks cut it "
        "(its step output is skipped: nothing consumes them, its next steps schedule them as tokens)"
    )
    cfg = cut.trace.config
    assert cut.claims("crash", message, cfg, Loaded("r0", True, (2,)), placeholders)
    assert not cut.claims("crash", message, cfg, Loaded("r0", True, ()), placeholders)  # no failed block
    assert not cut.claims("crash", message, cfg, Loaded("r0", True, (2,)), None)  # no site recorded


def test_every_crash_finding_names_its_trigger() -> None:
    """The shipped findings: every crash names a trigger. A file whose crash finding names
    none, or an unknown one, is refused with the field named (controls)."""
    assert all(f.precondition.trigger for f in load_known_findings() if f.property == "crash")
    entry = {
        "id": "x",
        "targets": ["vllm-manager"],
        "property": "crash",
        "vllm_versions": ["0.33.0"],
        "message_pattern": "TargetCrash: .+",
        "precondition": {"config": [], "operations": ["step"]},
        "description": "d",
        "consequence": "crash: the engine raises",
        "reachability": "defaults",
        "upstream": ["none found, searched 2026-12-06"],
        "trace": _trace_json(),
    }
    data = {"format": "kvretain-known-findings", "version": 2, "findings": [entry]}
    with pytest.raises(KnownFindingsError, match=r"findings\[0\]\.precondition\.trigger: a crash finding"):
        parse_known_findings(data)
    entry["precondition"] = {"config": [], "operations": ["step"], "trigger": "no_such_trigger"}
    with pytest.raises(KnownFindingsError, match=r"findings\[0\]\.precondition\.trigger: unknown trigger"):
        parse_known_findings(data)
    entry["precondition"] = {
        "config": [],
        "operations": ["step"],
        "trigger": "mamba_short_at_external_admission",
    }
    assert [f.precondition.trigger for f in parse_known_findings(data)] == [
        "mamba_short_at_external_admission"
    ]


def _trace_json() -> dict[str, Any]:
    import json

    from invariants.harness.known_findings import DEFAULT_PATH

    data = json.loads(DEFAULT_PATH.read_text())
    return next(e["trace"] for e in data["findings"] if e["id"] == MAMBA_EXTERNAL)


def test_tolerated_crashes_are_counted_apart() -> None:
    """The ledger counts tolerated crashes apart from other tolerated violations, and the
    run's counts name adapter crashes apart from other new crashes."""
    engine = Violation("crash", "m", crash=CrashSite(ENGINE, "ValueError", ()))
    adapter = Violation("crash", "m", crash=CrashSite(ADAPTER, "TargetCrash", ()))
    ledger = KnownLedger()
    ledger.record("a-crash", engine)
    ledger.record("a-crash", engine)
    ledger.record("a-promise", Violation("promise_kept", "m"))
    assert (ledger.total, ledger.crashes) == (3, 2)
    assert "3 violation(s), 2 of them crash(es)" in format_known(ledger)
    assert [(e["finding"], e["crash"]) for e in ledger.to_json()] == [("a-crash", True), ("a-promise", False)]
    counts = crash_counts(ledger.crashes, [adapter, engine, Violation("snapshot", "s")])
    assert counts == {"tolerated_crashes": 2, "adapter_crashes": 1, "new_crashes": 1}


@needs_vllm
@pytest.mark.vllm
def test_fuzz_reports_the_planted_crash_as_new(full_undercount: None, tmp_path: Path) -> None:
    """`kvretain fuzz --target vllm` (its `run_fuzz`, 60 s at most) over the finding's
    connector configuration with the planted undercount: the first violation is the
    out-of-blocks crash, raised by vLLM and new; the summary and the JSON count it.
    Control: the same run with the claim as it was (no trigger) tolerates that crash as
    the finding and ends no example on it as a violation."""
    from invariants.harness.fuzz import format_failure, format_summary, run_fuzz
    from invariants.results import fuzz_case

    f = finding(MAMBA_EXTERNAL)
    cfg = f.trace.config.with_(num_blocks=8)
    common: dict[str, Any] = dict(strategy=st.just(cfg), seed=0, out_dir=tmp_path, progress=False)
    report = run_fuzz("vllm", budget_s=60, **common)
    assert report.failure is not None
    v = report.failure.violations[0]
    assert v.check == "crash" and "Cannot get" in v.message and "free blocks from the pool" in v.message
    assert v.crash is not None and v.crash.raised_by == ENGINE and explain("vllm", v) is None
    assert report.crashes == {"tolerated_crashes": 0, "adapter_crashes": 0, "new_crashes": 1}
    assert "other new 1" in format_summary([report])
    assert "no crash finding's trigger matched it" in format_failure(report)
    assert fuzz_case(report).figures["crashes"] == report.crashes

    old = untriggered(f)

    def as_before(w: Violation) -> object:
        if old.matches("vllm-manager", "0.33.0", w.check, w.message, w.config, w.op, w.crash):
            return old
        return explain("vllm", w)

    control = run_fuzz("vllm", budget_s=8, tolerated=as_before, **common)
    assert MAMBA_EXTERNAL in control.stats.known and control.stats.known.crashes >= 1
    assert control.failure is None or control.failure.violations[0].check != "crash"
