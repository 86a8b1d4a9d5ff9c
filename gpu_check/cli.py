"""`kvretain gpu-check`: bitwise equivalence of a hybrid model across cache modes.

Exit codes: 0 every mode matches the no-cache run bit for bit (and every
caching mode served tokens from cache); 1 a mismatch, a vacuous mode, or a
fault; 2 bad usage (e.g. --device cuda without CUDA, an unavailable target),
reported in one line.

`kvretain` finds this module through the `kvretain.commands` entry point
(pyproject.toml): `add_parser` gives it the subcommand and `verify_row` the row
of `kvretain verify`, and invariants/ never imports gpu_check/. Registering
the subcommand imports no torch (every `kvretain` command builds the parser):
the model and its runner are imported when `gpu-check` runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from gpu_check.targets import TARGET_NAMES, target_factory
from gpu_check.workload import make_workload
from invariants.targets.base import TargetUnavailable
from model.contract.config import Config, ConfigError, GroupSpec

if TYPE_CHECKING:
    from gpu_check.runner import CheckReport


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `gpu-check` subcommand; `args.func` is `run`."""
    p = subparsers.add_parser(
        "gpu-check",
        help="run a small hybrid model over a paged KV cache; demand bit-identical outputs across cache modes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cpu", help="where the model runs (default cpu)"
    )
    p.add_argument(
        "--target", choices=TARGET_NAMES, default="reference", help="allocator deciding hits and block ids"
    )
    p.add_argument("--sessions", type=int, default=None, help="multi-turn sessions (default 12, --quick 4)")
    p.add_argument("--seed", type=int, default=0, help="seed for the workload and the weights (default 0)")
    p.add_argument(
        "--bench", action="store_true", help="also print attention throughput and checked tokens/minute"
    )
    p.add_argument("--quick", action="store_true", help="small workload and fewer modes (smoke test)")
    p.add_argument(
        "--kernels",
        choices=("invariant", "naive", "triton"),
        default=None,
        help="kernel set (default: triton on cuda, invariant on cpu); 'naive' is the negative control",
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size (default: tight, forces eviction)"
    )
    p.add_argument(
        "--intervals", default=None, help="retention intervals to test, comma-separated (default 32,64)"
    )
    p.add_argument(
        "--trace-out", default=None, help="write the op trace of the first failing mode as JSON here"
    )
    p.set_defaults(func=run)
    return p


def _usage(msg: str) -> int:
    print(f"gpu-check: error: {msg}", file=sys.stderr)
    return 2


def _blocks_for(base: Config, tokens: int) -> int:
    need = 0
    for g in base.groups:
        if g.kind == "full":
            need += -(-tokens // g.block_size)
        elif g.kind == "swa":
            need += -(-(g.sliding_window or 1) // g.block_size) + 2
        else:
            need += 2
    return need


def run(args: argparse.Namespace) -> int:
    """`kvretain gpu-check`: exit 0 when every cache mode holds against the baseline (retention
    off) and at least one mode ran, 1 otherwise, 2 for bad usage."""
    from gpu_check.forward_pass import GPU_CHECK_LOOP
    from gpu_check.runner import default_config, default_modes, run_check

    quick = bool(args.quick)
    sessions = args.sessions if args.sessions is not None else (4 if quick else 12)
    if sessions < 1:
        return _usage(f"--sessions must be >= 1, got {sessions}")
    device = args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return _usage("--device cuda: CUDA is not available on this machine (use --device cpu)")
    kname = args.kernels or ("triton" if device == "cuda" else "invariant")
    if kname == "triton":
        from gpu_check.triton_kernels import TritonKernels, triton_usable

        ok, why = triton_usable(device)
        if not ok:
            return _usage(f"--kernels triton: {why}")
        kernels: Any = TritonKernels()
    else:
        from gpu_check.kernels import get_kernels

        kernels = get_kernels(kname)
    workload = make_workload(args.seed, sessions)
    probe = default_config(64)
    max_tokens = workload.max_request_tokens()
    min_blocks = _blocks_for(probe, max_tokens) + 1
    num_blocks = args.num_blocks if args.num_blocks is not None else max(min_blocks + 4, min_blocks * 3 // 2)
    if num_blocks < min_blocks:
        return _usage(
            f"--num-blocks {num_blocks}: the longest request ({max_tokens} tokens) needs {min_blocks}"
        )
    base = default_config(num_blocks)
    try:
        intervals = [int(x) for x in args.intervals.split(",")] if args.intervals else None
    except ValueError:
        return _usage(f"--intervals must be comma-separated integers, got {args.intervals!r}")
    modes = default_modes(base, intervals)
    if quick:
        modes = _quick_modes(modes)
    factory = target_factory(args.target)
    try:
        factory(modes[0].config(base))
    except TargetUnavailable as exc:
        return _usage(f"--target {args.target}: {exc}")
    except ConfigError as exc:
        return _usage(f"--target {args.target} rejects the configuration: {exc}")
    print(
        f"gpu-check: seed {args.seed}, target {args.target}, device {device}, kernels {kname}, "
        f"{sessions} sessions ({workload.num_requests} requests, longest {max_tokens} tokens), "
        f"pool {num_blocks} blocks, groups {_groups(base.groups)}"
    )
    print(f"gpu-check: modes {', '.join(m.name for m in modes)} (baseline: off)")
    report = run_check(
        factory,
        workload,
        base_config=base,
        modes=modes,
        kernels=kernels,
        model_seed=args.seed,
        device=device,
        loop_config=GPU_CHECK_LOOP,
        log=lambda line: print(line, flush=True),
    )
    _print_summary(report)
    global LAST_REPORT
    LAST_REPORT = report
    if args.bench:
        _bench(report, device, args.seed)
    if args.trace_out and not report.ok:
        _write_failing_trace(args, report, base, modes)
    return 0 if report.ok else 1


def _quick_modes(modes: list[Any]) -> list[Any]:
    """`--quick`: retention off, dense, r0 and pinned, and the first interval mode."""
    return [m for m in modes if m.name in ("off", "dense", "r0", "pinned")] + [
        m for m in modes if m.name.startswith("r") and m.name != "r0"
    ][:1]


def _bench(report: CheckReport, device: str, seed: int) -> None:
    """`--bench`: the attention kernels' timings, then the check's checked tokens per minute."""
    from gpu_check.bench import bench_attention

    for line in bench_attention(device, seed=seed):
        print(line)
    minutes = report.seconds / 60.0
    print(f"equivalence check: {report.tokens_checked / minutes:,.0f} checked tokens/minute")


def _write_failing_trace(
    args: argparse.Namespace, report: CheckReport, base: Config, modes: list[Any]
) -> None:
    """`--trace-out`: the operations of the first mode that failed, as a trace `kvretain replay` runs."""
    from invariants.harness.trace import Trace, config_from_json, write_trace

    bad = next(r for r in report.results if not r.ok)
    cfg = config_from_json(_config_json(base, bad.mode, modes))
    write_trace(
        Trace(cfg, list(bad.ops), args.seed, args.target, f"gpu-check {bad.mode}: {bad.verdict}"),
        args.trace_out,
    )
    print(f"gpu-check: op trace of mode {bad.mode} written to {args.trace_out}")


LAST_REPORT: CheckReport | None = None


def verify_row(quick: bool = False) -> tuple[str, str, str, str, float, bool]:
    """The `kvretain verify` row: the CPU equivalence check on the reference target."""
    ns = argparse.Namespace(
        device="cpu",
        target="reference",
        sessions=None,
        seed=0,
        bench=False,
        quick=quick,
        kernels=None,
        num_blocks=None,
        intervals=None,
        trace_out=None,
    )
    rc = run(ns)
    report = LAST_REPORT
    if report is None:
        return ("gpu-check", "reference", f"could not run (exit {rc})", "-", 0.0, False)
    figure = (
        f"{report.tokens_checked} tokens bit-identical"
        if report.ok
        else "first mismatch: "
        + (report.first_mismatch.describe() if report.first_mismatch else "see output")
    )
    return (
        "gpu-check cpu",
        "reference",
        "holds" if report.ok else "FAILED",
        figure,
        report.seconds,
        report.ok,
    )


def _groups(groups: tuple[GroupSpec, ...]) -> str:
    return "+".join(
        f"{g.kind}{g.block_size}" + (f"(w{g.sliding_window})" if g.sliding_window else "") for g in groups
    )


def _config_json(base: Config, mode: str, modes: list[Any]) -> dict[str, Any]:
    cfg = next(m for m in modes if m.name == mode).config(base)
    return {
        "num_blocks": cfg.num_blocks,
        "retention_interval": cfg.retention_interval,
        "enable_caching": cfg.enable_caching,
        "pin_swa_on_drop": cfg.pin_swa_on_drop,
        "groups": [
            {"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
            for g in cfg.groups
        ],
    }


def _print_summary(report: CheckReport) -> None:
    print()
    print(report.table())
    print()
    mm = report.first_mismatch
    print(f"tokens checked: {report.tokens_checked} (each: every layer's output, bit for bit, vs mode off)")
    print(f"first mismatch: {mm.describe() if mm else 'none'}")
    for r in report.results:
        if r.verdict in ("vacuous", "fault", "skipped"):
            print(f"{r.mode}: {r.verdict}: {r.detail}")
    verdict = "PASS" if report.ok else "FAIL"
    print(f"gpu-check {verdict}: seed {report.seed}, target {report.target}, {report.seconds:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
