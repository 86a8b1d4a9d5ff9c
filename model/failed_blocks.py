"""Loads failed on some blocks: whom vLLM's cut reaches, and where it cuts them
(`Scheduler._handle_invalid_blocks`, `_update_requests_with_invalid_blocks`).

A KV connector's worker reports the blocks a load failed on
(`KVConnectorOutput.invalid_block_ids`); `model.connector` states the rest of
the connector's contract (offers, loads, promotion, deferred frees, saves) and
applies the cut stated here, ending the requests it reaches under "fail".

- **Failed blocks** (`Loaded(rid, True, invalid)`, the report's
  `invalid_block_ids`; a single KV cache group only: vLLM raises on more, as
  block ids are unique per group only). The async load of `rid` failed on
  some of its blocks (`failable_blocks`: covering its computed tokens, where
  the cut is stated, `cut_stated`). vLLM scans the async loads waiting among
  the requests holding blocks (`kv_holding_waiting` in status
  `WAITING_FOR_REMOTE_KVS`: in flight, or reported and not yet promoted; `rid`
  among them), in that queue's order, then, marking afresh, the running
  requests in `running`'s order (`scan_order`; both as `model.queues.QueueOrder`
  keeps them between steps). Of the scanned requests whose computed tokens
  cover a failed block, the first to reach it marks it; each is cut to the
  start of its first failed block no earlier request marked, and one whose
  failed blocks were all marked keeps its computed tokens
  (`_update_requests_with_invalid_blocks`, `cut_covering`; the observation,
  `LoadCut`: `rid`'s tokens and every other request's that changed). So
  `rid` itself may keep a failed block another load marked, and a reported
  load cut to nothing is rolled back at its promotion. Not scanned, so not
  cut: a waiting request promoted whose chunk did not fit, a finished one
  whose free is deferred.
  "recompute": at promotion a valid prefix is cached and the request takes
  its next chunk from there with the blocks it holds; an empty one is freed
  and re-admitted, as a failed load (`_update_waiting_for_remote_kv`); a cut
  running request takes its next chunk from its cut. No hash is evicted: the
  failed blocks keep theirs until recomputed in place (an async load's are
  not cached: only its valid prefix is, at promotion).
  "fail": every request the cut reached ends with an error, freed (after its
  out-of-window blocks on the cut computed tokens) as a finish is (`end_all`),
  and the hashes of each cut running request's blocks from its first failed
  block on are evicted (`KVCacheManager.evict_blocks`; an async load's blocks
  are not cached).
- **A sync load's failed blocks** (`Loaded(rid, True, invalid)` right after
  the step that ran `rid`'s sync load, or after samples of that step's
  requests: the worker reports them with that step's output, which carries
  the samples too, `sync_load_failed`, `sample_rides`). `invalid` names blocks
  holding its external tokens (`sync_failable_blocks`); the step's output
  comes whole (no other request of the step still awaits its sample). A
  sampled one's tokens ride on it and are dropped if the request is cut:
  vLLM skips its output; the others' outputs are processed after the cut,
  which counts a sample's rejected drafts as the scheduler does, not rolled
  back yet. Under async scheduling the output's fenced frees come before the
  cut and the tokens arrive after it (`model.async_scheduling`); with drafts
  under synchronous scheduling, where a sample's output is otherwise
  processed at once (`model.spec_decode`), a sample of the step waits for the
  report's turn (`output_waits`): its blocks are cached after the cut, or,
  where the next operation is not the report, before that operation. vLLM
  cuts the step's async loads holding one, then every running request whose
  computed tokens before the step cover one, in scan order (`scan_order`,
  `cut_covering`): at its first failed block no earlier request marked, or, where an earlier request (the loading one)
  marked them all, back to its tokens before the step (it keeps the hit on
  the failed blocks, which the loading request recomputes). The running ones
  lose the step's output. "recompute": they go on from their cut, nothing is
  evicted: the failed blocks, cached at the admission, keep their hashes to
  be recomputed in place, and a request hitting them in the step that
  recomputes them reads them right (a forward pass writes each layer's KV
  before attention reads it). A cut request preempted or aborted before that
  step leaves them to be hit: KV never loaded nor computed served, vLLM
  0.33.0's behaviour stated here and a known finding
  ("sync-load-failed-block-hash-kept", flagged by `hit_serves_written_kv` on
  vLLM and the model alike), not the contract; so is a request put back to
  its hit on a block the loading request marked, which reads it in its next
  step whether or not that one recomputed it first
  ("sync-load-failed-block-read-before-recompute", `step_reads_written_kv`).
  "fail": the hashes of each cut running request's blocks from its first
  failed block on are evicted (`KVCacheManager.evict_blocks`: KV computed on
  the failed block) and every cut request ends with an error, freed as a
  finish is (`end_all`); the connector saves one if asked.
- **Several requests ended at once** ("fail", a failed block more than one
  scanned request covers): vLLM ends them in one `finish_requests` over a set
  of their ids, each freed as a finish frees it, one after another; but the
  async load whose report this is is freed after them all (its free waits
  for its load's report, which the same output carries and vLLM processes
  after the finishes, `_update_from_kv_xfer_finished`). The order of the
  ends is not part of the contract: it follows the set's iteration, which
  string hashing decides (`PYTHONHASHSEED`), so it differs across processes
  while the free queue, and every later block id, depend on it. The model
  leaves it open: the observation (`LoadCut.ended`) names the ended requests
  in the order vLLM ended them, any order of exactly them is allowed, and
  the model ends them in the order its observer chooses (`model.seams.Observer`,
  the judge's: the order the target ended them in); in id order where no one chose.

- **A holder awaiting its sample**: the report of an async load's failed blocks
  rides on the latest step's output, with the shares of it still held for
  their samples (`riding_shares`; under async scheduling that output is the
  one the report processes first, `model.async_scheduling`). A request
  awaiting its sample from that step is scanned on its computed tokens
  before the step; one whose blocks there hold a failed block is cut as any
  holder is (`cut_covering`: back to those tokens if an earlier request
  marked them all) and loses its sample and the drafts the step verified:
  vLLM skips its output (`failed_kv_load_req_ids`), so it no longer awaits
  one and recomputes from its cut. The shares of the others stay held for
  their samples. Under async scheduling vLLM 0.33.0 keeps a cut request's
  output placeholders, which its next steps schedule as tokens: a known
  finding ("async-load-cut-keeps-placeholders"), not the contract. The
  output is one in vLLM, so a share of it delivered before the report (a
  sampled request of the step) is scanned on its tokens before the step too:
  kvretain delivers such a share on its own, so a report naming a block a
  rider holds names none such a share holds (`failable_blocks`).

Not stated (generation avoids them): a failed block a request awaiting its
sample covers where its share is not in the latest step's output (an earlier
step's: kvretain keeps no share of it), where only that step's own tokens reach it
(in vLLM the request is not cut and its sample is taken with the report: kvretain
gives a sample its own operation, and the sample then the report is that output); a
rider together with a share of the same output delivered before the report (above);
a sync load's failed blocks reported after another
operation than its step and its samples, or while another request of the step awaits
its sample (the step's output would not come whole).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from model.load_states import FAILED, LOADED, LOADING
from model.masks import cdiv
from model.observation import LoadCut, ScheduleResult
from model.ops import Loaded, Op, Sample
from model.state import SyncReport

if TYPE_CHECKING:
    from model.seams import Machine
    from model.state import RequestState


def failable_blocks(m: Machine, req: RequestState) -> list[int]:
    """The blocks a report of `req`'s load may name as failed (`Loaded.invalid`):
    with a single KV cache group (vLLM refuses block-level failures with more: block ids
    are unique per group only), for an async load in flight the non-null blocks covering
    its computed tokens whose cut is stated (`cut_stated`), none a rider holds where a
    share of the latest step's output delivered before the report holds one (module
    docstring); right after the step that ran its sync load, `sync_failable_blocks`."""
    if len(m.groups) != 1:
        return []
    if m.sync_report is not None and req.rid in m.sync_report.loads:
        return sync_failable_blocks(m, req, m.sync_report)
    if req.load != LOADING:
        return []
    g = m.groups[0]
    computed = g.tables.get(req.rid, [])[: cdiv(req.num_computed, g.bs)]
    riding = riding_shares(m)
    stated = [b for b in computed if b and cut_stated(m, req.rid, b, riding)]
    loads, running = scan_order(m)
    delivered = [r for r in [*loads, *running] if r != req.rid and r in m.step_shares and r not in riding]
    if not any(set(stated) & set(covered(m, r, {})) for r in delivered):
        return stated
    rides = {b for r in riding for b in covered(m, r, {})}
    return [b for b in stated if b not in rides]


def riding_shares(m: Machine) -> dict[str, int]:
    """The shares of the latest step's output a report of failed blocks rides on: those
    of requests awaiting their sample (their tokens in that step, `undelivered`, drafts
    verified in it included). The cut counts a request's computed tokens before that
    step, and one it cuts loses its sample and the step's drafts (vLLM skips its output)."""
    reqs = m.requests
    return {r: n for r, n in m.undelivered.items() if r in reqs and reqs[r].awaits_sample}


def scan_order(m: Machine) -> tuple[list[str], list[str]]:
    """The requests vLLM's failed-block cut scans, in order (`_handle_invalid_blocks`):
    the async loads among the requests holding blocks (`kv_holding_waiting` in status
    `WAITING_FOR_REMOTE_KVS`: a load in flight, or reported and not yet promoted), in
    that queue's order, then the running requests in `running`'s (`model.queues.QueueOrder`)."""
    reqs, order = m.requests, m.order
    loads = order.live(order.holding, lambda r: r in reqs and reqs[r].holding and bool(reqs[r].load))
    running = order.live(order.running, lambda r: r in reqs and reqs[r].running)
    assert set(running) == {r for r, q in reqs.items() if q.running}, "a running request out of order"
    assert set(loads) == {r for r, q in reqs.items() if q.holding and q.load}, "a load out of order"
    return loads, running


def covered(m: Machine, rid: str, undelivered: dict[str, int]) -> list[int]:
    """The blocks covering `rid`'s computed tokens before the step whose output is
    `undelivered` (those the cut scans: `_update_requests_with_invalid_blocks`)."""
    g, req = m.groups[0], m.requests[rid]
    return g.tables.get(rid, [])[: cdiv(req.num_computed - undelivered.get(rid, 0), g.bs)]


def cut_stated(m: Machine, rid: str, b: int, undelivered: dict[str, int]) -> bool:
    """Is the cut stated when `rid`'s load names block `b` failed? Every other request
    the cut scans whose computed tokens before the output `undelivered` names cover `b`
    is cut with it (`cut_covering`), in the scan's order (`scan_order`), unless one
    awaiting its sample holds `b` other than before its share in that output (an
    earlier step's share, drafts to verify, or `b` reached by that step's own tokens:
    its share could ride on the report only with its sample; see the module docstring)."""
    loads, running = scan_order(m)
    for r in [*loads, *running]:
        if r == rid or not m.requests[r].awaits_sample or b not in covered(m, r, {}):
            continue
        if r not in undelivered or b not in covered(m, r, undelivered):
            return False
    return True


def cut_scanned(m: Machine, rid: str, invalid: tuple[int, ...]) -> tuple[LoadCut, list[str], list[int]]:
    """Cut every request the scan reaches (`scan_order`) whose computed tokens before the
    latest step cover a failed block: the async loads, then, marking afresh, the running
    ones (`cut_covering`). A reported load cut to nothing is rolled back at its
    promotion (vLLM's `failed_recving_kv_req_ids`). Returns what `rid`'s report shows
    (its computed tokens, and every other request's that changed), the requests cut,
    and the running ones' dependent blocks (`cut_covering`)."""
    reqs = m.requests
    loads, running = scan_order(m)
    before = {r: reqs[r].num_computed for r in [*loads, *running]}
    cut, _ = cut_covering(m, loads, invalid)
    for r in cut:
        if reqs[r].load == LOADED and not reqs[r].num_computed:
            reqs[r].load = FAILED
    running_cut, dependent = cut_covering(m, running, invalid)
    changed = tuple(
        sorted((r, reqs[r].num_computed) for r in before if r != rid and reqs[r].num_computed != before[r])
    )
    if running_cut:
        m.observer.fired("connector: a running request holding a failed block cut")
    if [r for r in cut if r != rid]:
        m.observer.fired("connector: another async load holding a failed block cut")
    if len(running_cut) > 1:
        m.observer.fired("connector: several running requests holding failed blocks cut, in queue order")
    return LoadCut(reqs[rid].num_computed, changed), cut + running_cut, dependent


def turn(m: Machine, op: Op) -> SyncReport | None:
    """The latest step's `SyncReport` as `op` finds it: kept for a sample of a request of
    that step (`sample_rides`) and for the report of one of its sync loads; otherwise its
    turn is over, and the samples whose output waited on it are delivered first (`deliver`)."""
    report = m.sync_report
    if report is None:
        return None
    if (
        isinstance(op, Sample)
        and op.rid in m.undelivered
        or isinstance(op, Loaded)
        and op.rid in report.loads
    ):
        return report
    waiting = {r for r, _, _ in report.waiting}
    for rid in [r for r in m.undelivered if r in waiting and r in m.requests]:  # the output's order
        deliver(m, m.requests[rid])
    return None


def sample_rides(m: Machine, rid: str, report: SyncReport | None) -> SyncReport | None:
    """The latest step's `SyncReport` after a sample of `rid`: kept where `rid` ran in that
    step, as its tokens ride on the same output as the sync loads' failed blocks; else gone."""
    if report is None or rid not in m.undelivered:
        return None
    return report._replace(sampled=report.sampled | {rid})


def output_waits(m: Machine, req: RequestState, accepted: int, rejected: int) -> bool:
    """With drafts under synchronous scheduling, does the output of `req`'s sample wait for
    the report's turn (`turn`)? It does where it rides on the report (`sample_rides`): vLLM
    caches a sampled request's blocks as it processes the step's output, after the cut and
    not for a request cut (`model.spec_decode`; `deliver`)."""
    report = m.sync_report
    if m.in_flight is not None or report is None or req.rid not in report.sampled:
        return False
    m.sync_report = report._replace(waiting=(*report.waiting, (req.rid, 1 + accepted, rejected)))
    return True


def deliver(m: Machine, req: RequestState) -> None:
    """`req`'s share of the latest step's output, with its sample and drafts, processed
    (synchronous scheduling): its blocks cached (`update_from_output`'s `cache_blocks`)."""
    m.undelivered.pop(req.rid, None)
    if m.cfg.enable_caching:
        m.cache_blocks(req, req.num_computed)


def note_step(results: Iterable[tuple[str, ScheduleResult]]) -> SyncReport | None:
    """The step's `SyncReport` (None without a sync load)."""
    admitted = tuple(rid for rid, r in results if r.hit is not None and (r.admitted or r.external))
    loads = {rid: (r.hit or 0, r.external) for rid, r in results if r.admitted and r.external}
    return SyncReport(admitted, loads) if loads else None


def sync_failable_blocks(m: Machine, req: RequestState, report: SyncReport) -> list[int]:
    """The blocks the output of the step that ran `req`'s sync load may name as failed:
    the non-null blocks holding its external tokens (the ones the connector loaded), if
    the output can come whole (no other request of the step still awaits its sample: the
    samples ride on it, `sample_rides`), whose cut is stated (`cut_stated` on the computed
    tokens before the step)."""
    g = m.groups[0]
    others = [r for r in m.undelivered if r != req.rid and r in m.requests]
    if any(m.requests[r].awaits_sample for r in others):
        return []
    hit, ext = report.loads[req.rid]
    blocks = g.tables.get(req.rid, [])[hit // g.bs : cdiv(hit + ext, g.bs)]
    return [b for b in blocks if b and cut_stated(m, req.rid, b, m.undelivered)]


def cut_covering(m: Machine, rids: Iterable[str], invalid: tuple[int, ...]) -> tuple[list[str], list[int]]:
    """Cut each of `rids` whose computed tokens before the latest step (those delivered)
    cover a failed block, in order (`Scheduler._update_requests_with_invalid_blocks`):
    at its first failed block no earlier request marked; one whose failed blocks were
    all marked keeps its computed tokens before the step (the marking request recomputes
    them). Returns the requests cut and the blocks from each marking request's first
    failed block on (its dependent blocks)."""
    g = m.groups[0]
    marked: set[int] = set()
    cut: list[str] = []
    dependent: list[int] = []
    for rid in rids:
        req, table = m.requests[rid], g.tables.get(rid, [])
        before = req.num_computed - m.undelivered.get(rid, 0)
        failed = [i for i, b in enumerate(table[: cdiv(before, g.bs)]) if b in invalid]
        if not failed:
            continue
        first = next((i for i in failed if table[i] not in marked), None)
        marked.update(table[i] for i in failed)
        if first is None:
            m.observer.fired("connector: a request whose failed blocks another marked keeps them")
        req.num_computed = before if first is None else first * g.bs
        if first is not None:
            dependent += [b for b in table[first:] if b not in dependent]
        cut.append(rid)
    return cut, dependent
