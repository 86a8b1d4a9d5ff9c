"""The SGLang matrix as a Markdown report: the table, then per release its capabilities,
the fuzz rows (every non-clean one with class, message, why and trace), the layouts left
out with their reason, and where a release ships both cache families, what differs
between its legacy and unified caches, aspect by aspect, with counts and a first example."""

from __future__ import annotations

import json
from typing import Any

from invariants.matrix.runner import ReleaseRun
from invariants.matrix.sglang_runner import HEADERS, matrix_rows


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def _fuzz_lines(rows: list[dict[str, Any]]) -> list[str]:
    table = [
        [
            r["family"],
            r["layout"],
            r["verdict"] if r["verdict"] == "clean" else f"{r['verdict']}: {r['check']}",
            str(r["seeds"]),
            str(r["ops"]),
            ", ".join(f"{k} {v}" for k, v in sorted(r.get("coverage", {}).items())),
        ]
        for r in rows
    ]
    out = _md_table(["family", "layout", "verdict", "histories", "ops", "coverage"], table)
    for r in rows:
        if r["verdict"] != "clean":
            out += [
                "",
                f"- **{r['family']}/{r['layout']}**: {r['verdict']}: `{r['message']}`",
                f"  - why: {r['note']}",
                f"  - trace: `{r['trace']}`",
            ]
    return out


def _diff_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "### Legacy vs unified (same histories, lockstep)",
        "",
        "Each history runs on the unified cache (Python tree core) and the legacy cache at once",
        "and stops at the first op whose result (hit, eviction counts, admission) or pool account",
        "(available, evictable, protected per pool) differs; the aspect names what differed.",
        "",
    ]
    for r in rows:
        out += [
            f"**{r['layout']}**: {r['seeds']} histories, {r['ops']} ops, "
            f"{r['agreed']} agreed to the end, {r['seeds'] - r['agreed']} differed.",
            "",
        ]
        items = sorted({**r["differences"], **r["other"]}.items(), key=lambda kv: -kv[1])
        out += _md_table(
            ["aspect (op: what differs)", "histories", "first example (seed, op index, message)"],
            [
                [
                    k,
                    str(n),
                    f"seed {r['examples'][k]['seed']}, op {r['examples'][k]['op_index']}: "
                    f"`{r['examples'][k]['message'][:160]}`",
                ]
                for k, n in items
            ],
        )
        out.append("")
    return out


def render(runs: list[ReleaseRun], command: str) -> str:
    out = [
        "# SGLang release matrix",
        "",
        f"Produced by `{command}`. Columns: time to prepare each release's environment (0 when",
        "cached) and to run its checks, the cache families kvretain drives there, the fuzz verdict",
        "over every (family, layout) it serves, how many layouts were left out, and how many",
        "lockstep histories found the legacy and unified caches differing (see docs/sglang.md).",
        "",
        *_md_table(HEADERS, matrix_rows(runs)),
        "",
    ]
    for r in runs:
        out += [f"## SGLang {r.version}", ""]
        caps = r.result.get("capabilities")
        if caps:
            out += ["capabilities: `" + json.dumps(caps, separators=(", ", ": ")) + "`", ""]
        if r.error:
            out += [f"Not checked: {r.error}", ""]
            continue
        out += _fuzz_lines(r.result["fuzz"]) + [""]
        skipped = r.result.get("skipped", [])
        if skipped:
            out += [
                "Left out: " + "; ".join(f"{s['family']}/{s['layout']} ({s['why']})" for s in skipped),
                "",
            ]
        if r.result["legacy_vs_unified"]:
            out += _diff_lines(r.result["legacy_vs_unified"])
    return "\n".join(out)
