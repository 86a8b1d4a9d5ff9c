"""`kvretain fuzz`: run the stateful machine against one target.

Determinism: batch i of a run is Hypothesis run with seed `seed + i`, so the
same (target, config, seed, steps) gives the same operations and verdict.

Promises to the user:
- `budget_s` bounds the whole run, shrinking included: the search stops at
  the budget (mid-batch: every later step is rejected), and shrinking gets
  `shrink_s` but never more than a short grace past the budget.
- The moment a violation is seen, `log` gets one line (check, step, batch
  seed, elapsed) and the unshrunk trace is written; shrinking (our own,
  `invariants.harness.shrink`, on the recorded operations) logs progress and
  then replaces the trace atomically with the shrunk one.
- Policy drift (the target kept every contract but made one of vLLM's policy
  decisions otherwise: `Checker`'s `policy_drift`) is no violation: the run
  goes on, counts each drifting example, writes the first one's trace
  (`...-drift.json`, shrunk within the shrink budget) and ends with the verdict
  "POLICY DRIFT" (exit 4 from `kvretain fuzz`; "(declared)" and exit 0 where
  every drift is in a policy `KVRETAIN_DECLARED_POLICIES` names). A violation
  found as well wins: "VIOLATION", exit 1. `stop_at_drift` (the zoo) ends the
  run at the first drift.
- With a database directory, Hypothesis keeps every failing example there
  (keyed by target and configuration), and replays them first next run, so a
  failure found once comes back at once. Hypothesis's own shrink and explain
  phases never run: they have no time bound.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from invariants.harness import identities as id_rows
from invariants.harness.checker import DEFAULT_AUDIT_EVERY, REFUSED, Checker, InvalidOp, Violation
from invariants.harness.known_findings import (
    clean_verdict,
    crash_counts,
    explain,
    format_crash_counts,
    is_adapter_crash,
)
from invariants.harness.machine import build_machine
from invariants.harness.run_stats import BudgetSpent, FuzzStats, Tolerance, ViolationFound
from invariants.harness.shrink import shrink
from invariants.harness.strategies import configs
from invariants.harness.trace import Trace, write_trace
from invariants.layouts.presets import preset
from invariants.report import Progress, fitted_table, table, wrap
from invariants.targets import (
    ASYNC_SCHEDULER_TARGETS,
    CONNECTOR_TARGETS,
    ENGINE_STEP_TARGETS,
    FINE_MAMBA_TARGETS,
    GATED_TARGETS,
    PINNING_TARGETS,
    QUEUE_TARGETS,
    REAL_SCHEDULER_TARGETS,
    Target,
    target_factory,
)
from invariants.targets.vllm_env import replay_command
from model.contract.config import Config
from model.contract.ops import Op, op_to_json

EXAMPLES_PER_BATCH = 8
STEPS_PER_EXAMPLE = 40
DEFAULT_STEPS = 2000
DEFAULT_DB = Path(".kvretain/examples")
# Shrinking gets this share of the budget by default, and may run this long past it.
SHRINK_SHARE = 0.25
SHRINK_GRACE_S = 3.0


@dataclass
class FuzzReport:
    target: str
    config: str
    seed: int
    batches: int
    stats: FuzzStats
    seconds: float
    failure: ViolationFound | None = None
    trace_path: Path | None = None
    first_seen_s: float | None = None
    unshrunk_ops: int = 0
    shrink_s: float = 0.0
    # Features the generated configurations leave out for this target, each with why.
    not_generated: tuple[str, ...] = ()
    drift: ViolationFound | None = None  # the first drifting example (shrunk), apart from `failure`
    drift_trace_path: Path | None = None
    # The request identities the target takes (`Target.identities`): drawn and counted.
    identities: frozenset[str] = frozenset()

    @property
    def drifts(self) -> int:
        """Examples that drifted (each counted once, at its first differing decision)."""
        return len(self.stats.drifts)

    @property
    def drift_declared(self) -> bool:
        """Every drift of the run is in a policy the branch declares."""
        return all(d.violations[0].declared for d in self.stats.drifts)

    @property
    def ops_per_s(self) -> float:
        return self.stats.steps / self.seconds if self.seconds else 0.0

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return "VIOLATION"
        if self.stats.drifts:
            return "POLICY DRIFT (declared)" if self.drift_declared else "POLICY DRIFT"
        return clean_verdict(self.stats.known)

    @property
    def exit_code(self) -> int:
        """1 a violation (a defect); 4 policy drift alone, in a policy not declared; else 0."""
        if self.failure is not None:
            return 1
        return 4 if self.stats.drifts and not self.drift_declared else 0

    def drift_json(self) -> dict[str, object] | None:
        """The drift as the JSON field `policy_drift` (None where none)."""
        if not self.stats.drifts:
            return None
        v = (self.drift or self.stats.drifts[0]).violations[0]
        return {
            "examples": self.drifts,
            "policy": v.policy,
            "declared": self.drift_declared,
            "first": v.message,
            "trace": str(self.drift_trace_path) if self.drift_trace_path else None,
            "after_drift_judged_ops": self.stats.after_drift,
            "after_drift_unjudged_ops": self.stats.unjudged_after_drift,
        }

    def drift_line(self) -> str:
        """The drift in one line with its counts ('' where none): what still held after it."""
        if not self.stats.drifts:
            return ""
        d = self.drift or self.stats.drifts[0]
        s = self.stats
        return (
            f"POLICY DRIFT in {self.drifts} example(s), not a defect: {d.violations[0].message}; "
            f"after the drift {s.after_drift} operation(s) judged by the model-independent checks "
            f"(engine contract, catalogue invariants, crashes), {s.unjudged_after_drift} not judged "
            "(the target refused an operation drawn from the model's diverged state)"
            + (f"; trace {self.drift_trace_path}" if self.drift_trace_path else "")
        )

    @property
    def crashes(self) -> dict[str, int]:
        """The run's crashes, apart: tolerated (known crash findings), raised by kvretain's
        adapter, other new ones (`known_findings.crash_counts`)."""
        return crash_counts(self.stats.known.crashes, self.failure.violations if self.failure else ())


NO_EAGLE_WITHOUT_DRAFTS_ON_REAL_SCHEDULER = (
    "Eagle / MTP without lookahead slots (vLLM's Eagle drafts at least one token, so its scheduler "
    "cannot be built with none: Eagle configurations there reserve 1..3 lookahead slots)"
)
LONG_PREFILL_AT_SPEC_TOKENS = (
    "a long-prefill threshold at or below the spec tokens (vLLM 0.33.0 clips a padded one-token "
    "admission to it and fails its own assertion: a crash no serving threshold reaches; "
    "tests/test_long_prefill.py); the adaptive threshold"
)


NO_CONNECTOR = (
    "KV connectors (offers, async loads, failed loads, saves, deferred frees): the target cannot attach one "
    "(model.machine.connector; targets model, vllm and vllm-async-scheduler run them, with drafts and without; "
    "one step ahead model.machine.async_scheduling states vLLM's fenced frees)"
)
CONNECTOR_NOT_STATED = (
    "failed blocks covered by a request awaiting its sample of an earlier step than the latest, "
    "reached only by its latest step's tokens, or under async scheduling; "
    "a sync load's failed blocks reported after another operation than its step and its samples, "
    "while another request of its step awaits its sample, or after a sample with drafts or under "
    "async scheduling; failed blocks with more than one KV cache group (vLLM raises) "
    "(model.machine.connector does not state them)"
)


def _generated(target: str) -> st.SearchStrategy[Config]:
    """The configurations a run generates for `target` (what it can be judged on)."""
    if target in ASYNC_SCHEDULER_TARGETS:
        # Drafts included: the model states them one step ahead (`model.machine.async_scheduling`, 5),
        # and KV connectors, whose frees vLLM fences there (6).
        return configs(
            allow_pinning=False,
            allow_fine=target in FINE_MAMBA_TARGETS,
            eagle_drafts=True,
            connector=None,
            long_prefill=None,
            gates=None,
            unpredicted=target in ENGINE_STEP_TARGETS,
            lookahead_hashes=None,
        )
    return configs(
        allow_pinning=target in PINNING_TARGETS,
        allow_fine=target in FINE_MAMBA_TARGETS,
        # A real scheduler's Eagle always drafts (`model.policy.spec_decode`).
        eagle_drafts=target in REAL_SCHEDULER_TARGETS,
        connector=None if target in CONNECTOR_TARGETS else False,
        # Only a real scheduler caps a chunk at the long-prefill threshold.
        long_prefill=None if target in REAL_SCHEDULER_TARGETS else False,
        # The admission gates (`model.policy.admission`): every target with a scheduler's admissions.
        gates=None if target in GATED_TARGETS else False,
        # vLLM settings the model does not predict, judged by the contract: the real schedulers
        # that decide every step (the priority policy's order is vLLM's, run as it comes).
        unpredicted=target in ENGINE_STEP_TARGETS,
        # Eagle's lookahead block hashes (vLLM's default): the real schedulers hash with them.
        lookahead_hashes=None if target in REAL_SCHEDULER_TARGETS else False,
    )


QUEUES_UNJUDGED = (
    "the queue order each step leaves (StepResult.queues, model.policy.queues): unjudged, the target "
    "keeps no scheduler queues (judged on model, reference, vllm and vllm-async-scheduler)"
)


def _not_generated(target: str) -> tuple[str, ...]:
    """What `_generated` leaves out for `target`, said in its report (and what its
    observations leave unjudged)."""
    connector = CONNECTOR_NOT_STATED if target in CONNECTOR_TARGETS else NO_CONNECTOR
    unjudged = () if target in QUEUE_TARGETS else (QUEUES_UNJUDGED,)
    if target in REAL_SCHEDULER_TARGETS:
        return (NO_EAGLE_WITHOUT_DRAFTS_ON_REAL_SCHEDULER, LONG_PREFILL_AT_SPEC_TOKENS, connector, *unjudged)
    return (connector, *unjudged)


def _tolerance(target: str) -> Tolerance:
    """`target`'s known findings: a violation -> the finding whose claim it meets, or None."""
    return lambda v: explain(target, v)


def replayer(
    factory: Callable[[Config], Target], config: Config, check: str, tolerated: Tolerance
) -> Callable[[list[Op]], int | None]:
    """A shrink predicate: the index of the first step with a new violation, if it is `check`
    (a candidate the target refuses, `REFUSED`, is no trace of it: never a failure)."""

    def fails(ops: list[Op]) -> int | None:
        try:
            checker = Checker(factory(config))
        except Exception:
            return None
        for i, op in enumerate(ops):
            try:
                violations = checker.step(op)
            except InvalidOp:
                return None
            found = [v for v in violations if not tolerated(v)]
            if found:
                hit = any(v.check == check for v in found) and all(v.check != REFUSED for v in found)
                return i if hit else None
            if any(v.check == "crash" for v in violations):
                return None  # a tolerated crash leaves the target's state undefined (the fuzz halts)
        found = [v for v in checker.audit() if not tolerated(v)] if ops else []
        return len(ops) - 1 if any(v.check == check for v in found) else None

    return fails


class _FailuresOnly(ExampleDatabase):
    """The example database, minus the examples a budget cut off (not failures)."""

    def __init__(self, inner: ExampleDatabase, stats: FuzzStats) -> None:
        super().__init__()
        self.inner, self.stats = inner, stats

    def save(self, key: bytes, value: bytes) -> None:
        if not self.stats.out_of_time() or self.stats.last_failure is not None:
            self.inner.save(key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(src, dest, value)


def _database(
    path: Path | None, stats: FuzzStats, target: str, config_name: str | None
) -> tuple[ExampleDatabase | None, bytes]:
    key = f"kvretain-fuzz:{target}:{config_name or 'generated'}".encode()
    if path is None:
        return None, key
    return _FailuresOnly(DirectoryBasedExampleDatabase(str(path)), stats), key


def run_fuzz(
    target: str,
    *,
    config_name: str | None = None,
    steps: int | None = None,
    seed: int = 0,
    budget_s: float | None = None,
    shrink_s: float | None = None,
    out_dir: Path = Path("kvretain-traces"),
    progress: bool = True,
    strategy: st.SearchStrategy[Config] | None = None,
    database: Path | None = None,
    audit_every: int | None = None,
    log: Callable[[str], None] | None = None,
    factory: Callable[[Config], Target] | None = None,
    tolerated: Tolerance | None = None,
    trace_name: str | None = None,
    stop_at_drift: bool = False,
) -> FuzzReport:
    """Fuzz `target` (built by `factory`, default the registered one; `tolerated`
    default: its known findings). `steps` None: the budget decides (DEFAULT_STEPS
    without one). `stop_at_drift`: the first policy drift ends the run (the zoo's kill)."""
    factory = factory or target_factory(target)
    say = log or (lambda line: None)
    if steps is None and budget_s is None:
        steps = DEFAULT_STEPS
    if shrink_s is None:
        shrink_s = max(budget_s * SHRINK_SHARE, 1.0) if budget_s is not None else 30.0
    generated = strategy is None and not config_name
    if strategy is None:
        strategy = st.just(preset(config_name)) if config_name else _generated(target)
    tolerated = tolerated or _tolerance(target)
    start = time.monotonic()
    stats = FuzzStats(audit_every=audit_every or DEFAULT_AUDIT_EVERY)
    stats.deadline = start + budget_s if budget_s is not None else None
    trace_path = out_dir / (trace_name or f"kvretain-{target}-seed{seed}.json")
    first_seen: list[float] = []

    def seen(failure: ViolationFound) -> None:
        if first_seen:
            return
        first_seen.append(time.monotonic() - start)
        stats.deadline = time.monotonic()  # stop the batch now: no replay, no explain
        v = failure.violations[0]
        write_trace(Trace(failure.config, failure.ops, seed + stats.batches - 1, target, str(v)), trace_path)
        say(
            f"violation: {v.check} at step {len(failure.ops)} of an example (batch seed {seed + stats.batches - 1}, "
            f"seed {seed}), {first_seen[0]:.1f}s; unshrunk trace {trace_path}"
        )

    stats.on_violation = seen

    def drifted(drift: ViolationFound) -> None:
        if len(stats.drifts) == 1:
            say(f"policy drift at step {len(drift.ops)} of an example: {drift.violations[0].message}")
        if stop_at_drift:
            stats.deadline = time.monotonic()

    stats.on_drift = drifted
    machine = build_machine(
        factory, strategy, stats, tolerated=tolerated, connector=target in CONNECTOR_TARGETS
    )
    db, db_key = _database(database, stats, target, config_name)
    prog = Progress(f"fuzz {target}", enabled=progress)
    for batch in _batches(machine, stats, db, db_key, seed, steps):
        prog.tick(
            f"batch {batch}: {stats.steps} steps, {stats.steps / max(prog.elapsed(), 1e-9):.0f} ops/s, "
            f"hit rate {stats.hit_rate:.1%}"
        )
    failure = stats.last_failure
    stats.known.write_examples(out_dir, target, seed)
    report = FuzzReport(target, config_name or "generated", seed, stats.batches, stats, 0.0, failure)
    report.identities = cast("type[Target]", factory).identities if isinstance(factory, type) else frozenset()
    if generated:
        report.not_generated = _not_generated(target) + id_rows.not_generated(report.identities)
    outcome = _Outcome(target, seed + stats.batches - 1, factory, tolerated, start, budget_s, shrink_s, say)
    outcome.write(report, trace_path, first_seen)
    report.seconds = time.monotonic() - start
    return report


@dataclass
class _Outcome:
    """A run's first violation and first policy drift, shrunk within the budget and
    written as traces (a defect takes the shrink budget; the drift is then kept as seen)."""

    target: str
    seed: int
    factory: Callable[[Config], Target]
    tolerated: Tolerance
    start: float
    budget_s: float | None
    shrink_s: float
    say: Callable[[str], None]

    def _shrunk(self, found: ViolationFound, path: Path) -> tuple[ViolationFound, Path]:
        done = shrink_failure(
            found, self.factory, self.tolerated, self.start, self.budget_s, self.shrink_s, self.say
        )
        return done, self._written(done, path)

    def _written(self, found: ViolationFound, path: Path) -> Path:
        return write_trace(
            Trace(found.config, found.ops, self.seed, self.target, str(found.violations[0])), path
        )

    def write(self, report: FuzzReport, trace_path: Path, first_seen: list[float]) -> None:
        """The failure (first seen at `first_seen[0]` s) and the drift, shrunk and written."""
        if report.failure is not None:
            report.first_seen_s = first_seen[0] if first_seen else None
            report.unshrunk_ops = len(report.failure.ops)
            report.failure, report.trace_path = self._shrunk(report.failure, trace_path)
            report.shrink_s = time.monotonic() - self.start - (report.first_seen_s or 0.0)
        drifts = report.stats.drifts
        if drifts:
            path = trace_path.with_name(trace_path.stem + "-drift.json")
            if report.failure is None:
                report.drift, report.drift_trace_path = self._shrunk(drifts[0], path)
            else:
                report.drift, report.drift_trace_path = drifts[0], self._written(drifts[0], path)


def _batches(
    machine: type[RuleBasedStateMachine],
    stats: FuzzStats,
    db: ExampleDatabase | None,
    db_key: bytes,
    seed: int,
    steps: int | None,
) -> Iterator[int]:
    """Run Hypothesis batches (batch i seeded `seed + i`) until `steps`, the budget or a
    violation; yields each clean batch's number. Swallows only the run's own signals."""
    s = settings(
        max_examples=EXAMPLES_PER_BATCH,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        database=db,
        report_multiple_bugs=False,
        derandomize=False,
        print_blob=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    batch = 0
    # One test for every batch: building it digests the machine class's source (about 60 ms);
    # each batch sets the test's seed and settings afresh (@seed and settings only set attributes).
    test = get_state_machine_test(machine, settings=s)
    test._hypothesis_internal_database_key = db_key  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while (steps is None or stats.steps < steps) and not stats.out_of_time():
            test._hypothesis_internal_use_settings = s  # type: ignore[attr-defined]
            test = hypothesis_seed(seed + batch)(test)
            # @seed switches the database off (it assumes a one-off reproduction);
            # here every batch is seeded, and failures must still be remembered.
            test._hypothesis_internal_use_settings = settings(  # type: ignore[attr-defined]
                test._hypothesis_internal_use_settings,  # type: ignore[attr-defined]
                database=db,
            )
            batch += 1
            stats.batches = batch
            try:
                test()
            except (ViolationFound, BudgetSpent):
                pass  # a violation (recorded in stats) or the budget: the run's own signals
            except Flaky as exc:
                # Hypothesis replays a failing example once more and reports a replay that
                # ends otherwise as flaky; past the deadline the replay meets BudgetSpent.
                # Flaky about anything but the run's own signals is a harness error.
                if not _own_signals(exc, stats):
                    raise
            if stats.last_failure is not None:
                return
            yield batch


def _own_signals(exc: Flaky, stats: FuzzStats) -> bool:
    """Is this flaky report about the run's own signals only? A replay that ended
    otherwise than the failure did, where the failure was a violation or a
    cut-off: the replay is cut at once (`check_budget`), so it draws less data
    than the failure did, and Hypothesis calls the strategy flaky."""
    inner = getattr(exc, "exceptions", ())
    if inner:
        return all(isinstance(e, (ViolationFound, BudgetSpent)) for e in inner)
    return stats.cut_off or stats.last_failure is not None


def shrink_failure(
    failure: ViolationFound,
    factory: Callable[[Config], Target],
    tolerated: Tolerance,
    start: float,
    budget_s: float | None,
    shrink_s: float,
    say: Callable[[str], None],
) -> ViolationFound:
    """The failure with its shrunk trace (its violations re-read from a final replay)."""
    if not failure.ops:
        return failure
    now = time.monotonic()
    deadline = now + shrink_s
    if budget_s is not None:
        deadline = min(deadline, max(start + budget_s, now + min(shrink_s, SHRINK_GRACE_S)))
    check = failure.violations[0].check
    fails = replayer(factory, failure.config, check, tolerated)
    ops, tries = shrink(failure.ops, fails, deadline, log=say)
    say(
        f"shrunk {len(failure.ops)} -> {len(ops)} operations in {tries} replays ({time.monotonic() - now:.1f}s)"
    )
    if len(ops) == len(failure.ops) and ops == failure.ops:
        return failure
    checker = Checker(factory(failure.config))
    found: list[Violation] = []
    for op in ops:
        found = [v for v in checker.step(op) if not tolerated(v)]
    return ViolationFound(found or failure.violations, failure.config, ops)


def format_failure(report: FuzzReport) -> str:
    assert report.failure is not None
    f = report.failure
    lines = [
        f"VIOLATION on target {report.target} (seed {report.seed}, batch seed {report.seed + report.batches - 1})"
    ]
    for v in f.violations[:10]:
        lines.append(f"  {v}")
        if v.check == "crash":
            lines.append(f"    {_raised_by(v)}")
    lines.append(f"config: {f.config}")
    lines.append(f"shrunk trace ({len(f.ops)} operations, from {report.unshrunk_ops}):")
    lines += [f"  {i:3d}  {op_to_json(op)}" for i, op in enumerate(f.ops)]
    lines.append(f"written to {report.trace_path}; re-run with: {replay_command(report.trace_path)}")
    return wrap("\n".join(lines))


def _raised_by(v: Violation) -> str:
    """Who raised a new crash, in words."""
    if is_adapter_crash(v):
        return "raised by kvretain's adapter: a gap in kvretain, never tolerated as an engine finding"
    if v.crash is None:
        return "raised where no site was recorded: never tolerated"
    return f"raised by the {v.crash.raised_by}; no crash finding's trigger matched it"


def format_summary(reports: list[FuzzReport]) -> str:
    rows = [
        (
            r.target,
            r.config,
            r.seed,
            r.batches,
            r.stats.examples,
            r.stats.steps,
            f"{r.ops_per_s:.0f}",
            len(r.stats.states),
            f"{r.stats.hit_rate:.1%}",
            r.verdict,
            f"{r.seconds:.1f}",
        )
        for r in reports
    ]
    out = fitted_table(
        [
            "target",
            "config",
            "seed",
            "batches",
            "examples",
            "steps",
            "ops/s",
            "states",
            "hit rate",
            "verdict",
            "seconds",
        ],
        rows,
    )
    crashes = [(r, format_crash_counts(r.crashes)) for r in reports]
    out += "".join("\n" + wrap(f"{r.target}/{r.config}: {line}") for r, line in crashes if line)
    return out + "".join("\n" + wrap(f"{r.target}/{r.config}: {r.drift_line()}") for r in reports if r.drifts)


def format_features(reports: list[FuzzReport]) -> str:
    """How often each feature was exercised: configuration features per example,
    model rules per firing, summed over the reports."""
    total: Counter[str] = Counter()
    for r in reports:
        total.update(r.stats.features)
    rows = [(name, count) for name, count in sorted(total.items())]
    out = "features exercised:\n" + table(["feature", "count"], rows)
    out += "".join(f"\n{r.target}: {id_rows.summary_row(r.stats.features, r.identities)}" for r in reports)
    left_out = sorted({f"{r.target}: {why}" for r in reports for why in r.not_generated})
    if left_out:
        out += "\nnot generated (0 examples):\n" + "\n".join(f"  - {line}" for line in left_out)
    return wrap(out)


def first_violation(report: FuzzReport) -> Violation | None:
    return report.failure.violations[0] if report.failure else None
