"""The matrix as a Markdown report: the table, then per release its
capabilities and the model profile they select, every check that did not come back clean (class, first message,
why) and, for each defect, the shrunk trace and the command that replays it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from invariants.matrix.classify import GUARDED_BY, KNOWN_DESIGN
from invariants.matrix.runner import HEADERS, ReleaseRun, matrix_rows
from invariants.targets.vllm_capabilities import MECHANISM_PR, Capabilities, scheduler_unsupported


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return out


def _trace_ops(path: str) -> list[str]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return [f"(trace {path} not readable)"]
    lines = ["config: `" + json.dumps(data["config"], separators=(",", ":")) + "`", "", "```"]
    lines += [json.dumps(op, separators=(",", ":")) for op in data["ops"]]
    return [*lines, "```"]


def _check_lines(version: str, python: str, check: dict[str, Any]) -> list[str]:
    verdict = check.get("verdict", "?")
    if verdict == "clean" or verdict.startswith("n/a"):
        return []
    lines = [
        f"- **{check['check']}**: {verdict}: `{check.get('message')}`",
        f"  - why: {check.get('note', '')}",
    ]
    if check.get("trace"):
        name = check["trace"]
        lines.append(
            f"  - replay ({check.get('ops', '?')} operations, batch seed {check.get('batch_seed')}): "
            f"`kvretain replay --vllm-python {python} {name} --target {check.get('target', 'vllm-manager')}`"
        )
        if verdict == "defect":
            lines += ["", *("    " + x if x else "" for x in _trace_ops(check["trace"])), ""]
    return lines


def _known_design_lines(caps: Capabilities, checks: list[dict[str, Any]]) -> list[str]:
    """The release's known design, once: the invariants of mechanisms it lacks
    (not judged, their breaks counted by every check) and how often they broke."""
    missing = set(caps.missing())
    unjudged = sorted(inv for inv, needs in GUARDED_BY.items() if missing & set(needs))
    counted = [
        (c["check"], (c.get("tolerated") or {}).get(kind, 0), c.get("tolerated_first") or {})
        for c in checks
        for kind in KNOWN_DESIGN
    ]
    total = sum(n for _, n, _ in counted)
    if not unjudged and not total:
        return []
    lacks = ", ".join(f"{m} ({MECHANISM_PR.get(m, m)})" for m in sorted(missing)) or "nothing"
    first = next((f[k] for _, n, f in counted if n for k in KNOWN_DESIGN if k in f), None)
    line = (
        f"- known design (class predates, counted by every check, not judged): mechanisms the release "
        f"lacks: {lacks}; invariants not judged: {', '.join(f'`{i}`' for i in unjudged) or 'none'}; "
        f"{total} break(s) over {sum(1 for _, n, _ in counted if n)} check(s)"
    )
    return [line + (f", first: `{first}`" if first else "")]


def render(runs: list[ReleaseRun], command: str) -> str:
    out = [
        "# vLLM release matrix",
        "",
        f"Produced by `{command}`. Columns: time to prepare each release's environment (0 when",
        "cached) and to run its checks, its disk, the mechanisms detected in its own code, and",
        "the verdict per check (see docs/matrix.md for the classes).",
        "",
        *_md_table(HEADERS, matrix_rows(runs)),
        "",
    ]
    for r in runs:
        out += [f"## vLLM {r.version}", ""]
        if r.error:
            out += [f"Not checked: {r.error}", ""]
            continue
        caps: dict[str, Any] = dict(r.result["capabilities"])
        caps.pop("manager_args", None)
        caps.pop("event_fields", None)
        out += ["capabilities: `" + json.dumps(caps, separators=(", ", ": ")) + "`", ""]
        profile = Capabilities.from_json(r.result["capabilities"]).profile()
        out += [f"model profile: `{profile.describe()}`", ""]
        out += [scheduler_line(Capabilities.from_json(r.result["capabilities"])), ""]
        python = "~/.cache/kvretain/vllm-" + r.version + "/bin/python"
        checks = [*r.result["checks"], *r.result["conformance"]]
        out += _known_design_lines(Capabilities.from_json(r.result["capabilities"]), checks)
        for check in checks:
            out += _check_lines(r.version, python, check)
            out += [f"- {check['check']}: not generated: {what}" for what in check.get("not_generated", ())]
            for kind, first in sorted((check.get("tolerated_first") or {}).items()):
                if kind in KNOWN_DESIGN:
                    continue  # stated once for the release (`_known_design_lines`)
                n = check["tolerated"][kind]
                out.append(f"- {check['check']}: {n} tolerated {kind} violation(s), first: `{first}`")
        for k in r.result["known"]:
            out.append(_known_line(k))
        out.append("")
    return "\n".join(out)


def _known_line(k: dict[str, Any]) -> str:
    """A known finding on the release: as recorded, then through its real scheduler."""
    state = {True: "reproduces", False: "does not reproduce", None: "not applicable"}
    listed = "listed for this release" if k["expected"] else "not listed for this release"
    line = f"- known finding `{k['id']}`: {state[k['reproduces']]} ({listed}) {k.get('note') or ''}".rstrip()
    if "scheduler" in k:  # reports from before the scheduler replay have no such field
        line += f"; through the real Scheduler: {state[k['scheduler']]}"
        line += f" ({k['scheduler_note']})" if k.get("scheduler_note") else ""
    return line


def scheduler_line(caps: Capabilities) -> str:
    """Whether the vllm target (vLLM's real `Scheduler`) can drive this release."""
    if caps.scheduler_missing is None:
        return "vllm: the release's scheduler API was not detected"
    why = scheduler_unsupported(caps)
    return "vllm: can drive this release's Scheduler" if why is None else f"vllm: cannot: {why}"
