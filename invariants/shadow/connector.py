"""The KV connector's side of the shadow worker: what a connector is told, judged
against what the request holds, its transfers kept as provenance.

Contract judged (any scheduler policy that keeps it is correct):

- **A load writes its own request's blocks, while they are held**
  (`connector_loads_into_held_blocks`). `update_state_after_alloc(request, blocks,
  n)` tells the connector to load positions `[start, start + n)` of the request
  (`start`: the local hit it matched past) into `blocks`; every position needs a
  block, and the blocks are the request's until the load reports: a sync load's
  are the table its step ships, an async load's are still the request's when its
  `finished_recving` comes (a block freed or handed on meanwhile would take a
  transfer meant for another request). The load writes the request's own prefix
  there (a sync load before its step's forward pass, an async one at its report);
  the blocks it failed on (`invalid_block_ids`, or all of them under
  `failed_recving`) hold none (`worker.FAILED`), so whatever reads them is a
  wrong read (`worker_reads_own_prefix`) wherever the scheduler lets it happen.
- **The connector is told what the request holds**
  (`connector_told_what_request_holds`). The external tokens it is told are at
  most what it matched; the step that runs a sync load ships the request with
  exactly `start + n` tokens computed and the table the load was given
  (`build_connector_meta` sees that output); an async load's request is not
  computed in that step, and when it is admitted after a successful report it is
  at `start + n`; `request_finished` hands the blocks the request holds for its
  computed tokens.
- **A save reads its request's prefix until `finished_sending`**
  (`connector_saves_own_prefix`). A request whose free the connector defers
  (`request_finished` returned True) keeps the blocks it handed until the worker
  reports them sent; those blocks hold the request's own prefix for its computed
  tokens when it finishes, and still hold it at `finished_sending`.

A target feeds `ShadowConnector` what its connector is told (`told_load`,
`built_meta`, `reported`, `finished`) and asks it after every operation whether
the transfers in flight still hold their blocks (`check_held`); `holds(rid)` is
the target's view of the blocks the scheduler holds for a request (None: none).
Events that depend on what the forward pass wrote run in the worker's order
(`ShadowWorker.after`), so one step ahead (async scheduling) they wait with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .prefixes import EMPTY
from .worker import FAILED, NULL_BLOCK, STALE, ShadowWorker

LOADS = "connector_loads_into_held_blocks"
TOLD = "connector_told_what_request_holds"
SAVES = "connector_saves_own_prefix"

CONNECTOR_CHECKS: dict[str, str] = {
    LOADS: "a load writes its own request's blocks, for the tokens it is told, while they are held",
    TOLD: "what the connector is told (tokens, blocks, hand-over) is what the request holds",
    SAVES: "a save's blocks hold its request's prefix from its finish until finished_sending",
}

Table = tuple[tuple[int, ...], ...]
Holds = Callable[[str], Table | None]


@dataclass
class LoadTold:
    """One `update_state_after_alloc` with external tokens: positions `[start, start + told)`
    of the request (`tokens`) into `blocks`; `matched`: what the connector offered."""

    rid: str
    start: int
    matched: int
    told: int
    blocks: Table
    async_load: bool
    tokens: tuple[int, ...]
    written: bool = False
    # A report named one of its blocks failed (its own, or another load's sharing it):
    # vLLM cuts its count, so its admission may come lower.
    cut: bool = False


@dataclass
class SaveTold:
    """A finished request whose free the connector deferred: the blocks handed to it, its
    computed tokens, and the slots it read at the finish (compared at `finished_sending`)."""

    rid: str
    handed: Table
    computed: int
    tokens: tuple[int, ...]
    # The positions it reads (its computed tokens, as far as they were written at its finish).
    upto: int = 0
    read: dict[tuple[int, int], list[int | None]] = field(default_factory=dict)


@dataclass
class ConnectorFigures:
    """What the connector's side checked: loads written (slots), saves read (slots), failed blocks."""

    loads: int = 0
    slots_loaded: int = 0
    saves: int = 0
    slots_saved: int = 0
    failed_blocks: int = 0
    hand_overs: int = 0


class ShadowConnector:
    """The connector's transfers over a `ShadowWorker` (see the module docstring)."""

    def __init__(self, worker: ShadowWorker, holds: Holds) -> None:
        self.worker = worker
        self.holds = holds
        worker.hook = self
        self.figures = ConnectorFigures()
        # Sync loads told by the schedule() in progress, then by the output that runs them.
        self.told: list[LoadTold] = []
        self.by_step: dict[int, list[LoadTold]] = {}
        # Async loads until their report; saves until finished_sending.
        self.inflight: dict[str, LoadTold] = {}
        self.saving: dict[str, SaveTold] = {}
        # Admissions owed a check: rid -> (the count an async load left it at, exactly or at most).
        self.admitting: dict[str, tuple[int, bool]] = {}
        # Finished requests (their id may come back as a new request with a load of its own).
        self.gone: set[str] = set()

    # ------------------------------------------------------------------ what the connector is told
    def told_load(
        self,
        rid: str,
        start: int,
        matched: int,
        told: int,
        blocks: Table,
        async_load: bool,
        tokens: tuple[int, ...],
    ) -> None:
        """`update_state_after_alloc` with `told` external tokens past `start` into `blocks`
        (`matched`: what the connector offered past `start`; `tokens`: the request's)."""
        load = LoadTold(rid, start, matched, told, blocks, async_load, tokens)
        if load.told > load.matched:
            self._problem(
                TOLD,
                f"{load.rid}'s connector is told {load.told} external tokens from {load.start}; "
                f"it matched {load.matched}",
            )
        end = load.start + load.told
        for g, spec in self.worker.attention():
            have = len(load.blocks[g]) * spec.block_size
            if have < end:
                self._problem(
                    LOADS,
                    f"{load.rid}'s load of positions [{load.start}, {end}) is given {len(load.blocks[g])} "
                    f"blocks of group {g} (positions up to {have})",
                )
                break
        self.gone.discard(load.rid)
        # A new match supersedes what an earlier async load left the request at (a failed
        # load's request goes back to waiting, and the connector may match it afresh).
        self.admitting.pop(load.rid, None)
        if not load.async_load:
            self.told.append(load)
            return
        if load.rid in self.inflight:
            self._problem(TOLD, f"{load.rid}'s connector is told a second async load while one is in flight")
        self.inflight[load.rid] = load

    def built_meta(self, out: Any) -> None:
        """`build_connector_meta(out)`: the sync loads told this step run in it, as told; an
        async load's request computes nothing in it."""
        loads, self.told = self.told, []
        shipped = _shipped(out)
        for load in loads:
            end = load.start + load.told
            got = shipped.get(load.rid)
            if got is None:
                self._problem(TOLD, f"{load.rid}'s sync load is told, but its step does not compute it")
                continue
            computed, table = got
            if computed != end:
                self._problem(
                    TOLD,
                    f"{load.rid}'s connector loads positions [{load.start}, {end}); its step ships it "
                    f"with {computed} tokens computed",
                )
            if table is not None and tuple(t[: len(b)] for t, b in zip(table, load.blocks)) != load.blocks:
                self._problem(
                    TOLD, f"{load.rid}'s sync load is given blocks {load.blocks}; its step ships {table}"
                )
        for rid in self.inflight:
            if rid in out.num_scheduled_tokens:
                self._problem(TOLD, f"{rid} is computed while its async load is in flight")
        for rid in list(self.admitting):
            got = shipped.get(rid)
            if got is None:
                continue
            count, exact = self.admitting.pop(rid)
            if got[0] > count or exact and got[0] != count:
                self._problem(
                    TOLD,
                    f"{rid} is admitted with {got[0]} tokens computed; its async load left it at "
                    f"{'' if exact else 'most '}{count}",
                )
        self.by_step[id(out)] = loads

    def reported(
        self,
        finished_recving: Iterable[str],
        failed_recving: Iterable[str],
        invalid: Iterable[int],
        finished_sending: Iterable[str],
    ) -> None:
        """The worker's `KVConnectorOutput` as `update_connector_output` hands it over (before
        the scheduler frees what it releases)."""
        failed, bad = set(failed_recving), set(invalid)
        for load in self.inflight.values():
            load.cut |= load.rid in failed or bool(bad.intersection(b for g in load.blocks for b in g))
        done = []
        for rid in sorted(set(finished_recving) & set(self.inflight)):
            load = self.inflight.pop(rid)
            self._check_holds(load.rid, load.blocks, LOADS, "its load reports")
            done.append(load)
            if rid not in self.gone:
                self.admitting[rid] = (load.start + load.told, not load.cut)
        sent = [self.saving.pop(rid) for rid in sorted(set(finished_sending)) if rid in self.saving]
        for save in sent:
            self._check_holds(save.rid, save.handed, SAVES, "its save reports")
        self.figures.failed_blocks += len(bad)
        output = self.worker.outputs  # the output processing that carries this report

        def act() -> None:
            for load in done:
                self._write(load, bad, failed=load.rid in failed)
            if bad:
                self.worker.fail_blocks(bad, output)
            for save in sent:
                self._read_save(save, at_sent=True)

        self.worker.after(act)

    def finished(self, rid: str, handed: Table, saves: bool, computed: int, tokens: Iterable[int]) -> None:
        """`request_finished(_all_groups)`: handed `handed`; `saves`: the free deferred for a save."""
        self.figures.hand_overs += 1
        self.admitting.pop(rid, None)
        self.gone.add(rid)
        held = self.holds(rid)
        if held is not None:
            want = tuple(
                tuple(h[: -(-computed // self.worker.groups[g].block_size)])
                if self.worker.groups[g].kind != "mamba"
                else tuple(h)
                for g, h in enumerate(held)
            )
            if tuple(handed) != want:
                self._problem(
                    TOLD,
                    f"{rid}'s connector is handed {handed} at its finish; it holds {want} for its "
                    f"{computed} computed tokens",
                )
        if not saves:
            return
        save = SaveTold(rid, tuple(handed), computed, tuple(tokens))
        load = self.inflight.get(rid)
        # A load still in flight has not written its tokens: the save reads what precedes them.
        save.upto = min(computed, load.start) if load is not None else computed
        self.saving[rid] = save
        self.worker.after(lambda: self._read_save(save, at_sent=False))

    def check_held(self) -> None:
        """After an operation: every transfer in flight still has its blocks (the scheduler
        defers their free until its report)."""
        for rid, load in list(self.inflight.items()):
            if not self._check_holds(rid, load.blocks, LOADS, "its async load is in flight"):
                del self.inflight[rid]
        for rid, save in list(self.saving.items()):
            if not self._check_holds(rid, save.handed, SAVES, "its save is in flight"):
                del self.saving[rid]

    def take_figures(self) -> dict[str, int]:
        f = self.figures
        return {
            "connector loads written": f.loads,
            "connector slots loaded": f.slots_loaded,
            "connector saves read": f.saves,
            "connector slots saved": f.slots_saved,
            "connector failed blocks": f.failed_blocks,
            "connector hand-overs judged": f.hand_overs,
        }

    # ------------------------------------------------------------------ in the worker's order
    def before_forward(self, out: Any) -> None:
        """The sync loads of `out`'s step write their request's prefix before its forward pass."""
        for load in self.by_step.pop(id(out), ()):
            view = self.worker.requests.get(load.rid)
            if view is not None and any(
                tuple(t[: len(b)]) != b for t, b in zip((tuple(t) for t in view.tables), load.blocks)
            ):
                self._problem(
                    LOADS, f"{load.rid}'s sync load writes blocks {load.blocks}, not the table its step runs"
                )
            self._write(load, set())

    def _write(self, load: LoadTold, bad: set[int], failed: bool = False) -> None:
        """`load`'s positions written with its request's prefix (`FAILED` in `bad`, or everywhere)."""
        end = load.start + load.told
        ids = self.worker.own_ids(load.rid, load.tokens)
        if len(ids) < end:
            ids = self.worker.prefixes.chain(EMPTY, load.tokens)
        self.figures.loads += 1
        load.written = True
        for g, spec in self.worker.attention():
            bs, table = spec.block_size, load.blocks[g]
            for p in range(load.start, min(end, len(table) * bs)):
                block = table[p // bs]
                if block == NULL_BLOCK:
                    continue
                if p % bs == 0 or p == load.start:
                    # A load restores whole blocks (vLLM skips zeroing an async load's groups,
                    # `get_loaded_kv_cache_group_ids`): no stale slot is left in one it writes.
                    row = self.worker.slots(block, g)
                    self.worker.write_slots(block, g, 0, [None if v == STALE else v for v in row])
                value = FAILED if failed or block in bad else ids[p]
                self.worker.write_slots(block, g, p % bs, [value])
                self.figures.slots_loaded += 1

    def _read_save(self, save: SaveTold, at_sent: bool) -> None:
        """The save's read of its blocks: its request's prefix for its computed tokens (at the
        finish), and the same slots unchanged (at `finished_sending`)."""
        ids = self.worker.own_ids(save.rid, save.tokens)
        view = self.worker.requests.get(save.rid)
        if not at_sent:
            save.upto = min(save.upto, len(ids), view.computed if view is not None else len(ids))
        n = save.upto
        wrong: list[str] = []
        for g, spec in self.worker.attention():
            bs = spec.block_size
            for i, block in enumerate(save.handed[g]):
                if block == NULL_BLOCK or i * bs >= n:
                    continue
                hi = min((i + 1) * bs, n)
                got = self.worker.slots(block, g)[: hi - i * bs]
                if at_sent:
                    if save.read.get((g, block)) not in (None, got):
                        wrong.append(f"block {block} of group {g} was written over before finished_sending")
                    continue
                save.read[(g, block)] = got
                self.figures.slots_saved += len(got)
                want = ids[i * bs : hi]
                bad = [i * bs + k for k, (a, b) in enumerate(zip(got, want)) if a != b]
                if bad:
                    wrong.append(
                        f"position {bad[0]} in block {block} of group {g} holds {_what(got[bad[0] - i * bs])}"
                    )
        if not at_sent:
            self.figures.saves += 1
        if wrong:
            when = "at finished_sending" if at_sent else "at its finish"
            self._problem(SAVES, f"{save.rid}'s save reads, {when}: {wrong[0]} ({len(wrong)} block(s) wrong)")

    def _check_holds(self, rid: str, blocks: Table, check: str, when: str) -> bool:
        """Does the scheduler still hold `blocks` for `rid`? Reported once if not."""
        held = self.holds(rid)
        lost = (
            [b for g, table in enumerate(blocks) for b in table if b != NULL_BLOCK]
            if held is None
            else [
                b
                for g, table in enumerate(blocks)
                for i, b in enumerate(table)
                if b != NULL_BLOCK and (g >= len(held) or i >= len(held[g]) or held[g][i] != b)
            ]
        )
        if lost:
            whose = "no longer held by the scheduler" if held is None else "not among the blocks it holds"
            self._problem(check, f"{rid}'s block(s) {lost[:4]} are {whose} while {when}")
        return not lost

    def _problem(self, check: str, message: str) -> None:
        self.worker.figures.problems += 1
        self.worker.problems.append((check, message))


def _what(got: int | None) -> str:
    if got is None:
        return "no KV (never written)"
    if got == FAILED:
        return "a slot a failed KV load left unwritten"
    if got == STALE:
        return "a fresh slot never zeroed"
    return "another prefix's KV"


def _shipped(out: Any) -> dict[str, tuple[int, Table | None]]:
    """rid -> (num_computed_tokens, its whole table or None) as `out` ships a new or resumed
    request (a running one's new blocks are not its table)."""
    got: dict[str, tuple[int, Table | None]] = {}
    for data in out.scheduled_new_reqs:
        got[data.req_id] = (data.num_computed_tokens, tuple(tuple(g) for g in data.block_ids))
    cached = out.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    for i, rid in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        table = tuple(tuple(g) for g in new) if rid in resumed and new is not None else None
        got.setdefault(rid, (cached.num_computed_tokens[i], table))
    return got
