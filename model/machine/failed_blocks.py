"""Loads failed on some blocks: which requests the cut reaches, and where it cuts them.

A connector's worker may report the blocks a load failed on (`Loaded(rid, True,
invalid)`, vLLM's `invalid_block_ids`; one KV cache group only: vLLM raises on more).
`model.machine.connector` applies what is stated here:

- Only blocks whose cut is stated may be named (`failable_blocks`,
  `sync_failable_blocks`, `cut_stated`): generation keeps to them.
- The cut scans the async loads holding blocks in their queue's order, then the running
  requests in theirs (`scan_order`). Each scanned request whose computed tokens before
  the latest step cover a failed block is cut to the start of its first failed block no
  earlier request marked; one whose failed blocks were all marked keeps its tokens
  (`cut_covering`). The report shows `LoadCut`; a load cut to nothing is rolled back.
- A request awaiting its sample whose share rides on the report is cut as any holder
  and loses its sample (`riding_shares`).
- A sync load's failed blocks come with the output of the step that ran it, whole, with
  the samples riding on it (`SyncReport`, `turn`, `sample_rides`, `output_waits`).
- "recompute": the cut requests go on from their cut; no hash is evicted. "fail": the
  cut running requests' blocks from their first failed one lose their hashes and every
  cut request ends with an error, freed as a finish is, in an order the contract leaves
  open (`model.machine.connector.end_all`; the observer chooses, `model.machine.seams.Observer`).

The scan order is vLLM's policy (`Scheduler._handle_invalid_blocks`,
`_update_requests_with_invalid_blocks`, vLLM 0.33.0): predicted, no claim to be correct.
Stated as vLLM's behaviour and registered as findings, not the contract:
sync-load-failed-block-hash-kept, sync-load-failed-block-read-before-recompute,
async-load-cut-keeps-placeholders. vLLM's order scan by scan, and what generation leaves
out: docs/semantics.md, "vLLM 0.33.0's order, as the machine predicts it".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from model.contract.load_states import FAILED, LOADED, LOADING
from model.contract.masks import cdiv
from model.contract.observation import LoadCut, ScheduleResult
from model.contract.ops import Loaded, Op, Sample
from model.machine.state import SyncReport

if TYPE_CHECKING:
    from model.machine.seams import Machine
    from model.machine.state import RequestState


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
    that queue's order, then the running requests in `running`'s (`model.policy.queues.QueueOrder`)."""
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
    not for a request cut (`model.policy.spec_decode`; `deliver`)."""
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
