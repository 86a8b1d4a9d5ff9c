"""Run the theorem catalogue in worker processes and print it as a table.

Importing this module registers every subject's theorems; `THEOREMS` lists
them subject by subject (SWA, sparse SWA, Eagle, Mamba, alignment,
validation, free queue), the order of the table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext

import z3

from invariants.proofs import alignment, eagle, free_queue, mamba, swa, swa_sparse, validation
from invariants.proofs.engine import CATALOGUE, Outcome, Theorem, TheoremResult
from invariants.proofs.lemmas import reset_lemma_names
from model.contract import smt

SUBJECTS = (swa, swa_sparse, eagle, mamba, alignment, validation, free_queue)
# every registered theorem, subject by subject (each subject in its own order)
THEOREMS: list[Theorem] = [th for m in SUBJECTS for th in CATALOGUE if th.fn.__module__ == m.__name__]
assert len(THEOREMS) == len(CATALOGUE), "a theorem module is missing from SUBJECTS"


def _run_one(index: int) -> TheoremResult:
    th = THEOREMS[index]
    smt.reset_fresh_names()  # same names, same Z3 search, whichever worker runs it
    reset_lemma_names()
    t0 = time.monotonic()
    try:
        o = th.fn()
    except z3.Z3Exception as exc:  # a definition error is a failure to prove, reported as such
        o = Outcome("unknown", None, f"Z3 error: {exc}")
    return TheoremResult(
        name=th.name,
        statement=th.statement,
        result=o.result,
        bound=th.bound,
        seconds=time.monotonic() - t0,
        counterexample=o.counterexample,
        is_control=th.is_control,
        is_finding=th.is_finding,
        detail=o.detail,
        witness=o.witness,
    )


def run_theorems(
    progress: Callable[[str], None] | None = None, *, names: Sequence[str] = (), workers: int | None = None
) -> list[TheoremResult]:
    """Run the catalogue (theorems, controls, findings) and return one result each, in catalogue order.

    Runs in `workers` processes (default: min(2, CPUs)); each theorem is
    independent and deterministic.
    """
    indices = [i for i, th in enumerate(THEOREMS) if not names or th.name in names]
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    results: dict[int, TheoremResult] = {}

    def report(r: TheoremResult) -> None:
        if progress is not None:
            ok = "ok" if r.expected_ok else "UNEXPECTED"
            progress(f"{r.name}: {r.result} in {r.seconds:.1f}s ({r.kind}, {ok})")

    if workers <= 1 or len(indices) <= 1:
        for i in indices:
            results[i] = _run_one(i)
            report(results[i])
    else:
        import multiprocessing as mp

        # A fresh process per theorem, forked from a server that imported only the catalogue: Z3's
        # global state (term ids, caches) then depends neither on the theorems a worker ran before
        # nor on what the caller (pytest, a CLI) built, so every caller sees the same search.
        ctx: BaseContext = mp.get_context()
        if "forkserver" in mp.get_all_start_methods():
            server = mp.get_context("forkserver")
            server.set_forkserver_preload(["invariants.proofs.runner"])
            ctx = server
        # slowest first, so the two workers finish together
        order = sorted(indices, key=lambda i: -_EXPECTED_SECONDS.get(THEOREMS[i].name, 1.0))
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for i, r in zip(order, pool.imap(_run_one, order)):
                results[i] = r
                report(r)
    return [results[i] for i in indices]


# rough per-theorem times (2-vCPU machine), used only to order the work
_EXPECTED_SECONDS = {
    "swa_sparse_within_one_interval": 15.0,
    "control_swa_sparse_coarser_than_interval": 12.0,
    "control_swa_tail_one_short": 8.0,
    "swa_sparse_never_exceeds_dense": 7.0,
    "mamba_promise_kept": 5.0,
    "mamba_within_one_interval": 5.0,
    "control_mamba_within_off_by_one": 5.0,
}


def format_table(results: Sequence[TheoremResult]) -> str:
    """A plain-text table: theorem, kind, statement (first sentence), result, bound, seconds; then counterexamples."""
    rows = [("theorem", "kind", "result", "bound", "seconds", "statement")]
    for r in results:
        stmt = r.statement if len(r.statement) <= 110 else r.statement[:107] + "..."
        verdict = r.result + ("" if r.expected_ok else " (UNEXPECTED)")
        bound = r.bound or ("unbounded" if r.result == "proved" else "-")
        rows.append((r.name, r.kind, verdict, bound, f"{r.seconds:.1f}", stmt))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 9)
    total = sum(r.seconds for r in results)
    good = sum(r.expected_ok for r in results)
    lines.append(f"{good}/{len(results)} as expected; {total:.1f}s of solver time")
    notes = [r for r in results if r.counterexample or (r.detail and r.result != "proved")]
    if notes:
        lines.append("")
        lines.append("counterexamples (controls and findings are expected to have one):")
        for r in notes:
            lines.append(f"  {r.name}: {r.counterexample or r.detail}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    t_start = time.monotonic()
    res = run_theorems(progress=lambda m: print(m, file=sys.stderr, flush=True), names=sys.argv[1:])
    print(format_table(res))
    print(f"wall {time.monotonic() - t_start:.1f}s")
    sys.exit(0 if all(r.expected_ok for r in res) else 1)
