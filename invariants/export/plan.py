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
- `crash`: replaying the operations raises inside vLLM;
- `copies` (copies_sound, a copy whose source was handed out in the same
  step): no copy the last step queued reads a block that step allocated.

Everything before the broken property is setup: the plan keeps the model's
result of every `Schedule` (`ExportPlan.schedules`) and the decisions of
every batched `Step`, so the exported test can check that vLLM still walks
the trace the finding was derived on (a divergence there is no verdict on the
property; see `pytest_file`).

A batched `Step` is one `Scheduler.schedule` over several requests. The plan
records the decisions the model took in it (`StepAction`: which request gets
how many tokens, whose allocation fails, who is preempted, which waiting
request is admitted with which hit), so the exported test repeats them as
straight-line calls instead of carrying the scheduler's loop.

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
from invariants.harness.observer import ModelObserver
from invariants.harness.trace import Trace, trace_to_json
from invariants.targets.model_target import ModelTarget
from model.contract.observation import Observation, ProbeResult, ScheduleResult, Snapshot, StepResult
from model.contract.ops import AddRequest, Finish, Op, Probe, Sample, Schedule, Step
from model.machine.allocator import AllocatorModel

Kind = Literal["replay_hit", "stored_tokens", "state", "crash", "copies"]

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
class StepAction:
    """One scheduler call of a batched step, as the model decided it.

    `run`: a running request's next chunk of `tokens`; `admit`: a waiting
    request's lookup (its `hit`) and first chunk; `preempt`: the newest running
    request gives way. `fits`: whether `allocate_slots` finds room (an admission
    with nothing to compute allocates nothing and does not fit)."""

    kind: Literal["run", "admit", "preempt"]
    rid: str
    tokens: int = 0
    hit: int | None = None
    fits: bool = True


@dataclass(frozen=True)
class ExportPlan:
    trace: Trace
    expectation: Expectation
    finding: KnownFinding | None
    message: str
    # op index of each batched Step -> the calls it stands for, in order
    steps: dict[int, tuple[StepAction, ...]] = field(default_factory=dict)
    # op index of each Schedule -> the model's result (hit, tokens scheduled, block ids)
    schedules: dict[int, ScheduleResult] = field(default_factory=dict)


def violated_property(trace: Trace) -> tuple[str, str]:
    """(check name, message) of the trace's recorded violation."""
    if not trace.violation:
        raise ExportError("trace.violation: the trace records no violation; nothing to export")
    violation = trace.violation
    if violation.startswith("mutant "):  # a zoo trace: "mutant NAME: check: message"
        violation = violation.partition(":")[2]
    name, _, message = violation.partition(":")
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
    """What exporting `trace` produces: its violated property, the known finding it is, the
    model's decisions in every Schedule and batched Step, and the expectation the test asserts.

    ExportError when the trace cannot be exported: no operations, an unknown check, a
    copies_sound violation that is not a same-step copy, an operation the harness's
    well-formedness rules refuse, or a last operation that does not match the property.
    """
    if not trace.ops:
        raise ExportError("trace.ops: empty; nothing to replay")
    name, message = violated_property(trace)
    if name == "copies_sound" and "source was allocated in the same step" not in message:
        raise ExportError(
            "trace.violation: copies_sound is exported only for a copy whose source was "
            "allocated in the same step"
        )
    finding = matching_finding(trace)
    guards, asked_by = _doc(name)
    if finding is not None and finding.upstream:
        asked_by = "; ".join(finding.upstream)
    replay = _replay_on_model(trace)
    base: dict[str, Any] = {"property": name, "guards": guards, "asked_by": asked_by}
    exp = _expectation(trace, name, base, replay)
    return ExportPlan(trace, exp, finding, message, replay.steps, replay.schedules)


@dataclass
class _ModelReplay:
    """The model's replay of a whole trace: the state around its last operation, that
    operation's observation, every request's history, and the model's decisions in every
    batched Step and Schedule (by operation index)."""

    before: Snapshot
    after: Snapshot
    obs: Observation | None
    history: dict[str, RequestHistory]
    steps: dict[int, tuple[StepAction, ...]]
    schedules: dict[int, ScheduleResult]


def _replay_on_model(trace: Trace) -> _ModelReplay:
    """Replay every operation on a model of the trace's config, each first judged by the
    harness's own well-formedness rules (ExportError naming the first it refuses)."""
    seen = ModelObserver()
    model = AllocatorModel(trace.config, observer=seen)
    # The harness's own well-formedness rules, run on a model of the same config.
    judge = Checker(ModelTarget(trace.config), check_invariants=False)
    history: dict[str, RequestHistory] = {}
    before: Snapshot = model.snapshot()
    obs: Observation | None = None
    steps: dict[int, tuple[StepAction, ...]] = {}
    schedules: dict[int, ScheduleResult] = {}
    for i, op in enumerate(trace.ops):
        before = model.snapshot()
        try:
            judge.validate(op)
            judge.step(op)
            if isinstance(op, Step):
                obs, steps[i] = _replay_step(model, seen, op)
            else:
                obs = model.apply(op)
        except (InvalidOp, AssertionError, KeyError) as exc:
            raise ExportError(f"trace.ops[{i}]: not well formed ({exc})") from None
        if isinstance(op, Schedule) and isinstance(obs, ScheduleResult):
            schedules[i] = obs
        _record_history(history, op, obs)
    return _ModelReplay(before, model.snapshot(), obs, history, steps, schedules)


def _record_history(history: dict[str, RequestHistory], op: Op, obs: Observation | None) -> None:
    """A request's history: its prompt from its arrival, its sampled outputs, and the hit of
    its admission (where the promise's keys start)."""
    if isinstance(op, AddRequest):
        history[op.rid] = RequestHistory(op.tokens())
    elif isinstance(op, Sample):
        history[op.rid].outputs.append(op.token)
    elif (
        isinstance(op, Schedule) and isinstance(obs, ScheduleResult) and obs.admitted and obs.hit is not None
    ):
        history[op.rid].hit = obs.hit  # the promise's keys start at the admission hit


def _expectation(trace: Trace, name: str, base: dict[str, Any], replay: _ModelReplay) -> Expectation:
    """What the exported test asserts for property `name` after the trace's last operation,
    the specification's values written in (ExportError when the last operation is not the one
    the property is checked at)."""
    last = trace.ops[-1]
    before, after, obs = replay.before, replay.after, replay.obs
    if name == "crash":
        return Expectation(kind="crash", **base)
    if name == "copies_sound":
        if not isinstance(last, Step):
            raise ExportError(
                "trace.ops: copies_sound is exported after a batched Step; the last op is not one"
            )
        return Expectation(kind="copies", **base)
    if name in _REPLAY_PROPERTIES:
        if not isinstance(last, Finish):
            raise ExportError(f"trace.ops: {name} is checked when a request finishes; the last op is not one")
        req = replay.history[last.rid]
        ctx = CheckContext(trace.config, last, obs, before, after, History(), None, req)  # type: ignore[arg-type]
        e, keys = promised_replay(ctx)
        needed = tuple(sorted((k.group, len(k.tokens), role) for k, role in keys.items()))
        return Expectation(
            kind="replay_hit", request=last.rid, prompt=req.prompt, hit=e, needed=needed, **base
        )
    if name == "stored_tokens_match_hashes":
        return Expectation(kind="stored_tokens", stored=_stored_tokens(trace, before, after), **base)
    new_blocks = None
    hit = None
    if isinstance(obs, ScheduleResult):
        new_blocks, hit = obs.new_blocks, obs.hit
    elif isinstance(obs, ProbeResult) and isinstance(last, Probe):
        hit = obs.hit
    return Expectation(
        kind="state",
        hit=hit,
        new_blocks=new_blocks,
        free_queue=after.free_queue,
        ref_cnt=after.ref_cnt[1:],
        cached=tuple(sorted((k.group, b) for b, k in after.block_hash.items())),
        **base,
    )


def _replay_step(
    model: AllocatorModel, seen: ModelObserver, op: Step
) -> tuple[StepResult, tuple[StepAction, ...]]:
    """Apply a batched step to the model, recording its allocation attempts and
    preemptions (`ModelObserver.recording`, `seen` watching `model`: the StepResult
    alone cannot tell during whose allocation a request was preempted, nor the chunk
    of an admission that did not fit)."""
    with seen.recording() as log:
        result = model.apply(op)
    assert isinstance(result, StepResult)
    actions: list[StepAction] = []
    p = 0
    for rid, res in result.results:
        if res.hit is None:  # running pass: attempts and preemptions until it fits or gave way
            while p < len(log) and (log[p].kind == "preempt" or (log[p].rid == rid and not log[p].admission)):
                d = log[p]
                p += 1
                if d.kind == "preempt":
                    actions.append(StepAction("preempt", d.rid))
                    if d.rid == rid:
                        break
                else:
                    actions.append(StepAction("run", rid, d.tokens, fits=d.fits))
                    if d.fits:
                        break
        else:  # waiting pass: the lookup, then the first chunk if there is one
            n, fits = 0, False
            if p < len(log) and log[p].rid == rid and log[p].admission:
                n, fits = log[p].tokens, log[p].fits
                p += 1
            actions.append(StepAction("admit", rid, n, res.hit, fits))
    assert p == len(log), f"unattributed scheduler calls in the step: {log[p:]}"
    return result, tuple(actions)


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
