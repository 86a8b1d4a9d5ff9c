"""SWA retention theorems: every promised hit is served, no kept block is waste (#43447, #42258).

The symbolic group, its mask and hit rule come from `swa_setup` (whose
docstring names the executable function each term is tied to and the test).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import Outcome, Refutes, Step, Values, int_of, run_steps, theorem, value_of
from invariants.proofs.lemmas import lemma_mul_mod
from invariants.proofs.swa_setup import (
    Swa,
    boundary_promise_steps,
    boundary_served,
    per_eagle,
    reachable_boundaries,
    resend,
    segment_promise_steps,
    swa_hit_tokens,
    swa_kept,
    swa_mask_at,
    swa_values,
    window_in_scope,
)
from model.contract import masks, smt
from model.contract.smt import DENSE, ZERO


@theorem()
def swa_promise_segments() -> Outcome:
    """Promise kept (#43447): for retention None (every alignment boundary) and k, every segment end E whose tail the request computed is served: the SWA right-to-left scan finds all its contiguous blocks (incl. Eagle's peek), so the hit is >= E.

    Unbounded: block size, window (>= 2, or any with Eagle: finding_swa_window_one), alignment,
    interval, segment index; with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        steps, _ = segment_promise_steps(c, c.mask(), z3.Int("q"))
        return run_steps(steps, c.side, c.describe)

    return per_eagle(build)


def _segment_served(v: Values) -> str | None:
    """swa_promise_segments' claim at concrete values, for the mask whose tail is one block short."""
    bs, A, shift, q = int(v["block_size"]), int(v["alignment"]), int(bool(v["eagle"])), int(v["q"])
    E = q * (A if v["mode"] == DENSE else int(v["k"]))
    e = E // bs + shift
    if v["mode"] == ZERO or q < 1 or int(v["end"]) < e or not window_in_scope(v):
        return None
    hit = swa_hit_tokens(v, swa_kept(v, need_delta=-1), e * bs)
    return f"segment end {E} tokens, max length {e * bs}: the SWA hit is {hit} tokens" if hit < E else None


@theorem(control=True, claim=_segment_served)
def control_swa_tail_one_short() -> Outcome:
    """Control for swa_promise_segments (segment end E served, hit >= E): with tails one block short (need - 1) a computed segment end gets a hit below E."""
    c = Swa()
    mask = c.mask(need_delta=-1)
    q = z3.Int("q")
    steps, _ = segment_promise_steps(c, mask, q)
    E = q * c.seg

    def describe(m: z3.ModelRef) -> str:
        e = int_of(m, E / c.bs + c.shift)
        lo = max(e - int_of(m, c.need), 0)
        missing = [j for j in range(lo, e) if not z3.is_true(m.eval(mask(j), model_completion=True))]
        return f"{c.describe(m)}: segment end {int_of(m, E)} tokens, tail blocks {lo}..{e - 1}, block(s) {missing} not kept"

    refutes = Refutes(lambda m: swa_values(c, m, q=q), _segment_served)
    return run_steps(
        steps, c.side, describe, grid=c.grid(), refute_at="every tail block kept", refutes=refutes
    )


@theorem(finding=True)
def finding_swa_window_one() -> Outcome:
    """Finding (model and vLLM 0.33.0): an SWA group with a one-token window needs no block (need = cdiv(0, bs) = 0), so reachable_block_mask keeps no block even in dense mode, while find_longest_cache_hit still needs one cached block at the hit's edge: the group never serves a hit.

    Expected refuted (degenerate window; the other SWA theorems assume window >= 2 or Eagle).
    """
    c = Swa(eagle=False, window_one=True)
    steps, _ = segment_promise_steps(c, c.mask(), z3.Int("q"))
    return run_steps(steps, c.side, c.describe, grid=c.grid(), refute_at="scan finds the tail")


def _no_waste_steps(c: Swa, mask: smt.Mask, *, block0: bool = False) -> list[Step]:
    i = z3.Int("i")
    q = (i - c.shift) / c.per + 1
    E = q * c.seg

    def read_by(E_: z3.ArithRef) -> z3.BoolRef:
        """Block i is read by the scan for a hit of E_ > 0 tokens (incl. Eagle's peek)."""
        e_ = E_ / c.bs + c.shift
        return z3.And(E_ >= c.A, E_ % c.A == 0, e_ - c.need <= i, i < e_)

    periodic = z3.And(c.r.mode != ZERO, q >= 1, read_by(E))
    at_boundary = z3.Or([z3.And(c.r.mode != DENSE, read_by(b / c.A * c.A)) for b in c.boundaries])
    pre = [mask(i), z3.Not(mask.dense)]
    if not block0:
        pre.append(z3.Or(i >= 1, z3.Not(c.eagle)))
    return c.arith_steps() + [
        lemma_mul_mod((q, c.seg, c.seg / c.A, c.A)),
        *[lemma_mul_mod((b / c.A, c.A, c.A / c.bs, c.bs), (b / c.A, c.A, 1, c.A)) for b in c.boundaries],
        Step("E in blocks", z3.Implies(q >= 1, E / c.bs == q * c.per), pre),
        Step("E aligned", E % c.A == 0, pre),
        Step("E positive", z3.Implies(z3.And(q >= 1, c.r.mode != ZERO), E >= c.A), pre),
        Step("kept block is read by a retained boundary", z3.Or(periodic, at_boundary), pre),
    ]


@theorem()
def swa_no_waste() -> Outcome:
    """No waste (#42258): every SWA block the mask keeps (block 0 with Eagle aside, see finding_swa_eagle_block_zero) lies in the tail, incl. Eagle's peek, that the scan reads for a positive hit at some retained aligned boundary (a segment end or a reachable boundary).

    The boundary may lie past the blocks computed so far (a segment's tail is
    cached as the request passes it). Sparse masks; when need >= blocks per
    segment the mask is dense by design. Unbounded.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(_no_waste_steps(c, c.mask()), c.side, c.describe)

    return per_eagle(build)


def _every_kept_block_read(v: Values) -> str | None:
    """swa_no_waste's claim at concrete values, for the mask whose tail is one block too long: every kept
    block (block 0 with Eagle aside) lies in the tail the scan reads for a positive hit at a retained
    aligned boundary (a segment end, or a reachable boundary floored to the alignment)."""
    bs, A, shift = int(v["block_size"]), int(v["alignment"]), int(bool(v["eagle"]))
    need = masks.swa_tail_blocks(int(v["window"]), bs, bool(v["eagle"]))
    mode = int(v["mode"])
    seg = A if mode == DENSE else int(v["k"])
    mask = swa_mask_at(v, need_delta=1)
    if not window_in_scope(v) or seg < 1 or mask.dense():
        return None  # a dense mask keeps every block by design
    kept = mask.kept()
    ends = [q * seg for q in range(1, (int(v["end"]) + need) * bs // seg + 2)] if mode != ZERO else []
    if mode != DENSE:
        ends += [b // A * A for b in reachable_boundaries(v)]
    read = {i for E in ends if E >= A for i in range(E // bs + shift - need, E // bs + shift)}
    waste = sorted(i for i in kept if i not in read and (i >= 1 or not v["eagle"]))
    return f"block(s) {waste} kept, read by no hit at a retained boundary" if waste else None


@theorem(control=True, claim=_every_kept_block_read)
def control_swa_tail_one_long() -> Outcome:
    """Control for swa_no_waste (every kept block is read by some retained boundary's hit): with tails one block too long (need + 1) the mask keeps a block no such hit reads."""
    c = Swa(eagle=False)
    mask = c.mask(need_delta=1)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {value_of(m, i)} is kept but lies in no retained boundary's tail"

    return run_steps(
        _no_waste_steps(c, mask),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="kept block is read by a retained boundary",
        refutes=Refutes(lambda m: swa_values(c, m), _every_kept_block_read),
    )


@theorem(finding=True)
def finding_swa_eagle_block_zero() -> Outcome:
    """Finding (model and vLLM 0.33.0 reachable_block_mask): with Eagle and retention 0 / k, a reachable boundary below one alignment (a prompt shorter than 2A, or a junction below A) floors to 0 and keeps block 0 as the 'peek' of an empty hit: one cached block no hit reads.

    Expected refuted; harmless for correctness (one block of waste per such
    prompt), and the reason the dense/sparse inclusion excludes block 0.
    """
    c = Swa(eagle=True)
    i = z3.Int("i")

    def describe(m: z3.ModelRef) -> str:
        return f"{c.describe(m)}: block {value_of(m, i)} is kept but no positive hit reads it"

    return run_steps(
        _no_waste_steps(c, c.mask(), block0=True),
        c.side,
        describe,
        grid=c.grid(),
        refute_at="kept block is read by a retained boundary",
    )


@theorem()
def swa_promise_replay() -> Outcome:
    """Promise kept (#43447): with retention 0 or k, a resend of a cached prompt (max length P - 1) hits at least its latest replayable boundary (P - 1, with Eagle floor_A(P - 1) - A) floored to the alignment, whenever the request computed that boundary's tail; with Eagle, bs != A and the boundary less than a window above block 0, one alignment segment less (lookup.py alignment_quirk; finding_swa_eagle_short_prompt).

    Unbounded: block size, window (>= 2, or any with Eagle), alignment, interval, prompt length;
    with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(
            boundary_promise_steps(c, c.mask(), c.replay, c.L, quirk_clause=True),
            c.side + resend(c),
            c.describe,
        )

    return per_eagle(build)


@theorem(control=True, claim=boundary_served("replay", drop_boundaries=True))
def control_swa_dropped_replay_boundary() -> Outcome:
    """Control for swa_promise_replay (a resend hits at least its floored replay boundary): a mask that forgets the reachable boundaries gives the resend a hit below it."""
    c = Swa()
    steps = boundary_promise_steps(c, c.mask(drop_boundaries=True), c.replay, c.L, quirk_clause=True)

    def describe(m: z3.ModelRef) -> str:
        E = int_of(m, c.replay / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens not served (its tail blocks are not kept)"

    refutes = Refutes(lambda m: swa_values(c, m), boundary_served("replay", drop_boundaries=True))
    return run_steps(
        steps, c.side + resend(c), describe, grid=c.grid(), refute_at="every tail block kept", refutes=refutes
    )


@theorem(finding=True)
def finding_swa_eagle_short_prompt() -> Outcome:
    """Finding (vLLM 0.33.0 SlidingWindowManager.find_longest_cache_hit, kept by lookup.py): with Eagle, bs != A and a replay boundary less than one window above block 0, the resend hit is one alignment segment short although every block of the boundary is cached.

    Expected refuted: the counterexample is a configuration where the hit is
    suboptimal (never wrong: fewer tokens reused).
    """
    c = Swa(eagle=True)
    steps = boundary_promise_steps(c, c.mask(), c.replay, c.L, quirk_clause=False)

    def describe(m: z3.ModelRef) -> str:
        E = int_of(m, c.replay / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens is fully cached, the hit is {E - int_of(m, c.A)}"

    return run_steps(steps, c.side + resend(c), describe, grid=c.grid(), refute_at="scan finds the tail")


@theorem()
def swa_promise_junction() -> Outcome:
    """Promise kept (#43447): with retention 0 or k, a later request sharing the prefix up to the shared-prefix junction J hits at least floor_A(J) whenever its max length reaches that boundary's peek, because the junction is a reachable boundary whose tail the mask keeps (same Eagle short-prompt exception as swa_promise_replay).

    Unbounded (window >= 2, or any with Eagle); with and without Eagle.
    """

    def build(eagle: bool) -> Outcome:
        c = Swa(eagle=eagle)
        return run_steps(
            boundary_promise_steps(c, c.mask(), c.J, c.L, quirk_clause=True), c.side + [c.has_j], c.describe
        )

    return per_eagle(build)


@theorem(control=True, claim=boundary_served("junction", drop_boundaries=True))
def control_swa_dropped_junction() -> Outcome:
    """Control for swa_promise_junction (a request sharing the prefix hits at least floor_A(J)): without the reachable boundaries its hit falls below floor_A(J)."""
    c = Swa()
    steps = boundary_promise_steps(c, c.mask(drop_boundaries=True), c.J, c.L, quirk_clause=True)
    refutes = Refutes(lambda m: swa_values(c, m), boundary_served("junction", drop_boundaries=True))
    return run_steps(
        steps,
        c.side + [c.has_j],
        c.describe,
        grid=c.grid(),
        refute_at="every tail block kept",
        refutes=refutes,
    )
