"""`kvretain matrix`: judge several releases of an engine (vLLM by default, or SGLang with
`--engine sglang`), each in its own cached environment."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from invariants.errors import UsageError


def add_parser(sub: Any) -> None:
    m = sub.add_parser("matrix", help="judge several vLLM (or SGLang) releases (one cached environment each)")
    m.add_argument("--engine", default="vllm", help="vllm (default) or sglang")
    m.add_argument(
        "--releases",
        help="comma-separated versions (default: vllm 0.21.0 .. the newest on the index; sglang 0.5.20,0.5.23)",
    )
    m.add_argument("--budget-s", type=float, default=60.0, help="check time per release (installs extra)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--json", help="write the results as JSON here")
    m.add_argument("--markdown", help="write the report as Markdown here")
    m.add_argument("--out", default="kvretain-traces/matrix", help="where failing traces are written")
    m.add_argument(
        "--identity-table",
        action="store_true",
        help="print how each release from 0.20.0 hashed each identity field (docs/identity-matrix.md) and exit",
    )
    m.add_argument(
        "--identity-probe",
        action="store_true",
        help="with --identity-table: also hash real requests on every installed release and compare",
    )
    m.set_defaults(func=cmd_matrix)


def _write(path: str, text: str) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".kvretain-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)


ENGINES = ("vllm", "sglang")


def _cmd_identity(probe: bool) -> int:
    """The identity-field table; with `probe`, each installed release's source and probes
    checked against it (exit 1 on a disagreement)."""
    from invariants.matrix import identity_keys as ik

    print(ik.render_table(), end="")
    if not probe:
        return 0
    bad: list[str] = []
    for version, path in sorted(ik.installed_sources().items(), key=lambda kv: ik.version_key(kv[0])):
        found = ik.disagreements(version, Path(path).read_text()) + ik.probe_disagreements(
            version, ik.run_probes(version)
        )
        print(
            f"identity probe: vLLM {version}: " + ("agrees with the table" if not found else "; ".join(found))
        )
        bad += found
    return 1 if bad else 0


def _check_args(args: argparse.Namespace) -> None:
    if args.engine not in ENGINES:
        raise UsageError(f"--engine: {args.engine!r} is not one of {', '.join(ENGINES)}")
    if args.budget_s <= 0:
        raise UsageError("--budget-s: must be positive")
    for opt in ("json", "markdown"):
        path = getattr(args, opt)
        if path and not Path(path).parent.is_dir():
            raise UsageError(f"--{opt}: directory {Path(path).parent} does not exist")


def cmd_matrix(args: argparse.Namespace) -> int:
    from invariants.matrix.markdown import render
    from invariants.matrix.runner import format_table, index_releases, parse_releases, run_matrix

    _check_args(args)
    if args.identity_table:
        return _cmd_identity(args.identity_probe)
    if args.engine == "sglang":
        return _cmd_sglang(args)
    releases = parse_releases(args.releases) if args.releases else index_releases()
    print(
        f"kvretain matrix: {len(releases)} releases ({', '.join(releases)}), {args.budget_s:.0f} s of checks "
        f"each, seed {args.seed}",
        flush=True,
    )
    runs = run_matrix(releases, args.budget_s, args.seed, Path(args.out))
    print(format_table(runs))
    command = (
        "kvretain matrix --releases "
        + ",".join(releases)
        + f" --budget-s {args.budget_s:g} --seed {args.seed}"
    )
    if args.json:
        _write(args.json, json.dumps({"command": command, "releases": [r.to_json() for r in runs]}, indent=1))
    if args.markdown:
        _write(args.markdown, render(runs, command))
    failed = any(r.error for r in runs)
    print(
        "matrix: " + ("some releases could not be checked" if failed else "every release checked"),
        file=sys.stderr,
    )
    return 2 if failed and all(r.error for r in runs) else 0


def _cmd_sglang(args: argparse.Namespace) -> int:
    from invariants.matrix.sglang_markdown import render
    from invariants.matrix.sglang_runner import DEFAULT_RELEASES, format_table, parse_releases, run_matrix

    releases = parse_releases(args.releases) if args.releases else list(DEFAULT_RELEASES)
    print(
        f"kvretain matrix --engine sglang: {len(releases)} releases ({', '.join(releases)}), "
        f"{args.budget_s:.0f} s of checks each, seed {args.seed}",
        flush=True,
    )
    runs = run_matrix(releases, args.budget_s, args.seed, Path(args.out))
    print(format_table(runs))
    command = (
        f"kvretain matrix --engine sglang --releases {','.join(releases)} "
        f"--budget-s {args.budget_s:g} --seed {args.seed}"
    )
    if args.json:
        _write(args.json, json.dumps({"command": command, "releases": [r.to_json() for r in runs]}, indent=1))
    if args.markdown:
        _write(args.markdown, render(runs, command))
    failed = any(r.error for r in runs)
    print(
        "matrix: " + ("some releases could not be checked" if failed else "every release checked"),
        file=sys.stderr,
    )
    return 2 if failed and all(r.error for r in runs) else 0
