"""The retention masks and hit rules of `model/contract/masks.py` and `model/contract/lookup.py` as Z3 terms.

Every function here mirrors one function of the executable model over Z3
integers, so a theorem about these terms is a theorem about the code the
fuzzer runs (`tests/test_smt.py` evaluates both on thousands of concrete
inputs and demands equality).

Conventions:
- Sizes, windows, prompt lengths and block indices are Z3 `Int`s (Python
  ints are accepted and lifted). The Eagle flag is a Z3 `Bool`.
- A retention interval is a pair `(mode, k)`: `mode` is `DENSE` (None),
  `ZERO` (0) or `INTERVAL` (k > 0), so one formula covers all three.
- A mask is a predicate on the block index, `kept(i) -> BoolRef`, plus a
  `dense` flag standing for the model's `None` ("every block").
- A hit rule takes `cached(j) -> BoolRef` and returns a `Hit`: the hit
  length in blocks as a term over fresh variables, and a side condition that
  pins those variables down (the rule is a maximum: the side condition says
  "this is a candidate and nothing larger is"). For concrete inputs the side
  condition determines the hit uniquely. Proofs use its quantifier-free
  consequences (`Hit.chosen`, `Hit.instance`).
- Integer division: Z3 `/` and `%` on Int are Euclidean, equal to Python's
  `//` and `%` for positive divisors; every divisor here is positive under
  `config_side_conditions`.

Bounded quantifiers (`forall_range`, `exists_range`) are expanded into finite
conjunctions when both bounds are concrete, and are Z3 quantifiers otherwise,
so the same definition serves concrete evaluation and symbolic proofs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeAlias

import z3

IntLike: TypeAlias = "int | z3.ArithRef"
BoolLike: TypeAlias = "bool | z3.BoolRef"
Pred: TypeAlias = Callable[[z3.ArithRef], z3.BoolRef]

DENSE, ZERO, INTERVAL = 0, 1, 2

_fresh = itertools.count()


def I(x: IntLike) -> z3.ArithRef:  # noqa: E743 - short name, used everywhere
    return x if isinstance(x, z3.ArithRef) else z3.IntVal(x)


def B(x: BoolLike) -> z3.BoolRef:
    return x if isinstance(x, z3.BoolRef) else z3.BoolVal(bool(x))


def fresh(name: str) -> z3.ArithRef:
    return z3.Int(f"{name}!{next(_fresh)}")


def reset_fresh_names() -> None:
    """Restart the fresh-variable counter: the same formula gets the same names (reproducible Z3 runs)."""
    global _fresh
    _fresh = itertools.count()


def as_int(t: IntLike) -> int | None:
    """The Python value of `t` if it is (or simplifies to) a numeral."""
    if isinstance(t, int):
        return t
    if z3.is_int_value(t):
        return int(t.as_long())
    if z3.is_const(t):  # an uninterpreted constant: not a numeral
        return None
    s = z3.simplify(t)
    return s.as_long() if z3.is_int_value(s) else None


def cdiv(a: IntLike, b: IntLike) -> z3.ArithRef:
    """ceil(a / b) for b > 0 (masks.cdiv)."""
    return -((-I(a)) / I(b))


def zmax(a: IntLike, b: IntLike) -> z3.ArithRef:
    return z3.If(I(a) >= I(b), I(a), I(b))


def zmin(a: IntLike, b: IntLike) -> z3.ArithRef:
    return z3.If(I(a) <= I(b), I(a), I(b))


_expansion_bound: list[int] = []


@contextmanager
def bounded_indices(bound: int) -> Iterator[None]:
    """Within this block, quantifiers with symbolic bounds range over indices in [0, bound).

    Used for bounded proofs and to build evaluation templates; sound only when
    every quantified index really lies in [0, bound) (the caller states it).
    """
    _expansion_bound.append(bound)
    try:
        yield
    finally:
        _expansion_bound.pop()


def forall_range(lo: IntLike, hi: IntLike, body: Callable[[z3.ArithRef], BoolLike]) -> z3.BoolRef:
    """For all x in [lo, hi): body(x). Expanded when both bounds are numerals."""
    clo, chi = as_int(lo), as_int(hi)
    if clo is not None and chi is not None:
        return z3.And([B(body(z3.IntVal(x))) for x in range(clo, chi)] + [z3.BoolVal(True)])
    if _expansion_bound:
        first = 0 if clo is None else max(clo, 0)
        last = _expansion_bound[-1] if chi is None else min(chi, _expansion_bound[-1])
        guarded = [
            z3.Implies(z3.And(I(lo) <= x, x < I(hi)), B(body(z3.IntVal(x)))) for x in range(first, last)
        ]
        return z3.And(guarded + [z3.BoolVal(True)])
    x = fresh("x")
    return z3.ForAll([x], z3.Implies(z3.And(I(lo) <= x, x < I(hi)), B(body(x))))


def exists_range(lo: IntLike, hi: IntLike, body: Callable[[z3.ArithRef], BoolLike]) -> z3.BoolRef:
    return z3.Not(forall_range(lo, hi, lambda x: z3.Not(B(body(x)))))


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Retention:
    """`mode` in {DENSE, ZERO, INTERVAL}; `k` is the interval (tokens) when INTERVAL."""

    mode: z3.ArithRef
    k: z3.ArithRef

    @staticmethod
    def of(r: int | None) -> Retention:
        if r is None:
            return Retention(I(DENSE), I(0))
        return Retention(I(ZERO), I(0)) if r == 0 else Retention(I(INTERVAL), I(r))

    @staticmethod
    def symbolic(name: str = "r") -> Retention:
        return Retention(z3.Int(f"{name}_mode"), z3.Int(f"{name}_k"))

    def well_formed(self) -> z3.BoolRef:
        return z3.And(
            z3.Or(self.mode == DENSE, self.mode == ZERO, self.mode == INTERVAL),
            z3.Implies(self.mode == INTERVAL, self.k >= 1),
            z3.Implies(self.mode != INTERVAL, self.k == 0),
        )

    def describe(self, model: z3.ModelRef) -> str:
        mode = model.eval(self.mode, model_completion=True).as_long()
        if mode == DENSE:
            return "None (dense)"
        if mode == ZERO:
            return "0"
        return str(model.eval(self.k, model_completion=True).as_long())


def config_side_conditions(
    *,
    block_size: IntLike,
    alignment: IntLike,
    retention: Retention,
    window: IntLike | None = None,
) -> z3.BoolRef:
    """What `model.contract.config.validate` guarantees about one SWA/Mamba group in a hybrid model.

    Block size >= 1; the alignment (= scheduler block size, the lcm of the
    group block sizes) is a multiple of the block size; a window is >= 1; the
    retention interval is None, 0 or a positive multiple of the scheduler
    block size.
    """
    bs, a = I(block_size), I(alignment)
    cs = [bs >= 1, a >= bs, a % bs == 0, retention.well_formed()]
    cs.append(z3.Implies(retention.mode == INTERVAL, retention.k % a == 0))
    if window is not None:
        cs.append(I(window) >= 1)
    return z3.And(cs)


# --------------------------------------------------------------------------- masks.py


def swa_tail_blocks(window: IntLike, block_size: IntLike, eagle: BoolLike) -> z3.ArithRef:
    """masks.swa_tail_blocks: cdiv(window - 1, bs) (+1 with Eagle)."""
    return cdiv(I(window) - 1, block_size) + z3.If(B(eagle), 1, 0)


def boundary_edge(boundary: IntLike, alignment: IntLike, block_size: IntLike) -> z3.ArithRef:
    """masks.boundary_edge: block index just past the aligned boundary at or below `boundary`."""
    a = I(alignment)
    return (I(boundary) / a * a) / I(block_size)


@dataclass(frozen=True)
class Mask:
    """A retention mask: `dense` (the model's None) or the predicate `kept` on [start, end)."""

    dense: z3.BoolRef
    kept: Pred
    periodic: Pred | None = None  # the segment-end part (SWA), for proofs
    at_boundary: Pred | None = None  # the reachable-boundary part (SWA), for proofs

    def __call__(self, i: IntLike) -> z3.BoolRef:
        """Whether block i is kept, counting `dense` as keeping every block of the range."""
        return self.kept(I(i))


def swa_mask(
    start: IntLike,
    end: IntLike,
    *,
    block_size: IntLike,
    window: IntLike,
    alignment: IntLike,
    eagle: BoolLike,
    retention: Retention,
    boundaries: Sequence[IntLike] = (),
    need_delta: int = 0,
    drop_boundaries: bool = False,
) -> Mask:
    """masks.swa_kept_blocks.

    Block i in [start, end) is kept iff it lies in the `need`-block tail below
    some edge e (e - need <= i < e), where the edges are the segment ends
    `q * per_segment + shift` (q >= 1; segment = alignment when dense, k when
    retention is k) and, for retention 0 / k, the edges of the reachable
    boundaries. The tail holding i is unique (need < per_segment), so the
    model's finite set of segment edges is the single candidate
    q = (i - shift) // per_segment + 1, subject to the model's range bound on q.
    `need_delta` and `drop_boundaries` exist only for negative controls.
    """
    bs, w, a, eg, lo, hi = I(block_size), I(window), I(alignment), B(eagle), I(start), I(end)
    need = swa_tail_blocks(w, bs, eg) + need_delta
    shift = z3.If(eg, 1, 0)
    has_seg = retention.mode != ZERO
    segment = z3.If(retention.mode == DENSE, a, retention.k)
    per = segment / bs
    dense = z3.Or(a % bs != 0, z3.And(has_seg, need >= per))

    def periodic(i: z3.ArithRef) -> z3.BoolRef:
        q = (i - shift) / per + 1
        e = q * per + shift
        # masks.py ranges q over [1, (end + need) // per + 2)
        return z3.And(has_seg, q >= 1, q < (hi + need) / per + 2, e - need <= i, i < e)

    def at_boundary(i: z3.ArithRef) -> z3.BoolRef:
        if drop_boundaries:
            return z3.BoolVal(False)
        tails = []
        for b in boundaries:
            e = boundary_edge(b, a, bs) + shift
            tails.append(z3.And(e - need <= i, i < e))
        return z3.And(retention.mode != DENSE, z3.Or(tails + [z3.BoolVal(False)]))

    def kept(i: z3.ArithRef) -> z3.BoolRef:
        return z3.And(lo <= i, i < hi, z3.Or(dense, periodic(i), at_boundary(i)))

    return Mask(dense, kept, periodic, at_boundary)


def mamba_mask(
    start: IntLike,
    end: IntLike,
    *,
    block_size: IntLike,
    alignment: IntLike,
    retention: Retention,
    boundaries: Sequence[IntLike] = (),
    off_by_one: bool = False,
    boundary_shift: int = 0,
) -> Mask:
    """masks.mamba_kept_blocks.

    Dense for retention None or an interval of at most one block; otherwise
    block k in [start, end) is kept iff it is the last block of a k-token
    segment ((k + 1) % per_segment == 0, interval only) or the state block of
    a reachable boundary (boundary_edge - 1). `off_by_one` and
    `boundary_shift` exist only for negative controls.
    """
    bs, a, lo, hi = I(block_size), I(alignment), I(start), I(end)
    per = retention.k / bs
    dense = z3.Or(retention.mode == DENSE, z3.And(retention.mode == INTERVAL, per <= 1))
    delta = 0 if off_by_one else 1

    def kept(k: z3.ArithRef) -> z3.BoolRef:
        seg = z3.And(retention.mode == INTERVAL, (k + delta) % per == 0)
        bnd = z3.Or(
            [k == boundary_edge(b, a, bs) - 1 + boundary_shift for b in boundaries] + [z3.BoolVal(False)]
        )
        return z3.And(lo <= k, k < hi, z3.Or(dense, seg, bnd))

    return Mask(dense, kept)


def replay_boundaries(
    num_prompt_tokens: IntLike, scheduler_block_size: IntLike, eagle: BoolLike
) -> tuple[z3.ArithRef, z3.ArithRef]:
    """masks.replay_boundaries as two terms (equal when the model returns one value)."""
    p, sbs, eg = I(num_prompt_tokens), I(scheduler_block_size), B(eagle)
    resend = (p - 1) / sbs * sbs
    extension = p / sbs * sbs
    return (
        z3.If(eg, zmax(resend - sbs, 0), p - 1),
        z3.If(eg, zmax(extension - sbs, 0), p - 1),
    )


def mamba_checkpoint_position(num_tokens: IntLike, block_size: IntLike, eagle: BoolLike) -> z3.ArithRef:
    """scheduling.mamba_checkpoint_position: the last aligned position a replay can reuse."""
    n, bs, eg = I(num_tokens), I(block_size), B(eagle)
    limit = z3.If(eg, n, n - 1)
    position = limit / bs * bs - z3.If(eg, bs, 0)
    return zmax(position, 0)


def cacheable_tokens(
    num_tokens: IntLike,
    *,
    hybrid: BoolLike,
    scheduler_block_size: IntLike,
    block_size: IntLike,
    eagle: BoolLike,
) -> z3.ArithRef:
    """AllocatorModel._cacheable_tokens: how many tokens a group may cache at allocation time.

    Single group: all. Hybrid: floored to the scheduler block size, plus one
    block (the Eagle peek) with Eagle when anything is aligned.
    """
    n, sbs = I(num_tokens), I(scheduler_block_size)
    floored = n / sbs * sbs
    with_peek = z3.If(z3.And(B(eagle), floored > 0), zmin(n, floored + I(block_size)), floored)
    return z3.If(B(hybrid), with_peek, n)


# --------------------------------------------------------------------------- lookup.py


def aligned(e: IntLike, block_size: IntLike, alignment: IntLike) -> z3.BoolRef:
    """lookup._aligned: e blocks end on an alignment boundary."""
    bs, a = I(block_size), I(alignment)
    return z3.Or(bs == a, (I(e) * bs) % a == 0)


def run_cached(cached: Pred, lo: IntLike, hi: IntLike) -> z3.BoolRef:
    """Blocks max(lo, 0) .. hi - 1 are all cached."""
    return forall_range(zmax(lo, 0) if as_int(lo) is None else max(as_int(lo) or 0, 0), hi, cached)


@dataclass(frozen=True)
class MaxOf:
    """m is the largest x in [lo, hi) with pred(x), or lo - 1 if there is none."""

    m: z3.ArithRef
    pred: Callable[[z3.ArithRef], BoolLike]
    lo: IntLike
    hi: IntLike

    @property
    def chosen(self) -> z3.BoolRef:
        """m is a witness (or the 'none' value)."""
        return z3.Or(
            self.m == I(self.lo) - 1, z3.And(I(self.lo) <= self.m, self.m < I(self.hi), B(self.pred(self.m)))
        )

    @property
    def maximal(self) -> z3.BoolRef:
        """No x above m in range satisfies pred (a bounded quantifier)."""
        return forall_range(self.lo, self.hi, lambda x: z3.Implies(x > self.m, z3.Not(B(self.pred(x)))))

    def instance(self, x: IntLike) -> z3.BoolRef:
        """`maximal` instantiated at x: a quantifier-free consequence used as a proof hint."""
        x = I(x)
        return z3.Implies(z3.And(I(self.lo) <= x, x < I(self.hi), x > self.m), z3.Not(B(self.pred(x))))


def max_of(pred: Callable[[z3.ArithRef], BoolLike], lo: IntLike, hi: IntLike, name: str) -> MaxOf:
    return MaxOf(fresh(name), pred, lo, hi)


@dataclass(frozen=True)
class Hit:
    """A hit rule's result: `blocks` (hit length in blocks) under `side`.

    `side` = every maximum is chosen and maximal; it determines `blocks` for
    concrete inputs. `chosen` and `instance(x)` are consequences of `side`
    without quantifiers, which symbolic proofs use instead of `side`.
    """

    blocks: z3.ArithRef
    maxima: tuple[MaxOf, ...]
    extra: z3.BoolRef = z3.BoolVal(True)

    @property
    def side(self) -> z3.BoolRef:
        return z3.And([self.extra] + [m.chosen for m in self.maxima] + [m.maximal for m in self.maxima])

    @property
    def chosen(self) -> z3.BoolRef:
        return z3.And([self.extra] + [m.chosen for m in self.maxima])

    def instance(self, x: IntLike) -> z3.BoolRef:
        return z3.And([m.instance(x) for m in self.maxima])


def full_hit(
    cached: Pred, max_length: IntLike, block_size: IntLike, alignment: IntLike, drop_eagle: BoolLike
) -> Hit:
    """lookup.full_hit: the run of cached blocks from 0, Eagle drop, floored to the alignment.

    Returns the hit in blocks (cdiv(hit tokens, bs)).
    """
    bs, a, eg = I(block_size), I(alignment), B(drop_eagle)
    nb = I(max_length) / bs
    # the run is the largest n in [0, nb] with blocks 0..n-1 cached (n = 0 always qualifies)
    run = max_of(lambda n: run_cached(cached, 0, n), 0, nb + 1, "run")
    n = run.m
    hit = n * bs
    hit = z3.If(z3.And(eg, hit > 0), hit - zmin(a, bs), hit)
    hit = hit - hit % a
    return Hit(cdiv(hit, bs), (run,), n >= 0)


def swa_candidate(
    cached: Pred, e: IntLike, need: IntLike, block_size: IntLike, alignment: IntLike
) -> z3.BoolRef:
    """Non-Eagle SWA: a hit may end at block edge e (aligned, its `need`-block tail cached)."""
    return z3.And(aligned(e, block_size, alignment), run_cached(cached, I(e) - I(need), e))


def swa_peek(cached: Pred, s: IntLike, need: IntLike, block_size: IntLike, alignment: IntLike) -> z3.BoolRef:
    """Eagle SWA: a full run of `need` blocks ends at the peek block s (the hit ends at s)."""
    return z3.And(
        aligned(s, block_size, alignment),
        I(s) + 1 >= I(need),
        run_cached(cached, I(s) + 1 - I(need), I(s) + 1),
    )


def swa_short(cached: Pred, s: IntLike, need: IntLike, block_size: IntLike, alignment: IntLike) -> z3.BoolRef:
    """Eagle SWA, prompt shorter than the window: a run from block 0 through the peek block s."""
    return z3.And(aligned(s, block_size, alignment), I(s) + 1 < I(need), run_cached(cached, 0, I(s) + 1))


def swa_hit(
    cached: Pred,
    max_length: IntLike,
    block_size: IntLike,
    alignment: IntLike,
    need: IntLike,
    drop_eagle: BoolLike,
    *,
    quirk: bool = True,
) -> Hit:
    """lookup.swa_hit, hit in blocks. `need` includes Eagle's block when `drop_eagle`.

    Without Eagle: the largest aligned edge e <= max_length // bs whose tail is
    cached. With Eagle: the largest aligned peek s < max_length // bs with a
    full run ending at s; else the short run from block 0, reduced by one
    alignment segment when bs != A (`alignment_quirk`, vLLM's double
    re-alignment). `quirk=False` gives the rule without that reduction. A hit
    needs at least one cached block even when the window needs none (window 1).
    """
    bs, a, eg = I(block_size), I(alignment), B(drop_eagle)
    nb = I(max_length) / bs
    need = zmax(need, 1)  # a hit needs at least one cached block at its edge (window 1)
    if z3.is_true(z3.simplify(eg)):
        p = max_of(lambda x: swa_peek(cached, x, need, bs, a), 0, nb, "peek")
        s = max_of(lambda x: swa_short(cached, x, need, bs, a), 0, nb, "short")
        short_hit = z3.If(z3.And(bs != a, quirk), zmax(s.m - a / bs, 0), s.m)
        return Hit(z3.If(p.m >= 0, p.m, z3.If(s.m >= 0, short_hit, 0)), (p, s))
    e = max_of(lambda x: swa_candidate(cached, x, need, bs, a), 1, nb + 1, "edge")
    if z3.is_false(z3.simplify(eg)):
        return Hit(zmax(e.m, 0), (e,))
    # symbolic Eagle flag: both rules, selected by the flag
    eagle_hit = swa_hit(cached, max_length, bs, a, need, True, quirk=quirk)
    return Hit(z3.If(eg, eagle_hit.blocks, zmax(e.m, 0)), (e, *eagle_hit.maxima))


def mamba_hit(cached: Pred, max_length: IntLike, block_size: IntLike, alignment: IntLike) -> Hit:
    """lookup.mamba_hit: the largest aligned state block i < max_length // bs cached; hit i + 1 blocks."""
    bs, a = I(block_size), I(alignment)
    nb = I(max_length) / bs
    state = max_of(lambda x: z3.And(aligned(x + 1, bs, a), cached(x)), 0, nb, "state")
    return Hit(state.m + 1, (state,))


# --------------------------------------------------------------------------- evaluation helpers


def finite_set(members: Iterable[int]) -> Pred:
    """A concrete cached set as a predicate (for evaluating the terms on concrete inputs)."""
    ms = frozenset(members)

    def pred(j: z3.ArithRef) -> z3.BoolRef:
        cj = as_int(j)
        if cj is not None:
            return z3.BoolVal(cj in ms)
        return z3.Or([j == m for m in sorted(ms)] + [z3.BoolVal(False)])

    return pred


def evaluate_hit(term: z3.ArithRef, side: z3.BoolRef, solver: z3.Solver | None = None) -> int:
    """The unique value of `term` (a Hit's blocks) under `side` (inputs concrete); raises if not unique."""
    s = solver if solver is not None else z3.Solver()
    s.push()
    try:
        s.add(z3.simplify(side))
        if s.check() != z3.sat:
            raise ValueError("hit side condition unsatisfiable")
        value = s.model().eval(term, model_completion=True).as_long()
        s.add(term != value)
        if s.check() != z3.unsat:
            raise ValueError("hit not determined uniquely")
        return int(value)
    finally:
        s.pop()


def evaluate_mask(mask: Mask, start: int, end: int) -> set[int] | None:
    """The model's view of a mask on concrete inputs: None (dense) or the kept set."""
    if z3.is_true(z3.simplify(mask.dense)):
        return None
    return {i for i in range(start, end) if z3.is_true(z3.simplify(mask(i)))}
