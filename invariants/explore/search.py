"""Breadth-first search over every operation sequence of a small instance.

Contract of `explore(instance, factory, ...)`: starting from an empty
allocator, every operation of the alphabet (`invariants.explore.alphabet`) is
applied to every state of depth d before any of depth d + 1, through the
`Checker` with a full audit on every operation (the model differential on
observation and snapshot, then every invariant of the catalogue). A state
whose fingerprint (`invariants.explore.fingerprint`) was seen before is not
expanded again. The first violation that no known finding explains ends the
search: its path is a shortest one (every shorter sequence was checked first),
written as an ordinary replayable trace and re-run from scratch to confirm it.
Known findings are tolerated exactly as fuzzing tolerates them (`tolerate`,
by default `known_findings.explain`) and counted in the certificate.

The search stops at `depth`, at `max_states` distinct states, or at the
deadline, whichever comes first, and the certificate says which (a partial
layer is never counted as a completed depth). Once per instance a frozen
fork is compared with a re-execution of its path from scratch (snapshot and
fingerprint, hidden state included).

Each expanded state is thawed from its frozen fork once; between the
operations tried from it the copy is restored in place (`restore="live"`,
`invariants.explore.undo`), or thawed afresh for each (`restore="pickle"`,
the definition). Both try the same operations on the same states in the same
order, so the certificate is the same (`tests/test_explore_restore.py`).

On a target whose hidden state has an image (`fingerprint.HIDDEN_STATE`) that
image is part of every fingerprint; the certificate's `merging` says what
merging assumed either way, and `op_kinds` counts the transitions per
operation kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path

from invariants.explore.alphabet import alphabet, op_kind
from invariants.explore.certificate import Certificate
from invariants.explore.fingerprint import HIDDEN_STATE, fingerprint, merging
from invariants.explore.fork import Freezer
from invariants.explore.instances import Instance
from invariants.explore.undo import Revisit
from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.known_findings import explain
from invariants.harness.trace import Trace, write_trace
from invariants.report import Progress
from invariants.targets.base import Target
from invariants.targets.vllm_hidden_state import HiddenState
from model.contract.config import Config, ConfigError
from model.contract.ops import AddRequest, Op
from model.policy.scheduling import build_budget

Tolerate = Callable[[Violation], object]
"""A violation -> the known finding explaining it (its `id` is counted), or None."""
Wanted = Callable[[Violation], bool]
"""Which new violations end the search; any other prunes its path (counted)."""

RESTORES = ("live", "pickle")
"""How the search returns to a state to try its next operation: `live` thaws the frozen
state once and restores that copy in place between its operations
(`invariants.explore.undo.Checkpoint`); `pickle` thaws a fresh copy for each (the
definition, kept for comparison: `kvretain explore --restore pickle`, `--bench`). Both
search the same states in the same order: the certificate is the same."""


def unavailable(why: str) -> str:
    """The certificate's `restore` once live restore fell back to thawing (`why`: the
    object `undo.Checkpoint` could not record)."""
    return f"pickle (live restore unavailable: {why})"


@dataclass(frozen=True)
class Limits:
    """How far one instance's search may go; `deadline` is a `time.monotonic()` value,
    which `moved` (when given) may only put later while the search runs: a grid's shared
    budget (`invariants.explore.grid.Shares`), read once `deadline` has passed."""

    depth: int
    max_states: int = 50_000
    deadline: float | None = None
    moved: Callable[[], float] | None = None

    def spent(self, now: float) -> bool:
        """Whether the time is up at `now` (`time.monotonic()`)."""
        if self.deadline is None or now <= self.deadline:
            return False
        return self.moved is None or now > self.moved()


@dataclass
class _Node:
    path: tuple[Op, ...]
    frozen: bytes
    next_rid: int
    diverged: bool  # a tolerated finding on the path: the target's state joins the fingerprint
    state: Hashable  # its fingerprint


class _Stop(Exception):
    """The search ends early; the message says why."""


class _Found(Exception):
    def __init__(self, path: tuple[Op, ...], violations: list[Violation]) -> None:
        super().__init__(str(violations[0]))
        self.path, self.violations = path, violations


def new_checker(factory: Callable[[Config], Target], config: Config) -> Checker:
    """A checker that audits every operation (the definition, not the fast path)."""
    return Checker(factory(config), audit_every=1)


def _state_of(
    checker: Checker, diverged: bool, rename: bool = True, image: HiddenState | None = None
) -> Hashable:
    """The fingerprint of `checker`'s state; with `image`, its target's hidden state too."""
    target = checker.target
    return fingerprint(
        checker.model,
        checker.history,
        checker.last if diverged else None,
        rename=rename,
        hidden=(lambda names: image(target, names)) if image is not None else None,
    )


def _is_valid(checker: Checker) -> Callable[[Op], bool]:
    def valid(op: Op) -> bool:
        try:
            checker.validate(op)
        except InvalidOp:
            return False
        return True

    return valid


class _Search:
    def __init__(
        self,
        instance: Instance,
        factory: Callable[[Config], Target],
        cert: Certificate,
        limits: Limits,
        tolerate: Tolerate,
        progress: Progress | None,
        wanted: Wanted | None = None,
        image: HiddenState | None = None,
    ) -> None:
        self.instance, self.factory, self.cert = instance, factory, cert
        self.image = image
        self.limits, self.tolerate, self.progress = limits, tolerate, progress
        self.wanted = wanted
        self.rename = not instance.vocabulary
        self.freezer = Freezer()
        self.seen: set[Hashable] = set()
        self.start = time.monotonic()
        self.leaves = False

    def run(self) -> list[_Node]:
        """Search layer by layer; returns the deepest layer whose states were kept frozen."""
        root = new_checker(self.factory, self.instance.config)
        self.cert.steps = steps_text(root.target.features.engine_steps, self.instance.config)
        state = _state_of(root, False, self.rename, self.image)
        self.seen.add(state)
        frontier = [_Node((), self.freezer.freeze(root), 0, False, state)]
        for depth in range(1, self.limits.depth + 1):
            self.leaves = depth == self.limits.depth  # never expanded: not frozen
            layer: list[_Node] = []
            for i, node in enumerate(frontier):
                self._tick(depth, i, len(frontier))
                try:
                    layer += self._children(node)
                except _Stop as stop:
                    self.cert.stopped = f"{stop} in depth {depth} ({i} of {len(frontier)} states expanded)"
                    return frontier
            self.cert.depth_completed = depth
            self.cert.new_states.append(len(layer))
            if not layer:
                self.cert.stopped = f"exhausted at depth {depth}: no new state, every depth covered"
                self.cert.depth_completed = self.limits.depth
                return frontier
            if not self.leaves:
                frontier = layer
        self.cert.stopped = "depth reached"
        return frontier

    def _tick(self, depth: int, i: int, n: int) -> None:
        if self.progress is None:
            return
        elapsed = time.monotonic() - self.start
        rate = len(self.seen) / elapsed if elapsed > 0 else 0.0
        self.progress.tick(
            f"{self.instance.name}: depth {depth}, frontier {i}/{n}, states {len(self.seen)}, "
            f"transitions {self.cert.transitions}, {rate:.0f} states/s"
        )

    def _children(self, node: _Node) -> list[_Node]:
        """Try every operation from `node`; the new states it reaches."""
        parent = Revisit(self.freezer, node.frozen)
        base = parent.base
        ops = alphabet(
            self.instance,
            base.model,
            node.next_rid,
            _is_valid(base),
            base.target.features.real_scheduler,
            base.target.features.engine_steps,
        )
        if len(ops) > 1 and self.cert.restore == "live":
            why = parent.arm()
            if why is not None:
                self.cert.restore = unavailable(why)
        out = []
        for op in ops:
            if self.limits.spent(time.monotonic()):
                raise _Stop("budget spent")
            child, state = self._step(node, parent.checker(), op)
            if child is not None:
                out.append(child)
            if state != node.state:
                parent.moved()
        return out

    def _step(self, node: _Node, checker: Checker, op: Op) -> tuple[_Node | None, Hashable]:
        """Apply `op`; the child when its state is new, and its fingerprint."""
        path = (*node.path, op)
        try:
            found = checker.step(op)
        except Exception as exc:  # the model itself raised: a finding about the specification
            found = [Violation("crash", f"model: {type(exc).__name__}: {exc}", checker.config, op)]
        self.cert.transitions += 1
        self.cert.op_kinds[op_kind(op)] += 1
        diverged = node.diverged
        new = []
        for v in found:
            finding = self.tolerate(v)
            if finding:
                self.cert.known.record(str(getattr(finding, "id", v.check)), v)
                diverged = True
            else:
                new.append(v)
        if new:
            if self.wanted is None or any(self.wanted(v) for v in new):
                raise _Found(path, new)
            self.cert.other_violations += 1
            return None, object()  # pruned: a different defect; the checker moved on
        if any(v.check == "crash" for v in found):
            return None, object()  # a tolerated crash leaves the target's state undefined, as fuzzing halts
        state = _state_of(checker, diverged, self.rename, self.image)
        if state in self.seen:
            return None, state
        if len(self.seen) >= self.limits.max_states:
            raise _Stop(f"max states ({self.limits.max_states}) reached")
        self.seen.add(state)
        frozen = b"" if self.leaves else self.freezer.freeze(checker)
        return _Node(path, frozen, node.next_rid + isinstance(op, AddRequest), diverged, state), state


def replay(
    factory: Callable[[Config], Target], config: Config, ops: tuple[Op, ...], tolerate: Tolerate
) -> tuple[Checker, list[Violation]]:
    """Re-execute `ops` from scratch; the checker and the untolerated violations of the last op."""
    checker = new_checker(factory, config)
    found: list[Violation] = []
    for op in ops:
        found = [v for v in checker.step(op) if not tolerate(v)]
    return checker, found


def _fork_differs(search: _Search, node: _Node) -> str | None:
    """Compare a thawed fork with a re-execution of its path; None when they agree."""
    thawed = search.freezer.thaw(node.frozen)
    fresh, _ = replay(search.factory, search.instance.config, node.path, search.tolerate)
    if thawed.target.snapshot() != fresh.target.snapshot():
        return f"the target's snapshot after {len(node.path)} operations differs from re-execution"
    rename, image = search.rename, search.image
    if _state_of(thawed, node.diverged, rename, image) != _state_of(fresh, node.diverged, rename, image):
        return f"the fingerprint after {len(node.path)} operations differs from re-execution"
    return None


def steps_text(engine: bool, config: Config) -> str:
    """How the instance's steps were chosen, for the certificate (`alphabet.engine_alphabet`)."""
    if engine:
        return (
            f"the engine's own: one step over every request it holds, budget {build_budget(config)} "
            "(Config.max_num_batched_tokens), no preempt, nothing written to the scheduler"
        )
    return "kvretain's: a step per budget over one request or every ready one, preempts"


def explore(
    instance: Instance,
    factory: Callable[[Config], Target],
    target: str,
    limits: Limits,
    *,
    tolerate: Tolerate | None = None,
    out_dir: Path | None = None,
    progress: Progress | None = None,
    wanted: Wanted | None = None,
    hidden_state: bool = True,
    restore: str = "live",
) -> Certificate:
    """Search `instance` against the target built by `factory`; the certificate (see module
    docstring). `wanted`: only violations it accepts end the search (default: any).
    `hidden_state` False merges on the model's state alone even where the target's hidden
    state has an image (`fingerprint.HIDDEN_STATE`); the certificate says which.
    `restore`: one of `RESTORES` (how states are returned to; the certificate is the same)."""
    if restore not in RESTORES:
        raise ValueError(f"restore must be one of {RESTORES}, got {restore!r}")
    tol: Tolerate = tolerate or (lambda v: explain(target, v))
    cert = Certificate(instance.name, target, limits.depth)
    cert.restore = restore
    image = HIDDEN_STATE.get(target) if hidden_state else None
    cert.merging = merging(target if image is not None else "")
    start = time.monotonic()
    search = _Search(instance, factory, cert, limits, tol, progress, wanted, image)
    try:
        try:
            last = search.run()
        except ConfigError as exc:  # raised building the target: it refuses this configuration
            cert.skipped = f"{target} refuses this configuration: {exc}"
            cert.states, cert.new_states = 0, []
            return cert
        for node in _fork_samples(last):
            cert.fork_checks += 1
            cert.error = cert.error or _fork_differs(search, node)
    except _Found as found:
        _counterexample(search, found, target, out_dir)
    cert.states = len(search.seen)
    cert.seconds = time.monotonic() - start
    return cert


def _fork_samples(layer: list[_Node]) -> Iterator[_Node]:
    """The first and the last state of the deepest layer (the last has the longest path)."""
    if layer and layer[-1].path:
        yield layer[-1]
    if len(layer) > 1 and layer[0].path:
        yield layer[0]


def _counterexample(search: _Search, found: _Found, target: str, out_dir: Path | None) -> None:
    cert = search.cert
    cert.violation = "; ".join(str(v) for v in found.violations[:3])
    cert.trace_length = len(found.path)
    cert.path, cert.found = found.path, list(found.violations)
    cert.stopped = f"violation at depth {len(found.path)}"
    cert.depth_completed = len(found.path) - 1
    _, again = replay(search.factory, search.instance.config, found.path, search.tolerate)
    cert.reproduced = bool(again)
    if out_dir is not None:
        trace = Trace(search.instance.config, list(found.path), None, target, str(found.violations[0]))
        cert.trace = write_trace(trace, out_dir / f"kvretain-explore-{target}-{search.instance.name}.json")
