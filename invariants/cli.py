"""The `kvretain` command line.

Exit codes: 0 everything holds; 1 a violation (a finding); 2 bad usage, bad
input or a missing target (one line on stderr naming what is wrong).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from invariants.errors import UsageError
from invariants.report import table
from invariants.targets import TARGET_NAMES, TargetUnavailable, available_targets
from invariants.trace import TraceError, read_trace
from model.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _optional(module: str) -> object | None:
    """A kvretain module that may not be present in this build (None if absent)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# ---------------------------------------------------------------- fuzz
def cmd_fuzz(args: argparse.Namespace) -> int:
    from invariants.fuzz import format_failure, format_summary, run_fuzz

    print(f"kvretain fuzz: target {args.target}, config {args.config or 'generated'}, seed {args.seed}, "
          f"steps {args.steps}, budget {args.budget_s or 'none'} s", flush=True)
    report = run_fuzz(
        args.target, config_name=args.config, steps=args.steps, seed=args.seed,
        budget_s=args.budget_s, out_dir=Path(args.out),
    )
    if report.failure is not None:
        print(format_failure(report))
    print(format_summary([report]))
    return 1 if report.failure is not None else 0


# ---------------------------------------------------------------- replay
def cmd_replay(args: argparse.Namespace) -> int:
    from invariants.replay import replay

    trace = read_trace(args.trace)
    targets = args.target or [trace.target or "reference"]
    print(f"kvretain replay: {args.trace}: {len(trace.ops)} operations, seed {trace.seed}, "
          f"recorded on {trace.target}: {trace.violation}")
    rows, failed = [], False
    for name in targets:
        result = replay(trace, name)
        first = result.violations[0] if result.violations else None
        failed |= not result.clean
        for i, v in result.violations[:10]:
            print(f"  {name}: op {i}: {v}")
        for i, v in result.known[:3]:
            print(f"  {name}: op {i}: known finding: {v}")
        rows.append((name, "clean" if result.clean else "VIOLATION", len(result.violations), len(result.known),
                     f"op {first[0]}: {first[1].check}" if first else "-"))
    print(table(["target", "verdict", "violations", "known", "first"], rows))
    return 1 if failed else 0


# ---------------------------------------------------------------- prove
def cmd_prove(args: argparse.Namespace) -> int:
    theorems = _optional("invariants.theorems")
    if theorems is None:
        raise UsageError("the theorem catalogue (invariants.theorems) is not part of this build")
    results = theorems.run_theorems(progress=lambda s: print(f"[prove] {s}", file=sys.stderr, flush=True))  # type: ignore[attr-defined]
    print(theorems.format_table(results))  # type: ignore[attr-defined]
    if args.production_link:
        from invariants.production_link import format_link, run_production_link

        link = run_production_link(quick=False)
        print(format_link(link))
        results = list(results) + list(link)
    if args.crosshair:
        from invariants.crosshair_checks import format_crosshair, run_crosshair

        ch = run_crosshair(args.crosshair)
        print(format_crosshair(ch))
        if any(not getattr(r, "expected_ok", True) for r in ch):
            print("FAILED: a CrossHair check did not come out as expected")
            return 1
    bad = [r for r in results if not r.expected_ok]
    for r in bad:
        print(f"FAILED {r.name}: {r.result}; {r.counterexample or ''}")
    return 1 if bad else 0


# ---------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    """The main job: proofs, fuzzing against every installed target, GPU check on CPU."""
    rows: list[tuple[object, ...]] = []
    ok = True

    def record(check: str, target: str, verdict: str, figure: str, seconds: float, good: bool) -> None:
        nonlocal ok
        ok &= good
        rows.append((check, target, verdict, figure, f"{seconds:.1f}"))
        print(f"[verify] {check} {target}: {verdict} ({figure})", file=sys.stderr, flush=True)

    theorems = _optional("invariants.theorems")
    if theorems is not None:
        t = time.monotonic()
        results = theorems.run_theorems(progress=None)  # type: ignore[attr-defined]
        proved = sum(r.expected_ok for r in results)
        bad = [r.name for r in results if not r.expected_ok]
        record("prove", "model", "holds" if not bad else "FAILED: " + ", ".join(bad[:3]),
               f"{proved}/{len(results)} as expected", time.monotonic() - t, not bad)
        if available_targets().get("vllm") is None:
            from invariants.production_link import run_production_link

            t = time.monotonic()
            link = run_production_link(quick=args.quick)
            bad = [r.name for r in link if not r.expected_ok]
            record("production link", "vllm", "holds" if not bad else "FAILED: " + ", ".join(bad),
                   f"{len(link)} vLLM formulas = model, exhaustive", time.monotonic() - t, not bad)

    from invariants.fuzz import format_failure, run_fuzz

    budget = 20.0 if args.quick else args.budget_s
    steps = 400 if args.quick else args.steps
    for name, reason in available_targets().items():
        if name == "model":
            continue
        if reason is not None:
            rows.append(("fuzz", name, "skipped", reason[:70], "0.0"))
            print(f"[verify] fuzz {name}: skipped: {reason}", file=sys.stderr, flush=True)
            continue
        report = run_fuzz(name, steps=steps, seed=args.seed, budget_s=budget, out_dir=Path(args.out), progress=True)
        if report.failure is not None:
            print(format_failure(report))
        record("fuzz", name, report.verdict, f"{report.stats.steps} steps, {report.ops_per_s:.0f} ops/s, "
               f"hit {report.stats.hit_rate:.0%}", report.seconds, report.failure is None)

    if available_targets().get("vllm") is None:
        from invariants.conformance import run_conformance

        t = time.monotonic()
        rc = run_conformance(steps=300 if args.quick else 1500, budget_s=10.0 if args.quick else 30.0, seed=args.seed,
                             out=Path(args.out))
        record("conformance", "vllm", "agrees with the model" if rc == 0 else "FINDING (see above)",
               "8 feature rows", time.monotonic() - t, rc == 0)

    from invariants.known_findings import recheck_known_findings

    t = time.monotonic()
    usable = {n for n, why in available_targets().items() if why is None}
    rechecked = recheck_known_findings(usable)
    gone = [f"{fid} on {tgt}" for fid, tgt, still in rechecked if not still]
    record("known findings", ",".join(sorted(usable)), "all reproduce" if not gone else "NO LONGER REPRODUCE: " + "; ".join(gone),
           f"{len(rechecked)} finding/target pairs replayed", time.monotonic() - t, not gone)

    zoo = _optional("invariants.zoo.cli")
    if zoo is not None and hasattr(zoo, "verify_row"):
        record(*zoo.verify_row(quick=args.quick))

    sim = _optional("invariants.simulate.cli")
    if sim is not None and hasattr(sim, "verify_row"):
        # Small scale keeps verify fast; `kvretain simulate all --scale full` gives the real sizes.
        check, target, verdict, figure, seconds, good = sim.verify_row(quick=True, out=Path(args.out) / "simulate")
        record(check, target, verdict, f"report in {Path(args.out) / 'simulate'}", seconds, good)

    gpu = _optional("gpu_check.cli")
    if gpu is not None and hasattr(gpu, "verify_row"):
        check, target, verdict, figure, seconds, good = gpu.verify_row(quick=args.quick)
        record(check, target, verdict, figure, seconds, good)

    print(table(["check", "target", "verdict", "figure", "seconds"], rows))
    print("kvretain verify: " + ("everything holds" if ok else "FAILED"))
    return 0 if ok else 1


# ---------------------------------------------------------------- conformance
def cmd_conformance(args: argparse.Namespace) -> int:
    from invariants.conformance import run_conformance
    from invariants.targets import target_factory

    target_factory("vllm")  # one line and exit 2 when vLLM cannot be imported
    return run_conformance(steps=args.steps, budget_s=args.budget_s, seed=args.seed, out=Path(args.out))


# ---------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from invariants.bench import run_bench

    return run_bench(requests=args.requests, seed=args.seed)


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvretain", description="Verify prefix-cache retention in hybrid KV-cache allocators.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    f = sub.add_parser("fuzz", help="stateful fuzzing of one target against the model")
    f.add_argument("--target", choices=TARGET_NAMES, default="reference")
    f.add_argument("--config", help="a preset name (default: generated configurations)")
    f.add_argument("--steps", type=int, default=2000)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--budget-s", type=float, default=None)
    f.add_argument("--out", default="kvretain-traces", help="where failing traces are written")
    f.set_defaults(func=cmd_fuzz)

    r = sub.add_parser("replay", help="re-run a trace file against targets")
    r.add_argument("trace")
    r.add_argument("--target", action="append", choices=TARGET_NAMES, help="repeat to compare targets side by side")
    r.set_defaults(func=cmd_replay)

    p = sub.add_parser("prove", help="Z3 theorems about masks, hits and free-queue order")
    p.add_argument("--production-link", action="store_true",
                   help="also check vLLM's mask and hit functions against the model exhaustively (bounded domain)")
    p.add_argument("--crosshair", type=float, default=0.0, metavar="SECONDS",
                   help="also run CrossHair contracts and diffbehavior twins, SECONDS per function")
    p.set_defaults(func=cmd_prove)

    v = sub.add_parser("verify", help="the main job: proofs, fuzzing of every installed target, summary table")
    v.add_argument("--quick", action="store_true", help="small budgets (used by the tests)")
    v.add_argument("--steps", type=int, default=20000, help="fuzz steps per target")
    v.add_argument("--budget-s", type=float, default=60.0, help="fuzz time budget per target")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--out", default="kvretain-traces")
    v.set_defaults(func=cmd_verify)

    c = sub.add_parser("conformance", help="vLLM vs the model, feature by feature")
    c.add_argument("--steps", type=int, default=1500, help="fuzz steps per feature")
    c.add_argument("--budget-s", type=float, default=30.0, help="time budget per feature")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="kvretain-traces")
    c.set_defaults(func=cmd_conformance)

    b = sub.add_parser("bench", help="raw allocator cycles/s vs the checked harness on one fixed workload")
    b.add_argument("--requests", type=int, default=300)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_bench)

    for module in ("invariants.zoo.cli", "invariants.simulate", "gpu_check.cli"):
        mod = _optional(module)
        if mod is not None and hasattr(mod, "add_parser"):
            mod.add_parser(sub)  # type: ignore[attr-defined]
    return parser


def _run_under(python: str, argv: list[str]) -> int:
    """`--vllm-python PATH`: re-run this command under another interpreter (a
    vLLM developer's environment), with this kvretain first on its path."""
    import os
    import subprocess

    from invariants.targets.vllm_env import probe_python

    ok, line, _ = probe_python(python)
    if not ok:
        raise UsageError(line)
    print(f"kvretain: running under {line}", file=sys.stderr, flush=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return subprocess.call([python, "-m", "invariants.cli", *argv], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--vllm-python" in args_list:
            i = args_list.index("--vllm-python")
            if i + 1 >= len(args_list):
                raise UsageError("--vllm-python needs the path of a Python interpreter")
            python = args_list[i + 1]
            return _run_under(python, args_list[:i] + args_list[i + 2:])
    except UsageError as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(args_list)
        if getattr(args, "target", None) == "vllm" or args.command in ("verify", "conformance"):
            from invariants.targets.vllm_env import version_warning

            warning = version_warning()
            if warning:
                print(f"kvretain: warning: {warning}", file=sys.stderr)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except (UsageError, TraceError, ConfigError, TargetUnavailable) as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
