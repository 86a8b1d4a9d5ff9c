"""`kvretain export`: a trace becomes a standalone vLLM regression test.

For each known finding the exported test fails on vLLM 0.33.0 with the
property's message and passes once the defect is fixed (a fix applied to
vLLM as a monkeypatch here); a test exported from a zoo mutant's trace fails
with the mutant and passes without it. The checked-in files under
docs/findings/ are exactly what the exporter writes today.

Only the property is an assertion: a setup step that no longer gives the
trace's value raises the file's own `SetupDiverged`, so under docs/findings'
conftest (strict expected failures on AssertionError) a vLLM change that
moves a setup value fails the suite instead of staying an expected failure.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import itertools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from invariants.cli.main import main
from invariants.export.issue import run_exported
from invariants.export.plan import ExportError, plan_export
from invariants.export.pytest_file import exported_test_name, render_test, tokens_literal
from invariants.harness.known_findings import load_known_findings
from invariants.harness.trace import Trace, read_trace, trace_to_json, write_trace
from invariants.targets.vllm_env import MODELED_VERSION, vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Op, Sample, Schedule, Step

ROOT = Path(__file__).resolve().parent.parent
ALL_FINDINGS = {f.id: f for f in load_known_findings()}
# Findings of releases other than the pinned one replay through the release
# matrix (`kvretain replay --vllm-python`), not through this vLLM.
FINDINGS = {fid: f for fid, f in ALL_FINDINGS.items() if "*" in f.versions or MODELED_VERSION in f.versions}
# Pinned-release findings without an exported test yet, each with its reason.
NOT_EXPORTED: dict[str, str] = {}
# Findings recorded on vLLM's real scheduler (drafts, connectors, async scheduling):
# exported from the target's recorded calls, tested in tests/test_export_engine.py.
ENGINE = {
    fid
    for fid, f in FINDINGS.items()
    if (f.trace.target or "").startswith("vllm") and f.trace.target != "vllm-manager"
}
FINDINGS = {fid: f for fid, f in FINDINGS.items() if fid not in NOT_EXPORTED and fid not in ENGINE}
_counter = itertools.count()

needs_vllm = pytest.mark.skipif(not vllm_available()[0], reason=vllm_available()[1])


def load_exported(source: str, tmp_path: Path) -> Callable[[], None]:
    """Import an exported file and return its test function."""
    path = tmp_path / f"exported_{next(_counter)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    assert len(tests) == 1
    return tests[0]  # type: ignore[no-any-return]


# ------------------------------------------------------------------ fixes of vLLM, as monkeypatches
def fix_blockstored_token_range(mp: pytest.MonkeyPatch) -> None:
    """One BlockStored per contiguous run of stored blocks, carrying that run's tokens."""
    import msgspec
    from vllm.v1.core import block_pool as bp
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

    orig = bp.BlockPool.cache_full_blocks

    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Any = None,
    ) -> None:
        before = len(self.kv_event_queue)
        num_cached, num_full = num_cached_blocks, num_full_blocks
        orig(self, request, blocks, num_cached, num_full, block_size, kv_cache_group_id, block_mask)
        if len(self.kv_event_queue) == before:
            return
        ev = self.kv_event_queue.pop()
        stored = [
            i
            for i in range(num_cached, num_full)
            if not blocks[i].is_null and (block_mask is None or block_mask[i - num_cached])
        ]
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        k = 0
        for run in runs:
            n = len(run)
            self.kv_event_queue.append(
                msgspec.structs.replace(
                    ev,
                    block_hashes=ev.block_hashes[k : k + n],
                    parent_block_hash=None if run[0] == 0 else maybe_convert_block_hash(hashes[run[0] - 1]),
                    token_ids=request.all_token_ids[run[0] * block_size : (run[-1] + 1) * block_size],
                    extra_keys=None if ev.extra_keys is None else ev.extra_keys[k : k + n],
                )
            )
            k += n

    mp.setattr(bp.BlockPool, "cache_full_blocks", cache_full_blocks)


def fix_eagle_swa_short_run(mp: pytest.MonkeyPatch) -> None:
    """Not-found path with Eagle: trim the leading run so that it is aligned after the
    Eagle drop, then drop once (no second re-alignment)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    cls = stm.SlidingWindowManager
    orig = cls.find_longest_cache_hit.__func__  # type: ignore[attr-defined]

    def find_longest_cache_hit(
        klass: Any,
        block_hashes: Any,
        max_length: int,
        kv_cache_group_ids: Any,
        block_pool: Any,
        kv_cache_spec: Any,
        drop_eagle_block: bool,
        alignment_tokens: int,
        **kw: Any,
    ) -> Any:
        group_ids, pool, spec = kv_cache_group_ids, block_pool, kv_cache_spec
        blocks, hit = orig(
            klass, block_hashes, max_length, group_ids, pool, spec, drop_eagle_block, alignment_tokens, **kw
        )
        bs = spec.block_size
        if not drop_eagle_block or bs == alignment_tokens:
            return blocks, hit
        hashes = resolve_block_hashes(
            block_hashes,
            pool.hash_block_size,
            bs,
            supports_fine_grained_hash_lookup=klass.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        run = []
        for i in range(max_length // bs):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if cached is None:
                break
            run.append(cached)
        if len(run) >= klass._contiguous_blocks_for_hit(spec.sliding_window, bs, True):
            return blocks, hit  # a full window: the found path decides
        keep = len(run)
        while keep > 0 and (keep - 1) * bs % alignment_tokens:
            keep -= 1
        if keep == 0 or (keep - 1) * bs <= hit:
            return blocks, hit
        fixed = tuple(list(per_group) for per_group in zip(*run[: keep - 1], strict=True))
        return fixed, (keep - 1) * bs

    mp.setattr(cls, "find_longest_cache_hit", classmethod(find_longest_cache_hit))


FIXES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "vllm-blockstored-token-range": (
        fix_blockstored_token_range,
        "BlockStored events of group 1 carry 96 token ids",
    ),
    # Dense retention: the gap is a null (skipped) Mamba block, not the block mask.
    "vllm-blockstored-token-range-dense": (
        fix_blockstored_token_range,
        "BlockStored events of group 2 carry 12 token ids",
    ),
    "eagle-swa-short-run-double-pop": (fix_eagle_swa_short_run, r"hits 0 tokens; retention promised 8"),
}


def _cow_control(trace: Trace) -> Trace:
    """The same requests, r8 admitted one step after r7: the copy's source was
    written by r7's step, so the copy reads cached state."""
    last = trace.ops[-1]
    assert isinstance(last, Step) and last.rids == ("r7", "r8")
    ops = [*trace.ops[:-1], Step(("r7",), last.budget), Step(("r8",), last.budget)]
    return Trace(trace.config, ops, trace.seed, trace.target, trace.violation)


# Findings whose exported test repeats the specification's decisions in a batched
# step (which a fix in vLLM changes too): the control is a trace without the
# violation, on which the same exported assertion must pass.
CONTROLS: dict[str, tuple[Callable[[Trace], Trace], str]] = {
    "vllm-cow-copy-of-same-step-block": (
        _cow_control,
        r"copies \(source, destination\) \[\(1, 5\)\]: source was allocated in the same step",
    ),
}


def test_every_known_finding_has_a_fix_here() -> None:
    assert set(FIXES) | set(CONTROLS) == set(FINDINGS) and not set(FIXES) & set(CONTROLS)
    assert set(NOT_EXPORTED) <= set(ALL_FINDINGS), "a NOT_EXPORTED entry names no known finding"


# ------------------------------------------------------------------ known findings
@pytest.mark.parametrize("fid", sorted(FINDINGS))
def test_checked_in_export_is_current(fid: str) -> None:
    plan = plan_export(FINDINGS[fid].trace)
    path = ROOT / "docs" / "findings" / f"{exported_test_name(plan)}.py"
    assert path.read_text() == render_test(plan), f"re-export {fid}: kvretain export TRACE --out {path}"


@pytest.mark.parametrize("fid", sorted(FINDINGS))
def test_exported_file_imports_only_vllm_and_pytest(fid: str) -> None:
    source = render_test(plan_export(FINDINGS[fid].trace))
    tops = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            tops.add(node.module.split(".")[0])
    assert tops <= {"vllm", "torch", "pytest", "types"}, tops


@needs_vllm
@pytest.mark.parametrize("fid", sorted(FIXES))
def test_finding_fails_on_vllm_then_passes_fixed(
    fid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    test = load_exported(render_test(plan_export(FINDINGS[fid].trace)), tmp_path)
    fix, message = FIXES[fid]
    with pytest.raises(AssertionError, match=message):
        test()
    fix(monkeypatch)
    test()  # the property holds once the defect is fixed


@needs_vllm
@pytest.mark.parametrize("fid", sorted(CONTROLS))
def test_finding_fails_on_vllm_control_trace_passes(fid: str, tmp_path: Path) -> None:
    control, message = CONTROLS[fid]
    test = load_exported(render_test(plan_export(FINDINGS[fid].trace)), tmp_path)
    with pytest.raises(AssertionError, match=message):
        test()
    plan = plan_export(control(FINDINGS[fid].trace))
    assert plan.expectation.kind == ALL_FINDINGS[fid].property.replace("copies_sound", "copies")
    load_exported(render_test(plan), tmp_path)()  # the same assertion holds without the violation


@needs_vllm
def test_step_chunks_are_checked_against_the_scheduler_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's chunks are the specification's literals; with a Mamba group the
    exported test checks each against vLLM's own split (control: a split that
    gives one token less is caught before any allocation)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    test = load_exported(
        render_test(plan_export(FINDINGS["vllm-cow-copy-of-same-step-block"].trace)), tmp_path
    )
    orig = Scheduler._mamba_block_aligned_split
    monkeypatch.setattr(
        Scheduler,
        "_mamba_block_aligned_split",
        lambda self, req, n, *a: max(orig(self, req, n, *a) - 1, 0),
    )
    # A setup step: the file's own SetupDiverged, not the property's AssertionError.
    diverged = test.__globals__["SetupDiverged"]
    assert not issubclass(diverged, AssertionError)
    with pytest.raises(diverged, match=r"r1: Scheduler's Mamba split \(tokens\): got 3, expected 4"):
        test()


def test_batched_step_is_exported_call_by_call() -> None:
    """The step's decisions come from the specification: two admissions, the
    second with the 4-token fine-grained hit, each with its allocation asserted."""
    plan = plan_export(FINDINGS["vllm-cow-copy-of-same-step-block"].trace)
    last = len(plan.trace.ops) - 1
    assert [(a.kind, a.rid, a.hit, a.tokens, a.fits) for a in plan.steps[last]] == [
        ("admit", "r7", 0, 16, True),
        ("admit", "r8", 4, 8, True),
    ]
    source = render_test(plan)
    assert "NUM_LOOKAHEAD_TOKENS = 1" in source and "num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS" in source
    assert "admit(manager, req_r8, expected_hit=4, num_new_tokens=8, left=4080, step_budget=4096)" in source
    # The copy is the property; the step's decisions are setup: checked with expect.
    assert 'expect("r8: admitted (room for its first 8 token(s))", blocks is not None, True)' in source
    assert "final" not in source
    assert source.count("manager.new_step_starts()") == 2 + source.count("def schedule_step")


def test_step_with_preemption_is_exported_in_scheduler_order(tmp_path: Path) -> None:
    """A running request whose allocation fails preempts the newest running
    request and retries; the waiting pass is skipped after a preemption."""
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=4)
    ops: list[Op] = [
        AddRequest("a", tuple(range(1, 5))),
        AddRequest("b", tuple(range(11, 15))),
        AddRequest("c", tuple(range(21, 23))),
        Step(("a", "b", "c"), 64),
        Sample("a", 5),
        Sample("b", 15),
        Sample("c", 23),
        Step(("a", "b", "c"), 64),
    ]
    trace = Trace(
        cfg, ops, seed=0, target="vllm-manager", violation="snapshot: (none: a differential control)"
    )
    plan = plan_export(trace)
    # a finds no room: c (newest) gives way, a retries; b finds none: b gives way.
    assert [(a.kind, a.rid, a.fits) for a in plan.steps[7]] == [
        ("run", "a", False),
        ("preempt", "c", True),
        ("run", "a", True),
        ("run", "b", False),
        ("preempt", "b", True),
    ]
    source = render_test(plan)
    assert "preempt(manager, req_c)" in source and "admit(manager, req_c" in source
    # A differential export: the last step's decisions are its property (asserted), the
    # first step's are setup (SetupDiverged).
    first, last = source.split("# One scheduler step")[1:]
    assert 'expect("a: admitted (room for its first 4 token(s))", blocks is not None, True)' in first
    assert "final=True" not in first
    assert "expect(" not in last and "blocks = run_chunk(manager, req_b, 1)" in last
    assert 'assert blocks is None, "b: room for its next 1 token(s): expected False"' in last
    if vllm_available()[0]:
        load_exported(source, tmp_path)()  # vLLM makes the same decisions


# ------------------------------------------------------------------ a zoo mutant
def _mutant_trace(name: str) -> Trace:
    """A small trace, with the violation the mutated vLLM really shows on it."""
    from invariants.harness.replay import replay
    from invariants.zoo.mutants_vllm import activate

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops: list[Op] = [AddRequest("r0", tuple(range(1, 10))), Schedule("r0", 16), Finish("r0")]
    trace = Trace(cfg, list(ops), seed=0, target="vllm-manager")
    with activate(name):
        result = replay(trace, "vllm-manager", stop_at_first=True)
    assert result.violations, f"{name}: the trace does not show the mutant"
    i, v = result.violations[0]
    trace.ops = trace.ops[: i + 1]
    trace.violation = str(v)
    return trace


@needs_vllm
def test_mutant_export_fails_with_mutant_passes_without(tmp_path: Path) -> None:
    from invariants.zoo.mutants_vllm import activate

    trace = _mutant_trace("cached_blocks_prepended")
    plan = plan_export(trace)
    assert plan.expectation.kind == "state"
    test = load_exported(render_test(plan), tmp_path)
    test()  # unmutated vLLM keeps the property
    with activate("cached_blocks_prepended"), pytest.raises(AssertionError, match="free queue"):
        test()


# ------------------------------------------------------------------ the command
def _finding_file(tmp_path: Path, fid: str, among: dict[str, Any] | None = None) -> Path:
    return write_trace((among or FINDINGS)[fid].trace, tmp_path / f"{fid}.json")


def test_cli_writes_test_and_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _finding_file(tmp_path, "eagle-swa-short-run-double-pop")
    out, issue = tmp_path / "t.py", tmp_path / "report.md"
    assert main(["export", str(trace), "--out", str(out), "--issue", str(issue)]) == 0
    source = out.read_text()
    ast.parse(source)
    assert "def test_eagle_swa_short_run_double_pop():" in source
    report = issue.read_text()
    for heading in (
        "### Your current environment",
        "### Shortest trace",
        "### Expected vs actual",
        "### Regression test",
    ):
        assert heading in report
    assert "hits at least 8 tokens" in report and source.strip() in report
    if vllm_available()[0]:
        assert "fails on vLLM 0.33.0: replaying the 17-token prompt" in report


def test_cli_exports_a_batched_step_finding(tmp_path: Path) -> None:
    trace = _finding_file(tmp_path, "vllm-cow-copy-of-same-step-block")
    out, issue = tmp_path / "t.py", tmp_path / "report.md"
    assert main(["export", str(trace), "--out", str(out), "--issue", str(issue)]) == 0
    report = issue.read_text()
    assert "no copy-on-write copy of the last step reads a block that step allocated" in report
    if vllm_available()[0]:
        assert "fails on vLLM 0.33.0: copies (source, destination) [(1, 5)]: source was allocated" in report


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.update(violation=None), "records no violation"),
        (lambda d: d.update(violation="no_such_check: x"), "unknown check 'no_such_check'"),
        (lambda d: d.update(ops=[]), "empty"),
        (lambda d: d["ops"].insert(0, {"op": "finish", "rid": "nobody"}), "trace.ops[0]: not well formed"),
        (lambda d: d.update(format="other"), "trace.format"),
        (
            lambda d: d.update(
                violation="copies_sound: copy 1 -> 2: destination read by 2 block-table entries"
            ),
            "copies_sound is exported only for a copy whose source was allocated in the same step",
        ),
        (
            lambda d: d.update(violation="copies_sound: copy 1 -> 2: source was allocated in the same step"),
            "copies_sound is exported after a batched Step",
        ),
    ],
)
def test_bad_trace_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None], needle: str
) -> None:
    data = trace_to_json(FINDINGS["vllm-blockstored-token-range"].trace)
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out, issue = tmp_path / "t.py", tmp_path / "r.md"
    assert main(["export", str(path), "--out", str(out), "--issue", str(issue)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists() and not issue.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_bad_output_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _finding_file(tmp_path, "vllm-blockstored-token-range")
    assert main(["export", str(trace), "--out", str(tmp_path / "t.txt")]) == 2
    assert main(["export", str(trace), "--issue", str(tmp_path / "r.txt")]) == 2
    assert main(["export", str(tmp_path / "missing.json")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace.name]


def test_plan_rejects_a_promise_without_a_finish() -> None:
    trace = read_trace_copy("eagle-swa-short-run-double-pop")
    trace.ops = trace.ops[:-1]
    with pytest.raises(ExportError, match="last op is not one"):
        plan_export(trace)


def read_trace_copy(fid: str) -> Trace:
    f = FINDINGS[fid].trace
    return Trace(f.config, list(f.ops), f.seed, f.target, f.violation)


@pytest.mark.parametrize(
    "tokens, literal",
    [
        ((1, 2, 3, 4), "list(range(1, 5))"),
        ((1, 1, 1), "[1] * 3"),
        ((1, 2, 1, 2), "[1, 2] * 2"),
        ((3, 1), "[3, 1]"),
    ],
)
def test_tokens_literal(tokens: tuple[int, ...], literal: str) -> None:
    assert tokens_literal(tokens) == literal
    assert list(eval(literal)) == list(tokens)


def test_read_trace_round_trip(tmp_path: Path) -> None:
    path = _finding_file(tmp_path, "eagle-swa-short-run-double-pop")
    plan = plan_export(read_trace(path))
    assert plan.finding is not None and plan.finding.id == "eagle-swa-short-run-double-pop"
    assert plan.expectation.hit == 8 and (2, 12, "Eagle peek block") in plan.expectation.needed


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(_vllm_version() != "0.33.0", reason="strict only on the vLLM the findings were found on")
def test_findings_suite_reports_a_fixed_finding(tmp_path: Path) -> None:
    """The day vLLM fixes a finding, its exported test passes: under docs/findings'
    conftest that is an XPASS(strict), a failure of the suite (control: a test
    that still fails is an expected failure)."""
    import subprocess
    import sys

    findings = tmp_path / "findings"
    findings.mkdir()
    shutil.copy(ROOT / "docs" / "findings" / "conftest.py", findings / "conftest.py")
    (findings / "test_fixed.py").write_text("def test_fixed_upstream():\n    assert True\n")
    (findings / "test_open.py").write_text("def test_still_open():\n    assert 0 == 4, 'hit 0, promised 4'\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rxX", str(findings)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout
    assert "XPASS(strict)" in out.stdout and "1 xfailed" in out.stdout, out.stdout


def _recorded_traces(seed: int, examples: int) -> list[Trace]:
    """Well-formed operation sequences from the fuzzer's own state machine (on the model)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import get_state_machine_test

    from invariants.harness.machine import build_machine
    from invariants.harness.strategies import configs
    from invariants.targets.model_target import ModelTarget

    recorded: list[tuple[Config, list[Op]]] = []

    class Recorder(ModelTarget):
        # Request identities (salt, LoRA, multimodal) are not exported yet: none drawn.
        identities: frozenset[str] = frozenset()

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.ops: list[Op] = []
            recorded.append((config, self.ops))

        def apply(self, op: Op) -> Any:
            self.ops.append(op)
            return super().apply(op)

    machine = build_machine(Recorder, configs(allow_pinning=False), tolerated=lambda v: True)
    s = settings(
        max_examples=examples,
        stateful_step_count=12,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    hypothesis_seed(seed)(get_state_machine_test(machine, settings=s))()

    return [
        Trace(cfg, ops[:40], seed, "vllm-manager", "snapshot: (none: a differential control)")
        for cfg, ops in recorded
        if ops
    ]


@needs_vllm
@pytest.mark.parametrize("seed", [3, 8])
def test_state_exports_of_fuzzed_traces_pass_on_vllm(seed: int, tmp_path: Path) -> None:
    """Differential control of the exporter: on traces where vLLM agrees with the
    model, the exported test (its own replay through vLLM's API, Mamba chunks
    from vLLM's scheduler split, batched steps call by call, lookahead slots)
    must pass; a wrong replay would fail it."""
    traces = _recorded_traces(seed=seed, examples=16)
    assert len(traces) >= 6
    kinds = {type(op).__name__ for t in traces for op in t.ops}
    assert {"AddRequest", "Schedule", "Step", "Finish"} <= kinds
    assert any(t.config.num_lookahead_tokens for t in traces)
    tests = []
    for t in traces:
        plan = plan_export(t)
        assert plan.expectation.kind == "state"
        tests.append(load_exported(render_test(plan), tmp_path))
        tests[-1]()
    # Control: the same exported tests have teeth on a mutated vLLM.
    from invariants.zoo.mutants_vllm import activate

    failed = 0
    with activate("cached_blocks_prepended"):
        for test in tests:
            try:
                test()
            except AssertionError:
                failed += 1
            except test.__globals__["SetupDiverged"]:
                failed += 1  # the mutant moved a value an earlier operation checks
    assert failed >= 1


# ------------------------------------------------------------------ the findings suite's verdicts
on_found_vllm = pytest.mark.skipif(
    _vllm_version() != "0.33.0", reason="strict only on the vLLM the findings were found on"
)


def fix_cow_no_hit_in_same_step_block(mp: pytest.MonkeyPatch) -> None:
    """A plausible fix of vllm-cow-copy-of-same-step-block that moves a setup value: the
    lookup takes no hit from a block handed out in the current step (this step's forward
    pass writes it after the copies run), so such a request misses instead. In the
    finding's trace r8's hit, 4 inside r7's new block, becomes 0."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    handed_out: set[int] = set()  # block ids allocate_slots returned since new_step_starts
    new_step_starts = KVCacheManager.new_step_starts
    allocate_slots = KVCacheManager.allocate_slots
    get_computed_blocks = KVCacheManager.get_computed_blocks

    def new_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        handed_out.clear()
        return new_step_starts(self, *args, **kwargs)

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = allocate_slots(self, *args, **kwargs)
        if blocks is not None:
            handed_out.update(b for ids in blocks.get_block_ids() for b in ids if b)
        return blocks

    def lookup(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        blocks, hit, boundary = get_computed_blocks(self, request, *args, **kwargs)
        if handed_out & {b for ids in blocks.get_block_ids() for b in ids if b}:
            return self.empty_kv_cache_blocks, 0, 0
        return blocks, hit, boundary

    mp.setattr(KVCacheManager, "new_step_starts", new_step)
    mp.setattr(KVCacheManager, "allocate_slots", allocate)
    mp.setattr(KVCacheManager, "get_computed_blocks", lookup)


class _TestReports:
    """A pytest plugin: each test's report (its call, or the phase that failed), by file stem."""

    def __init__(self) -> None:
        self.by_file: dict[str, pytest.TestReport] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.failed:
            self.by_file[Path(report.nodeid.partition("::")[0]).stem] = report

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        assert not report.failed, f"collecting {report.nodeid}: {report.longrepr}"


def run_as_findings(sources: dict[str, str], tmp_path: Path) -> tuple[int, dict[str, pytest.TestReport]]:
    """Run exported files as `make test` runs docs/findings (under its conftest), in this
    process so that a fix the caller monkeypatched into vLLM applies: pytest's exit code
    and each test's report, by file stem (the keys of `sources`)."""
    findings = tmp_path / "findings"  # the conftest marks the tests of a folder so named
    findings.mkdir()
    shutil.copy(ROOT / "docs" / "findings" / "conftest.py", findings / "conftest.py")
    # Unique file names: the outer session may hold docs/findings' modules by their names.
    stems = {f"{stem}_run{next(_counter)}": stem for stem in sources}
    for unique, stem in stems.items():
        (findings / f"{unique}.py").write_text(sources[stem])
    reports = _TestReports()
    modules, path = dict(sys.modules), list(sys.path)
    try:
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-rxX", str(findings)], plugins=[reports])
    finally:
        # The run imported its conftest and test files under bare names (unloading ours):
        # undo that, so that the next run imports its own files and we keep our conftest.
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(findings)):
                del sys.modules[name]
        sys.modules.update({k: v for k, v in modules.items() if k not in sys.modules})
        sys.path[:] = path
    return int(code), {stems[unique]: report for unique, report in reports.by_file.items()}


def _verdict(report: pytest.TestReport) -> str:
    """'xfailed', 'XPASS(strict)', 'xpassed', 'passed' or 'failed', as `pytest -rxX` says."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed and str(report.longrepr).startswith("[XPASS(strict)]"):
        return "XPASS(strict)"
    return report.outcome


@needs_vllm
@on_found_vllm
def test_exported_unpatched_findings_xfail(tmp_path: Path) -> None:
    """Unpatched, each checked-in finding is an expected failure: it reaches the finding's
    state and fails the property's assertion (raises=AssertionError; a setup divergence
    would be a failure)."""
    sources = {p.stem: p.read_text() for p in sorted((ROOT / "docs" / "findings").glob("test_*.py"))}
    assert len(sources) == len(FINDINGS) + len(ENGINE)
    code, reports = run_as_findings(sources, tmp_path)
    assert {stem: _verdict(r) for stem, r in reports.items()} == dict.fromkeys(sources, "xfailed")
    assert code == 0


@needs_vllm
@on_found_vllm
def test_exported_setup_divergence_fails_not_xfails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of issue 24: a plausible vLLM fix that moves a setup value
    (no hit from a block handed out in the same step: r8's hit 4 becomes 0) fails the
    findings suite with SetupDiverged, naming the step and both values, instead of
    passing as an expected failure. Control: the same file with its setup checks
    assertions again (as exported before) stays an expected failure under the same fix,
    the blind spot this closes."""
    source = render_test(plan_export(FINDINGS["vllm-cow-copy-of-same-step-block"].trace))
    as_before = source.replace("class SetupDiverged(Exception):", "class SetupDiverged(AssertionError):")
    assert as_before != source
    fix_cow_no_hit_in_same_step_block(monkeypatch)
    code, reports = run_as_findings({"test_setup_diverged": source, "test_as_before": as_before}, tmp_path)
    diverged = reports["test_setup_diverged"]
    assert _verdict(diverged) == "failed", diverged.longrepr
    assert "SetupDiverged: r8: prefix-cache hit: got 0, expected 4" in str(diverged.longrepr)
    assert "the trace no longer reaches the finding's state: re-derive the finding" in str(diverged.longrepr)
    assert _verdict(reports["test_as_before"]) == "xfailed"
    assert code == 1


@needs_vllm
@on_found_vllm
def test_report_says_when_the_trace_no_longer_reaches_the_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream report's verdict row tells a setup divergence from a failure."""
    source = render_test(plan_export(FINDINGS["vllm-cow-copy-of-same-step-block"].trace))
    assert run_exported(source).startswith("fails on vLLM 0.33.0: copies (source, destination)")
    fix_cow_no_hit_in_same_step_block(monkeypatch)
    assert run_exported(source).startswith(
        "does not reach the finding's state on vLLM 0.33.0: r8: prefix-cache hit: got 0, expected 4"
    )


@needs_vllm
@on_found_vllm
@pytest.mark.parametrize("fid", sorted(FIXES))
def test_exported_property_fix_is_a_strict_xpass(
    fid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fix of the property itself (setup values unchanged): the exported test passes,
    which under the findings' conftest is an XPASS(strict), a failure of the suite."""
    plan = plan_export(FINDINGS[fid].trace)
    FIXES[fid][0](monkeypatch)
    code, reports = run_as_findings({exported_test_name(plan): render_test(plan)}, tmp_path)
    assert [_verdict(r) for r in reports.values()] == ["XPASS(strict)"]
    assert code == 1


@needs_vllm
def test_a_trace_the_renderer_refuses_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real scheduler's trace whose property has no assertion in the engine file passes
    the plan but not the renderer: one line, exit 2 (control: the same trace with its own
    violation exports)."""
    data = trace_to_json(ALL_FINDINGS["sync-load-failed-block-hash-kept"].trace)
    data["violation"] = "no_waste: group 0 keeps block 3 cached although no retained boundary needs it"
    trace = tmp_path / "unwritten.json"
    trace.write_text(json.dumps(data))
    out = tmp_path / "t.py"
    assert main(["export", str(trace), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no property assertion for the real scheduler's no_waste" in err, (
        err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unwritten.json"]
    good = _finding_file(tmp_path, "sync-load-failed-block-hash-kept", ALL_FINDINGS)
    assert main(["export", str(good), "--out", str(out)]) == 0 and out.exists()


@needs_vllm
def test_a_stored_tokens_finding_after_a_batched_step_asserts_the_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BlockStored finding whose last operation is a batched Step is exported as the
    events' assertion (it was rendered as an empty end-state assertion that failed on
    unrelated state): it fails on 0.33.0 on the events and passes under the fix."""
    trace = read_trace(Path(__file__).parent / "data" / "export_stored_tokens_after_step.json")
    assert isinstance(trace.ops[-1], Step)
    source = render_test(plan_export(trace))
    assert "stored = stored_token_ids(" in source and "assert free_queue ==" not in source
    test = load_exported(source, tmp_path)
    with pytest.raises(AssertionError, match="BlockStored events of group 1 carry 16 token ids"):
        test()
    fix_blockstored_token_range(monkeypatch)
    test()
