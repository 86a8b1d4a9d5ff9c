"""The stateful fuzzer: a Hypothesis RuleBasedStateMachine generic over targets.

Rules are the operations a scheduler performs (add, schedule a chunk or a
decode step, sample, finish, preempt, probe, reset, evict). Requests share
system prompts drawn from a 3-token alphabet, so hits, window slides and
eviction are common. After every rule the target's observation and snapshot
must equal the model's and every invariant of the catalogue must hold; the
first violation fails the run, and Hypothesis shrinks the operation sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from invariants.harness import identities
from invariants.harness.checker import Checker, Violation
from invariants.harness.engine_step import engine_step
from invariants.harness.run_stats import (
    FuzzStats,
    Tolerance,
    ViolationFound,
    check_budget,
    config_features,
    reused_across_requests,
)
from invariants.targets.base import Target, TargetFeatures
from model.contract.config import Config
from model.contract.extra_keys import Identity, identity_of
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import (
    LOAD_MODES,
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
from model.machine.failed_blocks import failable_blocks
from model.policy.scheduling import build_budget
from model.policy.spec_decode import acceptable

TOKENS = st.integers(1, 3)
MAX_REQUEST_TOKENS = 160


def _tolerate_nothing(v: Violation) -> object:
    return None


class AllocatorMachine(RuleBasedStateMachine):
    """The stateful fuzzer over one run's targets, written as Hypothesis's own examples write it.

    The class is abstract over the run: a run binds its settings as class
    attributes of a subclass, and the subclass's `setup` initialize rule is made
    from its `config_strategy` when the subclass is created (`__init_subclass__`):

        class DSV4Machine(AllocatorMachine):
            target_factory = make_target          # Config -> Target
            config_strategy = st.just(dsv4_tiny)  # the configurations examples draw
            run_stats = FuzzStats()               # shared by every example (fresh if omitted)
            tolerated = is_known                  # Violation -> known finding, or falsy (default: none)

        TestDSV4 = DSV4Machine.TestCase

    `build_machine(...)` does exactly this for a run's arguments. Every example
    builds its target from the configuration it draws, then each rule applies an
    operation through a `Checker`; a new violation raises `ViolationFound`, a
    step past `run_stats.deadline` raises `BudgetSpent`, a tolerated one is
    recorded in `run_stats.known`, and the end of each example is audited in full.
    """

    target_factory: ClassVar[Callable[[Config], Target]]
    config_strategy: ClassVar[st.SearchStrategy[Config]]
    run_stats: ClassVar[FuzzStats]
    tolerated: ClassVar[Tolerance] = _tolerate_nothing

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_strategy" in cls.__dict__:
            # The run's initialize rule; the base's `setup` is the plain method it wraps.
            cls.setup = initialize(config=cls.config_strategy, data=st.data())(AllocatorMachine.setup)  # type: ignore[method-assign]
        if not hasattr(cls, "run_stats"):
            cls.run_stats = FuzzStats()

    def __init__(self) -> None:
        super().__init__()
        self.checker: Checker | None = None
        self.failed = False
        # A tolerated crash (a known finding where the target raised) leaves the
        # target's state undefined: the example checks nothing after it.
        self.halted = False
        self.prefixes: list[tuple[int, ...]] = []
        self.next_rid = 0

    def setup(self, config: Config, data: st.DataObject) -> None:
        """The initialize rule (bound per run in `__init_subclass__`): build the target, draw prompts."""
        stats = self.run_stats
        check_budget(stats)
        stats.examples += 1
        factory = type(self).target_factory
        # A class states its features (a function's target says them once built).
        declared: TargetFeatures | None = factory.features if isinstance(factory, type) else None  # type: ignore[attr-defined]
        try:
            if declared is not None and declared.engine_steps:
                config = engine_caps(config, data)
            target = factory(config)
            if declared is None and target.features.engine_steps and not config.max_num_batched_tokens:
                config = engine_caps(config, data)
                target = factory(config)
        except Exception as exc:  # a target that cannot be built for a valid config: a finding
            crash = Violation("crash", f"target construction: {type(exc).__name__}: {exc}")
            raise self._report(ViolationFound([crash], config, [])) from exc
        self.checker = Checker(target, audit_every=stats.audit_every)
        stats.features.update(f"config: {name}" for name in config_features(config))
        stats.features.update(f"engine: {line}" for line in target.engine_settings())
        sbs = config.scheduler_block_size
        self.prefixes = [
            tuple(data.draw(st.lists(TOKENS, min_size=sbs + 1, max_size=3 * sbs), label="system prompt"))
            for _ in range(2)
        ]

    # -- helpers ------------------------------------------------------
    @property
    def cfg(self) -> Config:
        assert self.checker is not None
        return self.checker.config

    def _requests(self, pred: Callable[[object], bool]) -> list[str]:
        assert self.checker is not None
        return sorted(rid for rid, r in self.checker.model.requests.items() if pred(r))

    def _do(self, op: Op) -> None:
        assert self.checker is not None
        stats = self.run_stats
        check_budget(stats)
        if self.halted:
            return
        before = self.checker.tables()
        violations = self.checker.step(op)
        drift = [v for v in violations if v.is_drift]
        if drift:  # not a defect: counted apart (the checker says it once, then judges without the model)
            stats.drifts.append(ViolationFound(drift, self.cfg, self.checker.ops))
            if stats.on_drift is not None:
                stats.on_drift(stats.drifts[-1])
        found = [v for v in violations if not v.is_drift and not self._known(v)]
        stats.steps += 1
        if not found and any(v.check == "crash" for v in violations):
            self.halted = True
            stats.features["example ended by a tolerated crash"] += 1
        free_len, pinned_len, cached, tables = self.checker.shape()
        stats.features.update(self.checker.observer.coverage)
        self.checker.observer.coverage.clear()
        if isinstance(op, Step) and reused_across_requests(before, self.checker.last_obs):
            stats.features["block freed by one request reused by another in one step"] += 1
        stats.states.add((type(op).__name__, free_len // 2, pinned_len, min(cached, 12), tables))
        if found:
            self._fail(found)

    def _report(self, failure: ViolationFound) -> ViolationFound:
        """Mark this example failed and tell the run (its last failure, its listener)."""
        self.failed = True
        self.run_stats.last_failure = failure
        if self.run_stats.on_violation is not None:
            self.run_stats.on_violation(failure)
        return failure

    def _fail(self, found: list[Violation]) -> None:
        assert self.checker is not None
        raise self._report(ViolationFound(found, self.cfg, self.checker.ops))

    def teardown(self) -> None:
        """The end of every example is audited in full (nothing the fast path missed survives it)."""
        if self.checker is not None:
            figures = self.checker.target.engine_figures() or {}
            self.run_stats.features.update({f"engine contract: {k}": n for k, n in figures.items() if n})
            self.run_stats.after_drift += self.checker.after_drift
            self.run_stats.unjudged_after_drift += self.checker.unjudged
        if self.checker is None or self.failed or self.halted or self.checker.audit_every == 1:
            return
        found = [v for v in self.checker.audit() if not self._known(v)]
        if found:
            self._fail(found)

    def _known(self, v: Violation) -> bool:
        finding = type(self).tolerated(v)
        if not finding:
            return False
        ops = self.checker.ops if self.checker is not None else None
        self.run_stats.known.record(str(getattr(finding, "id", v.check)), v, ops)
        return True

    def _count_hit(self, rid: str, hit: int) -> None:
        """An admitted request's prompt and hit, for the run's hit rate."""
        assert self.checker is not None
        self.run_stats.prompt_tokens += len(self.checker.history.requests[rid].tokens)
        self.run_stats.hit_tokens += hit

    # -- rules --------------------------------------------------------
    @precondition(lambda self: self.checker is not None and len(self.checker.model.requests) < 4)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        sbs = self.cfg.scheduler_block_size
        prefix = data.draw(st.sampled_from([*self.prefixes, ()]), label="prefix")
        suffix = data.draw(st.lists(TOKENS, min_size=0 if prefix else 1, max_size=2 * sbs), label="suffix")
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self._do(self._identified(data, rid, tuple(prefix) + tuple(suffix)))

    def _identified(self, data: st.DataObject, rid: str, prompt: tuple[int, ...]) -> AddRequest:
        """The add of `prompt`, with an identity the target expresses (`harness.identities`:
        often an earlier request's prompt under another identity), counted."""
        assert self.checker is not None
        supported = self.checker.target.identities
        if not supported:
            return AddRequest(rid, prompt)
        earlier = list(self.checker.history.all_requests())
        sibling = (
            identities.draw_sibling(data, [r.prompt for r in earlier], self.cfg.hash_block_size)
            if self.cfg.hash_lookahead
            else None
        )
        if sibling is not None:
            prompt = sibling[0]
            op = AddRequest(rid, prompt, **{k: v for k, v in sibling[1].items() if k in supported})
        else:
            prompt = identities.draw_prompt(data, prompt, [tuple(r.prompt) for r in earlier])
            op = AddRequest(rid, prompt, **identities.draw_identity(data, prompt, supported))
        seen: dict[tuple[int, ...], set[Identity]] = {}
        for r in earlier:
            seen.setdefault(tuple(r.prompt), set()).add(identity_of(r.prompt))
        identities.count(
            self.run_stats.features, op.identity(), prompt, seen, self.checker.config.hash_lookahead > 0
        )
        return op

    def _schedulable(self) -> list[str]:
        return self._requests(lambda r: r.num_tokens < MAX_REQUEST_TOKENS)  # type: ignore[attr-defined]

    @property
    def engine(self) -> bool:
        """The target's engine decides every step (`TargetFeatures.engine_steps`)."""
        assert self.checker is not None
        return self.checker.target.features.engine_steps

    def _engine_step(self, data: st.DataObject) -> StepResult | None:
        """The engine's own step: first every request awaiting its sample is sampled (one at
        the size cap finishes instead, as an engine ends a request at its `max_tokens`), then
        the engine's next step (`invariants.harness.engine_step`) with the budget the engine was
        built with (`model.policy.scheduling.build_budget`). None where it runs none: no request is
        live, or one computed its tokens and awaits no sample yet (its verified drafts: the step
        waits for it)."""
        assert self.checker is not None
        model = self.checker.model
        for rid in self._arrival_order(list(model.requests)):
            r = model.requests.get(rid)
            if r is not None and r.awaits_sample:
                self._do(self._sample(rid, data) if r.num_tokens < MAX_REQUEST_TOKENS else Finish(rid))
        step = engine_step(model, build_budget(self.cfg))
        if step is None:
            return None
        self._do(step)
        obs = self.checker.last_obs
        if isinstance(obs, StepResult):
            for rid, result in obs.results:
                if result.admitted and result.hit is not None:
                    self._count_hit(rid, result.hit)
            return obs
        return None

    def _engine_steps(self, data: st.DataObject, most: int) -> None:
        """One to `most` engine steps (`_engine_step`), each followed by what may follow a step."""
        for _ in range(data.draw(st.integers(1, most), label="steps")):
            if self._engine_step(data) is None:
                return
            self._after_step(data)

    @precondition(lambda self: self.checker is not None and bool(self._schedulable()))
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """A few scheduler steps for one request: chunks, decodes, samples. Where the
        engine decides every step (`engine`), a few of its steps."""
        assert self.checker is not None
        if self.engine:
            self._engine_steps(data, 6)
            return
        rid = data.draw(st.sampled_from(self._schedulable()), label="rid")
        sbs = self.cfg.scheduler_block_size
        budget = data.draw(st.sampled_from([1, 3, sbs, 2 * sbs, 4 * sbs, 64]), label="budget")
        for _ in range(data.draw(st.integers(1, 6), label="steps")):
            r = self.checker.model.requests.get(rid)
            if r is None:  # ended by a report that followed its step
                return
            if r.num_tokens >= MAX_REQUEST_TOKENS:
                return
            if r.awaits_sample:
                self._do(self._sample(rid, data))
                continue
            if self.checker.target.features.real_scheduler:
                # A real scheduler runs whole steps: this request's own step.
                self._do(Step((rid,), budget))
            else:
                self._do(Schedule(rid, budget))
            obs = self._own_result(rid, self.checker.last_obs)
            if isinstance(obs, ScheduleResult) and obs.hit is not None:
                if not obs.admitted:
                    return
                self._count_hit(rid, obs.hit)
            self._after_step(data)

    @precondition(lambda self: self.checker is not None and bool(self._schedulable()))
    @rule(data=st.data())
    def step_batch(self, data: st.DataObject) -> None:
        """A few scheduler steps over every live request (FCFS, shared budget), each
        followed by a sample for every request that computed all its tokens. Where the
        engine decides every step (`engine`), a few of its steps."""
        assert self.checker is not None
        if self.engine:
            self._engine_steps(data, 4)
            return
        sbs = self.cfg.scheduler_block_size
        budget = data.draw(st.sampled_from([3, sbs, 2 * sbs, 4 * sbs, 64]), label="step budget")
        for _ in range(data.draw(st.integers(1, 4), label="steps")):
            for rid in self._arrival_order(self._requests(lambda r: r.running)):  # type: ignore[attr-defined]
                r = self.checker.model.requests[rid]
                if r.awaits_sample and r.num_tokens < MAX_REQUEST_TOKENS:
                    self._do(self._sample(rid, data))
            # Below the size cap and not owing a sample (those reached the cap).
            model_reqs = self.checker.model.requests
            queue = [
                rid
                for rid in self._arrival_order(list(model_reqs))
                if model_reqs[rid].num_tokens < MAX_REQUEST_TOKENS
                and not (
                    model_reqs[rid].running and model_reqs[rid].num_computed >= model_reqs[rid].num_tokens
                )
            ]
            if not queue:
                return
            self._do(Step(tuple(queue), budget))
            obs = self.checker.last_obs
            if isinstance(obs, StepResult):
                for rid, result in obs.results:
                    if result.admitted and result.hit is not None:
                        self._count_hit(rid, result.hit)
            self._after_step(data)

    def _after_step(self, data: st.DataObject) -> None:
        """What may follow a step before anything else (draws nothing here: a connector's
        report of the step's sync loads, `ConnectorMachine`)."""

    def _sample(self, rid: str, data: st.DataObject) -> Sample:
        """`rid`'s sample; where the target speculates, with how many of the step's
        drafts were accepted and the drafter's next proposal (`model.policy.spec_decode`)."""
        assert self.checker is not None
        token = data.draw(TOKENS, label="token")
        k = self.checker.model.num_spec_tokens
        if not k:
            return Sample(rid, token)
        verified = acceptable(self.checker.model.requests[rid].verifying)
        accepted = data.draw(st.integers(0, verified), label="accepted drafts")
        if accepted:
            self.run_stats.features["draft tokens accepted"] += 1
        drafts = data.draw(st.lists(TOKENS, max_size=k), label="drafts")
        return Sample(rid, token, accepted, tuple(drafts))

    @staticmethod
    def _own_result(rid: str, obs: object) -> object:
        """`rid`'s `ScheduleResult` in a `Schedule`'s or a `Step`'s observation (None if not reached)."""
        if isinstance(obs, StepResult):
            return next((r for r_id, r in obs.results if r_id == rid), None)
        return obs

    def _arrival_order(self, rids: list[str]) -> list[str]:
        return sorted(rids, key=lambda rid: int(rid[1:]))

    @precondition(lambda self: self.checker is not None and bool(self._requests(lambda r: True)))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._do(Finish(data.draw(st.sampled_from(self._requests(lambda r: True)), label="rid")))

    @precondition(
        lambda self: (
            self.checker is not None and not self.engine and bool(self._requests(lambda r: r.running))
        )  # type: ignore[attr-defined]
    )
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """A directed preemption (no engine's client can ask one: never sent where the engine
        decides every step, whose preemptions come from pool pressure)."""
        running = self._requests(lambda r: r.running)  # type: ignore[attr-defined]
        self._do(Preempt(data.draw(st.sampled_from(running), label="rid")))

    @precondition(lambda self: self.checker is not None and bool(self.checker.history.finished))
    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        assert self.checker is not None
        known = [r.prompt for r in self.checker.history.all_requests()] + self.prefixes
        base = data.draw(st.sampled_from(known), label="probe base")
        extra = data.draw(st.lists(TOKENS, max_size=self.cfg.scheduler_block_size), label="probe extension")
        self._do(Probe(tuple(base) + tuple(extra)))

    @precondition(lambda self: self.checker is not None and self.checker.history.tick % 5 == 4)
    @rule(data=st.data())
    def maintenance(self, data: st.DataObject) -> None:
        """Rare pool-wide operations: reset the prefix cache, evict blocks."""
        if data.draw(st.integers(0, 3), label="reset?") == 0:
            self._do(ResetPrefixCache())
            return
        ids = data.draw(
            st.lists(st.integers(1, self.cfg.num_blocks - 1), min_size=1, max_size=3, unique=True),
            label="blocks",
        )
        self._do(EvictBlocks(tuple(ids)))


class ConnectorMachine(AllocatorMachine):
    """`AllocatorMachine` plus a KV connector's operations (`model.machine.connector`), drawn
    where the configuration has one (`Config.kv_connector`): an offer for a request
    waiting for admission, or the report of an async load in flight (ok, or failed
    one time in three); right after a step that ran sync loads, the blocks one failed
    on, two times in three (`_after_step`); an async load sharing a running request's
    blocks, reported failed on some (`shared_load`); a save at a request's finish, or its
    report (also of one finished while its load is in flight: held until both report).
    A separate class, so runs without a connector draw exactly as before."""

    def _connector_choices(self) -> tuple[list[str], list[str]]:
        """(requests an offer may name, loads in flight, finished requests' included)."""
        assert self.checker is not None
        model = self.checker.model
        offerable = self._requests(lambda r: not (r.running or r.load or r.num_computed))  # type: ignore[attr-defined]
        loading = self._requests(lambda r: r.load == "loading") + sorted(model.held)  # type: ignore[attr-defined]
        return offerable, loading

    @precondition(
        lambda self: self.checker is not None and self.cfg.kv_connector and any(self._connector_choices())
    )
    @rule(data=st.data())
    def connector(self, data: st.DataObject) -> None:
        offerable, loading = self._connector_choices()
        if loading and (not offerable or data.draw(st.booleans(), label="report a load?")):
            rid = data.draw(st.sampled_from(loading), label="rid")
            ok = data.draw(st.sampled_from([True, True, False]), label="load ok?")
            invalid = () if ok else self._failed_blocks(data, rid)
            self._do(Loaded(rid, ok or bool(invalid), invalid))
            return
        rid = data.draw(st.sampled_from(offerable), label="rid")
        assert self.checker is not None
        model = self.checker.model
        size = model.requests[rid].num_tokens
        tokens = data.draw(st.integers(1, size + self.cfg.scheduler_block_size), label="offered tokens")
        self._do(Offer(rid, tokens, data.draw(st.sampled_from(LOAD_MODES), label="load")))
        if not data.draw(st.sampled_from([True, True, True, False]), label="admit it now?"):
            return
        # The offer's whole life at once: its admission, its load's report, its promotion.
        self._admission_step(data, rid)
        if rid not in model.requests or model.requests[rid].load != "loading":  # type: ignore[attr-defined]
            return
        # One group: a failure may name blocks (`_failed_blocks`), so failures come twice as often.
        outcomes = ["ok", "failed", "finished first"] + ["failed"] * (len(self.cfg.groups) == 1)
        outcome = data.draw(st.sampled_from(outcomes), label="load outcome")
        if outcome == "finished first":  # its free waits for the report (and a save's, if saved)
            if data.draw(st.booleans(), label="saved too?"):
                self._do(Save(rid))
            self._do(Finish(rid))
            if rid in model.sending and data.draw(st.booleans(), label="the save reports first?"):
                self._do(Saved(rid))
        invalid = self._failed_blocks(data, rid) if outcome == "failed" else ()
        self._do(Loaded(rid, outcome != "failed" or bool(invalid), invalid))
        if rid in model.requests and not model.requests[rid].running:  # type: ignore[attr-defined]
            self._step_with(data, (rid,), 64)

    def _admission_step(self, data: st.DataObject, rid: str) -> None:
        """The step admitting `rid` with its offer: for a sync load, three times in four
        where there is room, with a new request extending its prompt by more than the
        step's budget after it (it may hit `rid`'s blocks; its prefill stays unfinished);
        else alone, or one time in two with the other waiting requests after it. Then
        what may follow."""
        assert self.checker is not None
        model = self.checker.model
        others = self._requests(lambda r: not (r.running or r.load or r.num_computed))  # type: ignore[attr-defined]
        others = [o for o in others if o != rid]
        sbs = self.cfg.scheduler_block_size
        offer = model.requests[rid].offer  # type: ignore[attr-defined]
        extend = (
            len(model.requests) < 4
            and offer is not None
            and not offer[1]  # a sync load caches its blocks at once: they may be hit
            and data.draw(st.integers(0, 3), label="a request extending its prompt?") > 0
        )
        if extend:
            extra = data.draw(st.lists(TOKENS, min_size=4 * sbs + 1, max_size=5 * sbs), label="extension")
            others.append(f"r{self.next_rid}")
            self.next_rid += 1
            self._do(extending(others[-1], model.requests[rid].prompt, tuple(extra)))
        if extend:
            self._step_with(data, (rid, others[-1]), 4 * sbs)
        elif others and data.draw(st.booleans(), label="others in its step?") is True:
            budget = data.draw(st.sampled_from([sbs, 2 * sbs, 3 * sbs]), label="step budget")
            self._step_with(data, (rid, *others), budget)
        else:
            self._step_with(data, (rid,), 64)
        self._after_step(data)

    def _step_with(self, data: st.DataObject, rids: tuple[str, ...], budget: int) -> None:
        """A directed step over `rids` with `budget`; where the engine decides every step,
        the engine's own step (`_engine_step`) instead."""
        if self.engine:
            self._engine_step(data)
        else:
            self._do(Step(rids, budget))

    def _after_step(self, data: st.DataObject) -> None:
        """Right after a step that ran sync loads (and, one time in two, the samples of the
        step's other requests): two times in three, the step's output reports blocks one of
        them failed on (`model.machine.connector.sync_load_failed`)."""
        assert self.checker is not None
        model = self.checker.model
        report = model.sync_report
        if report is None:
            return
        # Other requests of the step awaiting their samples: one time in two sampled first, their
        # tokens riding on the same output (`model.machine.failed_blocks.sample_rides`).
        owing = [r for r in model.undelivered if r not in report.loads and model.requests[r].awaits_sample]
        if len(owing) > 0 and data.draw(st.booleans(), label="their samples first?"):
            for rid in owing:
                self._do(self._sample(rid, data))
            report = model.sync_report
            if report is None:
                return
        loads = [r for r in report.loads if failable_blocks(model, model.requests[r])]
        if not loads or not data.draw(st.integers(0, 2), label="sync load failed on some blocks?"):
            return
        rid = data.draw(st.sampled_from(loads), label="rid")
        self._do(Loaded(rid, True, self._some_blocks(data, failable_blocks(model, model.requests[rid]))))

    def _failed_blocks(self, data: st.DataObject, rid: str) -> tuple[int, ...]:
        """For a failed load of `rid`: the blocks it failed on, where some may be named
        (`model.machine.failed_blocks.failable_blocks`: one group), three times in four; else () (the
        whole load failed). Mostly one block, so that a cut often keeps a prefix."""
        assert self.checker is not None
        req = self.checker.model.requests.get(rid)
        blocks = failable_blocks(self.checker.model, req) if req is not None else []
        if not blocks or not data.draw(st.integers(0, 3), label="failed on some blocks?"):
            return ()
        return self._some_blocks(data, blocks)

    def _some_blocks(self, data: st.DataObject, blocks: list[int]) -> tuple[int, ...]:
        """One or two of `blocks`, three times in four among those another request holds
        too, if any (the requests holding them are cut as well: `model.machine.connector`)."""
        assert self.checker is not None
        shared = [b for b in blocks if self.checker.model.pool.ref[b] > 1]
        if shared and data.draw(st.integers(0, 3), label="a block another request holds?") != 0:
            blocks = shared
        return tuple(data.draw(st.lists(st.sampled_from(blocks), min_size=1, max_size=2, unique=True)))

    @precondition(
        lambda self: (
            self.checker is not None
            and self.cfg.kv_connector
            and len(self.cfg.groups) == 1
            and len(self.checker.model.requests) < 5
            and bool(self._requests(lambda r: r.running))  # type: ignore[attr-defined]
        )
    )
    @rule(data=st.data())
    def shared_load(self, data: st.DataObject) -> None:
        """An async load sharing a running request's blocks (one group, where a load may
        fail on blocks): a new request extending the prompt of a running one (sampled
        first if it awaits its sample) is offered its tokens and admitted; it hits the
        running request's blocks (and those of earlier such loads, running or still
        loading), and its load reports, failed on some blocks where any may be named
        (`model.machine.failed_blocks.failable_blocks`: under "recompute" the shared ones too, which
        cut the requests holding them as well, the first in queue order at the block),
        else ok, and one time in two it is promoted at once; one time in three it stays
        in flight (reported by `connector`), so a later load may share its blocks while
        it waits. One time in two every request awaiting its sample is sampled first
        (a failed block it would be cut on may not be named: `model.machine.connector`)."""
        assert self.checker is not None
        model = self.checker.model
        base = model.requests[data.draw(st.sampled_from(self._requests(lambda r: r.running)), label="base")]  # type: ignore[attr-defined]
        if base.awaits_sample:
            self._do(self._sample(base.rid, data))
        if data.draw(st.booleans(), label="sample every request awaiting its sample?"):
            for other in self._requests(lambda r: r.awaits_sample):  # type: ignore[attr-defined]
                self._do(self._sample(other, data))
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        extra = data.draw(
            st.lists(TOKENS, min_size=1, max_size=2 * self.cfg.scheduler_block_size), label="extension"
        )
        # Without `base`'s identity (`extending` would share its blocks: conformance's open gap).
        self._do(AddRequest(rid, base.prompt + tuple(extra)))
        self._do(Offer(rid, len(base.prompt) + len(extra), "async"))
        self._step_with(data, (rid,), 64)
        if rid in model.requests and model.requests[rid].load == "loading":  # type: ignore[attr-defined]
            if not data.draw(st.sampled_from([True, True, False]), label="report it now?"):
                return
            blocks = failable_blocks(model, model.requests[rid])
            self._do(Loaded(rid, True, self._some_blocks(data, blocks) if blocks else ()))
            if rid in model.requests and data.draw(st.booleans(), label="promote it now?"):
                self._step_with(data, (rid,), 64)  # running, it holds the shared blocks too

    @precondition(
        lambda self: (
            self.checker is not None
            and self.cfg.kv_connector
            and self.checker.history.tick % 2 == 0
            and bool(self.checker.model.requests or self.checker.model.sending)
        )
    )
    @rule(data=st.data())
    def save(self, data: st.DataObject) -> None:
        """A saving connector (`Save`, `Saved`): a pending save reports, or a live
        request is to be saved at its finish, finished now one time in two (its
        free then waits for the report)."""
        assert self.checker is not None
        model = self.checker.model
        sending = sorted(model.sending)
        if sending and (not model.requests or data.draw(st.booleans(), label="report a save?")):
            self._do(Saved(data.draw(st.sampled_from(sending), label="rid")))
            return
        rid = data.draw(st.sampled_from(sorted(model.requests)), label="rid")
        self._do(Save(rid))
        if data.draw(st.booleans(), label="finish it now?"):
            self._do(Finish(rid))


def extending(rid: str, prompt: tuple[int, ...], extra: tuple[int, ...]) -> AddRequest:
    """The add of a request extending `prompt` by `extra` under `prompt`'s identity (its
    salt, adapter and items), so that it shares the blocks that prompt's request holds."""
    ident = identity_of(prompt)
    mm = tuple((m.identifier, m.offset, m.length) for m in ident.mm)
    return AddRequest(rid, tuple(prompt) + extra, salt=ident.salt, lora=ident.lora, mm=mm)


def engine_caps(config: Config, data: st.DataObject) -> Config:
    """`config` with batch caps for an engine that decides every step, where it states
    none (`Config.max_num_batched_tokens` 0): a token budget that binds (3, one or two
    scheduler blocks, four, or 64 tokens) and one time in two a `max_num_seqs` of 1 to 4,
    as vLLM accepts them (`model.contract.config`: the budget above the lookahead tokens and at
    least `max_num_seqs`)."""
    if config.max_num_batched_tokens:
        return config
    sbs = config.scheduler_block_size
    budgets = [b for b in (3, sbs, 2 * sbs, 4 * sbs, 64) if b > config.num_lookahead_tokens]
    budget = data.draw(st.sampled_from(budgets or [config.num_lookahead_tokens + sbs]), label="engine budget")
    seqs = data.draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4]), label="max_num_seqs")
    return config.with_(max_num_batched_tokens=budget, max_num_seqs=min(seqs, budget))


def build_machine(
    target_factory: Callable[[Config], Target],
    config_strategy: st.SearchStrategy[Config],
    stats: FuzzStats | None = None,
    tolerated: Tolerance | None = None,
    connector: bool = False,
) -> type[AllocatorMachine]:
    """A state machine class that judges targets built by `target_factory`: the
    subclass of `AllocatorMachine` binding this run's settings (see its docstring);
    `connector`: of `ConnectorMachine`, with a KV connector's operations."""
    bound: dict[str, object] = {
        "target_factory": staticmethod(target_factory),
        "config_strategy": config_strategy,
        "run_stats": stats if stats is not None else FuzzStats(),
        "__module__": __name__,
        "__qualname__": "AllocatorMachine",
    }
    if tolerated is not None:
        bound["tolerated"] = staticmethod(tolerated)
    base = ConnectorMachine if connector else AllocatorMachine
    return type("AllocatorMachine", (base,), bound)
