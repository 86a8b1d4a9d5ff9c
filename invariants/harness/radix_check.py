"""Checking SGLang's radix cache after every operation.

A `RadixChecker` drives the same op on the Python tree core and, when asked,
on the Rust tree core (SGLang's default) in lockstep. After each op it:

1. runs SGLang's own `sanity_check()` on every core (tree shape, LRU lists,
   size counters);
2. checks pool conservation and, on the Python core, slot disjointness,
   locked paths and the event replay
   (`invariants/catalogue/radix.py`);
3. differential: an admission's hit must equal the model's match rule
   (`model/radix/match.py`) on the tree as it stood before the lookup; a
   full-only eviction must respect LRU; a finished request's pages must hit;
4. differential between cores: the op's result (hit, eviction counts,
   rejection) and every pool account must agree.

Violations are returned as `(invariant name, message)` pairs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.catalogue import radix as inv
from invariants.targets.sglang_drive import OpResult, SglangDriver
from invariants.targets.sglang_snapshot import (
    EventReplay,
    PoolAccount,
    free_lists,
    mamba_slot_sets,
    pool_accounts,
    prefix_slots,
    slot_sets,
    tree_view,
)
from model.radix.config import RadixLayout
from model.radix.ops import Admit, Evict, Extend, Finish, RadixOp
from model.radix.tree import TreeView

Violation = tuple[str, str]


class UnifiedReader:
    """How the checker reads a driver's state: `sglang_snapshot`'s functions (0.5.23).
    Another release's driver comes with its own reader (e.g. `sglang_legacy_snapshot`)."""

    pool_accounts = staticmethod(pool_accounts)
    slot_sets = staticmethod(slot_sets)
    free_lists = staticmethod(free_lists)
    mamba_slot_sets = staticmethod(mamba_slot_sets)
    prefix_slots = staticmethod(prefix_slots)
    tree_view = staticmethod(tree_view)

    @staticmethod
    def node_id(node: Any) -> int:
        return int(node)

    @staticmethod
    def sanity_check(driver: SglangDriver) -> str | None:
        """SGLang's own `sanity_check()`: None when it holds, else its first line."""
        try:
            driver.cache.sanity_check()
        except AssertionError as exc:
            return str(exc).splitlines()[0][:300]
        return None


@dataclass
class RadixChecker:
    layout: RadixLayout
    cores: tuple[str, ...] = ("python", "rust")
    drivers: dict[str, SglangDriver] = field(default_factory=dict)
    checked_ops: int = 0
    # What the run reached (hits, rejections, evictions, splits seen as tombstones, ...),
    # so a clean verdict says what it covered.
    coverage: Counter[str] = field(default_factory=Counter)
    # What builds a driver per core, and how its state is read (defaults: 0.5.23's).
    make_driver: Callable[[RadixLayout, str], SglangDriver] = SglangDriver
    reader: Any = UnifiedReader

    def __post_init__(self) -> None:
        self._mamba_use: dict[int, int] = {}
        for core in self.cores:
            self.drivers[core] = self.make_driver(self.layout, core)
        self.replay = EventReplay(self.layout.page_size)
        self.primary = self.drivers[self.cores[0]]

    def step(self, op: RadixOp) -> list[Violation]:
        """Apply `op` to every core and return what broke."""
        self._note_finish(op)
        self._insert_key = self._key_inserted_by(op) if self.layout.has_mamba else None
        # The tree changes only through ops, so the last op's after-view is this one's before-view.
        before = self._view if self._view is not None else self.reader.tree_view(self.primary)
        results = {core: d.apply(op) for core, d in self.drivers.items()}
        self.checked_ops += 1
        out: list[Violation] = []
        accounts = {}
        for core, d in self.drivers.items():
            broken = self.reader.sanity_check(d)
            if broken is not None:
                out.append(("sglang_sanity_check", f"[{core}] {broken}"))
            accounts[core] = self.reader.pool_accounts(d)
            out += [
                ("radix_pool_conservation", f"[{core}] {m}")
                for m in inv.radix_pool_conservation(accounts[core])
            ]
        self._count(results[self.cores[0]])
        out += self._primary_checks(op, results[self.cores[0]], before)
        out += self.cores_agree(op, results, accounts)
        return out

    def _primary_checks(self, op: RadixOp, res: OpResult, before: TreeView | None) -> list[Violation]:
        d = self.primary
        sets = self.reader.slot_sets(d)
        out: list[Violation] = [("radix_slots_disjoint", m) for m in inv.radix_slots_disjoint(sets)]
        out += [
            ("radix_running_prefix_backed", m)
            for m in inv.radix_running_prefix_backed(
                self.reader.prefix_slots(d), sets["free"], sets["cached"]
            )
        ]
        if self.layout.has_mamba:
            msgs = inv.radix_slots_disjoint(self.reader.mamba_slot_sets(d))
            out += [("radix_slots_disjoint", f"mamba: {m}") for m in msgs]
        out += [("radix_free_list_unique", m) for m in inv.radix_free_list_unique(self.reader.free_lists(d))]
        if d.last_refusal is not None:
            out += [("radix_refusal_justified", m) for m in inv.radix_refusal_justified(d.last_refusal)]
        after = self._view = self.reader.tree_view(d)
        if after is None or before is None:
            return out
        self.replay.feed(d.take_events())
        self.coverage["tombstone"] += any(n.swa is False for i, n in after.nodes.items() if i != after.root)
        # An insert that brought a tombstone's SWA back (the recovery paths of #27586/#29352).
        self.coverage["recovered"] += any(
            n.swa is False and n.node_id in after.nodes and after.nodes[n.node_id].swa
            for n in before.nodes.values()
        )
        locked = {
            rid: self.reader.node_id(run.req.last_node)
            for rid, run in d.running.items()
            if run.req.lock is not None
        }
        out += [("radix_locked_paths_kept", m) for m in inv.radix_locked_paths_kept(after, locked)]
        out += [
            ("radix_events_replay", m)
            for m in inv.radix_events_replay(self.replay.pages(), after, d.layout.page_size)
        ]
        if isinstance(op, Admit) and res.hit is not None and res.max_len is not None:
            msgs = inv.radix_hit_matches_model(before, op.tokens, self.layout, res.max_len, res.hit)
            out += [("radix_hit_matches_model", m) for m in msgs]
        if isinstance(op, Evict) and op.swa == 0 and op.mamba == 0 and not self.layout.has_mamba:
            out += [("radix_eviction_lru", m) for m in inv.radix_eviction_lru(before, after)]
        if self.layout.has_mamba:
            out += self._mamba_order(op, res, before, after)
        if isinstance(op, Evict) and self.layout.components == ("full",) and res.evicted is not None:
            msgs = inv.radix_full_eviction_matches_model(before, after, op.full, res.evicted[0])
            out += [("radix_full_eviction_matches_model", m) for m in msgs]
        if isinstance(op, Finish) and self._last_finished is not None and self.layout.components == ("full",):
            out += [
                ("radix_full_promise_kept", m)
                for m in inv.radix_full_promise_kept(after, self._last_finished, self.layout)
            ]
        return out

    _last_finished: tuple[int, ...] | None = None
    _insert_key: tuple[int, ...] | None = None
    _clock: int = 0

    def _key_inserted_by(self, op: RadixOp) -> tuple[int, ...] | None:
        """The key an op's insert ends on (a chunk checkpoint or a finish), read before the op."""
        run = self.primary.running.get(getattr(op, "rid", -1))
        if run is None or isinstance(op, Admit):
            return None
        seq = tuple(run.tokens) + tuple(run.decoded)
        if isinstance(op, Extend) and run.prefilled < len(run.tokens):
            return seq[: run.prefilled]
        if isinstance(op, Finish) and run.prefilled >= len(run.tokens):
            return seq[: run.req.kv.kv_committed_len]
        return None

    def _mamba_order(self, op: RadixOp, res: OpResult, before: TreeView, after: TreeView) -> list[Violation]:
        """Track each Mamba state's last use (it appeared, a lookup ended on it, an insert
        ended on it) and check a Mamba-only eviction against it."""
        self._clock += 1
        use = self._mamba_use
        out: list[Violation] = []
        if isinstance(op, Evict) and op.full == 0 and op.swa == 0 and op.mamba > 0:
            out = [("radix_mamba_eviction_lru", m) for m in inv.radix_mamba_eviction_lru(before, after, use)]
        ends = set()
        if isinstance(op, Admit) and res.hit:
            ends.add(op.tokens[: res.hit])
        if self._insert_key:
            ends.add(self._insert_key)
        for nid, node in after.nodes.items():
            if not node.mamba:
                use.pop(nid, None)
            elif nid not in use or (ends and after.prefix(nid) in ends):
                use[nid] = self._clock
        return out

    _view: TreeView | None = None

    def _count(self, res: OpResult) -> None:
        self.coverage["hit"] += bool(res.hit)
        self.coverage["rejected"] += res.rejected is not None
        if res.evicted is not None:
            self.coverage["evicted"] += sum(res.evicted) > 0

    def _note_finish(self, op: RadixOp) -> None:
        """Remember the tokens of the request `op` finishes (for the promise check)."""
        self._last_finished = None
        if isinstance(op, Finish):
            run = self.primary.running.get(op.rid)
            if run is not None and run.prefilled >= len(run.tokens):
                self._last_finished = tuple(run.tokens) + tuple(run.decoded)

    def cores_agree(
        self, op: RadixOp, results: dict[str, OpResult], accounts: dict[str, list[PoolAccount]]
    ) -> list[Violation]:
        if len(self.cores) < 2:
            return []
        out: list[Violation] = []
        first, ref = self.cores[0], results[self.cores[0]]
        for core in self.cores[1:]:
            r = results[core]
            mine = (ref.hit, ref.evicted, ref.rejected is None, ref.skipped)
            theirs = (r.hit, r.evicted, r.rejected is None, r.skipped)
            if mine != theirs:
                out.append(("radixcores_agree", f"{type(op).__name__}: {first} {mine} != {core} {theirs}"))
            a = [(x.pool, x.available, x.evictable, x.protected) for x in accounts[first]]
            b = [(x.pool, x.available, x.evictable, x.protected) for x in accounts[core]]
            if a != b:
                out.append(
                    ("radixcores_agree", f"pools after {type(op).__name__}: {first} {a} != {core} {b}")
                )
        return out
