"""`kvretain bench --compare-compiled`: checked/raw in pure Python and with the compiled build, in one run.

The same workload and seed as `kvretain bench` (`invariants.harness.bench`), measured in
child processes, one per variant and round, alternating (pure, compiled, pure, ...), so a
machine that slows down mid-run slows both; each child imports everything afresh under its
variant (`invariants.compiled.run_variant`) and times, in its own CPU time, vLLM's raw
allocator and the checked cycles on each of `TARGETS`, best of `RUNS`. Per variant the best
round counts. Raw is vLLM's own work, compiled in neither: its figure differs between the
variants only by the machine's noise, and each variant's checked/raw uses its own raw.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from invariants.compiled import run_variant
from invariants.report import table

CHILD = "invariants.harness.compiled_bench"
TARGETS = ("vllm-manager", "vllm")
RUNS = 3
VARIANTS = ("pure Python", "compiled")


def measure(requests: int, seed: int, runs: int = RUNS) -> dict[str, Any]:
    """In this process (one variant): best-of-`runs` raw and checked cycles/s per target."""
    from invariants.compiled import state
    from invariants.harness.bench import checked_cycles, raw_vllm_cycles, workload

    prompts = workload(requests, seed)
    out: dict[str, Any] = {"state": state().line(), "modules": len(state().modules)}
    out["raw"] = max(raw_vllm_cycles(prompts) for _ in range(runs))
    for name in TARGETS:
        out[name] = max(checked_cycles(name, prompts, timed=False)[0] for _ in range(runs))
    return out


def compare(
    requests: int, seed: int, rounds: int, log: Callable[[str], None] = print
) -> dict[str, dict[str, Any]]:
    """Each variant's best round (module docstring); prints the table and the speed-ups."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            got = run_variant(CHILD, [str(requests), str(seed)], pure=variant == VARIANTS[0])
            mine = best.setdefault(variant, got)
            for key in ("raw", *TARGETS):
                mine[key] = max(float(mine[key]), float(got[key]))
    rows = []
    for variant, got in best.items():
        raw = float(got["raw"])
        cells = [f"{float(got[t]):,.0f} ({float(got[t]) / raw:.2f})" for t in TARGETS]
        rows.append((variant, got["modules"], f"{raw:,.0f}", *cells))
    headers = ["variant", "compiled modules", "raw cycles/s", *(f"checked on {t} (/raw)" for t in TARGETS)]
    log(table(headers, rows))
    pure, compiled = best[VARIANTS[0]], best[VARIANTS[1]]
    gains = ", ".join(f"{t} {float(compiled[t]) / float(pure[t]):.2f}x" for t in TARGETS)
    log(f"compiled over pure Python, checked cycles/s (best of {rounds} round(s), CPU time): {gains}")
    log(f"compiled build: {compiled['state']}")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {CHILD}")
    parser.add_argument("requests", type=int)
    parser.add_argument("seed", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.requests, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
