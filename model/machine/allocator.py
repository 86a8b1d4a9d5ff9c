"""AllocatorModel: the executable specification of a hybrid prefix-caching allocator.

It applies the operations of `model.contract.ops` and predicts, exactly, what vLLM
0.33.0's `KVCacheManager` does for the configurations kvretain generates
(docs/semantics.md): block ids per group, hit lengths and the shared-prefix
junction, ref counts, the hash map, the free-queue order per tier, allocation
failures and KV events. Speed is not a goal: lists, sets and brute force (the
free queue is the one exception: `model.contract.free_queue.LinkedFreeQueue`, checked
against the list definition, so that 156k-block pools stay usable).

The state it keeps per request and per KV cache group (mirroring vLLM's
single-type managers): `model.machine.state`. Which blocks an allocation caches, and
under which keys: `model.machine.caching`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from model.contract.config import Config, GroupSpec, validate
from model.contract.eagle import LOOKAHEAD_HIT, hashed_tokens
from model.contract.fine_mamba import (
    Copy,
    KeyLayout,
    coarse_keys,
    ends_inside_block,
    fine_full_hit,
    fine_hits_enabled,
    fine_mamba_hit,
    is_fine_lookup,
    retained_endpoints,
)
from model.contract.hybrid_hit import HitRules, reconcile
from model.contract.kinds import rules_for
from model.contract.load_states import LOADING
from model.contract.lookup import full_hit, mamba_hit, swa_hit
from model.contract.masks import cdiv, swa_tail_blocks
from model.contract.observation import (
    Done,
    Observation,
    ProbeResult,
    Queues,
    ResetResult,
    ScheduleResult,
    Snapshot,
    StepResult,
    Tokens,
    block_key,
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
from model.contract.profile import MODELED, Profile, rules_of
from model.machine import connector as conn
from model.machine import failed_blocks as fb
from model.machine.async_scheduling import (
    InFlight,
    caching_limit,
    draft_slots,
    fenced_tables,
    fenced_victim,
    processed_limit,
    scheduler_position,
)
from model.machine.block_counts import BlockCounts, one_state
from model.machine.caching import BlockCaching
from model.machine.connector import NO_LOAD, Load, external_tokens
from model.machine.mamba_states import MambaStates
from model.machine.pool import Pool
from model.machine.seams import UNOBSERVED, Decision, Observer
from model.machine.state import GroupState, RequestState, SyncReport
from model.policy import admission as adm
from model.policy.queues import QueueOrder, StepQueues
from model.policy.scheduling import StepChunks, long_prefill_cap
from model.policy.spec_decode import PLACEHOLDER, acceptable, padded_admission, verified_drafts

Ids = tuple[int, ...]
Blocks = tuple[Ids, ...]  # block ids per group


class AllocatorModel(BlockCaching, BlockCounts, MambaStates, StepChunks):
    """The specification as a state machine: `apply` an operation, read its observation.

    Public, for the harness, the explorer and the exporter (documented seams; the rest is its own):
    - `requests`: the live requests by id (`RequestState`: prompt, outputs,
      computed tokens, running, junction); read-only;
    - `observer`: who hears of the rules only some traces reach, of each scheduler
      decision (`Decision`), and chooses where the contract leaves an order open
      (`model.machine.seams.Observer`; the model keeps no state for it);
    - `snapshot()`, and read-only `cfg`, `profile`, `rules`, `pool`, `groups`,
      `in_flight` (None, or with `async_scheduling` the outputs a one-step-ahead
      scheduler has not processed: `model.machine.async_scheduling`).
    """

    def __init__(
        self,
        config: Config,
        events: str = "seed",
        profile: Profile = MODELED,
        num_spec_tokens: int = 0,
        *,
        async_scheduling: bool = False,
        observer: Observer | None = None,
    ) -> None:
        self.cfg = validate(config)
        self.observer: Observer = UNOBSERVED if observer is None else observer
        self.num_spec_tokens = num_spec_tokens  # drafts a step verifies (`model.policy.spec_decode`); 0: none
        self.cap = (
            0  # the long-prefill cap of the step being scheduled (`model.policy.scheduling.StepChunks`)
        )
        # Async scheduling (vLLM `AsyncScheduler`): a sampled token reaches the scheduler a step late.
        self.in_flight = InFlight.fenced(config.kv_connector) if async_scheduling else None
        self.profile = profile  # the release's design of the time (model.contract.profile); default 0.33.0
        # The rule of each mechanism for that release: the model composes these, never reads a switch.
        self.rules = rules_of(profile)
        self.pool = Pool(
            config.num_blocks,
            config.hash_block_size,
            config.enable_caching,
            events,
            caching_off_to_head=self.rules.caching_off.to_head,
            groups=config.groups,  # the spec kind and window of each group's events
            lookahead=config.hash_lookahead,
        )
        self.groups = [GroupState(i, g) for i, g in enumerate(config.groups)]
        self.requests: dict[str, RequestState] = {}
        # Finished while their load was in flight: their blocks wait for `Loaded` (`model.machine.connector`).
        self.held: set[str] = set()
        # The connector saves these at their finish; finished, their blocks wait for `Saved`.
        self.saving: set[str] = set()
        self.sending: set[str] = set()
        # rid -> the latest step's tokens, output undelivered; `step_shares`: all its shares (`_output`).
        self.undelivered: dict[str, int] = {}
        self.step_shares: frozenset[str] = frozenset()
        # The latest step's sync loads, until the next operation (`model.machine.state.SyncReport`).
        self.sync_report: SyncReport | None = None
        self.order = QueueOrder()  # `running` and `holding` between steps (`model.policy.queues`)
        self.step_rids: tuple[
            str, ...
        ] = ()  # the requests of the step being scheduled (`model.policy.admission`)
        self.hybrid = len(config.groups) > 1
        self.fine = fine_hits_enabled(config)
        self.alignment = config.hash_block_size if self.fine else config.scheduler_block_size
        self.hit_rules = HitRules(
            self.cfg,
            looks_past=self.rules.looks_past,
            margin_reach=self.rules.margin_reach,
            full_bound=self.rules.full_bound,
            junction=self.rules.junction,
        )

    # ------------------------------------------------------------------ ops
    def apply(self, op: Op) -> Observation:
        # Only the operation right after a step (or its samples) may report its sync loads' failed blocks.
        report, self.sync_report = fb.turn(self, op), None
        if isinstance(op, AddRequest):
            assert op.rid not in self.requests, f"request {op.rid} already exists"
            self.requests[op.rid] = RequestState(op.rid, op.tokens())
            self.order.arrived(op.rid)
            return Done()
        if isinstance(op, Schedule):
            self._new_step()
            result = self._schedule(self.requests[op.rid], op.budget)
            result = replace(result, copies=self._take_copies())
            self._output(((op.rid, result),))
            self.order.scheduled(op.rid, self.requests[op.rid].running, self.requests[op.rid].holding)
            self.outputs_arrive({op.rid: result.scheduled})
            return result
        if isinstance(op, Step):
            assert all(rid in self.requests for rid in op.rids), f"unknown request in {op.rids}"
            step = self._step(op.rids, op.budget)
            step = replace(step, copies=self._take_copies())
            self._output(step.results)
            self.order.stepped(op.rids, step.queues)
            self.outputs_arrive({rid: r.scheduled for rid, r in step.results})
            return step
        if isinstance(op, Sample):
            req = self.requests[op.rid]
            self.sync_report = fb.sample_rides(self, op.rid, report)
            rejected = self._sample(req, op)
            if self.in_flight is not None and not self.in_flight.sampled(op.rid, op.accepted, rejected):
                self._token_arrives(req, 0)
            return Done()
        if isinstance(op, Finish):
            return conn.finish(self, self.requests.pop(op.rid))
        if isinstance(op, Offer):
            conn.offer(self.requests[op.rid], op.num_tokens, op.load == "async")
            return Done()
        if isinstance(op, Loaded):  # a report: processes the latest step's output (`model.machine.connector`)
            return conn.loaded(self, op.rid, op.ok, op.invalid, report)
        if isinstance(op, Save):
            assert op.rid in self.requests, f"saving unknown request {op.rid}"
            self.saving.add(op.rid)
            return Done()
        if isinstance(op, Saved):
            self.outputs_arrive(None)  # a report: the latest step's output is processed first
            self.undelivered = {}  # the report comes with the last step's output (`model.machine.connector`)
            conn.saved(self, op.rid)
            return Done()
        if isinstance(op, Preempt):
            assert self.requests[op.rid].running, f"preempting {op.rid}, which is not running"
            self._preempt(op.rid)
            self.order.preempted(op.rid)
            return Done()
        if isinstance(op, Probe):
            layouts, hit, spb = self._find_hit(op.tokens)
            return ProbeResult(hit, spb, self._hit_blocks(op.tokens, layouts))
        if isinstance(op, ResetPrefixCache):
            return ResetResult(self.pool.reset_prefix_cache())
        if isinstance(op, EvictBlocks):
            self.pool.evict_blocks(op.block_ids)
            return Done()
        raise TypeError(f"unknown operation {op!r}")

    def engine_queues(self) -> Queues:
        """The queues an engine's next step starts from, every live request in them front
        to back (`model.policy.queues.QueueOrder.engine_order`): the order a step the engine
        decides names its requests in (`Step.rids`: running, holding, then waiting)."""
        reqs = self.requests

        def state(rid: str) -> str:
            r = reqs[rid]
            return "running" if r.running else "holding" if r.holding else "waiting"

        return self.order.engine_order(reqs, state)

    def snapshot(self) -> Snapshot:
        events = tuple(self.pool.events)
        self.pool.events.clear()
        tables = fenced_tables(self.in_flight, len(self.groups))  # model.machine.async_scheduling, 6
        for rid in sorted({r for g in self.groups for r, t in g.tables.items() if t}):
            tables[rid] = tuple(tuple(g.tables.get(rid, ())) for g in self.groups)
        return Snapshot(
            free_queue=tuple(self.pool.queue.blocks),
            pinned_queue=tuple(self.pool.pinned_tier.blocks),
            ref_cnt=tuple(self.pool.ref),
            pinned=frozenset(self.pool.pinned),
            cached={k: tuple(v) for k, v in self.pool.cached.items()},
            block_hash=dict(self.pool.primary),
            tables=tables,
            events=events,
        )

    # ----------------------------------------------------------- scheduling
    def _new_step(self) -> None:
        for g in self.groups:
            g.cached_this_step.clear()

    def _output(self, results: tuple[tuple[str, ScheduleResult], ...]) -> None:
        """The latest step's output, undelivered: its shares and its sync loads (`model.machine.connector`)."""
        self.undelivered = {rid: r.scheduled for rid, r in results if r.scheduled}
        self.step_shares, self.sync_report = frozenset(self.undelivered), fb.note_step(results)

    def outputs_arrive(self, scheduled: dict[str, int] | None, cut: Callable[[], set[str]] = set) -> None:
        """Async scheduling: a step was scheduled (None: a connector's report), so the previous step's
        output is processed: fenced frees due, then sampled tokens arrive, but those of the requests
        a failed load's `cut`, made between, names (`model.machine.connector`; `model.machine.async_scheduling`)."""
        if self.in_flight is None:
            return
        arrived, due = self.in_flight.scheduled(scheduled)
        if due:
            self.observer.fired("async + connector: fenced frees returned as the step's output was processed")
        for blocks in due:
            self.pool.free(reversed(blocks))
        skip = cut()
        for rid, since in (a for a in arrived if a[0] not in skip):
            self._token_arrives(self.requests[rid], since)

    def _take_copies(self) -> tuple[Copy, ...]:
        """The step's copies; their endpoints' extra references released (`Scheduler.schedule`)."""
        copies = tuple(c for g in self.groups for c in g.copies)  # manager by manager
        for g in self.groups:
            g.copies.clear()
        retained = retained_endpoints(list(copies)) if copies else []
        if retained and not (self.in_flight is not None and self.in_flight.holds_copies(retained)):
            self.pool.free(retained)
        return copies

    def _sample(self, req: RequestState, op: Sample) -> int:
        """Accepted drafts and the token appended, rejected ones rolled back, blocks cached
        (`model.policy.spec_decode`; under async scheduling the drafts fill k slots and the
        caching waits for the arrival: `model.machine.async_scheduling`). Returns the rejected drafts."""
        assert req.awaits_sample and op.accepted <= acceptable(req.verifying), f"{op.rid}: no such sample"
        assert len(op.drafts) <= self.num_spec_tokens, f"{op.rid}: more drafts than num_spec_tokens"
        rejected = len(req.verifying) - op.accepted
        req.num_computed -= rejected
        req.outputs.extend((*req.verifying[: op.accepted], op.token))
        req.verifying, req.drafts = (), op.drafts
        if self.in_flight is not None:
            req.drafts = draft_slots(op.drafts, self.num_spec_tokens)
        elif self.num_spec_tokens and not fb.output_waits(self, req, op.accepted, rejected):
            fb.deliver(self, req)  # its step output comes with it (`model.machine.connector`)
        return rejected

    def ran(self, req: RequestState, n: int) -> None:
        """`req` computes `n` more tokens this step: the drafts they reach are verified."""
        req.verifying = verified_drafts(req.drafts, req.num_computed, req.num_tokens, n)
        if len(req.verifying) < len(req.drafts):
            self.observer.fired("drafts cut by the step's budget")
        req.drafts = ()
        req.num_computed += n
        req.prefill_chunk = req.num_computed < req.num_tokens

    def _schedule(self, req: RequestState, budget: int) -> ScheduleResult:
        self.cap = 0  # one request queued: no long-prefill cap
        self.step_rids = (req.rid,)
        if req.running:
            result = self._continue(req, budget, budget)
        else:
            result = conn.wait_turn(self, req, budget, budget) or ScheduleResult(0, False)
        conn.settle_prefill(self, [req.rid])
        return result

    def _continue(self, req: RequestState, left: int, budget: int) -> ScheduleResult:
        n = self._next_chunk(req, left, budget)
        if n <= 0:
            return ScheduleResult(scheduled=0, admitted=False)
        new = self.allocate_slots(req, n, 0, None)
        if new is None:
            return ScheduleResult(scheduled=0, admitted=False)
        self.ran(req, n)
        return ScheduleResult(scheduled=n, admitted=False, new_blocks=new)

    def admit(
        self, req: RequestState, left: int, budget: int, ran_running: bool = False, ran_prefill: bool = False
    ) -> ScheduleResult:
        """Admit a waiting request: lookup (and the connector's offer: `model.machine.connector`),
        then its first chunk of at most `left` tokens, or its async load (`ran_running`,
        `ran_prefill`: the step ran a request, a prefill chunk; `model.policy.spec_decode`)."""
        layouts, hit, spb = self._find_hit(req.tokens, req.num_tokens - 1)
        hit_blocks = self._hit_blocks(req.tokens, layouts)
        req.shared_prefix_boundary = spb
        if hit % self.cfg.scheduler_block_size:
            self.observer.fired("fine-grained hit (inside a scheduler block)")
        if hit and self.cfg.hash_lookahead:
            self.observer.fired(LOOKAHEAD_HIT)
        ext = external_tokens(req.offer[0], req.num_tokens, hit) if req.offer else 0
        load_async = ext > 0 and req.offer is not None and req.offer[1]
        computed = hit + ext
        result = ScheduleResult(0, False, hit, spb, hit_blocks, None)
        # External tokens count as a hit would; an async load computes nothing now (`model.machine.connector`).
        todo = 0 if load_async else req.num_tokens - computed
        pad = padded_admission(todo, self.num_spec_tokens, computed, ran_running, ran_prefill)
        if pad and 1 + pad > left:
            return result  # vLLM prefers not scheduling to scheduling unpadded
        n = (
            0
            if load_async
            else self.chunk(
                req, computed, min(self.long_prefill_capped(req.num_tokens - computed + pad), left), budget
            )
        )
        if pad and 0 < n != 1 + pad:
            n, pad = 1, 0  # a Mamba split clipped the padding: drop it
        if n <= 0 and not load_async:
            return result
        reserve = conn.async_load_reserve(self) if load_async else 0
        # External tokens past a hit ending inside a scheduler block replace its tail (`model.machine.connector`).
        local, local_blocks = conn.superseded_tail(self, hit, hit_blocks, ext)
        new = self.allocate_slots(req, n, local, local_blocks, Load(computed - local, load_async, reserve))
        if new is None:
            return result
        req.offer, req.num_computed, req.prefilling = None, computed + n, computed + n < req.num_tokens
        if ext:
            self.observer.fired(f"connector: {'async' if load_async else 'sync'} external hit admitted")
        if load_async:
            req.load, req.holding = LOADING, True  # waits for `Loaded`; cached at its promotion
            return replace(result, external=ext)
        req.running, req.holding = True, False
        req.prefill_chunk = req.num_computed < req.num_tokens
        req.verifying = (PLACEHOLDER,) * pad
        if pad:
            self.observer.fired("one-token admission padded with draft slots")
        return ScheduleResult(n, True, hit, spb, hit_blocks, new, external=ext)

    def _step(self, rids: tuple[str, ...], budget: int) -> StepResult:
        """One scheduler step over a batch: vLLM `sched/scheduler.py` `Scheduler.schedule`, FCFS.

        Running requests go first, in queue order. One whose allocation fails
        preempts the last running request and retries (preempting itself ends
        the running pass): the newest request gives way to the older ones.
        Waiting requests are admitted only if nobody was preempted (the blocks
        just freed are for the running ones), and a failed admission ends the
        step: a younger request never overtakes an older one (`waiting_pass`).
        The order the step leaves the queues in: `model.policy.queues`.
        """
        self._new_step()
        self.cap = long_prefill_cap(self.cfg.long_prefill_token_threshold, len(rids))
        self.step_rids = rids
        running = [rid for rid in rids if self.requests[rid].running]
        waiting = [rid for rid in rids if not self.requests[rid].running]
        holding = [rid for rid in waiting if self.requests[rid].holding]
        queues = StepQueues(running, holding, [rid for rid in waiting if rid not in holding])
        results: list[tuple[str, ScheduleResult]] = []
        preempted: list[str] = []
        left = budget
        ran_prefill = False
        i = 0
        while i < len(running) and left > 0:
            req = self.requests[running[i]]
            n = self._next_chunk(req, left, budget)
            if n <= 0:  # nothing to compute now (a Mamba chunk that rounds to 0): skip, keep going
                results.append((req.rid, ScheduleResult(0, False)))
                i += 1
                continue
            new = self.allocate_slots(req, n, 0, None)
            while new is None and not fenced_victim(self.in_flight, running[-1]):  # async_scheduling, 6
                self.observer.fired("preemption inside a step")
                victim = running.pop()
                self._preempt(victim)
                queues.preempted(victim)
                preempted.append(victim)
                if victim == req.rid:
                    break
                new = self.allocate_slots(req, n, 0, None)
            if new is None:  # it and the running requests after it (left only by a fenced victim) wait
                results += [(rid, ScheduleResult(0, False)) for rid in [req.rid, *running[i + 1 :]]]
                break
            ran_prefill |= req.prefill_chunk
            self.ran(req, n)
            left -= n
            results.append((req.rid, ScheduleResult(n, False, new_blocks=new)))
            i += 1
        if not preempted:
            ran_running = any(r.scheduled for _, r in results)
            conn.waiting_pass(self, queues, left, budget, results, (ran_running, ran_prefill))
        conn.settle_prefill(self, [rid for rid, r in results if r.scheduled])
        if len(results) > 1:
            self.observer.fired("step over several requests")
        if any(r.admitted for _, r in results) and any(not r.admitted and r.scheduled for _, r in results):
            self.observer.fired("admission after running chunks in one step")
        return StepResult(tuple(results), tuple(preempted), queues=queues.left())

    def _preempt(self, rid: str) -> None:
        """Free every block; the request waits again with its tokens (`Scheduler._preempt_request`)."""
        req = self.requests[rid]
        if self.in_flight is not None:
            self.in_flight.forget(rid)  # its in-flight output is stale: it caches nothing
        self.free(rid)
        req.running, req.num_computed, req.prefilling = False, 0, False
        req.drafts, req.verifying = (), ()
        self.observer.decided(Decision("preempt", rid))

    # --------------------------------------------------------------- lookup
    def _cached_fn(self, tokens: Tokens, gids: list[int], bs: int):  # type: ignore[no-untyped-def]
        seen: dict[int, bool] = {}  # the finders ask about a block many times: name it once
        L = self.cfg.hash_lookahead

        def cached(j: int) -> bool:
            if j not in seen:
                seen[j] = all(block_key(g, tokens, (j + 1) * bs, L) in self.pool.cached for g in gids)
            return seen[j]

        return cached

    def _finder(
        self, tokens: Tokens, spec: GroupSpec, gids: list[int], max_len: int, drop: bool, a: int
    ) -> tuple[KeyLayout, int]:
        """One spec group's hit: the key read at each table position, and its length in tokens."""
        bs = spec.block_size
        if is_fine_lookup(self.cfg, spec.kind, bs):
            hbs, L = self.cfg.hash_block_size, self.cfg.hash_lookahead

            def keyed(n: int) -> bool:
                return all(block_key(g, tokens, n, L) in self.pool.cached for g in gids)

            num_hashed = hashed_tokens(len(tokens), L) // hbs * hbs
            if spec.kind == "full":
                return fine_full_hit(keyed, max_len, bs, hbs, num_hashed, drop)
            return fine_mamba_hit(keyed, max_len, bs, hbs, num_hashed)
        cached = self._cached_fn(tokens, gids, bs)
        if spec.kind == "full":
            return coarse_keys(full_hit(cached, max_len, bs, a, drop), bs)
        if spec.kind == "swa":
            assert spec.sliding_window is not None
            need = swa_tail_blocks(spec.sliding_window, bs, drop)
            return coarse_keys(swa_hit(cached, max_len, bs, a, need, drop), bs)
        return coarse_keys(mamba_hit(cached, max_len, bs, a), bs)

    def _find_hit(self, tokens: Tokens, max_len: int | None = None) -> tuple[dict[int, KeyLayout], int, int]:
        """The prefix-cache hit for `tokens`: per-group layouts, the hit length every
        group can serve, and the shared-prefix boundary (0 when there is no junction).

        vLLM `kv_cache_coordinator.py` `find_longest_cache_hit` (unitary and hybrid).
        """
        if max_len is None:
            max_len = len(tokens) - 1  # the last token is always recomputed
        if not self.cfg.enable_caching or max_len <= 0:
            return {g.gid: [] for g in self.groups}, 0, 0
        if not self.hybrid:
            # One group: its own block size is the alignment and nothing can disagree with it.
            g = self.groups[0]
            layout, hit = self._finder(tokens, g.spec, [0], max_len, self.cfg.eagle_drop, g.bs)
            return {0: layout}, hit, 0
        return self._reconcile_hybrid_hit(tokens, max_len)

    def _reconcile_hybrid_hit(self, tokens: Tokens, max_len: int) -> tuple[dict[int, KeyLayout], int, int]:
        """The hybrid fixed point (`model.contract.hybrid_hit.reconcile`) over this model's finders."""

        def find(spec: GroupSpec, gids: list[int], limit: int, drop: bool) -> tuple[KeyLayout, int]:
            return self._finder(tokens, spec, gids, limit, drop, self.alignment)

        hbs = self.cfg.hash_block_size
        hashed_len = hashed_tokens(len(tokens), self.cfg.hash_lookahead) // hbs * hbs
        return reconcile([g.spec for g in self.groups], find, max_len, hashed_len, self.hit_rules)

    def _hit_blocks(self, tokens: Tokens, layouts: dict[int, KeyLayout]) -> tuple[tuple[int, ...], ...]:
        out = []
        for g in self.groups:
            blocks = []
            for n in layouts[g.gid]:
                b = (
                    None
                    if n is None
                    else self.pool.lookup(block_key(g.gid, tokens, n, self.cfg.hash_lookahead))
                )
                blocks.append(b or 0)
            out.append(tuple(blocks))
        return tuple(out)

    # ----------------------------------------------------------- allocation
    def allocate_slots(
        self, req: RequestState, n: int, hit: int, hit_blocks: Blocks | None, load: Load = NO_LOAD
    ) -> Blocks | None:
        """An allocation attempt (`_allocate`), told to the observer."""
        new = self._allocate(req, n, hit, hit_blocks, load)
        self.observer.decided(Decision("alloc", req.rid, n, hit_blocks is not None, new is not None))
        return new

    def _allocate(
        self, req: RequestState, n: int, hit: int, hit_blocks: Blocks | None, load: Load = NO_LOAD
    ) -> Blocks | None:
        """vLLM `KVCacheManager.allocate_slots` (order of effects matters); `load`: a
        connector's external tokens, delayed caching and reserve (`model.machine.connector`)."""
        ext, delay_cache, reserve = load
        rid = req.rid
        hits = hit_blocks if hit_blocks is not None and any(hit_blocks) else None
        # Async scheduling: the scheduler's count still holds an in-flight rejection.
        unrolled = self.in_flight.unrolled(rid) if self.in_flight is not None else 0
        local = scheduler_position(req.num_computed, unrolled) + hit
        total = min(local + ext, self.cfg.max_model_len)
        main = total + n
        # Speculative slots past the chunk: attention groups reserve them, Mamba (align)
        # sizes by `main` only (draft models have no Mamba layers).
        need_slot = min(main + conn.lookahead_slots(self, load), self.cfg.max_model_len)
        # The admission gates (`model.policy.admission`), the full sequence counted before anything is freed.
        admission = not req.running
        wm = adm.watermark_blocks(self.cfg.watermark, self.cfg.num_blocks)
        wm = wm if adm.watermark_applies(admission, self._any_running()) else 0
        if (
            admission
            and self.cfg.reserve_full_isl
            and not self._full_sequence_fits(req, hits, local, total, wm)
        ):
            self.observer.fired("admission refused: the whole sequence does not fit")
            return None
        unprocessed = self.in_flight.unprocessed(rid) if self.in_flight is not None else 0
        for g in self.groups:
            self.remove_skipped(g, rid, processed_limit(total, unprocessed))

        def count(physical: bool) -> int:
            return sum(
                self._blocks_to_allocate(
                    g, rid, need_slot, hits[g.gid] if hits else (), local, main, total, taken=physical
                )
                for g in self.groups
            )

        # The gates' count, and what the allocation takes (only a Mamba group's with external tokens differs).
        need = count(False)
        taken = count(True) if ext else need
        if not adm.chunk_fits(need, wm, self.pool.num_free(), reserve):
            if wm and adm.chunk_fits(need, 0, self.pool.num_free(), reserve):
                self.observer.fired("admission refused by the watermark")
            return None
        if taken > self.pool.num_free():
            # vLLM passes its gate on a count below what the admission takes and raises
            # (finding vllm-mamba-external-state-uncounted): predicted as a refusal.
            return None
        if wm and taken + wm > self.pool.num_free():
            # Passed on vLLM's count, the admission takes part of the watermark's headroom
            # (finding vllm-mamba-external-state-uncounted-watermark, `admission_keeps_watermark`).
            self.observer.fired("admission took the watermark's blocks (a Mamba external state uncounted)")
        if (hits is not None or ext) and not any(rid in g.num_cached for g in self.groups):
            for g in self.groups:
                self._add_hit_blocks(g, rid, hits[g.gid] if hits else (), local, total)
            for g in self.groups if ext else ():
                conn.add_external_blocks(self, g, rid, total, ext)
        new = tuple(tuple(self._allocate_new(g, rid, need_slot, main)) for g in self.groups)
        unknown = self.in_flight.unknown(rid) if self.in_flight is not None else 0
        if unknown:
            self.observer.fired("async: a step scheduled a sampled token's position ahead of it")
        if unrolled:
            self.observer.fired("async: a step allocated past drafts still to be rolled back")
        if self.cfg.enable_caching and not delay_cache:
            self.cache_blocks(
                req, caching_limit(total, n, req.num_tokens, unknown), self._hashed_known(req, unknown)
            )
        return new

    def _any_running(self) -> bool:
        """A request of the step being scheduled is running (its admissions so far included)."""
        return any(self.requests[r].running for r in self.step_rids if r in self.requests)

    def _full_sequence_fits(
        self, req: RequestState, hits: Blocks | None, local: int, total: int, wm: int
    ) -> bool:
        """`model.policy.admission.full_sequence_fits` for `req`'s admission: every group counts
        the whole sequence as it counts a chunk, a sliding-window group capped."""
        full = adm.full_sequence_tokens(req.num_tokens, self.cfg.max_model_len)
        blocks = sum(
            self._blocks_to_allocate(
                g,
                req.rid,
                full,
                hits[g.gid] if hits else (),
                local,
                full,
                total,
                self._admission_cap(g),
                True,
            )
            for g in self.groups
        )
        return adm.full_sequence_fits(blocks, wm, self.pool.num_free())

    def _admission_cap(self, g: GroupState) -> int | None:
        """A sliding-window group's full-sequence cap (`model.policy.admission.admission_cap_blocks`)
        over the tokens the engine built for this configuration keeps in flight."""
        if g.spec.kind != "swa":
            return None
        assert g.spec.sliding_window is not None
        in_flight = adm.in_flight_tokens(self.cfg, self.in_flight is not None)
        return adm.admission_cap_blocks(g.spec.sliding_window, g.bs, in_flight, self.cfg.max_model_len)

    def skipped_tokens(self, g: GroupState, computed: int) -> int:
        return rules_for(g.spec).skipped_tokens(g.spec, computed)  # model.contract.kinds

    def remove_skipped(self, g: GroupState, rid: str, computed: int) -> None:
        """Free blocks no future token of `rid` reads (out of window / stale state)."""
        skipped = self.skipped_tokens(g, computed)
        if one_state(g):
            table = g.table(rid)
            if skipped > 0:
                last = min(skipped // g.bs, len(table))
                first = self.rules.retirement(table, g.retired.get(rid, 0), last)  # model.contract.mamba
                if first < last:
                    freed = [table[i] for i in range(last - 1, first - 1, -1) if table[i]]
                    for i in range(first, last):
                        table[i] = 0
                    if freed:
                        self.pool.free(freed, append_all=self.rules.free_order.skipped_to_tail)
                    g.retired[rid] = last
            prev = g.last_state.get(rid)
            if prev is not None and prev < cdiv(computed, g.bs) - 1 and table[prev]:
                self.pool.free([table[prev]], append_all=self.rules.free_order.stale_state_to_tail)
                table[prev] = 0
            return
        if skipped <= 0:
            return
        table = g.table(rid)
        freed = []
        for i in range(min(skipped // g.bs, len(table)) - 1, -1, -1):
            if table[i] == 0:
                break
            freed.append(table[i])
            table[i] = 0
        if not freed:
            return
        if g.spec.kind == "swa" and self.cfg.pin_swa_on_drop and len(freed) >= self.cfg.pin_min_drop_blocks:
            assert g.spec.sliding_window is not None
            self.pool.pin(freed[: swa_tail_blocks(g.spec.sliding_window, g.bs, self.cfg.eagle_drop)])
        self.pool.free(freed, append_all=self.rules.free_order.skipped_to_tail)

    def _add_hit_blocks(
        self, g: GroupState, rid: str, hits: tuple[int, ...], local: int, computed: int | None = None
    ) -> None:
        table = g.table(rid)
        assert not table
        skipped = self.skipped_tokens(g, local if computed is None else computed) // g.bs
        kept = list(hits[skipped:]) if skipped > 0 else list(hits)
        if self.cfg.enable_caching:
            self.pool.touch(kept)
        table.extend([0] * max(skipped, 0) + kept)
        g.num_cached[rid] = len(table)
        if ends_inside_block(len(kept), local, g.bs):
            # Read only in part: the next allocation gives the request a private copy,
            # and caching resumes at that block once the copy is full.
            g.partial[rid] = (local // g.bs, kept[-1])
            g.num_cached[rid] = local // g.bs

    def _allocate_new(self, g: GroupState, rid: str, num_tokens: int, main: int) -> list[int]:
        table = g.table(rid)
        if not one_state(g):
            copied = []
            if rid in g.partial:
                copied = self.pool.get_new_blocks(1)
                self._consumer_copy(g, rid, copied[0])
            new = cdiv(num_tokens + g.bs * self.draft_blocks(g), g.bs) - len(table)
            if new <= 0:
                return copied
            blocks = self.pool.get_new_blocks(new)
            table.extend(blocks)
            return copied + blocks
        return self._allocate_state(g, rid, main)

    # ----------------------------------------------------------------- free
    def free(self, rid: str) -> None:
        tables = [g.tables.pop(rid, []) for g in self.groups]
        for g in self.groups:
            for d in (g.num_cached, g.last_state, g.retired, g.partial):
                d.pop(rid, None)
            g.allocated.discard(rid)
        if self.in_flight is not None and self.in_flight.holds(rid, tables):
            return  # its last step's output is unprocessed (model.machine.async_scheduling, 6)
        for g, table in zip(self.groups, tables):  # the pool skips null blocks
            append_all = g.spec.kind in self.rules.free_order.finished_to_tail  # model.contract.routing
            self.pool.free(reversed(table), append_all=append_all)
