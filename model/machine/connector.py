"""What a KV connector may do to the allocator: external hits, async loads, deferred frees, saves.

A KV connector holds KV outside the pool (vLLM `KVConnectorBase_V1`). kvretain states
its answers as operations (`model.contract.ops.Offer`, `Loaded`, `Save`, `Saved`); this module
states what the allocator must then do:

- **External hit.** An offer of the first `n` tokens adds `external_tokens(n,
  num_tokens, hit)` tokens past the local hit (never the last token). The admission
  holds the hit blocks, one fresh block per group for each external block inside its
  window, then the chunk's blocks, from `hit + ext`. A sync load caches them as a local
  hit would. An offer stands until the request's next admission succeeds.
- **Async load.** The admission allocates for the hit and the external tokens only,
  caches nothing, and leaves free what every in-flight prefill still needs
  (`async_load_reserve`); the request waits among the block holders until its load
  reports, then is cached and takes its next chunk without a lookup (`wait_turn`).
- **Failed load.** "recompute": nothing loaded is kept, the request is freed and
  admitted afresh; "fail": the report ends it with an error, freed as a finish is.
- **Deferred free.** A request finished while its load or its save is in flight keeps
  its blocks until that transfer reports, and until both have where both are (`finish`,
  `loaded`, `saved`); a finish first frees the blocks out of its windows.
- **Saves.** A finish hands the connector, per group, the blocks covering its computed
  tokens, nulls included (a Mamba group's whole table: `handed_blocks`).
- **Mamba (align).** External tokens give one block, the state after the last external
  token (`external_state_blocks`); the chunk's own state comes after it.
- **A hit's sub-block tail** is superseded by external tokens past it (`superseded_tail`).
- **Failed blocks**: `model.machine.failed_blocks`.

Where the machine predicts a vLLM policy rather than a contract (a promoted chunk's
padding and `UNSEEN_END`, the stale `is_prefill_chunk` of a cut request) or a
registered defect (a rolled-back load left in `kv_holding_waiting` and in the
reservation; the Mamba external-state counts), the function says so. vLLM 0.33.0's
order of effects, which this docstring no longer narrates: docs/semantics.md,
"vLLM 0.33.0's order, as the machine predicts it".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from model.contract.kinds import rules_for
from model.contract.load_states import FAILED, LOADED, LOADING
from model.contract.masks import cdiv
from model.contract.observation import BlockIds, Done, LoadCut, Saving, ScheduleResult
from model.machine.async_scheduling import Arriving, scheduler_position
from model.machine.failed_blocks import cut_covering, cut_scanned, deliver, riding_shares, scan_order
from model.machine.state import SyncReport
from model.policy.scheduling import seq_cap, seq_cap_reached
from model.policy.spec_decode import PLACEHOLDER, padded_admission

Blocks = tuple[tuple[int, ...], ...]  # block ids per group

if TYPE_CHECKING:
    from model.machine.seams import Machine
    from model.machine.state import GroupState, RequestState
    from model.policy.queues import StepQueues


class Load(NamedTuple):
    """An allocation's connector side (`KVCacheManager.allocate_slots` arguments):
    external tokens, `delay_cache_blocks`, `reserved_blocks`."""

    external: int = 0
    delay_cache: bool = False
    reserve: int = 0


NO_LOAD = Load()


def external_tokens(offered: int, num_tokens: int, hit: int) -> int:
    """Tokens an offer of the first `offered` tokens adds past a local hit of `hit`:
    never the request's last token (it is computed to sample the next one)."""
    return max(0, min(offered, num_tokens - 1) - hit)


def remaining_blocks(
    num_tokens: int,
    block_sizes: Iterable[int],
    held: Iterable[int],
    states: Iterable[bool] = (),
    copies: Iterable[bool] = (),
    spec_tokens: int = 0,
    draft_blocks: Iterable[int] = (),
) -> int:
    """Blocks a request holding `held` blocks per group still needs for its whole
    sequence (`Scheduler._request_remaining_blocks` for a request with blocks). A
    group flagged in `states` (Mamba, align) keeps one state at a time: it needs one
    more block at most (`MambaManager.get_num_blocks_to_allocate`'s cap), and one
    more where `copies` flags its own mid-block key awaiting its copy (`model.contract.fine_mamba`).
    With drafts every other group counts `spec_tokens` more tokens (a decode step's
    slots, `spec_step_tokens`); a group's `draft_blocks` (Mamba) count past its tokens."""
    sizes = list(block_sizes)
    one_state = list(states) + [False] * len(sizes)
    copy = list(copies) + [False] * len(sizes)
    drafts = list(draft_blocks) + [0] * len(sizes)
    needs = [
        max(cdiv(num_tokens + (0 if one else spec_tokens), bs) + d - h, 0)
        for bs, h, one, d in zip(sizes, held, one_state, drafts)
    ]
    return sum(min(n, 1) + c if one else n for n, one, c in zip(needs, one_state, copy))


def spec_step_tokens(m: Machine) -> int:
    """The slots one decode step takes with drafts: its token, the k drafts it verifies and
    the lookahead past them (`1 + num_spec_tokens + num_lookahead_tokens`); 0 without drafts."""
    return 1 + m.num_spec_tokens + m.cfg.num_lookahead_tokens if m.num_spec_tokens else 0


def spec_step_blocks(m: Machine) -> int:
    """Blocks one decode step's slots take in every group but Mamba's, which counts its
    draft blocks itself (`Scheduler._spec_decode_step_blocks`)."""
    step = spec_step_tokens(m)
    return sum(cdiv(step, g.bs) for g in m.groups if rules_for(g.spec).counts_step_slots) if step else 0


def async_load_reserve(m: Machine) -> int:
    """Free blocks an async load's admission must leave: what the in-flight prefills still
    need, and with drafts one decode step's slots, the lookahead it does not take now."""
    return in_flight_reserve(m) + spec_step_blocks(m)


def lookahead_slots(m: Machine, load: Load) -> int:
    """Lookahead slots an allocation reserves: none for an async load's admission (its
    forward pass comes after the load; the promoted chunk reserves them), else
    `num_lookahead_tokens`."""
    return 0 if load.delay_cache else m.cfg.num_lookahead_tokens


# ---------------------------------------------------------------- the contract, on `AllocatorModel`
# The model's steps call these (its own room: they read its state as its methods do).


def offer(req: RequestState, num_tokens: int, load_async: bool) -> None:
    """The connector holds the first `num_tokens` tokens of a waiting request and offers
    them at its next admission (`Offer`)."""
    assert not req.running and not req.load and not req.num_computed, f"{req.rid} is not waiting"
    req.offer = (num_tokens, load_async)


UNSEEN_END = ScheduleResult(0, False)
"""A turn that ends the step's admissions before any lookup or allocation: no scheduler
output shows it, so the step records nothing for it (`waiting_pass`; compared by identity)."""


def wait_turn(
    m: Machine, req: RequestState, left: int, budget: int, ran: tuple[bool, bool] = (False, False)
) -> ScheduleResult | None:
    """A waiting request's turn in a step's waiting pass (`model.machine.connector`): None
    when its load has not reported (passed over); a reported load is promoted
    first (cached, or freed when it failed); a request holding blocks takes its
    next chunk without a lookup, any other is admitted (`ran`: whether the step
    ran a request, a prefill chunk, for the admission's draft padding:
    `model.policy.spec_decode`)."""
    if req.load == LOADING:
        return None
    if req.load == FAILED:
        m.free(req.rid)
        req.num_computed = 0
        m.observer.fired("connector: failed load rolled back")
    elif req.load == LOADED and m.cfg.enable_caching:
        m.cache_blocks(req, req.num_computed)
        m.observer.fired("connector: async load cached at promotion")
    req.load = ""
    if not req.num_computed:
        return m.admit(req, left, budget, *ran)
    return promoted_chunk(m, req, left, budget, ran)


def promoted_chunk(
    m: Machine, req: RequestState, left: int, budget: int, ran: tuple[bool, bool]
) -> ScheduleResult:
    """The next chunk of a waiting request holding blocks (its load promoted): no lookup,
    the lookahead reserved, and, with drafts, a one-token chunk padded as an admission
    with a hit is (its computed tokens count as one: `padded_admission`); a padded chunk
    over `left`, or a Mamba split to nothing, ends the step's admissions."""
    todo = req.num_tokens - req.num_computed
    pad = padded_admission(todo, m.num_spec_tokens, req.num_computed, *ran)
    if pad and 1 + pad > left:
        return UNSEEN_END  # vLLM prefers not scheduling to scheduling unpadded
    n = m.chunk(req, req.num_computed, min(m.long_prefill_capped(todo + pad), left), budget)
    if pad and 0 < n != 1 + pad:
        n, pad = 1, 0  # a Mamba split clipped the padding: drop it
    if n <= 0:
        return UNSEEN_END
    new = m.allocate_slots(req, n, 0, None)
    if new is None:
        return ScheduleResult(0, False)
    req.running, req.holding = True, False
    m.ran(req, n)
    req.verifying = (PLACEHOLDER,) * pad
    if pad:
        m.observer.fired("connector: promoted one-token chunk padded with draft slots")
    return ScheduleResult(n, True, new_blocks=new)


def in_flight_reserve(m: Machine) -> int:
    """Blocks the in-flight prefills still need (with drafts one decode step past their
    sequence): an async load's admission leaves them free. A rolled-back load still
    counts (vLLM's `_inflight_prefills`; finding failed-load-rollback-reserves-against-itself)."""
    step = spec_step_tokens(m)
    total = 0
    for r in (r for r in m.requests.values() if r.prefilling):
        for g in m.groups:
            align = rules_for(g.spec).one_state(g.spec)
            drafts = m.draft_blocks(g)
            # A Mamba 'none' group counts its draft blocks as tokens (`MambaManager`, non-align).
            total += remaining_blocks(
                min(r.num_tokens, m.cfg.max_model_len),
                [g.bs],
                [len(g.tables.get(r.rid, ()))],
                [align],
                [r.rid in g.partial],
                step + (0 if align else g.bs * drafts),
                [drafts if align else 0],
            )
    return total


def settle_prefill(m: Machine, rids: list[str]) -> None:
    """A scheduled request that computed every known token is no longer an in-flight prefill."""
    for rid in rids:
        req = m.requests.get(rid)
        if req is not None and req.running and req.num_computed >= req.num_tokens:
            req.prefilling = False


def finish(m: Machine, req: RequestState) -> Done | Saving:
    """Free a finished request (`model.machine.connector`: with a connector the blocks out of
    the windows of its processed tokens go first; a load in flight keeps the rest
    until it reports, a save until it reports, both until both have reported)."""
    computed, processed = finish_tokens(m, req)
    if m.in_flight is not None:
        m.in_flight.forget(req.rid)  # its output in flight is dropped (`model.machine.async_scheduling`)
    if m.cfg.kv_connector:
        for g in m.groups:
            if g.tables.get(req.rid):
                m.remove_skipped(g, req.rid, processed)
    saves = req.rid in m.saving
    m.saving.discard(req.rid)
    seen: Done | Saving = Saving(handed_blocks(m, req, computed)) if saves else Done()
    if req.load == LOADING:
        m.held.add(req.rid)
        m.observer.fired("connector: free deferred until the load reports")
    if isinstance(seen, Saving) and any(seen.block_ids):
        m.sending.add(req.rid)
        m.observer.fired("connector: free deferred until the save reports")
        if req.rid in m.held:
            m.observer.fired("connector: free deferred until both the load and the save report")
    if req.rid not in m.held | m.sending:
        m.free(req.rid)
    return seen


def finish_tokens(m: Machine, req: RequestState) -> tuple[int, int]:
    """A finishing request's (computed, processed) tokens as `_connector_finished` reads
    them: computed, and computed less the tokens of the step whose output is undelivered
    (`num_in_flight_tokens`). Under async scheduling (`model.machine.async_scheduling`) the
    computed tokens still count the rejected drafts of a sample riding on that output
    (`scheduler_position`, 5), and the undelivered step is the latest one (3)."""
    if m.in_flight is None:
        return req.num_computed, max(req.num_computed - m.undelivered.get(req.rid, 0), 0)
    computed = scheduler_position(req.num_computed, m.in_flight.unrolled(req.rid))
    return computed, max(computed - m.in_flight.unprocessed(req.rid), 0)


def handed_blocks(m: Machine, req: RequestState, computed: int) -> tuple[BlockIds, ...]:
    """The block ids a finish hands the connector: per group those covering the
    `computed` tokens (a Mamba group's whole table: vLLM clips attention groups only)."""
    return tuple(
        tuple(t[: cdiv(computed, g.bs)] if rules_for(g.spec).hands_computed_only else t)
        for g in m.groups
        for t in [g.tables.get(req.rid, [])]
    )


def saved(m: Machine, rid: str) -> None:
    """The save of finished request `rid` reported: its blocks are freed now, unless
    its load is still in flight (then at the load's report)."""
    assert rid in m.sending, f"{rid} has no save pending"
    m.sending.discard(rid)
    if rid in m.held:
        return
    m.free(rid)
    m.observer.fired("connector: freed when the save reported")


def loaded(
    m: Machine, rid: str, ok: bool, invalid: tuple[int, ...] = (), report: SyncReport | None = None
) -> Done | LoadCut:
    """The async load of `rid` reported, failed on the blocks `invalid` names (if
    any: seen as the cut, `LoadCut`); a finished request's deferred free happens now.
    Right after the step that ran `rid`'s sync load (`report`), its failed blocks
    come with that step's output (`sync_load_failed`)."""
    if report is not None and rid in report.loads:
        return sync_load_failed(m, rid, invalid, report)
    m.outputs_arrive(None)  # async scheduling: the latest step's output is processed first
    riding = riding_shares(m)
    m.undelivered = {}  # the report comes with the last step's output
    if rid in m.held:
        m.held.discard(rid)
        if rid not in m.sending:  # a save still in flight keeps them
            m.free(rid)
        return Done()
    req = m.requests[rid]
    assert req.load == LOADING, f"{rid} has no load in flight"
    seen: Done | LoadCut = Done()
    cut: list[str] = []
    dependent: list[int] = []
    if invalid:
        m.undelivered = riding  # the shares it cuts come with it
        seen, cut, dependent = cut_scanned(m, rid, invalid)
        m.undelivered = {}
        m.observer.fired("connector: load failed on some blocks")
        for r in set(cut) & set(riding):
            m.requests[r].verifying = ()  # cut back past them: no sample will verify them
            m.observer.fired("connector: a request awaiting its sample holding a failed block cut")
    if (not ok or invalid) and m.cfg.kv_load_failure_policy == "fail":
        # The request ends with an error; its load has reported, so only a save waits.
        req.load = ""
        m.pool.evict_blocks(dependent)
        ended = end_all(m, sorted({rid, *cut}), last=rid)
        m.observer.fired("connector: failed load ends the request ('fail')")
        return replace(seen, ended=ended) if isinstance(seen, LoadCut) else seen
    if not ok:
        req.num_computed = 0  # nothing loaded counts (`Scheduler._handle_failed_recving`)
    req.load = LOADED if req.num_computed else FAILED
    if invalid and req.num_computed:
        m.observer.fired("connector: valid prefix of a load kept")
    return seen


def sync_load_failed(m: Machine, rid: str, invalid: tuple[int, ...], report: SyncReport) -> LoadCut:
    """The output of the step that ran `rid`'s sync load names the blocks `invalid` it
    failed on (`Scheduler._handle_invalid_blocks`): the async loads holding one are cut,
    then the running requests (`cut_covering`, in `scan_order`); the running ones lose
    the step's output (its tokens and samples). "recompute": the cut requests go on from
    their cut. "fail": the dependent blocks' hashes are evicted and the cut request
    ends with an error, freed as a finish is (its save, if any, deferred as usual),
    every cut request at once (`end_all`). The samples riding on the output are processed
    after the cut, but the cut requests': under async scheduling after its fenced frees
    (`model.machine.async_scheduling`), with drafts under synchronous scheduling their outputs
    having waited for it (`output_waits`)."""
    riders = {r: Arriving(n, j) for r, n, j in report.waiting}
    riders.update(m.in_flight.tokens if m.in_flight is not None else {})
    order = [r for r in m.undelivered if r in riders]  # the output's order
    made: list[tuple[LoadCut, list[str], list[int]]] = []

    def cut() -> set[str]:
        made.append(_sync_cut(m, rid, invalid, report, riders))
        return set(made[0][1])

    if m.in_flight is None:
        made_cut = cut()
        for r in [r for r in order if r not in made_cut]:
            deliver(m, m.requests[r])  # after the cut, as vLLM processes the output
    else:
        m.outputs_arrive(None, cut)
    seen, cut_rids, _ = made[0]
    if m.cfg.kv_load_failure_policy == "fail":
        seen = replace(seen, ended=end_all(m, cut_rids))
    return seen


def _sync_cut(
    m: Machine, rid: str, invalid: tuple[int, ...], report: SyncReport, riders: dict[str, Arriving]
) -> tuple[LoadCut, list[str], list[int]]:
    """`sync_load_failed`'s cut, on the scheduler's count (a riding sample's rejected drafts
    not rolled back yet, `riders`); "fail": the dependent blocks' hashes evicted. Returns
    what the report shows, the requests cut and the dependent blocks."""
    for r, a in riders.items():
        m.requests[r].num_computed += a.rejected
    loads, running = scan_order(m)
    before = {r: m.requests[r].num_computed for r in [*loads, *running]}
    cut, _ = cut_covering(m, loads, invalid)
    running_cut, dependent = cut_covering(m, running, invalid)
    cut += running_cut
    for r, a in riders.items():
        if r not in cut:
            m.requests[r].num_computed -= a.rejected  # the output rolls them back
    if report.sampled:
        m.observer.fired("connector: sync load's failed blocks with samples riding on the step's output")
    dropped = tuple(sorted(set(cut) & report.sampled))
    for r in dropped:
        m.requests[r].drop_outputs(riders[r].tokens if r in riders else 1)  # vLLM skips its output
        m.observer.fired("connector: a sample riding on a sync load's failed blocks dropped")
    m.undelivered = {}  # a cut request's `is_prefill_chunk` stays as its step set it
    m.observer.fired("connector: sync load failed on some blocks")
    # Every other request whose computed tokens the report changed: cut, or a rider's rejection rolled back.
    changed = sorted(r for r in before if r != rid and m.requests[r].num_computed != before[r])
    others = tuple((r, m.requests[r].num_computed) for r in changed)
    seen = LoadCut(m.requests[rid].num_computed, others, dropped=dropped)
    if len(cut) > 1:
        m.observer.fired("connector: a request sharing a failed block cut")
    if m.cfg.kv_load_failure_policy == "fail":
        m.pool.evict_blocks(dependent)
        m.observer.fired("connector: a sync load's failed blocks evicted ('fail')")
    return seen, cut, dependent


def end_all(m: Machine, rids: list[str], last: str = "") -> tuple[str, ...]:
    """End `rids` with an error at once ("fail"), each freed as a finish is (`last`, the
    async load whose report ends them, after the others), in the order the observer
    chooses (`model.machine.seams.Observer.order_to_end`: the judge's, the order the target ended
    them in) where it names exactly them, else in id order: any order is allowed (vLLM
    iterates a set of their ids). Returns the order taken."""
    chosen = m.observer.order_to_end(tuple(sorted(rids)))
    order = chosen if sorted(chosen) == sorted(rids) else tuple(sorted(rids))
    for rid in [r for r in order if r != last] + [r for r in order if r == last]:
        finish(m, m.requests.pop(rid))
    if len(order) > 1:
        m.observer.fired("connector: several requests ended at once ('fail'), in the order seen")
    return order


def waiting_pass(
    m: Machine,
    queues: StepQueues,
    left: int,
    budget: int,
    results: list[tuple[str, ScheduleResult]],
    ran: tuple[bool, bool] = (False, False),
) -> None:
    """The waiting requests' turns (`wait_turn`) under what is `left` of the budget:
    those holding blocks first (`model.machine.connector`), then the others, in queue order.
    A request passed over or gone to its async load lets the next one go (skipped:
    it comes back to the queue it holds blocks for, `model.policy.queues`); a failed
    admission, or a promoted chunk that ends the step's admissions unseen (`UNSEEN_END`),
    ends the pass, the request staying where it was."""
    reqs = m.requests
    for rid in [*queues.holding, *queues.waiting]:
        if left <= 0 or seq_cap_reached(len(queues.running), seq_cap(m.cfg)):
            break
        result = wait_turn(m, reqs[rid], left, budget, ran)
        if result is UNSEEN_END:
            break
        if result is not None:
            results.append((rid, result))
        if result is None or reqs[rid].load == LOADING:
            queues.skipped(rid, holds_blocks(reqs[rid]))
            continue
        if not result.admitted:
            break
        queues.admitted(rid)
        left -= result.scheduled


def holds_blocks(req: RequestState) -> bool:
    """A waiting request holds blocks (vLLM `Scheduler._holds_kv_blocks`): it has computed
    tokens, or its load is in flight (a failed one reported 0 tokens but holds them)."""
    return req.num_computed > 0 or req.load == LOADING


def external_state_blocks(local: int, computed: int, held: int) -> int:
    """The blocks a Mamba (align) group's admission takes for external tokens before
    its chunk's state: one, the state after the last external token (`computed`
    past the local hit `local`), for a request holding no blocks (`held`); else 0."""
    return int(computed > local and not held)


def superseded_tail(m: Machine, hit: int, hit_blocks: Blocks, ext: int) -> tuple[int, Blocks]:
    """The local hit an admission adopts (tokens, blocks per group): a hit ending inside
    a scheduler block, followed by external tokens, is cut to that block's start
    (`Scheduler.schedule`, `truncate_computed_blocks`: per group the blocks the cut
    covers, a Mamba group's at most as many as it has); the external tokens load the
    rest. Without external tokens the hit stands."""
    tail = hit % m.cfg.scheduler_block_size
    if not (ext and tail):
        return hit, hit_blocks
    m.observer.fired("connector: external tokens supersede a hit's sub-block tail")
    cut = hit - tail
    return cut, tuple(blocks[: cut // g.bs] for g, blocks in zip(m.groups, hit_blocks))


def add_external_blocks(m: Machine, g: GroupState, rid: str, computed: int, ext: int) -> None:
    """Fresh blocks for the external tokens inside the window (vLLM
    `SingleTypeKVCacheManager.allocate_external_computed_blocks`): a Mamba group's
    window is its last token, so it takes the one state block."""
    if min(computed - max(m.skipped_tokens(g, computed), 0), ext) <= 0:
        return
    table = g.table(rid)
    table.extend(m.pool.get_new_blocks(max(0, cdiv(computed, g.bs) - len(table))))
    if rules_for(g.spec).one_state(g.spec):
        m.observer.fired("connector: Mamba external state block")
