"""The judge's loop: apply one operation to the model and to a target, compare
what they observed, then run every invariant on the target's state.

A `Violation` is either a differential finding (`observation`, `snapshot`,
`crash`: the target disagrees with the model) or a named invariant from the
catalogue that the target's state breaks: both are defects. Apart from them,
`policy_drift`: the target kept every contract on an operation (the engine
contract, every catalogue invariant, no crash) but made one of vLLM's *policy*
decisions (`POLICIES`: the preemption victim, the queue order a step leaves)
otherwise than the model predicts. Drift is said once, as the first differing
decision; from then on the model's state no longer predicts the target's, so the
differential comparison stops for the rest of the run while the target is still
judged by every model-independent check (`after_drift`; docs/semantics.md, "Verdicts").

Two paths, one verdict. The audit is the definition: full snapshots of the
model and the target before and after the operation, `diff_snapshots`, and
every invariant of the catalogue as written. The fast path asks both sides
only for what the operation touched (`partial`: the blocks of the requests it
names, the blocks its observation lists, the keys those blocks carry or the
events name), demands equal partial states, and runs the catalogue on that
delta (`check_delta`). It is an optimisation the audit keeps honest: an audit
runs every `audit_every` operations, for pool-wide operations (reset, evict),
for pinned-tier configurations, and whenever `audit()` is called (the end of
every example, before any "clean" verdict). `audit_every=1` is the audit alone.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace

from invariants.catalogue import (
    CachedView,
    CheckContext,
    Delta,
    History,
    RefCounts,
    StateView,
    check_all,
    check_delta,
    check_state,
    forget,
    update_history,
    update_history_delta,
)
from invariants.harness.crash_site import ADAPTER, CrashSite, crash_site
from invariants.harness.observer import ModelObserver
from invariants.targets.base import PartialState, Tables, Target, TargetRefusal, table_changes
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config
from model.contract.observation import (
    BlockIds,
    BlockKey,
    LoadCut,
    Observation,
    ProbeResult,
    ScheduleResult,
    Snapshot,
    StepResult,
    diff_snapshots,
)
from model.contract.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Loaded,
    Offer,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Save,
    Saved,
    Schedule,
    Step,
)
from model.machine.allocator import AllocatorModel
from model.machine.async_scheduling import FENCED
from model.machine.failed_blocks import failable_blocks
from model.policy.spec_decode import acceptable

DEFAULT_AUDIT_EVERY = 32
NOT_FREE = -1
POLICY_DRIFT = "policy_drift"
# The check of a `TargetRefusal`: the target refused the operation (kvretain's refusal, not a crash).
REFUSED = "refused"
DECLARED_POLICIES_ENV = "KVRETAIN_DECLARED_POLICIES"


@dataclass(frozen=True)
class Policy:
    """A vLLM policy decision the model predicts for the exact differential, with the
    module holding the prediction and the vLLM code it was read from. The prediction
    claims to be vLLM's choice, not the only correct one."""

    name: str
    decision: str  # "{target} <decision> <what it decided>"
    predicted: str  # "the prediction <predicted> <what the model decided>"
    prediction: str


POLICIES: dict[str, Policy] = {
    "preemption": Policy(
        "preemption",
        "preempted",
        "preempted",
        "model/policy/queues.py (StepQueues.preempted, applied by AllocatorModel._step): preempt the last "
        "running request, vLLM 0.33.0 Scheduler.schedule `self.running.pop()`",
    ),
    "queue-order": Policy(
        "queue-order",
        "ended the step with the queues the step left (running, holding, waiting) as",
        "left them as",
        "model/policy/queues.py (StepQueues.left): vLLM 0.33.0 Scheduler.schedule with FCFSRequestQueue",
    ),
}


def declared_policies(text: str | None = None) -> frozenset[str]:
    """The policies a branch declares it decides otherwise (`KVRETAIN_DECLARED_POLICIES`,
    comma-separated names of `POLICIES`): their drift is still reported, but as declared.
    An unknown name raises ValueError naming the known ones."""
    raw = os.environ.get(DECLARED_POLICIES_ENV, "") if text is None else text
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - POLICIES.keys())
    if unknown:
        raise ValueError(
            f"{DECLARED_POLICIES_ENV}: unknown policy {', '.join(unknown)} (known: {', '.join(POLICIES)})"
        )
    return names


@dataclass(frozen=True)
class Violation:
    """A check that failed, with where it failed: the run's configuration and the
    operation (None: an audit between operations), which a known finding's
    precondition reads. Two violations are equal when check and message are."""

    check: str
    message: str
    config: Config | None = field(default=None, compare=False, repr=False)
    op: Op | None = field(default=None, compare=False, repr=False)
    # A crash's site: who raised it (the engine, or kvretain's adapter) and in which frames.
    crash: CrashSite | None = field(default=None, compare=False, repr=False)
    # A `policy_drift`'s policy (a key of `POLICIES`); None for every other check.
    policy: str | None = field(default=None, compare=False, repr=False)

    @property
    def is_drift(self) -> bool:
        return self.check == POLICY_DRIFT

    @property
    def declared(self) -> bool:
        """A drift in a policy the branch declares (`KVRETAIN_DECLARED_POLICIES`)."""
        return self.is_drift and self.policy in declared_policies()

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


def crashed(exc: BaseException) -> Violation:
    """The `crash` violation of a target that raised `exc`, with its site (`crash_site`);
    `refused` where the target refused the operation (`TargetRefusal`: not a crash)."""
    if isinstance(exc, TargetRefusal):
        return Violation(REFUSED, f"{type(exc).__name__}: {exc}")
    return Violation("crash", f"{type(exc).__name__}: {exc}", crash=crash_site(exc))


class InvalidOp(ValueError):
    """An operation that a well-formed trace never contains at this point."""


class Checker:
    def __init__(
        self, target: Target, *, check_invariants: bool = True, audit_every: int | None = None
    ) -> None:
        self.target = target
        self.config = target.config
        # The model the target is judged against: `model_target` answers the fast
        # path's partial states, `model` is its AllocatorModel (the fuzzer reads its
        # public seam `requests`), `observer` what it fired and the judge's choices.
        self.observer = ModelObserver()
        self.model_target = ModelTarget(
            target.config,
            events=target.event_profile,
            profile=target.profile,
            # Only a real scheduler speculates: it verifies num_lookahead_tokens drafts a step.
            num_spec_tokens=target.config.num_lookahead_tokens if target.features.real_scheduler else 0,
            async_scheduling=target.features.async_scheduling,
            observer=self.observer,
        )
        self.model: AllocatorModel = self.model_target.model
        # A one-step-ahead scheduler with a KV connector holds freed blocks in fenced frees
        # (`model.machine.async_scheduling`, 6): any operation may move them, so each reads their table.
        self.fenced = target.features.async_scheduling and bool(target.config.kv_connector)
        self.history = History(
            failed_load_ends=self.config.kv_load_failure_policy == "fail",
            block_sizes=tuple(g.block_size for g in self.config.groups),
        )
        self.check_invariants = check_invariants
        # Pinned-tier moves are pool-wide; a target without `features.partial` has no fast path.
        fast = target.features.partial and not target.config.pin_swa_on_drop
        self.audit_every = max(1, audit_every or 1) if fast else 1
        self.ops: list[Op] = []
        self.last_obs: object = None
        self.audits = 0
        # Policy drift (module docstring): the first one, at which operation, then how many
        # operations were judged by the model-independent checks alone, and how many not
        # at all (after the target refused an operation drawn from the model's diverged state).
        self.drift: Violation | None = None
        self.drift_at: int | None = None
        # Settings the model does not predict (`unpredicted`): judged as after a drift from the start.
        self.unpredicted = unpredicted(self.config)
        self.after_drift = 0
        self.unjudged = 0
        self._refused = False
        self._running_before: frozenset[str] = frozenset()
        self._since_audit = 0
        self.last = self.target.snapshot()
        self.model.snapshot()
        self._mirror(self.last)

    def tables(self) -> dict[str, tuple[BlockIds, ...]]:
        """Each live request's block table as of the last operation (fast path or audit)."""
        return dict(self._tables)

    # ------------------------------------------------------------------ mirror
    def _mirror(self, snap: Snapshot) -> None:
        """The target's state as the fast path tracks it, reset from a full snapshot."""
        q = snap.free_queue
        links = {b: (q[i - 1] if i else 0, q[i + 1] if i + 1 < len(q) else 0) for i, b in enumerate(q)}
        self._blocks = [
            (snap.ref_cnt[b], snap.block_hash.get(b), *links.get(b, (NOT_FREE, NOT_FREE)))
            for b in range(snap.num_blocks)
        ]
        self._key_of: dict[int, BlockKey] = dict(snap.block_hash)
        self._holders: dict[BlockKey, BlockIds] = dict(snap.cached)
        self._tables = dict(snap.tables)
        self._uses: Counter[int] = Counter(b for t in snap.tables.values() for g in t for b in g if b)
        self._in_use = sum(1 for r in snap.ref_cnt if r > 0)
        self._free_uncached = {b for b in q if b not in snap.block_hash}
        self._free_len, self._pinned_len = len(q), len(snap.pinned_queue)

    def shape(self) -> tuple[int, int, int, int]:
        """(free queue length, pinned tier length, cached keys, live tables) after the
        last operation, fast path or audit (a pinned tier forces the audit)."""
        if self.audit_every == 1:  # no mirror: every step leaves a full snapshot
            snap = self.last
            return len(snap.free_queue), len(snap.pinned_queue), len(snap.cached), len(snap.tables)
        return self._free_len, self._pinned_len, len(self._holders), len(self._tables)

    # ------------------------------------------------------------------ operations
    def validate(self, op: Op) -> None:
        reqs = self.model.requests
        rid = getattr(op, "rid", None)
        if isinstance(op, AddRequest):
            if op.rid in reqs:
                raise InvalidOp(f"add: request {op.rid!r} already exists")
            if op.rid in self.model.held | self.model.sending:
                # vLLM keeps a request finished with a transfer in flight until it reports.
                raise InvalidOp(
                    f"add: request {op.rid!r} finished, but its connector load or save has not reported"
                )
            if not op.prompt:
                raise InvalidOp(f"add: request {op.rid!r} has an empty prompt")
            untaken = set(op.identity().kinds()) - self.target.identities
            if untaken:  # the target would drop them: its hits could not be judged by identity
                raise InvalidOp(f"add: the target takes no {', '.join(sorted(untaken))} (Target.identities)")
        elif isinstance(op, (Schedule, Sample, Finish, Preempt)) and rid not in reqs:
            raise InvalidOp(f"{type(op).__name__.lower()}: unknown request {rid!r}")
        if isinstance(op, Schedule):
            r = reqs[op.rid]
            if r.running and r.num_computed >= r.num_tokens:
                raise InvalidOp(f"schedule: {op.rid!r} computed every known token; it needs a sample first")
            if r.num_tokens >= self.config.max_model_len:
                raise InvalidOp(f"schedule: {op.rid!r} reached max_model_len")
        elif isinstance(op, Step):
            unknown = [r for r in op.rids if r not in reqs]
            if unknown or len(set(op.rids)) != len(op.rids) or not op.rids:
                raise InvalidOp(f"step: rids must name distinct known requests, got {list(op.rids)}")
            for name in op.rids:
                req = reqs[name]
                if req.running and req.num_computed >= req.num_tokens:
                    raise InvalidOp(f"step: {name!r} computed every known token; it needs a sample first")
                if req.num_tokens >= self.config.max_model_len:
                    raise InvalidOp(f"step: {name!r} reached max_model_len")
        elif isinstance(op, Sample):
            self._validate_sample(op)
        elif isinstance(op, Preempt) and not reqs[op.rid].running:
            raise InvalidOp(f"preempt: {op.rid!r} is not running")
        elif isinstance(op, (Offer, Loaded, Save, Saved)):
            connector_op_problem(self.model, self.config, op)
        elif isinstance(op, Probe) and not op.tokens:
            raise InvalidOp("probe: empty token list")
        elif isinstance(op, EvictBlocks) and any(not 0 < b < self.config.num_blocks for b in op.block_ids):
            raise InvalidOp(f"evict: block ids must be in 1..{self.config.num_blocks - 1}")

    def _validate_sample(self, op: Sample) -> None:
        r = self.model.requests[op.rid]
        if not r.awaits_sample:
            raise InvalidOp(f"sample: {op.rid!r} is not waiting for a sampled token")
        k = self.model.num_spec_tokens
        if (op.accepted or op.drafts) and not k:
            raise InvalidOp(
                f"sample: {op.rid!r} carries drafts, but target {self.target.name!r} does not speculate "
                "(only a real scheduler with num_lookahead_tokens > 0 does)"
            )
        if op.accepted > acceptable(r.verifying):
            raise InvalidOp(
                f"sample: {op.rid!r} accepts {op.accepted} drafts; its step verified "
                f"{acceptable(r.verifying)} acceptable ones"
            )
        if len(op.drafts) > k:
            raise InvalidOp(f"sample: {op.rid!r} proposes {len(op.drafts)} drafts; num_spec_tokens is {k}")

    def step(self, op: Op) -> list[Violation]:
        if self.target.features.real_scheduler and isinstance(op, Schedule):
            # A real scheduler runs it as the one-request step it is (it may preempt the
            # request to make room), so the model is sent that step too: a trace written
            # with `Schedule` (explore's alphabet, an old trace) means the same on both.
            op = Step((op.rid,), op.budget)
        self.validate(op)
        self.ops.append(op)
        self._since_audit += 1
        if self.drift is not None or self.unpredicted:
            found = self._contract_step(op)
            return [replace(v, config=self.config, op=op) for v in found] if found else found
        reqs = self.model.requests
        self._running_before = (
            frozenset(r for r in op.rids if reqs[r].running) if isinstance(op, Step) else frozenset()
        )
        # Reset and evict act on the whole pool: no delta names what they touch.
        if self._since_audit >= self.audit_every or isinstance(op, (ResetPrefixCache, EvictBlocks)):
            found = self.audited_step(op)
        else:
            found = self._fast_step(op)
        return [replace(v, config=self.config, op=op) for v in found] if found else found

    def audited_step(self, op: Op) -> list[Violation]:
        """The definition: full snapshots before and after, every invariant as written.

        `step` takes this path every `audit_every` operations (and for pool-wide
        operations), the fast path otherwise; the bench times it apart."""
        self._since_audit, self.audits = 0, self.audits + 1
        pre: list[Violation] = []  # the state the fast path left, already apart from the model's
        if self.audit_every > 1:
            # The state the fast path left is compared whole too: a corruption of
            # blocks no operation since the last audit touched shows here.
            try:
                before = self.target.snapshot()
            except Exception as exc:
                return [crashed(exc)]
            pre += [
                Violation("snapshot", f"before the operation: {line}")
                for line in diff_snapshots(self.model.snapshot(), before)
            ]
        else:
            before = self.last
        try:
            obs = self.target.apply(op)
            snap = self.target.snapshot()
        except Exception as exc:  # the target crashing is itself a finding
            self._expected(op, None)  # the model moves on all the same
            return [crashed(exc)]
        expected_obs = self._expected(op, obs)
        expected = self.model.snapshot()
        self.last_obs = obs
        differs = self._judged(obs) != expected_obs
        diff: list[Violation] = []
        if differs:
            diff.append(
                Violation("observation", _observation_difference(expected_obs, obs, self.target.name))
            )
        diff += [Violation("snapshot", line) for line in diff_snapshots(expected, snap)]
        found = self._judge_state(op, obs, before, snap)
        drift = self._drifted(expected_obs, obs, snap.tables) if differs and not pre and not found else None
        return [drift] if drift is not None else pre + diff + found

    def _fast_step(self, op: Op) -> list[Violation]:
        """The delta: both sides report what the operation touched; compared exactly, then checked."""
        rid = getattr(op, "rid", None)
        blocks: set[int] = set(op.block_ids) if isinstance(op, EvictBlocks) else set()
        rids = list(op.rids) if isinstance(op, Step) else [rid] if isinstance(rid, str) else []
        if isinstance(op, Loaded):  # under "fail" a report may end every request holding a failed block
            rids += [r for r in self._tables if r != rid]
        if self.fenced:
            rids.append(FENCED)
        # The named requests' tables before the operation (the step invariants read
        # them; the partial reads only the positions where they changed).
        tables_before = {r: self._tables.get(r, ()) for r in rids}
        try:
            obs = self.target.apply(op)
        except Exception as exc:
            self._expected(op, None)  # the model moves on all the same
            return [crashed(exc)]
        expected_obs = self._expected(op, obs)
        self.last_obs = obs
        diff: list[Violation] = []
        same = self._judged(obs) == expected_obs
        if not same:
            diff.append(
                Violation("observation", _observation_difference(expected_obs, obs, self.target.name))
            )
        for o in (obs,) if same else (obs, expected_obs):
            blocks |= _named_blocks(o)
        n = len(self._blocks)
        blocks = {b for b in blocks if 0 < b < n}
        key_of = self._key_of
        keys = {key_of[b] for b in blocks if b in key_of}
        try:
            got, want = self._partials(blocks, rids, keys, tables_before)
        except Exception as exc:
            return [crashed(exc)]
        diff += [Violation("snapshot", line) for line in _diff_partial(want, got)]
        found = self._engine_problems()
        delta = self._advance(got)
        finished = self.history.requests.get(op.rid) if isinstance(op, Finish) else None
        anomalies = update_history_delta(
            self.history, op, obs, delta, got.events, (tables_before, got.tables)
        )
        found += [Violation("events_match_hash_map", a) for a in anomalies]
        if self.check_invariants:
            before = StateView(CachedView(self._holders, delta.before_holders), tables=tables_before)
            after = StateView(
                self._holders,
                got.events,
                tables={r: got.tables.get(r, ()) for r in rids},
                ref_cnt=RefCounts(got.blocks, self._blocks),
            )
            ctx = CheckContext(
                self.config,
                op,
                obs,
                before,  # type: ignore[arg-type]
                after,  # type: ignore[arg-type]
                self.history,
                self._probe,
                finished,
                delta,  # type: ignore[arg-type]
                self.model.profile,
                self.model.num_spec_tokens,
            )
            found += [Violation(name, msg) for name, msg in check_delta(ctx)]
        forget(self.history, self._holders)  # after the checks: they read the finishing request's keys
        drift = None if same or found else self._drifted(expected_obs, obs, got.tables)
        if drift is None:
            return diff + found
        try:  # what the judging after the drift starts from: the target's whole state
            self.last = self.target.snapshot()
        except Exception as exc:
            return [drift, crashed(exc)]
        return [drift]

    # ------------------------------------------------------------------ policy drift
    def _drifted(self, expected: Observation, got: Observation, tables: Tables) -> Violation | None:
        """The `policy_drift` of an operation whose observations differ while every contract
        held on it (the caller's condition), if the first differing decision is one of
        `POLICIES`; None (a defect) otherwise. A different preemption counts only where both
        sides preempted (the victim differs, not whether an allocation failed: that is the
        allocator's mechanism) and the target's victims are distinct requests of the step that
        were running and hold no block."""
        if not isinstance(expected, StepResult) or not isinstance(got, StepResult):
            return None
        name = self.target.name
        if expected.preempted != got.preempted:
            victims = got.preempted
            if not victims or not expected.preempted:
                return None
            if len(set(victims)) != len(victims) or not set(victims) <= self._running_before:
                return None
            if any(b for r in victims for ids in tables.get(r, ()) for b in ids):
                return None
            policy = POLICIES["preemption"]
            said, predicted = _names(victims), _names(expected.preempted)
        elif _only_queues_differ(expected, got):
            policy = POLICIES["queue-order"]
            said, predicted = str(got.queues), str(expected.queues)
        else:
            return None
        self.drift, self.drift_at = (
            Violation(
                POLICY_DRIFT,
                f"{name} {policy.decision} {said} where the model's vLLM-policy prediction "
                f"({policy.prediction}) {policy.predicted} {predicted}, every contract kept; "
                "from here the model no longer predicts the target's state, so the differential "
                "comparison stops and the model-independent checks go on; a branch that means this "
                f"policy declares it: {DECLARED_POLICIES_ENV}={policy.name}",
                policy=policy.name,
            ),
            len(self.ops) - 1,
        )
        return self.drift

    def _contract_step(self, op: Op) -> list[Violation]:
        """After a drift: the target judged by what does not read the model (the engine
        contract, every catalogue invariant on the target's own states, crashes); the
        model still applies `op` (operations are validated against it). A crash raised by
        kvretain's adapter refused an operation drawn from the model's diverged state: it
        and every later operation go unjudged (`unjudged`); a crash the engine raised stays
        a defect."""
        if self._refused:
            self.unjudged += 1
            self._expected(op, None)
            return []
        before = self.last
        try:
            obs = self.target.apply(op)
            snap = self.target.snapshot()
        except Exception as exc:
            self._expected(op, None)
            v = crashed(exc)
            if v.crash is not None and v.crash.raised_by == ADAPTER:
                self._refused, self.unjudged = True, self.unjudged + 1
                return []
            # After a drift the crash says so; under unpredicted settings its message stays whole
            # (a known crash finding's pattern matches the whole message).
            return [replace(v, message=f"{v.message} ({self._judged_since()})") if self.drift else v]
        self._expected(op, obs)
        self.after_drift += 1
        self.last_obs = obs
        return self._judge_state(op, obs, before, snap)

    def _judged_since(self) -> str:
        """Why the model is out of the judging: a drift, or settings it does not predict."""
        if self.drift is not None:
            return f"after the policy drift at operation {self.drift_at}"
        return f"the model does not predict {'; '.join(self.unpredicted)}: judged by the contract alone"

    def _judge_state(self, op: Op, obs: Observation, before: Snapshot, snap: Snapshot) -> list[Violation]:
        """What a whole target state after `op` breaks, the model aside: the engine's
        contract, the KV events against the hash map, every catalogue invariant; then
        `snap` is the state the next operation starts from."""
        found = self._engine_problems()
        finished = self.history.requests.get(op.rid) if isinstance(op, Finish) else None
        anomalies = update_history(self.history, op, obs, before, snap)
        found += [Violation("events_match_hash_map", a) for a in anomalies]
        if self.check_invariants:
            ctx = CheckContext(
                self.config,
                op,
                obs,
                before,
                snap,
                self.history,
                self._probe,
                finished,
                profile=self.model.profile,
                draft_blocks=self.model.num_spec_tokens,
            )
            found += [Violation(name, msg) for name, msg in check_all(ctx)]
        forget(self.history, snap.cached)  # after the checks: they read the finishing request's keys
        self.last = snap
        if self.audit_every > 1:
            self._mirror(snap)
        return found

    def _engine_problems(self) -> list[Violation]:
        """The engine's contract (`invariants.shadow`), as the target's judges found it."""
        if not self.check_invariants:
            self.target.engine_problems()  # drained all the same: they belong to this operation
            return []
        return [Violation(check, message) for check, message in self.target.engine_problems()]

    def _expected(self, op: Op, got: Observation | None) -> Observation:
        """The model's observation of `op` (after the target's, `got`), as far as the target
        observes it. Where the contract leaves a choice open, the model takes the one the
        target made if it is one the contract allows (`ModelObserver.choose_end_order`: the
        order a "fail" report's ended requests are ended in); else its own, and the two differ."""
        self.observer.choose_end_order(got.ended if isinstance(got, LoadCut) else ())
        return self._judged(self.model.apply(op))

    def _judged(self, expected: Observation) -> Observation:
        """An observation as far as the target observes it: a step's queue order only where
        the target states it (`TargetFeatures.queues`), else left unjudged on both sides."""
        if isinstance(expected, StepResult) and not self.target.features.queues:
            return replace(expected, queues=None)
        return expected

    def _partials(
        self, blocks: set[int], rids: list[str], keys: set[BlockKey], before: Tables
    ) -> tuple[PartialState, PartialState]:
        """(target's, model's) partial states over the same blocks and keys (the union of
        what either side says the operation touched); events are drained once."""
        got = self.target.partial(blocks, rids, keys, before)  # type: ignore[attr-defined]
        want = self.model_target.partial(blocks | set(got.blocks), rids, keys | set(got.holders), before)
        for _ in range(4):
            if want.blocks.keys() == got.blocks.keys() and want.holders.keys() == got.holders.keys():
                break
            blocks, keys = want.blocks.keys() | got.blocks.keys(), want.holders.keys() | got.holders.keys()
            got = replace(self.target.partial(blocks, rids, keys, before), events=got.events)  # type: ignore[attr-defined]
            want = replace(self.model_target.partial(blocks, rids, keys, before), events=want.events)
        return got, want

    def _advance(self, got: PartialState) -> Delta:
        """Apply a target's partial state to the mirror; the delta for the invariants."""
        before_blocks = {b: self._blocks[b] for b in got.blocks}
        before_holders = {k: self._holders.get(k, ()) for k in got.holders}
        idle_before = self._in_use == 0
        self._free_len = got.free_len
        uses = self._uses
        for rid, table in got.tables.items():
            old = self._tables.pop(rid, ())
            if table:
                self._tables[rid] = table
            if old == table:
                continue
            left, joined = table_changes(old, table)
            for b in left:
                uses[b] -= 1
            for b in joined:
                uses[b] += 1
        for b, state in got.blocks.items():
            self._in_use += (state[0] > 0) - (self._blocks[b][0] > 0)
            self._blocks[b] = state
            if state[1] is None:
                self._key_of.pop(b, None)
            else:
                self._key_of[b] = state[1]
            if state[2] != NOT_FREE and state[1] is None:
                self._free_uncached.add(b)
            else:
                self._free_uncached.discard(b)
        for k, v in got.holders.items():
            if v:
                self._holders[k] = v
            else:
                self._holders.pop(k, None)
        return Delta(
            blocks=got.blocks,
            before_blocks=before_blocks,
            holders=got.holders,
            before_holders=before_holders,
            uses=self._uses,
            key_of=self._key_of,
            free_uncached=self._free_uncached,
            idle_before=idle_before,
            free_len=got.free_len,
        )

    def audit(self) -> list[Violation]:
        """A full check between operations: both snapshots compared, every state invariant."""
        self.audits += 1
        self._since_audit = 0
        if self._refused:  # after a drift, the target refused an operation: nothing more is judged
            return []
        expected = self.model.snapshot()
        try:
            snap = self.target.snapshot()
        except Exception as exc:
            return [crashed(exc)]
        # After a drift, or under settings the model does not predict: no model.
        diffs = diff_snapshots(expected, snap) if self.drift is None and not self.unpredicted else []
        found = [Violation("snapshot", line) for line in diffs]
        anomalies = update_history(self.history, Probe((0,)), None, snap, snap)  # type: ignore[arg-type]
        self.history.tick -= 1  # an audit is not a step
        found += [Violation("events_match_hash_map", a) for a in anomalies]
        if self.check_invariants and self.ops:
            ctx = CheckContext(self.config, self.ops[-1], self.last_obs, snap, snap, self.history, None, None)  # type: ignore[arg-type]
            found += [Violation(name, msg) for name, msg in check_state(ctx)]
        self.last = snap
        self._mirror(snap)
        return [replace(v, config=self.config) for v in found]

    def _probe(self, tokens: tuple[int, ...]) -> ProbeResult:
        result = self.target.apply(Probe(tokens))
        assert isinstance(result, ProbeResult)
        return result


def _observation_difference(expected: object, got: object, target: str) -> str:
    """The message of an observation disagreement: both observations, or, where two steps
    differ only in the queue order they left, that order on each side."""
    if (
        isinstance(expected, StepResult)
        and isinstance(got, StepResult)
        and _only_queues_differ(expected, got)
    ):
        queues = "the queues the step left (running, holding, waiting)"
        return f"{queues}: model {expected.queues}, {target} {got.queues}"
    return f"model {expected}, {target} {got}"


def unpredicted(cfg: Config) -> tuple[str, ...]:
    """vLLM settings of `cfg` the model does not predict: an operation under them is judged as
    after a policy drift, by the engine contract, every catalogue invariant and crashes, never
    against the model (`kvretain conformance` lists them as excluded; the fuzz summary counts the
    examples). vLLM 0.33.0: the priority policy (`Scheduler.schedule`: the waiting queue a heap by
    (priority, arrival), the lowest-priority running request preempted, even one already scheduled
    this step). Eagle's lookahead block hashes are predicted (`model.contract.eagle`, `Config.hash_lookahead`)."""
    out = []
    if cfg.scheduling_policy == "priority":
        out.append("the priority scheduling policy")
    return tuple(out)


def _names(rids: tuple[str, ...]) -> str:
    return ", ".join(rids) if rids else "nobody"


def _named_blocks(obs: Observation) -> set[int]:
    """The blocks an observation names: each result's hit and new blocks, and every
    copy's endpoints (a copy moves keys and retention outside any table)."""
    blocks: set[int] = set()
    for _, r in obs.results if isinstance(obs, StepResult) else ((None, obs),):
        for ids in (getattr(r, "hit_blocks", None) or ()) + (getattr(r, "new_blocks", None) or ()):
            blocks.update(ids)
    for pair in getattr(obs, "copies", ()):
        blocks.update(pair)
    return blocks


def _only_queues_differ(expected: StepResult, got: StepResult) -> bool:
    return expected.queues != got.queues and replace(expected, queues=got.queues) == got


def _diff_partial(want: object, got: object) -> list[str]:
    """Differences between the model's and the target's partial states, one line per field."""
    lines = []
    for name in ("free_len", "events", "tables"):
        a, b = getattr(want, name), getattr(got, name)
        if a != b:
            lines.append(f"{name}: expected {_short(a)}, got {_short(b)}")
    ends_want, ends_got = getattr(want, "ends", None), getattr(got, "ends", None)
    if ends_want is not None and ends_got is not None and ends_want != ends_got:
        lines.append(f"free queue (head, tail): expected {ends_want}, got {ends_got}")
    for name in ("blocks", "holders"):
        a, b = getattr(want, name), getattr(got, name)
        if a != b:
            for k in sorted(set(a) | set(b), key=repr):
                if a.get(k) != b.get(k):
                    label = k.short() if isinstance(k, BlockKey) else f"block {k}"
                    lines.append(f"{name}[{label}]: expected {_short(a.get(k))}, got {_short(b.get(k))}")
    return lines


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = [
    "DECLARED_POLICIES_ENV",
    "DEFAULT_AUDIT_EVERY",
    "POLICIES",
    "POLICY_DRIFT",
    "REFUSED",
    "Checker",
    "InvalidOp",
    "ScheduleResult",
    "Violation",
    "declared_policies",
]


def connector_op_problem(model: AllocatorModel, config: Config, op: Offer | Loaded | Save | Saved) -> None:
    """Raise `InvalidOp` for a connector operation `model.machine.connector` does not state here."""
    name = type(op).__name__.lower()
    if not config.kv_connector:
        raise InvalidOp(f"{name}: the configuration has no KV connector (kv_connector: false)")
    req = model.requests.get(op.rid)
    if isinstance(op, Loaded):
        sync = model.sync_report is not None and op.rid in model.sync_report.loads
        if sync and not op.invalid:
            raise InvalidOp(
                f"loaded: {op.rid!r}'s sync load reports only the blocks it failed on ('invalid')"
            )
        if not sync and op.rid not in model.held and (req is None or req.load != "loading"):
            raise InvalidOp(f"loaded: {op.rid!r} has no connector load in flight")
        if op.invalid and (
            not op.ok or req is None or not set(op.invalid) <= set(failable_blocks(model, req))
        ):
            raise InvalidOp(
                f"loaded: 'invalid' must name blocks of {op.rid!r}'s load, reported ok, in a single-group "
                "layout: of an async load in flight, blocks covering its computed tokens that no other "
                "request holds; right after the step that ran a sync load, blocks holding its external "
                "tokens (model.machine.failed_blocks.failable_blocks)"
            )
        return
    if isinstance(op, Saved):
        if op.rid not in model.sending:
            raise InvalidOp(f"saved: {op.rid!r} has no connector save pending")
        return
    if req is None:
        raise InvalidOp(f"{name}: unknown request {op.rid!r}")
    if isinstance(op, Offer) and (req.running or req.load or req.num_computed):
        raise InvalidOp(f"offer: {op.rid!r} is not waiting for admission")
