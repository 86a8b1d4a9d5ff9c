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
   full-only eviction must respect LRU; a finished request's pages must hit (each in the
   request's namespace: its adapter and cache salt);
4. isolation, on every core and independent of the model: every slot a hit hands a
   request was written by a request of the same identity (the driver's slot provenance);
5. differential between cores: the op's result (hit, eviction counts,
   rejection) and every pool account must agree.

Violations are returned as `(invariant name, message)` pairs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from invariants.catalogue import radix as inv
from invariants.targets.sglang_drive import OpResult, SglangDriver
from invariants.targets.sglang_snapshot import (
    EventReplay,
    PoolAccount,
    core_view,
    free_lists,
    mamba_slot_sets,
    pool_accounts,
    prefix_slots,
    slot_sets,
    tree_view,
)
from model.radix.config import RadixLayout
from model.radix.ops import Admit, Evict, Extend, Finish, RadixOp
from model.radix.recency import Recency, advance, as_time
from model.radix.tree import DEFAULT_NAMESPACE, Namespace, TreeView

Violation = tuple[str, str]


def _with_recency(view: TreeView, recency: dict[int, Recency]) -> TreeView:
    """`view` with each node's access time replaced by the model's recency (0 when unknown)."""
    nodes = {
        nid: replace(node, last_access=as_time(recency[nid]) if nid in recency else 0.0)
        for nid, node in view.nodes.items()
    }
    return TreeView(root=view.root, nodes=nodes)


class UnifiedReader:
    """How the checker reads a driver's state: `sglang_snapshot`'s functions (0.5.23).
    Another release's driver comes with its own reader (e.g. `sglang_legacy_snapshot`).

    `per_core_views`: every core's own tree can be read (`core_view`) and the driver
    records its tree calls, so eviction order, eviction scope and the finished-prefix
    promise are judged on each core against the model, not against the other core."""

    per_core_views = True
    core_view = staticmethod(core_view)
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
    # Per core (per_core_views): its tree after the last op, and the model's recency of its nodes.
    _core_views: dict[str, TreeView] = field(default_factory=dict, init=False, repr=False)
    _recency: dict[str, dict[int, Recency]] = field(default_factory=dict, init=False, repr=False)

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
        per_core = self.reader.per_core_views and all(d.observes_tree for d in self.drivers.values())
        if not per_core:
            self.coverage["per_core_unjudged"] += 1  # ops not judged on each core against the model
        if per_core:
            befores = {core: self._core_before(core) for core in self.cores}
            promises = {core: self._promise_inputs(op, d) for core, d in self.drivers.items()}
        results = {core: d.apply(op) for core, d in self.drivers.items()}
        self.checked_ops += 1
        out: list[Violation] = []
        if isinstance(op, Admit):
            out += self._isolation(op, results)
        if per_core:
            for core in self.cores:
                out += self._core_checks(core, op, results[core], befores[core], promises[core])
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

    def _namespace(self, op: Admit) -> Namespace:
        """The namespace `op`'s lookup runs in: its identity, where the driver passes it."""
        return op.namespace if self.primary.passes_identity else DEFAULT_NAMESPACE

    def _isolation(self, op: Admit, results: dict[str, OpResult]) -> list[Violation]:
        """Every core: the slots of an admission's hit were written by its own identity."""
        if op.namespace != DEFAULT_NAMESPACE:
            self.coverage["identity_admits"] += 1
            self.coverage["identity_hits"] += bool(results[self.cores[0]].hit)
        if not self.primary.passes_identity:
            self.coverage["identity_unjudged"] += op.namespace != DEFAULT_NAMESPACE
            return []
        out: list[Violation] = []
        for core, d in self.drivers.items():
            res = results[core]
            if res.hit:
                msgs = inv.radix_hit_same_identity(res.prefix_slots, d.slot_writer, op.namespace)
                out += [("radix_hit_same_identity", f"[{core}] {m}") for m in msgs]
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
            msgs = inv.radix_hit_matches_model(
                before, op.tokens, self.layout, res.max_len, res.hit, self._namespace(op)
            )
            out += [("radix_hit_matches_model", m) for m in msgs]
        if isinstance(op, Evict) and op.swa == 0 and op.mamba == 0 and not self.layout.has_mamba:
            out += [("radix_eviction_lru", m) for m in inv.radix_eviction_lru(before, after)]
        if self.layout.has_mamba:
            out += self._mamba_order(op, res, before, after)
        full_only = self.layout.components == ("full",)
        if isinstance(op, Evict) and full_only and res.evicted is not None and not self.reader.per_core_views:
            # Legacy caches: LRU read from the Python core's own access times.
            msgs = inv.radix_full_eviction_matches_model(before, after, op.full, res.evicted[0])
            out += [("radix_full_eviction_matches_model", m) for m in msgs]
        if isinstance(op, Finish) and self._last_finished is not None and self.layout.components == ("full",):
            out += [
                ("radix_full_promise_kept", m)
                for m in inv.radix_full_promise_kept(
                    after, self._last_finished, self.layout, self._finished_namespace
                )
            ]
        return out

    _last_finished: tuple[int, ...] | None = None
    _finished_namespace: Namespace = DEFAULT_NAMESPACE
    _insert_key: tuple[Namespace, tuple[int, ...]] | None = None
    _clock: int = 0

    def _key_inserted_by(self, op: RadixOp) -> tuple[Namespace, tuple[int, ...]] | None:
        """The (namespace, key) an op's insert ends on (a chunk checkpoint or a finish), read
        before the op."""
        run = self.primary.running.get(getattr(op, "rid", -1))
        if run is None or isinstance(op, Admit):
            return None
        seq = tuple(run.tokens) + tuple(run.decoded)
        ns = run.namespace if self.primary.passes_identity else DEFAULT_NAMESPACE
        if isinstance(op, Extend) and run.prefilled < len(run.tokens):
            return ns, seq[: run.prefilled]
        if isinstance(op, Finish) and run.prefilled >= len(run.tokens):
            return ns, seq[: run.req.kv.kv_committed_len]
        return None

    def _mamba_order(self, op: RadixOp, res: OpResult, before: TreeView, after: TreeView) -> list[Violation]:
        """Track each Mamba state's last use (it appeared, a lookup ended on it, an insert
        ended on it) and check a Mamba-only eviction against it."""
        self._clock += 1
        use = self._mamba_use
        out: list[Violation] = []
        if isinstance(op, Evict) and op.full == 0 and op.swa == 0 and op.mamba > 0:
            out = [("radix_mamba_eviction_lru", m) for m in inv.radix_mamba_eviction_lru(before, after, use)]
        ends: set[tuple[Namespace, tuple[int, ...]]] = set()  # (namespace, prefix) used by this op
        if isinstance(op, Admit) and res.hit:
            ends.add((self._namespace(op), op.tokens[: res.hit]))
        if self._insert_key:
            ends.add(self._insert_key)
        for nid, node in after.nodes.items():
            if not node.mamba:
                use.pop(nid, None)
            elif nid not in use or (ends and (node.namespace, after.prefix(nid)) in ends):
                use[nid] = self._clock
        return out

    _view: TreeView | None = None

    # -- each core on its own, against the model ------------------------------------------

    def _core_before(self, core: str) -> TreeView:
        if core not in self._core_views:
            self._core_views[core] = self.reader.core_view(self.drivers[core])
        return self._core_views[core]

    def _promise_inputs(
        self, op: RadixOp, d: SglangDriver
    ) -> tuple[tuple[int, ...], int, int, int, Namespace] | None:
        """For a Finish of a request whose prompt ran, read from the request before the finish:
        (sequence, tokens the finish caches, protected length, SWA freed below, namespace). The finish
        caches the committed tokens, or only up to the SWA branch point its lookup set (SWA
        without Mamba: `SWAComponent.prepare_for_caching_req`)."""
        if not isinstance(op, Finish):
            return None
        run = d.running.get(op.rid)
        if run is None or run.prefilled < len(run.tokens):
            return None
        kv = run.req.kv
        cached, protected, swa_freed = int(kv.kv_committed_len), int(kv.cache_protected_len), 0
        if self.layout.has_swa:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

            swa_freed = int(kv.get_evicted_seqlen(ComponentType.SWA))
            branch = run.req.swa_branching_seqlen
            if not self.layout.has_mamba and branch is not None and protected < branch <= cached:
                cached = int(branch)
        seq = tuple(run.tokens) + tuple(run.decoded)
        return seq, cached, protected, swa_freed, run.namespace if d.passes_identity else DEFAULT_NAMESPACE

    def _effective_request(self, op: Evict) -> tuple[int, int, int]:
        """What an eviction asks of the components this layout has (others are ignored by SGLang)."""
        return (op.full, op.swa if self.layout.has_swa else 0, op.mamba if self.layout.has_mamba else 0)

    def _core_checks(
        self,
        core: str,
        op: RadixOp,
        res: OpResult,
        before: TreeView,
        promise: tuple[tuple[int, ...], int, int, int, Namespace] | None,
    ) -> list[Violation]:
        """Judge one core on its own tree: eviction scope and (full attention) the LRU order
        predicted from the model's recency (`model/radix/recency.py`, `model/radix/evict.py`),
        and a finished request's promised hit. Then advance the model's recency."""
        d = self.drivers[core]
        after = self.reader.core_view(d)
        self._core_views[core] = after
        rec = self._recency.get(core, {})
        out: list[Violation] = []
        first = core == self.cores[0]
        if isinstance(op, Evict) and res.evicted is not None:
            request = self._effective_request(op)
            if sum(1 for x in request if x) == 1:
                self.coverage["evict_judged"] += first
                msgs = inv.radix_eviction_scope(before, after, request)
                out += [("radix_eviction_scope", f"[{core}] {m}") for m in msgs]
                if request[0]:
                    timed = _with_recency(before, rec)
                    msgs = inv.radix_full_eviction_matches_model(timed, after, request[0], res.evicted[0])
                    out += [("radix_full_eviction_matches_model", f"[{core}] {m}") for m in msgs]
            elif any(request):
                self.coverage["evict_unjudged"] += first  # several components at once: not predicted
        if promise is not None:
            seq, cached, own_from, swa_freed, namespace = promise
            claimed = inv.finished_prefix_promised(cached, own_from, swa_freed, self.layout)
            self.coverage["promise_checked" if claimed else "promise_unclaimed"] += first
            msgs = inv.radix_finished_prefix_promise(
                after, seq, cached, own_from, swa_freed, self.layout, namespace
            )
            out += [("radix_finished_prefix_promise", f"[{core}] {m}") for m in msgs]
        calls = [(c.kind, c.path, c.walked) for c in d.tree_calls]
        self._recency[core] = advance(
            rec, set(before.nodes), after, calls, self.checked_ops, self.layout.has_mamba
        )
        return out

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
                self._finished_namespace = (
                    run.namespace if self.primary.passes_identity else DEFAULT_NAMESPACE
                )

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
