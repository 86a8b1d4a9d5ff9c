"""Validation theorem: the validator accepts exactly the intervals the promise proofs assume (#43447).

Tied to the executable model: `validator_accepts` is `model.contract.config.validate`'s
retention rule (`tests/test_theorems.py::test_validator_term_matches_config_validate`);
`smt.config_side_conditions` is checked against `model.contract.config.validate` by
`tests/test_proof_setups.py::test_side_conditions_match_validate` (equal on the
retention rule: accepted exactly when the side conditions hold). The control's
search evaluates `smt.swa_mask` and `smt.swa_hit` (tied in `swa_setup`).
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from invariants.proofs.engine import Outcome, Refutes, Step, Values, concrete, run_steps, theorem, value_of
from model.contract import lookup, masks, smt
from model.contract.smt import DENSE, INTERVAL, ZERO


def validator_accepts(
    k: z3.ArithRef, is_none: z3.BoolRef, sbs: z3.ArithRef, has_group: z3.BoolRef
) -> z3.BoolRef:
    """model.contract.config.validate's retention rule as a Z3 term (None; 0 without SWA/Mamba; else k >= 0, k % sbs == 0)."""
    return z3.Or(is_none, z3.If(has_group, z3.And(k >= 0, k % sbs == 0), k == 0))


def _validation_steps(*, block_multiples: bool) -> tuple[list[Step], Callable[[z3.ModelRef], Values]]:
    """accepted => side condition; the control's validator accepts multiples of a group's block size."""
    k, sbs, gbs = z3.Ints("retention scheduler_block_size group_block_size")
    is_none, has_group = z3.Bools("retention_is_none has_swa_or_mamba")
    r = smt.Retention(z3.If(is_none, DENSE, z3.If(k == 0, ZERO, INTERVAL)), z3.If(is_none, 0, k))
    side = smt.config_side_conditions(block_size=gbs, alignment=sbs, retention=r)
    accepts = (
        z3.Or(is_none, z3.And(k >= 0, k % gbs == 0))
        if block_multiples
        else validator_accepts(k, is_none, sbs, has_group)
    )
    hyps = [gbs >= 1, sbs >= gbs, sbs % gbs == 0, has_group, accepts]
    steps = [Step("accepted intervals meet the proofs' side condition", side, hyps)]

    def values(m: z3.ModelRef) -> Values:
        names = {"retention": k, "scheduler_block_size": sbs, "group_block_size": gbs, "is_none": is_none}
        return {name: concrete(m, term) for name, term in names.items()}

    return steps, values


def _describe(m: z3.ModelRef) -> str:
    k, sbs, gbs = z3.Ints("retention scheduler_block_size group_block_size")
    return f"retention={value_of(m, k)}, scheduler_block_size={value_of(m, sbs)}, group block size={value_of(m, gbs)}"


@theorem()
def validation_accepts_what_the_promise_needs() -> Outcome:
    """Validation (#43447): every retention interval the validator accepts for a model with an SWA/Mamba group is None, 0 or a positive multiple of the scheduler block size, because that is the side condition under which swa_promise_segments and mamba_promise_kept are proved.

    Unbounded.
    """
    steps, _ = _validation_steps(block_multiples=False)
    return run_steps(steps, [], _describe)


def _accepted_meets_side(v: Values) -> str | None:
    """validation_accepts_what_the_promise_needs' claim at concrete values: the accepted interval meets the
    side condition; where it does not, the model's mask and lookup show the promised hit it loses."""
    k, sbs, gbs = int(v["retention"]), int(v["scheduler_block_size"]), int(v["group_block_size"])
    if v["is_none"]:
        return None
    side = smt.config_side_conditions(block_size=gbs, alignment=sbs, retention=smt.Retention.of(k))
    if z3.is_true(z3.simplify(side)):
        return None
    loss = None
    if k > 0:
        loss = next(
            (x for w in (2, 5, 9) for e in (False, True) if (x := _non_multiple_loss(gbs, sbs, k, w, e))),
            None,
        )
    return f"retention {k} accepted, not a multiple of {sbs}" + (f"; {loss}" if loss else "")


@theorem(control=True, claim=_accepted_meets_side)
def control_validator_accepting_block_multiples() -> Outcome:
    """Control for validation_accepts_what_the_promise_needs (accepted intervals are multiples of the scheduler block size): a validator accepting multiples of a group's block size accepts an interval outside the side condition, and the model's mask and lookup show a promised segment-end hit it loses."""
    steps, values = _validation_steps(block_multiples=True)
    k, sbs, gbs = z3.Ints("retention scheduler_block_size group_block_size")
    grid = [[gbs == b, sbs == b * m, k == b * j] for b in (1, 2, 4) for m in (2, 3) for j in (3, 5, 1)]
    return run_steps(
        steps,
        [],
        _describe,
        grid=grid,
        refute_at="accepted intervals meet the proofs' side condition",
        refutes=Refutes(values, _accepted_meets_side),
    )


def _non_multiple_loss(bs: int, A: int, k: int, w: int, eagle: bool) -> str | None:
    """The first segment end q*k whose aligned boundary floor_A(q*k) a request reaching it does not hit
    (the mask term at interval k, the executable lookup), or None."""
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
        got = len(lookup.swa_hit(cached.__contains__, F + bs * int(eagle), bs, A, need, eagle)) * bs
        if got < F:
            return (
                f"block_size={bs}, alignment={A}, window={w}, eagle={eagle}, retention={k}: segment end {E} "
                f"tokens floors to the aligned boundary {F}, and a request reaching it hits only {got}"
            )
    return None
