"""The symbolic SWA group (#43447, #42258) and the proof chains the SWA and Eagle theorems share.

Every term is evaluated against the executable model on many concrete values
by a test (`tests/test_smt.py`: S, `tests/test_proof_setups.py`: P):

- `Swa.mask` (`smt.swa_mask`): `model.contract.masks.swa_kept_blocks` (S
  `test_masks_match_model`); with the allocator's prompt, junction, range and
  config substituted, the blocks `AllocatorModel.cache_blocks` keeps (P
  `test_setup_mask_is_the_allocators_mask`), which ties `Swa.boundaries`
  (replay boundaries, junction, junction minus a block with Eagle) and `Swa.end`.
- `Swa.need` (`smt.swa_tail_blocks`), `smt.boundary_edge`: `model.contract.masks` (S
  `test_tail_and_edge_match_model`).
- `Swa.replay` (`smt.replay_boundaries`): `model.contract.masks.replay_boundaries` (S
  `test_replay_boundaries_match_model`).
- `Swa.hit` (`smt.swa_hit`): `model.contract.lookup.swa_hit` (S `test_hit_rules_match_model`).
- `Swa.side` (`smt.config_side_conditions`): `model.contract.config.validate` (P
  `test_side_conditions_match_validate`).
- `resend` (max length P - 1): the allocator's admission lookup (P
  `test_a_resend_looks_up_prompt_minus_one`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from invariants.proofs.engine import Claim, Outcome, Step, Values, concrete, value_of
from invariants.proofs.lemmas import (
    lemma_cancel,
    lemma_div_lower,
    lemma_floor_aligned,
    lemma_mul_mod,
    quotient_step,
)
from model.contract import lookup, masks, smt
from model.contract.smt import DENSE, INTERVAL, ZERO, I


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


def dense_twin(c: Swa, need_delta: int = 0) -> smt.Mask:
    """The mask the same group would keep with retention None (`need_delta`: for a control only)."""
    return smt.swa_mask(
        0,
        c.end,
        block_size=c.bs,
        window=c.w,
        alignment=c.A,
        eagle=c.eagle,
        retention=smt.Retention(I(DENSE), I(0)),
        boundaries=c.boundaries,
        need_delta=need_delta,
    )


# --------------------------------------------------------------------------- claims on concrete values
# A control's counterexample counts only if its concrete values violate the stated claim of its
# theorem; these evaluate that claim with the executable model (`model.contract.lookup`, `model.contract.masks`),
# the control's broken mask evaluated at the values.


def swa_values(c: Swa, m: z3.ModelRef, **extra: z3.ExprRef) -> Values:
    """The concrete configuration, prompt and lookup of a Z3 model of an SWA setup."""
    terms: dict[str, z3.ExprRef] = {
        "block_size": c.bs,
        "window": c.w,
        "alignment": c.A,
        "prompt": c.P,
        "end": c.end,
        "junction": c.J,
        "has_junction": c.has_j,
        "max_length": c.L,
        "eagle": c.eagle,
        "mode": c.r.mode,
        "k": c.r.k,
        **extra,
    }
    return {name: concrete(m, t) for name, t in terms.items()}


@dataclass
class MaskAt:
    """A (possibly broken) mask term with concrete values substituted: what it keeps in [0, end)."""

    mask: smt.Mask
    values: Sequence[tuple[z3.ExprRef, z3.ExprRef]]
    end: int

    def dense(self) -> bool:
        """The mask keeps every block (its dense fallback)."""
        return bool(z3.is_true(z3.simplify(z3.substitute(self.mask.dense, *self.values))))

    def kept(self) -> set[int]:
        if self.dense():
            return set(range(self.end))
        return {
            i for i in range(self.end) if z3.is_true(z3.simplify(z3.substitute(self.mask(i), *self.values)))
        }


def swa_mask_at(
    v: Values, *, mask_eagle: bool | None = None, dense: bool = False, **control: object
) -> MaskAt:
    """A (possibly broken) SWA mask at the values `v`.

    `dense` evaluates the dense twin; `mask_eagle` computes the mask as if Eagle were on/off.
    """
    c = Swa(eagle=bool(v["eagle"]))
    mode, k = (DENSE, 0) if dense else (int(v["mode"]), int(v["k"]))
    sub = [
        (c.bs, I(int(v["block_size"]))),
        (c.w, I(int(v["window"]))),
        (c.A, I(int(v["alignment"]))),
        (c.P, I(int(v["prompt"]))),
        (c.J, I(int(v["junction"]))),
        (c.has_j, z3.BoolVal(bool(v["has_junction"]))),
    ]
    mask = smt.swa_mask(
        0,
        int(v["end"]),
        block_size=c.bs,
        window=c.w,
        alignment=c.A,
        eagle=c.eagle if mask_eagle is None else mask_eagle,
        retention=smt.Retention(I(mode), I(k)),
        boundaries=c.boundaries,
        **control,  # type: ignore[arg-type]
    )
    return MaskAt(mask, sub, int(v["end"]))


def swa_kept(v: Values, **options: object) -> set[int]:
    """The blocks in [0, end) the SWA mask `options` describe keeps at the values `v` (dense: all)."""
    return swa_mask_at(v, **options).kept()  # type: ignore[arg-type]


def swa_hit_tokens(v: Values, cached: set[int], max_length: int) -> int:
    """The executable SWA hit rule (`model.contract.lookup.swa_hit`) over a concrete cached set, in tokens."""
    bs, eagle = int(v["block_size"]), bool(v["eagle"])
    need = masks.swa_tail_blocks(int(v["window"]), bs, eagle)
    return len(lookup.swa_hit(cached.__contains__, max_length, bs, int(v["alignment"]), need, eagle)) * bs


def reachable_boundaries(v: Values) -> list[int]:
    """The boundaries the allocator passes the mask: the replay boundaries, the junction (and minus a block)."""
    out = list(masks.replay_boundaries(int(v["prompt"]), int(v["alignment"]), bool(v["eagle"])))
    if v["has_junction"]:
        out.append(int(v["junction"]))
        if v["eagle"]:
            out.append(int(v["junction"]) - int(v["block_size"]))
    return out


def replay_boundary(v: Values) -> int:
    """Swa.replay at the values: the boundary a resend lands on."""
    b1 = smt.replay_boundaries(int(v["prompt"]), int(v["alignment"]), bool(v["eagle"]))[0]
    return int(z3.simplify(I(b1)).as_long())


def window_in_scope(v: Values) -> bool:
    """The SWA theorems assume a window of at least two tokens, or Eagle (finding_swa_window_one)."""
    return int(v["window"]) >= 2 or bool(v["eagle"])


def boundary_served(which: str, **control: object) -> Claim:
    """swa_promise_replay / swa_promise_junction's claim on concrete values, for the mask `control` breaks."""

    def claim(v: Values) -> str | None:
        bs, A, shift = int(v["block_size"]), int(v["alignment"]), int(bool(v["eagle"]))
        b = replay_boundary(v) if which == "replay" else int(v["junction"])
        L = int(v["max_length"])
        E = b // A * A
        s = E // bs
        e = s + shift
        in_scope = (
            int(v["mode"]) != DENSE
            and window_in_scope(v)
            and b >= 0
            and int(v["end"]) >= e
            and e * bs <= L
            and (int(v["prompt"]) - 1 == L if which == "replay" else bool(v["has_junction"]))
        )
        if not in_scope:
            return None
        need = masks.swa_tail_blocks(int(v["window"]), bs, bool(v["eagle"]))
        short = bool(v["eagle"]) and s + 1 < need and bs != A
        promised = E - A if short else E
        hit = swa_hit_tokens(v, swa_kept(v, **control), L)
        if hit >= promised:
            return None
        return f"{which} boundary {E} tokens, max length {L}: the SWA hit is {hit} tokens"

    return claim
