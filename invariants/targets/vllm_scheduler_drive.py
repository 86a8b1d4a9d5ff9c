"""kvretain's scheduling operations run by vLLM's real `Scheduler`.

A `Step(rids, budget)` is one `Scheduler.schedule()` call over vLLM's own
queues, with the token budget the scheduler was built with
(`RealStepScheduler`): kvretain writes nothing of the scheduler's state, as an
engine core writes nothing (tests/test_steering_ledger.py holds the adapters'
source to it). `rids` names the requests the model says
the engine holds, in the order it predicts for them (running, holding, then
waiting: `model.policy.queues`); a step that names another set of requests, a
budget that would have cut it otherwise (`budget_unbound`), or (under FCFS)
another order is a step the engine cannot run, refused
as such (`SteeredStep`: the queues each step leaves are compared with the
model's, so the order a step starts from is the one the last step left, plus
arrivals at `waiting`'s back); under the priority policy, whose order the model
does not predict, a step is run in vLLM's order and counted.
Which requests run, in what order, with which chunk, is vLLM's own code: the
running pass, preemption, the waiting pass and its `max_num_seqs` cap, the
Mamba split, spec-decode padding, CoW copies. `Schedule(rid, budget)` is
`Step((rid,), budget)`; `Preempt(rid)` is refused (no client of an engine can ask it).

The step's decisions are read, never re-derived: a `StepRecorder` wraps the
`KVCacheManager`'s `get_computed_blocks`, `allocate_slots` and `free` for the
duration of `schedule()` and records each call (request, arguments, result);
the `SchedulerOutput` gives the tokens each request was scheduled and the
copies. `observe` arranges them as the model's `StepResult`: the running
requests the pass reached in `running`'s order (a running request with nothing to
compute is reached but calls nothing, exactly as in `Scheduler.schedule`),
then the waiting requests in lookup order; the preempted requests in the order
their blocks were freed; the queues `schedule()` left (`running`,
`kv_holding_waiting`, `waiting`, front to back: `model.policy.queues`), restricted to
the step's requests.

The block ids of a scheduled request are the ones the step ships to the worker
(`SchedulerOutput`), not the allocator's return value, so a scheduler that
hands the worker the wrong table differs from the model: a running request's
`new_blocks` is its `CachedRequestData.new_block_ids` (None: nothing new); an
admitted request ships its whole table (`NewRequestData.block_ids`, or a
resumed request's `new_block_ids`), whose entries past the hit are its
`new_blocks` and whose first entries must be the hit's blocks, except where the
allocator nulled a block the window left behind (`shipped_admission`).

The model runner's half of a step is `update_from_output` with a synthetic
`ModelRunnerOutput`: it runs just before the next `schedule()` (never sooner,
as a model runner returns a step's output before the next step is scheduled)
and carries, for every request the step scheduled, the token a `Sample`
operation gave it (an empty list for a prefill chunk). Where another output
is processed between a request's last chunk and its sample (a connector's
report, which rides on no step), the request's share of the output (the output
restricted to it) waits, and is delivered with its token by the `Sample`, as an
asynchronous engine delivers a step's output after later steps were
scheduled; a `Finish` first delivers it without a token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from invariants.shadow import ShadowWorker
from model.contract.observation import Queues, ScheduleResult, StepResult
from model.contract.ops import Sample

from .base import TargetCrash, TargetRefusal
from .vllm_names import HashLearner
from .vllm_scheduler_build import EventCapture
from .vllm_session import VllmSession


class SteeredStep(TargetRefusal):
    """A step the engine cannot run: it names other requests than the scheduler holds, or
    a budget that would have cut it otherwise than the one it was built with (an engine
    core schedules every request it holds, with its configured budget). kvretain's own
    refusal of the trace, never vLLM's defect."""


@dataclass
class Call:
    """One manager call during `schedule()`: `kind` is "lookup", "allocate" or "free"."""

    kind: str
    rid: str
    result: Any = None


@dataclass
class Recorded:
    """One recorded manager method. An object, not a closure: a fork of the target
    (explore's pickle) copies it with its recorder and its manager, where a closure
    would be shared and keep recording into the original."""

    recorder: StepRecorder
    method: Callable[..., Any]
    kind: str

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = self.method(request, *args, **kwargs)
        if self.recorder.active:
            self.recorder.calls.append(Call(self.kind, request.request_id, result))
        return result


@dataclass
class StepRecorder:
    """Records the `KVCacheManager` calls of one `schedule()` (observation only: each
    wrapper calls vLLM's method with the same arguments and returns its result)."""

    manager: Any
    calls: list[Call] = field(default_factory=list)
    active: bool = False

    def __post_init__(self) -> None:
        m = self.manager
        m.get_computed_blocks = self._wrap(m.get_computed_blocks, "lookup")
        m.allocate_slots = self._wrap(m.allocate_slots, "allocate")
        m.free = self._wrap(m.free, "free")

    def _wrap(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        return Recorded(self, method, kind)

    @contextmanager
    def recording(self) -> Iterator[list[Call]]:
        self.calls = []
        self.active = True
        try:
            yield self.calls
        finally:
            self.active = False


class RealStepScheduler:
    """Runs kvretain's scheduling operations through one vLLM `Scheduler` (see the module docstring)."""

    def __init__(
        self, session: VllmSession, names: HashLearner, scheduler: Any, modules: dict[str, Any]
    ) -> None:
        self.s = session
        self.names = names
        self.sched = scheduler
        self.m = modules
        self.recorder = StepRecorder(scheduler.kv_cache_manager)
        # The publisher `vllm_scheduler_build` gave the scheduler at construction.
        self.capture: EventCapture = scheduler.kv_event_publisher
        if not isinstance(self.capture, EventCapture):
            raise TargetCrash("the vLLM scheduler was not built with kvretain's event capture")
        # The last step's output, until the model runner's half of the step runs (`flush`).
        self.pending: Any = None
        # rid -> the token a `Sample` gave it, delivered with its step's output.
        self.samples: dict[str, int] = {}
        # rid -> the step output whose share for it waits for its sample (see `flush`).
        self.held: dict[str, Any] = {}
        # The last step's output (a connector's report is delivered with an empty share of it).
        self.last_out: Any = None
        # Ids whose share of `pending` was a finished request's, reused since (see `add`).
        self.stale: set[str] = set()
        # The requests `update_from_output` ended with an error, in its outputs' order.
        self.errored: list[str] = []
        # Those whose sample rode on a connector's report and was skipped (`take_dropped`).
        self.dropped: list[str] = []
        # The shadow worker fed every step's output and every sampled token (None: not followed).
        self.shadow: ShadowWorker | None = None
        # Steps whose requests vLLM held in another order than the step named them (run in vLLM's).
        self.reordered_steps = 0

    # ------------------------------------------------------------------ the manager, as before
    def computed_blocks(self, req: Any) -> tuple[Any, int, int]:
        """`get_computed_blocks` (a probe's lookup; pure)."""
        out = self.s.manager.get_computed_blocks(req)
        return out if self.s.caps.shared_prefix_junction else (*out, 0)

    # ------------------------------------------------------------------ operations
    def add(self, req: Any) -> None:
        """A request reusing the id of one that finished with its share of the last step's
        output undelivered: that share (and its sample) was the finished request's, which
        vLLM delivers before the finish (its engine updates from a step's output before it
        takes the next abort). Delivered later it would land on the new request: dropped
        (vLLM ignores output for a request it no longer has)."""
        rid = req.request_id
        if self.pending is not None and rid in self.pending.num_scheduled_tokens:
            self.stale.add(rid)
            self.samples.pop(rid, None)
        self.sched.add_request(req)

    def sample(self, req: Any, token: int) -> None:
        """A sampled token: delivered with its step's output, or appended now when that
        output was already processed (see the module docstring)."""
        rid = req.request_id
        if self.pending is not None and rid in self.pending.num_scheduled_tokens:
            self.samples[rid] = token
            return
        if rid not in self.held:
            raise TargetCrash(f"the vLLM scheduler adapter holds no step output for {rid!r}'s sample")
        self.samples[rid] = token
        self._deliver(self.held.pop(rid), [rid])

    def sample_op(self, req: Any, op: Sample) -> None:
        """A `Sample` operation (drafts are `SpecStepScheduler`'s, `vllm_scheduler_spec`)."""
        self.sample(req, op.token)

    def close_window(self) -> None:
        """An operation other than a sample or a load's report is next (the output a sample
        with drafts waits on is processed then: `SpecStepScheduler`); nothing here."""

    def sampled_tokens(self, out: Any, rid: str) -> list[int]:
        """`rid`'s sampled tokens in step output `out` (none if unsampled)."""
        return [self.samples.pop(rid)] if rid in self.samples else []

    def awaits_sample(self, rid: str) -> bool:
        """`rid` was sampled and its token waits for the step's output."""
        return rid in self.samples

    def preempt(self, req: Any) -> None:
        """`Preempt(rid)`: no client of an engine preempts one request (vLLM preempts under
        pool pressure, or every running request at a reset): refused."""
        raise SteeredStep(
            f"preempt {req.request_id}: vLLM's engine has no call that preempts one running request "
            "(it preempts under pool pressure)"
        )

    def finish(self, req: Any) -> None:
        self.settle(req.request_id)
        self.sched.finish_requests(req.request_id, self.s.v["RequestStatus"].FINISHED_ABORTED)

    def schedule(self, req: Any, budget: int) -> ScheduleResult:
        """`Schedule(rid, budget)`: a step of one request."""
        step = self.step((req.request_id,), budget)
        result = next((r for rid, r in step.results if rid == req.request_id), ScheduleResult(0, False))
        return ScheduleResult(
            result.scheduled,
            result.admitted,
            result.hit,
            result.shared_prefix_boundary,
            result.hit_blocks,
            result.new_blocks,
            step.copies,
        )

    def step(self, rids: tuple[str, ...], budget: int) -> StepResult:
        """One `Scheduler.schedule()`, the step the engine takes over the requests it holds,
        which `rids` must name (`arrange`), with a `budget` that gives the same step
        (`budget_unbound`; see the module docstring)."""
        self.flush()
        sched, named = self.sched, set(rids)
        self.arrange(rids)
        running = [r.request_id for r in sched.running]  # the running pass's order
        with self.recorder.recording() as calls:
            out = sched.schedule()
        queues = self.queues_left(named)
        if self.shadow is not None:
            self.shadow.execute(out)
        self.pending = self.last_out = out
        self.budget_unbound(budget, out)
        for rid in out.num_scheduled_tokens:
            self.names.learn_computed(self.s.requests[rid])
        computed = {rid: self.s.requests[rid].num_computed_tokens for rid in rids}
        step = observe(calls, running, out, budget, computed, sched.block_size)
        return replace(step, queues=queues)

    def own_queues(self) -> tuple[list[Any], list[Any], list[Any]]:
        """vLLM's queues as they stand, front to back: `running`, `kv_holding_waiting`
        (empty before the release that added it, 0.31), `waiting`."""
        sched = self.sched
        holding = list(sched.kv_holding_waiting) if hasattr(sched, "kv_holding_waiting") else []
        return list(sched.running), holding, list(sched.waiting)

    def arrange(self, rids: tuple[str, ...]) -> None:
        """An engine's step: `rids` must name exactly the requests vLLM's queues hold, in
        their order under FCFS (else `SteeredStep`); under another policy (priority), whose
        order the model does not predict, another order is run in vLLM's and counted
        (`reordered_steps`). Nothing is written: the check only reads the queues."""
        own = [r.request_id for queue in self.own_queues() for r in queue]
        if set(own) != set(rids) or len(own) != len(rids):
            missing, extra = sorted(set(rids) - set(own)), sorted(set(own) - set(rids))
            raise SteeredStep(
                f"step over {list(rids)}: vLLM's queues hold {own} (named but not held: {missing}; "
                f"held but not named: {extra}); an engine's step schedules every request it holds"
            )
        if own != list(rids):
            if self.sched.policy.value == "fcfs":  # FCFS order is the model's (`model.policy.queues`)
                raise SteeredStep(
                    f"step over {list(rids)}: vLLM's queues hold them as {own} (running, holding, "
                    "waiting); an engine's step takes its own order (after a step, the queues it left "
                    "are judged against the model's: model.policy.queues)"
                )
            self.reordered_steps += 1  # another policy's order: vLLM's (the model predicts FCFS only)

    def budget_unbound(self, budget: int, out: Any) -> None:
        """A step's `budget` is the engine's own where it did not bind: the engine, built with
        its budget, scheduled what step output `out` says, which is the step the trace states
        iff neither budget cut it (no more than `budget`, and less than the built budget where
        the trace's is larger), and, where a prefill chunk stopped short of its prompt in an
        aligned-Mamba layout, each Mamba block is no wider than both budgets or wider than both
        (`_mamba_block_aligned_split` compares the block with the step budget itself there).
        Else `SteeredStep`: the trace asks a budget the engine does not have."""
        built = self.sched.max_num_scheduled_tokens
        scheduled = int(out.total_num_scheduled_tokens)
        requests = self.s.requests
        short = any(
            r in requests and requests[r].num_computed_tokens < requests[r].num_prompt_tokens
            for r in out.num_scheduled_tokens
        )
        split = not short or all(
            (g.block_size <= budget) == (g.block_size <= built)
            for g in self.s.config.groups
            if g.kind == "mamba" and g.mamba_cache_mode == "align"
        )
        unbound = scheduled < min(budget, built) or (budget < built and scheduled == budget)
        if budget == built or (unbound and split):
            return
        raise SteeredStep(
            f"step with budget {budget}: the scheduler, built with {built} tokens a step "
            f"(Config.max_num_batched_tokens), scheduled {scheduled}, so the two budgets give "
            "different steps; a trace's step states the built budget, or one that does not bind"
        )

    def queues_left(self, named: set[str]) -> Queues:
        """The queues `schedule()` left, front to back, restricted to the step's requests
        (`model.policy.queues`); a release without `kv_holding_waiting` (before 0.31) has every
        waiting request in `waiting`."""
        sched = self.sched

        def ids(queue: Iterable[Any]) -> tuple[str, ...]:
            return tuple(r.request_id for r in queue if r.request_id in named)

        holding = ids(sched.kv_holding_waiting) if hasattr(sched, "kv_holding_waiting") else ()
        return Queues(ids(sched.running), holding, ids(sched.waiting))

    def flush(self) -> None:
        """The model runner's half of the last step: `update_from_output` with the
        sampled tokens; a request's share waits for its sample (see the module docstring)."""
        out, self.pending = self.pending, None
        stale, self.stale = self.stale, set()
        if out is None:
            return
        running = self.s.v["RequestStatus"].RUNNING
        now = []
        for rid in out.num_scheduled_tokens:
            if rid in stale:
                continue
            req = self.s.requests.get(rid)
            owes = (
                req is not None
                and rid not in self.samples
                and req.status == running
                and req.num_computed_tokens >= req.num_tokens
            )
            if owes:
                self.held[rid] = out
            else:
                now.append(rid)
        self._deliver(out, now)

    def _deliver(self, out: Any, rids: list[str], connector_output: Any = None) -> None:
        """`update_from_output` for the share of step output `out` that belongs to `rids`,
        with their sampled tokens (and the worker's `connector_output`, if any)."""
        if not rids:
            return
        scheduled = {r: out.num_scheduled_tokens[r] for r in rids}
        share = replace(
            out,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=self.share_total(out, scheduled),
            scheduled_spec_decode_tokens={
                r: t for r, t in out.scheduled_spec_decode_tokens.items() if r in scheduled
            },
        )
        sampled = [self.sampled_tokens(out, r) for r in rids]
        if self.shadow is not None:
            for rid, tokens in zip(rids, sampled):
                self.shadow.returned(rid, tokens)
        live = self.s.requests
        starts = {r: self.names.before_sample(live[r]) for r, t in zip(rids, sampled) if t and r in live}
        runner_out = self.m["ModelRunnerOutput"](
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
        known = {r: live[r].num_tokens for r in starts}
        self.update(share, runner_out)
        if connector_output is not None:  # a failed load's cut skips the outputs of those it cuts
            self.dropped += sorted(r for r, n in known.items() if live[r].num_tokens == n)
        for rid, start in starts.items():
            self.names.after_sample(self.s.requests[rid], start)

    def share_total(self, out: Any, scheduled: dict[str, int]) -> int:
        """The `total_num_scheduled_tokens` a share of `out` reports: its own tokens."""
        return sum(scheduled.values())

    def settle(self, rid: str) -> None:
        """Deliver `rid`'s waiting share without a token (it is preempted or finished unsampled)."""
        out = self.held.pop(rid, None)
        if out is not None:
            self._deliver(out, [rid])

    def report_load(self, connector_output: Any, invalid: tuple[int, ...] = ()) -> None:
        """The worker's report of a connector load (`model.contract.ops.Loaded`): after the
        last step's output, `update_from_output` with `connector_output`
        (`vllm_connector.connector_output`) and no request's share, but for the shares
        of that output still held for a sample whose requests hold a failed block
        before it (`riding`): the worker reports the failed blocks with them."""
        self.flush()
        if self.last_out is None:
            raise TargetCrash("the vLLM scheduler adapter has no step output to carry a load report")
        riding = self.riding(invalid)
        if riding:
            for rid in riding:
                del self.held[rid]
            self._deliver(self.last_out, riding, connector_output)
            return
        empty = replace(
            self.last_out,
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            scheduled_spec_decode_tokens={},
        )
        runner_out = self.m["ModelRunnerOutput"](
            req_ids=[], req_id_to_index={}, sampled_token_ids=[], kv_connector_output=connector_output
        )
        self.update(empty, runner_out)

    def update(self, out: Any, runner_out: Any) -> None:
        """`update_from_output`, noting the requests it ended with an error (a failed
        load under "fail") in the order of its outputs, which is the order
        `finish_requests` ended them in (`errored`)."""
        outputs = self.sched.update_from_output(out, runner_out)
        if self.shadow is not None:
            self.shadow.processed()
        for batch in (outputs or {}).values():  # older releases may return nothing
            self.errored += [
                o.request_id for o in batch.outputs if getattr(o.finish_reason, "name", "") == "ERROR"
            ]

    def take_dropped(self) -> tuple[str, ...]:
        """The requests whose sample a connector's report skipped since the last call, by id."""
        out, self.dropped = tuple(sorted(self.dropped)), []
        return out

    def take_errored(self) -> tuple[str, ...]:
        """The requests ended with an error since the last call, in the order they were ended."""
        out, self.errored = tuple(self.errored), []
        return out

    def riding(self, invalid: tuple[int, ...]) -> list[str]:
        """The requests whose share of the last step's output is held for a sample and whose
        blocks before that step include one of `invalid` (one KV cache group)."""
        out, manager, size = self.last_out, self.sched.kv_cache_manager, self.sched.block_size
        found = []
        for rid, held in self.held.items():
            req = self.sched.requests.get(rid)
            if held is not out or req is None or not invalid:
                continue
            before = req.num_computed_tokens - out.num_scheduled_tokens[rid]
            (ids,) = manager.get_block_ids(rid)
            if set(ids[: -(-before // size)]) & set(invalid):
                found.append(rid)
        return found

    def report_step(self, rid: str, connector_output: Any) -> None:
        """The worker's report of the sync load that the last step ran for `rid`
        (`model.contract.ops.Loaded` right after that step): the step's output, every request's
        share at once, `rid`'s with its token where it was sampled (vLLM decides to drop
        it: observed in `LoadCut.dropped`, as any rider's), carries it."""
        out, self.pending = self.pending, None
        if out is None or rid not in out.num_scheduled_tokens:
            raise TargetCrash(f"the vLLM scheduler adapter holds no step output of {rid!r}'s sync load")
        self._deliver(out, list(out.num_scheduled_tokens), connector_output)

    def take_events(self) -> list[Any]:
        """The KV events `update_from_output` published, then those still in the manager."""
        return [*self.capture.take(), *self.s.manager.take_events()]


def observe(
    calls: list[Call],
    running: list[str],
    out: Any,
    budget: int,
    computed: dict[str, int] | None = None,
    block_size: int = 0,
) -> StepResult:
    """The model's `StepResult` of one `schedule()`, from its recorded manager calls
    and its output (see the module docstring); `computed`: each request's computed
    tokens after the step, from which an admission's external tokens (a KV
    connector's) are read; `block_size`: the scheduler's, at which a hit followed
    by external tokens is cut (`model.machine.connector`)."""
    scheduled: dict[str, int] = dict(out.num_scheduled_tokens)
    results: list[tuple[str, ScheduleResult]] = []
    allocated: dict[str, Any] = {}
    # (victim, the request whose allocation preempted it), in preemption order.
    preemptions: list[tuple[str, str]] = []
    serving = ""
    for c in calls:
        if c.kind == "allocate":
            allocated[c.rid] = c.result
            serving = c.rid
        elif c.kind == "free" and c.rid in running:
            preemptions.append((c.rid, serving))
    shipped = shipped_blocks(out)
    cow = {(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies or ()}
    queue, i, left = list(running), 0, budget
    while i < len(queue) and left > 0:
        rid = queue[i]
        if rid in scheduled:
            new_blocks = shipped_new_blocks(shipped.get(rid), block_ids(allocated[rid]))
            results.append((rid, ScheduleResult(scheduled[rid], False, new_blocks=new_blocks)))
            left -= scheduled[rid]
        else:
            results.append((rid, ScheduleResult(0, False)))
            if (rid, rid) in preemptions:
                break  # it preempted itself: the pass ends
        # Its victims left the queue's end.
        queue = [r for r in queue if (r, rid) not in preemptions or r == rid]
        i += 1
    looked_up: set[str] = set()
    for c in calls:
        if c.kind == "allocate" and c.rid not in running and c.rid not in looked_up:
            # A waiting request holding blocks (a connector's load) takes its chunk without a lookup.
            n = scheduled.get(c.rid, 0)
            new = block_ids(c.result) if n and c.result is not None else None
            results.append((c.rid, ScheduleResult(n, bool(n), new_blocks=new)))
            continue
        if c.kind != "lookup":
            continue
        looked_up.add(c.rid)
        blocks, hit, spb = c.result if len(c.result) == 3 else (*c.result, 0)
        n = scheduled.get(c.rid, 0)
        granted = allocated.get(c.rid) is not None
        hit_ids = block_ids(blocks)
        new = block_ids(allocated[c.rid]) if n and granted else None
        # Past the hit and the chunk: what the connector supplied (0 unless granted).
        ext = max((computed or {}).get(c.rid, 0) - hit - n, 0) if granted else 0
        if new is not None:
            superseded = ext > 0 and block_size > 0 and hit % block_size > 0
            hit_ids, new = shipped_admission(
                shipped.get(c.rid), hit_ids, new, cow, external=ext > 0, superseded=superseded
            )
        results.append((c.rid, ScheduleResult(n, bool(n), hit, spb, hit_ids, new, external=ext)))
    seen = {rid for rid, _ in results}
    missed = [rid for rid in scheduled if rid not in seen]
    if missed:
        raise TargetCrash(
            f"the vLLM scheduler adapter could not place scheduled requests {missed} in the step"
        )
    copies = tuple((c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies or ())
    return StepResult(tuple(results), tuple(v for v, _ in preemptions), copies)


def block_ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `KVCacheBlocks` as block ids per group."""
    return tuple(tuple(ids) for ids in blocks.get_block_ids())


Table = tuple[tuple[int, ...], ...]
NULL_BLOCK_ID = 0


def shipped_blocks(out: Any) -> dict[str, Table | None]:
    """rid -> the block ids step output `out` ships to the worker: a new request's
    whole table, a cached request's `new_block_ids` (a resumed request's whole
    table; None when no group got a block)."""
    shipped: dict[str, Table | None] = {}
    for data in out.scheduled_new_reqs:
        shipped[data.req_id] = tuple(tuple(ids) for ids in data.block_ids)
    cached = out.scheduled_cached_reqs
    for rid, ids in zip(cached.req_ids, cached.new_block_ids):
        shipped[rid] = None if ids is None else tuple(tuple(g) for g in ids)
    return shipped


def shipped_new_blocks(shipped: Table | None, allocated: Table) -> Table:
    """A running request's shipped new blocks, None as empty groups (as many as `allocated`)."""
    return tuple(() for _ in allocated) if shipped is None else shipped


def _under_hit(
    hit: tuple[int, ...], table: tuple[int, ...], cow: set[tuple[int, int]], superseded: bool = False
) -> tuple[int, ...]:
    """One group's hit as the table shows it (see `shipped_admission`); `superseded`: from
    the first entry that is not the hit's on, the table holds external blocks instead
    (the hit's sub-block tail was cut: `model.machine.connector`), so the hit is the lookup's there."""
    shown = tuple(h if t == NULL_BLOCK_ID or (h, t) in cow else t for h, t in zip(hit, table))
    if not superseded:
        return shown
    agree = next((i for i, (h, s) in enumerate(zip(hit, shown)) if h != s), len(shown))
    return shown[:agree] + hit[agree : len(shown)]


def shipped_admission(
    shipped: Table | None,
    hit: Table,
    allocated: Table,
    cow: set[tuple[int, int]],
    external: bool = False,
    superseded: bool = False,
) -> tuple[Table, Table]:
    """An admitted request's (hit blocks, new blocks) as its shipped whole table
    shows them: per group, the entries under the hit, then the rest. Under the
    hit, a null entry where the hit had a block stands for that block (the
    allocator nulls the blocks a window left behind; the worker never reads
    them), and so does the destination of a copy-on-write of that block, which
    is also a new block (`cow`: the step's copies, as (source, destination)).
    With a KV connector's `external` tokens the blocks holding them come between
    the hit and the chunk's new blocks; they are the request's table, which the
    snapshot compares, so the new blocks are the table's last entries; where
    they `superseded` the hit's sub-block tail, they stand in that tail's place."""
    if shipped is None:
        return tuple(() for _ in hit), tuple(() for _ in allocated)
    if external:
        shipped = tuple(
            (*tg[: len(hg)], *tg[len(tg) - len(ag) :]) if len(tg) >= len(hg) + len(ag) else tg
            for hg, ag, tg in zip(hit, allocated, shipped)
        )
    hits = tuple(
        _under_hit(hg, tg, cow, superseded) if external else _under_hit(hg, tg, cow)
        for hg, tg in zip(hit, shipped)
    )
    new = tuple(
        (*(t for h, t in zip(hg, tg) if (h, t) in cow), *tg[len(hg) :]) for hg, tg in zip(hit, shipped)
    )
    return hits, new
