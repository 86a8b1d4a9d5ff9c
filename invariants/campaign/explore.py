"""Exhaustive search on Ray: the frontier partitioned by fingerprint, each state expanded once.

Contract of `explore_on_ray(session, instance, target, limits)`: the certificate
`invariants.explore.search.explore` writes for the same arguments, field for
field but the time: the distinct states first reached at each depth, the
states, transitions and transitions by kind, the known findings tolerated (by
id, with counts and first message), the paths pruned, why the search stopped,
the fork checks, and a violation's shortest path, written as the same trace.

How: `session.workers` shards (Ray actors). Shard i owns the states whose
fingerprint routes to i (`route(state) % n`, a hash that is the same in every
process, unlike `hash()`). The search is level-synchronous:
at each depth every shard expands the frontier states it owns exactly as the
one-process search expands one (the same alphabet, checker, tolerance and
fingerprint; thawed once and restored in place between operations, or thawed
per operation, as `restore` says: `invariants.explore.undo.Revisit`), and
sends each successor's fingerprint to its owner (each part once per pair of
shards: `invariants.campaign.wire`); the owner drops those it has seen and
keeps, for each new one, the candidate with the least *key* (the operation
indices along its path); the producer then ships the kept states (a frozen
checker, `invariants.campaign.portable` where the state changes worker) to
their owners, which expand them at the next depth. A producer offers (and
freezes) a fingerprint at most once per search: its owner holds it after.

Why that is the one-process run: the one-process search appends a layer in
the order of its parents and then of the alphabet, so by induction a layer is
in key order and a state is first reached through the least key among its
candidates; the owners keep exactly that one (its path, its frozen checker).
Where the one-process search stops inside a layer (a violation, the state
bound) the campaign finds the key it stops at (the least violating key, the
state bound's new state in key order) and counts only what comes before it
(each shard keeps its layer's transitions by key). A budget stop is timing,
not the search: there the counts are what was done, as the one-process run's are.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.campaign import Session
from invariants.campaign.portable import Portable
from invariants.campaign.route import route_kept
from invariants.campaign.wire import Receiver, Sender
from invariants.explore.alphabet import alphabet, op_kind
from invariants.explore.certificate import Certificate
from invariants.explore.fingerprint import HIDDEN_STATE, fingerprint, merging
from invariants.explore.fork import Freezer
from invariants.explore.grid import MIN_SHARE_S, GridReport
from invariants.explore.instances import Instance
from invariants.explore.search import RESTORES, Limits, new_checker, replay, steps_text, unavailable
from invariants.explore.undo import Revisit
from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.known_findings import explain
from invariants.harness.trace import Trace, write_trace
from invariants.report import Progress
from invariants.targets import target_factory
from invariants.targets.base import Target
from model.contract.config import Config, ConfigError
from model.contract.ops import AddRequest, Op

Key = tuple[int, ...]
"""A state's place in the one-process search: the alphabet index of each operation on its path."""
Factory = Callable[[Config], Target]


class CampaignError(Exception):
    """The campaign cannot run as promised."""


@dataclass
class _Node:
    key: Key
    path: tuple[Op, ...]
    frozen: bytes
    next_rid: int
    diverged: bool
    state: Hashable


@dataclass
class LayerSummary:
    """What one shard's expansion of one depth did (up to its first violation)."""

    transitions: int = 0
    op_kinds: Counter[str] = field(default_factory=Counter)
    # finding id -> (violations tolerated, the key of the first, the first violation)
    known: dict[str, tuple[int, Key, Violation]] = field(default_factory=dict)
    found: tuple[Key, tuple[Op, ...], list[Violation]] | None = None
    expanded: int = 0
    frontier: int = 0
    cut: bool = False  # the deadline passed mid-layer
    # the first expanded state whose checker live restore could not record: its key, why
    unrestorable: tuple[Key, str] | None = None


class _Cut(Exception):
    pass


class _Found(Exception):
    pass


def _state_of(checker: Checker, diverged: bool, rename: bool, image: Any) -> Hashable:
    """The fingerprint the one-process search takes (`invariants.explore.search`)."""
    target = checker.target
    return fingerprint(
        checker.model,
        checker.history,
        checker.last if diverged else None,
        rename=rename,
        hidden=(lambda names: image(target, names)) if image is not None else None,
    )


def _valid(checker: Checker) -> Callable[[Op], bool]:
    def valid(op: Op) -> bool:
        try:
            checker.validate(op)
        except InvalidOp:
            return False
        return True

    return valid


class Shard:
    """One worker's part of the search: the states it owns (seen and frontier), and the
    successors it produced this depth until their owners take them. A plain class (Ray
    wraps it as an actor), so a test can drive shards in one process."""

    def __init__(self, index: int, n: int) -> None:
        self.index, self.n = index, n

    def reset(
        self,
        instance: Instance,
        target: str,
        factory: Factory | None = None,
        hidden_state: bool = True,
        restore: str = "live",
    ) -> None:
        """Start a new search (the worker process, and what it imported, stay); `restore`
        as the one-process search's (`invariants.explore.search.RESTORES`)."""
        self.instance, self.target, self.restore = instance, target, restore
        gc.unfreeze()  # the last search's states: garbage now, back in the collector's sight
        self.factory = factory or target_factory(target)
        self.image = HIDDEN_STATE.get(target) if hidden_state else None
        self.rename = not instance.vocabulary
        self.freezer, self.portable = Freezer(), Portable()
        self.memo: dict[Any, int] = {}
        self.seen: set[Hashable] = set()
        # Every successor this shard offered its owner, at any depth: the owner has it now
        # (kept, or seen before), so reaching it again is never offered nor frozen again.
        self.offered: set[Hashable] = set()
        self.frontier: list[_Node] = []
        self.kept: list[_Node] = []  # won by this shard's own successors: the next frontier's part
        # The fingerprints offered to each other shard, and received from each (`wire`).
        self.senders = [Sender() for _ in range(self.n)]
        self.receivers = [Receiver() for _ in range(self.n)]
        self._reset_layer()

    def _reset_layer(self) -> None:
        self.pending: dict[Key, tuple[tuple[Op, ...], bytes, int, bool, Hashable]] = {}
        self.outbox: list[list[tuple[Key, Hashable]]] = [[] for _ in range(self.n)]
        self.log: list[tuple[Key, str, tuple[str, ...]]] = []
        self.summary = LayerSummary()
        self.winners: list[Key] = []
        self.won: dict[Key, Hashable] = {}  # as owner: the new states this depth, by key

    def owner(self, state: Hashable) -> int:
        """The shard that owns `state`. Routed on the fingerprint's second part where it
        has one (the checker's history image, `invariants.explore.fingerprint`): equal
        states have equal parts, and it costs a quarter of routing the whole."""
        if self.n == 1:
            return 0
        part = state[1] if type(state) is tuple and len(state) > 1 else state
        return route_kept(part, self.memo) % self.n

    def root(self) -> tuple[bool, bool]:
        """Build the empty allocator; keep it when this shard owns its fingerprint. Returns
        (owned, whether the target's engine decides every step: the certificate's `steps`)."""
        checker = new_checker(self.factory, self.instance.config)
        engine = checker.target.features.engine_steps
        state = _state_of(checker, False, self.rename, self.image)
        if self.owner(state) != self.index:
            return False, engine
        self.seen.add(state)
        self.frontier = [_Node((), (), self.freezer.freeze(checker), 0, False, state)]
        return True, engine

    # ------------------------------------------------------------ one depth
    def expand(self, leaves: bool, left_s: float | None) -> tuple[Any, ...]:
        """Expand every frontier state this shard owns, in key order, up to its first
        violation or `left_s` seconds; (summary, then per owner its candidates (key, state))."""
        self._reset_layer()
        # What this shard keeps from depth to depth (seen states, parts received, the frontier)
        # is no garbage: out of the collector's sight, a collection stays cheap (measured at
        # depth 6 on the model: a quarter to a third of the workers' CPU went to collections without it).
        gc.collect()
        gc.freeze()
        deadline = None if left_s is None else time.monotonic() + left_s
        s = self.summary
        s.frontier = len(self.frontier)
        try:
            for node in self.frontier:
                self._children(node, leaves, deadline)
                s.expanded += 1
        except _Cut:
            s.cut = True
        except _Found:
            pass
        # Its own candidates stay here for `dedup` (no copy through Ray's object store).
        boxes = [[] if i == self.index else self.senders[i].encode(box) for i, box in enumerate(self.outbox)]
        return (s, *boxes)

    def _children(self, node: _Node, leaves: bool, deadline: float | None) -> None:
        """As the one-process search's (`search._Search._children`): thawed once, restored
        in place between operations where `restore` is live and the checker recordable."""
        parent = Revisit(self.freezer, node.frozen)
        base = parent.base
        ops = alphabet(
            self.instance,
            base.model,
            node.next_rid,
            _valid(base),
            base.target.features.real_scheduler,
            base.target.features.engine_steps,
        )
        if len(ops) > 1 and self.restore == "live":
            why = parent.arm()
            if why is not None:
                self.restore = unavailable(why)
                self.summary.unrestorable = (node.key, why)
        for j, op in enumerate(ops):
            if deadline is not None and time.monotonic() > deadline:
                raise _Cut
            state = self._step(node, parent.checker(), op, (*node.key, j), leaves)
            if state != node.state:
                parent.moved()

    def _step(self, node: _Node, checker: Checker, op: Op, key: Key, leaves: bool) -> Hashable:
        path = (*node.path, op)
        try:
            found = checker.step(op)
        except Exception as exc:  # the model itself raised: a finding about the specification
            found = [Violation("crash", f"model: {type(exc).__name__}: {exc}", checker.config, op)]
        s = self.summary
        s.transitions += 1
        kind = op_kind(op)
        s.op_kinds[kind] += 1
        diverged = node.diverged
        new, fids = [], []
        for v in found:
            finding = explain(self.target, v)
            if finding:
                fid = str(getattr(finding, "id", v.check))
                fids.append(fid)
                count, first, first_v = s.known.get(fid, (0, key, v))
                s.known[fid] = (count + 1, first, first_v)
                diverged = True
            else:
                new.append(v)
        self.log.append((key, kind, tuple(fids)))
        if new:
            s.found = (key, path, new)
            raise _Found
        if any(v.check == "crash" for v in found):
            return object()  # a tolerated crash leaves the target's state undefined
        state = _state_of(checker, diverged, self.rename, self.image)
        if state in self.offered or state in self.seen:
            return state  # offered before (this depth with a smaller key, or earlier), or seen here
        self.offered.add(state)
        owner = self.owner(state)
        data = b"" if leaves else self._frozen(checker, local=owner == self.index)
        self.pending[key] = (path, data, node.next_rid + isinstance(op, AddRequest), diverged, state)
        self.outbox[owner].append((key, state))
        return state

    def _frozen(self, checker: Checker, local: bool) -> bytes:
        """This shard's own freeze, or bytes any worker can load (`portable`: what the
        local freezer shares by reference, by name or by value)."""
        if local or self.freezer.plain:
            return self.freezer.freeze(checker)
        return self.portable.freeze(checker)

    def dedup(self, *offers: list[tuple[Key, Hashable]]) -> tuple[Any, ...]:
        """As owner: of every producer's candidates, the new states, each with its least
        key; (how many, then per producer the keys it must ship here)."""
        best: dict[Hashable, tuple[Key, int]] = {}
        for producer, offered in enumerate(offers):
            if producer == self.index:
                candidates = self.outbox[self.index]
            else:
                candidates = self.receivers[producer].decode(offered)
            for key, state in candidates:
                if state in self.seen:
                    continue
                mine = best.get(state)
                if mine is None or key < mine[0]:
                    best[state] = (key, producer)
        self.seen.update(best)
        wanted: list[list[Key]] = [[] for _ in range(self.n)]
        self.won = {}
        for state, (key, producer) in best.items():
            wanted[producer].append(key)
            self.won[key] = state
        self.winners = sorted(self.won)
        return (len(best), *wanted)

    def ship(self, *wanted: list[Key]) -> Any:
        """As producer: the successors each owner kept (its own stay here)."""
        out: list[list[tuple[Any, ...]]] = [[] for _ in range(self.n)]
        self.kept = []
        for owner, keys in enumerate(wanted):
            for key in keys:
                path, data, rid, diverged, state = self.pending[key]
                if owner == self.index:
                    self.kept.append(_Node(key, path, data, rid, diverged, state))
                else:  # the owner has its fingerprint (`dedup`)
                    out[owner].append((key, path, data, rid, diverged))
        self.pending = {}
        return tuple(out) if self.n > 1 else out[0]  # one return value: the list itself

    def adopt(self, *shipped: list[tuple[Any, ...]]) -> int:
        """As owner: the next frontier, in key order (a shipped checker kept as it came:
        `Freezer.thaw` loads plain and `portable` bytes alike)."""
        nodes = list(self.kept)
        for batch in shipped:
            for key, path, data, rid, diverged in batch:
                nodes.append(_Node(key, path, data, rid, diverged, self.won[key]))
        nodes.sort(key=lambda node: node.key)
        self.frontier, self.kept, self.won = nodes, [], {}
        return len(nodes)

    # ------------------------------------------------------------ a stop inside a layer
    def cpu(self) -> float:
        """This worker process's CPU seconds so far (its Ray threads included)."""
        return time.process_time()

    def winner_keys(self) -> list[Key]:
        return self.winners

    def tally(self, stop: Key) -> tuple[LayerSummary, int]:
        """This layer's figures up to and including the transition at `stop`, and the
        new states (as owner) first reached before it."""
        s = LayerSummary()
        firsts = self.summary.known
        for key, kind, fids in self.log:
            if key > stop:
                break
            s.transitions += 1
            s.op_kinds[kind] += 1
            for fid in fids:
                count, first, first_v = s.known.get(fid, (0, firsts[fid][1], firsts[fid][2]))
                s.known[fid] = (count + 1, first, first_v)
        parent = stop[:-1]
        s.expanded = sum(node.key < parent for node in self.frontier)
        gave_up = self.summary.unrestorable
        s.unrestorable = gave_up if gave_up is not None and gave_up[0] <= parent else None
        return s, sum(k < stop for k in self.winners)

    # ------------------------------------------------------------ the fork check
    def edges(self) -> list[Key]:
        """The least and greatest key of this shard's frontier (none when empty)."""
        return [self.frontier[0].key, self.frontier[-1].key] if self.frontier else []

    def fork_differs(self, key: Key) -> str | None:
        """Compare the thawed frontier state `key` with a re-execution of its path."""
        node = next(n for n in self.frontier if n.key == key)
        thawed = self.freezer.thaw(node.frozen)
        tolerate = lambda v: explain(self.target, v)  # noqa: E731
        fresh, _ = replay(self.factory, self.instance.config, node.path, tolerate)
        if thawed.target.snapshot() != fresh.target.snapshot():
            return f"the target's snapshot after {len(node.path)} operations differs from re-execution"
        a = _state_of(thawed, node.diverged, self.rename, self.image)
        if a != _state_of(fresh, node.diverged, self.rename, self.image):
            return f"the fingerprint after {len(node.path)} operations differs from re-execution"
        return None


def _merge(into: LayerSummary, s: LayerSummary) -> None:
    into.transitions += s.transitions
    into.op_kinds.update(s.op_kinds)
    into.expanded += s.expanded
    into.frontier += s.frontier
    into.cut |= s.cut
    for fid, (count, first, v) in s.known.items():
        mine = into.known.get(fid)
        if mine is None:
            into.known[fid] = (count, first, v)
        else:
            into.known[fid] = (mine[0] + count, *min((mine[1], mine[2]), (first, v), key=lambda x: x[0]))
    if s.found is not None and (into.found is None or s.found[0] < into.found[0]):
        into.found = s.found
    if s.unrestorable is not None and (into.unrestorable is None or s.unrestorable < into.unrestorable):
        into.unrestorable = s.unrestorable


def _record(cert: Certificate, layer: LayerSummary) -> None:
    """Add a layer's figures to the certificate (a finding's first message: the earliest;
    live restore given up at the layer's first state it could not record)."""
    cert.transitions += layer.transitions
    if cert.restore == "live" and layer.unrestorable is not None:
        cert.restore = unavailable(layer.unrestorable[1])
    cert.op_kinds.update(layer.op_kinds)
    for fid in sorted(layer.known, key=lambda f: layer.known[f][1]):
        count, _, v = layer.known[fid]
        if fid not in cert.known.entries:
            cert.known.record(fid, v)
            count -= 1
        cert.known.entries[fid].count += count


# Seconds a campaign waits for its workers to start, and for Ray to free them after.
START_TIMEOUT_S = 120.0
CLOSE_WAIT_S = 10.0


def _get(refs: Any) -> Any:
    import ray

    try:
        return ray.get(refs)
    except Exception as exc:  # a worker's exception arrives wrapped; a refusal is the target's
        cause = getattr(exc, "cause", None)
        raise (cause if isinstance(cause, ConfigError) else exc) from None


class Driver:
    """The shards of one campaign (a worker process each, kept from instance to instance)."""

    def __init__(self, session: Session, shard: type[Shard] = Shard) -> None:
        import ray

        self.n = session.workers
        actor = ray.remote(num_cpus=1)(shard)
        self.shards: list[Any] = [actor.remote(i, self.n) for i in range(self.n)]  # type: ignore[attr-defined]
        self._placed(ray)
        # CPU seconds of the workers: the busiest one's per depth summed (the search's critical
        # path on dedicated cores), and all of them; what the figure reads on a shared machine.
        self.critical_cpu_s = self.total_cpu_s = 0.0
        self._cpu: list[float] = []

    def cpu_mark(self) -> None:
        """Add the workers' CPU seconds since the last mark (a depth) to the two sums."""
        now = _get([s.cpu.remote() for s in self.shards])
        if self._cpu:
            spent = [b - a for a, b in zip(self._cpu, now)]
            self.critical_cpu_s += max(spent)
            self.total_cpu_s += sum(spent)
        self._cpu = now

    def start(
        self, instance: Instance, target: str, limits: Limits, factory: Factory | None, restore: str = "live"
    ) -> None:
        self.instance, self.limits = instance, limits
        _get([s.reset.remote(instance, target, factory, True, restore) for s in self.shards])

    def _placed(self, ray: Any) -> None:
        """Wait for every worker to start: a worker Ray cannot place (its CPUs taken) would
        leave every later call waiting forever, so it is one clear error instead."""
        try:
            ray.get([s.cpu.remote() for s in self.shards], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get("CPU", 0)
            self.close()
            raise CampaignError(
                f"{self.n} Ray workers (1 CPU each) did not start within {START_TIMEOUT_S:.0f} s; "
                f"the instance has {free:g} CPU(s) free"
            ) from None

    def close(self) -> None:
        """Kill the workers and wait (a few seconds at most) for Ray to free their CPUs,
        so that the next campaign on this instance can place its own."""
        import ray

        for s in self.shards:
            ray.kill(s)
        deadline = time.monotonic() + CLOSE_WAIT_S
        total = ray.cluster_resources().get("CPU", 0)
        while time.monotonic() < deadline and ray.available_resources().get("CPU", 0) < min(self.n, total):
            time.sleep(0.05)

    def expand(self, leaves: bool) -> tuple[LayerSummary, list[LayerSummary], int, list[Any]]:
        n = self.n
        end = self.limits.deadline  # the driver's clock; a worker's may differ (another machine)
        left = None if end is None else max(end - time.monotonic(), 0.0)
        outs = [s.expand.options(num_returns=n + 1).remote(leaves, left) for s in self.shards]
        dedup = [
            self.shards[j].dedup.options(num_returns=n + 1).remote(*[outs[i][j + 1] for i in range(n)])
            for j in range(n)
        ]
        parts: list[LayerSummary] = _get([o[0] for o in outs])
        new = sum(_get([d[0] for d in dedup]))
        total = LayerSummary()
        for p in parts:
            _merge(total, p)
        return total, parts, new, dedup

    def advance(self, dedup: list[Any]) -> int:
        n = self.n
        ships = []
        for i, s in enumerate(self.shards):
            refs = s.ship.options(num_returns=n).remote(*[dedup[j][i + 1] for j in range(n)])
            ships.append(refs if n > 1 else [refs])
        return sum(_get([self.shards[j].adopt.remote(*[ships[i][j] for i in range(n)]) for j in range(n)]))

    def stop_at_state_bound(self, seen: int, new: int) -> Key | None:
        """The key of the new state the one-process search would stop at (None: not reached)."""
        room = self.limits.max_states - seen
        if new <= room:
            return None
        keys = sorted(k for ks in _get([s.winner_keys.remote() for s in self.shards]) for k in ks)
        return keys[room]

    def tally(self, stop: Key) -> tuple[LayerSummary, int]:
        total, new = LayerSummary(), 0
        for s, n in _get([s.tally.remote(stop) for s in self.shards]):
            _merge(total, s)
            new += n
        return total, new

    def fork_checks(self, cert: Certificate) -> None:
        """The one-process search's: the last, then the first state of the last frozen layer."""
        edges = _get([s.edges.remote() for s in self.shards])
        owned = [(k, i) for i, ks in enumerate(edges) for k in ks]
        if not owned:
            return
        first, last = min(owned), max(owned)
        samples = [last] + ([first] if first != last else [])
        for key, i in samples:
            if not key:
                continue  # the empty path: nothing to compare
            cert.fork_checks += 1
            cert.error = cert.error or _get(self.shards[i].fork_differs.remote(key))


def explore_on_ray(
    session: Session,
    instance: Instance,
    target: str,
    limits: Limits,
    *,
    factory: Factory | None = None,
    out_dir: Path | None = None,
    progress: Progress | None = None,
    driver: Driver | None = None,
    restore: str = "live",
) -> Certificate:
    """Search `instance` on `session`'s workers; the certificate (see the module docstring).
    `factory` replaces the target's constructor (Ray pickles it to the workers). `driver`:
    shards already started (their start-up is then not in the certificate's time).
    `restore`: as the one-process search's (`invariants.explore.search.RESTORES`)."""
    _known(restore)
    own = driver is None
    shards = driver or Driver(session)
    try:
        return _explore(shards, instance, target, limits, factory, out_dir, progress, restore)
    finally:
        if own:
            shards.close()


def _explore(
    driver: Driver,
    instance: Instance,
    target: str,
    limits: Limits,
    factory: Factory | None,
    out_dir: Path | None,
    progress: Progress | None,
    restore: str,
) -> Certificate:
    cert = Certificate(instance.name, target, limits.depth)
    cert.merging = merging(target if target in HIDDEN_STATE else "")
    cert.restore = restore
    start = time.monotonic()
    driver.start(instance, target, limits, factory, restore)
    try:
        roots = _get([s.root.remote() for s in driver.shards])
        if not any(owned for owned, _ in roots):
            raise CampaignError("no worker owns the initial state")
        cert.steps = steps_text(roots[0][1], instance.config)
        _search(driver, cert, target, factory, out_dir, progress, start)
        driver.cpu_mark()
    except ConfigError as exc:  # raised building the target: it refuses this configuration
        cert.skipped = f"{target} refuses this configuration: {exc}"
        cert.states, cert.new_states = 0, []
    cert.seconds = time.monotonic() - start
    return cert


def _search(
    driver: Driver,
    cert: Certificate,
    target: str,
    factory: Factory | None,
    out_dir: Path | None,
    progress: Progress | None,
    start: float,
) -> None:
    limits, instance = driver.limits, driver.instance
    seen = 1
    for depth in range(1, limits.depth + 1):
        driver.cpu_mark()
        leaves = depth == limits.depth
        layer, _, new, dedup = driver.expand(leaves)
        if progress is not None:
            rate = (seen + new) / max(time.monotonic() - start, 1e-9)
            progress.tick(
                f"{instance.name}: depth {depth} on {driver.n} workers, frontier {layer.frontier}, "
                f"states {seen + new}, transitions {cert.transitions + layer.transitions}, {rate:.0f} states/s"
            )
        bound = driver.stop_at_state_bound(seen, new)
        stops = [k for k in (layer.found[0] if layer.found else None, bound) if k is not None]
        if stops:
            stop = min(stops)
            part, before = driver.tally(stop)
            _record(cert, part)
            cert.states = seen + before
            if layer.found is not None and stop == layer.found[0]:
                _counterexample(cert, instance, target, factory, layer.found, out_dir)
                return
            cert.stopped = (
                f"max states ({limits.max_states}) reached in depth {depth} "
                f"({part.expanded} of {layer.frontier} states expanded)"
            )
            driver.fork_checks(cert)
            return
        _record(cert, layer)
        seen += new
        cert.states = seen
        if layer.cut:
            cert.stopped = (
                f"budget spent in depth {depth} ({layer.expanded} of {layer.frontier} states expanded)"
            )
            driver.fork_checks(cert)
            return
        cert.depth_completed = depth
        cert.new_states.append(new)
        if not new:
            cert.stopped = f"exhausted at depth {depth}: no new state, every depth covered"
            cert.depth_completed = limits.depth
            driver.fork_checks(cert)
            return
        if not leaves:
            driver.advance(dedup)
    cert.stopped = "depth reached"
    driver.fork_checks(cert)


def _known(restore: str) -> None:
    if restore not in RESTORES:
        raise ValueError(f"restore must be one of {RESTORES}, got {restore!r}")


def _counterexample(
    cert: Certificate,
    instance: Instance,
    target: str,
    factory: Factory | None,
    found: tuple[Key, tuple[Op, ...], list[Violation]],
    out_dir: Path | None,
) -> None:
    """As the one-process search writes it: the shortest path, re-run from scratch."""
    _, path, violations = found
    cert.violation = "; ".join(str(v) for v in violations[:3])
    cert.trace_length = len(path)
    cert.path, cert.found = path, list(violations)
    cert.stopped = f"violation at depth {len(path)}"
    cert.depth_completed = len(path) - 1
    build = factory or target_factory(target)
    _, again = replay(build, instance.config, path, lambda v: explain(target, v))
    cert.reproduced = bool(again)
    if out_dir is not None:
        trace = Trace(instance.config, list(path), None, target, str(violations[0]))
        cert.trace = write_trace(trace, out_dir / f"kvretain-explore-{target}-{instance.name}.json")


def explore_grid_on_ray(
    session: Session,
    instances: list[Instance],
    target: str,
    *,
    depth: int,
    max_states: int,
    budget_s: float | None,
    out_dir: Path | None = None,
    progress: Progress | None = None,
    factory: Factory | None = None,
    restore: str = "live",
) -> GridReport:
    """Each instance in turn on every worker, the budget shared as `explore_grid` shares it
    (an equal share of what is left; an instance no time is left for is listed as skipped)."""
    _known(restore)
    report = GridReport(target)
    start = time.monotonic()
    end = start + budget_s if budget_s is not None else None
    driver = Driver(session)
    try:
        _grid(
            driver, report, instances, target, (depth, max_states, end, restore), out_dir, progress, factory
        )
    finally:
        driver.close()
    report.seconds = time.monotonic() - start
    return report


def _grid(
    driver: Driver,
    report: GridReport,
    instances: list[Instance],
    target: str,
    bounds: tuple[int, int, float | None, str],
    out_dir: Path | None,
    progress: Progress | None,
    factory: Factory | None,
) -> None:
    depth, max_states, end, restore = bounds
    for i, instance in enumerate(instances):
        deadline = None
        if end is not None:
            share = (end - time.monotonic()) / (len(instances) - i)
            if share < MIN_SHARE_S:
                cert = Certificate(instance.name, target, depth, depth_completed=0, states=0, new_states=[])
                cert.skipped = "the time budget was spent"
                report.certificates.append(cert)
                continue
            deadline = time.monotonic() + share
        limits = Limits(depth, max_states, deadline)
        cert = _explore(driver, instance, target, limits, factory, out_dir, progress, restore)
        report.certificates.append(cert)
