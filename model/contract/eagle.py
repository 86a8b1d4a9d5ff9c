"""Eagle (MTP) and prefix caching: the lookup's margin and the boundaries a replay resumes at.

Eagle drafts from the hidden state one position back, so a hit under Eagle
gives back its last block (the "drop", `model.contract.lookup`), and what caching keeps
must serve the hit a later request lands on after that drop.

- Margin (vLLM `kv_cache_coordinator.py` `find_longest_cache_hit`): in a
  hybrid lookup an Eagle group looks one drop unit past the candidate
  (`model.contract.fine_mamba.eagle_margin`: a hash block for a fine lookup, else a
  block) so that its drop lands back on the candidate. The look stops at the
  hashed tokens (`MARGIN_REACH`), and Mamba, whose finder never drops, gets
  no margin (`LOOKS_PAST`).
- Replay boundaries (vLLM `replay_boundaries`): where a later request
  replaying this prompt resumes, which caching keeps reachable
  (`replay_boundaries`, `REPLAY_BOUNDARIES`).
- Junction peek: under Eagle a sibling diverging right after the
  shared-prefix junction drops the block below it, so that block's boundary is
  kept too (`JUNCTION_REACH`).

Each table maps the value of a `model.contract.profile.Profile` switch to the rule of
the releases that have it; each rule's docstring names them.
"""

from __future__ import annotations

from collections.abc import Callable


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt can resume (vLLM `replay_boundaries`).

    A resend is capped at P-1 tokens. With Eagle the hit lands one block below
    the last aligned boundary, for the resend and for a longer sibling; the two
    differ only when P is block-aligned. 0.30.0 on (#53945, #54713).
    """
    if not eagle:
        return (num_prompt_tokens - 1,)
    sbs = scheduler_block_size
    resend = (num_prompt_tokens - 1) // sbs * sbs
    extension = num_prompt_tokens // sbs * sbs
    return tuple(sorted({max(resend - sbs, 0), max(extension - sbs, 0)}))


def resend_boundary(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """0.29.0 and older (before #53945, #54713): every group keeps the tail of
    `prompt - 1` whatever Eagle, where no Eagle resend resumes."""
    return (num_prompt_tokens - 1,)


ReplayBoundaries = Callable[[int, int, bool], tuple[int, ...]]
REPLAY_BOUNDARIES: dict[bool, ReplayBoundaries] = {True: replay_boundaries, False: resend_boundary}


def junction_and_peek(junction: int, block_size: int, eagle: bool) -> tuple[int, ...]:
    """0.33.0 (PR not identified; `cache_blocks`): the junction, and under Eagle
    the boundary one of the group's blocks below it."""
    return (junction, junction - block_size) if eagle else (junction,)


def junction_only(junction: int, block_size: int, eagle: bool) -> tuple[int, ...]:
    """0.26.0 .. 0.32.0: only the junction itself is kept, whatever Eagle."""
    return (junction,)


JunctionReach = Callable[[int, int, bool], tuple[int, ...]]
JUNCTION_REACH: dict[bool, JunctionReach] = {True: junction_and_peek, False: junction_only}


def to_hashed_tokens(hashed_len: int, max_len: int) -> int:
    """0.32.0 on (PR not identified): the margin may reach every hashed token, so
    the drop can land on a hit ending at the recomputed last token."""
    return hashed_len


def to_lookup_limit(hashed_len: int, max_len: int) -> int:
    """0.31.0 and older: the margin stops at the lookup's limit (`max_cache_hit_length`)."""
    return max_len


MarginReach = Callable[[int, int], int]
MARGIN_REACH: dict[bool, MarginReach] = {True: to_hashed_tokens, False: to_lookup_limit}


def all_but_mamba(kind: str) -> bool:
    """0.26.0 on (#46384): every Eagle group but Mamba looks past the candidate
    (`not isinstance(spec, MambaSpec)`: Mamba's finder never drops)."""
    return kind != "mamba"


def every_kind(kind: str) -> bool:
    """0.25.x and older: Mamba too is searched one block past the candidate (the
    known finding `vllm-eagle-mamba-hit-without-full-blocks`)."""
    return True


LooksPast = Callable[[str], bool]
LOOKS_PAST: dict[bool, LooksPast] = {True: all_but_mamba, False: every_kind}


# ------------------------------------------------------------------ lookahead block hashes
# vLLM 0.33.0's default for Eagle (`SpeculativeConfig.disable_lookahead_block_hashes=False`):
# each block's hash also covers the drafter's next token(s), so a hit proves the KV the
# drafter read at the block's last position and nothing is dropped. Which tokens enter each
# key is `model.contract.extra_keys.lookahead_hash_keys` (named by `model.contract.prefix.block_name`); what the
# allocator does is stated here, and `model.contract.config.Config` (`hash_lookahead`, `eagle_drop`)
# hands both variants to the allocator, its caching and lookups.

# The model rule an admission fires when it hits under lookahead hashes (`kvretain conformance`).
LOOKAHEAD_HIT = "a hit under Eagle's lookahead hashes (no trailing block dropped)"


def hash_lookahead_tokens(eagle: bool, asked: bool, caching: bool, connector: bool) -> int:
    """Tokens after each block its hash covers (vLLM 0.33.0 `VllmConfig.num_hash_lookahead_tokens`):
    1 for an Eagle drafter (it reads only the next token; multi-module MTP, not generated,
    reads `num_speculative_tokens`) when asked for (`Config.lookahead_block_hashes`), with
    prefix caching on and no KV connector (connectors keep the legacy hashes); else 0."""
    return int(eagle and asked and caching and not connector)


def drops_last_block(eagle: bool, lookahead: int) -> bool:
    """An Eagle hit gives back its last block (`model.contract.lookup`'s drop, and with it the margin,
    replay boundaries and junction peek above) iff the hashes carry no lookahead tokens
    (vLLM 0.33.0 `Scheduler.__init__`: `use_eagle_block_drop = False` when
    `num_hash_lookahead_tokens`; the managers' `use_eagle` is that flag)."""
    return eagle and lookahead == 0


def hashed_tokens(num_tokens: int, lookahead: int) -> int:
    """The tokens whose blocks a request can hash: a block is hashed, so cached and found,
    only once its `lookahead` tokens exist (`get_request_block_hasher`: `num_tokens - L`)."""
    return num_tokens - lookahead


def mamba_proof_limit(num_tokens: int, eagle_drop: bool, lookahead: int) -> int:
    """The last token a Mamba prefill checkpoint may cover before block alignment
    (`get_mamba_prefill_checkpoint_position`): all of them under Eagle's drop (the drop
    leaves tokens to recompute), else all but max(1, L) (the logits' token and the hash's)."""
    return num_tokens if eagle_drop else num_tokens - max(1, lookahead)
