"""Sparse SWA retention against dense: never more, at most one interval less (#43447).

The symbolic group, its masks and hit rule come from `swa_setup` (whose
docstring names the executable function each term is tied to and the test).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import Describe, Outcome, Refutes, Step, Values, run_steps, theorem, value_of
from invariants.proofs.lemmas import generic_lemma, lemma_cancel, lemma_mul_mod, quotient_step
from invariants.proofs.swa_setup import (
    Swa,
    dense_twin,
    per_eagle,
    segment_promise_steps,
    swa_hit_tokens,
    swa_kept,
    swa_values,
    window_in_scope,
)
from model.contract import smt
from model.contract.smt import DENSE, INTERVAL


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
        lemma_cancel((m * pa, c.bs)),
        Step("blocks per interval", c.per == m * pa, [c.r.mode == INTERVAL, pa * c.bs == c.A]),
        Step("segment end in alignment blocks", Q * pa == qk * c.per, per_sp),
        quotient_step("dense segment of a sparse tail", i - c.shift, pa, Q, c.need, per_sp),
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
        lemma_cancel((qb * pa, c.bs)),
        Step(
            "boundary edge in alignment blocks",
            (qb * c.A) / c.bs == qb * pa,
            [pa * c.bs == c.A],
            also_at=each,
        ),
        Step("boundary below one alignment reads nothing", qb >= 1, at_b, also_at=each),
        quotient_step("dense segment of a boundary tail", i - c.shift, pa, qb, c.need, at_b),
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
        return f"block_size={value_of(m, bs)}, alignment={value_of(m, A)}, need={value_of(m, need)}, max_length={value_of(m, L)}"

    return steps, base, describe


@theorem()
def swa_sparse_never_exceeds_dense() -> Outcome:
    """Sparse never exceeds dense (#43447): the retention-0 / retention-k SWA mask keeps a subset of the dense mask (block 0 with Eagle aside, which no positive hit reads unless the dense mask keeps it too), and the SWA hit is monotone in the cached set, so the sparse hit is at most the dense hit.

    Two lemmas, both unbounded: mask inclusion; hit monotonicity for arbitrary
    cached predicates related that way (hence for the two masks).
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        first = run_steps(_inclusion_steps(c, c.mask(), dense_twin(c)), c.side, c.describe)
        if first.result != "proved":
            return first
        steps, base, describe = _hit_monotone_steps(eagle)
        return run_steps(steps, base, describe)

    return per_eagle(build)


def _hits(v: Values, sparse: set[int], dense: set[int]) -> list[tuple[int, int, int]]:
    """(max length, sparse hit, dense hit) for every max length up to the cached blocks, in tokens."""
    bs = int(v["block_size"])
    return [
        (L, swa_hit_tokens(v, sparse, L), swa_hit_tokens(v, dense, L))
        for L in range((int(v["end"]) + 2) * bs)
    ]


def _sparse_at_most_dense(v: Values) -> str | None:
    """swa_sparse_never_exceeds_dense's claim at concrete values, against a dense mask one block short."""
    if v["mode"] == DENSE or not window_in_scope(v):
        return None
    for L, hs, hd in _hits(v, swa_kept(v), swa_kept(v, dense=True, need_delta=-1)):
        if hs > hd:
            return f"max length {L}: sparse hit {hs} tokens > dense hit {hd}"
    return None


@theorem(control=True, claim=_sparse_at_most_dense)
def control_swa_sparse_exceeds_dense() -> Outcome:
    """Control for swa_sparse_never_exceeds_dense (sparse hit <= dense hit): measured against a dense mask whose tails are one block short, the sparse hit exceeds the dense hit."""
    c = Swa(eagle=False)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {value_of(m, i)} kept by the sparse mask, not by the dense one"

    return run_steps(
        _inclusion_steps(c, c.mask(), dense_twin(c, need_delta=-1)),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="sparse mask within dense",
        refutes=Refutes(lambda m: swa_values(c, m), _sparse_at_most_dense),
    )


def _within_one_interval_steps(c: Swa, sparse: smt.Mask) -> list[Step]:
    """Sparse (interval k) hit > dense hit - k over the same computed prompt and max length.

    The premises of the last steps are the definitions (cached = mask, the two
    hit rules' witnesses and two maximality instances) and retention k.
    """
    dense = dense_twin(c)
    D, dense_axiom = c.cached(dense, "cached_dense")
    hd = c.hit(D, c.L)
    k = c.r.k
    q = z3.Int("q")
    hd_tokens = hd.blocks * c.bs
    qd = hd_tokens / k
    # the segment-promise chain is proved for a free q and recorded also at q = floor(dense hit / k)
    promise, hs = segment_promise_steps(c, sparse, q, "s", also_at=[[(q, qd)]])
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
        *_dense_hit_bounds(c, hd, D, last),
        *_floored_boundary_steps(c, hd, qd, k, hd_tokens),
        *_sparse_within_interval_steps(c, hd, hs, qd, k, hd_tokens, e_qd),
    ]
    for st in tail:  # identical antecedents, so each lemma's premises are discharged syntactically
        st.hyps = [*premises, *st.hyps]
    return promise + [lemma_mul_mod((qd, k, k / c.A * (c.A / c.bs), c.bs))] + tail


def _dense_hit_bounds(c: Swa, hd: smt.Hit, D: z3.FuncDeclRef, last: z3.ArithRef) -> list[Step]:
    """The dense hit reads only cached blocks and stays within the max length."""
    return [
        Step(
            "dense hit reads cached blocks", z3.Implies(z3.And(hd.blocks >= 1, c.need >= 1), D(last)), uses=[]
        ),
        Step(
            "dense hit within max length",
            z3.Implies(hd.blocks >= 1, (hd.blocks + c.shift) * c.bs <= c.L),
            uses=[],
        ),
    ]


def _floored_boundary_steps(
    c: Swa, hd: smt.Hit, qd: z3.ArithRef, k: z3.ArithRef, hd_tokens: z3.ArithRef
) -> list[Step]:
    """The dense hit floored to the interval is a segment boundary: within one interval
    below it, on whole blocks, at or below the dense hit's blocks."""
    return [
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
    ]


def _sparse_within_interval_steps(
    c: Swa,
    hd: smt.Hit,
    hs: smt.Hit,
    qd: z3.ArithRef,
    k: z3.ArithRef,
    hd_tokens: z3.ArithRef,
    e_qd: z3.ArithRef,
) -> list[Step]:
    """The sparse hit reaches the floored boundary (computed, within the max length, so served),
    hence exceeds the dense hit minus one interval."""
    return [
        Step("a one-token window reads nothing", z3.Implies(c.need == 0, hs.blocks >= hd.blocks), uses=[]),
        generic_lemma(
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


@theorem()
def swa_sparse_within_one_interval() -> Outcome:
    """Sparse is at most one interval coarser (#43447): with retention k, over the same computed prompt and max length, the SWA hit is greater than the dense hit minus k (the largest segment end at or below the dense hit is served).

    Unbounded (window >= 2, or any with Eagle); with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(_within_one_interval_steps(c, c.mask()), c.side, c.describe)

    return per_eagle(build)


def _within_one_interval(v: Values) -> str | None:
    """swa_sparse_within_one_interval's claim at concrete values, for sparse tails one block short."""
    if v["mode"] != INTERVAL or not window_in_scope(v):
        return None
    k = int(v["k"])
    for L, hs, hd in _hits(v, swa_kept(v, need_delta=-1), swa_kept(v, dense=True)):
        if hs <= hd - k:
            return f"retention {k}, max length {L}: sparse hit {hs} tokens <= dense hit {hd} - {k}"
    return None


@theorem(control=True, claim=_within_one_interval)
def control_swa_sparse_coarser_than_interval() -> Outcome:
    """Control for swa_sparse_within_one_interval (sparse hit > dense hit - k): a sparse mask whose tails are one block short falls a whole interval or more behind the dense hit."""
    c = Swa(eagle=False)
    return run_steps(
        _within_one_interval_steps(c, c.mask(need_delta=-1)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="every tail block kept",
        refutes=Refutes(lambda m: swa_values(c, m), _within_one_interval),
    )
