"""The symbolic SWA group (#43447, #42258) and the proof chains the SWA and Eagle theorems share.

Every term is evaluated against the executable model on many concrete values
by a test (`tests/test_smt.py`: S, `tests/test_proof_setups.py`: P):

- `Swa.mask` (`smt.swa_mask`): `model.masks.swa_kept_blocks` (S
  `test_masks_match_model`); with the allocator's prompt, junction, range and
  config substituted, the blocks `AllocatorModel._cache_blocks` keeps (P
  `test_setup_mask_is_the_allocators_mask`), which ties `Swa.boundaries`
  (replay boundaries, junction, junction minus a block with Eagle) and `Swa.end`.
- `Swa.need` (`smt.swa_tail_blocks`), `smt.boundary_edge`: `model.masks` (S
  `test_tail_and_edge_match_model`).
- `Swa.replay` (`smt.replay_boundaries`): `model.masks.replay_boundaries` (S
  `test_replay_boundaries_match_model`).
- `Swa.hit` (`smt.swa_hit`): `model.lookup.swa_hit` (S `test_hit_rules_match_model`).
- `Swa.side` (`smt.config_side_conditions`): `model.config.validate` (P
  `test_side_conditions_match_validate`).
- `resend` (max length P - 1): the allocator's admission lookup (P
  `test_a_resend_looks_up_prompt_minus_one`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from invariants.proofs.engine import Outcome, Step, value_of
from invariants.proofs.lemmas import (
    lemma_cancel,
    lemma_div_lower,
    lemma_floor_aligned,
    lemma_mul_mod,
    quotient_step,
)
from model import smt
from model.smt import DENSE, INTERVAL, ZERO, I


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
            f"block_size={value_of(m, self.bs)}",
            f"window={value_of(m, self.w)}",
            f"alignment={value_of(m, self.A)}",
            f"retention={self.r.describe(m)}",
            f"eagle={value_of(m, self.eagle)}",
            f"prompt={value_of(m, self.P)} tokens",
            f"{value_of(m, self.end)} blocks cached",
            f"need={value_of(m, self.need)} blocks",
        ]
        if z3.is_true(m.eval(self.has_j, model_completion=True)):
            parts.append(f"junction={value_of(m, self.J)}")
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


def per_eagle(build: Callable[[bool], Outcome]) -> Outcome:
    """Prove without and with Eagle separately (smaller formulas); the first failure wins."""
    details = []
    for eagle in (False, True):
        o = build(eagle)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"eagle={eagle}: {o.detail}" if o.detail else None)
        if o.detail:
            details.append(o.detail)
    return Outcome("proved", None, "; ".join(details) or None)


def segment_promise_steps(
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
        lemma_mul_mod((q, c.seg, c.seg / c.A, c.A)),
        lemma_div_lower((c.end + c.need, c.per, q)),
        Step("E in blocks", E / c.bs == q * c.per, pre),
        Step("E aligned", E % c.A == 0, pre),
        quotient_step("tail lies in segment q", i - c.shift, c.per, q, c.need, pre + in_tail),
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


def boundary_promise_steps(
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
        lemma_mul_mod((b / c.A, c.A, c.A / c.bs, c.bs)),
        Step("boundary = n*a blocks", (b / c.A) * (c.A / c.bs) * c.bs == E, pre),
        lemma_cancel(((b / c.A) * (c.A / c.bs), c.bs)),
        Step("boundary in whole blocks", s * c.bs == E, pre),
        lemma_floor_aligned(b, c.A),
        Step("every tail block kept", C(i), pre + in_tail, [i]),
        Step(
            "scan finds the tail",
            claim,
            pre + [hit.chosen, hit.instance(s) if c.is_eagle else hit.instance(e)],
            uses=["every tail block kept", "boundary in whole blocks", "floor is aligned"],
        ),
    ]


def resend(c: Swa) -> list[z3.BoolRef]:
    """A resend of the prompt: max cache-hit length P - 1."""
    return [c.L == c.P - 1]


def dense_twin(c: Swa) -> smt.Mask:
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
