"""The upstream report of a finding, in Markdown, in the shape of vLLM's bug
template: environment, what breaks, the operations, expected vs actual, and
the exported regression test to paste into tests/v1/core."""

from __future__ import annotations

import json
import platform
import re
import sys
from typing import Any

from invariants.export.plan import ExportPlan
from invariants.harness.trace import config_to_json
from invariants.targets.vllm_env import vllm_available, vllm_version
from model.contract.ops import op_to_json


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


def title(plan: ExportPlan) -> str:
    """What breaks, in the words of what a user sees (a known finding's consequence), else
    the property and its message."""
    f = plan.finding
    if f is not None and f.consequence:
        kind, _, what = f.consequence.partition(":")
        what = re.sub(r" [(][^)]*[)]", "", what).strip()
        return f"[Bug]: {kind.strip()}: {what}"
    return f"[Bug]: prefix caching breaks {plan.expectation.property}: {plan.message[:80]}"


def summary(plan: ExportPlan, test_file: str, verdict: str) -> list[str]:
    """Five lines: trigger, consequence, the vLLM function, the fix direction, the test."""
    f, exp = plan.finding, plan.expectation
    fixes = [u for u in (f.upstream if f else ()) if "fix" in u.split(" (", 1)[-1][:20]]
    direction = (
        f"as proposed in {fixes[0].split(' (')[0]}"
        if fixes
        else f"restore `{exp.property}`: {exp.guards.split('. ')[0].rstrip('.')}"
    )
    return [
        f"- **Trigger**: {f.reachability if f and f.reachability else _config_words(plan)}",
        f"- **Consequence**: {f.consequence if f and f.consequence else f'`{exp.property}` breaks: {plan.message}'}",
        f"- **vLLM function**: {f'`{f.where}`' if f and f.where else 'not located yet'}",
        f"- **Fix direction**: {direction}",
        f"- **Test**: `{test_file}` ({verdict})",
    ]


def _config_words(plan: ExportPlan) -> str:
    cfg = plan.trace.config
    groups = " + ".join(f"{g.kind}{g.block_size}" for g in cfg.groups)
    extra = [
        *(["Eagle"] if cfg.eagle else []),
        *([f"{cfg.num_lookahead_tokens} draft token(s)"] if cfg.num_lookahead_tokens else []),
        *(["a KV connector"] if cfg.kv_connector else []),
        *([f"retention interval {cfg.retention_interval}"] if cfg.retention_interval is not None else []),
    ]
    return f"{groups}, {cfg.num_blocks} blocks" + "".join(f", {e}" for e in extra)


def render_issue(plan: ExportPlan, test_source: str, test_file: str, sentence: str | None = None) -> str:
    """The report: a title that says what breaks, a five-line summary, the exported test,
    and the shortest trace in words (`sentence`: explore's one-sentence form of the
    trace, which the caller builds; by default each operation as a short phrase)."""
    trace, exp = plan.trace, plan.expectation
    verdict = run_exported(test_source)
    words = sentence or "; ".join(_phrase(op) for op in trace.ops) + f": {trace.violation}"
    lines = [
        f"# {title(plan)}",
        "",
        *summary(plan, test_file, verdict),
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
        f"### Shortest trace ({len(trace.ops)} operations, the last one breaks the property)",
        "",
        words,
        "",
        f"Configuration: `{json.dumps(config_to_json(trace.config))}`",
        "",
        "### Expected vs actual",
        "",
        "| | |",
        "|---|---|",
        f"| expected | {_expected(plan)} |",
        f"| actual (recorded on target `{trace.target}`, seed {trace.seed}) | `{trace.violation}` |",
        f"| the regression test below | {verdict} |",
        "",
        "### Regression test",
        "",
        f"`{test_file}` (needs only vLLM, torch and pytest; fails today, passes once fixed):",
        "",
        "```python",
        test_source.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(lines)


def _phrase(op: Any) -> str:
    data = op_to_json(op)
    name = data.pop("op")
    parts = [name]
    for key, value in data.items():
        if key == "rid":
            parts.append(str(value))
        elif key == "rids":
            parts.append(",".join(value))
        elif key in ("prompt", "tokens"):
            parts.append(f"{len(value)} tokens")
        else:
            parts.append(f"{key} {value}")
    return " ".join(parts)
