"""The `kvretain` command line.

Exit codes: 0 everything holds; 1 a violation (a finding); 2 bad usage, bad
input or a missing target (one line on stderr naming what is wrong).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from invariants.cli.fuzz import (
    cmd_bench,
    cmd_conformance,
    cmd_fuzz,
    cmd_replay,
    non_negative_float,
    positive_float,
    positive_int,
)
from invariants.cli.prove import cmd_prove
from invariants.cli.verify import cmd_verify
from invariants.errors import UsageError
from invariants.harness.trace import TraceError
from invariants.results import add_output_flags
from invariants.targets import BUILTIN_TARGETS, RENAMED, TARGET_NAMES, TargetUnavailable, plugin_targets
from model.contract.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


# Command groups that live in invariants/cli/, each a module with `add_parser(subparsers)`.
_BUILTIN_COMMANDS = (
    "invariants.cli.zoo",
    "invariants.cli.simulate",
    "invariants.cli.export",
    "invariants.cli.matrix",
    "invariants.cli.explore",
    "invariants.cli.upstream",
)
COMMAND_GROUP = "kvretain.commands"


@functools.cache
def command_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Command groups that packages register under the `kvretain.commands` entry
    point (`name = "package.module"`: a module with `add_parser(subparsers)` and,
    for a row of `kvretain verify`, `verify_row(quick=...)` returning that row), by
    name, not loaded yet.

    This is how `gpu-check` reaches the command line while invariants/ never
    imports gpu_check/ (gpu_check/ imports invariants/, not the reverse). A
    checkout this interpreter has not installed (`--vllm-python` re-runs kvretain
    from PYTHONPATH) has no entry-point metadata, so its own pyproject.toml is read
    as well; an installed entry point wins over it."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMAND_GROUP)}
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text()).get("project", {}) if pyproject.is_file() else {}
    if project.get("name") == "kvretain":
        for name, value in project.get("entry-points", {}).get(COMMAND_GROUP, {}).items():
            found.setdefault(name, importlib.metadata.EntryPoint(name, value, COMMAND_GROUP))
    return dict(sorted(found.items()))


def _command_module(module: str) -> object:
    """A kvretain module that registers commands; one that fails to import is a
    broken build, reported as a usage error rather than a missing command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"cannot import {module}: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------- main
DRIFT_EXIT = (
    "Verdicts: VIOLATION (exit 1) a defect: a contract broken (an invariant, a crash, a seeds' mechanism "
    "diverging); POLICY DRIFT (exit 4) every contract kept, but the target made one of vLLM's policy "
    "decisions (the preemption victim, the queue order a step leaves) otherwise than the model's "
    "prediction: said once, then the target is judged without the model; "
    "KVRETAIN_DECLARED_POLICIES=preemption,queue-order declares a branch's own policy (drift reported "
    "as declared, exit 0). docs/semantics.md, 'Verdicts'."
)


def build_parser() -> argparse.ArgumentParser:
    """The `kvretain` parser: the commands defined here, then every command group's module
    (built-in, then plug-ins by entry point), each accepting `--vllm-python`."""
    parser = _Parser(
        prog="kvretain",
        description="Verify prefix-cache retention in hybrid KV-cache allocators.",
        epilog="Exit codes: 0 everything holds (known findings aside), 1 a violation (a defect), 2 bad "
        "usage or input, 3 (verify) what ran holds but rows were skipped, 4 (fuzz, replay, verify) policy "
        "drift alone: every contract kept, one of vLLM's policy decisions made otherwise than predicted "
        "(KVRETAIN_DECLARED_POLICIES=preemption,queue-order declares a branch's own: exit 0). Judge your own vLLM checkout: add "
        "--vllm-python PATH/TO/ITS/bin/python to any command (README, 'Judge your branch').",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_fuzz(sub)
    _add_replay(sub)
    _add_prove(sub)
    _add_verify(sub)
    _add_conformance(sub)
    _add_bench(sub)
    for module in (*_BUILTIN_COMMANDS, *(ep.module for ep in command_plugins().values())):
        _command_module(module).add_parser(sub)  # type: ignore[attr-defined]
    for command_parser in (parser, *sub.choices.values()):
        add_vllm_python_flag(command_parser)
    return parser


def _add_fuzz(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain fuzz`: one target against the model, on generated or preset configurations,
    at small or production scale, or as a Ray campaign over seeds."""
    f = sub.add_parser("fuzz", help="stateful fuzzing of one target against the model", epilog=DRIFT_EXIT)
    f.add_argument(
        "--target",
        choices=(*TARGET_NAMES, "sglang"),
        default="reference",
        help="the allocator under test: built-in "
        + ", ".join(BUILTIN_TARGETS)
        + (f"; plug-ins: {', '.join(plugin_targets())}" if plugin_targets() else "")
        + " (packages register more under the kvretain.targets entry point)",
    )
    f.add_argument("--config", help="a preset name (default: generated configurations)")
    f.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="stop after this many steps (default 2000 without --budget-s)",
    )
    f.add_argument("--seed", type=int, default=0)
    f.add_argument(
        "--budget-s", type=positive_float, default=None, help="wall-clock bound, shrinking included"
    )
    f.add_argument(
        "--shrink-s",
        type=positive_float,
        default=None,
        help="shrinking limit (default 1/4 of the budget, or 30)",
    )
    f.add_argument(
        "--audit-every", type=positive_int, default=None, help="full-state audit every K operations"
    )
    f.add_argument(
        "--db", default=".kvretain/examples", help="Hypothesis example database (failures replayed first)"
    )
    f.add_argument("--no-db", action="store_true", help="keep no example database")
    f.add_argument("--out", default="kvretain-traces", help="where failing traces are written")
    f.add_argument(
        "--scale",
        choices=("small", "production"),
        default="small",
        help="production: real presets, vLLM-sized pools, 16+ requests in flight, 8k chunks",
    )
    f.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="a campaign: every --seeds seed (and --config name, comma-separated) a run on a Ray "
        "cluster's workers, merged into one report (local, local:N, auto, HOST:PORT); docs/campaigns.md",
    )
    f.add_argument("--seeds", metavar="A-B|A,B,...", help="the campaign's seeds (with --ray; default --seed)")
    add_output_flags(f)
    f.set_defaults(func=cmd_fuzz)


def _add_replay(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain replay`: a trace file re-run against one or more targets."""
    r = sub.add_parser("replay", help="re-run a trace file against targets", epilog=DRIFT_EXIT)
    r.add_argument("trace")
    r.add_argument(
        "--target", action="append", choices=TARGET_NAMES, help="repeat to compare targets side by side"
    )
    r.set_defaults(func=cmd_replay)


def _add_prove(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain prove`: the theorem catalogue, optionally with the production link and CrossHair."""
    p = sub.add_parser("prove", help="Z3 theorems about masks, hits and free-queue order")
    p.add_argument(
        "--production-link",
        action="store_true",
        help="also check vLLM's mask and hit functions against the model exhaustively (bounded domain)",
    )
    p.add_argument(
        "--crosshair",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="also run CrossHair contracts and diffbehavior twins, SECONDS per function",
    )
    p.set_defaults(func=cmd_prove)


def _add_verify(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain verify`: proofs and fuzzing of every installed target; the targets named by
    `--require` fail the run when their rows are skipped."""
    v = sub.add_parser(
        "verify",
        help="the main job: proofs, fuzzing of every installed target (vLLM also at production scale), summary table",
    )
    v.add_argument("--quick", action="store_true", help="small budgets (used by the tests)")
    v.add_argument("--steps", type=positive_int, default=20000, help="fuzz steps per target")
    v.add_argument(
        "--budget-s",
        type=positive_float,
        default=60.0,
        help="fuzz time budget per target, and for the production-scale vLLM run",
    )
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--out", default="kvretain-traces")
    v.add_argument(
        "--require",
        action="append",
        choices=(*TARGET_NAMES, "sglang"),
        metavar="TARGET",
        help="fail (exit 1) when TARGET's rows are skipped (repeatable; `make verify` requires vllm and sglang); "
        "without it a run with skipped rows exits 3, never 0",
    )
    add_output_flags(v)
    v.set_defaults(func=cmd_verify)


def _add_conformance(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain conformance`: vLLM against the model, feature by feature, each with its budget."""
    c = sub.add_parser("conformance", help="vLLM vs the model, feature by feature")
    c.add_argument("--steps", type=positive_int, default=1500, help="fuzz steps per feature")
    c.add_argument("--budget-s", type=positive_float, default=30.0, help="time budget per feature")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="kvretain-traces")
    add_output_flags(c)
    c.set_defaults(func=cmd_conformance)


def _add_bench(sub: argparse._SubParsersAction[_Parser]) -> None:
    """`kvretain bench`: the raw allocator against the checked harness on one fixed workload."""
    b = sub.add_parser("bench", help="raw allocator cycles/s vs the checked harness on one fixed workload")
    b.add_argument(
        "--target", choices=("default", "sglang"), default="default", help="sglang: its radix cache"
    )
    b.add_argument("--requests", type=positive_int, default=300)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--scale",
        choices=("small", "production"),
        default="small",
        help="production: dsv4-flash, 156k blocks",
    )
    b.add_argument(
        "--compare-compiled",
        action="store_true",
        help="pure Python against the compiled build (make compiled): checked/raw and explore states/CPU s",
    )
    b.add_argument(
        "--rounds", type=positive_int, default=2, help="with --compare-compiled: rounds per variant"
    )
    b.add_argument(
        "--explore-depth", type=positive_int, default=4, help="with --compare-compiled: the search's depth"
    )
    b.set_defaults(func=cmd_bench)


VLLM_PYTHON = "--vllm-python"
# kvretain's runtime dependencies (pyproject's `dependencies`, import name -> distribution):
# what an environment judged with --vllm-python needs besides vLLM.
RUNTIME_DEPENDENCIES = {"hypothesis": "hypothesis", "z3": "z3-solver"}


def runtime_requirements() -> list[str]:
    """The pip requirements of kvretain's runtime dependencies, pinned as
    requirements/dev.txt pins them (unpinned where it does not)."""
    dev = Path(__file__).resolve().parents[2] / "requirements" / "dev.txt"
    lines = dev.read_text().splitlines() if dev.is_file() else []
    pins = {line.split("==")[0].strip().lower(): line.strip() for line in lines if "==" in line}
    return [pins.get(dist, dist) for dist in RUNTIME_DEPENDENCIES.values()]


def add_vllm_python_flag(parser: argparse.ArgumentParser) -> None:
    """Show `--vllm-python PATH` in `parser`'s help. The flag itself is taken out of
    the arguments by `main` before argparse sees them (the command re-runs under that
    interpreter, whose own argparse never sees it), so a value argparse does receive
    means it was abbreviated, which `main` refuses."""
    parser.add_argument(
        VLLM_PYTHON,
        metavar="PATH",
        dest="vllm_python",
        default=None,
        help="judge the vLLM of another environment (say, the venv of your editable vLLM checkout): "
        "kvretain re-runs this command under that interpreter, this checkout first on its PYTHONPATH; "
        f"that environment needs `pip install {' '.join(runtime_requirements())}`. Give it in full",
    )


def split_vllm_python(args: list[str]) -> tuple[str | None, list[str]]:
    """(the interpreter `--vllm-python PATH` or `--vllm-python=PATH` names, the
    arguments without it); (None, args) when it is absent. Given twice, or without
    a path, is a usage error."""
    found = [i for i, a in enumerate(args) if a == VLLM_PYTHON or a.startswith(VLLM_PYTHON + "=")]
    if not found:
        return None, args
    if len(found) > 1:
        raise UsageError(f"{VLLM_PYTHON} given {len(found)} times; give it once")
    i = found[0]
    if args[i] == VLLM_PYTHON:
        if i + 1 >= len(args) or not args[i + 1] or args[i + 1].startswith("-"):
            raise UsageError(f"{VLLM_PYTHON} needs the path of a Python interpreter")
        return args[i + 1], args[:i] + args[i + 2 :]
    python = args[i].split("=", 1)[1]
    if not python:
        raise UsageError(f"{VLLM_PYTHON} needs the path of a Python interpreter")
    return python, args[:i] + args[i + 1 :]


def _run_under(python: str, argv: list[str]) -> int:
    """`--vllm-python PATH`: re-run this command under another interpreter (a
    vLLM developer's environment), with this kvretain first on its path."""
    import os
    import subprocess

    from invariants.targets.vllm_env import IMPORT_CHECK_ENV, JUDGED_PYTHON_ENV, probe_python

    # Its version only: whether vLLM imports there is checked by the re-run command itself,
    # which imports it anyway (a probe importing it too cost a second vLLM import per command).
    ok, line, _ = probe_python(python, modules=())
    if not ok:
        raise UsageError(line)
    imports = "; ".join(f"import {name}" for name in RUNTIME_DEPENDENCIES)
    if subprocess.run([python, "-c", imports], capture_output=True, check=False).returncode != 0:
        raise UsageError(
            f"{VLLM_PYTHON} {python}: kvretain's runtime dependencies do not import there; "
            f"install them with: {python} -m pip install {' '.join(runtime_requirements())}"
        )
    print(f"kvretain: running under {line}", file=sys.stderr, flush=True)
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **{JUDGED_PYTHON_ENV: python, IMPORT_CHECK_ENV: python})
    return subprocess.call([python, "-m", "invariants.cli.main", *argv], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        renamed = [a.removeprefix("--target=") for a in args_list if a.removeprefix("--target=") in RENAMED]
        if renamed:  # an old target name: its new one, not argparse's list of choices
            raise UsageError(f"--target: {renamed[0]!r} is now called {RENAMED[renamed[0]]}")
        python, rest = split_vllm_python(args_list)
        if python is not None:
            return _run_under(python, rest)
        from invariants.targets.vllm_env import import_check_here

        failed = import_check_here()  # a command re-run by `--vllm-python`: does vLLM import here?
        if failed:
            raise UsageError(failed)
    except UsageError as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2
    from invariants.compiled import state

    if state().modules:  # the opt-in mypyc build is in use (`make compiled`): say so first
        print(f"kvretain: {state().line()}", file=sys.stderr)
    try:
        args = build_parser().parse_args(args_list)
        if args.vllm_python is not None:  # an abbreviation argparse expanded: split_vllm_python missed it
            raise UsageError(
                f"write {VLLM_PYTHON} in full (an abbreviation would run this interpreter's vLLM)"
            )
        if str(getattr(args, "target", None) or "").startswith("vllm") or args.command in (
            "verify",
            "conformance",
        ):
            from invariants.targets.vllm_env import version_warning

            warning = version_warning()
            if warning:
                print(f"kvretain: warning: {warning}", file=sys.stderr)
            from invariants.targets.vllm_capabilities import profile_lines

            for line in profile_lines():  # the release whose rules judge, and any profile drift
                print(f"kvretain: {line}", file=sys.stderr)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except (UsageError, TraceError, ConfigError, TargetUnavailable) as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
