"""Alignment theorems: no block cached past the last aligned boundary, every hit a multiple of it.

Tied to the executable model: `smt.cacheable_tokens` is
`model.machine.allocator.AllocatorModel._cacheable_tokens`
(`tests/test_smt.py::test_scheduling_and_cacheable_match_model`); `smt.full_hit`,
`smt.swa_hit`, `smt.mamba_hit` are `model.contract.lookup`'s rules
(`tests/test_smt.py::test_hit_rules_match_model`).
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from invariants.proofs.engine import (
    CONTROL_TIMEOUT_MS,
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
from invariants.proofs.lemmas import generic_lemma, lemma_floor_aligned, whole_blocks_steps
from model.contract import lookup, smt


def _cacheable_steps(
    floor: bool,
) -> tuple[list[Step], list[z3.BoolRef], Describe, Callable[[z3.ModelRef], Values]]:
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

    def values(m: z3.ModelRef) -> Values:
        return {
            "computed_tokens": int_of(m, n),
            "block_size": int_of(m, bs),
            "alignment": int_of(m, A),
            "eagle": bool(concrete(m, eagle)),
        }

    return steps, base, describe, values


def _unfloored_claim(v: Values) -> str | None:
    """alignment_no_block_past_boundary's claim at concrete values, for a group that caches every
    computed token: its blocks stay below the last aligned boundary (+ the Eagle peek), and without
    Eagle its cached length is a multiple of the alignment."""
    n, bs, A, eagle = int(v["computed_tokens"]), int(v["block_size"]), int(v["alignment"]), bool(v["eagle"])
    cached_blocks = n // bs  # every computed full block
    limit = n // A * A // bs + int(eagle)
    problems = (
        [f"{cached_blocks} blocks cached, the boundary allows {limit}"] if cached_blocks > limit else []
    )
    if not eagle and n % A:
        problems.append(f"cached length {n} is not a multiple of {A}")
    return "; ".join(problems) or None


@theorem()
def alignment_no_block_past_boundary() -> Outcome:
    """Alignment (#42258): in a hybrid model a group caches only blocks below the last alignment boundary of the computed tokens (plus Eagle's one peek block), and without Eagle the cached length is a multiple of the alignment (AllocatorModel._cacheable_tokens).

    Unbounded.
    """
    steps, base, describe, _ = _cacheable_steps(True)
    return run_steps(steps, base, describe)


@theorem(control=True, claim=_unfloored_claim)
def control_alignment_unfloored() -> Outcome:
    """Control for alignment_no_block_past_boundary (no block past the last aligned boundary): caching every computed token stores blocks past the boundary."""
    steps, base, describe, values = _cacheable_steps(False)
    refutes = Refutes(values, _unfloored_claim)
    return run_steps(steps, base, describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=refutes)


def _hits_aligned_steps(
    lookup_alignment_is_block: bool,
) -> tuple[list[Step], list[z3.BoolRef], Describe, Callable[[z3.ModelRef], Values], list[list[z3.BoolRef]]]:
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

    def values(m: z3.ModelRef) -> Values:
        v: Values = {"block_size": int_of(m, bs), "alignment": int_of(m, A), "max_length": int_of(m, L)}
        v.update(need=int_of(m, need), eagle=bool(concrete(m, eagle)))
        for j in range(int(v["max_length"]) // int(v["block_size"]) + 2):
            v[f"cached_{j}"] = bool(concrete(m, C(j)))
        return v

    grid = [[bs == b, b * k == A, n * b == L] for b in (1, 2) for k in (2, 3) for n in (3, 5, 8)]
    return steps, base, describe, values, grid


def _unaligned_hits(v: Values) -> str | None:
    """alignment_hits_are_multiples' claim at concrete values, for lookup rules run with the block size as
    their alignment (model.contract.lookup): every hit a multiple of the alignment."""
    bs, A, L, need = int(v["block_size"]), int(v["alignment"]), int(v["max_length"]), int(v["need"])
    cached = {
        int(name.split("_")[1]) for name, x in v.items() if name.startswith("cached_") and x
    }.__contains__
    hits = {
        "full": lookup.full_hit(cached, L, bs, bs, bool(v["eagle"])),
        "swa": lookup.swa_hit(cached, L, bs, bs, need, False),
        "swa eagle": lookup.swa_hit(cached, L, bs, bs, need + 1, True),
        "mamba": lookup.mamba_hit(cached, L, bs, bs),
    }
    bad = [f"{rule} hit {len(layout) * bs} tokens" for rule, layout in hits.items() if len(layout) * bs % A]
    return f"alignment {A}: " + ", ".join(bad) if bad else None


@theorem()
def alignment_hits_are_multiples() -> Outcome:
    """Alignment (#42258): every hit the lookup rules return (full attention with and without the Eagle drop, SWA with and without Eagle, Mamba) is a multiple of the alignment, for every cached set.

    Unbounded; cached set uninterpreted.
    """
    steps, base, describe, _, _ = _hits_aligned_steps(False)
    return run_steps(steps, base, describe)


@theorem(control=True, claim=_unaligned_hits)
def control_alignment_lookup_ignores_alignment() -> Outcome:
    """Control for alignment_hits_are_multiples (every hit a multiple of the alignment): a lookup that aligns to the block size instead of A returns unaligned hits."""
    steps, base, describe, values, grid = _hits_aligned_steps(True)
    refutes = Refutes(values, _unaligned_hits)
    return run_steps(
        steps,
        base,
        describe,
        grid=grid,
        timeout_ms=CONTROL_TIMEOUT_MS,
        refute_at="swa hit aligned",
        refutes=refutes,
    )
