"""Run the zoo: every applicable check against each mutant; who killed it, how fast.

For one mutant, in order: its direct checks (`invariants.zoo.checks`), then
the fuzzer exactly as `kvretain fuzz --budget-s T` runs it
(`invariants.harness.fuzz.run_fuzz`: the stateful machine, invariants +
differential against the model, over the mutant's config strategy; batch i
uses `hypothesis.seed(seed + i)`, printed). Two times are reported from the
mutant's start: to the first violation line, and to the shrunk trace (the
fuzzer's own shrinker, bounded by `shrink_s` and by the budget). The shrunk
trace is then handed to `explore` (`invariants.explore.handover`) for what is
left of the mutant's budget: the shortest trace over its operations, and the
sentence naming the first observable that differs.

The trace's `target` is the unmutated target's name (so `kvretain replay`
runs it: clean on the unmutated target is the expected answer); its
`violation` names the mutant.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from invariants.explore.handover import Handover, shortest_trace
from invariants.harness.checker import Violation
from invariants.harness.fuzz import FuzzReport, run_fuzz
from invariants.harness.trace import Trace, write_trace
from invariants.report import Progress, table
from invariants.targets import REAL_SCHEDULER_TARGETS
from invariants.targets.base import Target
from invariants.zoo import checks as direct
from invariants.zoo.configs import strategy as config_strategy
from model.contract.config import Config
from model.contract.ops import Op

if TYPE_CHECKING:
    from invariants.zoo.mutants_scheduler import SchedulerMutant

Factory = Callable[[Config], Target]

EXAMPLES_PER_BATCH = 8
STEPS_PER_EXAMPLE = 40


@dataclass(frozen=True)
class ZooEntry:
    """One mutant on one target: how to activate it and how to hunt it."""

    name: str
    target: str
    summary: str
    strategy: str
    checks: tuple[str, ...]
    activate: Callable[[], AbstractContextManager[Factory]]
    doc: str = ""
    tolerated: Callable[[Violation], bool] | None = None
    control: bool = False  # the unmutated target run as a mutant: its "kill" is the finding


@dataclass
class MutantResult:
    name: str
    target: str
    strategy: str
    killed: bool
    check: str = "-"
    also: tuple[str, ...] = ()
    seconds_to_kill: float | None = None
    seconds_to_trace: float | None = None
    seconds: float = 0.0
    trace_path: Path | None = None
    seeds: str = "-"
    detail: str = ""
    steps: int = 0
    note: str = ""
    fuzz_ops: int | None = None  # the fuzz trace's length after shrinking
    handover: Handover | None = None  # explore's shortest trace, when the fuzzer killed it

    unsound: str = ""  # the violation the killing trace also meets on the unmutated target
    # Killed as policy drift (every contract kept, a predicted vLLM policy decided otherwise),
    # not as a defect: no check of a contract fired within the budget.
    drift: bool = False

    @property
    def verdict(self) -> str:
        if self.unsound:
            return "UNSOUND"
        if self.killed and self.drift:
            return "killed (drift)"
        return "killed" if self.killed else "SURVIVED"

    def trace_lengths(self) -> str:
        """`37 -> 5 (<=4 all)`: the fuzz trace, explore's, and the depth checked exhaustively."""
        if self.fuzz_ops is None:
            return "-"
        h = self.handover
        if h is None:
            return f"{self.fuzz_ops} (no budget left)"
        return f"{self.fuzz_ops} -> {len(h.ops)} (<={h.depth_completed} all)"


def run_entry(
    entry: ZooEntry,
    *,
    seed: int = 0,
    budget_s: float = 60.0,
    shrink_s: float = 10.0,
    out_dir: Path | None = Path("kvretain-traces/zoo"),
    progress: bool = True,
    max_batches: int | None = None,
) -> MutantResult:
    """Hunt one mutant: direct checks, then the machine; never raises for a target failure."""
    prog = Progress(f"zoo {entry.target} {entry.name}", enabled=progress)
    start = time.monotonic()
    result = MutantResult(entry.name, entry.target, entry.strategy, killed=False)
    killing: tuple[Config, tuple[Op, ...]] | None = None
    with entry.activate() as factory:
        _direct_checks(entry, factory, result, start, out_dir)
        if not result.killed:
            prog.tick(f"fuzz: strategy {entry.strategy}, seeds from {seed}", force=progress)
            killing = _fuzz_hunt(
                entry, factory, result, prog, start, seed, budget_s, shrink_s, out_dir, progress, max_batches
            )
    if killing is not None and not entry.control:
        _judge_unmutated(entry, *killing, result)
    result.seconds = time.monotonic() - start
    if result.unsound:
        prog.tick(
            f"UNSOUND: the killing trace fails the unmutated target too ({result.unsound})", force=progress
        )
    elif result.killed:
        prog.tick(f"killed by {result.check} in {result.seconds_to_kill:.1f}s", force=progress)
    else:
        prog.tick(f"SURVIVED {result.seconds:.1f}s ({result.steps} steps)", force=progress)
    return result


def _fuzz_hunt(
    entry: ZooEntry,
    factory: Factory,
    result: MutantResult,
    prog: Progress,
    start: float,
    seed: int,
    budget_s: float,
    shrink_s: float,
    out_dir: Path | None,
    progress: bool,
    max_batches: int | None,
) -> tuple[Config, tuple[Op, ...]] | None:
    """The fuzzer on the mutant for what is left of its budget, exactly as `kvretain fuzz` runs
    it; a kill (a defect, else policy drift) is recorded in `result` and its killing
    (config, operations) returned."""
    hunt_start = time.monotonic()
    report = run_fuzz(
        entry.target,
        factory=factory,
        strategy=config_strategy(
            entry.strategy,
            allow_pinning=entry.target == "reference",
            allow_fine=entry.target != "reference",
            real_scheduler=entry.target in REAL_SCHEDULER_TARGETS,
        ),
        tolerated=entry.tolerated or (lambda v: False),
        steps=None if max_batches is None else max_batches * EXAMPLES_PER_BATCH * STEPS_PER_EXAMPLE,
        seed=seed,
        budget_s=max(start + budget_s - hunt_start, 0.1),
        shrink_s=shrink_s,
        out_dir=out_dir or Path(tempfile.mkdtemp(prefix="kvretain-zoo-")),
        trace_name=f"zoo-{entry.target}-{entry.name}.json",
        progress=False,
        log=(lambda line: prog.tick(line, force=True)) if progress else None,
        stop_at_drift=True,
    )
    result.steps = report.stats.steps
    result.seeds = f"{seed}..{seed + report.batches - 1}" if report.batches else "-"
    if report.failure is not None and report.first_seen_s is not None:
        return _defect_kill(
            entry, factory, result, report, hunt_start - start, start, seed, budget_s, out_dir
        )
    if report.drift is not None:  # no defect, but a predicted policy decided otherwise
        d = report.drift
        result.killed, result.drift, result.check = True, True, "fuzz: policy_drift"
        result.seconds_to_kill = result.seconds_to_trace = hunt_start - start + report.seconds
        result.detail = d.violations[0].message
        result.seeds = str(seed + report.batches - 1)
        result.fuzz_ops = len(d.ops)
        result.note = "killed as policy drift: explore's hand-over takes defects only"
        result.trace_path = report.drift_trace_path
        return (d.config, tuple(d.ops))
    return None


def _defect_kill(
    entry: ZooEntry,
    factory: Factory,
    result: MutantResult,
    report: FuzzReport,
    hunt_offset: float,
    start: float,
    seed: int,
    budget_s: float,
    out_dir: Path | None,
) -> tuple[Config, tuple[Op, ...]]:
    """A fuzz kill by a broken contract: its checks and times recorded, its shrunk trace handed
    to explore for the shortest one (written, naming the mutant, when `out_dir` is given)."""
    assert report.failure is not None and report.first_seen_s is not None
    best = report.failure
    found = [v.check for v in best.violations]
    result.killed, result.check = True, f"fuzz: {found[0]}"
    result.also = tuple(dict.fromkeys(c for c in found[1:] if c != found[0]))
    result.seconds_to_kill = hunt_offset + report.first_seen_s
    result.seconds_to_trace = hunt_offset + report.seconds
    result.detail = str(best.violations[0])
    result.seeds = str(seed + report.batches - 1)
    result.fuzz_ops = len(best.ops)
    ops, v = _hand_over(
        entry,
        factory,
        best.config,
        tuple(best.ops),
        best.violations[0],
        result,
        deadline=start + budget_s,
    )
    if out_dir is not None:
        trace = Trace(
            best.config,
            list(ops),
            seed + report.batches - 1,
            entry.target,
            f"mutant {entry.name}: {v}",
        )
        result.trace_path = write_trace(trace, out_dir / f"zoo-{entry.target}-{entry.name}.json")
    return (best.config, ops)


def _direct_checks(
    entry: ZooEntry, factory: Factory, result: MutantResult, start: float, out_dir: Path | None
) -> None:
    """The mutant's direct checks in order, until one kills it (its trace written, needing
    the injected fault); a vacuous one is noted and the next tried."""
    for name in entry.checks:
        outcome = direct.DIRECT_CHECKS[name](factory)
        if outcome.vacuous:
            result.note = f"{name} vacuous: {outcome.vacuous}"
            continue
        if outcome.violation is None:
            continue
        result.killed, result.check = True, name
        result.seconds_to_kill = time.monotonic() - start
        result.detail = outcome.violation.message
        if out_dir is not None and outcome.config is not None:
            trace = Trace(
                outcome.config,
                outcome.ops,
                None,
                entry.target,
                f"mutant {entry.name}: {outcome.violation} (needs the injected fault)",
            )
            result.trace_path = write_trace(trace, out_dir / f"zoo-{entry.target}-{entry.name}.json")
        return


def _judge_unmutated(entry: ZooEntry, config: Config, ops: tuple[Op, ...], result: MutantResult) -> None:
    """A kill counts only if its trace is clean on the unmutated target: a trace that
    fails there too (a fault of the harness, the model or the shrinker, or a finding
    no claim covers) names no defect of the mutant. Run after the mutant's context is
    left (its patches are process-global), on the target the registry builds."""
    from invariants.harness.checker import Checker, InvalidOp
    from invariants.targets import target_factory

    tolerate = entry.tolerated or (lambda v: False)
    checker = Checker(target_factory(entry.target)(config))
    for i, op in enumerate(ops):
        try:
            violations = checker.step(op)
        except InvalidOp as exc:
            result.killed, result.unsound = False, f"op {i}: not a valid operation there: {exc}"
            return
        found = [v for v in violations if not tolerate(v)]
        if found:
            result.killed, result.unsound = False, f"op {i}: {found[0]}"
            return
        if any(v.check == "crash" for v in violations):
            return  # a tolerated crash: nothing after it is judged, on the mutant either


def _hand_over(
    entry: ZooEntry,
    factory: Factory,
    config: Config,
    ops: tuple[Op, ...],
    violation: Violation,
    result: MutantResult,
    deadline: float,
) -> tuple[tuple[Op, ...], Violation]:
    """The shortest trace explore finds within the budget left (the fuzz trace if none)."""
    if time.monotonic() >= deadline:
        return ops, violation
    tolerate = entry.tolerated or (lambda v: False)
    try:
        result.handover = shortest_trace(
            config, ops, violation, factory, entry.target, tolerate=tolerate, deadline=deadline
        )
    except Exception as exc:  # the kill stands on the fuzz trace; the table says why it was not shortened
        result.note = f"hand-over to explore failed: {type(exc).__name__}: {exc}"
        return ops, violation
    result.detail = result.handover.sentence
    return result.handover.ops, result.handover.violation


@dataclass
class ZooReport:
    target: str
    results: list[MutantResult]
    not_applicable: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kill_times(self) -> list[float]:
        return [r.seconds_to_kill for r in self.results if r.killed and r.seconds_to_kill is not None]

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.killed for r in self.results)

    def summary(self) -> str:
        killed = sum(r.killed for r in self.results)
        times = self.kill_times
        med = f"{statistics.median(times):.1f}" if times else "-"
        mx = f"{max(times):.1f}" if times else "-"
        rate = killed / len(self.results) if self.results else 0.0
        unsound = sum(bool(r.unsound) for r in self.results)
        drift = [r.name for r in self.results if r.killed and r.drift]
        return (
            f"zoo {self.target}: {killed}/{len(self.results)} killed ({rate:.0%}), "
            + f"{len(drift)} of them as policy drift ({', '.join(drift) or 'none'}), "
            + (f"{unsound} UNSOUND (their killing traces fail the unmutated target too), " if unsound else "")
            + f"median time to kill {med} s, max {mx} s, {len(self.not_applicable)} not applicable, "
            f"{self.seconds:.0f} s in all" + self.lengths_summary()
        )

    def lengths_summary(self) -> str:
        """The fuzz-killed mutants' trace lengths before and after the hand-over to explore."""
        pairs = [(r.fuzz_ops, len(r.handover.ops)) for r in self.results if r.fuzz_ops and r.handover]
        if not pairs:
            return ""
        before = sorted(p[0] for p in pairs)
        after = sorted(p[1] for p in pairs)
        return (
            f"; fuzz traces handed to explore: {len(pairs)}, operations median "
            f"{statistics.median(before):g} -> {statistics.median(after):g}, max {before[-1]} -> {after[-1]} "
            f"(lengths after: {', '.join(map(str, after))})"
        )

    def table(self) -> str:
        rows = []
        for r in self.results:
            first = r.check + (f" (+{', '.join(r.also[:3])})" if r.also else "")
            rows.append(
                (
                    r.name,
                    r.verdict,
                    first,
                    f"{r.seconds_to_kill:.2f}" if r.seconds_to_kill is not None else "-",
                    f"{r.seconds_to_trace:.2f}" if r.seconds_to_trace is not None else "-",
                    r.trace_lengths(),
                    r.strategy,
                    r.seeds,
                    str(r.trace_path) if r.trace_path else "-",
                )
            )
        for name, why in self.not_applicable:
            rows.append((name, "n/a", why, "-", "-", "-", "-", "-", "-"))
        return table(
            [
                "mutant",
                "verdict",
                "first check (+ others on that step)",
                "first violation s",
                "shrunk trace s",
                "ops fuzz -> explore",
                "configs",
                "seed",
                "trace",
            ],
            rows,
        )


def run_zoo(
    entries: list[ZooEntry],
    *,
    target: str,
    seed: int = 0,
    budget_s: float = 60.0,
    shrink_s: float = 10.0,
    out_dir: Path | None = Path("kvretain-traces/zoo"),
    progress: bool = True,
    not_applicable: list[tuple[str, str]] | None = None,
    on_result: Callable[[MutantResult], None] | None = None,
) -> ZooReport:
    start = time.monotonic()
    results = []
    for entry in entries:
        r = run_entry(
            entry, seed=seed, budget_s=budget_s, shrink_s=shrink_s, out_dir=out_dir, progress=progress
        )
        results.append(r)
        if on_result:
            on_result(r)
    return ZooReport(target, results, list(not_applicable or []), time.monotonic() - start)


# ------------------------------------------------------------------ entries
def reference_entries(only: list[str] | None = None) -> list[ZooEntry]:
    from invariants.zoo.mutants_reference import REFERENCE_MUTANTS, factory

    names = only or list(REFERENCE_MUTANTS)
    out = []
    for name in names:
        m = REFERENCE_MUTANTS[name]
        f = factory(name)
        out.append(
            ZooEntry(
                name,
                "reference",
                m.summary,
                m.strategy,
                m.checks,
                lambda f=f: contextlib.nullcontext(f),  # type: ignore[misc]
                doc=m.doc,
                tolerated=known_tolerance("reference"),
            )
        )
    return out


def unmutated_entry(target: str, strategy_name: str, checks: tuple[str, ...] = ()) -> ZooEntry:
    """The unmutated target run exactly like a mutant (the zoo's control: it must survive)."""
    from invariants.targets import target_factory

    tolerated = known_tolerance(target)
    f = target_factory(target)
    return ZooEntry(
        "(unmutated)",
        target,
        "control",
        strategy_name,
        checks,
        lambda: contextlib.nullcontext(f),
        tolerated=tolerated,
        control=True,
    )


def known_tolerance(target: str) -> Callable[[Violation], bool] | None:
    """Known findings of `target` do not count as kills (nor flag the control)."""
    try:
        from invariants.harness.known_findings import is_known_violation
    except ImportError:
        return None
    return lambda v: bool(is_known_violation(target, v))


def scheduler_entries(only: list[str] | None = None) -> list[ZooEntry]:
    """The mutants of vLLM's `Scheduler`, on the vllm target."""
    from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS, activate

    return _mutant_entries("vllm", SCHEDULER_MUTANTS, activate, only)


def async_scheduler_entries(only: list[str] | None = None) -> list[ZooEntry]:
    """The mutants of vLLM's `AsyncScheduler` path, on the vllm-async-scheduler target."""
    from invariants.zoo.mutants_scheduler import ASYNC_SCHEDULER_MUTANTS, activate_async

    return _mutant_entries("vllm-async-scheduler", ASYNC_SCHEDULER_MUTANTS, activate_async, only)


def _mutant_entries(
    target: str,
    mutants: dict[str, SchedulerMutant],
    activate: Callable[[str], AbstractContextManager[Factory]],
    only: list[str] | None,
) -> list[ZooEntry]:
    """One entry per mutant of `mutants` (those named in `only`), run on `target`
    with `activate(name)` yielding its factory."""
    tolerated = known_tolerance(target)
    entries = []
    for name in only or list(mutants):
        if name not in mutants:
            continue
        m = mutants[name]

        @contextlib.contextmanager
        def ctx(name: str = name) -> Iterator[Factory]:
            with activate(name) as factory:
                yield factory

        entries.append(ZooEntry(name, target, m.summary, m.strategy, (), ctx, doc=m.doc, tolerated=tolerated))
    return entries


def vllm_entries(
    only: list[str] | None = None, *, target: str = "vllm-manager"
) -> tuple[list[ZooEntry], list[tuple[str, str]]]:
    """The mutants of vLLM's allocator (`mutants_vllm`), hunted on `target`: "vllm-manager"
    (kvretain re-creates the scheduler's calls) or "vllm" (the real `Scheduler` makes them,
    so a kill there is a defect a serving engine meets)."""
    from invariants.zoo.mutants_vllm import NOT_APPLICABLE, VLLM_MUTANTS, activate

    tolerated = known_tolerance(target)
    names = only or list(VLLM_MUTANTS)
    entries = []
    for name in names:
        if name not in VLLM_MUTANTS:
            continue
        m = VLLM_MUTANTS[name]

        @contextlib.contextmanager
        def ctx(name: str = name) -> Iterator[Factory]:
            with activate(name, target) as factory:
                yield factory

        entries.append(
            ZooEntry(name, target, m.summary, m.strategy, m.checks, ctx, doc=m.doc, tolerated=tolerated)
        )
    na = [(n, why) for n, why in NOT_APPLICABLE.items() if only is None or n in only]
    return entries, na
