"""The free-queue theorems speak about `model/machine/pool.py`: its transitions are the pool's operations.

The free-queue theorems prove invariants of a symbolic transition system
(`invariants/proofs/queues.py`). This test ties that system to the executable
model: seeded random sequences of pool operations (allocate, free, hit,
cache, pin, evict, reset) run on `model.machine.pool.Pool`, and each one is mapped to
the transitions it consists of. For every transition the concrete pre-state
is substituted into the Z3 relation; Z3 must find a post-state (the operation
is enabled) and only one (the relation determines every field), and after the
operation the symbolic state must read back as the Python pool: the regular
queue in order, the pinned tier in order, and the set of blocks carrying a
hash. The theorems' invariants are evaluated on every state reached.

The transition arguments (which block, where popleft_n cuts the queue) are
computed from the symbolic state, never from what Python did, so a
transition that drifts from the code shows up as a mismatch. Negative
controls: each broken transition of the queue controls, and the drift
"popleft_n takes from the tail" (which still proves all four free-queue
theorems, shown below), must break the link.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import z3

from invariants.proofs import free_queue
from invariants.proofs.queues import ALL_OPS, BLOCK, HEAD_CUT, PINNED_CUT, Queues, transitions
from model.machine.pool import Pool

NUM_BLOCKS = 8  # blocks 1..7 (0 is the null block): small, so the pool is often under pressure
BLOCKS = tuple(range(1, NUM_BLOCKS))
DEFAULTS: dict[str, int | bool] = {
    "inq": False,
    "pos": 0,
    "cls": False,
    "joined": 0,
    "hashed": False,
    "inp": False,
    "ppos": 0,
}

State = dict[str, object]  # field -> {block: value} for arrays, int for scalars


class LinkBroken(AssertionError):
    """The symbolic transition system and the Python pool disagree."""


def _initial() -> State:
    """The theorems' initial queue on a finite pool: every block free, uncached, in id order."""
    state: State = {name: {b: default for b in BLOCKS} for name, default in DEFAULTS.items()}
    state["inq"] = {b: True for b in BLOCKS}
    state["pos"] = {b: b for b in BLOCKS}
    state.update(lo=0, hi=NUM_BLOCKS, t=0, plo=0, phi=1)
    return state


def _value(x: int | bool) -> z3.ExprRef:
    return z3.BoolVal(x) if isinstance(x, bool) else z3.IntVal(x)


def _terms(q: Queues, state: State) -> list[tuple[z3.ExprRef, z3.ExprRef]]:
    """Substitution pairs: each field of q becomes the concrete value in `state`."""
    pairs: list[tuple[z3.ExprRef, z3.ExprRef]] = []
    for name in Queues.ARRAYS:
        arr: z3.ExprRef = z3.K(z3.IntSort(), _value(DEFAULTS[name]))
        for b, v in state[name].items():  # type: ignore[attr-defined]
            arr = z3.Store(arr, b, _value(v))
        pairs.append((getattr(q, name), arr))
    pairs += [(getattr(q, name), z3.IntVal(state[name])) for name in Queues.SCALARS]  # type: ignore[arg-type]
    return pairs


class SymbolicQueues:
    """The transition system run on concrete states: each step asks Z3 for the post-state."""

    def __init__(self, broken: str = "") -> None:
        self.pre, self.post = Queues("_pre"), Queues("_post")
        self.relation = transitions(self.pre, self.post, broken=broken)
        self.state = _initial()
        self.taken: set[str] = set()  # the transitions this run went through
        self.check = Queues("_chk", universe=BLOCKS)
        self.invariant = z3.And(
            self.check.structure(), self.check.disjoint(), self.check.uncached_first(), self.check.lru()
        )

    def regular(self) -> list[int]:
        inq, pos = self.state["inq"], self.state["pos"]
        return sorted((b for b in BLOCKS if inq[b]), key=pos.__getitem__)  # type: ignore[index]

    def pinned(self) -> list[int]:
        inp, ppos = self.state["inp"], self.state["ppos"]
        return sorted((b for b in BLOCKS if inp[b]), key=ppos.__getitem__)  # type: ignore[index]

    def head_cut(self, n: int) -> int:
        """The position before which popleft_n takes exactly the first n blocks of the regular queue."""
        regular = self.regular()
        return int(self.state["pos"][regular[n]]) if n < len(regular) else int(self.state["hi"])  # type: ignore[index, call-overload]

    def pinned_cut(self, n: int) -> int:
        """The pinned-tier position before which demote_n takes exactly the n oldest pinned blocks."""
        pinned = self.pinned()
        return int(self.state["ppos"][pinned[n]]) if n < len(pinned) else int(self.state["phi"])  # type: ignore[index, call-overload]

    def hashed(self) -> set[int]:
        return {b for b in BLOCKS if self.state["hashed"][b]}  # type: ignore[index]

    def step(self, op: str, x: int = 0, theta: int = 0, thp: int = 0, *, check: bool = True) -> None:
        """Apply transition `op` with its arguments; it must be enabled and determine the post-state."""
        self.taken.add(op)
        args = [(BLOCK, z3.IntVal(x)), (HEAD_CUT, z3.IntVal(theta)), (PINNED_CUT, z3.IntVal(thp))]
        relation = z3.substitute(self.relation[op], *_terms(self.pre, self.state), *args)
        s = z3.Solver()
        s.add(relation)
        if s.check() != z3.sat:
            raise LinkBroken(
                f"{op}(x={x}, theta={theta}, theta_pinned={thp}) is not enabled on {self.show()}"
            )
        # Z3's model of a lambda-defined array can evaluate a point wrongly; a wrong reading is caught by
        # the uniqueness check below, and the model that check returns is read instead (a few times)
        for _ in range(4):
            post = self._read_post(s.model())
            s.add(z3.Not(self._equals_post(post)))
            unique = s.check() == z3.unsat
            if unique:
                break
        else:
            raise LinkBroken(f"{op}(x={x}) leaves the post-state open on {self.show()}")
        self.state = post
        if check and not self.holds(self.invariant):
            raise LinkBroken(f"the theorems' invariant fails after {op}(x={x}): {self.show()}")

    def _read_post(self, m: z3.ModelRef) -> State:
        post: State = {}
        for name in Queues.ARRAYS:
            arr = getattr(self.post, name)
            post[name] = {b: _read(m.eval(arr[b], model_completion=True)) for b in BLOCKS}
        for name in Queues.SCALARS:
            post[name] = m.eval(getattr(self.post, name), model_completion=True).as_long()
        return post

    def _equals_post(self, post: State) -> z3.BoolRef:
        same = [getattr(self.post, n)[b] == _value(post[n][b]) for n in Queues.ARRAYS for b in BLOCKS]  # type: ignore[index]
        return z3.And(same + [getattr(self.post, n) == post[n] for n in Queues.SCALARS])

    def holds(self, formula: z3.BoolRef) -> bool:
        """A formula over `self.check`'s fields (the small pool), on the current state."""
        return bool(z3.is_true(z3.simplify(z3.substitute(formula, *_terms(self.check, self.state)))))

    def show(self) -> str:
        return f"regular {self.regular()}, pinned {self.pinned()}, hashed {sorted(self.hashed())}"


def _read(v: z3.ExprRef) -> int | bool:
    return bool(z3.is_true(v)) if z3.is_bool(v) else v.as_long()


# ----------------------------------------------------------------------------- the pool's operations


class Linked:
    """One Python pool and its symbolic twin, driven by the same operations."""

    def __init__(self, rng: random.Random, broken: str = "") -> None:
        self.rng = rng
        self.pool = Pool(NUM_BLOCKS, hash_block_size=1, enable_caching=True)
        self.sym = SymbolicQueues(broken)
        self.tokens = 0

    def active(self) -> list[int]:
        return [b for b in BLOCKS if self.pool.ref[b] > 0]

    def allocate(self) -> str:
        free = len(self.sym.regular()) + len(self.sym.pinned())
        if free == 0:
            return "allocate: pool full"
        n = self.rng.randint(1, min(3, free))
        regular = self.sym.regular()
        if n > len(regular):  # pressure: the shortfall comes from the pinned tier, oldest first
            self.sym.step("demote_n", thp=self.sym.pinned_cut(n - len(regular)))
        self.sym.step("popleft_n", theta=self.sym.head_cut(n))
        return f"get_new_blocks({n}) -> {self.pool.get_new_blocks(n)}"

    def free(self, blocks: list[int]) -> str:
        """Route each block reaching ref 0 as the relation says: hash -> tail (pinned flag -> tier), none -> head."""
        head: list[int] = []
        tail: list[int] = []
        tier: list[int] = []
        hashed = self.sym.hashed()
        for b in blocks:
            if self.pool.ref[b] == 1:
                if b not in hashed:
                    head.append(b)
                else:
                    (tier if b in self.pool.pinned else tail).append(b)
        for b in reversed(head):  # prepend_n puts its first block at the head
            self.sym.step("prepend_uncached", x=b)
        for b in tail:
            self.sym.step("append_cached", x=b)
        for b in tier:
            self.sym.step("free_pinned", x=b)
        self.pool.free(blocks)
        return f"free({blocks})"

    def free_some(self) -> str:
        active = self.active()
        if not active:
            return "free: nothing active"
        return self.free(self.rng.sample(active, self.rng.randint(1, min(3, len(active)))))

    def touch(self) -> str:
        """A hit: cached free blocks (either tier) or active ones gain a reference."""
        candidates = [b for b in BLOCKS if b in self.sym.hashed() or self.pool.ref[b] > 0]
        if not candidates:
            return "touch: no candidate"
        blocks = self.rng.sample(candidates, min(len(candidates), self.rng.randint(1, 2)))
        regular, pinned = set(self.sym.regular()), set(self.sym.pinned())
        for b in blocks:
            if b in regular or b in pinned:
                self.sym.step("remove_touch", x=b)
        self.pool.touch(blocks)
        return f"touch({blocks})"

    def cache(self) -> str:
        uncached = [b for b in self.active() if b not in self.sym.hashed()]
        if not uncached:
            return "cache: no uncached active block"
        b = self.rng.choice(uncached)
        self.tokens += 1
        self.sym.step("cache_active_block", x=b)
        self.pool.cache_full_blocks((self.tokens,), [b], 0, 1, 1, 0, None)
        return f"cache({b})"

    def pin(self) -> str:
        """As the allocator does: pin cached active blocks about to be released (no queue change)."""
        cached = [b for b in self.active() if b in self.sym.hashed()]
        if not cached:
            return "pin: no cached active block"
        b = self.rng.choice(cached)
        self.pool.pin([b])
        return f"pin({b})"

    def evict(self) -> str:
        """A pinned-tier block leaves the tier for the regular head; any other block loses its hash in place."""
        cached = sorted(self.sym.hashed())
        if not cached:
            return "evict: nothing cached"
        b = self.rng.choice(cached)
        if b in self.sym.pinned():
            self.sym.step("remove_touch", x=b)
            self.sym.step("hash_eviction", x=b)
            self.sym.step("prepend_uncached", x=b)
        else:
            self.sym.step("hash_eviction", x=b)
        self.pool.evict_blocks([b])
        return f"evict_blocks([{b}])"

    def drain_and_reset(self) -> str:
        """Release every reference, then reset the prefix cache (only possible with every block free)."""
        while self.active():
            self.free(self.active())
        self.sym.step("demote_n", thp=self.sym.pinned_cut(len(self.sym.pinned())))
        self.sym.step("reset_hashes")
        assert self.pool.reset_prefix_cache()
        return "reset_prefix_cache()"

    def agree(self) -> None:
        """The symbolic state reads back as the Python pool."""
        got = (self.sym.regular(), self.sym.pinned(), self.sym.hashed())
        want = (self.pool.queue.blocks, self.pool.pinned_tier.blocks, set(self.pool.primary))
        if got != want:
            raise LinkBroken(f"symbolic {got} != pool {want}")


OPS: dict[str, Callable[[Linked], str]] = {
    "allocate": Linked.allocate,
    "free": Linked.free_some,
    "touch": Linked.touch,
    "cache": Linked.cache,
    "pin": Linked.pin,
    "evict": Linked.evict,
    "reset": Linked.drain_and_reset,
}
WEIGHTS = {"allocate": 5, "free": 5, "touch": 3, "cache": 4, "pin": 2, "evict": 1, "reset": 1}


def run_link(seed: int, steps: int, broken: str = "") -> tuple[set[str], set[str]]:
    """Run one seeded sequence on both sides; raise LinkBroken (with seed and history) on a mismatch.

    Returns the pool operations drawn and the transitions they went through."""
    rng = random.Random(seed)
    linked = Linked(rng, broken)
    history: list[str] = []
    used: set[str] = set()
    names, weights = list(OPS), [WEIGHTS[n] for n in OPS]
    for _ in range(steps):
        name = rng.choices(names, weights)[0]
        try:
            history.append(OPS[name](linked))
            linked.agree()
        except LinkBroken as exc:
            raise LinkBroken(f"seed {seed}, after {history[-8:]} then {name}: {exc}") from None
        used.add(name)
    return used, linked.sym.taken


SEEDS = (1, 2, 3)
STEPS = 150


@pytest.mark.parametrize("seed", SEEDS)
def test_transition_system_is_the_pool(seed: int) -> None:
    used, taken = run_link(seed, STEPS)
    # every pool operation drawn, and every transition the theorems quantify over exercised
    assert used == set(OPS), f"seed {seed}: operations never drawn: {set(OPS) - used}"
    assert taken == set(ALL_OPS), f"seed {seed}: transitions never taken: {set(ALL_OPS) - taken}"


# ----------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize(
    "broken",
    ["popleft_from_tail", "prepend_to_tail", "append_to_head", "demote_newest", "pinned_also_regular"],
)
def test_a_drifted_transition_breaks_the_link(broken: str) -> None:
    with pytest.raises(LinkBroken) as caught:
        for seed in SEEDS:
            run_link(seed, STEPS, broken=broken)
    if broken == "popleft_from_tail":  # invisible to the invariants: only the read-back sees it
        assert "get_new_blocks" in str(caught.value) and "!= pool" in str(caught.value)


def test_popleft_from_the_tail_still_proves_the_theorems(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the link is needed: the drift keeps every free-queue invariant, so only the link sees it."""

    def drifted(s: Queues, n: Queues, *, broken: str = "") -> dict[str, z3.BoolRef]:
        return transitions(s, n, broken=broken or "popleft_from_tail")

    monkeypatch.setattr(free_queue, "transitions", drifted)
    for theorem in (
        free_queue.free_queue_uncached_first,
        free_queue.free_queue_lru,
        free_queue.pinned_tier_disjoint_pressure_oldest,
    ):
        assert theorem().result == "proved", theorem.__name__


def _explore(
    broken: str, claim: Callable[[SymbolicQueues, str], bool], seed: int, steps: int = 80
) -> str | None:
    """Run the (broken) transition system alone from the initial queue, each transition with arguments
    drawn from the symbolic state; return the first reachable state where `claim` fails."""
    rng = random.Random(seed)
    sym = SymbolicQueues(broken)
    for n in range(steps):
        regular, pinned = sym.regular(), sym.pinned()
        active = [b for b in BLOCKS if b not in regular and b not in pinned]
        hashed = sym.hashed()
        moves: list[tuple[str, dict[str, int]]] = []
        if regular:
            moves.append(("popleft_n", {"theta": sym.head_cut(rng.randint(1, min(3, len(regular))))}))
        if pinned:
            moves.append(("demote_n", {"thp": sym.pinned_cut(rng.randint(1, len(pinned)))}))
        for b in active:
            moves.append(
                ("free_pinned" if rng.random() < 0.3 else "append_cached", {"x": b})
                if b in hashed
                else ("prepend_uncached", {"x": b})
            )
            if b not in hashed:
                moves.append(("cache_active_block", {"x": b}))
        moves += [("remove_touch", {"x": b}) for b in (regular + pinned) if b in hashed]
        op, args = rng.choice(moves)
        before = (sym.regular(), sym.pinned())
        sym.step(op, check=False, **args)
        if not claim(sym, op):
            return f"seed {seed}, step {n}: {op}{args} from regular {before[0]}, pinned {before[1]} gives {sym.show()}"
    return None


class _DemoteWatch:
    """demote_n moves the oldest pinned blocks: checked on each demote_n against the tier before it."""

    def __init__(self) -> None:
        self.tier: list[int] = []

    def __call__(self, sym: SymbolicQueues, op: str) -> bool:
        before, self.tier = self.tier, sym.pinned()
        if op != "demote_n":
            return True
        moved = [b for b in before if b not in self.tier]
        return before[: len(moved)] == moved


CLAIMS: dict[str, Callable[[], Callable[[SymbolicQueues, str], bool]]] = {
    # control -> the stated claim of its theorem, on a concrete state
    "prepend_to_tail": lambda: lambda sym, op: sym.holds(sym.check.uncached_first()),
    "append_to_head": lambda: lambda sym, op: sym.holds(z3.And(sym.check.uncached_first(), sym.check.lru())),
    "pinned_also_regular": lambda: lambda sym, op: sym.holds(sym.check.disjoint()),
    "demote_newest": _DemoteWatch,
}


@pytest.mark.parametrize("broken", list(CLAIMS))
def test_each_queue_control_reaches_a_state_that_breaks_its_claim(broken: str) -> None:
    """The free-queue controls' counterexamples are inductive steps; here each broken transition system,
    run from the initial queue, reaches a state violating its theorem's claim (the correct one keeps every
    claim on long runs: test_transition_system_is_the_pool checks them, and the pool, after each step)."""
    found = next((w for seed in SEEDS if (w := _explore(broken, CLAIMS[broken](), seed)) is not None), None)
    assert found is not None, f"{broken}: no reachable state violates the claim"
