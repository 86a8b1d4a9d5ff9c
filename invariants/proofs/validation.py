"""Validation theorem: the validator accepts exactly the intervals the promise proofs assume (#43447).

Tied to the executable model: `validator_accepts` is `model.config.validate`'s
retention rule (`tests/test_theorems.py::test_validator_term_matches_config_validate`);
`smt.config_side_conditions` is checked against `model.config.validate` by
`tests/test_proof_setups.py::test_side_conditions_match_validate` (equal on the
retention rule: accepted exactly when the side conditions hold). The control's
search evaluates `smt.swa_mask` and `smt.swa_hit` (tied in `swa_setup`).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import Outcome, Step, run_steps, theorem, value_of
from model import smt
from model.smt import DENSE, INTERVAL, ZERO, I


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
    return run_steps(
        steps, [], lambda m: f"retention={value_of(m, k)}, scheduler_block_size={value_of(m, sbs)}"
    )


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
