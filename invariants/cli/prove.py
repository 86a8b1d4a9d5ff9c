"""`kvretain prove`: the Z3 theorems, and optionally the production link and CrossHair."""

from __future__ import annotations

import argparse
import sys


def cmd_prove(args: argparse.Namespace) -> int:
    from invariants.proofs import runner as theorems

    results = theorems.run_theorems(progress=lambda s: print(f"[prove] {s}", file=sys.stderr, flush=True))  # type: ignore[attr-defined]
    print(theorems.format_table(results))  # type: ignore[attr-defined]
    if args.production_link:
        from invariants.proofs.production_link import format_link, run_production_link

        link = run_production_link(quick=False)
        print(format_link(link))
        results = list(results) + list(link)
    if args.crosshair:
        from invariants.proofs.crosshair import format_crosshair, run_crosshair

        ch = run_crosshair(args.crosshair)
        print(format_crosshair(ch))
        if any(not getattr(r, "expected_ok", True) for r in ch):
            print("FAILED: a CrossHair check did not come out as expected")
            return 1
    bad = [r for r in results if not r.expected_ok]
    for r in bad:
        print(f"FAILED {r.name}: {r.result}; {r.counterexample or ''}")
    return 1 if bad else 0
