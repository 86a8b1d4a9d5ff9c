"""`kvretain simulate SCENARIO` and `kvretain plan`: the simulator's command line.

Exit codes follow `invariants.cli`: 0 ran, 2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from invariants.simulate.engine import Engine, SimRequest, SimulationStalled, random_tokens
from invariants.simulate.scenarios import SCENARIOS, Ctx, Row, make_target, run_scenario, settings_for
from invariants.targets import TARGET_NAMES, TargetUnavailable
from model.config import ConfigError, validate

HEADERS = ["setting", "hit rate", "cached blocks/req", "survived", "alloc failures", "preemptions", "seconds"]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_rows(rows: list[Row]) -> str:
    extra_keys = sorted({k for r in rows for k, v in r.extra.items() if isinstance(v, float)})
    body = [
        [r.setting, f"{r.hit_rate:.3f}", r.cached_per_req, r.survived, r.alloc_failures, r.preemptions,
         f"{r.seconds:.2f}"] + [f"{r.extra.get(k, 0.0):.3f}" for k in extra_keys]
        for r in rows
    ]
    return _table(HEADERS + extra_keys, body)


def _progress(line: str) -> None:
    print(f"[simulate] {line}", file=sys.stderr, flush=True)


def _plot(rows: list[Row], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r.setting for r in rows], [r.hit_rate for r in rows])
    ax.set_ylabel("hit rate")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _check_common(args: argparse.Namespace) -> None:
    from invariants.errors import UsageError
    from invariants.presets import PRESETS

    if args.target not in TARGET_NAMES:
        raise UsageError(f"--target: unknown target {args.target!r} (known: {', '.join(TARGET_NAMES)})")
    if args.preset is not None and args.preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {args.preset!r} (known: {', '.join(sorted(PRESETS))})")


def run_simulate(args: argparse.Namespace) -> int:
    from invariants.errors import UsageError
    from invariants.presets import PRESETS

    if args.scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {args.scenario!r} (known: {', '.join(SCENARIOS)})")
    _check_common(args)
    sc = SCENARIOS[args.scenario]
    base = PRESETS[args.preset or sc.preset]
    params = sc.scales[args.scale]
    seed = args.seed if args.seed is not None else 0
    print(f"kvretain simulate {sc.name}: {sc.doc}; target {args.target}, preset {base.name}, "
          f"scale {args.scale}, seed {seed}", flush=True)
    print(f"  sizes: {params}", flush=True)
    try:
        validate(base.with_(num_blocks=params.num_blocks))
        rows = run_scenario(sc.name, base, params, Ctx(args.target, seed, _progress))
    except (ConfigError, TargetUnavailable, SimulationStalled) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    text = format_rows(rows)
    print(text)
    print(f"survived = {sc.survived_means}; cached blocks/req = blocks one request leaves cached alone")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        png = out / f"{sc.name}.png"
        plotted = _plot(rows, png, f"{sc.name} ({base.name}, {args.target})")
        md = [f"# kvretain simulate {sc.name}", "", f"{sc.doc}. Target `{args.target}`, preset `{base.name}`, "
              f"scale `{args.scale}`, seed {seed}.", "", f"Sizes: `{params}`", "", text, "",
              f"*survived* = {sc.survived_means}.", ""]
        md.append(f"![hit rate]({png.name})" if plotted else "(matplotlib not installed: no plot)")
        (out / f"{sc.name}.md").write_text("\n".join(md) + "\n")
        print(f"wrote {out / (sc.name + '.md')}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from invariants.errors import UsageError

    try:
        return _run_plan(args)
    except SimulationStalled as exc:
        raise UsageError(f"--pool-blocks {args.pool_blocks}: {exc}") from None


def _run_plan(args: argparse.Namespace) -> int:
    """How many prefixes of `--prefix-len` tokens stay hittable in a pool of `--pool-blocks`."""
    from invariants.errors import UsageError
    from invariants.presets import PRESETS

    if args.preset is None:
        raise UsageError("--preset is required")
    _check_common(args)
    if args.pool_blocks < 2:
        raise UsageError("--pool-blocks: must be >= 2")
    base = PRESETS[args.preset].with_(num_blocks=args.pool_blocks)
    sbs = base.scheduler_block_size
    length = args.prefix_len or 16 * sbs
    if length < 2 * sbs:
        raise UsageError(f"--prefix-len: must be >= 2 scheduler blocks ({2 * sbs} tokens)")
    max_bs = max(g.block_size for g in base.groups)
    count = min(2 * math.ceil(args.pool_blocks * max_bs / length) + 4, args.max_prefixes)
    seed = args.seed if args.seed is not None else 0
    print(f"kvretain plan: preset {base.name}, pool {args.pool_blocks} blocks, prefix {length} tokens, "
          f"{count} prefixes issued one after another, seed {seed}", flush=True)
    rows = []
    try:
        validate(base)
        for s in settings_for(base, (length // 4, length // 2), args.target):
            t0 = time.monotonic()
            t = make_target(args.target, s)
            rng = random.Random(seed)
            e = Engine(t, token_budget=args.token_budget, max_running=1, rng=rng, progress=_progress)
            prompts = [random_tokens(rng, length) for _ in range(count)]
            for i, p in enumerate(prompts):
                e.submit(SimRequest(f"p{i}", p))
                e.run()
            hits = [e.probe(p).hit for p in prompts]
            hittable = sum(h > 0 for h in hits)
            mean = sum(hits) / max(hittable, 1)
            rows.append([s.name, f"{hittable}" + ("+" if hittable == count else ""), f"{mean:.0f}",
                         f"{time.monotonic() - t0:.2f}"])
    except (ConfigError, TargetUnavailable, SimulationStalled) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    print(_table(["setting", "hittable prefixes", "mean hit tokens (hittable)", "seconds"], rows))
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `simulate` and `plan` on an argparse subparsers object."""
    p = subparsers.add_parser("simulate", help="block-level serving simulation of a seed scenario")
    p.add_argument("scenario", help=f"one of: {', '.join(SCENARIOS)}")
    p.add_argument("--target", default="reference", help="allocator target (default reference)")
    p.add_argument("--preset", default=None, help="configuration preset (default: the scenario's)")
    p.add_argument("--scale", choices=("small", "full"), default="small")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--out", default=None, help="directory for a Markdown report (and PNG if matplotlib)")
    p.set_defaults(func=run_simulate)
    q = subparsers.add_parser("plan", help="how many prefixes stay hittable under each retention setting")
    q.add_argument("--preset", default=None)
    q.add_argument("--pool-blocks", type=int, required=True)
    q.add_argument("--prefix-len", type=int, default=0, help="tokens per prefix (default 16 scheduler blocks)")
    q.add_argument("--target", default="reference")
    q.add_argument("--token-budget", type=int, default=8192)
    q.add_argument("--max-prefixes", type=int, default=400)
    q.add_argument("--seed", type=int, default=None)
    q.set_defaults(func=run_plan)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (the lead wires `add_parser` into `invariants.cli`)."""
    from invariants.cli import _Parser
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
