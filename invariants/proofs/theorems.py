"""Z3 theorems about retention masks, hit rules and free-queue order (issue 3).

Each theorem is a named function whose docstring is its statement. It returns
`proved` (Z3 showed the negation unsatisfiable), `refuted` (with a
counterexample in domain terms) or `unknown` (a step timed out). Variables are
unbounded integers unless the result names a bound.

The terms come from `model/smt.py`, which `tests/test_smt.py` checks against
the executable model (`model/masks.py`, `model/lookup.py`) on thousands of
concrete inputs, so the theorems are about the code the fuzzer runs.

Proof style. A theorem is a chain of steps; each step is one validity check
`hyps => claim`. A proved step is a tautology, so later steps may use it as a
hypothesis (and its universal closure over a free index, `generalize`). Steps
keep Z3 in decidable territory: quotient facts (`x / p == q - 1` when
`x` lies in the q-th block of p) are proved once as separate steps instead of
asking Z3 for nonlinear integer reasoning in one go. Hit rules are maxima;
steps use the witness part (`Hit.chosen`) and explicit instances of the
maximality quantifier (`Hit.instance(x)`), both consequences of the rule.

Lemmas proved with an uninterpreted `cached` predicate hold for every cached
set, in particular for the one a retention mask describes (the composition
is stated in the theorem's docstring).

Negative controls: every theorem has a deliberately broken twin (off-by-one
tail, dropped boundary, missing Eagle block, wrong prepend, ...) that must be
refuted. Findings: statements the design would like that do not hold of the
model (or of vLLM); expected to be refuted, reported with the counterexample.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from model import smt
from model.smt import DENSE, INTERVAL, ZERO, I

STEP_TIMEOUT_MS = 20_000  # generous: steps take ~0.1-3 s; the margin absorbs a loaded machine
CONTROL_TIMEOUT_MS = 2_000  # controls fall back to a small-size counterexample search
_STEP_TIMES = bool(os.environ.get("KVRETAIN_STEP_TIMES"))

# --------------------------------------------------------------------------- results


@dataclass
class TheoremResult:
    name: str
    statement: str
    result: str  # "proved" | "refuted" | "unknown"
    bound: str | None
    seconds: float
    counterexample: str | None = None
    is_control: bool = False
    is_finding: bool = False
    detail: str | None = None

    @property
    def expected_ok(self) -> bool:
        """Theorems must be proved; controls and findings must be refuted; a skipped check is no failure."""
        if self.result == "skipped":
            return True
        if self.is_control or self.is_finding:
            return self.result == "refuted"
        return self.result == "proved"

    @property
    def kind(self) -> str:
        return "control" if self.is_control else ("finding" if self.is_finding else "theorem")


@dataclass
class Step:
    """One validity check: hyps => claim (or, with `witness`, satisfiability of hyps and claim)."""

    label: str
    claim: z3.BoolRef
    hyps: Sequence[z3.BoolRef] = ()
    generalize: Sequence[z3.ExprRef] = ()
    witness: bool = False
    # the proved implication is valid for every value of its constants, so it may
    # also be recorded with some constants replaced by terms (instances)
    also_at: Sequence[Sequence[tuple[z3.ExprRef, z3.ExprRef]]] = ()
    # the labels of earlier steps this one uses (None: all of them); fewer lemmas, faster Z3
    uses: Sequence[str] | None = None
    # a lemma over fresh variables: checked without the theorem's premises
    standalone: bool = False


@dataclass
class Outcome:
    result: str
    counterexample: str | None = None
    detail: str | None = None


Describe = Callable[[z3.ModelRef], str]


def _search_small(s: z3.Solver, grid: Sequence[Sequence[z3.BoolRef]]) -> z3.ModelRef | None:
    """Look for a counterexample with the size parameters pinned to small values (linear, fast)."""
    deadline = time.monotonic() + 8.0
    for pins in grid:
        if time.monotonic() > deadline:
            break
        s.push()
        s.add(*pins)
        s.set("timeout", 1500)
        r = s.check()
        model = s.model() if r == z3.sat else None
        s.pop()
        if model is not None:
            return model
    return None


def run_steps(
    steps: Sequence[Step],
    base: Sequence[z3.BoolRef],
    describe: Describe,
    grid: Sequence[Sequence[z3.BoolRef]] = (),
    timeout_ms: int | None = None,
    refute_at: str | None = None,
) -> Outcome:
    """Check the steps in order; each proved step becomes a hypothesis of the next.

    When a step is unknown and `grid` is given, small pinned size parameters are
    tried: a model found there is a genuine counterexample (refuted); none
    found leaves the step unknown. Controls name the step their breakage hits
    (`refute_at`): that step is searched first, without the earlier lemmas
    (they only help a proof; a model of the step alone is a counterexample).
    """
    if refute_at is not None:
        target = [st for st in steps if st.label == refute_at]
        assert target, f"no step {refute_at!r}"
        s = z3.Solver()
        s.add(*base, *target[0].hyps, z3.Not(target[0].claim))
        found = _search_small(s, grid) if grid else None
        if found is not None:
            return Outcome("refuted", f"{refute_at}: {describe(found)}")
    lemmas: list[tuple[str, z3.BoolRef]] = []
    witnesses: list[str] = []
    for step in steps:
        t0 = time.monotonic()
        s = z3.Solver()
        s.set("timeout", timeout_ms or (CONTROL_TIMEOUT_MS if grid else STEP_TIMEOUT_MS))
        if not step.standalone:
            s.add(*base, *[f for label, f in lemmas if step.uses is None or label in step.uses])
        s.add(*step.hyps)
        if step.witness:
            s.add(step.claim)
            r = s.check()
            if r == z3.sat:
                witnesses.append(f"{step.label}: {describe(s.model())}")
                continue
            return Outcome("refuted" if r == z3.unsat else "unknown", None, f"no witness for {step.label}")
        s.add(z3.Not(step.claim))
        r = s.check()
        if _STEP_TIMES:
            print(f"    {step.label}: {r} {time.monotonic() - t0:.2f}s", flush=True)
        if r == z3.sat:
            return Outcome("refuted", f"{step.label}: {describe(s.model())}")
        if r != z3.unsat:
            reason = s.reason_unknown()
            found = _search_small(s, grid) if grid else None
            if found is not None:
                return Outcome("refuted", f"{step.label}: {describe(found)}")
            return Outcome("unknown", None, f"step '{step.label}': {reason}")
        fact = z3.Implies(z3.And(list(step.hyps) + [z3.BoolVal(True)]), step.claim)
        for subs in step.also_at:
            inst = z3.substitute(fact, *subs)
            lemmas.append((step.label, z3.ForAll(list(step.generalize), inst) if step.generalize else inst))
        lemmas.append((step.label, z3.ForAll(list(step.generalize), fact) if step.generalize else fact))
    return Outcome("proved", None, "; ".join(witnesses) or None)


@dataclass
class Theorem:
    name: str
    fn: Callable[[], Outcome]
    is_control: bool = False
    is_finding: bool = False
    bound: str | None = None

    @property
    def statement(self) -> str:
        doc = (self.fn.__doc__ or "").strip()
        return " ".join(doc.split("\n\n")[0].split())


CATALOGUE: list[Theorem] = []


def theorem(*, control: bool = False, finding: bool = False, bound: str | None = None):  # type: ignore[no-untyped-def]
    def register(fn: Callable[[], Outcome]) -> Callable[[], Outcome]:
        CATALOGUE.append(Theorem(fn.__name__, fn, control, finding, bound))
        return fn

    return register


# --------------------------------------------------------------------------- describing models


def _v(m: z3.ModelRef, t: z3.ExprRef) -> str:
    x = m.eval(t, model_completion=True)
    if z3.is_int_value(x):
        return str(x.as_long())
    if z3.is_true(x):
        return "yes"
    if z3.is_false(x):
        return "no"
    return str(x)


def _n(m: z3.ModelRef, t: z3.ExprRef) -> int:
    return int(m.eval(t, model_completion=True).as_long())


# --------------------------------------------------------------------------- SWA context


class Swa:
    """A symbolic SWA group of a hybrid model, the prompt it cached and its boundaries.

    `end` = the number of the request's blocks that went through caching; the
    reachable boundaries are what the allocator passes: the replay boundaries
    of the prompt and, when there is one, the shared-prefix junction (and,
    with Eagle, the junction minus one block).
    """

    def __init__(self, tag: str = "", *, eagle: bool | None = None, window_one: bool = False) -> None:
        names = ["block_size", "window", "alignment", "prompt", "end", "junction", "max_length"]
        self.bs, self.w, self.A, self.P, self.end, self.J, self.L = (z3.Int(n + tag) for n in names)
        self.eagle = z3.Bool("eagle" + tag) if eagle is None else z3.BoolVal(eagle)
        self.is_eagle = eagle
        self.r = smt.Retention.symbolic("retention" + tag)
        self.has_j = z3.Bool("has_junction" + tag)
        self.need = smt.swa_tail_blocks(self.w, self.bs, self.eagle)
        self.shift = z3.If(self.eagle, 1, 0)
        b1, b2 = smt.replay_boundaries(self.P, self.A, self.eagle)
        self.replay = b1  # the boundary a resend (max length P - 1) lands on
        # duplicates stand for "absent": they do not change the union of tails
        self.boundaries = [
            b1,
            b2,
            z3.If(self.has_j, self.J, b1),
            z3.If(z3.And(self.has_j, self.eagle), self.J - self.bs, b1),
        ]
        self.seg = z3.If(self.r.mode == DENSE, self.A, self.r.k)
        self.per = self.seg / self.bs
        self.side = [
            smt.config_side_conditions(block_size=self.bs, alignment=self.A, retention=self.r, window=self.w),
            self.P >= 1,
            self.end >= 0,
            z3.Implies(self.has_j, self.J >= 1),
            # a window of one token needs no block, yet a hit needs one: see finding_swa_window_one
            z3.And(self.w == 1, z3.Not(self.eagle)) if window_one else z3.Or(self.w >= 2, self.eagle),
        ]

    def mask(self, **control: object) -> smt.Mask:
        return smt.swa_mask(
            0,
            self.end,
            block_size=self.bs,
            window=self.w,
            alignment=self.A,
            eagle=self.eagle,
            retention=self.r,
            boundaries=self.boundaries,
            **control,  # type: ignore[arg-type]
        )

    def cached(self, mask: smt.Mask, name: str) -> tuple[z3.FuncDeclRef, z3.BoolRef]:
        """An uninterpreted cached predicate defined as the mask (gives Z3 a trigger to instantiate on)."""
        C = z3.Function(name, z3.IntSort(), z3.BoolSort())
        x = z3.Int("x_" + name)
        return C, z3.ForAll([x], C(x) == mask(x), patterns=[C(x)])

    def hit(self, cached: smt.Pred, max_length: z3.ArithRef, *, quirk: bool = True) -> smt.Hit:
        return smt.swa_hit(cached, max_length, self.bs, self.A, self.need, self.eagle, quirk=quirk)

    def describe(self, m: z3.ModelRef) -> str:
        parts = [
            f"block_size={_v(m, self.bs)}",
            f"window={_v(m, self.w)}",
            f"alignment={_v(m, self.A)}",
            f"retention={self.r.describe(m)}",
            f"eagle={_v(m, self.eagle)}",
            f"prompt={_v(m, self.P)} tokens",
            f"{_v(m, self.end)} blocks cached",
            f"need={_v(m, self.need)} blocks",
        ]
        if z3.is_true(m.eval(self.has_j, model_completion=True)):
            parts.append(f"junction={_v(m, self.J)}")
        return ", ".join(parts)

    def grid(self) -> list[list[z3.BoolRef]]:
        """Small sizes for counterexample search: block size, alignment multiple, window, interval."""
        out = []
        for bs in (1, 2, 4):
            for mult in (1, 2, 3):
                for w in (1, 2, 3, 5, 9):
                    for r in (None, 0, 2, 3):
                        mode = DENSE if r is None else (ZERO if r == 0 else INTERVAL)
                        out.append(
                            [
                                self.bs == bs,
                                bs * mult == self.A,
                                self.w == w,
                                self.r.mode == mode,
                                self.r.k == (r or 0) * bs * mult,
                            ]
                        )
        return out

    def arith_steps(self) -> list[Step]:
        """Facts about the segment length every SWA proof needs (validator side conditions)."""
        seg, bs, A = self.seg, self.bs, self.A
        blocks = (seg / A) * (A / bs)
        return [
            Step("alignment is whole blocks", (A / bs) * bs == A),
            Step("segment is whole alignments", seg % A == 0),
            Step("segment = n alignments", seg == (seg / A) * A),
            Step("segment = n*a blocks", seg == blocks * bs),
            Step("blocks per segment", seg / bs == blocks),
            Step("segment is whole blocks", seg == self.per * bs),
        ]


_generic_ids = iter(range(10**9))


def _generic(
    label: str,
    arity: int,
    build: Callable[..., tuple[Sequence[z3.BoolRef], z3.BoolRef]],
    *at: Sequence[z3.ArithRef],
) -> Step:
    """An arithmetic lemma proved over fresh integers, recorded at the given argument terms.

    Proving `hyps(v) => claim(v)` for fresh v and substituting terms is sound (the
    proved formula is valid for every value of v); it spares Z3 the structure
    of the terms, which is where nonlinear reasoning times out.
    """
    n = next(_generic_ids)
    vs = [z3.Int(f"g{n}_{j}") for j in range(arity)]
    hyps, claim = build(*vs)
    return Step(
        label,
        claim,
        hyps,
        also_at=[[(v, I(t)) for v, t in zip(vs, args)] for args in at],
        uses=[],
        standalone=True,
    )


def _mul_mod(*at: Sequence[z3.ArithRef]) -> Step:
    """x == n * A  =>  (q * x) % A == 0."""
    return _generic(
        "multiple of a multiple", 4, lambda q, x, n, a: ([a >= 1, x == n * a], (q * x) % a == 0), *at
    )


def _div_lower(*at: Sequence[z3.ArithRef]) -> Step:
    """p >= 1 and x >= q * p  =>  x / p >= q."""
    return _generic("division lower bound", 3, lambda x, p, q: ([p >= 1, x >= q * p], x / p >= q), *at)


def _cancel(*at: Sequence[z3.ArithRef]) -> Step:
    """y >= 1  =>  (x * y) / y == x."""
    return _generic("cancel", 2, lambda x, y: ([y >= 1], (x * y) / y == x), *at)


def _whole_blocks_steps(x: z3.ArithRef, a: z3.ArithRef, b: z3.ArithRef) -> list[Step]:
    """x % a == 0 and a % b == 0 (a, b >= 1)  =>  x == (x / b) * b, as a chain Z3 can follow."""
    return [
        Step("x = n*a", x == (x / a) * a, [a >= 1, x % a == 0]),
        Step("a = m*b", a == (a / b) * b, [b >= 1, a % b == 0]),
        _generic(
            "whole blocks",
            5,
            lambda x_, a_, b_, n, m: ([b_ >= 1, x_ == n * a_, a_ == m * b_], x_ == (x_ / b_) * b_),
            (x, a, b, x / a, a / b),
        ),
        Step(
            "x is whole b",
            x == (x / b) * b,
            [a >= 1, b >= 1, x % a == 0, a % b == 0],
            uses=["x = n*a", "a = m*b", "whole blocks"],
        ),
    ]


def _floor_aligned(x: z3.ArithRef, a: z3.ArithRef) -> Step:
    """(x - x % a) % a == 0 and (x / a * a) % a == 0 for a >= 1."""
    return _generic(
        "floor is aligned",
        2,
        lambda x_, a_: ([a_ >= 1], z3.And((x_ - x_ % a_) % a_ == 0, (x_ / a_ * a_) % a_ == 0)),
        (x, a),
    )


def _quotient_step(
    label: str,
    x: z3.ArithRef,
    p: z3.ArithRef,
    q: z3.ArithRef,
    n: z3.ArithRef,
    hyps: Sequence[z3.BoolRef],
    generalize: Sequence[z3.ExprRef] = (),
) -> Step:
    """x in [q*p - n, q*p) with 0 <= n < p  =>  x / p == q - 1 (the tail lies in segment q)."""
    return Step(label, x / p == q - 1, [*hyps, p >= 1, n >= 0, n < p, q * p - n <= x, x < q * p], generalize)


# --------------------------------------------------------------------------- SWA theorems


def _per_eagle(build: Callable[[bool], Outcome]) -> Outcome:
    """Prove without and with Eagle separately (smaller formulas); the first failure wins."""
    details = []
    for eagle in (False, True):
        o = build(eagle)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"eagle={eagle}: {o.detail}" if o.detail else None)
        if o.detail:
            details.append(o.detail)
    return Outcome("proved", None, "; ".join(details) or None)


def _segment_promise(
    c: Swa,
    mask: smt.Mask,
    q: z3.ArithRef,
    tag: str = "",
    also_at: Sequence[Sequence[tuple[z3.ExprRef, z3.ExprRef]]] = (),
) -> tuple[list[Step], smt.Hit]:
    """Steps proving: the segment end E = q * segment is served (hit >= E); returns (steps, hit)."""
    i = z3.Int("i" + tag)
    C, axiom = c.cached(mask, "cached" + tag)
    E = q * c.seg
    e = E / c.bs + c.shift
    pre = [axiom, c.r.mode != ZERO, z3.Not(mask.dense), q >= 1, c.end >= e]
    in_tail = [smt.zmax(e - c.need, 0) <= i, i < e]
    hit = c.hit(C, c.L)
    qi = (i - c.shift) / c.per + 1
    steps = c.arith_steps() + [
        _mul_mod((q, c.seg, c.seg / c.A, c.A)),
        _div_lower((c.end + c.need, c.per, q)),
        Step("E in blocks", E / c.bs == q * c.per, pre),
        Step("E aligned", E % c.A == 0, pre),
        _quotient_step("tail lies in segment q", i - c.shift, c.per, q, c.need, pre + in_tail),
        Step("tail edge", qi * c.per == q * c.per, pre + in_tail),
        Step("tail start", qi * c.per + c.shift - c.need <= i, pre + in_tail),
        Step("mask range bound", (c.end + c.need) / c.per >= q, pre + [c.per >= 1]),
        Step("every tail block kept", C(i), pre + in_tail, [i]),
        Step(
            "scan finds the tail",
            hit.blocks * c.bs >= E,
            pre + [e * c.bs <= c.L, hit.chosen, hit.instance(e - c.shift) if c.is_eagle else hit.instance(e)],
            uses=["every tail block kept", "E in blocks", "E aligned", "segment is whole blocks"],
        ),
    ]
    for st in steps[len(c.arith_steps()) + 2 :]:
        st.also_at = also_at
    return steps, hit


@theorem()
def swa_promise_segments() -> Outcome:
    """Promise kept (#43447): for retention None (every alignment boundary) and k, every segment end E whose tail the request computed is served: the SWA right-to-left scan finds all its contiguous blocks (incl. Eagle's peek), so the hit is >= E.

    Unbounded: block size, window (>= 2, or any with Eagle: finding_swa_window_one), alignment,
    interval, segment index; with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        steps, _ = _segment_promise(c, c.mask(), z3.Int("q"))
        return run_steps(steps, c.side, c.describe)

    return _per_eagle(build)


@theorem(control=True)
def control_swa_tail_one_short() -> Outcome:
    """Control for swa_promise_segments: a mask whose tail is one block short (need - 1) loses a promised hit."""
    c = Swa()
    mask = c.mask(need_delta=-1)
    q = z3.Int("q")
    steps, _ = _segment_promise(c, mask, q)
    E = q * c.seg

    def describe(m: z3.ModelRef) -> str:
        e = _n(m, E / c.bs + c.shift)
        lo = max(e - _n(m, c.need), 0)
        missing = [j for j in range(lo, e) if not z3.is_true(m.eval(mask(j), model_completion=True))]
        return f"{c.describe(m)}: segment end {_n(m, E)} tokens, tail blocks {lo}..{e - 1}, block(s) {missing} not kept"

    return run_steps(steps, c.side, describe, grid=c.grid(), refute_at="every tail block kept")


@theorem(finding=True)
def finding_swa_window_one() -> Outcome:
    """Finding (model and vLLM 0.33.0): an SWA group with a one-token window needs no block (need = cdiv(0, bs) = 0), so reachable_block_mask keeps no block even in dense mode, while find_longest_cache_hit still needs one cached block at the hit's edge: the group never serves a hit.

    Expected refuted (degenerate window; the other SWA theorems assume window >= 2 or Eagle).
    """
    c = Swa(eagle=False, window_one=True)
    steps, _ = _segment_promise(c, c.mask(), z3.Int("q"))
    return run_steps(steps, c.side, c.describe, grid=c.grid(), refute_at="scan finds the tail")


def _no_waste_steps(c: Swa, mask: smt.Mask, *, block0: bool = False) -> list[Step]:
    i = z3.Int("i")
    q = (i - c.shift) / c.per + 1
    E = q * c.seg

    def read_by(E_: z3.ArithRef) -> z3.BoolRef:
        """Block i is read by the scan for a hit of E_ > 0 tokens (incl. Eagle's peek)."""
        e_ = E_ / c.bs + c.shift
        return z3.And(E_ >= c.A, E_ % c.A == 0, e_ - c.need <= i, i < e_)

    periodic = z3.And(c.r.mode != ZERO, q >= 1, read_by(E))
    at_boundary = z3.Or([z3.And(c.r.mode != DENSE, read_by(b / c.A * c.A)) for b in c.boundaries])
    pre = [mask(i), z3.Not(mask.dense)]
    if not block0:
        pre.append(z3.Or(i >= 1, z3.Not(c.eagle)))
    return c.arith_steps() + [
        _mul_mod((q, c.seg, c.seg / c.A, c.A)),
        *[_mul_mod((b / c.A, c.A, c.A / c.bs, c.bs), (b / c.A, c.A, 1, c.A)) for b in c.boundaries],
        Step("E in blocks", z3.Implies(q >= 1, E / c.bs == q * c.per), pre),
        Step("E aligned", E % c.A == 0, pre),
        Step("E positive", z3.Implies(z3.And(q >= 1, c.r.mode != ZERO), E >= c.A), pre),
        Step("kept block is read by a retained boundary", z3.Or(periodic, at_boundary), pre),
    ]


@theorem()
def swa_no_waste() -> Outcome:
    """No waste (#42258): every SWA block the mask keeps (block 0 with Eagle aside, see finding_swa_eagle_block_zero) lies in the tail, incl. Eagle's peek, that the scan reads for a positive hit at some retained aligned boundary (a segment end or a reachable boundary).

    The boundary may lie past the blocks computed so far (a segment's tail is
    cached as the request passes it). Sparse masks; when need >= blocks per
    segment the mask is dense by design. Unbounded.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(_no_waste_steps(c, c.mask()), c.side, c.describe)

    return _per_eagle(build)


@theorem(control=True)
def control_swa_tail_one_long() -> Outcome:
    """Control for swa_no_waste: a mask whose tail is one block too long (need + 1) caches a block no hit reads."""
    c = Swa(eagle=False)
    mask = c.mask(need_delta=1)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {_v(m, i)} is kept but lies in no retained boundary's tail"

    return run_steps(
        _no_waste_steps(c, mask),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="kept block is read by a retained boundary",
    )


@theorem(finding=True)
def finding_swa_eagle_block_zero() -> Outcome:
    """Finding (model and vLLM 0.33.0 reachable_block_mask): with Eagle and retention 0 / k, a reachable boundary below one alignment (a prompt shorter than 2A, or a junction below A) floors to 0 and keeps block 0 as the 'peek' of an empty hit: one cached block no hit reads.

    Expected refuted; harmless for correctness (one block of waste per such
    prompt), and the reason the dense/sparse inclusion excludes block 0.
    """
    c = Swa(eagle=True)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {_v(m, i)} is kept but no positive hit reads it"

    return run_steps(
        _no_waste_steps(c, c.mask(), block0=True),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="kept block is read by a retained boundary",
    )


def _boundary_promise(
    c: Swa, mask: smt.Mask, b: z3.ArithRef, L: z3.ArithRef, *, quirk_clause: bool, hit: smt.Hit | None = None
) -> list[Step]:
    """The aligned boundary floor_A(b) is served by a lookup of max length L."""
    i = z3.Int("i")
    C, axiom = c.cached(mask, "cached")
    E = b / c.A * c.A
    s = E / c.bs
    e = s + c.shift
    hit = hit if hit is not None else c.hit(C, L)
    pre = [axiom, c.r.mode != DENSE, c.end >= e, e * c.bs <= L, b >= 0]
    in_tail = [smt.zmax(e - c.need, 0) <= i, i < e]
    short = z3.And(c.eagle, s + 1 < c.need, c.bs != c.A)
    claim = hit.blocks * c.bs >= E
    if quirk_clause:  # lookup.py's alignment_quirk: the short Eagle run loses one alignment segment
        claim = z3.If(short, hit.blocks * c.bs >= E - c.A, claim)
    return c.arith_steps() + [
        _mul_mod((b / c.A, c.A, c.A / c.bs, c.bs)),
        Step("boundary = n*a blocks", (b / c.A) * (c.A / c.bs) * c.bs == E, pre),
        _cancel(((b / c.A) * (c.A / c.bs), c.bs)),
        Step("boundary in whole blocks", s * c.bs == E, pre),
        _floor_aligned(b, c.A),
        Step("every tail block kept", C(i), pre + in_tail, [i]),
        Step(
            "scan finds the tail",
            claim,
            pre + [hit.chosen, hit.instance(s) if c.is_eagle else hit.instance(e)],
            uses=["every tail block kept", "boundary in whole blocks", "floor is aligned"],
        ),
    ]


def _resend(c: Swa) -> list[z3.BoolRef]:
    """A resend of the prompt: max cache-hit length P - 1."""
    return [c.L == c.P - 1]


@theorem()
def swa_promise_replay() -> Outcome:
    """Promise kept (#43447): with retention 0 or k, a resend of a cached prompt (max length P - 1) hits at least its latest replayable boundary (P - 1, with Eagle floor_A(P - 1) - A) floored to the alignment, whenever the request computed that boundary's tail; with Eagle, bs != A and the boundary less than a window above block 0, one alignment segment less (lookup.py alignment_quirk; finding_swa_eagle_short_prompt).

    Unbounded: block size, window (>= 2, or any with Eagle), alignment, interval, prompt length;
    with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(
            _boundary_promise(c, c.mask(), c.replay, c.L, quirk_clause=True), c.side + _resend(c), c.describe
        )

    return _per_eagle(build)


@theorem(control=True)
def control_swa_dropped_replay_boundary() -> Outcome:
    """Control for swa_promise_replay: a mask that forgets the reachable boundaries loses the resend hit."""
    c = Swa()
    steps = _boundary_promise(c, c.mask(drop_boundaries=True), c.replay, c.L, quirk_clause=True)

    def describe(m: z3.ModelRef) -> str:
        E = _n(m, c.replay / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens not served (its tail blocks are not kept)"

    return run_steps(steps, c.side + _resend(c), describe, grid=c.grid(), refute_at="every tail block kept")


@theorem(finding=True)
def finding_swa_eagle_short_prompt() -> Outcome:
    """Finding (vLLM 0.33.0 SlidingWindowManager.find_longest_cache_hit, kept by lookup.py): with Eagle, bs != A and a replay boundary less than one window above block 0, the resend hit is one alignment segment short although every block of the boundary is cached.

    Expected refuted: the counterexample is a configuration where the hit is
    suboptimal (never wrong: fewer tokens reused).
    """
    c = Swa(eagle=True)
    steps = _boundary_promise(c, c.mask(), c.replay, c.L, quirk_clause=False)

    def describe(m: z3.ModelRef) -> str:
        E = _n(m, c.replay / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens is fully cached, the hit is {E - _n(m, c.A)}"

    return run_steps(steps, c.side + _resend(c), describe, grid=c.grid(), refute_at="scan finds the tail")


@theorem()
def swa_promise_junction() -> Outcome:
    """Promise kept: with retention 0 or k, a later request sharing the prefix up to the shared-prefix junction J hits at least floor_A(J) whenever its max length reaches that boundary's peek (same Eagle short-prompt exception as swa_promise_replay).

    Unbounded (window >= 2, or any with Eagle); with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(
            _boundary_promise(c, c.mask(), c.J, c.L, quirk_clause=True), c.side + [c.has_j], c.describe
        )

    return _per_eagle(build)


@theorem(control=True)
def control_swa_dropped_junction() -> Outcome:
    """Control for swa_promise_junction: without the reachable boundaries the junction hit is lost."""
    c = Swa()
    steps = _boundary_promise(c, c.mask(drop_boundaries=True), c.J, c.L, quirk_clause=True)
    return run_steps(steps, c.side + [c.has_j], c.describe, grid=c.grid(), refute_at="every tail block kept")


# ---- sparse vs dense


def _dense_twin(c: Swa) -> smt.Mask:
    return smt.swa_mask(
        0,
        c.end,
        block_size=c.bs,
        window=c.w,
        alignment=c.A,
        eagle=c.eagle,
        retention=smt.Retention(I(DENSE), I(0)),
        boundaries=c.boundaries,
    )


def _inclusion_steps(c: Swa, sparse: smt.Mask, dense: smt.Mask) -> list[Step]:
    """sparse(i) => dense(i) for i >= 1 (any i without Eagle)."""
    assert sparse.periodic is not None and sparse.at_boundary is not None
    i = z3.Int("i")
    pa = c.A / c.bs  # blocks per alignment (the dense segment)
    m = c.r.k / c.A
    qk = (i - c.shift) / c.per + 1
    Q = qk * m  # the dense segment index of a sparse segment end
    pre = [c.r.mode != DENSE, z3.Not(dense.dense), z3.Or(i >= 1, z3.Not(c.eagle)), i >= 0, i < c.end]
    per_sp = [*pre, c.r.mode == INTERVAL, sparse.periodic(i)]
    steps = c.arith_steps() + [
        Step("interval = m alignments", c.r.k == m * c.A, [c.r.mode == INTERVAL]),
        _cancel((m * pa, c.bs)),
        Step("blocks per interval", c.per == m * pa, [c.r.mode == INTERVAL, pa * c.bs == c.A]),
        Step("segment end in alignment blocks", Q * pa == qk * c.per, per_sp),
        _quotient_step("dense segment of a sparse tail", i - c.shift, pa, Q, c.need, per_sp),
        Step("dense tail edge", ((i - c.shift) / pa + 1) * pa == Q * pa, per_sp),
        Step("sparse segment tail within dense", dense(i), per_sp),
    ]
    # one generic reachable boundary b, recorded at each actual boundary term
    b = z3.Int("boundary")
    qb = b / c.A
    at_b = [
        *pre,
        c.r.mode != DENSE,
        b >= 0,
        (qb * c.A) / c.bs + c.shift - c.need <= i,
        i < (qb * c.A) / c.bs + c.shift,
    ]
    each = [[(b, bt)] for bt in c.boundaries]
    steps += [
        _cancel((qb * pa, c.bs)),
        Step(
            "boundary edge in alignment blocks",
            (qb * c.A) / c.bs == qb * pa,
            [pa * c.bs == c.A],
            also_at=each,
        ),
        Step("boundary below one alignment reads nothing", qb >= 1, at_b, also_at=each),
        _quotient_step("dense segment of a boundary tail", i - c.shift, pa, qb, c.need, at_b),
        Step("boundary tail edge", ((i - c.shift) / pa + 1) * pa == qb * pa, at_b),
        Step("boundary tail within dense", dense(i), at_b, also_at=each),
    ]
    steps.append(
        Step("sparse mask within dense", dense(i), [*pre, *[bt >= 0 for bt in c.boundaries], sparse(i)], [i])
    )
    return steps


def _hit_monotone_steps(eagle: bool) -> tuple[list[Step], list[z3.BoolRef], Describe]:
    """For cached sets C1 within C2 (C1 within C2 plus block 0 with Eagle, block 0 being in C2 whenever
    a hit could read it): the SWA hit over C1 is at most the hit over C2."""
    C1 = z3.Function("cached_sparse", z3.IntSort(), z3.BoolSort())
    C2 = z3.Function("cached_dense", z3.IntSort(), z3.BoolSort())
    bs, A, L, need = z3.Ints("block_size alignment max_length need")
    j = z3.Int("j")
    within = z3.Or(C2(j), z3.And(eagle, j == 0))
    base = [
        bs >= 1,
        bs <= A,
        A % bs == 0,
        need >= (1 if eagle else 0),
        z3.ForAll([j], z3.Implies(C1(j), within), patterns=[C1(j)]),
    ]
    if eagle:  # the dense mask keeps every block when need >= A / bs (its fallback)
        base.append(z3.Implies(z3.And(need > A / bs, C1(0)), C2(0)))
    h1 = smt.swa_hit(C1, L, bs, A, need, eagle)
    h2 = smt.swa_hit(C2, L, bs, A, need, eagle)
    hyps = [h1.chosen, h2.chosen] + [h2.instance(mm.m) for mm in h1.maxima]
    steps = [
        Step("aligned peeks are whole alignments", z3.Implies(mm.m >= 1, mm.m >= A / bs), [h1.chosen])
        for mm in h1.maxima
        if eagle
    ] + [Step("hit monotone in the cached set", h1.blocks <= h2.blocks, hyps)]

    def describe(m: z3.ModelRef) -> str:
        return f"block_size={_v(m, bs)}, alignment={_v(m, A)}, need={_v(m, need)}, max_length={_v(m, L)}"

    return steps, base, describe


@theorem()
def swa_sparse_never_exceeds_dense() -> Outcome:
    """Sparse never exceeds dense: the retention-0 / retention-k SWA mask keeps a subset of the dense mask (block 0 with Eagle aside, which no positive hit reads unless the dense mask keeps it too), and the SWA hit is monotone in the cached set, so the sparse hit is at most the dense hit.

    Two lemmas, both unbounded: mask inclusion; hit monotonicity for arbitrary
    cached predicates related that way (hence for the two masks).
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        first = run_steps(_inclusion_steps(c, c.mask(), _dense_twin(c)), c.side, c.describe)
        if first.result != "proved":
            return first
        steps, base, describe = _hit_monotone_steps(eagle)
        return run_steps(steps, base, describe)

    return _per_eagle(build)


@theorem(control=True)
def control_swa_sparse_exceeds_dense() -> Outcome:
    """Control for swa_sparse_never_exceeds_dense: a sparse mask with a one-block-longer tail is not within the dense mask."""
    c = Swa(eagle=False)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {_v(m, i)} kept by the sparse mask, not by the dense one"

    return run_steps(
        _inclusion_steps(c, c.mask(need_delta=1), _dense_twin(c))[-1:], c.side, describe, grid=c.grid()
    )


def _within_one_interval_steps(c: Swa, sparse: smt.Mask) -> list[Step]:
    """Sparse (interval k) hit > dense hit - k over the same computed prompt and max length.

    The premises of the last steps are the definitions (cached = mask, the two
    hit rules' witnesses and two maximality instances) and retention k.
    """
    dense = _dense_twin(c)
    D, dense_axiom = c.cached(dense, "cached_dense")
    hd = c.hit(D, c.L)
    k = c.r.k
    q = z3.Int("q")
    hd_tokens = hd.blocks * c.bs
    qd = hd_tokens / k
    # the segment-promise chain is proved for a free q and recorded also at q = floor(dense hit / k)
    promise, hs = _segment_promise(c, sparse, q, "s", also_at=[[(q, qd)]])
    last = hd.blocks + c.shift - 1  # the last block the dense hit's scan read (Eagle: the peek)
    e_qd = (qd * k) / c.bs + c.shift
    sparse_axiom = c.cached(sparse, "cacheds")[1]
    premises = [
        dense_axiom,
        sparse_axiom,
        c.r.mode == INTERVAL,
        z3.Not(sparse.dense),
        hd.chosen,
        hs.chosen,
        hs.instance(e_qd - c.shift) if c.is_eagle else hs.instance(e_qd),
        hs.instance(hd.blocks),
    ]
    tail = [
        Step(
            "dense hit reads cached blocks", z3.Implies(z3.And(hd.blocks >= 1, c.need >= 1), D(last)), uses=[]
        ),
        Step(
            "dense hit within max length",
            z3.Implies(hd.blocks >= 1, (hd.blocks + c.shift) * c.bs <= c.L),
            uses=[],
        ),
        Step("floor to the interval", z3.And(qd * k <= hd_tokens, hd_tokens < qd * k + k), uses=[]),
        Step(
            "floored boundary whole blocks",
            (qd * k) % c.bs == 0,
            [k == k / c.A * (c.A / c.bs) * c.bs],
            uses=["multiple of a multiple"],
        ),
        Step(
            "floored boundary in blocks",
            (qd * k) / c.bs <= hd.blocks,
            uses=["floor to the interval", "floored boundary whole blocks"],
        ),
        Step("a one-token window reads nothing", z3.Implies(c.need == 0, hs.blocks >= hd.blocks), uses=[]),
        _generic(
            "scale", 3, lambda x, y, b_: ([x >= y, b_ >= 1], x * b_ >= y * b_), (hs.blocks, hd.blocks, c.bs)
        ),
        Step(
            "below one interval",
            z3.Implies(qd == 0, hs.blocks * c.bs > hd_tokens - k),
            uses=["floor to the interval"],
        ),
        Step(
            "floored boundary computed",
            z3.Implies(z3.And(qd >= 1, c.need >= 1), c.end >= e_qd),
            uses=["dense hit reads cached blocks", "floored boundary in blocks"],
        ),
        Step(
            "floored boundary within max length",
            z3.Implies(qd >= 1, e_qd * c.bs <= c.L),
            uses=["dense hit within max length", "floored boundary in blocks"],
        ),
        Step("floored boundary served", z3.Implies(z3.And(qd >= 1, c.need >= 1), hs.blocks * c.bs >= qd * k)),
        Step(
            "sparse within one interval of dense",
            hs.blocks * c.bs > hd_tokens - k,
            uses=[
                "below one interval",
                "floored boundary served",
                "floor to the interval",
                "a one-token window reads nothing",
                "scale",
            ],
        ),
    ]
    for st in tail:  # identical antecedents, so each lemma's premises are discharged syntactically
        st.hyps = [*premises, *st.hyps]
    return promise + [_mul_mod((qd, k, k / c.A * (c.A / c.bs), c.bs))] + tail


@theorem()
def swa_sparse_within_one_interval() -> Outcome:
    """Sparse is at most one interval coarser: with retention k, over the same computed prompt and max length, the SWA hit is greater than the dense hit minus k (the largest segment end at or below the dense hit is served).

    Unbounded (window >= 2, or any with Eagle); with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(_within_one_interval_steps(c, c.mask()), c.side, c.describe)

    return _per_eagle(build)


@theorem(control=True)
def control_swa_sparse_coarser_than_interval() -> Outcome:
    """Control for swa_sparse_within_one_interval: a sparse mask whose tails are one block short falls more than one interval behind."""
    c = Swa(eagle=False)
    return run_steps(
        _within_one_interval_steps(c, c.mask(need_delta=-1)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="every tail block kept",
    )


# --------------------------------------------------------------------------- Eagle / MTP


def _eagle_resend_steps(c: Swa, mask: smt.Mask) -> list[Step]:
    """With Eagle: the peek block of the replay boundary is kept and the resend hit is >= that boundary > 0."""
    C, axiom = c.cached(mask, "cached")
    E = c.replay / c.A * c.A
    s = E / c.bs
    hit = c.hit(C, c.L)
    pre = [axiom, c.r.mode != DENSE, c.end >= s + 1, c.L == c.P - 1, c.P - 1 >= 2 * c.A, s + 1 >= c.need]
    steps = _boundary_promise(c, mask, c.replay, c.L, quirk_clause=True, hit=hit)
    return steps + [
        Step("Eagle peek block kept", C(s), pre),
        Step("boundary positive", E >= c.A, pre),
        Step(
            "resend hit is positive and reaches the boundary",
            z3.And(hit.blocks * c.bs >= E, hit.blocks >= 1),
            pre + [hit.chosen, hit.instance(s)],
        ),
    ]


@theorem()
def eagle_block_kept_and_served() -> Outcome:
    """Eagle/MTP: with retention 0 or k, the extra (peek) block right after the Eagle replay boundary floor_A(P - 1) - A is kept, and a resend of any prompt with P - 1 >= 2A whose boundary lies at least a window above block 0 hits at least that boundary (> 0): the 0% hit-rate class (vLLM #42784, #44082, #51771) cannot occur.

    Unbounded: block size, window, alignment, interval, prompt length.
    """
    c = Swa(eagle=True)
    return run_steps(_eagle_resend_steps(c, c.mask()), c.side, c.describe)


@theorem(control=True)
def control_eagle_block_missing() -> Outcome:
    """Control for eagle_block_kept_and_served: a mask computed without the Eagle block and shift (the pre-#44082 mask) leaves the Eagle resend at a 0% hit."""
    c = Swa(eagle=True)
    broken = smt.swa_mask(
        0,
        c.end,
        block_size=c.bs,
        window=c.w,
        alignment=c.A,
        eagle=False,
        retention=c.r,
        boundaries=c.boundaries,
    )

    def describe(m: z3.ModelRef) -> str:
        s = _n(m, c.replay / c.A * c.A / c.bs)
        return f"{c.describe(m)}: Eagle peek block {s} (right after the replay boundary) is not kept"

    return run_steps(
        _eagle_resend_steps(c, broken), c.side, describe, grid=c.grid(), refute_at="every tail block kept"
    )


def _drop_once_steps(
    kind: str, redrop: bool
) -> tuple[list[Step], list[z3.BoolRef], Describe, list[list[z3.BoolRef]]]:
    """A group verified with the Eagle drop, re-evaluated at its own hit in a later pass."""
    C = z3.Function("cached", z3.IntSort(), z3.BoolSort())
    bs, A, L, need0 = z3.Ints("block_size alignment max_length window_blocks")
    base = [bs >= 1, bs <= A, A % bs == 0, need0 >= 1]  # window >= 2 (window 1: finding_swa_window_one)
    if kind == "full":
        h1 = smt.full_hit(C, L, bs, A, True)
        h2 = smt.full_hit(C, h1.blocks * bs, bs, A, redrop)
        t = h1.maxima[0].m * bs
        t = z3.If(t > 0, t - smt.zmin(A, bs), t)
        floored = t - t % A
        steps = [
            _floor_aligned(t, A),
            Step("floored is aligned", floored % A == 0, [A >= 1], uses=["floor is aligned"]),
            *_whole_blocks_steps(floored, A, bs),
            _generic(
                "ceil of a multiple",
                2,
                lambda x, b_: ([b_ >= 1, x == (x / b_) * b_], smt.cdiv(x, b_) * b_ == x),
                (floored, bs),
            ),
            _generic(
                "ceil of a multiple is its quotient",
                2,
                lambda x, b_: ([b_ >= 1, x == (x / b_) * b_], smt.cdiv(x, b_) == x / b_),
                (floored, bs),
            ),
        ]
    else:
        h1 = smt.swa_hit(C, L, bs, A, need0 + 1, True)
        need2 = need0 + 1 if redrop else need0
        h2 = smt.swa_hit(C, h1.blocks * bs, bs, A, need2, redrop)
        steps = []
    hyps = [h1.chosen, h2.chosen, *[h2.instance(x) for x in (h1.blocks, h1.blocks - 1, h1.maxima[0].m)]]
    steps += [
        _cancel((h1.blocks, bs)),
        Step("re-evaluation keeps the hit", h2.blocks == h1.blocks, hyps),
    ]

    def describe(m: z3.ModelRef) -> str:
        return (
            f"block_size={_v(m, bs)}, alignment={_v(m, A)}, window blocks={_v(m, need0)}, "
            f"max_length={_v(m, L)}: first pass hit {_n(m, h1.blocks) * _n(m, bs)} tokens, "
            f"second pass {_n(m, h2.blocks) * _n(m, bs)}"
        )

    grid = [[bs == b_, b_ * k_ == A, b_ * n_ == L] for b_ in (1, 2) for k_ in (1, 2) for n_ in (4, 8)]
    return steps, base, describe, grid


@theorem()
def eagle_drop_applied_once() -> Outcome:
    """Eagle drop applied once (#33270): a full-attention or SWA group whose hit was computed with the Eagle drop and is re-evaluated at that hit without the drop (the coordinator's later fixed-point passes: verified groups) returns the same hit, so passes never compound the drop.

    For every cached set (uninterpreted), block size, alignment and window; unbounded.
    """
    for kind in ("full", "swa"):
        steps, base, describe, _ = _drop_once_steps(kind, redrop=False)
        o = run_steps(steps, base, describe)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"{kind}: {o.detail}")
    return Outcome("proved")


@theorem(control=True)
def control_eagle_drop_every_pass() -> Outcome:
    """Control for eagle_drop_applied_once: re-applying the drop on the second pass (the #33270 bug) shrinks the hit."""
    steps, base, describe, grid = _drop_once_steps("full", redrop=True)
    return run_steps(steps, base, describe, grid=grid, refute_at="re-evaluation keeps the hit")


# --------------------------------------------------------------------------- Mamba


class Mamba:
    """A symbolic Mamba group (align mode) of a hybrid model and the prompt it cached."""

    def __init__(self, *, eagle: bool | None = None) -> None:
        self.bs, self.A, self.P, self.end, self.J, self.L = z3.Ints(
            "block_size alignment prompt end junction max_length"
        )
        self.eagle = z3.Bool("eagle") if eagle is None else z3.BoolVal(eagle)
        self.r = smt.Retention.symbolic("retention")
        self.has_j = z3.Bool("has_junction")
        b1, b2 = smt.replay_boundaries(self.P, self.A, self.eagle)
        self.replay = (b1, b2)
        self.boundaries = [
            b1,
            b2,
            z3.If(self.has_j, self.J, b1),
            z3.If(z3.And(self.has_j, self.eagle), self.J - self.bs, b1),
        ]
        self.per = self.r.k / self.bs
        self.side = [
            smt.config_side_conditions(block_size=self.bs, alignment=self.A, retention=self.r),
            self.P >= 1,
            self.end >= 0,
            z3.Implies(self.has_j, self.J >= 1),
        ]

    def mask(self, **control: object) -> smt.Mask:
        return smt.mamba_mask(
            0,
            self.end,
            block_size=self.bs,
            alignment=self.A,
            retention=self.r,
            boundaries=self.boundaries,
            **control,
        )  # type: ignore[arg-type]

    def cached(
        self, mask: smt.Mask, name: str, exists: z3.FuncDeclRef | None = None
    ) -> tuple[z3.FuncDeclRef, z3.BoolRef]:
        """cached(j) = kept(j) and the state block exists (states exist only at chunk ends)."""
        C = z3.Function(name, z3.IntSort(), z3.BoolSort())
        x = z3.Int("x_" + name)
        body = mask(x) if exists is None else z3.And(mask(x), exists(x))
        return C, z3.ForAll([x], C(x) == body, patterns=[C(x)])

    def describe(self, m: z3.ModelRef) -> str:
        return (
            f"block_size={_v(m, self.bs)}, alignment={_v(m, self.A)}, retention={self.r.describe(m)}, "
            f"eagle={_v(m, self.eagle)}, prompt={_v(m, self.P)} tokens, {_v(m, self.end)} blocks computed"
        )

    def grid(self) -> list[list[z3.BoolRef]]:
        out = []
        for bs in (1, 2, 4):
            for mult in (1, 2):
                for r in (0, 2, 3, 4):
                    mode = ZERO if r == 0 else INTERVAL
                    out.append(
                        [self.bs == bs, bs * mult == self.A, self.r.mode == mode, self.r.k == r * bs * mult]
                    )
        return out

    def arith_steps(self) -> list[Step]:
        k, A, bs = self.r.k, self.A, self.bs
        n = (k / A) * (A / bs)
        inter = [self.r.mode == INTERVAL]
        return [
            Step("alignment is whole blocks", (A / bs) * bs == A),
            Step("interval = n alignments", k == (k / A) * A, inter),
            Step("interval = n*a blocks", k == n * bs, inter),
            Step("blocks per interval", self.per == n, inter),
        ]


def _one_state_steps(c: Mamba, mask: smt.Mask) -> list[Step]:
    i = z3.Int("i")
    not_boundary = z3.And([i != smt.boundary_edge(b, c.A, c.bs) - 1 for b in c.boundaries])
    pre = [c.r.mode == INTERVAL, z3.Not(mask.dense), mask(i), not_boundary]
    return [
        _generic(
            "last block of a segment",
            2,
            lambda x, p: ([p >= 2, (x + 1) % p == 0], x % p == p - 1),
            (i, c.per),
        ),
        Step("one state per segment: its last block", i % c.per == c.per - 1, pre),
    ]


@theorem()
def mamba_one_state_per_segment() -> Outcome:
    """Mamba (#45845): with retention k, within every k-token segment the only state block kept other than the reachable-boundary states (the replay boundary, the junction) is the segment's last block.

    Unbounded.
    """
    c = Mamba()
    return run_steps(_one_state_steps(c, c.mask()), c.side, c.describe)


@theorem(control=True)
def control_mamba_state_off_by_one() -> Outcome:
    """Control for mamba_one_state_per_segment: keeping block k with k % per == 0 (the segment's first block) is caught."""
    c = Mamba()
    return run_steps(
        _one_state_steps(c, c.mask(off_by_one=True)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="one state per segment: its last block",
    )


def _mamba_promise_steps(c: Mamba, mask: smt.Mask, which: str) -> tuple[list[Step], smt.Hit]:
    exists = z3.Function("state_exists", z3.IntSort(), z3.BoolSort())
    C, axiom = c.cached(mask, "cached", exists)
    hit = smt.mamba_hit(C, c.L, c.bs, c.A)
    q = z3.Int("q")
    if which == "segment":
        E = q * c.r.k
        cond = [c.r.mode == INTERVAL, q >= 1]
    else:
        E = c.boundaries[0 if which == "replay" else 2] / c.A * c.A
        cond = [c.r.mode != DENSE, E >= c.A] + ([c.has_j] if which == "junction" else [])
    s = E / c.bs - 1  # the state block of the boundary: no Eagle shift
    pre = [axiom, *cond, c.end > s, c.L >= E, exists(s)]
    steps = c.arith_steps() + [
        _mul_mod(
            (q, c.r.k, c.r.k / c.A, c.A),
            (q, c.r.k, (c.r.k / c.A) * (c.A / c.bs), c.bs),
            (E / c.A, c.A, c.A / c.bs, c.bs),
        ),
        _cancel((q * c.per, c.bs)),
        _mul_mod((q, c.per, 1, c.per)),
        Step("segment end in blocks", z3.Implies(c.r.mode == INTERVAL, (q * c.r.k) / c.bs == q * c.per), pre),
        Step("boundary in whole blocks", (E / c.bs) * c.bs == E, pre),
        _floor_aligned(E, c.A),
        Step("boundary aligned", z3.Or(E % c.A == 0, which == "segment"), pre, uses=["floor is aligned"]),
        Step(
            "state block index",
            z3.Implies(c.r.mode == INTERVAL, (s + 1) % c.per == 0)
            if which == "segment"
            else z3.BoolVal(True),
            pre,
        ),
        Step("state block kept", C(s), pre),
        Step(
            "scan finds the state",
            hit.blocks * c.bs >= E,
            pre + [hit.chosen, hit.instance(s)],
            uses=[
                "state block kept",
                "boundary in whole blocks",
                "boundary aligned",
                "multiple of a multiple",
                "segment end in blocks",
                "interval = n*a blocks",
                "blocks per interval",
                "alignment is whole blocks",
            ],
        ),
    ]
    return steps, hit


@theorem()
def mamba_promise_kept() -> Outcome:
    """Mamba (#45845): for every retained boundary (a segment end for interval k, the replay boundary, the junction; floored to the alignment), the state block ending exactly there (no Eagle shift) is kept, and a lookup reaching the boundary hits at least it, provided the scheduler produced that state.

    Unbounded; mamba_checkpoint_is_replay_boundary shows the scheduler does
    produce the replay boundary's state.
    """
    for which in ("segment", "replay", "junction"):
        c = Mamba()
        steps, _ = _mamba_promise_steps(c, c.mask(), which)
        o = run_steps(steps, c.side, c.describe)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"{which}: {o.detail}")
    return Outcome("proved")


@theorem(control=True)
def control_mamba_eagle_shift() -> Outcome:
    """Control for mamba_promise_kept: shifting the boundary state by one block (an Eagle shift applied to Mamba) loses the replay hit."""
    c = Mamba()
    steps, _ = _mamba_promise_steps(c, c.mask(boundary_shift=1), "replay")

    def describe(m: z3.ModelRef) -> str:
        E = _n(m, c.replay[0] / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens, its state block {E // _n(m, c.bs) - 1} not kept"

    return run_steps(steps, c.side, describe, grid=c.grid(), refute_at="state block kept")


def _mamba_within_steps(c: Mamba, sparse: smt.Mask) -> list[Step]:
    """States exist at every computed block; sparse (interval k) hit > dense hit - k."""
    dense = smt.mamba_mask(
        0,
        c.end,
        block_size=c.bs,
        alignment=c.A,
        retention=smt.Retention(I(DENSE), I(0)),
        boundaries=c.boundaries,
    )
    D, dense_axiom = c.cached(dense, "cached_dense")
    S, sparse_axiom = c.cached(sparse, "cached_sparse")
    hd = smt.mamba_hit(D, c.L, c.bs, c.A)
    hs = smt.mamba_hit(S, c.L, c.bs, c.A)
    k = c.r.k
    hd_tokens = hd.blocks * c.bs
    qd = hd_tokens / k
    s = qd * c.per - 1
    premises = [
        dense_axiom,
        sparse_axiom,
        c.r.mode == INTERVAL,
        z3.Not(sparse.dense),
        hd.chosen,
        hs.chosen,
        hs.instance(s),
    ]
    tail = [
        Step("floor to the interval", z3.And(qd * k <= hd_tokens, hd_tokens < qd * k + k)),
        Step("floored boundary in blocks", qd * c.per <= hd.blocks),
        Step("dense hit state computed", z3.Implies(hd.blocks >= 1, D(hd.blocks - 1))),
        Step("state edge in tokens", (s + 1) * c.bs == qd * k),
        Step("floored state kept", z3.Implies(qd >= 1, S(s))),
        Step("floored state aligned", z3.Implies(qd >= 1, ((s + 1) * c.bs) % c.A == 0)),
        Step("floored boundary served", z3.Implies(qd >= 1, hs.blocks >= qd * c.per)),
        _generic(
            "scale", 3, lambda x, y, b_: ([x >= y, b_ >= 1], x * b_ >= y * b_), (hs.blocks, qd * c.per, c.bs)
        ),
        Step(
            "sparse within one interval of dense",
            hs.blocks * c.bs > hd_tokens - k,
            uses=[
                "floor to the interval",
                "floored boundary served",
                "scale",
                "interval = n*a blocks",
                "blocks per interval",
            ],
        ),
    ]
    for st in tail:
        st.hyps = [*premises, *st.hyps]
    return (
        c.arith_steps()
        + [
            _mul_mod((qd * (k / c.A), c.A, c.A / c.bs, c.bs), (qd, k, k / c.A, c.A)),
            _cancel((qd * c.per, c.bs)),
        ]
        + tail
    )


@theorem()
def mamba_within_one_interval() -> Outcome:
    """Mamba (#45845): when a state exists at every computed block, the retention-k hit over a cached prompt is greater than the dense hit minus k.

    Unbounded. (With chunked prefill states exist only at chunk ends; then the
    bound holds for the segment ends the scheduler stopped at.)
    """
    c = Mamba()
    return run_steps(_mamba_within_steps(c, c.mask()), c.side, c.describe)


@theorem(control=True)
def control_mamba_within_off_by_one() -> Outcome:
    """Control for mamba_within_one_interval: states kept one block early lose the interval bound."""
    c = Mamba()
    return run_steps(
        _mamba_within_steps(c, c.mask(off_by_one=True)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="floored state kept",
    )


def _checkpoint_steps(c: Mamba, eagle_aware: bool) -> list[Step]:
    b1, b2 = c.replay
    ckpt = smt.mamba_checkpoint_position(c.P, c.A, c.eagle if eagle_aware else False)
    latest = smt.zmax(b1, b2) / c.A * c.A
    return [Step("checkpoint = latest replay boundary, floored", ckpt == latest, [c.A >= 1])]


@theorem()
def mamba_checkpoint_is_replay_boundary() -> Outcome:
    """Mamba: the scheduler's chunk stop (scheduling.mamba_checkpoint_position) is exactly the latest replay boundary floored to the alignment, with and without Eagle, so the state the Mamba mask promises to keep exists.

    Unbounded prompt length and scheduler block size.
    """
    c = Mamba()
    return run_steps(_checkpoint_steps(c, True), c.side, c.describe)


@theorem(control=True)
def control_mamba_checkpoint_ignores_eagle() -> Outcome:
    """Control for mamba_checkpoint_is_replay_boundary: a scheduler stop that ignores Eagle misses the Eagle replay boundary."""
    c = Mamba(eagle=True)
    return run_steps(_checkpoint_steps(c, False), c.side, c.describe, timeout_ms=CONTROL_TIMEOUT_MS)


# --------------------------------------------------------------------------- alignment


def _cacheable_steps(floor: bool) -> tuple[list[Step], list[z3.BoolRef], Describe]:
    n, bs, A, i = z3.Ints("computed_tokens block_size alignment i")
    eagle = z3.Bool("eagle")
    shift = z3.If(eagle, 1, 0)
    nc = (
        smt.cacheable_tokens(n, hybrid=True, scheduler_block_size=A, block_size=bs, eagle=eagle)
        if floor
        else n
    )
    fl = n / A * A
    base = [bs >= 1, bs <= A, A % bs == 0, n >= 0]
    steps = [
        _generic("one more block", 2, lambda x, b_: ([b_ >= 1], (x + b_) / b_ == x / b_ + 1), (fl, bs)),
        _generic(
            "division is monotone",
            3,
            lambda x, y, b_: ([b_ >= 1, x <= y], x / b_ <= y / b_),
            (nc, fl, bs),
            (nc, fl + bs, bs),
        ),
        Step(
            "no block past the last aligned boundary (+ Eagle peek)",
            z3.Implies(i < nc / bs, i < fl / bs + shift),
            [i >= 0],
        ),
        Step("cached length aligned without Eagle", z3.Implies(z3.Not(eagle), nc % A == 0)),
    ]

    def describe(m: z3.ModelRef) -> str:
        return (
            f"block_size={_v(m, bs)}, alignment={_v(m, A)}, eagle={_v(m, eagle)}, {_v(m, n)} tokens computed: "
            f"block {_v(m, i)} cached past the aligned boundary {_n(m, fl)}"
        )

    return steps, base, describe


@theorem()
def alignment_no_block_past_boundary() -> Outcome:
    """Alignment: in a hybrid model a group caches only blocks below the last alignment boundary of the computed tokens (plus Eagle's one peek block), and without Eagle the cached length is a multiple of the alignment (AllocatorModel._cacheable_tokens).

    Unbounded.
    """
    steps, base, describe = _cacheable_steps(True)
    return run_steps(steps, base, describe)


@theorem(control=True)
def control_alignment_unfloored() -> Outcome:
    """Control for alignment_no_block_past_boundary: caching every computed token stores blocks past the boundary."""
    steps, base, describe = _cacheable_steps(False)
    return run_steps(steps, base, describe, timeout_ms=CONTROL_TIMEOUT_MS)


def _hits_aligned_steps(lookup_alignment_is_block: bool) -> tuple[list[Step], list[z3.BoolRef], Describe]:
    C = z3.Function("cached", z3.IntSort(), z3.BoolSort())
    bs, A, L, need = z3.Ints("block_size alignment max_length need")
    eagle = z3.Bool("eagle")
    base = [bs >= 1, bs <= A, A % bs == 0, need >= 0]
    la = bs if lookup_alignment_is_block else A
    steps: list[Step] = []
    for name, hit in (
        ("swa", smt.swa_hit(C, L, bs, la, need, False)),
        ("swa eagle", smt.swa_hit(C, L, bs, la, need, True)),
        ("mamba", smt.mamba_hit(C, L, bs, la)),
    ):
        steps.append(Step(f"{name} hit aligned", (hit.blocks * bs) % A == 0, [hit.chosen]))
    full = smt.full_hit(C, L, bs, la, eagle)
    t = full.maxima[0].m * bs
    t = z3.If(z3.And(eagle, t > 0), t - smt.zmin(la, bs), t)
    floored = t - t % la
    steps += [
        _floor_aligned(t, la),
        Step("floored is aligned", floored % la == 0, [la >= 1], uses=["floor is aligned"]),
        *_whole_blocks_steps(floored, la, bs),
        _generic(
            "ceil of a multiple",
            2,
            lambda x, b_: ([b_ >= 1, x == (x / b_) * b_], smt.cdiv(x, b_) * b_ == x),
            (floored, bs),
        ),
        Step("full hit aligned", (full.blocks * bs) % A == 0, [full.chosen]),
    ]

    def describe(m: z3.ModelRef) -> str:
        return f"block_size={_v(m, bs)}, alignment={_v(m, A)}, need={_v(m, need)}, max_length={_v(m, L)}"

    return steps, base, describe


@theorem()
def alignment_hits_are_multiples() -> Outcome:
    """Alignment: every hit the lookup rules return (full attention with and without the Eagle drop, SWA with and without Eagle, Mamba) is a multiple of the alignment, for every cached set.

    Unbounded; cached set uninterpreted.
    """
    steps, base, describe = _hits_aligned_steps(False)
    return run_steps(steps, base, describe)


@theorem(control=True)
def control_alignment_lookup_ignores_alignment() -> Outcome:
    """Control for alignment_hits_are_multiples: a lookup that aligns to the block size instead of A returns unaligned hits."""
    steps, base, describe = _hits_aligned_steps(True)
    return run_steps(steps, base, describe, timeout_ms=CONTROL_TIMEOUT_MS)


# --------------------------------------------------------------------------- validation


def validator_accepts(
    k: z3.ArithRef, is_none: z3.BoolRef, sbs: z3.ArithRef, has_group: z3.BoolRef
) -> z3.BoolRef:
    """model.config.validate's retention rule as a Z3 term (None; 0 without SWA/Mamba; else k >= 0, k % sbs == 0)."""
    return z3.Or(is_none, z3.If(has_group, z3.And(k >= 0, k % sbs == 0), k == 0))


@theorem()
def validation_accepts_what_the_promise_needs() -> Outcome:
    """Validation: every retention interval the validator accepts for a model with an SWA/Mamba group is None, 0 or a positive multiple of the scheduler block size: exactly the side condition under which swa_promise_segments and mamba_promise_kept are proved (control_validator_accepting_block_multiples shows why other intervals must be rejected).

    Unbounded.
    """
    k, sbs = z3.Ints("retention scheduler_block_size")
    is_none, has_group = z3.Bools("retention_is_none has_swa_or_mamba")
    r = smt.Retention(z3.If(is_none, DENSE, z3.If(k == 0, ZERO, INTERVAL)), z3.If(is_none, 0, k))
    side = smt.config_side_conditions(block_size=I(1), alignment=sbs, retention=r)
    steps = [
        Step(
            "accepted intervals meet the proofs' side condition",
            side,
            [sbs >= 1, has_group, validator_accepts(k, is_none, sbs, has_group)],
        )
    ]
    return run_steps(steps, [], lambda m: f"retention={_v(m, k)}, scheduler_block_size={_v(m, sbs)}")


@theorem(control=True)
def control_validator_accepting_block_multiples() -> Outcome:
    """Control for validation_accepts_what_the_promise_needs (why non-multiples are rejected): an interval that is a multiple of the SWA block size but not of the scheduler block size loses a promised segment-end hit: Z3 evaluates the model's mask and lookup on small configurations and finds one.

    Searched: block size 1-4, alignment 2-3 blocks, window 2-9, interval a
    non-multiple of the alignment, prompt up to 40 blocks.
    """
    for bs in (1, 2, 4):
        for mult in (2, 3):
            A = bs * mult
            for k in (A * j + bs * t for j in (1, 2) for t in range(1, mult)):
                for w in (2, 5, 9):
                    for eagle in (False, True):
                        found = _non_multiple_loss(bs, A, k, w, eagle)
                        if found is not None:
                            return Outcome("refuted", found)
    return Outcome("proved", None, "no counterexample in the searched domain")


def _non_multiple_loss(bs: int, A: int, k: int, w: int, eagle: bool) -> str | None:
    """The first segment end q*k whose floored boundary floor_A(q*k) is not served, or None."""
    from model import masks

    end = 40
    need = masks.swa_tail_blocks(w, bs, eagle)
    mask = smt.swa_mask(
        0, end, block_size=bs, window=w, alignment=A, eagle=eagle, retention=smt.Retention.of(k)
    )
    kept = smt.evaluate_mask(mask, 0, end)
    cached = set(range(end)) if kept is None else kept
    for q in range(1, end * bs // k):
        E = q * k
        F = E // A * A
        if F == 0 or (F // bs + need) >= end:
            continue
        hit = smt.swa_hit(smt.finite_set(cached), F + bs * (1 if eagle else 0), bs, A, need, eagle)
        got = smt.evaluate_hit(hit.blocks, hit.side) * bs
        if got < F:
            return (
                f"block_size={bs}, alignment={A}, window={w}, eagle={eagle}, retention={k} (not a multiple "
                f"of {A}): segment end {E} tokens is not aligned; the aligned boundary below it, {F}, "
                f"has no kept tail, so a request reaching {F} tokens hits only {got}"
            )
    return None


# --------------------------------------------------------------------------- free queue and pinned tier


class Queues:
    """The free queue(s) as arrays over block ids (unbounded pool).

    Regular queue: `inq[b]`, position `pos[b]` (head = smallest), all positions
    strictly inside (lo, hi); `cls[b]`: the block was freed with a hash (went to
    the tail); `joined[b]`: when it joined the cached region (a clock `t`).
    Pinned tier (#40676): `inp[b]`, `ppos[b]` inside (plo, phi). `hashed[b]`:
    the block carries a hash now. Every list operation of model/free_queue.py
    and the routing of model/pool.py is a transition below.
    """

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
        return [
            self.inq,
            self.pos,
            self.cls,
            self.joined,
            self.hashed,
            self.inp,
            self.ppos,
            self.lo,
            self.hi,
            self.t,
            self.plo,
            self.phi,
        ]

    def same(self, other: Queues, *, but: Sequence[str] = ()) -> z3.BoolRef:
        names = ["inq", "pos", "cls", "joined", "hashed", "inp", "ppos", "lo", "hi", "t", "plo", "phi"]
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


def _ops(s: Queues, n: Queues, *, broken: str = "") -> dict[str, z3.BoolRef]:
    """Transitions s -> n: the free-queue operations and the pool's routing."""
    x, theta, thp = z3.Ints("x theta theta_pinned")
    b = z3.Int("b")
    active = z3.And(z3.Not(s.inq[x]), z3.Not(s.inp[x]))
    ops: dict[str, z3.BoolRef] = {}
    # popleft_n: the blocks before position theta leave (get_new_blocks; their hashes are dropped)
    ops["popleft_n"] = z3.And(
        n.inq == z3.Lambda([b], z3.And(s.inq[b], s.pos[b] >= theta)),
        n.hashed == z3.Lambda([b], z3.If(z3.And(s.inq[b], s.pos[b] < theta), False, s.hashed[b])),
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


def _small_world(s: Queues, x: z3.ArithRef) -> list[z3.BoolRef]:
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


def _queue_row(m: z3.ModelRef, q: Queues, tier: str = "regular") -> str:
    inq, pos = (q.inq, q.pos) if tier == "regular" else (q.inp, q.ppos)
    order = []
    for blk in range(1, 5):
        if z3.is_true(m.eval(inq[blk], model_completion=True)):
            tag = "cached" if z3.is_true(m.eval(q.hashed[blk], model_completion=True)) else "uncached"
            if tier == "regular" and z3.is_true(m.eval(q.cls[blk], model_completion=True)):
                tag += f", freed cached at t={_n(m, q.joined[blk])}"
            order.append((_n(m, pos[blk]), f"{blk} ({tag})"))
    return "[" + ", ".join(t for _, t in sorted(order)) + "]"


def _queue_steps(
    invariant: Callable[[Queues], z3.BoolRef], ops: Sequence[str], broken: str = "", small: bool = False
) -> tuple[list[Step], Describe]:
    universe = SMALL if small else None
    s, n = Queues(universe=universe), Queues("'", universe=universe)
    trans = _ops(s, n, broken=broken)
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
    world = _small_world(s, x) if small else []
    for op in ops:
        steps.append(Step(f"{op} preserves the invariant", inv(n), [inv(s), trans[op], *world]))

    def describe(m: z3.ModelRef) -> str:
        return (
            f"block {_v(m, x)}: free queue before {_queue_row(m, s)}, after {_queue_row(m, n)} (head first)"
        )

    return steps, describe


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


@theorem(control=True)
def control_free_queue_wrong_prepend() -> Outcome:
    """Control for free_queue_uncached_first: putting a freed uncached block at the tail (append instead of prepend_n) breaks the order."""
    steps, describe = _queue_steps(
        Queues.uncached_first, ("prepend_uncached",), broken="prepend_to_tail", small=True
    )
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS)


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
    """Free-queue order: cached free blocks are reused least-recently-freed first (ordered by when they joined the cached region; a demoted pinned block joins when demoted), over every queue operation.

    Inductive invariant; unbounded pool.
    """
    steps, describe = _queue_steps(lambda q: z3.And(q.uncached_first(), q.lru()), ALL_OPS)
    return run_steps(steps, [], describe)


@theorem(control=True)
def control_free_queue_cached_to_head() -> Outcome:
    """Control for free_queue_lru: a freed cached block put at the head breaks least-recently-freed order."""
    steps, describe = _queue_steps(
        lambda q: z3.And(q.uncached_first(), q.lru()), ("append_cached",), broken="append_to_head", small=True
    )
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS)


def _pinned_steps(broken: str = "") -> tuple[list[Step], Describe]:
    universe = SMALL if broken else None
    s, n = Queues(universe=universe), Queues("'", universe=universe)
    trans = _ops(s, n, broken=broken)
    small = _small_world(s, z3.Int("x")) if broken else []

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
            f"regular queue before {_queue_row(m, s)} after {_queue_row(m, n)}; pinned tier before "
            f"{_queue_row(m, s, 'pinned')} after {_queue_row(m, n, 'pinned')}"
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


@theorem(control=True)
def control_pinned_demote_newest() -> Outcome:
    """Control for pinned_tier_disjoint_pressure_oldest: demoting the newest pinned blocks first is caught."""
    steps, describe = _pinned_steps(broken="demote_newest")
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS)


@theorem(control=True)
def control_pinned_in_both_tiers() -> Outcome:
    """Control for pinned_tier_disjoint_pressure_oldest: a pinned free that also links the block into the regular queue puts it in two tiers."""
    steps, describe = _pinned_steps(broken="pinned_also_regular")
    return run_steps(steps, [], describe, timeout_ms=CONTROL_TIMEOUT_MS)


# --------------------------------------------------------------------------- runner


def _run_one(index: int) -> TheoremResult:
    global _generic_ids
    th = CATALOGUE[index]
    smt.reset_fresh_names()  # same names, same Z3 search, whichever worker runs it
    _generic_ids = iter(range(10**9))
    t0 = time.monotonic()
    try:
        o = th.fn()
    except z3.Z3Exception as exc:  # a definition error is a failure to prove, reported as such
        o = Outcome("unknown", None, f"Z3 error: {exc}")
    return TheoremResult(
        name=th.name,
        statement=th.statement,
        result=o.result,
        bound=th.bound,
        seconds=time.monotonic() - t0,
        counterexample=o.counterexample,
        is_control=th.is_control,
        is_finding=th.is_finding,
        detail=o.detail,
    )


def run_theorems(
    progress: Callable[[str], None] | None = None, *, names: Sequence[str] = (), workers: int | None = None
) -> list[TheoremResult]:
    """Run the catalogue (theorems, controls, findings) and return one result each, in catalogue order.

    Runs in `workers` processes (default: min(2, CPUs)); each theorem is
    independent and deterministic.
    """
    indices = [i for i, th in enumerate(CATALOGUE) if not names or th.name in names]
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    results: dict[int, TheoremResult] = {}

    def report(r: TheoremResult) -> None:
        if progress is not None:
            ok = "ok" if r.expected_ok else "UNEXPECTED"
            progress(f"{r.name}: {r.result} in {r.seconds:.1f}s ({r.kind}, {ok})")

    if workers <= 1 or len(indices) <= 1:
        for i in indices:
            results[i] = _run_one(i)
            report(results[i])
    else:
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        # slowest first, so the two workers finish together
        order = sorted(indices, key=lambda i: -_EXPECTED_SECONDS.get(CATALOGUE[i].name, 1.0))
        # a fresh process per theorem: Z3's global state (term ids, caches) then does not depend on
        # which theorems a worker ran before, so the search, and the verdict, are reproducible
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for i, r in zip(order, pool.imap(_run_one, order)):
                results[i] = r
                report(r)
    return [results[i] for i in indices]


# rough per-theorem times (2-vCPU machine), used only to order the work
_EXPECTED_SECONDS = {
    "swa_sparse_within_one_interval": 15.0,
    "control_swa_sparse_coarser_than_interval": 12.0,
    "control_swa_tail_one_short": 8.0,
    "swa_sparse_never_exceeds_dense": 7.0,
    "mamba_promise_kept": 5.0,
    "mamba_within_one_interval": 5.0,
    "control_mamba_within_off_by_one": 5.0,
}


def format_table(results: Sequence[TheoremResult]) -> str:
    """A plain-text table: theorem, kind, statement (first sentence), result, bound, seconds; then counterexamples."""
    rows = [("theorem", "kind", "result", "bound", "seconds", "statement")]
    for r in results:
        stmt = r.statement if len(r.statement) <= 110 else r.statement[:107] + "..."
        verdict = r.result + ("" if r.expected_ok else " (UNEXPECTED)")
        bound = r.bound or ("unbounded" if r.result == "proved" else "-")
        rows.append((r.name, r.kind, verdict, bound, f"{r.seconds:.1f}", stmt))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 9)
    total = sum(r.seconds for r in results)
    good = sum(r.expected_ok for r in results)
    lines.append(f"{good}/{len(results)} as expected; {total:.1f}s of solver time")
    notes = [r for r in results if r.counterexample or (r.detail and r.result != "proved")]
    if notes:
        lines.append("")
        lines.append("counterexamples (controls and findings are expected to have one):")
        for r in notes:
            lines.append(f"  {r.name}: {r.counterexample or r.detail}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    t_start = time.monotonic()
    res = run_theorems(progress=lambda m: print(m, file=sys.stderr, flush=True), names=sys.argv[1:])
    print(format_table(res))
    print(f"wall {time.monotonic() - t_start:.1f}s")
    sys.exit(0 if all(r.expected_ok for r in res) else 1)
