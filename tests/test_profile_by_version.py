"""A run's rules are chosen by the installed vLLM's version; its code is only checked.

- Version mapping: an exact release, a dev/post/local/pre-release build, a release
  without a row, one older or newer than the table, each mapped to a row with a
  stated note; a version that is not PEP 440 is one clear error.
- The table (`vllm_releases.RELEASES`) equals what the code-derived detection found on
  each release (`docs/matrix-report.json`); control: a planted wrong row is caught.
- A planted regression on 0.33.0 (BlockPool.free_blocks appending freed blocks with
  caching off, as 0.27.x did before #51482) is reported as profile drift and shows as
  disagreements in a short run judged by 0.33.0's rule, not adopted; control: the
  unpatched code reports no drift and agrees. The declared override (escape hatch)
  adopts it openly.
- A scheduler whose `schedule` was recompiled from edited source (`inspect.getsource`
  fails) runs under the vllm target (and `kvretain replay --target vllm` exits 0, not
  2); control: a scheduler that lacks a method the target calls is still refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from invariants.errors import UsageError
from invariants.targets import vllm_releases
from invariants.targets.vllm_capabilities import Capabilities, compare
from invariants.targets.vllm_env import vllm_available
from invariants.targets.vllm_releases import (
    RELEASES,
    ROWS,
    RULE_FIELDS,
    parse_overrides,
    release_of,
    releases_with,
)
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Op, Schedule

ROOT = Path(__file__).resolve().parents[1]
_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


# ----------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    ("version", "release", "said"),
    [
        ("0.33.0", "0.33.0", None),
        ("0.27.1", "0.27.1", None),
        ("0.33.1.dev12+gabc1234", "0.33.0", "development build descending from 0.33.0"),
        ("0.28.0.dev3", "0.27.1", "development build descending from 0.27.1"),
        ("0.33.0+cu124", "0.33.0", "build descending from 0.33.0"),
        ("0.33.0.post1", "0.33.0", "build descending from 0.33.0"),
        ("0.28.0rc1", "0.27.1", "build descending from 0.27.1"),
        ("0.26.1", "0.26.0", "no row of its own: rules of 0.26.0"),
        ("0.34.0", "0.33.0", "newer than the release table"),
        ("0.20.0", "0.21.0", "predates the release table"),
    ],
)
def test_a_version_maps_to_the_release_it_descends_from(version: str, release: str, said: str | None) -> None:
    got, note = release_of(version)
    assert got == release
    if said is None:
        assert note is None
    else:
        assert note is not None and said in note and version in note


def test_a_version_that_is_no_version_is_one_clear_error() -> None:
    with pytest.raises(UsageError, match=r"vLLM version 'banana': not a PEP 440 version"):
        release_of("banana")


# ----------------------------------------------------------------------------- the table
def _report_rows() -> dict[str, dict[str, Any]]:
    report = json.loads((ROOT / "docs" / "matrix-report.json").read_text())
    return {r["version"]: r["capabilities"] for r in report["releases"] if r.get("capabilities")}


def _table_differences(rows: dict[str, dict[str, Any]], found: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"{release}.{field}: table {rows[release][field]!r}, detected {caps.get(field)!r}"
        for release, caps in found.items()
        for field in RULE_FIELDS
        if rows[release][field] != caps.get(field)
    ]


def test_every_row_is_what_the_detection_found_on_that_release() -> None:
    found = _report_rows()
    assert set(found) == {r for r, _ in RELEASES}  # every row is backed by a recorded release
    assert all(set(row) == set(RULE_FIELDS) for row in ROWS.values())
    assert _table_differences(ROWS, found) == []
    # control: a planted wrong row (0.33.0 with the 0.27.x caching-off order) is caught
    planted = {**ROWS, "0.33.0": {**ROWS["0.33.0"], "caching_off_order": "fifo"}}
    assert _table_differences(planted, found) == ["0.33.0.caching_off_order: table 'fifo', detected 'lifo'"]


def test_releases_with_a_rule_are_named_as_spans() -> None:
    assert releases_with("caching_off_order", "fifo") == "0.27.0 .. 0.27.1"
    assert releases_with("caching_off_order", "lifo") == "0.21.0 .. 0.26.0, 0.28.0 .. 0.33.0"
    assert releases_with("free_order", "caller") == "0.23.0"


# ----------------------------------------------------------------------------- overrides
def test_an_override_declares_a_rule_and_a_bad_one_is_refused() -> None:
    assert parse_overrides("caching_off_order=fifo, sample_caching=false") == {
        "caching_off_order": "fifo",
        "sample_caching": False,
    }
    assert parse_overrides("") == {} and parse_overrides(None) == {}
    with pytest.raises(UsageError, match=r"caching_off_order is one of lifo, fifo, got 'sideways'"):
        parse_overrides("caching_off_order=sideways")
    with pytest.raises(UsageError, match=r"'colour=red' is not capability=value"):
        parse_overrides("colour=red")
    with pytest.raises(UsageError, match=r"block_mask is true or false"):
        parse_overrides("block_mask=maybe")


# ----------------------------------------------------------------------------- drift, without vLLM
def _caps(version: str, **rules: Any) -> Capabilities:
    row = {**ROWS[release_of(version)[0]], **rules}
    return Capabilities(version=version, manager_args=frozenset(), event_fields=frozenset(), **row)


def test_a_rule_the_code_behaves_unlike_is_drift_and_an_unread_rule_is_counted() -> None:
    run, code = _caps("0.33.0"), _caps("0.33.0", caching_off_order="fifo")
    check = compare("0.33.0", run, code, frozenset(), {})
    assert [d.capability for d in check.drift] == ["caching_off_order"]
    assert check.lines()[0].startswith(
        "profile drift: caching_off_order: installed code behaves like 'fifo' (0.27.0 .. 0.27.1), "
        "0.33.0's rule is 'lifo' (#51482); checked against 'lifo'"
    )
    assert "KVRETAIN_VLLM_PROFILE=caching_off_order=fifo" in check.lines()[0]
    assert check.to_json()["drift"][0]["installed"] == "fifo"
    # a rule whose source could not be read is unchecked, counted, and no drift
    unread = compare("0.33.0", run, code, frozenset({"caching_off_order"}), {})
    assert unread.drift == () and unread.unchecked == ("caching_off_order",)
    assert "1 rule(s) not checked against the installed code" in unread.lines()[-1]
    # control: code that behaves like the rule is no drift, and nothing is said
    same = compare("0.33.0", run, _caps("0.33.0"), frozenset(), {})
    assert same.drift == () and same.lines() == []


# ----------------------------------------------------------------------------- on the installed vLLM
@pytest.fixture
def fresh() -> Iterator[Any]:
    """The capabilities module with its caches cleared before and after (a test changes the code)."""
    from invariants.targets import vllm_capabilities

    vllm_capabilities.clear_caches()
    yield vllm_capabilities
    vllm_capabilities.clear_caches()


def _free_blocks_before_51482(self: Any, ordered_blocks: Any) -> None:
    """0.33.0's `BlockPool.free_blocks` as 0.27.x freed: with caching off every freed block
    goes to the tail (FIFO), the order #51482 replaced."""
    first, last, other_pools = [], [], {}
    for block in ordered_blocks:
        if block.is_null:
            continue
        if block.pool is not None and block.pool is not self:
            other_pools.setdefault(block.pool, []).append(block)
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None and self.enable_caching:
                first.append(block)
            else:
                last.append(block)
    self.free_block_queue.prepend_n(first)
    self.free_block_queue.append_n(last)
    for pool, blocks in other_pools.items():
        pool.free_blocks(blocks)


CACHING_OFF = Config((GroupSpec("full", 4),), 8, enable_caching=False)
CACHING_OFF_OPS: tuple[Op, ...] = (
    AddRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9)),
    Schedule("a", 64),
    Finish("a"),
)


def _disagreements(target: Any, ops: tuple[Op, ...]) -> list[str]:
    from invariants.harness.checker import Checker

    checker = Checker(target, check_invariants=False, audit_every=1)
    return [str(v) for op in ops for v in checker.step(op) if v.check in ("observation", "snapshot")]


@needs_vllm
def test_the_unpatched_release_reports_no_drift(fresh: Any) -> None:
    check = fresh.profile_check()
    assert (check.release, check.note, check.drift, check.unchecked) == ("0.33.0", None, (), ())
    assert fresh.detect().caching_off_order == "lifo" and fresh.profile_lines() == []


@needs_vllm
def test_a_regression_to_the_fifo_caching_off_order_is_reported_not_adopted(
    fresh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    from invariants.targets.vllm_target import VllmManagerTarget

    clean = _disagreements(VllmManagerTarget(CACHING_OFF), CACHING_OFF_OPS)
    assert clean == []  # control: 0.33.0 agrees with its own rule
    monkeypatch.setattr(BlockPool, "free_blocks", _free_blocks_before_51482)
    fresh.clear_caches()
    assert fresh.detect_code()[0].caching_off_order == "fifo"  # the code behaves like 0.27.x
    check = fresh.profile_check()
    assert [(d.capability, d.installed, d.rule) for d in check.drift] == [
        ("caching_off_order", "fifo", "lifo")
    ]
    assert any(
        line.startswith("profile drift: caching_off_order: installed code behaves like 'fifo'")
        for line in fresh.profile_lines()
    )
    assert fresh.profile_json()["drift"][0]["capability"] == "caching_off_order"
    # not adopted: the run is judged by 0.33.0's rule, so the regression shows as disagreements
    target = VllmManagerTarget(CACHING_OFF)
    assert target.caps.caching_off_order == "lifo" and target.profile.caching_off_free_to_head
    assert _disagreements(target, CACHING_OFF_OPS), "the FIFO regression should disagree with 0.33.0's rule"


@needs_vllm
def test_a_declared_rule_is_adopted_openly(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool

    from invariants.targets.vllm_target import VllmManagerTarget

    monkeypatch.setattr(BlockPool, "free_blocks", _free_blocks_before_51482)
    monkeypatch.setenv(vllm_releases.OVERRIDE_ENV, "caching_off_order=fifo")
    fresh.clear_caches()
    check = fresh.profile_check()
    assert check.drift == () and check.overrides == {"caching_off_order": "fifo"}
    assert fresh.profile_lines() == ["profile: declared by KVRETAIN_VLLM_PROFILE: caching_off_order=fifo"]
    assert _disagreements(VllmManagerTarget(CACHING_OFF), CACHING_OFF_OPS) == []
    # a declared rule the code does not follow is drift against the declaration
    monkeypatch.setenv(vllm_releases.OVERRIDE_ENV, "caching_off_order=lifo,sample_caching=false")
    fresh.clear_caches()
    lines = fresh.profile_lines()
    assert any("caching_off_order" in x and "the declared rule (KVRETAIN_VLLM_PROFILE)" in x for x in lines)
    assert any("sample_caching" in x and "the declared rule" in x for x in lines)


def _recompiled(fn: Any, old: str, new: str) -> Any:
    """`fn` recompiled from its source with `old` replaced by `new`, under a file name
    linecache does not know (so `inspect.getsource` of the result fails)."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, old
    namespace: dict[str, Any] = {}
    exec(
        compile(src.replace(old, new), "<a user's edited scheduler>", "exec"),
        vars(sys.modules[fn.__module__]),
        namespace,
    )  # noqa: S102
    return namespace[fn.__name__]


@pytest.fixture
def edited_scheduler(monkeypatch: pytest.MonkeyPatch, fresh: Any) -> Any:
    """vLLM's `Scheduler` with `schedule` (reading its budget through a local name) and
    `update_from_output` recompiled from edited source: neither source can be read."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = _recompiled(
        Scheduler.schedule,
        "token_budget = self.max_num_scheduled_tokens",
        "token_budget = getattr(self, 'max_num_scheduled_' + 'tokens')",
    )
    update = _recompiled(Scheduler.update_from_output, "def update_from_output(", "def update_from_output(")
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "update_from_output", update)
    for fn in (Scheduler.schedule, Scheduler.update_from_output):
        with pytest.raises((OSError, TypeError)):
            inspect.getsource(fn)
    fresh.clear_caches()
    return Scheduler


@needs_vllm
def test_a_recompiled_schedule_runs_under_the_vllm_target(edited_scheduler: Any, fresh: Any) -> None:
    from invariants.targets import target_factory

    assert fresh.detect().scheduler_missing == ()
    factory = target_factory("vllm")  # not refused
    # The engine's own steps: built with 4 tokens a step, which the edited `schedule` reads.
    ops = (AddRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9)), *[Schedule("a", 4)] * 3, Finish("a"))
    assert _disagreements(factory(Config((GroupSpec("full", 4),), 16, max_num_batched_tokens=4)), ops) == []
    # the rule whose source is unreadable is counted as unchecked, not reported as drift
    check = fresh.profile_check()
    assert check.drift == () and check.unchecked == ("sample_caching",)


@needs_vllm
def test_replay_on_an_edited_scheduler_exits_0_and_a_missing_method_exits_2(
    edited_scheduler: Any, fresh: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from invariants.cli.main import main
    from invariants.harness.trace import Trace, write_trace

    ops = [AddRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9)), Schedule("a", 64), Finish("a")]
    trace = write_trace(Trace(Config((GroupSpec("full", 4),), 16), ops, 0, "vllm", ""), tmp_path / "t.json")
    assert main(["replay", str(trace), "--target", "vllm"]) == 0
    # control: the same scheduler without a method the target calls is refused, exit 2
    monkeypatch.delattr(edited_scheduler, "_preempt_request")
    fresh.clear_caches()
    assert main(["replay", str(trace), "--target", "vllm"]) == 2
    assert "lacks what the vllm target drives: Scheduler._preempt_request" in capsys.readouterr().err


def test_capabilities_round_trip_json() -> None:
    caps = dataclasses.replace(_caps("0.27.0"), scheduler_missing=())
    assert Capabilities.from_json(caps.to_json()) == caps
