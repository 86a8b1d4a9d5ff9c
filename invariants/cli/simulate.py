"""`kvretain simulate SCENARIO` and `kvretain plan`: the simulator's command line.

Exit codes follow `invariants.cli.main`: 0 ran, 2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from invariants.cli.fuzz import positive_int
from invariants.report import table
from invariants.simulate.loop import LoopConfig, Request, SchedulerLoop, SchedulerStalled
from invariants.simulate.scenarios import SCENARIOS, Ctx, Row, Scenario, run_scenario
from invariants.simulate.settings import interval_of, make_target, setting_scope, settings_for
from invariants.simulate.tokens import RandomTokens, random_tokens
from invariants.simulate.verdicts import Verdict, verdicts
from invariants.targets import TARGET_NAMES, TargetUnavailable
from model.contract.config import ConfigError, validate

HEADERS = ["setting", "hit rate", "cached blocks/req", "survived", "alloc failures", "preemptions", "seconds"]


def format_rows(rows: list[Row]) -> str:
    extra_keys = sorted({k for r in rows for k, v in r.extra.items() if isinstance(v, float)})
    body = [
        [
            r.setting,
            f"{r.hit_rate:.3f}",
            r.cached_per_req,
            r.survived,
            r.alloc_failures,
            r.preemptions,
            f"{r.seconds:.2f}",
        ]
        + [f"{r.extra.get(k, 0.0):.3f}" for k in extra_keys]
        for r in rows
    ]
    return table(HEADERS + extra_keys, body, markdown=True)


def _progress(line: str) -> None:
    print(f"[simulate] {line}", file=sys.stderr, flush=True)


def _plot(name: str, rows: list[Row], out: Path, title: str) -> list[tuple[str, Path]]:
    """PNGs for one scenario: (caption, path); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    figs: list[tuple[str, Path]] = []

    def save(fig: Any, caption: str, stem: str) -> None:
        path = out / f"{name}_{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        figs.append((caption, path))

    if name != "sweep":
        # hit rate vs retention interval; dense/off/pre43447/pinned as horizontal lines
        pts = sorted((x, r.hit_rate) for r in rows if (x := interval_of(r.setting)) is not None)
        fig, ax = plt.subplots(figsize=(7, 3.6))
        if pts:
            ax.plot(
                [max(x, 1) for x, _ in pts], [y for _, y in pts], "o-", label="retention interval (r0 at 1)"
            )
        for r in rows:
            if interval_of(r.setting) is None:
                ax.axhline(
                    r.hit_rate,
                    linestyle="--",
                    linewidth=1,
                    label=f"{r.setting} {r.hit_rate:.2f}",
                    color=f"C{1 + rows.index(r)}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("retention interval (tokens)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "hit rate vs retention interval", "interval")
    if name == "concurrent":
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for r in rows:
            fr = sorted((float(k[4:]), v) for k, v in r.extra.items() if k.startswith("hit@"))
            ax.plot([f for f, _ in fr], [v for _, v in fr], "o-", label=r.setting)
        ax.set_xlabel("replayed prompt fraction")
        ax.set_ylabel("hit rate")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "hit rate vs prompt fraction", "fraction")
    if name == "sweep":
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for setting in dict.fromkeys(r.setting.partition(" K=")[0] for r in rows):
            pts2 = sorted(
                (int(r.setting.partition(" K=")[2]), r.hit_rate)
                for r in rows
                if r.setting.partition(" K=")[0] == setting
            )
            ax.plot([k for k, _ in pts2], [v for _, v in pts2], "o-", label=setting)
        ax.set_xlabel("shared prefixes K (working set)")
        ax.set_ylabel("shared-prefix hit rate (rounds 2-3)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "hit rate vs working set", "working_set")
    return figs


def _check_common(args: argparse.Namespace) -> None:
    from invariants.errors import UsageError
    from invariants.layouts.presets import PRESETS

    if args.target not in TARGET_NAMES:
        raise UsageError(f"--target: unknown target {args.target!r} (known: {', '.join(TARGET_NAMES)})")
    if args.preset is not None and args.preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {args.preset!r} (known: {', '.join(sorted(PRESETS))})")


def run_simulate(args: argparse.Namespace) -> int:
    from invariants.errors import UsageError

    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.scenario != "all" and args.scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {args.scenario!r} (known: {', '.join(SCENARIOS)}, all)")
    _check_common(args)
    seed = args.seed if args.seed is not None else 0
    out = Path(args.out) if args.out else None
    md: list[str] = []
    for name in names:
        report = simulate_one(
            name, args.target, args.preset, args.scale, seed, out, _progress, jobs=args.jobs
        )
        md.extend(report.markdown)
    if out is not None and len(names) > 1:
        (out / "report.md").write_text("\n".join(md) + "\n")
        print(f"wrote {out / 'report.md'}")
    return 0


class Report:
    def __init__(
        self, sc: Scenario, rows: list[Row], found: list[Verdict], markdown: list[str], seconds: float
    ):
        self.scenario = sc
        self.rows = rows
        self.verdicts = found
        self.markdown = markdown
        self.seconds = seconds


def simulate_one(
    name: str,
    target: str,
    preset_name: str | None,
    scale: str,
    seed: int,
    out: Path | None,
    progress: Any = None,
    echo: bool = True,
    jobs: int = 1,
) -> Report:
    """Run one scenario, print its table and verdicts, write `out/NAME.md` (+ PNGs)."""
    from invariants.errors import UsageError
    from invariants.layouts.presets import PRESETS

    t0 = time.monotonic()
    sc = SCENARIOS[name]
    base = PRESETS[preset_name or sc.preset]
    params = sc.scales[scale]
    say = print if echo else (lambda *a, **k: None)
    say(
        f"kvretain simulate {sc.name}: {sc.doc}; target {target}, preset {base.name}, "
        f"scale {scale}, seed {seed}",
        flush=True,
    )
    pool = params.pool(base)
    pool_note = (
        f" ({params.pool_x:g}x the blocks of one {params.max_len or params.length}-token request)"
        if params.pool_x > 0
        else ""
    )
    say(f"  sizes: {params}; pool {pool} blocks{pool_note}", flush=True)
    try:
        validate(base.with_(num_blocks=pool))
        rows = run_scenario(sc.name, base, params, Ctx(target, seed, progress, jobs))
    except (ConfigError, TargetUnavailable, SchedulerStalled) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    text = format_rows(rows)
    found = verdicts(sc.name, rows)
    wall = time.monotonic() - t0
    say(text)
    say(f"survived = {sc.survived_means}; cached blocks/req = blocks one request leaves cached alone")
    say(f"table {sc.name}: {wall:.0f} s wall ({jobs} job{'s' if jobs > 1 else ''})")
    for v in found:
        say(f"  {v.line()}")
    md = [
        f"# kvretain simulate {sc.name}",
        "",
        f"{sc.doc}. Target `{target}`, preset `{base.name}`, scale `{scale}`, seed {seed}.",
        "",
        f"Sizes: `{params}`; pool {pool} blocks{pool_note}.",
        "",
        text,
        "",
        f"*survived* = {sc.survived_means}; *cached blocks/req* = blocks one request leaves cached alone. "
        f"Table wall time {wall:.0f} s ({jobs} job{'s' if jobs > 1 else ''}).",
        "",
        "## Seed claims",
        "",
    ]
    md.extend(f"- {v.line()}" for v in found)
    md.append("")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        figs = _plot(sc.name, rows, out, f"{sc.name} ({base.name}, {target}, {scale})")
        md.extend(f"![{cap}]({path.name})\n" for cap, path in figs)
        if not figs:
            md.append("(matplotlib not installed: no plots)")
        (out / f"{sc.name}.md").write_text("\n".join(md) + "\n")
        say(f"wrote {out / (sc.name + '.md')}")
    return Report(sc, rows, found, md, time.monotonic() - t0)


def verify_row(quick: bool, out: Path | None = None) -> tuple[str, str, str, str, float, bool]:
    """One `kvretain verify` row: every scenario on the reference target (quick: small scale).

    Returns (check, target, verdict, figure, seconds, ok); ok is False only when a
    claim the tests assert (`Verdict.asserted`) is not reproduced.
    """
    t0 = time.monotonic()
    scale = "small" if quick else "full"
    found: list[Verdict] = []
    for name in SCENARIOS:
        found.extend(simulate_one(name, "reference", None, scale, 0, out, None, echo=False).verdicts)
    ok = all(v.reproduced for v in found if v.asserted)
    reproduced = sum(1 for v in found if v.reproduced)
    measured = sum(1 for v in found if v.reproduced is not None)
    bad = [v.claim.split(":")[0] for v in found if v.reproduced is False]
    verdict = f"{reproduced}/{measured} seed claims reproduced" + (f" (not: {', '.join(bad)})" if bad else "")
    key = [v.detail for v in found if v.asserted]
    return ("simulate", "reference", verdict, "; ".join(key), time.monotonic() - t0, ok)


def run_plan(args: argparse.Namespace) -> int:
    from invariants.errors import UsageError

    try:
        return _run_plan(args)
    except SchedulerStalled as exc:
        raise UsageError(f"--pool-blocks {args.pool_blocks}: {exc}") from None


def _run_plan(args: argparse.Namespace) -> int:
    """How many prefixes of `--prefix-len` tokens stay hittable in a pool of `--pool-blocks`."""
    from invariants.errors import UsageError
    from invariants.layouts.presets import PRESETS

    if args.preset is None:
        raise UsageError("--preset is required")
    _check_common(args)
    if args.pool_blocks < 2:
        raise UsageError("--pool-blocks: must be >= 2")
    if args.token_budget < 1:
        raise UsageError(f"--token-budget: must be >= 1, got {args.token_budget}")
    base = PRESETS[args.preset].with_(num_blocks=args.pool_blocks)
    sbs = base.scheduler_block_size
    length = args.prefix_len or 16 * sbs
    if length < 2 * sbs:
        raise UsageError(f"--prefix-len: must be >= 2 scheduler blocks ({2 * sbs} tokens)")
    max_bs = max(g.block_size for g in base.groups)
    count = min(2 * math.ceil(args.pool_blocks * max_bs / length) + 4, args.max_prefixes)
    seed = args.seed if args.seed is not None else 0
    print(
        f"kvretain plan: preset {base.name}, pool {args.pool_blocks} blocks, prefix {length} tokens, "
        f"{count} prefixes issued one after another, seed {seed}",
        flush=True,
    )
    rows = []
    try:
        validate(base)
        for s in settings_for(base, (length // 4, length // 2), args.target):
            t0 = time.monotonic()
            with setting_scope(args.target, s):
                t = make_target(args.target, s)
                rng = random.Random(seed)
                sched = SchedulerLoop(
                    t, LoopConfig(args.token_budget, 1), RandomTokens(rng), progress=_progress
                )
                prompts = [random_tokens(rng, length) for _ in range(count)]
                for i, p in enumerate(prompts):
                    sched.submit(Request(f"p{i}", p))
                    sched.run()
                hits = [sched.probe(p).hit for p in prompts]
            hittable = sum(h > 0 for h in hits)
            mean = sum(hits) / max(hittable, 1)
            rows.append(
                [
                    s.name,
                    f"{hittable}" + ("+" if hittable == count else ""),
                    f"{mean:.0f}",
                    f"{time.monotonic() - t0:.2f}",
                ]
            )
    except (ConfigError, TargetUnavailable, SchedulerStalled) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    print(
        table(["setting", "hittable prefixes", "mean hit tokens (hittable)", "seconds"], rows, markdown=True)
    )
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `simulate` and `plan` on an argparse subparsers object."""
    p = subparsers.add_parser("simulate", help="block-level serving simulation of a seed scenario")
    p.add_argument("scenario", help=f"one of: {', '.join(SCENARIOS)}, all")
    p.add_argument("--target", default="reference", help="allocator target (default reference)")
    p.add_argument("--preset", default=None, help="configuration preset (default: the scenario's)")
    p.add_argument("--scale", choices=("small", "full"), default="small")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 0, printed)")
    p.add_argument("--out", default=None, help="directory for a Markdown report (and PNGs if matplotlib)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes, one setting each (default 1; rows do not depend on it)",
    )
    p.set_defaults(func=run_simulate)
    q = subparsers.add_parser("plan", help="how many prefixes stay hittable under each retention setting")
    q.add_argument("--preset", default=None)
    q.add_argument("--pool-blocks", type=int, required=True)
    q.add_argument(
        "--prefix-len", type=int, default=0, help="tokens per prefix (default 16 scheduler blocks)"
    )
    q.add_argument("--target", default="reference")
    q.add_argument("--token-budget", type=int, default=8192)
    q.add_argument("--max-prefixes", type=positive_int, default=400)
    q.add_argument("--seed", type=int, default=None)
    q.set_defaults(func=run_plan)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (the lead wires `add_parser` into `invariants.cli.main`)."""
    from invariants.cli.main import _Parser
    from invariants.errors import UsageError

    parser = _Parser(prog="kvretain")
    add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
        rc: int = args.func(args)
        return rc
    except UsageError as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
