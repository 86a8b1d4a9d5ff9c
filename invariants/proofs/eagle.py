"""Eagle / MTP theorems: the peek block is kept and served, the drop is applied once (#42258, #43447).

The resend setup is `swa_setup`'s (its docstring lists each term's tie). The
drop-once setup composes `smt.full_hit` / `smt.swa_hit` (tied to
`model.lookup` by `tests/test_smt.py::test_hit_rules_match_model`): a first
pass with the drop, a second at that hit without it. That composition is what
`AllocatorModel._find_hit` does for a verified group
(`tests/test_proof_setups.py::test_eagle_reevaluation_at_own_hit_is_what_the_allocator_does`),
and its claim is evaluated on the executable lookup rules
(`test_eagle_drop_once_setup_on_the_lookup_rules`).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import Describe, Outcome, Step, int_of, run_steps, theorem, value_of
from invariants.proofs.lemmas import generic_lemma, lemma_cancel, lemma_floor_aligned, whole_blocks_steps
from invariants.proofs.swa_setup import Swa, boundary_promise_steps
from model import smt
from model.smt import DENSE


def _eagle_resend_steps(c: Swa, mask: smt.Mask) -> list[Step]:
    """With Eagle: the peek block of the replay boundary is kept and the resend hit is >= that boundary > 0."""
    C, axiom = c.cached(mask, "cached")
    E = c.replay / c.A * c.A
    s = E / c.bs
    hit = c.hit(C, c.L)
    pre = [axiom, c.r.mode != DENSE, c.end >= s + 1, c.L == c.P - 1, c.P - 1 >= 2 * c.A, s + 1 >= c.need]
    steps = boundary_promise_steps(c, mask, c.replay, c.L, quirk_clause=True, hit=hit)
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
        s = int_of(m, c.replay / c.A * c.A / c.bs)
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
            lemma_floor_aligned(t, A),
            Step("floored is aligned", floored % A == 0, [A >= 1], uses=["floor is aligned"]),
            *whole_blocks_steps(floored, A, bs),
            generic_lemma(
                "ceil of a multiple",
                2,
                lambda x, b_: ([b_ >= 1, x == (x / b_) * b_], smt.cdiv(x, b_) * b_ == x),
                (floored, bs),
            ),
            generic_lemma(
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
        lemma_cancel((h1.blocks, bs)),
        Step("re-evaluation keeps the hit", h2.blocks == h1.blocks, hyps),
    ]

    def describe(m: z3.ModelRef) -> str:
        return (
            f"block_size={value_of(m, bs)}, alignment={value_of(m, A)}, window blocks={value_of(m, need0)}, "
            f"max_length={value_of(m, L)}: first pass hit {int_of(m, h1.blocks) * int_of(m, bs)} tokens, "
            f"second pass {int_of(m, h2.blocks) * int_of(m, bs)}"
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
