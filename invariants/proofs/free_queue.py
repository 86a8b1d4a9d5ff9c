"""Free-queue order theorems: uncached blocks reused first, cached ones least recently freed first, the pinned tier apart (#43447, #40676).

Each is an inductive invariant of the transition system in `queues`, which
`tests/test_queue_link.py` ties to `model/contract/free_queue.py` and `model/machine/pool.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from invariants.proofs.engine import (
    CONTROL_TIMEOUT_MS,
    Claim,
    Describe,
    Outcome,
    Refutes,
    Step,
    Values,
    run_steps,
    theorem,
    value_of,
)
from invariants.proofs.queues import (
    ALL_OPS,
    SMALL,
    Queues,
    holds,
    pre_and_post,
    queue_row,
    small_world,
    transitions,
)


def _queue_steps(
    invariant: Callable[[Queues], z3.BoolRef], ops: Sequence[str], broken: str = "", small: bool = False
) -> tuple[list[Step], Describe]:
    universe = SMALL if small else None
    s, n = Queues(universe=universe), Queues("'", universe=universe)
    trans = transitions(s, n, broken=broken)
    inv = lambda q: z3.And(q.structure(), q.disjoint(), invariant(q))  # noqa: E731
    x = z3.Int("x")
    init = Queues("0")
    b = z3.Int("b")
    steps = [
        Step(
            "initial queue [1..N-1]: all uncached, no pinned tier",
            inv(init),
            [
                init.cls == z3.K(z3.IntSort(), False),
                init.inp == z3.K(z3.IntSort(), False),
                init.hashed == z3.K(z3.IntSort(), False),
                init.lo == 0,
                init.hi == init.t + 10**6,
                init.t == 0,
                init.pos == z3.Lambda([b], b),
                init.inq == z3.Lambda([b], z3.And(b >= 1, b < init.hi)),
                init.plo == 0,
                init.phi == 1,
            ],
        )
    ]
    world = small_world(s, x) if small else []
    for op in ops:
        steps.append(Step(f"{op} preserves the invariant", inv(n), [inv(s), trans[op], *world]))

    def describe(m: z3.ModelRef) -> str:
        return f"block {value_of(m, x)}: free queue before {queue_row(m, s)}, after {queue_row(m, n)} (head first)"

    return steps, describe


@theorem()
def free_queue_uncached_first() -> Outcome:
    """Free-queue order (#43447): over popleft_n, prepend_n of uncached, append_n of cached, remove/touch, caching, reset, hash eviction, pinned free and demote_n, every free block freed without a hash is ahead of (reused before) every block freed with one; the strong form (no hash now, see finding_free_queue_evicted_in_place) holds for every operation but hash eviction.

    Inductive invariant over arrays indexed by block id: unbounded pool.
    """
    steps, describe = _queue_steps(Queues.uncached_first, ALL_OPS)
    o = run_steps(steps, [], describe)
    if o.result != "proved":
        return o
    strong_ops = [op for op in ALL_OPS if op != "hash_eviction"]
    steps, describe = _queue_steps(lambda q: z3.And(q.uncached_first(), q.unhashed_first()), strong_ops)
    return run_steps(steps, [], describe)


def _broken_by_the_step(claim: Callable[[Queues], z3.BoolRef], what: str) -> Claim:
    """A free-queue claim violated on the counterexample: it held before the transition and fails after."""

    def violated(v: Values) -> str | None:
        full = lambda q: z3.And(q.structure(), q.disjoint(), claim(q))  # noqa: E731
        return what if holds(v, "pre", full) and not holds(v, "post", claim) else None

    return violated


_UNCACHED_FIRST = _broken_by_the_step(
    Queues.uncached_first, "a block freed without a hash is behind a cached one"
)


@theorem(control=True, claim=_UNCACHED_FIRST)
def control_free_queue_wrong_prepend() -> Outcome:
    """Control for free_queue_uncached_first (uncached free blocks ahead of cached ones): putting a freed uncached block at the tail (append instead of prepend_n) puts it behind a cached one."""
    steps, describe = _queue_steps(
        Queues.uncached_first, ("prepend_uncached",), broken="prepend_to_tail", small=True
    )
    refutes = Refutes(pre_and_post, _UNCACHED_FIRST)
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=refutes)


@theorem(finding=True)
def finding_free_queue_evicted_in_place() -> Outcome:
    """Finding (model and vLLM 0.33.0 BlockPool.evict_blocks): a free cached block whose hash is evicted stays in place, so a block with no hash can sit behind cached blocks and is reused after them.

    Expected refuted: the strong 'no hash now => ahead of every hashed block' is
    not preserved by hash eviction (the invariant catalogue exempts these
    blocks by name).
    """
    steps, describe = _queue_steps(
        lambda q: z3.And(q.uncached_first(), q.unhashed_first()), ("hash_eviction",), small=True
    )
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS)


@theorem()
def free_queue_lru() -> Outcome:
    """Free-queue order (#43447): cached free blocks are reused least-recently-freed first (ordered by when they joined the cached region; a demoted pinned block joins when demoted) over every queue operation, because freed cached blocks and demoted ones are appended at the tail.

    Inductive invariant; unbounded pool.
    """
    steps, describe = _queue_steps(lambda q: z3.And(q.uncached_first(), q.lru()), ALL_OPS)
    return run_steps(steps, [], describe)


_LRU = _broken_by_the_step(
    lambda q: z3.And(q.uncached_first(), q.lru()), "cached free blocks are not least-recently-freed first"
)


@theorem(control=True, claim=_LRU)
def control_free_queue_cached_to_head() -> Outcome:
    """Control for free_queue_lru (cached free blocks reused least-recently-freed first): a freed cached block put at the head is reused before older ones."""
    steps, describe = _queue_steps(
        lambda q: z3.And(q.uncached_first(), q.lru()), ("append_cached",), broken="append_to_head", small=True
    )
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=Refutes(pre_and_post, _LRU))


def _pinned_steps(broken: str = "") -> tuple[list[Step], Describe]:
    universe = SMALL if broken else None
    s, n = Queues(universe=universe), Queues("'", universe=universe)
    trans = transitions(s, n, broken=broken)
    small = small_world(s, z3.Int("x")) if broken else []

    def demoted_(x_: z3.ArithRef) -> z3.BoolRef:
        return z3.And(s.inp[x_], z3.Not(n.inp[x_]), n.inq[x_])

    def remaining_(x_: z3.ArithRef) -> z3.BoolRef:
        return z3.And(s.inp[x_], n.inp[x_])

    steps = [
        Step(
            "pinned free keeps the tiers disjoint",
            n.disjoint(),
            [s.structure(), s.disjoint(), trans["free_pinned"]],
        ),
        Step(
            "demote keeps the tiers disjoint", n.disjoint(), [s.structure(), s.disjoint(), trans["demote_n"]]
        ),
        Step(
            "demote takes the oldest pinned blocks",
            s.all2(lambda b_, c_: z3.Implies(z3.And(demoted_(b_), remaining_(c_)), s.ppos[b_] < s.ppos[c_])),
            [s.structure(), s.disjoint(), trans["demote_n"]],
        ),
        Step(
            "demoted blocks go behind every regular block",
            s.all2(lambda b_, c_: z3.Implies(z3.And(demoted_(b_), s.inq[c_]), n.pos[c_] < n.pos[b_])),
            [s.structure(), s.disjoint(), trans["demote_n"]],
        ),
        Step(
            "popleft_n never takes a pinned block",
            s.all1(lambda b_: z3.Implies(s.inp[b_], n.inp[b_])),
            [s.structure(), s.disjoint(), trans["popleft_n"]],
        ),
    ]
    for st in steps:
        st.hyps = [*st.hyps, *small]

    def describe(m: z3.ModelRef) -> str:
        return (
            f"regular queue before {queue_row(m, s)} after {queue_row(m, n)}; pinned tier before "
            f"{queue_row(m, s, 'pinned')} after {queue_row(m, n, 'pinned')}"
        )

    return steps, describe


@theorem()
def pinned_tier_disjoint_pressure_oldest() -> Outcome:
    """Pinned tier (#40676): the pinned tier and the regular queue never share a block; get_new_blocks takes no pinned block unless it demotes (only when the request needs more blocks than the regular queue holds: then every regular block is taken too, Pool.get_new_blocks); demote_n moves the oldest pinned blocks, behind every regular block.

    Unbounded pool (arrays). 'Only under pressure' is the structure of
    Pool.get_new_blocks: popleft_n alone never touches the tier (proved), and
    demote_n is called only for the shortfall n - len(regular).
    """
    steps, describe = _pinned_steps()
    return run_steps(steps, [], describe)


def _demotes_oldest(v: Values) -> str | None:
    """pinned_tier_disjoint_pressure_oldest's 'demote_n moves the oldest pinned blocks', on the counterexample."""
    pinned_before = [b for b in SMALL if v[f"pre.inp[{b}]"]]
    demoted = [b for b in pinned_before if not v[f"post.inp[{b}]"] and v[f"post.inq[{b}]"]]
    kept = [b for b in pinned_before if v[f"post.inp[{b}]"]]
    age = {b: int(v[f"pre.ppos[{b}]"]) for b in pinned_before}
    younger = [(b, c) for b in demoted for c in kept if age[b] > age[c]]
    return (
        f"demoted block {younger[0][0]} while the older block {younger[0][1]} stays pinned"
        if younger
        else None
    )


@theorem(control=True, claim=_demotes_oldest)
def control_pinned_demote_newest() -> Outcome:
    """Control for pinned_tier_disjoint_pressure_oldest (demote_n moves the oldest pinned blocks): demoting the newest pinned blocks first leaves an older block pinned."""
    steps, describe = _pinned_steps(broken="demote_newest")
    refutes = Refutes(pre_and_post, _demotes_oldest)
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=refutes)


_TIERS_DISJOINT = _broken_by_the_step(Queues.disjoint, "a block is in the pinned tier and the regular queue")


@theorem(control=True, claim=_TIERS_DISJOINT)
def control_pinned_in_both_tiers() -> Outcome:
    """Control for pinned_tier_disjoint_pressure_oldest (the tiers never share a block): a pinned free that also links the block into the regular queue puts it in both."""
    steps, describe = _pinned_steps(broken="pinned_also_regular")
    refutes = Refutes(pre_and_post, _TIERS_DISJOINT)
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=refutes)
