"""A "clean" means every check ran and nothing new was tolerated (issue 24).

Each test reproduces one way a run used to print "clean" while a check did not
run or a new defect passed as a known one, and shows it reported now:

1. known findings are precise claims (whole message, direction, configuration,
   operation, shape), counted per finding, and a tolerated message does not
   switch off the rest of its invariant;
2. no invariant runs only on the audited operation (`copies_sound` on the fast path);
3. state between audits: the free queue's ends are compared on every operation,
   the audited operation compares its "before" snapshot;
6. no silent green: the fuzz loop re-raises a harness error past its budget,
   `verify` with a skipped row is not "everything holds", the matrix counts a
   finding only when its claim is met;
7. nothing is judged after a tolerated crash (the target's state is undefined
   there): the fuzz halts, and so do the shrinker's predicate and the zoo's
   replay on the unmutated target, so no kill rests on what followed one.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_incremental import reorder_free_queue

from invariants.catalogue import AUDIT_ONLY, INVARIANTS, STATE_INVARIANTS, coverage_gaps
from invariants.catalogue.events import stored_tokens_match_hashes
from invariants.harness.checker import DEFAULT_AUDIT_EVERY, Checker, Violation
from invariants.harness.claims import CONDITIONS, SHAPES, operation_kind
from invariants.harness.known_findings import (
    KnownLedger,
    explain,
    format_known,
    known_finding,
    load_known_findings,
)
from invariants.harness.trace import read_trace
from invariants.targets import available_targets
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec
from model.contract.observation import BlockStored, Observation
from model.contract.ops import AddRequest, Finish, Op, Probe, Sample, Schedule
from model.contract.prefix import extend

FINDINGS = {f.id: f for f in load_known_findings()}
FULL_SWA = Config(groups=(GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=32)), num_blocks=16)
FULL_ONLY = Config(groups=(GroupSpec("full", 4),), num_blocks=16)


def _v(check: str, message: str, config: Config, op: Op | None) -> Violation:
    return Violation(check, message, config, op)


# ------------------------------------------------------------------ 1. precise claims
def test_blockstored_with_too_few_token_ids_is_a_new_violation() -> None:
    """The known defect carries MORE token ids (the whole range); fewer, or a
    layout with no skipped blocks, or a non-caching operation, is new."""
    cfg = FINDINGS["vllm-blockstored-token-range"].trace.config
    prop, op = "stored_tokens_match_hashes", Schedule("A", 100)
    known = "BlockStored(group 1) has 2 hash(es) of 16 tokens but 96 token ids"
    assert explain("vllm-manager", _v(prop, known, cfg, op)) is not None
    too_few = "BlockStored(group 1) has 3 hash(es) of 16 tokens but 16 token ids"
    assert explain("vllm-manager", _v(prop, too_few, cfg, op)) is None
    ragged = "BlockStored(group 1) has 2 hash(es) of 16 tokens but 97 token ids"
    assert explain("vllm-manager", _v(prop, ragged, cfg, op)) is None
    full_group = "BlockStored(group 0) has 2 hash(es) of 16 tokens but 96 token ids"
    assert explain("vllm-manager", _v(prop, full_group, cfg, op)) is None  # full attention skips nothing
    assert explain("vllm-manager", _v(prop, known.replace("group 1", "group 0"), FULL_ONLY, op)) is None
    assert explain("vllm-manager", _v(prop, known, cfg, Probe((1,)))) is None  # a probe caches nothing
    assert explain("vllm-manager", _v(prop, known + " (and more)", cfg, op)) is None  # whole message
    assert explain("vllm-manager", _v(prop, known, cfg, None)) is None  # no operation: an audit
    assert explain("vllm-manager", _v(prop, known, None, op)) is None  # no configuration to judge


def test_a_tolerated_length_mismatch_still_checks_the_hash_chain() -> None:
    """With the whole range in token_ids the hashes must still name blocks of it."""
    tokens = tuple(range(1, 13))
    parent = None
    chain = []
    for i in range(3):
        parent = extend(parent, tokens[i * 4 : (i + 1) * 4])
        chain.append(parent)

    def judge(hashes: tuple[Any, ...]) -> list[str]:
        ev = BlockStored(group=1, block_size=4, block_hashes=hashes, parent=None, token_ids=tokens)
        return stored_tokens_match_hashes(SimpleNamespace(after=SimpleNamespace(events=(ev,))))  # type: ignore[arg-type]

    assert judge((chain[1], chain[2])) == ["BlockStored(group 1) has 2 hash(es) of 4 tokens but 12 token ids"]
    wrong = judge((chain[2], chain[1]))  # out of order: no longer a subsequence of the range
    assert wrong[0].endswith("but 12 token ids") and "hash 1 does not chain" in wrong[1]
    assert judge(tuple(chain)) == []


def test_eagle_replay_claim_needs_its_precondition_and_shape() -> None:
    f = FINDINGS["eagle-swa-short-run-double-pop"]
    cfg, prop, fin = f.trace.config, "promise_kept", Finish("a")
    msg = "with Eagle: replay hit {} < promised {} although every needed block is cached"
    assert explain("model", _v(prop, msg.format(0, 8), cfg, fin)) is f
    assert explain("model", _v(prop, msg.format(0, 4096), cfg, fin)) is None  # not one segment
    assert explain("model", _v(prop, msg.format(0, 16), cfg, fin)) is None  # beyond the window
    no_eagle = cfg.with_(eagle=False)
    assert explain("model", _v(prop, msg.format(0, 8), no_eagle, fin)) is None
    wide_swa = cfg.with_(groups=(GroupSpec("full", 4), GroupSpec("swa", 8, sliding_window=16)))
    assert explain("model", _v(prop, msg.format(0, 8), wide_swa, fin)) is None  # no SWA block < sbs


def test_waste_of_a_kind_is_known_only_with_eagle_and_sparse_retention() -> None:
    """The claim covers retention 0 and k (the matrix replays it on both); dense
    retention or no Eagle is a new violation."""
    f = FINDINGS["vllm-eagle-mamba-interval-waste"]
    cfg, op = f.trace.config, Schedule("r3", 3)
    waste = _v("no_waste", "mamba g1:4t cached but no retained boundary of any request needs it", cfg, op)
    assert known_finding("vllm-manager", "0.29.0", waste) is f
    assert (
        known_finding(
            "vllm-manager", "0.29.0", _v(waste.check, waste.message, cfg.with_(retention_interval=0), op)
        )
        is f
    )
    for other in (cfg.with_(eagle=False), cfg.with_(retention_interval=None)):
        assert known_finding("vllm-manager", "0.29.0", _v(waste.check, waste.message, other, op)) is None


def test_every_finding_states_a_precondition_its_own_trace_meets() -> None:
    for f in FINDINGS.values():
        assert f.precondition.operations, f.id
        op_kind = next(iter(f.precondition.operations))
        groups = _groups(f)
        if groups is None:  # a prose summary: the shape is checked by the replay tests
            assert f.precondition.conditions and all(
                CONDITIONS[c][0](f.trace.config) for c in f.precondition.conditions
            ), f.id
            continue
        # A crash's trigger reads the replayed crash's site (tests/test_crash_triggers.py).
        pre = replace(f.precondition, trigger=None)
        assert pre.holds(f.trace.config, op_kind, groups), f.id


def _groups(f: Any) -> dict[str, str] | None:
    """The captured numbers of the finding's recorded violation (only shapes read them)."""
    import re

    if f.precondition.shape is None:
        return {}
    message = (f.trace.violation or ": ").split(": ", 1)[1]
    m = re.fullmatch(f.message_pattern, message)
    return None if m is None else m.groupdict()


def test_shapes_read_only_what_their_patterns_capture() -> None:
    for f in FINDINGS.values():
        if f.precondition.shape is not None:
            assert set(SHAPES[f.precondition.shape][1]) <= set(f._compiled.groupindex), f.id


def test_ledger_counts_each_finding_and_writes_a_replayable_example(tmp_path: Path) -> None:
    f = FINDINGS["eagle-swa-short-run-double-pop"]
    checker = Checker(ModelTarget(f.trace.config))
    ledger = KnownLedger()
    for op in f.trace.ops:
        for v in checker.step(op):
            finding = explain("model", v)
            assert finding is f
            ledger.record(finding.id, v, checker.ops)
            ledger.record(finding.id, v, checker.ops)  # counted, the first kept
    ledger.write_examples(tmp_path, "model", 3)
    (entry,) = ledger.entries.values()
    assert entry.count == 2 and entry.first.startswith("promise_kept: with Eagle")
    assert entry.example is not None and read_trace(entry.example).ops == f.trace.ops
    table = format_known(ledger)
    assert f.id in table and "2" in table and str(entry.example) in table
    assert ledger.to_json()[0]["count"] == 2


def test_matrix_counts_a_reproduction_only_when_the_claim_is_met() -> None:
    f = FINDINGS["vllm-eagle-mamba-interval-waste"]
    cfg, op = f.trace.config, Schedule("r3", 3)
    assert f.claims(
        "no_waste", "mamba g1:4t cached but no retained boundary of any request needs it", cfg, op
    )
    assert not f.claims(
        "no_waste", "swa g1:4t cached but no retained boundary of any request needs it", cfg, op
    )
    assert not f.claims("promise_kept", "mamba g1:4t cached but no retained boundary", cfg, op)


# ------------------------------------------------------------------ 2. every invariant runs
def test_no_invariant_runs_only_on_the_audited_operation() -> None:
    assert coverage_gaps() == []
    names = {inv.name for inv in INVARIANTS}
    assert names >= AUDIT_ONLY and set(STATE_INVARIANTS) <= names
    # Control: the old catalogue left copies_sound to the audited operation alone.
    assert coverage_gaps(AUDIT_ONLY | {"copies_sound"}) == ["copies_sound"]


def test_the_copy_finding_is_seen_at_the_default_audit_cadence() -> None:
    f = FINDINGS["vllm-cow-copy-of-same-step-block"]
    checker = Checker(ModelTarget(f.trace.config), audit_every=DEFAULT_AUDIT_EVERY)  # the fuzzer's
    assert checker.audit_every > len(f.trace.ops)
    found = [v for op in f.trace.ops for v in checker.step(op)]
    assert checker.audits == 0  # every operation went by deltas
    assert [v.check for v in found] == ["copies_sound"], found
    assert explain("model", found[0]) is f


# ------------------------------------------------------------------ 3. between audits
class TailToHeadForTwoOps(ModelTarget):
    """Mutant: after its 5th operation the free queue's tail goes to the head; two
    operations later it goes back. No operation names the block."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.n = 0

    def apply(self, op: Op) -> Observation:
        out = super().apply(op)
        self.n += 1
        q = self._model.pool.queue
        if self.n == 5:
            last = q.blocks[-1]
            q.remove(last)
            q.prepend_n([last])
        elif self.n == 7:
            first = q.blocks[0]
            q.remove(first)
            q.append_n([first])
        return out


OPS: list[Op] = [
    AddRequest("a", (1, 2, 3, 4, 5)),
    Schedule("a", 8),
    Sample("a", 1),
    AddRequest("b", (7, 7)),
    Schedule("b", 8),
    Probe((1, 2)),
    Probe((7,)),
    Probe((9,)),
    Probe((5,)),
]


def _violations(checker: Checker, ops: list[Op]) -> list[tuple[int, Violation]]:
    return [(i, v) for i, op in enumerate(ops) for v in checker.step(op)]


def test_a_corruption_undone_before_the_next_audit_is_seen() -> None:
    found = _violations(Checker(TailToHeadForTwoOps(FULL_ONLY), audit_every=DEFAULT_AUDIT_EVERY), OPS)
    assert found and found[0][0] == 4 and found[0][1].check == "snapshot"
    assert "free queue (head, tail)" in found[0][1].message
    # Control: without the ends on every operation the default cadence misses it.
    blind = Checker(TailToHeadForTwoOps(FULL_ONLY), audit_every=DEFAULT_AUDIT_EVERY)
    blind.model_target.partial = _without_ends(blind.model_target.partial)  # type: ignore[method-assign]
    blind.target.partial = _without_ends(blind.target.partial)  # type: ignore[attr-defined]
    assert _violations(blind, OPS) == [] and blind.audit() == []


def _without_ends(partial: Any) -> Any:
    from dataclasses import replace

    return lambda *a, **k: replace(partial(*a, **k), ends=None)


class SwapsMiddleUndoneByTheAuditedOp(ModelTarget):
    """Mutant: after its 3rd operation two free blocks in the middle of the queue
    swap; applying its 6th operation (the audited one at `audit_every=6`) swaps
    them back first, so the state after that operation is right again."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.n = 0
        self.pair: tuple[int, int] = (0, 0)

    def _swap(self, a: int, b: int) -> None:
        reorder_free_queue(self, lambda blocks: [b if x == a else a if x == b else x for x in blocks])

    def apply(self, op: Op) -> Observation:
        self.n += 1
        if self.n == 6:
            self._swap(*self.pair)
        out = super().apply(op)
        if self.n == 3:
            blocks = self._model.pool.queue.blocks
            self.pair = (blocks[len(blocks) // 2], blocks[len(blocks) // 2 + 1])
            self._swap(*self.pair)
        return out


def test_the_audited_operation_compares_its_before_snapshot() -> None:
    found = _violations(Checker(SwapsMiddleUndoneByTheAuditedOp(FULL_ONLY), audit_every=6), OPS)
    assert found and found[0][0] == 5
    assert all(v.message.startswith("before the operation: free_queue") for _, v in found), found


# ------------------------------------------------------------------ 6. no silent green
class Lies(ModelTarget):
    """Every operation's observation disagrees with the model's."""

    def apply(self, op: Op) -> Observation:
        super().apply(op)
        return "not what the model saw"  # type: ignore[return-value]


def test_a_harness_error_after_the_budget_is_raised_not_clean(tmp_path: Path) -> None:
    """A bug in the harness that strikes as the budget runs out is raised, not read
    as "clean" (the fuzz loop swallowed any exception once the budget was spent)."""
    from invariants.harness.fuzz import run_fuzz

    # A budget the first violation surely comes within, even on a loaded machine; the
    # harness bug then strikes just after the budget ran out.
    deadline = time.monotonic() + 5.0

    def tolerated(v: Violation) -> bool:
        time.sleep(max(0.0, deadline + 0.2 - time.monotonic()))
        raise RuntimeError("harness bug")

    with pytest.raises(RuntimeError, match="harness bug"):
        run_fuzz(
            "model",
            factory=Lies,
            tolerated=tolerated,
            strategy=st.just(FULL_ONLY),
            budget_s=5.0,
            seed=0,
            out_dir=tmp_path,
            progress=False,
            database=None,
        )


@pytest.fixture
def verify_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from invariants.cli import verify

    monkeypatch.setattr(
        verify,
        "available_targets",
        lambda: (
            {"model": None}
            | {t: "vllm: not installed here" for t in ("vllm", "vllm-async-scheduler", "vllm-manager")}
        ),
    )
    real_import = verify.import_row_module

    def rows(module: str, record: Any) -> Any:
        if module == "invariants.proofs.runner":
            return SimpleNamespace(
                run_theorems=lambda progress: [SimpleNamespace(name="t", expected_ok=True)]
            )
        if module in ("invariants.cli.zoo", "invariants.cli.simulate") or module.startswith("gpu_check"):
            row = ("stub", "model", "ok", "-", 0.0, True)
            return SimpleNamespace(verify_row=lambda **kw: row)
        if module == "invariants.cli.sglang":
            return SimpleNamespace(verify_row=lambda *a: ("pass", "stub", 0))
        return real_import(module, record)

    monkeypatch.setattr(verify, "import_row_module", rows)


def test_verify_with_skipped_rows_is_not_everything_holds(
    verify_without_vllm: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from invariants.cli.main import main

    monkeypatch.chdir(tmp_path)
    rc = main(["verify", "--quick", "--json", "v.json"])
    out = capsys.readouterr().out
    assert rc == 3 and "everything holds" not in out
    vllm_rows = (
        "production link [vllm]",
        "fuzz [vllm]",
        "fuzz [vllm-async-scheduler]",
        "fuzz [vllm-manager]",
        "fuzz (production scale) [vllm]",
        "conformance [vllm]",
        "explore [vllm]",
    )
    assert f"holds, {len(vllm_rows)} row(s) skipped" in out
    for row in vllm_rows:
        assert row in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["exit_code"] == 3 and not data["complete"] and data["counts"]["skipped"] == len(vllm_rows)
    # A CI that must judge vLLM says so: the skip is then a failure.
    assert main(["verify", "--quick", "--require", "vllm"]) == 1
    assert "FAILED: required but skipped" in capsys.readouterr().out


def test_verify_counts_a_skipped_sglang_row(
    verify_without_vllm: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without SGLang its row is skipped with the reason, counted, and --require sglang fails."""
    from invariants.cli import verify
    from invariants.cli.main import main

    stubbed = verify.import_row_module

    def rows(module: str, record: Any) -> Any:
        if module == "invariants.cli.sglang":
            return SimpleNamespace(verify_row=lambda *a: ("skipped", "sglang is not installed here", 0))
        return stubbed(module, record)

    monkeypatch.setattr(verify, "import_row_module", rows)
    monkeypatch.chdir(tmp_path)
    rc = main(["verify", "--quick", "--json", "v.json"])
    out = capsys.readouterr().out
    assert rc == 3 and "fuzz [sglang]" in out and "sglang is not installed here" in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["counts"]["skipped"] == 8  # seven vLLM rows and SGLang's
    assert main(["verify", "--quick", "--require", "sglang"]) == 1


@pytest.mark.skipif(available_targets().get("vllm-manager") is not None, reason="needs vLLM")
def test_a_short_vllm_fuzz_tolerates_only_what_its_findings_claim(tmp_path: Path) -> None:
    """Every finding a vLLM fuzz tolerated: its example trace replays to a violation
    that meets the finding's precondition, checked here from the trace alone."""
    from invariants.harness.fuzz import run_fuzz
    from invariants.harness.replay import replay

    report = run_fuzz("vllm-manager", seed=1, budget_s=20, out_dir=tmp_path, progress=False, database=None)
    assert report.failure is None, report.failure
    assert report.stats.known, "the sample needs tolerated violations (seed 1 meets them within seconds)"
    for entry in report.stats.known.entries.values():
        f = FINDINGS[entry.finding]
        assert entry.example is not None and entry.count >= 1
        trace = read_trace(entry.example)
        result = replay(trace, "vllm-manager")
        i, v = next((i, v) for i, v in result.known if str(v) == entry.first)
        assert f.precondition.holds(
            trace.config, operation_kind(trace.ops[i]), _match(f, v.message), trace.ops[i], v.crash
        )


def _match(f: Any, message: str) -> dict[str, str]:
    import re

    m = re.fullmatch(f.message_pattern, message)
    assert m is not None
    return m.groupdict()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=120),
    st.sampled_from([1, 2, 4, 16, 40]),
    st.integers(0, 40),
    st.data(),
)
def test_the_fast_range_walk_agrees_with_the_exact_subsequence_walk(
    tokens: list[int], bs: int, plen: int, data: st.DataObject
) -> None:
    """`_name_blocks_of_range` (no prefix named, chunk compares) is the exact walk's
    fast twin: True exactly when the hashes are an in-order subsequence of the
    range's blocks. Corrupted hashes (a shifted block, a swapped pair) are drawn too."""
    from invariants.catalogue.events import _name_blocks_of_range

    parent = extend(None, [3] * plen) if plen else None
    blocks = len(tokens) // bs
    chain, p = [], parent
    for i in range(blocks):
        p = extend(p, tokens[i * bs : (i + 1) * bs])
        chain.append(p)
    picked = sorted(data.draw(st.sets(st.integers(0, max(blocks - 1, 0)), max_size=blocks)))
    hashes = [chain[i] for i in picked]
    how = data.draw(st.sampled_from(["as is", "shift", "swap"]))
    if how == "shift" and hashes:
        hashes[-1] = extend(parent, [t % 3 + 1 for t in tokens[: len(hashes[-1]) - (plen or 0)]])
    elif how == "swap" and len(hashes) > 1:
        hashes[0], hashes[1] = hashes[1], hashes[0]
    j = 0
    for b in chain:
        if j < len(hashes) and hashes[j] is b:
            j += 1
    exact = j == len(hashes)
    assert _name_blocks_of_range(parent, hashes, tuple(tokens), bs) == exact


# ------------------------------------------------------------------ 7. after a tolerated crash
def post_crash_trace() -> Any:
    """vLLM 0.33.0 frees r1 at its load's report while its save is in flight (the known
    finding "save-during-load-freed-at-first-report", a tolerated crash); the next
    operation then sees a free queue the model never reaches."""
    from invariants.harness.trace import trace_from_json

    return trace_from_json(
        {
            "format": "kvretain-trace",
            "version": 1,
            "config": {
                "groups": [{"kind": "full", "block_size": 4}],
                "num_blocks": 18,
                "kv_connector": True,
                "kv_load_failure_policy": "fail",
            },
            "ops": [
                {"op": "add", "rid": "r1", "prompt": [1, 2, 3, 1, 1, 3, 3, 3, 2, 2, 1, 3, 2, 1, 3, 3, 3]},
                {"op": "offer", "rid": "r1", "num_tokens": 13, "load": "async"},
                {"op": "step", "rids": ["r1"], "budget": 64},
                {"op": "save", "rid": "r1"},
                {"op": "finish", "rid": "r1"},
                {"op": "loaded", "rid": "r1", "ok": True},
                {"op": "add", "rid": "r0", "prompt": [2, 3, 2, 1, 2, 2, 2, 2, 3]},
            ],
        }
    )


@pytest.mark.vllm
def test_nothing_is_judged_after_a_tolerated_crash() -> None:
    from invariants.harness.fuzz import _tolerance, replayer
    from invariants.targets import available_targets, target_factory
    from invariants.zoo.runner import MutantResult, _judge_unmutated, unmutated_entry

    if available_targets().get("vllm") is not None:
        pytest.skip(f"vllm target unavailable: {available_targets()['vllm']}")
    trace = post_crash_trace()
    tolerated = _tolerance("vllm")
    # Control: stepped on, the checker does flag the operation after the crash.
    checker = Checker(target_factory("vllm")(trace.config))
    found = [(i, v.check, bool(tolerated(v))) for i, op in enumerate(trace.ops) for v in checker.step(op)]
    assert (5, "crash", True) in found and (6, "snapshot", False) in found, found
    # The shrinker's predicate halts at the crash: no trace "fails" past it.
    assert replayer(target_factory("vllm"), trace.config, "snapshot", tolerated)(list(trace.ops)) is None
    # The zoo's soundness replay: clean up to the crash, nothing judged after it.
    entry = unmutated_entry("vllm", "scheduler-connector")
    result = MutantResult(entry.name, "vllm", "scheduler-connector", killed=True)
    _judge_unmutated(entry, trace.config, tuple(trace.ops), result)
    assert result.killed and not result.unsound


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        (
            ["agrees", "NOT EXERCISED: connector: x"],
            "NOT EXERCISED: 1 rows' required rules not reached in 300 steps",
        ),
        (["NOT EXERCISED: connector: x", "FINDING: snapshot: y"], "FINDING (see above)"),
    ],
)
def test_verify_tells_an_unreached_conformance_row_from_a_finding(
    verdicts: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A conformance row whose required rules were not reached is neither green nor a finding."""
    from invariants.cli import verify
    from invariants.harness import conformance

    def fake(*, sink: list[Any], **_: Any) -> int:
        sink += [conformance.Row(f"row {i}", 1, 300, v, 0.1, v == "agrees") for i, v in enumerate(verdicts)]
        return 1

    monkeypatch.setattr(conformance, "run_conformance", fake)
    recorded: list[tuple[Any, ...]] = []
    run = SimpleNamespace(
        missing=lambda target: None,
        args=SimpleNamespace(quick=True, seed=0),
        out=tmp_path,
        record=lambda *row: recorded.append(row),
    )
    verify.row_conformance(run)  # type: ignore[arg-type]
    ((check, _target, verdict, _figure, _seconds, good, *_),) = recorded
    assert check == "conformance" and verdict == expected and good is False
