"""What an exported regression test asserts: the broken property, with the
specification's value written as a literal.

A trace that `kvretain fuzz` writes ends at the operation that broke the
property (the state machine stops at the first violation). The plan replays
the trace on the executable model and turns the recorded violation into one
of four assertions a vLLM engineer can read without kvretain:

- `replay_hit` (promise_kept, eagle_extra_block_kept): right after the last
  request finishes, every block the replay of its prompt needs is cached and a
  new request with that prompt hits at least the promised boundary;
- `stored_tokens` (stored_tokens_match_hashes): the BlockStored events of the
  last step carry exactly the token ids of the blocks that entered the map;
- `state` (every other check): after the last step, the hit, the block ids
  handed out, the free-queue order, the ref counts and the cached blocks equal
  the specification's;
- `crash`: replaying the operations raises inside vLLM.

The expected value never comes from vLLM: it is the model's (or, for a
promise, the catalogue's definition of the promised boundary), so a test
exported from a mutant's trace fails on the mutant and passes on vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from invariants.catalogue import BY_NAME, CheckContext, History, RequestHistory
from invariants.catalogue.promises import promised_replay
from invariants.harness.checker import Checker, InvalidOp
from invariants.harness.known_findings import KnownFinding, load_known_findings
from invariants.harness.trace import Trace, trace_to_json
from invariants.targets.model_target import ModelTarget
from model.allocator import AllocatorModel
from model.observation import ProbeResult, ScheduleResult, Snapshot
from model.ops import AddRequest, Finish, Probe, Sample, Schedule, Step

Kind = Literal["replay_hit", "stored_tokens", "state", "crash"]

# Differential checks: the target disagreed with the specification itself.
DIFFERENTIAL: dict[str, str] = {
    "observation": "every lookup and allocation returns what the specification returns "
    "(hit length, block ids per group)",
    "snapshot": "the free-queue order, the ref counts and the hash map equal the specification's "
    "after every step",
    "crash": "a well-formed sequence of scheduler calls never raises inside the allocator",
    "events_match_hash_map": "replaying the KV events gives exactly the hash map",
}
DIFFERENTIAL_PRS = "#43447 (free-queue routing), #42258 (SWA masks), #45845 (Mamba retention)"
_REPLAY_PROPERTIES = {"promise_kept", "eagle_extra_block_kept"}


class ExportError(ValueError):
    """A trace that cannot be exported; the message names what is wrong."""


@dataclass(frozen=True)
class Expectation:
    kind: Kind
    property: str
    guards: str
    asked_by: str
    # replay_hit
    request: str | None = None
    prompt: tuple[int, ...] = ()
    hit: int | None = None
    # (group, prefix length, role) of every block the promised replay needs
    needed: tuple[tuple[int, int, str], ...] = ()
    # stored_tokens: group -> token ids of the blocks stored by the last step
    stored: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # state
    free_queue: tuple[int, ...] = ()
    ref_cnt: tuple[int, ...] = ()
    cached: tuple[tuple[int, int], ...] = ()
    new_blocks: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class ExportPlan:
    trace: Trace
    expectation: Expectation
    finding: KnownFinding | None
    message: str


def violated_property(trace: Trace) -> tuple[str, str]:
    """(check name, message) of the trace's recorded violation."""
    if not trace.violation:
        raise ExportError("trace.violation: the trace records no violation; nothing to export")
    name, _, message = trace.violation.partition(":")
    name = name.strip()
    if name not in BY_NAME and name not in DIFFERENTIAL:
        raise ExportError(f"trace.violation: unknown check {name!r} (not in the catalogue)")
    return name, message.strip()


def _doc(name: str) -> tuple[str, str]:
    if name in DIFFERENTIAL:
        return DIFFERENTIAL[name], DIFFERENTIAL_PRS
    doc = BY_NAME[name].doc
    prs = sorted(set(re.findall(r"#\d+", doc)), key=lambda p: int(p[1:]))
    return doc, ", ".join(prs) or "kvretain's invariant catalogue"


def matching_finding(trace: Trace) -> KnownFinding | None:
    """The known finding whose trace is this one (same config and operations)."""
    mine = trace_to_json(trace)
    for f in load_known_findings():
        theirs = trace_to_json(f.trace)
        if theirs["config"] == mine["config"] and theirs["ops"] == mine["ops"]:
            return f
    return None


def plan_export(trace: Trace) -> ExportPlan:
    if not trace.ops:
        raise ExportError("trace.ops: empty; nothing to replay")
    steps = [i for i, op in enumerate(trace.ops) if isinstance(op, Step)]
    if steps:
        # A batched step is kvretain's loop over Scheduler.schedule's policy, not
        # one vLLM call: a standalone test would have to carry that loop.
        raise ExportError(
            f"trace.ops[{steps[0]}]: a batched Step cannot be exported (single-request ops only)"
        )
    name, message = violated_property(trace)
    finding = matching_finding(trace)
    guards, asked_by = _doc(name)
    if finding is not None and finding.upstream:
        asked_by = "; ".join(finding.upstream)
    model = AllocatorModel(trace.config)
    # The harness's own well-formedness rules, run on a model of the same config.
    judge = Checker(ModelTarget(trace.config), check_invariants=False)
    history: dict[str, RequestHistory] = {}
    before: Snapshot = model.snapshot()
    obs = None
    for i, op in enumerate(trace.ops):
        before = model.snapshot()
        try:
            judge.validate(op)
            judge.step(op)
            obs = model.apply(op)
        except (InvalidOp, AssertionError, KeyError) as exc:
            raise ExportError(f"trace.ops[{i}]: not well formed ({exc})") from None
        if isinstance(op, AddRequest):
            history[op.rid] = RequestHistory(op.prompt)
        elif isinstance(op, Sample):
            history[op.rid].outputs.append(op.token)
        elif (
            isinstance(op, Schedule)
            and isinstance(obs, ScheduleResult)
            and obs.admitted
            and obs.hit is not None
        ):
            history[op.rid].hit = obs.hit  # the promise's keys start at the admission hit
    after = model.snapshot()
    last = trace.ops[-1]
    base: dict[str, Any] = {"property": name, "guards": guards, "asked_by": asked_by}
    if name == "crash":
        exp = Expectation(kind="crash", **base)
    elif name in _REPLAY_PROPERTIES:
        if not isinstance(last, Finish):
            raise ExportError(f"trace.ops: {name} is checked when a request finishes; the last op is not one")
        req = history[last.rid]
        ctx = CheckContext(trace.config, last, obs, before, after, History(), None, req)  # type: ignore[arg-type]
        e, keys = promised_replay(ctx)
        needed = tuple(sorted((k.group, len(k.tokens), role) for k, role in keys.items()))
        exp = Expectation(
            kind="replay_hit", request=last.rid, prompt=req.prompt, hit=e, needed=needed, **base
        )
    elif name == "stored_tokens_match_hashes":
        exp = Expectation(kind="stored_tokens", stored=_stored_tokens(trace, before, after), **base)
    else:
        new_blocks = None
        hit = None
        if isinstance(obs, ScheduleResult):
            new_blocks, hit = obs.new_blocks, obs.hit
        elif isinstance(obs, ProbeResult) and isinstance(last, Probe):
            hit = obs.hit
        exp = Expectation(
            kind="state",
            hit=hit,
            new_blocks=new_blocks,
            free_queue=after.free_queue,
            ref_cnt=after.ref_cnt[1:],
            cached=tuple(sorted((k.group, b) for b, k in after.block_hash.items())),
            **base,
        )
    return ExportPlan(trace, exp, finding, message)


def _stored_tokens(trace: Trace, before: Snapshot, after: Snapshot) -> dict[int, tuple[int, ...]]:
    """Per group, the token ids of the blocks that entered the hash map in the last step."""
    out: dict[int, tuple[int, ...]] = {}
    for g, spec in enumerate(trace.config.groups):
        keys = sorted(
            (k for b, k in after.block_hash.items() if k.group == g and before.block_hash.get(b) != k),
            key=lambda k: len(k.tokens),
        )
        out[g] = tuple(t for k in keys for t in k.tokens.tokens()[-spec.block_size :])
    return out
