"""`kvretain matrix`: every release's checks, one table, JSON and Markdown.

For each release: prepare its environment (`vllm_env.prepare_release`, cached,
so a second run installs nothing), run `invariants.matrix.worker` under its
interpreter with this kvretain first on the path, and collect the result. The
per-release budget bounds the checks (the worker shares it out); a worker that
overruns it by more than `SLACK_S` (importing vLLM, shrinking) is stopped and
reported as such. Nothing is written until every release has run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.errors import UsageError
from invariants.report import table
from invariants.targets.vllm_env import ReleaseEnvError, prepare_release, vllm_version

# The last release before #42258's block mask (0.22.0 has it; the matrix's own
# capability column shows the change): the default span starts here.
FIRST_RELEASE = "0.21.0"
SLACK_S = 90.0
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def parse_version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def parse_releases(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out:
        raise UsageError("--releases: give at least one version, e.g. 0.21.0,0.33.0")
    for v in out:
        if not VERSION.match(v):
            raise UsageError(f"--releases: {v!r} is not a release version like 0.21.0")
    return sorted(dict.fromkeys(out), key=parse_version)


def index_releases() -> list[str]:
    """Every vLLM release the package index serves from FIRST_RELEASE on."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("Available versions:")), None)
    if proc.returncode != 0 or line is None:
        raise UsageError("the package index did not list vllm's releases; pass --releases explicitly")
    found = [v.strip() for v in line.split(":", 1)[1].split(",")]
    first = parse_version(FIRST_RELEASE)
    return sorted((v for v in found if VERSION.match(v) and parse_version(v) >= first), key=parse_version)


@dataclass
class ReleaseRun:
    version: str
    python: str = ""
    install_s: float = 0.0
    disk_bytes: int = 0
    check_s: float = 0.0
    error: str | None = None
    result: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "python": self.python,
            "install_s": round(self.install_s, 1),
            "disk_bytes": self.disk_bytes,
            "check_s": round(self.check_s, 1),
            "error": self.error,
            **self.result,
        }


def _installed_disk() -> int:
    import vllm  # noqa: F401  (the running interpreter's own release)

    root = Path(sys.modules["vllm"].__file__ or "").parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def run_release(version: str, budget_s: float, seed: int, out: Path) -> ReleaseRun:
    run = ReleaseRun(version)
    if vllm_version() == version:  # this interpreter's own release: nothing to install
        run.python = sys.executable
        run.disk_bytes = _installed_disk()
    else:
        try:
            env = prepare_release(version)
        except ReleaseEnvError as exc:
            run.error = str(exc)
            return run
        run.python, run.install_s, run.disk_bytes = str(env.python), env.install_s, env.disk_bytes
    root = str(Path(__file__).resolve().parents[2])
    env_vars = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    cmd = [run.python, "-m", "invariants.matrix.worker", "--budget-s", str(budget_s), "--seed", str(seed)]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [*cmd, "--out", str(out / version)],
            stdout=subprocess.PIPE,
            text=True,
            env=env_vars,
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
    if "error" in result:
        run.error = result["error"]
    else:
        run.result = result
    return run


def run_matrix(releases: list[str], budget_s: float, seed: int, out: Path) -> list[ReleaseRun]:
    runs = []
    for i, version in enumerate(releases, 1):
        print(f"[matrix] {i}/{len(releases)} vLLM {version}: preparing", file=sys.stderr, flush=True)
        run = run_release(version, budget_s, seed, out)
        status = run.error or "checked"
        print(
            f"[matrix] {i}/{len(releases)} vLLM {version}: {status} "
            f"(install {run.install_s:.0f} s, checks {run.check_s:.0f} s, disk {run.disk_bytes / 1e6:.0f} MB)",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run)
    return runs


# ----------------------------------------------------------------------------- the table
def _cell(check: dict[str, Any]) -> str:
    verdict = check.get("verdict", "?")
    if verdict == "clean":
        tolerated = check.get("tolerated") or {}
        extra = ", ".join(f"{k} {n}" for k, n in sorted(tolerated.items()))
        return f"clean ({extra})" if extra else "clean"
    if verdict.startswith("n/a"):
        return "n/a"
    name = (check.get("message") or "").split(":", 1)[0]
    return f"{verdict}: {name}"


def _conformance_cell(rows: list[dict[str, Any]]) -> str:
    applied = [r for r in rows if not r.get("verdict", "").startswith("n/a")]
    agree = sum(1 for r in applied if r.get("verdict") == "clean")
    kinds = sorted({r["verdict"] for r in applied if r.get("verdict") != "clean"})
    return f"{agree}/{len(applied)} agree" + (f" ({', '.join(kinds)})" if kinds else "")


def _known_cell(rows: list[dict[str, Any]]) -> str:
    odd = [r["id"] for r in rows if r.get("reproduces") is not None and r["reproduces"] != r["expected"]]
    listed = sum(1 for r in rows if r.get("expected") and r.get("reproduces"))
    return f"{listed} listed repro" + (f"; unlisted/stale: {', '.join(odd)}" if odd else "")


def _caps_cell(caps: dict[str, Any]) -> str:
    flags = [
        ("mask", caps.get("block_mask")),
        ("eagle-mask", caps.get("eagle_aware_mask")),
        ("mamba-R", caps.get("mamba_retention")),
        ("junction", caps.get("shared_prefix_junction")),
        ("fine-mamba", caps.get("fine_grained_mamba")),
        ("scheduler", caps.get("scheduler_missing") == []),  # vllm can drive it
    ]
    have = " ".join(name for name, ok in flags if ok)
    return f"free={caps.get('free_order')} R={caps.get('retention')} {have}".strip()


HEADERS = [
    "release",
    "install s",
    "check s",
    "disk MB",
    "capabilities",
    "fuzz",
    "invariants",
    "conformance",
    "known",
]


def matrix_rows(runs: list[ReleaseRun]) -> list[list[str]]:
    rows = []
    for r in runs:
        head = [r.version, f"{r.install_s:.0f}", f"{r.check_s:.0f}", f"{r.disk_bytes / 1e6:.0f}"]
        if r.error:
            rows.append([*head, f"ERROR: {r.error}"[:80], "-", "-", "-", "-"])
            continue
        checks = {c["check"]: c for c in r.result["checks"]}
        rows.append(
            [
                *head,
                _caps_cell(r.result["capabilities"]),
                _cell(checks["fuzz"]),
                _cell(checks["invariants"]),
                _conformance_cell(r.result["conformance"]),
                _known_cell(r.result["known"]),
            ]
        )
    return rows


def format_table(runs: list[ReleaseRun]) -> str:
    return table(HEADERS, matrix_rows(runs))
