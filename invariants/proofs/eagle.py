"""Eagle / MTP theorems: the peek block is kept and served, the drop is applied once (#42258, #43447).

The resend setup is `swa_setup`'s (its docstring lists each term's tie). The
drop-once setup composes `smt.full_hit` / `smt.swa_hit` (tied to
`model.contract.lookup` by `tests/test_smt.py::test_hit_rules_match_model`): a first
pass with the drop, a second at that hit without it. That composition is what
`AllocatorModel._find_hit` does for a verified group
(`tests/test_proof_setups.py::test_eagle_reevaluation_at_own_hit_is_what_the_allocator_does`),
and its claim is evaluated on the executable lookup rules
(`test_eagle_drop_once_setup_on_the_lookup_rules`).
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from invariants.proofs.engine import (
    Describe,
    Outcome,
    Refutes,
    Step,
    Values,
    concrete,
    int_of,
    run_steps,
    theorem,
    value_of,
)
from invariants.proofs.lemmas import generic_lemma, lemma_cancel, lemma_floor_aligned, whole_blocks_steps
from invariants.proofs.swa_setup import (
    Swa,
    boundary_promise_steps,
    replay_boundary,
    swa_hit_tokens,
    swa_kept,
    swa_values,
)
from model.contract import lookup, masks, smt
from model.contract.smt import DENSE


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


def _peek_kept_and_served(v: Values) -> str | None:
    """eagle_block_kept_and_served's claim at concrete values, for the mask computed without Eagle."""
    bs, A, P, L = int(v["block_size"]), int(v["alignment"]), int(v["prompt"]), int(v["max_length"])
    E = replay_boundary(v) // A * A
    s = E // bs
    need = masks.swa_tail_blocks(int(v["window"]), bs, True)
    if v["mode"] == DENSE or L != P - 1 or P - 1 < 2 * A or int(v["end"]) < s + 1 or s + 1 < need:
        return None
    kept = swa_kept(v, mask_eagle=False)
    hit = swa_hit_tokens(v, kept, L)
    problems = [f"peek block {s} not kept"] if s not in kept else []
    if hit < E or hit == 0:
        problems.append(f"the resend hit is {hit} tokens, below the boundary {E}")
    return "; ".join(problems) or None


@theorem(control=True, claim=_peek_kept_and_served)
def control_eagle_block_missing() -> Outcome:
    """Control for eagle_block_kept_and_served (peek block kept, resend hit >= boundary > 0): a mask computed without the Eagle block and shift (the pre-#44082 mask) drops the peek block and the resend hit falls below the boundary."""
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
        _eagle_resend_steps(c, broken),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="every tail block kept",
        refutes=Refutes(lambda m: swa_values(c, m), _peek_kept_and_served),
    )


def _drop_once_steps(
    kind: str, redrop: bool
) -> tuple[list[Step], list[z3.BoolRef], Describe, list[list[z3.BoolRef]], Callable[[z3.ModelRef], Values]]:
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
            f"max_length={value_of(m, L)}: candidate hits (a model of the step), first pass {int_of(m, h1.blocks) * int_of(m, bs)} tokens, "
            f"second pass {int_of(m, h2.blocks) * int_of(m, bs)}"
        )

    def values(m: z3.ModelRef) -> Values:
        v: Values = {"block_size": int_of(m, bs), "alignment": int_of(m, A), "max_length": int_of(m, L)}
        v["window_blocks"] = int_of(m, need0)
        for j in range(int(v["max_length"]) // int(v["block_size"]) + 2):
            v[f"cached_{j}"] = bool(concrete(m, C(j)))
        return v

    grid = [[bs == b_, b_ * k_ == A, b_ * n_ == L] for b_ in (1, 2) for k_ in (1, 2) for n_ in (4, 8)]
    return steps, base, describe, grid, values


@theorem()
def eagle_drop_applied_once() -> Outcome:
    """Eagle drop applied once (#33270): a full-attention or SWA group whose hit was computed with the Eagle drop and is re-evaluated at that hit without the drop (the coordinator's later fixed-point passes: verified groups) returns the same hit, so passes never compound the drop.

    For every cached set (uninterpreted), block size, alignment and window; unbounded.
    """
    for kind in ("full", "swa"):
        steps, base, describe, _, _ = _drop_once_steps(kind, redrop=False)
        o = run_steps(steps, base, describe)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"{kind}: {o.detail}")
    return Outcome("proved")


def _drop_kept_on_second_pass(v: Values) -> str | None:
    """eagle_drop_applied_once's claim at concrete values, for a coordinator that drops on every pass:
    the full-attention hit re-evaluated at its own hit (model.contract.lookup.full_hit) is that hit."""
    bs, A, L = int(v["block_size"]), int(v["alignment"]), int(v["max_length"])
    cached = {int(name.split("_")[1]) for name, x in v.items() if name.startswith("cached_") and x}
    first = len(lookup.full_hit(cached.__contains__, L, bs, A, True)) * bs
    second = len(lookup.full_hit(cached.__contains__, first, bs, A, True)) * bs
    return f"first pass {first} tokens, second pass {second}" if second != first else None


@theorem(control=True, claim=_drop_kept_on_second_pass)
def control_eagle_drop_every_pass() -> Outcome:
    """Control for eagle_drop_applied_once (re-evaluation keeps the hit): re-applying the drop on the second pass (the #33270 bug) shrinks the hit."""
    steps, base, describe, grid, values = _drop_once_steps("full", redrop=True)
    refutes = Refutes(values, _drop_kept_on_second_pass)
    return run_steps(
        steps, base, describe, grid=grid, refute_at="re-evaluation keeps the hit", refutes=refutes
    )
