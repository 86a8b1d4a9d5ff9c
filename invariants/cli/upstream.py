"""`kvretain upstream-tests`: vLLM's own tests against each scheduler mutant of the zoo.

    kvretain upstream-tests DIR [--only NAME] [--files PATH ...] [--pythonpath DIR ...]
                            [--timeout-s T] [--json PATH]

DIR is a vLLM source tree holding `tests/` (a checkout of the release's commit,
or the release's sdist unpacked: `pip download vllm==X --no-deps --no-binary
:all:` fails to build, so fetch the `.tar.gz` the index lists). The tests run
offline on the CPU under the installed vLLM (`invariants.zoo.upstream`): a
control session without a mutant, then one session per mutant of
`--target vllm` and `--target vllm-async-scheduler`, each stopping at
its first failing test.

Prints a table (mutant | vLLM's tests | verdict), the counts, the vLLM commits
(installed and of DIR), and the tests that cannot run here (they fail without a
mutant and are deselected from every mutant session). `--pythonpath` adds
directories to the sessions' path (vLLM modules the installed wheel imports but
this environment lacks, e.g. `einops`).

Exit codes: 0 every mutant is missed by vLLM's tests (the zoo's claim holds);
1 some mutant is caught, stale, hung or errored; 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from invariants.cli.fuzz import positive_float
from invariants.errors import UsageError
from invariants.results import output_path


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `upstream-tests`; `args.func` is `run`."""
    p = subparsers.add_parser(
        "upstream-tests",
        help="vLLM's own tests/v1/core against each scheduler mutant: which ones upstream catches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", metavar="DIR", help="a vLLM source tree with tests/ (checkout or unpacked sdist)")
    p.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="only this mutant (repeatable)"
    )
    p.add_argument(
        "--files", nargs="+", metavar="PATH", help="test files/dirs under DIR (default tests/v1/core)"
    )
    p.add_argument(
        "--pythonpath", action="append", default=[], metavar="DIR", help="added to the sessions' path"
    )
    p.add_argument(
        "--timeout-s", type=positive_float, default=1800.0, help="per pytest session (default 1800)"
    )
    p.add_argument("--json", metavar="PATH", type=output_path, help="also write the report as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from invariants.zoo import upstream

    root = Path(args.dir)
    files = tuple(args.files) if args.files else upstream.DEFAULT_FILES
    for extra in args.pythonpath:
        if not Path(extra).is_dir():
            raise UsageError(f"--pythonpath {extra}: not a directory")
    try:
        upstream.locate(root, files)
        upstream.scheduler_mutants(args.only)
        report = upstream.run_upstream(
            root,
            files=files,
            only=args.only,
            pythonpath=args.pythonpath,
            timeout_s=args.timeout_s,
            log=lambda line: print(f"upstream-tests: {line}", file=sys.stderr, flush=True),
        )
    except upstream.UpstreamError as exc:
        raise UsageError(str(exc)) from exc
    print(upstream.render(report))
    code = 0 if all(r.verdict == "missed" for r in report.rows) else 1
    if args.json:
        data = dict(report.to_json(), exit_code=code)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return code
