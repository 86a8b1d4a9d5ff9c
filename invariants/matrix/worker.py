"""One release's checks, run inside that release's interpreter.

`python -m invariants.matrix.worker --budget-s B --seed S --out DIR` detects
the capabilities of the vLLM it imports, then runs, within B seconds:

- `fuzz`: the stateful fuzzer on generated configurations narrowed to what the
  release can be configured with, driving the release's `KVCacheManager`
  (target "vllm-manager"); the model (built with the release's profile) and
  every invariant judge each step; only this release's known findings and its
  known design are tolerated.
- `scheduler`: the same through the release's own `Scheduler` (target "vllm"),
  "n/a" naming what is missing where it cannot be built offline; differences
  from the model are counted (the scheduler's rules of the time are in no
  profile), invariant breaks are fatal.
- `invariants`: the same fuzzer where differences from the model (class
  "semantics") are counted too, not fatal, so a defect behind them is still
  reached.
- `conformance`: the conformance feature rows, each a short differential run.

The known design: a break of an invariant guarding a mechanism the release
lacks ("predates", e.g. the free order before #42656) is the release's design
of the time, which its profile models. Every check counts such breaks and runs
past them (`KNOWN_DESIGN`); the report states them once per release.
- `known findings`: every vLLM finding's trace replayed on this release, as
  recorded and through the release's own `Scheduler`.

A failure is shrunk (`shrink`), classified (`classify`) and written as a trace
under DIR. The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import get_state_machine_test

from invariants.harness.checker import Violation
from invariants.harness.conformance import FEATURES, FINE_MAMBA_ROW
from invariants.harness.fuzz import EXAMPLES_PER_BATCH, STEPS_PER_EXAMPLE
from invariants.harness.known_findings import KnownFinding, explain, load_known_findings
from invariants.harness.machine import AllocatorMachine, build_machine
from invariants.harness.replay import replay
from invariants.harness.run_stats import FuzzStats, ViolationFound
from invariants.harness.strategies import configs, engine_runnable
from invariants.harness.trace import Trace, TraceError, write_trace
from invariants.matrix.classify import KNOWN_DESIGN, Verdict, classify
from invariants.matrix.shrink import Judge, shrink
from invariants.report import Progress
from invariants.targets import TargetUnavailable, target_factory
from invariants.targets.vllm_capabilities import Capabilities, detect, profile_check, scheduler_unsupported
from invariants.targets.vllm_env import vllm_available, vllm_version
from model.contract.config import Config, ConfigError

SHRINK_SHARE = 0.4  # of a check's time slice, kept for shrinking a failure


def narrowed(
    caps: Capabilities, strategy: st.SearchStrategy[Config] | None = None
) -> st.SearchStrategy[Config]:
    """Generated configurations (`strategy`, default all) this release can be configured with."""
    if strategy is None:
        strategy = configs(allow_pinning=False, retention=None if caps.has_retention_interval else "dense")
    if not caps.fine_grained_mamba:
        # A Mamba block wider than the hash block means fine-grained hits only where the release has them.
        strategy = strategy.filter(
            lambda c: not any(g.kind == "mamba" and g.block_size > c.hash_block_size for g in c.groups)
        )
    if not caps.has_retention_interval:
        strategy = strategy.filter(lambda c: c.retention_interval is None)
    elif not caps.mamba_retention:
        # Before #45845 an interval needs an SWA group (the release rejects it otherwise).
        strategy = strategy.filter(
            lambda c: c.retention_interval is None or any(g.kind == "swa" for g in c.groups)
        )
    return strategy


def feature_applies(feature: str, caps: Capabilities) -> str | None:
    """None when a conformance row applies to the release, else why not."""
    if ("retention 0" in feature or "retention k" in feature) and not caps.has_retention_interval:
        return "n/a: no retention interval"
    if feature == FINE_MAMBA_ROW and not caps.fine_grained_mamba:
        return "n/a: no fine-grained Mamba hits"
    return None


def _judge(version: str, caps: Capabilities, tolerate: frozenset[str]) -> Judge:
    def judge(v: Violation) -> tuple[str, bool]:
        finding = explain("vllm-manager", v)
        if finding is not None:
            return f"known: {finding.id}", True
        kind = classify(v.check, v.message, caps).kind
        return kind, kind in tolerate

    return judge


def _fuzz_batches(
    machine: type[AllocatorMachine], stats: FuzzStats, prog: Progress, seed: int, shrink_at: float
) -> tuple[int, ViolationFound | None, str | None]:
    """Hypothesis batches of the stateful machine (batch i seeded `seed + i`, no shrinking)
    until `shrink_at`, the first untolerated violation, or an error outside the checks (a
    release rejecting a generated configuration): (batches run, the violation, the error)."""
    batch, failure, error = 0, None, None
    s = settings(
        max_examples=EXAMPLES_PER_BATCH,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        database=None,
        print_blob=False,
        phases=[Phase.generate],  # shrinking is ours, within the budget
        suppress_health_check=list(HealthCheck),
    )
    machine_test = get_state_machine_test(machine, settings=s)  # built once: it digests the machine's source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while time.monotonic() < shrink_at:
            test = hypothesis_seed(seed + batch)(machine_test)
            batch += 1
            try:
                test()
            except ViolationFound:
                failure = stats.last_failure
                break
            except Exception as exc:  # e.g. the release rejects a generated configuration
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                break
            prog.tick(f"batch {batch}: {stats.steps} steps")
    return batch, failure, error


def run_check(
    name: str,
    strategy: st.SearchStrategy[Config],
    caps: Capabilities,
    *,
    seed: int,
    budget_s: float,
    out: Path,
    tolerate: frozenset[str] = KNOWN_DESIGN,
    target: str = "vllm-manager",
) -> dict[str, Any]:
    """Fuzz `target` until `budget_s` is spent or a violation the judge does not tolerate
    (`tolerate`: the classes counted instead; the known design by default)."""
    factory = target_factory(target)
    version = vllm_version() or "?"
    judge = _judge(version, caps, tolerate)
    counts: Counter[str] = Counter()
    firsts: dict[str, str] = {}

    def tolerated(v: Violation) -> bool:
        kind, ok = judge(v)
        if ok:
            counts[kind] += 1
            firsts.setdefault(kind, str(v)[:160])
        return ok

    stats = FuzzStats()
    machine = build_machine(factory, strategy, stats, tolerated=tolerated)
    prog = Progress(f"matrix {version} {name}")
    start = time.monotonic()
    batch, failure, error = _fuzz_batches(machine, stats, prog, seed, start + budget_s * (1 - SHRINK_SHARE))
    result: dict[str, Any] = {
        "check": name,
        "target": target,
        "examples": stats.examples,
        "steps": stats.steps,
        "batches": batch,
        "tolerated": dict(counts),
        "tolerated_first": firsts,
        "verdict": "clean",
        "class": None,
        "message": None,
        "trace": None,
        "config": None,
        "batch_seed": None,
    }
    if error is not None:
        result.update(verdict="adapter", message=error, note="the run stopped on an error outside the checks")
    if failure is not None:
        v = failure.violations[0]
        kind = judge(v)[0]
        ops = shrink(factory, failure.config, failure.ops, judge, (v.check, kind), start + budget_s)
        trace = Trace(failure.config, ops, seed + batch - 1, target, str(v))
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        path = write_trace(trace, out / f"vllm-{version}-{slug}.json")
        verdict: Verdict = classify(v.check, v.message, caps)
        result.update(
            verdict=kind,
            message=str(v)[:300],
            note=verdict.note,
            trace=str(path),
            ops=len(ops),
            batch_seed=seed + batch - 1,
        )
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def scheduler_check(caps: Capabilities, *, seed: int, budget_s: float, out: Path) -> dict[str, Any]:
    """The "fuzz" check through the release's own `Scheduler` (target "vllm"), on the
    configurations a serving engine can run (Eagle always drafts; no KV connector:
    kvretain's connector is written against 0.33.0's connector API); "n/a" with the
    missing pieces where the release's scheduler cannot be built offline."""
    why = scheduler_unsupported(caps)
    if why is not None:
        return {"check": "scheduler", "verdict": f"n/a: {why}"[:200], "seconds": 0.0}
    # The model caches a drafting request's blocks at its sample (0.33.0's update_from_output);
    # no profile states the older rule, so a release without it is not sent drafts.
    speculate = caps.sample_caching is not False
    strategy = configs(
        allow_pinning=False,
        retention=None if caps.has_retention_interval else "dense",
        eagle_drafts=True,
        connector=False,
        eagle=None if speculate else False,
        lookahead=None if speculate else False,
    )
    # The scheduler's own rules of the time (chunk splits, admission) are in no profile: a
    # difference from the model is counted (class semantics) and the run goes on, so an
    # invariant the release's real scheduler breaks is still reached.
    row = run_check(
        "scheduler",
        narrowed(caps, strategy),
        caps,
        seed=seed,
        budget_s=budget_s,
        out=out,
        tolerate=KNOWN_DESIGN | {"semantics"},
        target="vllm",
    )
    row["not_generated"] = ["KV connectors (kvretain's connector follows 0.33.0's connector API)"]
    if not speculate:
        row["not_generated"].append(NO_SAMPLE_CACHING)
    return row


NO_SAMPLE_CACHING = (
    "speculative decoding: the release caches a drafting request's blocks at its next "
    "allocation, not at the sample (Capabilities.sample_caching), a rule no profile states"
)


def run_known(caps: Capabilities) -> list[dict[str, Any]]:
    """Every vLLM known finding replayed here: does it reproduce, and should it? Once as
    recorded ("vllm-manager": `reproduces`), once through the release's own `Scheduler`
    (target "vllm", the configuration made engine-runnable: `scheduler`, None where the
    scheduler cannot be built or refuses the trace, with the reason in `scheduler_note`)."""
    version = caps.version
    scheduler_why = scheduler_unsupported(caps)
    rows = []
    for f in load_known_findings():
        if "vllm-manager" not in f.targets:
            continue
        row: dict[str, Any] = {"id": f.id, "expected": "*" in f.versions or version in f.versions}
        row["reproduces"], row["note"] = _reproduces(f, f.trace, "vllm-manager")
        if scheduler_why is not None:
            row["scheduler"], row["scheduler_note"] = None, "the release's Scheduler cannot be built"
        else:
            runnable = dataclasses.replace(f.trace, config=engine_runnable(f.trace.config))
            # A finding of the AsyncScheduler (recorded there) replays through it.
            sched = "vllm-async-scheduler" if f.trace.target == "vllm-async-scheduler" else "vllm"
            row["scheduler"], row["scheduler_note"] = _reproduces(f, runnable, sched)
        rows.append(row)
    return rows


def _reproduces(f: KnownFinding, trace: Trace, target: str) -> tuple[bool | None, str]:
    """Does `trace` on `target` meet the finding's claim (pattern and precondition, not any
    violation of the same property)? None, with why, when the target refuses the trace."""
    try:
        result = replay(trace, target)
    except (ConfigError, TargetUnavailable, TraceError) as exc:
        return None, str(exc).splitlines()[0][:120]
    refused = [v for _, v in result.violations if v.check == "refused"]
    if refused:  # e.g. a step the engine does not run as the trace states it (SteeredStep)
        return None, refused[0].message.splitlines()[0][:120]
    seen = [*result.known, *result.violations]
    return any(f.claims(v.check, v.message, v.config, v.op, v.crash) for _, v in seen), ""


def run_release(budget_s: float, seed: int, out: Path) -> dict[str, Any]:
    ok, line = vllm_available()
    if not ok:
        return {"error": line}
    caps = detect()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # Shares of the budget; the rest is left for importing vLLM and the known findings.
    slice_s: Callable[[float], float] = lambda share: budget_s * share  # noqa: E731
    checks = [
        run_check("fuzz", narrowed(caps), caps, seed=seed, budget_s=slice_s(0.15), out=out),
        scheduler_check(caps, seed=seed + 2000, budget_s=slice_s(0.15), out=out),
        run_check(
            "invariants",
            narrowed(caps),
            caps,
            seed=seed + 1000,
            budget_s=slice_s(0.2),
            out=out,
            tolerate=KNOWN_DESIGN | {"semantics", "known"},
        ),
    ]
    rows = []
    per_row = slice_s(0.25) / len(FEATURES)
    for feature, strategy in FEATURES.items():
        why = feature_applies(feature, caps)
        if why is not None:
            rows.append({"check": feature, "verdict": why, "seconds": 0.0})
            continue
        rows.append(run_check(feature, narrowed(caps, strategy), caps, seed=seed, budget_s=per_row, out=out))
    known = run_known(caps)
    return {
        "version": caps.version,
        "capabilities": caps.to_json(),
        # the release's rules come from its version; where its code behaves otherwise, said here
        "profile_check": profile_check().to_json(),
        "checks": checks,
        "conformance": rows,
        "known": known,
        "seconds": round(time.monotonic() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="invariants.matrix.worker")
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = run_release(args.budget_s, args.seed, Path(args.out))
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 2


if __name__ == "__main__":
    sys.exit(main())
