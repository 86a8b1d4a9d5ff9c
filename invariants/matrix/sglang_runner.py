"""`kvretain matrix --engine sglang`: SGLang releases, each in its own cached environment.

For each release: prepare its environment (`sglang_release_env.prepare_release`,
cached; this interpreter's own SGLang is used as is), run
`invariants.matrix.sglang_worker` under its interpreter with this kvretain first
on the path, and collect the result. One table row per release, then per
release with both cache families the legacy-vs-unified differences by aspect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from invariants.errors import UsageError
from invariants.matrix.runner import VERSION, ReleaseRun, parse_version
from invariants.report import table
from invariants.targets.sglang_release_env import release_env_vars

# 0.5.20: last release with SWARadixCache / MambaRadixCache (beside the unified cache);
# 0.5.21 removed them; 0.5.23 is the release kvretain's radix model describes.
KNOWN_RELEASES = ("0.5.20", "0.5.21", "0.5.22", "0.5.23")
DEFAULT_RELEASES = ("0.5.20", "0.5.23")
# Past the check budget: importing SGLang (~10 s idle), probing the paged allocator and, on
# a first run, building SGLang's native hash extension; on a loaded machine all of it is slower.
SLACK_S = 180.0


def parse_releases(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out:
        raise UsageError("--releases: give at least one version, e.g. 0.5.20,0.5.23")
    for v in out:
        if not VERSION.match(v):
            raise UsageError(f"--releases: {v!r} is not a release version like 0.5.20")
        if v not in KNOWN_RELEASES:
            raise UsageError(
                f"--releases: SGLang {v} is not one the matrix knows (known: {', '.join(KNOWN_RELEASES)})"
            )
    return sorted(dict.fromkeys(out), key=parse_version)


def _interpreter(version: str, run: ReleaseRun) -> str | None:
    from invariants.targets.sglang_env import sglang_version
    from invariants.targets.sglang_release_env import prepare_release
    from invariants.targets.vllm_env import ReleaseEnvError

    if sglang_version() == version:
        return sys.executable
    try:
        env = prepare_release(version)
    except ReleaseEnvError as exc:
        run.error = str(exc)
        return None
    run.install_s, run.disk_bytes = env.install_s, env.disk_bytes
    return str(env.python)


def run_release(version: str, budget_s: float, seed: int, out: Path) -> ReleaseRun:
    run = ReleaseRun(version)
    python = _interpreter(version, run)
    if python is None:
        return run
    run.python = python
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if python != sys.executable:
        env = release_env_vars(version, env)
    cmd = [python, "-m", "invariants.matrix.sglang_worker", "--budget-s", str(budget_s), "--seed", str(seed)]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [*cmd, "--out", str(out / f"sglang-{version}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            timeout=budget_s + SLACK_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        run.check_s = time.monotonic() - start
        run.error = f"checks overran the budget ({budget_s:.0f} s + {SLACK_S:.0f} s) and were stopped"
        return run
    run.check_s = time.monotonic() - start
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        run.error = f"the worker exited with {proc.returncode} and no result"
        return run
    result = json.loads(lines[-1])
    run.error = result.pop("error", None)
    run.result = result
    return run


def run_matrix(releases: list[str], budget_s: float, seed: int, out: Path) -> list[ReleaseRun]:
    runs = []
    for i, version in enumerate(releases, 1):
        print(f"[matrix] {i}/{len(releases)} SGLang {version}: preparing", file=sys.stderr, flush=True)
        run = run_release(version, budget_s, seed, out)
        print(
            f"[matrix] {i}/{len(releases)} SGLang {version}: {run.error or 'checked'} "
            f"(install {run.install_s:.0f} s, checks {run.check_s:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run)
    return runs


HEADERS = ["release", "install s", "check s", "families", "fuzz", "skipped", "legacy vs unified"]


def _fuzz_cell(rows: list[dict[str, Any]]) -> str:
    clean = sum(1 for r in rows if r["verdict"] == "clean")
    bad = [
        f"{r['family']}/{r['layout']} {r['verdict']}: {r['check']}" for r in rows if r["verdict"] != "clean"
    ]
    ops = sum(r["ops"] for r in rows)
    return f"{clean}/{len(rows)} clean, {ops} ops" + (f" ({'; '.join(bad)})" if bad else "")


def _diff_cell(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "n/a (one family)"
    seeds = sum(r["seeds"] for r in rows)
    agreed = sum(r["agreed"] for r in rows)
    return f"{seeds - agreed}/{seeds} histories differ"


def matrix_rows(runs: list[ReleaseRun]) -> list[list[str]]:
    rows = []
    for r in runs:
        head = [r.version, f"{r.install_s:.0f}", f"{r.check_s:.0f}"]
        res = r.result
        families = ",".join(res.get("capabilities", {}).get("families", [])) or "-"
        if r.error:
            rows.append([*head, families, f"ERROR: {r.error}"[:100], "-", "-"])
            continue
        rows.append(
            [
                *head,
                families,
                _fuzz_cell(res["fuzz"]),
                str(len(res.get("skipped", []))),
                _diff_cell(res["legacy_vs_unified"]),
            ]
        )
    return rows


def format_table(runs: list[ReleaseRun]) -> str:
    return table(HEADERS, matrix_rows(runs))
