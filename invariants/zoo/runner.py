"""Run the zoo: every applicable check against each mutant; who killed it, how fast.

For one mutant, in order: its direct checks (`invariants.zoo.checks`), then
the stateful machine (`invariants.machine.build_machine`: invariants +
differential against the model) over the mutant's config strategy. Fuzzing
runs in batches; batch i uses `hypothesis.seed(seed + i)` (the seeds are
printed), so the same command gives the same verdicts. The time to kill is
measured from the mutant's start to the first violation (direct checks
included, shrinking excluded); Hypothesis then shrinks the trace for at most
`shrink_s` seconds (after that every candidate is rejected and the smallest
failing trace seen so far is kept) and the trace is written with
`invariants.trace.write_trace`.

The trace's `target` is the unmutated target's name (so `kvretain replay`
runs it: clean on the unmutated target is the expected answer); its
`violation` names the mutant.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Verbosity, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from invariants.harness.checker import Violation
from invariants.harness.machine import FuzzStats, ViolationFound, build_machine
from invariants.harness.trace import Trace, write_trace
from invariants.report import Progress, table
from invariants.targets.base import Target
from invariants.zoo import checks as direct
from invariants.zoo.configs import strategy as config_strategy
from model.config import Config

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


@dataclass
class MutantResult:
    name: str
    target: str
    strategy: str
    killed: bool
    check: str = "-"
    also: tuple[str, ...] = ()
    seconds_to_kill: float | None = None
    seconds: float = 0.0
    trace_path: Path | None = None
    seeds: str = "-"
    detail: str = ""
    steps: int = 0
    note: str = ""

    @property
    def verdict(self) -> str:
        return "killed" if self.killed else "SURVIVED"


@dataclass
class _Hunt:
    """What the machine saw: first detection time, smallest failing trace, shrink cut-off."""

    shrink_s: float
    first_at: float | None = None
    best: ViolationFound | None = None
    batches: int = 0

    def record(self, failure: ViolationFound) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        if self.best is None or len(failure.ops) <= len(self.best.ops):
            self.best = failure

    def stop_shrinking(self) -> bool:
        return self.first_at is not None and time.monotonic() - self.first_at > self.shrink_s


def _machine(
    factory: Factory,
    cfg_strategy: object,
    stats: FuzzStats,
    hunt: _Hunt,
    tolerated: Callable[[Violation], bool] | None,
) -> type:
    def guarded(config: Config) -> Target:
        if hunt.stop_shrinking():
            reject()
        try:
            return factory(config)
        except Exception as exc:  # a mutant that cannot even be built for a valid config is killed
            failure = ViolationFound(
                [Violation("crash", f"target construction: {type(exc).__name__}: {exc}")], config, []
            )
            hunt.record(failure)
            raise failure from exc

    base = build_machine(guarded, cfg_strategy, stats, tolerated)  # type: ignore[arg-type]

    class ZooMachine(base):  # type: ignore[misc,valid-type]
        def _do(self, op: object) -> None:
            if hunt.stop_shrinking():
                reject()
            try:
                super()._do(op)
            except ViolationFound as failure:
                hunt.record(failure)
                raise

    return ZooMachine


def fuzz_until_killed(
    factory: Factory,
    strategy_name: str,
    *,
    allow_pinning: bool,
    seed: int,
    deadline: float,
    shrink_s: float,
    tolerated: Callable[[Violation], bool] | None = None,
    progress: Progress | None = None,
    max_batches: int | None = None,
) -> tuple[_Hunt, FuzzStats]:
    """Batches of the state machine until a violation, the deadline or `max_batches`."""
    stats = FuzzStats()
    hunt = _Hunt(shrink_s)
    machine = _machine(
        factory, config_strategy(strategy_name, allow_pinning=allow_pinning), stats, hunt, tolerated
    )
    s = settings(
        max_examples=EXAMPLES_PER_BATCH,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while time.monotonic() < deadline and (max_batches is None or hunt.batches < max_batches):
            test = hypothesis_seed(seed + hunt.batches)(get_state_machine_test(machine, settings=s))
            hunt.batches += 1
            # Any failure (ViolationFound, or Hypothesis' Flaky once shrinking was cut
            # off) is read back from `hunt`.
            with contextlib.suppress(Exception):
                test()
            if hunt.best is not None:
                break
            if progress:
                progress.tick(f"batch seed {seed + hunt.batches - 1}: {stats.steps} steps, alive")
    return hunt, stats


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
    with entry.activate() as factory:
        for name in entry.checks:
            outcome = direct.DIRECT_CHECKS[name](factory)
            if outcome.vacuous:
                result.note = f"{name} vacuous: {outcome.vacuous}"
                continue
            if outcome.violation is not None:
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
                break
        if not result.killed:
            prog.tick(f"fuzz: strategy {entry.strategy}, seeds from {seed}", force=progress)
            hunt, stats = fuzz_until_killed(
                factory,
                entry.strategy,
                allow_pinning=entry.target == "reference",
                seed=seed,
                deadline=start + budget_s,
                shrink_s=shrink_s,
                tolerated=entry.tolerated,
                progress=prog,
                max_batches=max_batches,
            )
            result.steps = stats.steps
            result.seeds = f"{seed}..{seed + hunt.batches - 1}" if hunt.batches else "-"
            if hunt.best is not None and hunt.first_at is not None:
                best = hunt.best
                found = [v.check for v in best.violations]
                result.killed, result.check = True, f"fuzz: {found[0]}"
                result.also = tuple(dict.fromkeys(c for c in found[1:] if c != found[0]))
                result.seconds_to_kill = hunt.first_at - start
                result.detail = str(best.violations[0])
                if out_dir is not None:
                    kill_seed = seed + hunt.batches - 1
                    trace = Trace(
                        best.config,
                        best.ops,
                        kill_seed,
                        entry.target,
                        f"mutant {entry.name}: {best.violations[0]}",
                    )
                    result.trace_path = write_trace(trace, out_dir / f"zoo-{entry.target}-{entry.name}.json")
                    result.seeds = str(kill_seed)
    result.seconds = time.monotonic() - start
    if result.killed:
        prog.tick(f"killed by {result.check} in {result.seconds_to_kill:.1f}s", force=progress)
    else:
        prog.tick(f"SURVIVED {result.seconds:.1f}s ({result.steps} steps)", force=progress)
    return result


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
        return (
            f"zoo {self.target}: {killed}/{len(self.results)} killed ({rate:.0%}), "
            f"median time to kill {med} s, max {mx} s, {len(self.not_applicable)} not applicable, "
            f"{self.seconds:.0f} s in all"
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
                    r.strategy,
                    r.seeds,
                    str(r.trace_path) if r.trace_path else "-",
                )
            )
        for name, why in self.not_applicable:
            rows.append((name, "n/a", why, "-", "-", "-", "-"))
        return table(
            [
                "mutant",
                "verdict",
                "first check (+ others on that step)",
                "kill s",
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
                lambda f=f: contextlib.nullcontext(f),
                doc=m.doc,
                tolerated=known_tolerance("reference"),
            )
        )  # type: ignore[misc]
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
    )


def _vllm_tolerance() -> Callable[[Violation], bool] | None:
    return known_tolerance("vllm")


def known_tolerance(target: str) -> Callable[[Violation], bool] | None:
    """Known findings of `target` do not count as kills (nor flag the control)."""
    try:
        from invariants.harness.known_findings import is_known_violation
    except ImportError:
        return None
    return lambda v: bool(is_known_violation(target, v))


def vllm_entries(only: list[str] | None = None) -> tuple[list[ZooEntry], list[tuple[str, str]]]:
    from invariants.zoo.mutants_vllm import NOT_APPLICABLE, VLLM_MUTANTS, activate

    tolerated = _vllm_tolerance()
    names = only or list(VLLM_MUTANTS)
    entries = []
    for name in names:
        if name not in VLLM_MUTANTS:
            continue
        m = VLLM_MUTANTS[name]

        @contextlib.contextmanager
        def ctx(name: str = name) -> Iterator[Factory]:
            with activate(name) as factory:
                yield factory

        entries.append(
            ZooEntry(name, "vllm", m.summary, m.strategy, m.checks, ctx, doc=m.doc, tolerated=tolerated)
        )
    na = [(n, why) for n, why in NOT_APPLICABLE.items() if only is None or n in only]
    return entries, na
