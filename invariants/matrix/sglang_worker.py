"""One SGLang release's checks, run inside that release's interpreter.

`python -m invariants.matrix.sglang_worker --budget-s B --seed S --out DIR`
detects the release's capabilities (`sglang_capabilities`) and, within B
seconds, runs:

- `fuzz`: per cache family the release ships (`unified`, on the Python and
  Rust tree cores in lockstep; `legacy`, `SWARadixCache` / `MambaRadixCache`
  alone) and per layout the family serves there, seeded scheduler histories
  checked after every op by the one radix catalogue; the first violation of a
  layout stops it, is classified (`sglang_classify`) and written as a trace.
- `legacy_vs_unified` (releases with both families): the same histories on the
  unified cache (Python core) and the legacy cache in lockstep; every history
  runs to its first disagreement (result of an op or a pool account), which is
  counted by the aspect it concerns (`sglang_classify.aspect`), then the next
  seed starts. A layout's row says how many histories agreed to the end.

A layout a family cannot serve on this release is listed with the reason, not
run. The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from model.radix.config import LAYOUTS, RadixLayout

OPS_PER_SEED = 60
DIFF_SHARE = 0.5  # of the budget, for legacy_vs_unified where the release has both families


def _checker(caps: Any, family: str, layout: RadixLayout, cores: tuple[str, ...] | None = None) -> Any:
    from invariants.harness.radix_check import RadixChecker
    from invariants.targets.sglang_capabilities import API_CHECKPOINT

    if caps.scheduler_api == API_CHECKPOINT:
        return RadixChecker(layout, cores or ("python", "rust"))
    from invariants.targets.sglang_legacy import LegacyDriver
    from invariants.targets.sglang_legacy_snapshot import LegacyReader

    default = ("legacy",) if family == "legacy" else ("python", "rust")
    return RadixChecker(layout, cores or default, make_driver=LegacyDriver, reader=LegacyReader)


def _history(checker: Any, ops: list[Any]) -> tuple[tuple[str, str] | None, int, str]:
    """Run `ops`; (first violation, ops applied, the op's kind at the violation)."""
    from invariants.harness.radix_fuzz import run_history

    found, done = run_history(checker, ops)
    return found, len(done), type(done[-1]).__name__ if done else ""


def fuzz_family(caps: Any, family: str, name: str, budget_s: float, seed: int, out: Path) -> dict[str, Any]:
    """Histories on one layout for `budget_s`; the first violation, classified, with its trace."""
    from invariants.harness.radix_fuzz import LayoutRun, generate_ops, write_trace
    from invariants.matrix.sglang_classify import classify

    layout = LAYOUTS[name]
    run = LayoutRun(layout=name)
    start, s = time.perf_counter(), seed
    row: dict[str, Any] = {"family": family, "layout": name}
    while run.seeds == 0 or time.perf_counter() - start < budget_s:
        ops = generate_ops(s, layout, OPS_PER_SEED)
        applied = 0
        try:
            checker = _checker(caps, family, layout)
            found, applied, _ = _history(checker, ops)
        except Exception as exc:  # building the cache failed: the adapter's gap
            found, checker = ("sglang_raised", f"{type(exc).__name__}: {str(exc)[:200]}"), None
        run.seeds += 1
        if checker is not None:
            run.ops += checker.checked_ops
            run.coverage.update(checker.coverage)
        if found is not None:
            verdict = classify(found[0], found[1], family)
            run.violation, run.seed = found, s
            # Up to and including the op that broke (one SGLang raised on is not "checked").
            run.trace = ops[:applied]
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"sglang-{caps.version}-{family}-{name}-seed{s}.json"
            write_trace(run, layout, path)
            row.update(
                verdict=verdict.kind, check=found[0], message=found[1], note=verdict.note, trace=str(path)
            )
            break
        s += 1
    row.update(seeds=run.seeds, ops=run.ops, seconds=round(time.perf_counter() - start, 1))
    row.setdefault("verdict", "clean")
    row["coverage"] = dict(run.coverage)
    return row


def legacy_vs_unified(caps: Any, name: str, budget_s: float, seed: int) -> dict[str, Any]:
    """Lockstep histories (unified Python core, legacy) on one layout; disagreements by aspect."""
    from invariants.harness.radix_fuzz import generate_ops
    from invariants.matrix.sglang_classify import aspect

    layout = LAYOUTS[name]
    start, s = time.perf_counter(), seed
    seeds = agreed = ops_total = 0
    aspects: Counter[str] = Counter()
    examples: dict[str, dict[str, Any]] = {}
    other: Counter[str] = Counter()
    while seeds == 0 or time.perf_counter() - start < budget_s:
        checker = _checker(caps, "unified", layout, cores=("python", "legacy"))
        found, n, op_kind = _history(checker, generate_ops(s, layout, OPS_PER_SEED))
        seeds, ops_total = seeds + 1, ops_total + n
        if found is None:
            agreed += 1
        elif found[0] == "radixcores_agree":
            key = aspect(op_kind, found[1])
            aspects[key] += 1
            examples.setdefault(key, {"seed": s, "op_index": n - 1, "message": found[1]})
        else:  # an invariant broke on the unified side (the primary) before any disagreement
            other[found[0]] += 1
            examples.setdefault(found[0], {"seed": s, "op_index": n - 1, "message": found[1]})
        s += 1
    return {
        "layout": name,
        "seeds": seeds,
        "ops": ops_total,
        "agreed": agreed,
        "differences": dict(aspects),
        "other": dict(other),
        "examples": examples,
        "seconds": round(time.perf_counter() - start, 1),
    }


def plan(caps: Any) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
    """(family, layout) pairs to fuzz, and the pairs left out with their reason."""
    runs, skipped = [], []
    for family in ("unified", "legacy"):
        for name, layout in LAYOUTS.items():
            why = caps.serves(family, layout) if family in caps.families() else "not shipped or not driven"
            if family == "legacy" and family not in caps.families():
                continue
            if why is None:
                runs.append((family, name))
            else:
                skipped.append({"family": family, "layout": name, "why": why})
    return runs, skipped


def run(budget_s: float, seed: int, out: Path) -> dict[str, Any]:
    from invariants.targets.sglang_capabilities import detect
    from invariants.targets.sglang_env import sglang_available

    ok, line = sglang_available()
    if not ok:
        return {"error": line}
    caps = detect()
    result: dict[str, Any] = {"capabilities": caps.to_json(), "fuzz": [], "legacy_vs_unified": []}
    if not caps.families():
        result["error"] = (
            f"SGLang {caps.version}: kvretain has no driver for this release's scheduler API "
            "(neither 0.5.20's cache_unfinished_req nor 0.5.23's checkpoint_kv_cache)"
        )
        return result
    runs, skipped = plan(caps)
    result["skipped"] = skipped
    diff_layouts = [n for f, n in runs if f == "legacy"]
    # Each job gets an equal share of what is left, so a slow first job (the one
    # that builds SGLang's native extensions) does not push the worker past its budget.
    deadline = time.monotonic() + budget_s
    fuzz_deadline = deadline - (budget_s * DIFF_SHARE if diff_layouts else 0.0)
    for i, (family, name) in enumerate(runs):
        share = max(0.0, fuzz_deadline - time.monotonic()) / (len(runs) - i)
        result["fuzz"].append(fuzz_family(caps, family, name, share, seed, out))
    for i, name in enumerate(diff_layouts):
        share = max(0.0, deadline - time.monotonic()) / (len(diff_layouts) - i)
        result["legacy_vs_unified"].append(legacy_vs_unified(caps, name, share, seed))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="invariants.matrix.sglang_worker")
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    result = run(args.budget_s, args.seed, Path(args.out))
    result["worker_s"] = round(time.perf_counter() - start, 1)
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
