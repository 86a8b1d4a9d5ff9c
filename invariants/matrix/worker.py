"""One release's checks, run inside that release's interpreter.

`python -m invariants.matrix.worker --budget-s B --seed S --out DIR` detects
the capabilities of the vLLM it imports, then runs, within B seconds:

- `fuzz`: the stateful fuzzer on generated configurations narrowed to what the
  release can be configured with; the model (built with the release's
  profile) and every invariant judge each step; only this release's known
  findings and its known design are tolerated.
- `invariants`: the same fuzzer where differences from the model (class
  "semantics") are counted too, not fatal, so a defect behind them is still
  reached.
- `conformance`: the conformance feature rows, each a short differential run.

The known design: a break of an invariant guarding a mechanism the release
lacks ("predates", e.g. the free order before #42656) is the release's design
of the time, which its profile models. Every check counts such breaks and runs
past them (`KNOWN_DESIGN`); the report states them once per release.
- `known findings`: every vLLM finding's trace replayed on this release.

A failure is shrunk (`shrink`), classified (`classify`) and written as a trace
under DIR. The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
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
from invariants.harness.known_findings import explain, load_known_findings
from invariants.harness.machine import FuzzStats, ViolationFound, build_machine
from invariants.harness.replay import replay
from invariants.harness.strategies import configs
from invariants.harness.trace import Trace, write_trace
from invariants.matrix.classify import KNOWN_DESIGN, Verdict, classify
from invariants.matrix.shrink import Judge, shrink
from invariants.report import Progress
from invariants.targets import target_factory
from invariants.targets.vllm_capabilities import Capabilities, detect
from invariants.targets.vllm_env import vllm_available, vllm_version
from model.config import Config, ConfigError

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


def run_check(
    name: str,
    strategy: st.SearchStrategy[Config],
    caps: Capabilities,
    *,
    seed: int,
    budget_s: float,
    out: Path,
    tolerate: frozenset[str] = KNOWN_DESIGN,
) -> dict[str, Any]:
    """Fuzz until `budget_s` is spent or a violation the judge does not tolerate
    (`tolerate`: the classes counted instead; the known design by default)."""
    factory = target_factory("vllm-manager")
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
    shrink_at = start + budget_s * (1 - SHRINK_SHARE)
    batch, failure, error = 0, None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while time.monotonic() < shrink_at:
            s = settings(
                max_examples=EXAMPLES_PER_BATCH,
                stateful_step_count=STEPS_PER_EXAMPLE,
                deadline=None,
                database=None,
                print_blob=False,
                phases=[Phase.generate],  # shrinking is ours, within the budget
                suppress_health_check=list(HealthCheck),
            )
            test = hypothesis_seed(seed + batch)(get_state_machine_test(machine, settings=s))
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
    result: dict[str, Any] = {
        "check": name,
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
        trace = Trace(failure.config, ops, seed + batch - 1, "vllm-manager", str(v))
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


def run_known(caps: Capabilities) -> list[dict[str, Any]]:
    """Every vLLM known finding replayed here: does it reproduce, and should it?"""
    version = caps.version
    rows = []
    for f in load_known_findings():
        if "vllm-manager" not in f.targets:
            continue
        expected = "*" in f.versions or version in f.versions
        try:
            result = replay(f.trace, "vllm-manager")
        except ConfigError as exc:
            rows.append({"id": f.id, "expected": expected, "reproduces": None, "note": str(exc)[:120]})
            continue
        # Reproducing means meeting the finding's claim (pattern and precondition),
        # not any violation of the same property.
        hit = any(
            f.claims(v.check, v.message, v.config, v.op) for _, v in [*result.known, *result.violations]
        )
        rows.append({"id": f.id, "expected": expected, "reproduces": hit, "note": ""})
    return rows


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
        run_check("fuzz", narrowed(caps), caps, seed=seed, budget_s=slice_s(0.2), out=out),
        run_check(
            "invariants",
            narrowed(caps),
            caps,
            seed=seed + 1000,
            budget_s=slice_s(0.3),
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
