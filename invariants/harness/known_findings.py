"""Known findings: real, understood behaviours of a production allocator that an
invariant flags, kept with a replayable trace and the upstream reference.

`known_findings.json` (beside this module) holds them:

    {"format": "kvretain-known-findings", "version": 1,
     "findings": [{"id", "target", "property", "vllm_versions": [...],
                   "message_pattern" (optional regex searched in the message),
                   "upstream": [...], "where", "description",
                   "trace": {kvretain trace, version 1}}]}

A finding names one `target` or a list of `targets` (a finding in vLLM's design
that the model and the reference follow too lists all three). A violation is
known when its target, the target's version (vLLM only) and the violated
property (and, if the finding gives one, the message pattern) match a finding.
`kvretain replay` / `fuzz` report known violations apart from new ones; a
known finding that stops reproducing is worth a look too (the bug may be fixed
upstream: drop the entry).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from invariants.harness.trace import Trace, TraceError, trace_from_json

FINDINGS_FORMAT = "kvretain-known-findings"
FINDINGS_VERSION = 1
DEFAULT_PATH = Path(__file__).with_name("known_findings.json")


class KnownFindingsError(ValueError):
    """A malformed known-findings file; the message names the field."""


@dataclass(frozen=True)
class KnownFinding:
    id: str
    targets: tuple[str, ...]
    property: str
    versions: tuple[str, ...]
    upstream: tuple[str, ...]
    where: str
    description: str
    trace: Trace
    message_pattern: str | None = None

    def matches(self, target: str, version: str | None, prop: str, message: str | None = None) -> bool:
        if target not in self.targets or prop != self.property:
            return False
        # Versions name vLLM releases; the model and reference follow 0.33.0 semantics.
        if target == "vllm" and "*" not in self.versions and version not in self.versions:
            return False
        return (
            self.message_pattern is None
            or message is None
            or re.search(self.message_pattern, message) is not None
        )


def _parse(entry: Any, i: int) -> KnownFinding:
    where = f"findings[{i}]"
    if not isinstance(entry, dict):
        raise KnownFindingsError(f"{where}: must be an object")
    targets = entry.get("targets", [entry.get("target")])
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise KnownFindingsError(f"{where}.targets: must be a non-empty list of target names")
    for key in ("id", "property", "description"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise KnownFindingsError(f"{where}.{key}: must be a non-empty string")
    versions = entry.get("vllm_versions", entry.get("versions"))
    if not isinstance(versions, list) or not versions or not all(isinstance(v, str) for v in versions):
        raise KnownFindingsError(
            f"{where}.vllm_versions: must be a non-empty list of version strings ('*' = any)"
        )
    upstream = entry.get("upstream", [])
    if isinstance(upstream, str):
        upstream = [upstream]
    if not isinstance(upstream, list) or not all(isinstance(u, str) for u in upstream):
        raise KnownFindingsError(f"{where}.upstream: must be a string or a list of strings")
    pattern = entry.get("message_pattern")
    if pattern is not None:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise KnownFindingsError(f"{where}.message_pattern: not a regular expression ({exc})") from None
    try:
        trace = trace_from_json(entry.get("trace"))
    except TraceError as exc:
        raise KnownFindingsError(f"{where}.trace: {exc}") from None
    return KnownFinding(
        id=entry["id"],
        targets=tuple(targets),
        property=entry["property"],
        versions=tuple(versions),
        upstream=tuple(upstream),
        where=str(entry.get("where", "")),
        description=entry["description"],
        trace=trace,
        message_pattern=pattern,
    )


def parse_known_findings(data: Any) -> list[KnownFinding]:
    if not isinstance(data, dict):
        raise KnownFindingsError("known findings: top level must be a JSON object")
    if data.get("format") != FINDINGS_FORMAT:
        raise KnownFindingsError(f"format: expected {FINDINGS_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != FINDINGS_VERSION:
        raise KnownFindingsError(
            f"version: this kvretain reads version {FINDINGS_VERSION}, got {data.get('version')!r}"
        )
    entries = data.get("findings")
    if not isinstance(entries, list):
        raise KnownFindingsError("findings: must be a list")
    findings = [_parse(e, i) for i, e in enumerate(entries)]
    ids = [f.id for f in findings]
    dupes = sorted({x for x in ids if ids.count(x) > 1})
    if dupes:
        raise KnownFindingsError(f"findings: duplicate id(s) {dupes}")
    return findings


def load_known_findings(path: str | Path | None = None) -> list[KnownFinding]:
    """Read and validate a known-findings file (default: the one shipped with kvretain)."""
    if path is None:
        return list(_default_findings())
    return _load(Path(path))


@functools.cache
def _default_findings() -> tuple[KnownFinding, ...]:
    return tuple(_load(DEFAULT_PATH))


def _load(path: Path) -> list[KnownFinding]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KnownFindingsError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KnownFindingsError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_known_findings(data)


def known_finding(
    target: str,
    version: str | None,
    prop: str,
    message: str | None = None,
    findings: list[KnownFinding] | None = None,
) -> KnownFinding | None:
    """The known finding that explains `prop` violated on `target` at `version`, or None."""
    for f in _default_findings() if findings is None else findings:
        if f.matches(target, version, prop, message):
            return f
    return None


def is_known_finding(target: str, version: str | None, prop: str, message: str | None = None) -> bool:
    return known_finding(target, version, prop, message) is not None


@functools.cache
def target_version(target: str) -> str | None:
    """The version of the allocator behind `target` (vLLM's package version; None otherwise).

    Read once per process: the package metadata lookup costs milliseconds, and
    matching runs for every violation a fuzz run tolerates."""
    if target == "vllm":
        from invariants.targets.vllm_env import vllm_version

        return vllm_version()
    return None


def is_known_violation(target: str, violation: Any) -> bool:
    """Is this `invariants.checker.Violation` a known finding on `target`? (microseconds:
    the version is read once, properties no finding names are rejected by a set lookup)"""
    if violation.check not in _known_properties():
        return False
    return is_known_finding(target, target_version(target), violation.check, violation.message)


@functools.cache
def _known_properties() -> frozenset[str]:
    return frozenset(f.property for f in _default_findings())


__all__ = [
    "DEFAULT_PATH",
    "KnownFinding",
    "KnownFindingsError",
    "is_known_finding",
    "is_known_violation",
    "known_finding",
    "load_known_findings",
    "parse_known_findings",
]


def recheck_known_findings(available: set[str]) -> list[tuple[str, str, bool]]:
    """Replay every finding's trace on each of its targets that is available.

    Returns (finding id, target, still reproduces). A finding that no longer
    reproduces has been fixed (or the model changed): its entry must go.
    """
    from invariants.harness.replay import replay

    out = []
    for f in _default_findings():
        for target in f.targets:
            if target not in available:
                continue
            if target == "vllm" and "*" not in f.versions and target_version(target) not in f.versions:
                continue  # another release's finding: the release matrix replays it there
            result = replay(f.trace, target)
            hit = any(
                v.check == f.property and f.matches(target, target_version(target), v.check, v.message)
                for _, v in result.known
            )
            out.append((f.id, target, hit))
    return out
