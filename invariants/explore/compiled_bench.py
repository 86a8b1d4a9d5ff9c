"""`kvretain bench --compare-compiled`'s search half: states per CPU second, pure Python and compiled.

The same instance and depth (`invariants.explore.bench`'s BENCH_INSTANCE) searched on one
target in child processes, one per variant and round, alternating, each in its own CPU
time (`invariants.compiled.run_variant`); per variant the best round counts. The
certificates of every round must be equal but for their time (`same`): a compiled build
that searched something else would be a defect, not a figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from invariants.compiled import run_variant
from invariants.report import table

CHILD = "invariants.explore.compiled_bench"
VARIANTS = ("pure Python", "compiled")


def measure(target: str, instance: str, depth: int) -> dict[str, Any]:
    """In this process (one variant): one search's states, transitions, CPU seconds and the
    digest of its certificate (time and restore left out)."""
    from invariants.compiled import state
    from invariants.explore.bench import _comparable
    from invariants.explore.instances import features_of, grid_by_name
    from invariants.explore.search import Limits, explore
    from invariants.targets import target_factory

    factory = target_factory(target)
    inst = grid_by_name([instance], features_of(factory))[0]
    cpu = time.process_time()
    cert = explore(inst, factory, target, Limits(depth, max_states=10**7))
    cpu = time.process_time() - cpu
    digest = hashlib.sha256(json.dumps(_comparable(cert), sort_keys=True, default=repr).encode()).hexdigest()
    return {
        "state": state().line(),
        "states": cert.states,
        "transitions": cert.transitions,
        "cpu_s": cpu,
        "certificate": digest,
    }


def compare(
    target: str, instance: str, depth: int, rounds: int, log: Callable[[str], None] = print
) -> tuple[dict[str, dict[str, Any]], bool]:
    """Each variant's best round and whether every certificate agreed; prints the table."""
    best: dict[str, dict[str, Any]] = {}
    digests: set[str] = set()
    for _ in range(rounds):
        for variant in VARIANTS:
            got = run_variant(CHILD, [target, instance, str(depth)], pure=variant == VARIANTS[0])
            digests.add(str(got["certificate"]))
            if variant not in best or float(got["cpu_s"]) < float(best[variant]["cpu_s"]):
                best[variant] = got
    rows = [
        (
            v,
            g["states"],
            g["transitions"],
            f"{float(g['cpu_s']):.2f}",
            f"{g['states'] / float(g['cpu_s']):,.0f}",
        )
        for v, g in best.items()
    ]
    log(
        f"explore on {target}, instance {instance}, depth {depth}, best of {rounds} round(s) each, alternating"
    )
    log(table(["variant", "states", "transitions", "CPU s", "states/CPU s"], rows))
    pure, compiled = best[VARIANTS[0]], best[VARIANTS[1]]
    log(
        f"compiled over pure Python, states per CPU second: {float(pure['cpu_s']) / float(compiled['cpu_s']):.2f}x"
    )
    same = len(digests) == 1
    log(
        "the certificates are identical (states per depth, transitions, verdict, counterexample)"
        if same
        else "CERTIFICATES DIFFER between pure Python and compiled: the compiled build searched something else"
    )
    return best, same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {CHILD}")
    parser.add_argument("target")
    parser.add_argument("instance")
    parser.add_argument("depth", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.target, args.instance, args.depth)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
