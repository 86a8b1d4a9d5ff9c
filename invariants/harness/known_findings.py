"""Known findings: real, understood behaviours of a production allocator that an
invariant flags, kept with a replayable trace and the upstream reference.

`known_findings.json` (beside this module) holds them:

    {"format": "kvretain-known-findings", "version": 2,
     "findings": [{"id", "target" | "targets", "property", "vllm_versions": [...],
                   "message_pattern" (a regex the WHOLE message must match),
                   "precondition": {"config": [condition, ...],
                                    "operations": [operation kind, ...],
                                    "shape": name (optional),
                                    "trigger": name (required of a "crash" finding)},
                   "views" (optional): [{"property", "message_pattern"}, ...],
                   "upstream": [...], "where", "description",
                   "consequence": "<wrong output|crash|hang|lost hit|latent>: what a user sees",
                   "reachability": "<defaults|opt-in...>: the configurations that reach it",
                   "not_exported" (optional): "not exported: <why docs/findings has no test>",
                   "trace": {kvretain trace, version 1}}]}

A finding is a precise claim (`invariants.harness.claims`): a violation is
known only when its target, release (vLLM only), property and whole message
match, the run's configuration satisfies every condition the finding lists,
the violating operation is of a listed kind and the numbers the pattern
captured have the finding's shape; a crash finding also names its trigger,
checked against who raised the crash and in which frames
(`invariants.harness.crash_site`). A finding's `views` are the same defect as
another judge reports it (the shadow worker's read of a slot a failed load
left unwritten, where the catalogue's invariant names the hit): each is a
property with its own whole-message pattern, under the same precondition (a
shape reads the same named groups from it), except that a view may name the
operation kinds it is seen at (a save that copies out the defect's unwritten
slot is judged at the request's finish, where the hit was judged at a step). A crash raised by kvretain's own adapter
code is never a known finding. Anything else is a new violation, however
close. A run counts what it tolerated per finding (`KnownLedger`): how often,
the first message, and where an example trace was written; `kvretain replay` /
`fuzz` report known violations apart from new ones; a known finding that stops
reproducing is worth a look too (the bug may be fixed upstream: drop the entry).
Tolerated crashes are counted apart (`KnownLedger.crashes`), and so are the
crashes kvretain's adapter raised (`crash_counts`: always new violations).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from invariants.harness.claims import CONDITIONS, OPERATIONS, SHAPES, TRIGGERS, Precondition, operation_kind
from invariants.harness.crash_site import ADAPTER, CrashSite
from invariants.harness.trace import Trace, TraceError, trace_from_json, write_trace
from model.contract.config import Config
from model.contract.ops import Op

FINDINGS_FORMAT = "kvretain-known-findings"
FINDINGS_VERSION = 2
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
    message_pattern: str
    precondition: Precondition
    # What a user sees ("<kind>: ..." with kind in CONSEQUENCES), and which configurations reach it.
    consequence: str = ""
    reachability: str = ""
    not_exported: str = ""  # why docs/findings has no exported test ("" when it has one)
    # (property, whole-message pattern): the same defect as another judge reports it.
    # (property, whole-message pattern, operation kinds: () = the precondition's).
    views: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def matches(
        self,
        target: str,
        version: str | None,
        prop: str,
        message: str,
        config: Config | None,
        op: Op | None,
        crash: CrashSite | None = None,
    ) -> bool:
        """Does this finding explain `prop` violated with `message` on `target` at
        `version`, in a run of `config`, at operation `op` (None: an audit), raised at
        `crash` (a crash's site, None for any other violation)?"""
        if target not in self.targets:
            return False
        # Versions name vLLM releases; the model and reference follow 0.33.0 semantics.
        if target == "vllm-manager" and "*" not in self.versions and version not in self.versions:
            return False
        return self.claims(prop, message, config, op, crash)

    def claims(
        self, prop: str, message: str, config: Config | None, op: Op | None, crash: CrashSite | None = None
    ) -> bool:
        """The claim alone, whatever the target and release: the property, the whole
        message, and the precondition (configuration, operation kind, shape, and for a
        crash its trigger; a crash without a site, or raised by the adapter, is never it)."""
        if prop != self.property:
            view = next(((re.compile(p), ops) for v, p, ops in self.views if v == prop), None)
            m = view[0].fullmatch(message) if view is not None else None
            if m is None or view is None:
                return False
            precondition = (
                replace(self.precondition, operations=frozenset(view[1])) if view[1] else self.precondition
            )
            return precondition.holds(config, operation_kind(op), m.groupdict(), op, crash)
        if prop == "crash" and crash is None:
            return False
        m = self._compiled.fullmatch(message)
        if m is None:
            return False
        return self.precondition.holds(config, operation_kind(op), m.groupdict(), op, crash)

    @functools.cached_property
    def _compiled(self) -> re.Pattern[str]:
        return re.compile(self.message_pattern)


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
    if not isinstance(pattern, str) or not pattern:
        raise KnownFindingsError(f"{where}.message_pattern: must be a non-empty regular expression")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise KnownFindingsError(f"{where}.message_pattern: not a regular expression ({exc})") from None
    precondition = _parse_precondition(entry.get("precondition"), f"{where}.precondition", compiled)
    if entry["property"] == "crash" and precondition.trigger is None:
        raise KnownFindingsError(
            f"{where}.precondition.trigger: a crash finding must name its trigger (known: {sorted(TRIGGERS)})"
        )
    views = _parse_views(entry.get("views", []), f"{where}.views", precondition)
    consequence, reachability, not_exported = _parse_report(entry, where, upstream)
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
        precondition=precondition,
        consequence=consequence,
        reachability=reachability,
        not_exported=not_exported,
        views=views,
    )


def _parse_views(
    data: Any, where: str, precondition: Precondition
) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """A finding's other judges' views of it: [{"property", "message_pattern", "operations"?}, ...]."""
    if not isinstance(data, list):
        raise KnownFindingsError(f"{where}: must be a list of {{'property', 'message_pattern'}} objects")
    views = []
    for i, view in enumerate(data):
        prop, pattern = (
            (view.get("property"), view.get("message_pattern")) if isinstance(view, dict) else (0, 0)
        )
        if (
            not isinstance(prop, str)
            or not prop
            or prop == "crash"
            or not isinstance(pattern, str)
            or not pattern
        ):
            raise KnownFindingsError(
                f"{where}[{i}]: a non-crash 'property' and a 'message_pattern' are required"
            )
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise KnownFindingsError(
                f"{where}[{i}].message_pattern: not a regular expression ({exc})"
            ) from None
        if precondition.shape is not None:
            missing = sorted(set(SHAPES[precondition.shape][1]) - set(compiled.groupindex))
            if missing:
                raise KnownFindingsError(
                    f"{where}[{i}]: shape {precondition.shape!r} reads the named group(s) {missing}, "
                    "which the pattern does not capture"
                )
        ops = view.get("operations", [])
        if not isinstance(ops, list) or not set(ops) <= OPERATIONS:
            raise KnownFindingsError(f"{where}[{i}].operations: a list of {sorted(OPERATIONS)}")
        views.append((prop, pattern, tuple(ops)))
    return tuple(views)


CONSEQUENCES = ("wrong output", "crash", "hang", "lost hit", "latent")
_SEARCH_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _parse_report(entry: dict[str, Any], where: str, upstream: list[str]) -> tuple[str, str, str]:
    """What the findings table reads (docs/findings/README.md): a consequence naming what
    a user sees, a reachability line, an upstream status (a reference that says none was
    found names the date of the search), and why a finding has no exported test."""
    consequence, reachability = entry.get("consequence"), entry.get("reachability")
    if not isinstance(consequence, str) or consequence.split(":")[0] not in CONSEQUENCES:
        raise KnownFindingsError(f"{where}.consequence: must start with one of {list(CONSEQUENCES)} and ':'")
    if not isinstance(reachability, str) or not reachability.strip():
        raise KnownFindingsError(f"{where}.reachability: must say which configurations reach the finding")
    if not upstream:
        raise KnownFindingsError(
            f"{where}.upstream: name the issues/PRs found, or 'none found, searched <date>'"
        )
    for ref in upstream:
        if re.search(r"\bnone\b", ref) and not _SEARCH_DATE.search(ref):
            raise KnownFindingsError(
                f"{where}.upstream: {ref[:60]!r} says none was found: name the search date"
            )
    not_exported = entry.get("not_exported", "")
    if not isinstance(not_exported, str) or (not_exported and not not_exported.startswith("not exported: ")):
        raise KnownFindingsError(f"{where}.not_exported: must start with 'not exported: ' and say why")
    return consequence, reachability, not_exported


def _parse_precondition(data: Any, where: str, pattern: re.Pattern[str]) -> Precondition:
    if not isinstance(data, dict):
        raise KnownFindingsError(
            f"{where}: must be an object with 'config', 'operations' and optional 'shape' and 'trigger'"
        )
    conditions = data.get("config", [])
    if not isinstance(conditions, list) or not all(isinstance(c, str) for c in conditions):
        raise KnownFindingsError(f"{where}.config: must be a list of condition names")
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        raise KnownFindingsError(
            f"{where}.config: unknown condition(s) {unknown} (known: {sorted(CONDITIONS)})"
        )
    operations = data.get("operations")
    if not isinstance(operations, list) or not operations or not all(isinstance(o, str) for o in operations):
        raise KnownFindingsError(f"{where}.operations: must be a non-empty list of operation kinds")
    bad = sorted(set(operations) - OPERATIONS)
    if bad:
        raise KnownFindingsError(f"{where}.operations: unknown kind(s) {bad} (known: {sorted(OPERATIONS)})")
    shape = data.get("shape")
    if shape is not None:
        if shape not in SHAPES:
            raise KnownFindingsError(f"{where}.shape: unknown shape {shape!r} (known: {sorted(SHAPES)})")
        missing = sorted(set(SHAPES[shape][1]) - set(pattern.groupindex))
        if missing:
            raise KnownFindingsError(
                f"{where}.shape: {shape!r} reads the named group(s) {missing}, which the pattern does not capture"
            )
    trigger = data.get("trigger")
    if trigger is not None and trigger not in TRIGGERS:
        raise KnownFindingsError(f"{where}.trigger: unknown trigger {trigger!r} (known: {sorted(TRIGGERS)})")
    return Precondition(tuple(conditions), frozenset(operations), shape, trigger)


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
    violation: Any,
    findings: list[KnownFinding] | None = None,
) -> KnownFinding | None:
    """The known finding that explains `violation` (an `invariants.harness.checker.Violation`,
    which carries its configuration and operation) on `target` at `version`, or None."""
    crash = getattr(violation, "crash", None)
    for f in _default_findings() if findings is None else findings:
        if f.matches(
            target, version, violation.check, violation.message, violation.config, violation.op, crash
        ):
            return f
    return None


@functools.cache
def target_version(target: str) -> str | None:
    """The version of the allocator behind `target` (vLLM's package version; None otherwise).

    Read once per process: the package metadata lookup costs milliseconds, and
    matching runs for every violation a fuzz run tolerates."""
    if _allocator_of(target) == "vllm-manager":
        from invariants.targets.vllm_env import vllm_version

        return vllm_version()
    return None


def explain(target: str, violation: Any) -> KnownFinding | None:
    """The known finding on `target` that explains this `Violation`, or None
    (microseconds: the version is read once, properties no finding names are
    rejected by a set lookup)."""
    if violation.check not in _known_properties():
        return None
    target = _allocator_of(target)
    return known_finding(target, target_version(target), violation)


def _allocator_of(target: str) -> str:
    """The target whose allocator code `target` drives (`vllm` drives vLLM's own
    `KVCacheManager` through its real scheduler: vLLM's findings are its findings)."""
    from invariants.targets import SAME_ALLOCATOR

    return SAME_ALLOCATOR.get(target, target)


def is_known_violation(target: str, violation: Any) -> bool:
    """Is this `Violation` a known finding on `target`? (see `explain`)"""
    return explain(target, violation) is not None


@functools.cache
def _known_properties() -> frozenset[str]:
    return frozenset(p for f in _default_findings() for p in (f.property, *(v for v, _, _ in f.views)))


__all__ = [
    "DEFAULT_PATH",
    "KnownFinding",
    "KnownFindingsError",
    "KnownLedger",
    "Tolerated",
    "clean_verdict",
    "format_crash_counts",
    "format_known",
    "known_summary",
    "crash_counts",
    "explain",
    "is_adapter_crash",
    "is_known_violation",
    "known_finding",
    "load_known_findings",
    "parse_known_findings",
]


@dataclass
class Tolerated:
    """What one run tolerated as one known finding."""

    finding: str
    count: int
    first: str
    config: Config | None = None
    ops: list[Op] | None = None  # up to the first tolerated violation (None: not kept)
    example: Path | None = None  # where that trace was written
    crash: bool = False  # a crash finding: each tolerated violation ended its example


class KnownLedger:
    """The known findings a run tolerated: per finding, how many violations, the
    first message, and an example trace (the operations up to the first one).

    Iterating gives the finding ids, so `sorted(ledger)` names what was
    tolerated; `rows()` and `to_json()` give the counts a summary must show."""

    def __init__(self, keep_examples: bool = True) -> None:
        self.entries: dict[str, Tolerated] = {}
        self.keep_examples = keep_examples

    def record(self, finding: str, violation: Any, ops: list[Op] | None = None) -> None:
        entry = self.entries.get(finding)
        if entry is not None:
            entry.count += 1
            return
        kept = list(ops) if ops is not None and self.keep_examples else None
        crash = violation.check == "crash"
        self.entries[finding] = Tolerated(finding, 1, str(violation), violation.config, kept, crash=crash)

    def merge(self, other: KnownLedger) -> None:
        for name, e in other.entries.items():
            mine = self.entries.get(name)
            if mine is None:
                self.entries[name] = Tolerated(
                    e.finding, e.count, e.first, e.config, e.ops, e.example, crash=e.crash
                )
            else:
                mine.count += e.count

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def total(self) -> int:
        return sum(e.count for e in self.entries.values())

    @property
    def crashes(self) -> int:
        """Tolerated crashes: engine crashes (or the adapter's observations of the engine)
        that met a crash finding's trigger; each ended its example unchecked."""
        return sum(e.count for e in self.entries.values() if e.crash)

    def write_examples(self, out_dir: Path, target: str, seed: int | None) -> None:
        """Write each finding's example trace once (`known-<finding>-<target>-seed<seed>.json`)."""
        for e in self.entries.values():
            if e.example is None and e.ops is not None and e.config is not None:
                path = out_dir / f"known-{e.finding}-{target}-seed{seed}.json"
                e.example = write_trace(Trace(e.config, e.ops, seed, target, e.first), path)

    def rows(self) -> list[tuple[str, int, str, str]]:
        return [
            (e.finding, e.count, _clip(e.first), str(e.example) if e.example else "-")
            for e in (self.entries[n] for n in self)
        ]

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "finding": e.finding,
                "count": e.count,
                "first": e.first,
                "example": str(e.example) if e.example else None,
                "crash": e.crash,
            }
            for e in (self.entries[n] for n in self)
        ]


def known_summary(ledger: KnownLedger) -> str:
    """Every tolerated finding with its count: "<finding> xN, ..." ("" when none)."""
    return ", ".join(f"{name} x{ledger.entries[name].count}" for name in ledger)


def clean_verdict(ledger: KnownLedger) -> str:
    """ "clean", or "clean (known: <finding> xN, ...)"."""
    return f"clean (known: {known_summary(ledger)})" if ledger else "clean"


def format_known(ledger: KnownLedger) -> str:
    """The per-finding tolerance table a run prints (empty when nothing was tolerated)."""
    if not ledger:
        return ""
    from invariants.report import fitted_table, wrap

    rows = ledger.rows()
    crashes = f", {ledger.crashes} of them crash(es) that ended their example" if ledger.crashes else ""
    head = wrap(
        f"known findings tolerated ({ledger.total} violation(s){crashes}; "
        "each matched its finding's precondition):"
    )
    # The example traces below the table: a path is as long as the output directory.
    body = fitted_table(["finding", "tolerated", "first message"], [r[:3] for r in rows])
    examples = [f"  example trace of {r[0]}:\n    {r[3]}" for r in rows if r[3] != "-"]
    return "\n".join([head, body, *examples])


def is_adapter_crash(violation: Any) -> bool:
    """A crash raised by kvretain's own adapter code (a gap in kvretain, never a known finding)."""
    site = getattr(violation, "crash", None)
    return violation.check == "crash" and site is not None and site.raised_by == ADAPTER


def crash_counts(tolerated: int, new: Iterable[Any] = ()) -> dict[str, int]:
    """The crashes of a run, apart: `tolerated` (known crash findings, e.g. a ledger's
    `crashes`), and among its `new` violations, those kvretain's adapter raised and the others."""
    new_crashes = [v for v in new if v.check == "crash"]
    adapter = sum(1 for v in new_crashes if is_adapter_crash(v))
    return {
        "tolerated_crashes": tolerated,
        "adapter_crashes": adapter,
        "new_crashes": len(new_crashes) - adapter,
    }


def format_crash_counts(counts: dict[str, int]) -> str:
    """ "crashes: tolerated N, raised by kvretain's adapter N, new N" ("" when all are 0)."""
    if not any(counts.values()):
        return ""
    return (
        f"crashes: tolerated {counts['tolerated_crashes']} (known findings), "
        f"raised by kvretain's adapter {counts['adapter_crashes']} (a gap in kvretain, never tolerated), "
        f"other new {counts['new_crashes']}"
    )


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
            if (
                target == "vllm-manager"
                and "*" not in f.versions
                and target_version(target) not in f.versions
            ):
                continue  # another release's finding: the release matrix replays it there
            # A trace recorded through a real scheduler replays there (its allocator is `target`'s).
            via = f.trace.target if f.trace.target and _allocator_of(f.trace.target) == target else target
            result = replay(f.trace, via)
            hit = any(explain(via, v) is f for _, v in result.known)
            out.append((f.id, target, hit))
    return out
