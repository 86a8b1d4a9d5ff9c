"""Semantics profiles: the design of the time of one vLLM release, as a few switches.

The model predicts vLLM 0.33.0's design by default. An older release predates
some mechanisms; the release matrix builds the model with that release's
profile so that a remaining disagreement is a defect of the release, not a
mechanism it did not have yet.

A profile is data. Each switch selects, from the variant tables of the
mechanism modules, the rules of the releases that share its value
(`rules_of`, the one table from switches to rules); `AllocatorModel` composes
the `Rules` it gets and never reads a switch. Each variant's docstring (or
`since`) names the releases that have it and the upstream change, where one is
known:

| switch                             | module                 | rules it selects          |
|------------------------------------|------------------------|---------------------------|
| `free_order`                       | `model.contract.routing`        | `FREE_ORDERS`             |
| `caching_off_free_to_head`         | `model.contract.routing`        | `CACHING_OFF_ORDERS`      |
| `block_mask`, `eagle_aware_mask`   | `model.contract.masks`          | `CACHEABLE`, `SWA_MASKS`  |
| `block_mask`, `mamba_retention`    | `model.contract.masks`          | `MAMBA_MASKS`             |
| `masks_on_hit_grid`                | `model.contract.masks`          | `MASK_GRIDS`              |
| `eagle_replay_boundaries`          | `model.contract.eagle`          | `REPLAY_BOUNDARIES`       |
| `eagle_junction_peek`              | `model.contract.eagle`          | `JUNCTION_REACH`          |
| `eagle_margin_to_hashed`           | `model.contract.eagle`          | `MARGIN_REACH`            |
| `eagle_margin_skips_mamba`         | `model.contract.eagle`,         | `LOOKS_PAST`,             |
|                                    | `model.contract.hybrid_hit`     | `FULL_BOUNDS`             |
| `shared_prefix_junction`           | `model.contract.hybrid_hit`     | `JUNCTIONS`               |
| `partial_tail`, `partial_tail_excludes_last_token` | `model.contract.partial_tails` | `FULL_TAILS` |
| `partial_tail`, `mamba_checkpoint` | `model.contract.partial_tails`  | `CHECKPOINTS`             |
| `mamba_retire_past_nulls`          | `model.contract.mamba`          | `RETIREMENTS`             |
| `mamba_count_capped`               | `model.contract.mamba`          | `COUNTS`                  |

Contract: `Profile()` is vLLM 0.33.0 exactly (the default everywhere); a switch
only ever selects an older rule, never a new one. Which profile a release gets
is decided by its version (the vLLM adapter's release table), not here; where
the installed code behaves like another rule, the adapter reports it as drift.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from model.contract import eagle, hybrid_hit, mamba, masks, partial_tails, routing

FREE_ORDERS = ("pool", "caller", "append")
MAMBA_CHECKPOINTS = ("any_block", "in_block_drop", "in_block")


@dataclass(frozen=True)
class Profile:
    """Which rules of the modeled design a release has (True / 0.33.0 value = has it).

    - `eagle_junction_peek`: under Eagle, the block below the shared-prefix
      junction is a reachable boundary too (a sibling diverging right after the
      junction drops the peek block and lands one block lower). Before it only
      the junction itself was kept (added in 0.33.0's `cache_blocks`).
    - `partial_tail_excludes_last_token`: full attention with block size above
      the hash block size keys the prompt's last hash boundary at most
      `prompt - 1` tokens without Eagle (a resend recomputes the last token).
      Before it the boundary was taken over the whole prompt (0.32.0).
    - `eagle_margin_to_hashed`: a hybrid lookup under Eagle looks one block
      past the candidate, up to every hashed token (so the drop can land on a
      hit that ends at the recomputed last token). Before it the look stopped
      at the lookup's limit (`max_cache_hit_length`) (0.32.0).
    - `eagle_replay_boundaries`: under Eagle the boundaries a replaying
      request resumes at are one block below the prompt's last aligned
      boundary, for a resend and a longer sibling (`replay_boundaries`). Before
      it every group kept the tail of `prompt - 1` whatever Eagle (0.30.0).
    - `caching_off_free_to_head`: with prefix caching off, freed blocks go to
      the head of the free queue (reused first, LIFO) (#51482, 0.28.0). Before
      it they were appended to the tail (0.27.0, 0.27.1: #48017).
    - `block_mask`: SWA and Mamba cache only the blocks some boundary can use
      (#42258). Before it every full block of every group was cached (0.21.0).
    - `eagle_aware_mask`: the SWA mask keeps Eagle's peek block and shifts the
      tail up one block (#44082). Before it the mask ignored Eagle (0.22.0).
    - `mamba_retention`: the retention interval thins Mamba states too
      (#45845). Before it every Mamba state was cached (0.23.0).
    - `free_order`: where freed blocks go in the free queue: "pool" (the
      pool puts uncached blocks at the head, cached ones at the tail: #42656
      "Apply LRU policy only to proper cache entries", 0.24.0), "caller" (SWA
      splits its own frees cached/uncached, #43447; a finished request's
      full-attention and Mamba blocks and a stale Mamba state are appended)
      (0.23.0) or "append" (every freed block to the tail) (0.21.0, 0.22.0).
    - `shared_prefix_junction`: a hybrid lookup reports the junction (the
      longest hit a group reached alone) and caching keeps its tail. Before
      it there was no junction (0.25.0 and older).
    - `partial_tail`: the prompt's last hash boundary inside a full-attention
      block (block size above the hash block size) and the Mamba checkpoint
      state are keyed as partial entries (#46384, partial prefix hits). Before
      it only whole blocks were keyed (0.25.0 and older).
    - `eagle_margin_skips_mamba`: a hybrid lookup under Eagle gives Mamba's
      finder (which never drops a block) no look past the candidate, and full
      attention's later rounds cap the candidate at its own hit (#46384).
      Before it Mamba was searched one block past the candidate and full
      attention only re-aligned it, so the fixed point could settle above the
      full-attention hit (0.25.x and older; the known finding
      `vllm-eagle-mamba-hit-without-full-blocks`).
    - `mamba_checkpoint`: where the Mamba state at the prompt's checkpoint is
      keyed. "any_block" (0.32.0): at `scheduling.mamba_checkpoint_position`
      (floored from `prompt - 1` without Eagle, one hash block lower with
      it), even where it ends a Mamba block. Before it only a checkpoint
      inside a Mamba block was keyed (one on a block edge was left to the
      retention mask), floored from the whole prompt: "in_block_drop" one
      hash block lower under Eagle (0.30.0, 0.31.0), "in_block" whatever
      Eagle (0.26.0 .. 0.29.0).
    - `mamba_count_capped`: a Mamba group asks admission for its needed new
      blocks capped at one running state plus a copy destination (0.31.0).
      Before it any positive need was raised to that cap, so a partial hit
      needing only its copy block asked for two (0.26.0 .. 0.30.0).
    - `masks_on_hit_grid`: the SWA and Mamba masks floor a boundary to the
      lookup's hit grid, the hash block under fine-grained hits (0.29.0).
      Before it they floored to the scheduler block while lookups landed on
      the hash block (0.26.0 .. 0.28.0; the known finding
      `vllm-fine-grained-mask-on-scheduler-grid`).
    - `mamba_retire_past_nulls`: Mamba 'align' frees the states it skipped
      past the null gaps prefill leaves between them (a retired-block mark).
      Before it the walk down from the last skipped block stopped at the first
      null, so a state below one was freed only as the stale state, in the
      order of that path (0.29.0; PR not identified).
    """

    eagle_junction_peek: bool = True
    partial_tail_excludes_last_token: bool = True
    eagle_margin_to_hashed: bool = True
    eagle_replay_boundaries: bool = True
    caching_off_free_to_head: bool = True
    block_mask: bool = True
    eagle_aware_mask: bool = True
    mamba_retention: bool = True
    free_order: str = "pool"
    shared_prefix_junction: bool = True
    partial_tail: bool = True
    eagle_margin_skips_mamba: bool = True
    mamba_checkpoint: str = "any_block"
    mamba_count_capped: bool = True
    mamba_retire_past_nulls: bool = True
    masks_on_hit_grid: bool = True

    def __post_init__(self) -> None:
        assert self.free_order in FREE_ORDERS, f"free_order: one of {FREE_ORDERS}"
        assert self.mamba_checkpoint in MAMBA_CHECKPOINTS, f"mamba_checkpoint: one of {MAMBA_CHECKPOINTS}"

    def differences(self) -> list[str]:
        """The switches that select an older rule, by name (empty for 0.33.0)."""
        default = Profile()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]

    def describe(self) -> str:
        """The profile in words: "0.33.0" or the older rules it selects (`switch=value`)."""
        older = [f"{name}={getattr(self, name)!r}" for name in self.differences()]
        return "0.33.0" if not older else "0.33.0 but " + ", ".join(older)


MODELED = Profile()


@dataclass(frozen=True)
class Rules:
    """The rule of each mechanism a profile selects: what `AllocatorModel` composes."""

    free_order: routing.FreeOrder
    caching_off: routing.CachingOff
    cacheable: masks.Cacheable
    swa_mask: masks.Mask
    mamba_mask: masks.Mask
    mask_grid: masks.MaskGrid
    replay_boundaries: eagle.ReplayBoundaries
    junction_reach: eagle.JunctionReach
    margin_reach: eagle.MarginReach
    looks_past: eagle.LooksPast
    full_bound: hybrid_hit.FullBound
    junction: hybrid_hit.Junction
    full_tail: partial_tails.FullTail
    checkpoint: partial_tails.Checkpoint
    retirement: mamba.Retirement
    count: mamba.Count


def rules_of(p: Profile) -> Rules:
    """The profile table: each switch looked up in its mechanism module's variants."""
    return Rules(
        free_order=routing.FREE_ORDERS[p.free_order],
        caching_off=routing.CACHING_OFF_ORDERS[p.caching_off_free_to_head],
        cacheable=masks.CACHEABLE[p.block_mask, p.eagle_aware_mask],
        swa_mask=masks.SWA_MASKS[p.block_mask, p.eagle_aware_mask],
        mamba_mask=masks.MAMBA_MASKS[p.block_mask, p.mamba_retention],
        mask_grid=masks.MASK_GRIDS[p.masks_on_hit_grid],
        replay_boundaries=eagle.REPLAY_BOUNDARIES[p.eagle_replay_boundaries],
        junction_reach=eagle.JUNCTION_REACH[p.eagle_junction_peek],
        margin_reach=eagle.MARGIN_REACH[p.eagle_margin_to_hashed],
        looks_past=eagle.LOOKS_PAST[p.eagle_margin_skips_mamba],
        full_bound=hybrid_hit.FULL_BOUNDS[p.eagle_margin_skips_mamba],
        junction=hybrid_hit.JUNCTIONS[p.shared_prefix_junction],
        full_tail=partial_tails.FULL_TAILS[p.partial_tail, p.partial_tail_excludes_last_token],
        checkpoint=partial_tails.CHECKPOINTS[p.partial_tail, p.mamba_checkpoint],
        retirement=mamba.RETIREMENTS[p.mamba_retire_past_nulls],
        count=mamba.COUNTS[p.mamba_count_capped],
    )
