"""Arithmetic lemmas the proofs record at their own terms (quotients, multiples, floors).

Each lemma is proved over fresh integers and recorded at the argument terms a
theorem needs: the proved formula is valid for every value of its variables,
so substituting terms is sound, and Z3 never sees the terms' structure, which
is where nonlinear integer reasoning times out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from invariants.proofs.engine import Step
from model.contract.smt import I

_lemma_ids = iter(range(10**9))


def reset_lemma_names() -> None:
    """Number fresh lemma variables from 0 again (same names, same Z3 search, whichever process runs it)."""
    global _lemma_ids
    _lemma_ids = iter(range(10**9))


def generic_lemma(
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
    n = next(_lemma_ids)
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


def lemma_mul_mod(*at: Sequence[z3.ArithRef]) -> Step:
    """x == n * A  =>  (q * x) % A == 0."""
    return generic_lemma(
        "multiple of a multiple", 4, lambda q, x, n, a: ([a >= 1, x == n * a], (q * x) % a == 0), *at
    )


def lemma_div_lower(*at: Sequence[z3.ArithRef]) -> Step:
    """p >= 1 and x >= q * p  =>  x / p >= q."""
    return generic_lemma("division lower bound", 3, lambda x, p, q: ([p >= 1, x >= q * p], x / p >= q), *at)


def lemma_cancel(*at: Sequence[z3.ArithRef]) -> Step:
    """y >= 1  =>  (x * y) / y == x."""
    return generic_lemma("cancel", 2, lambda x, y: ([y >= 1], (x * y) / y == x), *at)


def whole_blocks_steps(x: z3.ArithRef, a: z3.ArithRef, b: z3.ArithRef) -> list[Step]:
    """x % a == 0 and a % b == 0 (a, b >= 1)  =>  x == (x / b) * b, as a chain Z3 can follow."""
    return [
        Step("x = n*a", x == (x / a) * a, [a >= 1, x % a == 0]),
        Step("a = m*b", a == (a / b) * b, [b >= 1, a % b == 0]),
        generic_lemma(
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


def lemma_floor_aligned(x: z3.ArithRef, a: z3.ArithRef) -> Step:
    """(x - x % a) % a == 0 and (x / a * a) % a == 0 for a >= 1."""
    return generic_lemma(
        "floor is aligned",
        2,
        lambda x_, a_: ([a_ >= 1], z3.And((x_ - x_ % a_) % a_ == 0, (x_ / a_ * a_) % a_ == 0)),
        (x, a),
    )


def quotient_step(
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
