"""The free queue(s) and the pinned tier as a symbolic transition system (#43447, #40676).

A state is a set of arrays over block ids (an unbounded pool); each transition
is one list operation of `model/contract/free_queue.py` or one routing decision of
`model/machine/pool.py`. Tied to the executable model by
`tests/test_queue_link.py`: seeded random operation sequences run on
`model.machine.pool.Pool` and, with the concrete pre-state substituted, through these
transitions; the relation must admit the post-state the Python produced and
determine it (every field). The drift "popleft_n takes from the tail" is that
test's negative control.

| transition           | executable operation                                              |
|----------------------|-------------------------------------------------------------------|
| `popleft_n`          | `FreeQueue.popleft_n` in `Pool.get_new_blocks` (hashes dropped)    |
| `prepend_uncached`   | `Pool.free` of a block without a hash (`FreeQueue.prepend_n`)      |
| `append_cached`      | `Pool.free` of a cached, unpinned block (`FreeQueue.append_n`)     |
| `free_pinned`        | `Pool.free` of a pinned block (pinned tier `append_n`)             |
| `remove_touch`       | `Pool.touch` of a free block (`FreeQueue.remove`, either tier)     |
| `cache_active_block` | `Pool.cache_full_blocks` / `cache_partial_block` on an active block |
| `hash_eviction`      | `Pool.evict_blocks` in place (a pinned-tier block: `remove_touch`, |
|                      | `hash_eviction`, then `prepend_uncached`: it goes to the head)      |
| `demote_n`           | `free_queue.demote_n` in `Pool.get_new_blocks` under pressure      |
| `reset_hashes`       | `Pool.reset_prefix_cache` after demoting the whole tier            |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from invariants.proofs.engine import Values, concrete, int_of


class Queues:
    """The free queue(s) as arrays over block ids (unbounded pool).

    Regular queue: `inq[b]`, position `pos[b]` (head = smallest), all positions
    strictly inside (lo, hi); `cls[b]`: the block was freed with a hash (went to
    the tail); `joined[b]`: when it joined the cached region (a clock `t`).
    Pinned tier (#40676): `inp[b]`, `ppos[b]` inside (plo, phi). `hashed[b]`:
    the block carries a hash now. Every list operation of model/contract/free_queue.py
    and the routing of model/machine/pool.py is a transition below.
    """

    ARRAYS = ("inq", "pos", "cls", "joined", "hashed", "inp", "ppos")  # indexed by block id
    SCALARS = ("lo", "hi", "t", "plo", "phi")

    def __init__(self, suffix: str = "", universe: Sequence[int] | None = None) -> None:
        # universe: for controls, a small pool (blocks 1..4): quantifiers become finite conjunctions
        self.universe = universe
        A_B, A_I = z3.ArraySort(z3.IntSort(), z3.BoolSort()), z3.ArraySort(z3.IntSort(), z3.IntSort())
        self.inq = z3.Const("inq" + suffix, A_B)
        self.pos = z3.Const("pos" + suffix, A_I)
        self.cls = z3.Const("freed_cached" + suffix, A_B)
        self.joined = z3.Const("joined" + suffix, A_I)
        self.hashed = z3.Const("hashed" + suffix, A_B)
        self.inp = z3.Const("in_pinned" + suffix, A_B)
        self.ppos = z3.Const("pinned_pos" + suffix, A_I)
        self.lo, self.hi, self.t, self.plo, self.phi = z3.Ints(
            f"lo{suffix} hi{suffix} t{suffix} plo{suffix} phi{suffix}"
        )

    def fields(self) -> list[z3.ExprRef]:
        return [getattr(self, name) for name in (*self.ARRAYS, *self.SCALARS)]

    def same(self, other: Queues, *, but: Sequence[str] = ()) -> z3.BoolRef:
        names = (*self.ARRAYS, *self.SCALARS)
        return z3.And([getattr(self, n) == getattr(other, n) for n in names if n not in but])

    # --- invariants
    def all1(self, body: Callable[[z3.ArithRef], z3.BoolRef]) -> z3.BoolRef:
        if self.universe is not None:
            return z3.And([body(z3.IntVal(v)) for v in self.universe])
        b = z3.Int("b")
        return z3.ForAll([b], body(b))

    def all2(self, body: Callable[[z3.ArithRef, z3.ArithRef], z3.BoolRef]) -> z3.BoolRef:
        if self.universe is not None:
            return z3.And([body(z3.IntVal(v), z3.IntVal(w)) for v in self.universe for w in self.universe])
        b, c = z3.Ints("b c")
        return z3.ForAll([b, c], body(b, c))

    def structure(self) -> z3.BoolRef:
        inq, inp = self.inq, self.inp
        return z3.And(
            self.lo < self.hi,
            self.plo < self.phi,
            self.all1(lambda b: z3.Implies(inq[b], z3.And(self.lo < self.pos[b], self.pos[b] < self.hi))),
            self.all1(lambda b: z3.Implies(inp[b], z3.And(self.plo < self.ppos[b], self.ppos[b] < self.phi))),
            self.all2(lambda b, c: z3.Implies(z3.And(inq[b], inq[c], b != c), self.pos[b] != self.pos[c])),
            self.all2(lambda b, c: z3.Implies(z3.And(inp[b], inp[c], b != c), self.ppos[b] != self.ppos[c])),
            self.all1(lambda b: z3.Implies(z3.And(inq[b], self.cls[b]), self.joined[b] < self.t)),
            self.all1(lambda b: z3.Implies(inp[b], self.hashed[b])),
        )

    def disjoint(self) -> z3.BoolRef:
        return self.all1(lambda b: z3.Not(z3.And(self.inq[b], self.inp[b])))

    def uncached_first(self) -> z3.BoolRef:
        """Every block freed without a hash precedes every block freed with one."""
        return self.all2(
            lambda b, c: z3.Implies(
                z3.And(self.inq[b], self.inq[c], z3.Not(self.cls[b]), self.cls[c]), self.pos[b] < self.pos[c]
            )
        )

    def unhashed_first(self) -> z3.BoolRef:
        """Every block without a hash now precedes every block with one (the strong form)."""
        return self.all2(
            lambda b, c: z3.Implies(
                z3.And(self.inq[b], self.inq[c], z3.Not(self.hashed[b]), self.hashed[c]),
                self.pos[b] < self.pos[c],
            )
        )

    def lru(self) -> z3.BoolRef:
        """Cached-class blocks are ordered by when they joined the cached region (oldest first)."""
        return self.all2(
            lambda b, c: z3.Implies(
                z3.And(self.inq[b], self.inq[c], self.cls[b], self.cls[c], self.joined[b] < self.joined[c]),
                self.pos[b] < self.pos[c],
            )
        )


# the arguments of a transition: the block it moves, and the position (regular queue, pinned tier)
# before which popleft_n / demote_n take every block
BLOCK, HEAD_CUT, PINNED_CUT = z3.Ints("x theta theta_pinned")


def transitions(s: Queues, n: Queues, *, broken: str = "") -> dict[str, z3.BoolRef]:
    """Transitions s -> n: the free-queue operations and the pool's routing."""
    x, theta, thp = BLOCK, HEAD_CUT, PINNED_CUT
    b = z3.Int("b")
    active = z3.And(z3.Not(s.inq[x]), z3.Not(s.inp[x]))
    return {
        **_queue_routing(s, n, x, theta, b, active, broken),
        **_hash_changes(s, n, x, b, active),
        **_pinned_tier(s, n, x, thp, b, active, broken),
    }


def _queue_routing(
    s: Queues, n: Queues, x: z3.ArithRef, theta: z3.ArithRef, b: z3.ArithRef, active: z3.BoolRef, broken: str
) -> dict[str, z3.BoolRef]:
    """Blocks leaving the free queue's head, and freed blocks joining it: uncached ones at the
    head, cached ones at the tail (where they join the cached region)."""
    ops: dict[str, z3.BoolRef] = {}
    # popleft_n: the blocks before position theta leave (get_new_blocks; their hashes are dropped);
    # the drift (tests' control of the link to model/machine/pool.py) takes them from the tail instead
    leaves = (s.pos[b] >= theta) if broken == "popleft_from_tail" else (s.pos[b] < theta)
    ops["popleft_n"] = z3.And(
        n.inq == z3.Lambda([b], z3.And(s.inq[b], z3.Not(leaves))),
        n.hashed == z3.Lambda([b], z3.If(z3.And(s.inq[b], leaves), False, s.hashed[b])),
        n.same(s, but=["inq", "hashed"]),
    )
    # free of an uncached block: prepend_n (head); the control appends it instead
    head = s.hi if broken == "prepend_to_tail" else s.lo
    ops["prepend_uncached"] = z3.And(
        active,
        z3.Not(s.hashed[x]),
        z3.Not(s.inp[x]),
        n.inq == z3.Store(s.inq, x, True),
        n.pos == z3.Store(s.pos, x, head),
        n.cls == z3.Store(s.cls, x, False),
        n.lo == (s.lo if broken == "prepend_to_tail" else s.lo - 1),
        n.hi == (s.hi + 1 if broken == "prepend_to_tail" else s.hi),
        n.same(s, but=["inq", "pos", "cls", "lo", "hi"]),
    )
    # free of a cached, unpinned block: append_n (tail); it joins the cached region now
    tail_pos = s.lo if broken == "append_to_head" else s.hi
    ops["append_cached"] = z3.And(
        active,
        s.hashed[x],
        n.inq == z3.Store(s.inq, x, True),
        n.pos == z3.Store(s.pos, x, tail_pos),
        n.cls == z3.Store(s.cls, x, True),
        n.joined == z3.Store(s.joined, x, s.t),
        n.t == s.t + 1,
        n.lo == (s.lo - 1 if broken == "append_to_head" else s.lo),
        n.hi == (s.hi if broken == "append_to_head" else s.hi + 1),
        n.same(s, but=["inq", "pos", "cls", "joined", "t", "lo", "hi"]),
    )
    return ops


def _hash_changes(
    s: Queues, n: Queues, x: z3.ArithRef, b: z3.ArithRef, active: z3.BoolRef
) -> dict[str, z3.BoolRef]:
    """A hit taking a free block out of its queue, and blocks gaining or losing their hash
    with the queue order unchanged."""
    ops: dict[str, z3.BoolRef] = {}
    # remove / touch: a hit on a free block takes it out of its queue (regular or pinned)
    ops["remove_touch"] = z3.And(
        n.inq == z3.Store(s.inq, x, False), n.inp == z3.Store(s.inp, x, False), n.same(s, but=["inq", "inp"])
    )
    # caching an active block gives it a hash
    ops["cache_active_block"] = z3.And(
        active, n.hashed == z3.Store(s.hashed, x, True), n.same(s, but=["hashed"])
    )
    # reset_prefix_cache: every hash dropped, queue order unchanged (pinned demotion: see demote)
    ops["reset_hashes"] = z3.And(
        n.hashed == z3.K(z3.IntSort(), False),
        n.inp == z3.K(z3.IntSort(), False),
        n.same(s, but=["hashed", "inp"]),
        z3.ForAll([b], z3.Not(s.inp[b])),
    )
    # evict_blocks: a block loses its hash in place (pinned-tier blocks go to the regular head)
    ops["hash_eviction"] = z3.And(
        z3.Not(s.inp[x]), n.hashed == z3.Store(s.hashed, x, False), n.same(s, but=["hashed"])
    )
    return ops


def _pinned_tier(
    s: Queues, n: Queues, x: z3.ArithRef, thp: z3.ArithRef, b: z3.ArithRef, active: z3.BoolRef, broken: str
) -> dict[str, z3.BoolRef]:
    """The pinned tier: a freed pinned block joins it (oldest first), and demotion moves its
    oldest blocks to the regular tail."""
    ops: dict[str, z3.BoolRef] = {}
    # free of a pinned block: appended to the pinned tier (oldest first); the control leaves it in both tiers
    in_reg = broken == "pinned_also_regular"
    ops["free_pinned"] = z3.And(
        active,
        s.hashed[x],
        n.inp == z3.Store(s.inp, x, True),
        n.ppos == z3.Store(s.ppos, x, s.phi),
        n.phi == s.phi + 1,
        n.inq == (z3.Store(s.inq, x, True) if in_reg else s.inq),
        n.pos == (z3.Store(s.pos, x, s.hi) if in_reg else s.pos),
        n.hi == (s.hi + 1 if in_reg else s.hi),
        n.same(s, but=["inp", "ppos", "phi", "inq", "pos", "hi"]),
    )
    # demote_n: the pinned blocks before theta_pinned (oldest; the control: the newest) move to the
    # regular tail in tier order and join the cached region then; only under pressure (see below)
    demoted = z3.And(s.inp[b], (s.ppos[b] >= thp) if broken == "demote_newest" else (s.ppos[b] < thp))
    ops["demote_n"] = z3.And(
        thp <= s.phi,
        n.inp == z3.Lambda([b], z3.And(s.inp[b], z3.Not(demoted))),
        n.inq == z3.Lambda([b], z3.Or(s.inq[b], demoted)),
        n.pos == z3.Lambda([b], z3.If(demoted, s.hi + (s.ppos[b] - s.plo), s.pos[b])),
        n.cls == z3.Lambda([b], z3.Or(s.cls[b], demoted)),
        n.joined == z3.Lambda([b], z3.If(demoted, s.t + (s.ppos[b] - s.plo), s.joined[b])),
        n.hi == s.hi + (s.phi - s.plo),
        n.t == s.t + (s.phi - s.plo),
        n.same(s, but=["inp", "inq", "pos", "cls", "joined", "hi", "t"]),
    )
    return ops


SMALL = (1, 2, 3, 4)


def small_world(s: Queues, x: z3.ArithRef) -> list[z3.BoolRef]:
    """For controls and findings: a pool of blocks 1..4 (a counterexample there is a real one, and prints
    as a readable queue); the invariants are then finite conjunctions."""
    b = z3.Int("b")
    inside = z3.And(b >= 1, b <= 4)
    return [
        x >= 1,
        x <= 4,
        s.inq == z3.Lambda([b], z3.And(inside, s.inq[b])),
        s.inp == z3.Lambda([b], z3.And(inside, s.inp[b])),
    ]


def queue_row(m: z3.ModelRef, q: Queues, tier: str = "regular") -> str:
    inq, pos = (q.inq, q.pos) if tier == "regular" else (q.inp, q.ppos)
    order = []
    for blk in range(1, 5):
        if z3.is_true(m.eval(inq[blk], model_completion=True)):
            tag = "cached" if z3.is_true(m.eval(q.hashed[blk], model_completion=True)) else "uncached"
            if tier == "regular" and z3.is_true(m.eval(q.cls[blk], model_completion=True)):
                tag += f", freed cached at t={int_of(m, q.joined[blk])}"
            order.append((int_of(m, pos[blk]), f"{blk} ({tag})"))
    return "[" + ", ".join(t for _, t in sorted(order)) + "]"


ALL_OPS = (
    "popleft_n",
    "prepend_uncached",
    "append_cached",
    "remove_touch",
    "cache_active_block",
    "reset_hashes",
    "hash_eviction",
    "free_pinned",
    "demote_n",
)


# --------------------------------------------------------------------------- concrete states
# A control's counterexample is a pair of states over the small pool; its claim is evaluated on them.

PRE, POST = Queues(universe=SMALL), Queues("'", universe=SMALL)  # the names every transition step uses


def pre_and_post(m: z3.ModelRef) -> Values:
    """The small-pool pre- and post-state of a Z3 model of one transition, as concrete values."""
    v: Values = {}
    for q, tag in ((PRE, "pre"), (POST, "post")):
        for name in Queues.ARRAYS:
            for b in SMALL:
                v[f"{tag}.{name}[{b}]"] = concrete(m, getattr(q, name)[b])
        for name in Queues.SCALARS:
            v[f"{tag}.{name}"] = concrete(m, getattr(q, name))
    return v


def holds(v: Values, tag: str, formula: Callable[[Queues], z3.BoolRef]) -> bool:
    """Evaluate a formula over the small pool on the concrete state `tag` ("pre" or "post") of `v`."""
    q = PRE if tag == "pre" else POST
    sub: list[tuple[z3.ExprRef, z3.ExprRef]] = []
    for name in Queues.ARRAYS:
        x = v[f"{tag}.{name}[{SMALL[0]}]"]
        arr: z3.ExprRef = z3.K(z3.IntSort(), z3.BoolVal(False) if isinstance(x, bool) else z3.IntVal(0))
        for b in SMALL:
            x = v[f"{tag}.{name}[{b}]"]
            arr = z3.Store(arr, b, z3.BoolVal(x) if isinstance(x, bool) else z3.IntVal(x))
        sub.append((getattr(q, name), arr))
    sub += [(getattr(q, name), z3.IntVal(int(v[f"{tag}.{name}"]))) for name in Queues.SCALARS]
    return bool(z3.is_true(z3.simplify(z3.substitute(formula(q), *sub))))
