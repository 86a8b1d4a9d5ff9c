"""Alignment theorems: no block cached past the last aligned boundary, every hit a multiple of it.

Tied to the executable model: `smt.cacheable_tokens` is
`model.allocator.AllocatorModel._cacheable_tokens`
(`tests/test_smt.py::test_scheduling_and_cacheable_match_model`); `smt.full_hit`,
`smt.swa_hit`, `smt.mamba_hit` are `model.lookup`'s rules
(`tests/test_smt.py::test_hit_rules_match_model`).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import (
    CONTROL_TIMEOUT_MS,
    Describe,
    Outcome,
    Step,
    int_of,
    run_steps,
    theorem,
    value_of,
)
from invariants.proofs.lemmas import generic_lemma, lemma_floor_aligned, whole_blocks_steps
from model import smt


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
        generic_lemma("one more block", 2, lambda x, b_: ([b_ >= 1], (x + b_) / b_ == x / b_ + 1), (fl, bs)),
        generic_lemma(
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
            f"block_size={value_of(m, bs)}, alignment={value_of(m, A)}, eagle={value_of(m, eagle)}, {value_of(m, n)} tokens computed: "
            f"block {value_of(m, i)} cached past the aligned boundary {int_of(m, fl)}"
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
        lemma_floor_aligned(t, la),
        Step("floored is aligned", floored % la == 0, [la >= 1], uses=["floor is aligned"]),
        *whole_blocks_steps(floored, la, bs),
        generic_lemma(
            "ceil of a multiple",
            2,
            lambda x, b_: ([b_ >= 1, x == (x / b_) * b_], smt.cdiv(x, b_) * b_ == x),
            (floored, bs),
        ),
        Step("full hit aligned", (full.blocks * bs) % A == 0, [full.chosen]),
    ]

    def describe(m: z3.ModelRef) -> str:
        return f"block_size={value_of(m, bs)}, alignment={value_of(m, A)}, need={value_of(m, need)}, max_length={value_of(m, L)}"

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
