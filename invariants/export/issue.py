"""The upstream report of a finding, in Markdown, in the shape of vLLM's bug
template: environment, what breaks, the operations, expected vs actual, and
the exported regression test to paste into tests/v1/core."""

from __future__ import annotations

import json
import platform
import sys
from typing import Any

from invariants.export.plan import ExportPlan
from invariants.harness.trace import config_to_json
from invariants.targets.vllm_env import vllm_available, vllm_version
from model.ops import op_to_json


def _expected(plan: ExportPlan) -> str:
    exp = plan.expectation
    if exp.kind == "replay_hit":
        blocks = ", ".join(f"{role} of group {g} (prefix {n} tokens)" for g, n, role in exp.needed)
        return (
            f"right after request `{exp.request}` finishes, replaying its {len(exp.prompt)}-token prompt "
            f"hits at least {exp.hit} tokens, served by: {blocks}"
        )
    if exp.kind == "stored_tokens":
        return "; ".join(
            f"group {g}: BlockStored carries {len(t)} token ids (those of the blocks stored)"
            for g, t in sorted(exp.stored.items())
        )
    if exp.kind == "crash":
        return "every step completes without an exception"
    if exp.kind == "copies":
        return "no copy-on-write copy of the last step reads a block that step allocated"
    parts = [f"free queue {list(exp.free_queue)}", f"ref counts of blocks 1.. {list(exp.ref_cnt)}"]
    if exp.hit is not None:
        parts.insert(0, f"hit {exp.hit}")
    return "; ".join(parts)


def run_exported(test_source: str) -> str:
    """What the exported test says on the vLLM installed here: its failure's first
    line, that a setup step diverged (the file's `SetupDiverged`: the trace does not
    reach the finding's state here), or why it did not fail. The test is our own
    generated code."""
    ok, reason = vllm_available()
    if not ok:
        return f"not run here ({reason})"
    namespace: dict[str, object] = {"__name__": "kvretain_exported"}
    try:
        exec(compile(test_source, "<exported test>", "exec"), namespace)
        tests: list[Any] = [v for k, v in namespace.items() if k.startswith("test_")]
        tests[0]()
    except AssertionError as exc:
        first = (str(exc).splitlines() or ["assertion failed"])[0]
        return f"fails on vLLM {vllm_version()}: {first}"
    except Exception as exc:  # the allocator raising is a result too
        diverged = namespace.get("SetupDiverged")
        if isinstance(diverged, type) and isinstance(exc, diverged):
            return f"does not reach the finding's state on vLLM {vllm_version()}: {str(exc)[:200]}"
        return f"raises on vLLM {vllm_version()}: {type(exc).__name__}: {str(exc)[:200]}"
    return (
        f"passes on the installed vLLM {vllm_version()} (fixed there, or the trace needs the "
        "modified allocator it was found on)"
    )


def _environment() -> list[str]:
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = "not installed"
    return [
        f"- vLLM: {vllm_version() or 'not installed'}",
        f"- torch: {torch_version}",
        f"- Python: {sys.version.split()[0]} ({platform.platform()})",
        "- Reproduces on CPU: only `vllm.v1.core` is exercised (no model, no GPU).",
    ]


def render_issue(plan: ExportPlan, test_source: str, test_file: str) -> str:
    trace, exp = plan.trace, plan.expectation
    title = plan.finding.id if plan.finding else exp.property
    lines = [
        f"# [Bug]: prefix caching: {exp.property} broken ({title})",
        "",
        "### Your current environment",
        "",
        *_environment(),
        "",
        "### Describe the bug",
        "",
        plan.finding.description if plan.finding else f"The allocator breaks `{exp.property}`.",
        "",
        f"**Property `{exp.property}`**: {exp.guards}",
        "",
        f"**Asked for by**: {exp.asked_by}",
        "",
    ]
    if plan.finding and plan.finding.where:
        lines += [f"**Where**: `{plan.finding.where}`", ""]
    lines += [
        "### Configuration",
        "",
        "```json",
        json.dumps(config_to_json(trace.config)),
        "```",
        "",
        f"### Operations ({len(trace.ops)}, the last one breaks the property)",
        "",
        "| step | operation |",
        "|---:|---|",
        *(f"| {i} | `{json.dumps(op_to_json(op))}` |" for i, op in enumerate(trace.ops)),
        "",
        "### Expected vs actual",
        "",
        "| | |",
        "|---|---|",
        f"| expected | {_expected(plan)} |",
        f"| actual (recorded on target `{trace.target}`, seed {trace.seed}) | `{trace.violation}` |",
        f"| the regression test below | {run_exported(test_source)} |",
        "",
        "### Regression test",
        "",
        f"`{test_file}` (needs only vLLM and pytest; fails today, passes once fixed):",
        "",
        "```python",
        test_source.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(lines)
