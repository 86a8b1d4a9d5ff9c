"""pytest plugin: run an upstream test session with one kvretain scheduler mutant active.

Loaded with `-p invariants.zoo.upstream_plugin` by `invariants.zoo.upstream`; it
reads its orders from the environment so that the pytest command line stays
vLLM's own:

- `KVRETAIN_UPSTREAM_MUTANT=<target>:<name>` (e.g. `vllm:preempt_oldest`):
  installed at `pytest_configure`, before any test module is collected, and
  restored at `pytest_unconfigure`. A mutant that cannot be installed (a source
  mutant whose line is not in the installed vLLM) aborts the session: no test
  result is ever reported for a mutant that was not active.
- `KVRETAIN_UPSTREAM_APPLIED=PATH`: written once the mutant is installed (the
  proof the runner checks before it believes a green session).
- `KVRETAIN_UPSTREAM_DESELECT=PATH`: node ids, one a line, left out of the
  session (the tests that fail without any mutant).
- `KVRETAIN_UPSTREAM_LOG=PATH`: one JSON line per test outcome that is not a plain
  pass of a setup/teardown phase, and per test file that fails to import (node id,
  phase, outcome, the exception line).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

ENV_MUTANT = "KVRETAIN_UPSTREAM_MUTANT"
ENV_APPLIED = "KVRETAIN_UPSTREAM_APPLIED"
ENV_DESELECT = "KVRETAIN_UPSTREAM_DESELECT"
ENV_LOG = "KVRETAIN_UPSTREAM_LOG"

_stack: contextlib.ExitStack | None = None


def install(stack: contextlib.ExitStack, spec: str) -> None:
    """Install mutant `spec` (`<target>:<name>`) on vLLM's class; restored when `stack` closes."""
    import importlib

    from invariants.zoo import mutants_scheduler as ms

    target, _, name = spec.partition(":")
    families = {
        "vllm": (ms.SCHEDULER_MUTANTS, "vllm.v1.core.sched.scheduler", "Scheduler"),
        "vllm-async-scheduler": (
            ms.ASYNC_SCHEDULER_MUTANTS,
            "vllm.v1.core.sched.async_scheduler",
            "AsyncScheduler",
        ),
    }
    if target not in families or name not in families[target][0]:
        raise ValueError(f"{ENV_MUTANT}={spec!r}: no such scheduler mutant")
    mutants, module, cls = families[target]
    mutants[name].install(stack, getattr(importlib.import_module(module), cls))


def pytest_configure(config: Any) -> None:
    global _stack
    spec = os.environ.get(ENV_MUTANT)
    if not spec:
        return
    _stack = contextlib.ExitStack()
    install(_stack, spec)
    applied = os.environ.get(ENV_APPLIED)
    if applied:
        Path(applied).write_text(spec + "\n")


def pytest_unconfigure(config: Any) -> None:
    global _stack
    if _stack is not None:
        _stack.close()
        _stack = None


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    path = os.environ.get(ENV_DESELECT)
    if not path:
        return
    drop = set(Path(path).read_text().splitlines())
    kept = [item for item in items if item.nodeid not in drop]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in drop])
        items[:] = kept


def pytest_collectreport(report: Any) -> None:
    if report.failed:  # a test file that cannot even be imported here
        _log(report.nodeid, "collect", "error", _reason(str(report.longrepr)))


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(ENV_LOG)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    reason = ""
    if report.outcome != "passed":
        reason = _reason(str(report.longrepr))
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
    _log(report.nodeid, report.when, report.outcome, reason)


def _log(nodeid: str, when: str, outcome: str, reason: str) -> None:
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a") as fh:
            record = {"nodeid": nodeid, "when": when, "outcome": outcome, "reason": reason[:300]}
            fh.write(json.dumps(record) + "\n")


def _reason(longrepr: str) -> str:
    """The first line of the last `E   ...` block pytest printed (the exception), else the last line."""
    lines = [ln for ln in longrepr.splitlines() if ln.strip()]
    block: list[str] = []
    for ln in reversed(lines):
        if ln.startswith("E "):
            block.append(ln[1:].strip())
        elif block:
            break
    if len(block) > 1 and "validation error" in block[-1]:  # pydantic's reason is on the next line
        return f"{block[-1]}: {block[-2]}"
    if block:
        return block[-1]
    return lines[-1].strip() if lines else ""
