"""Partial entries: the prompt's reusable hash boundary keyed inside a block.

A group block wider than the hash block can serve a hit ending inside it
only if the block is also keyed by the prefix that ends there (vLLM
`BlockPool.cache_partial_block`, #46384 "support partial prefix cache hit for
hybrid model"). Caching keys one such boundary per request, the one a resend
of the prompt reaches:

- full attention (`FullAttentionManager._cache_partial_tail_block`): the
  prompt's last hash boundary, at most `prompt - 1` tokens without Eagle (a
  resend recomputes the last token), the whole prompt under Eagle; keyed
  only when it lies inside a block (`full_tail`);
- Mamba in 'align' mode (`MambaManager._cache_partial_tail_block`): the
  state at the prompt's checkpoint (`model.policy.scheduling.mamba_checkpoint_position`:
  floored from `prompt - 1` without Eagle, one hash block lower with it),
  keyed when a chunk ends exactly there, on a block edge too (`checkpoint`).

Release variants, keyed by the `model.contract.profile.Profile` switches that select
them (each rule's docstring names its releases):
- `FULL_TAILS[partial_tail, partial_tail_excludes_last_token]`;
- `CHECKPOINTS[partial_tail, mamba_checkpoint]`.
Before #46384 (`partial_tail=False`, 0.25.x and older) only whole blocks are
keyed, whatever the other switch says.
"""

from __future__ import annotations

from collections.abc import Callable

from model.policy.scheduling import mamba_checkpoint_position


def below_last_token(num_prompt_tokens: int, num_tokens: int, hash_block_size: int, eagle: bool) -> int:
    """0.32.0 on (PR not identified): the last hash boundary of at most `prompt - 1`
    tokens without Eagle (of the prompt with it) and of the request's tokens."""
    limit = num_prompt_tokens if eagle else num_prompt_tokens - 1
    return min(limit, num_tokens) // hash_block_size * hash_block_size


def at_prompt_end(num_prompt_tokens: int, num_tokens: int, hash_block_size: int, eagle: bool) -> int:
    """0.26.0 .. 0.31.0 (#46384): the last hash boundary of the whole prompt, whatever Eagle."""
    return min(num_prompt_tokens, num_tokens) // hash_block_size * hash_block_size


def no_full_tail(num_prompt_tokens: int, num_tokens: int, hash_block_size: int, eagle: bool) -> int:
    """0.25.x and older (before #46384): no partial entry (0: nothing to key)."""
    return 0


FullTail = Callable[[int, int, int, bool], int]
FULL_TAILS: dict[tuple[bool, bool], FullTail] = {
    (True, True): below_last_token,
    (True, False): at_prompt_end,
    (False, True): no_full_tail,
    (False, False): no_full_tail,
}


def any_block(
    end: int, num_prompt_tokens: int, hash_block_size: int, block_size: int, eagle: bool
) -> int | None:
    """0.32.0 on (PR not identified): `mamba_checkpoint_position`, even where it ends a Mamba block."""
    return mamba_checkpoint_position(num_prompt_tokens, hash_block_size, eagle)


def in_block_drop(
    end: int, num_prompt_tokens: int, hash_block_size: int, block_size: int, eagle: bool
) -> int | None:
    """0.30.0, 0.31.0 (#51295): only a chunk end inside a Mamba block is keyed
    (one on a block edge is left to the retention mask); the checkpoint is
    floored from the whole prompt, one hash block lower under Eagle."""
    if end % block_size == 0:
        return None
    drop = hash_block_size if eagle else 0
    return max(num_prompt_tokens // hash_block_size * hash_block_size - drop, 0)


def in_block(
    end: int, num_prompt_tokens: int, hash_block_size: int, block_size: int, eagle: bool
) -> int | None:
    """0.26.0 .. 0.29.0 (#46384): inside a Mamba block only, floored from the whole
    prompt whatever Eagle (the known finding `vllm-mamba-checkpoint-at-prompt-end`)."""
    if end % block_size == 0:
        return None
    return num_prompt_tokens // hash_block_size * hash_block_size


def no_checkpoint(
    end: int, num_prompt_tokens: int, hash_block_size: int, block_size: int, eagle: bool
) -> int | None:
    """0.25.x and older (before #46384): no Mamba state is keyed inside a block."""
    return None


Checkpoint = Callable[[int, int, int, int, bool], "int | None"]
"""(the chunk's end, prompt tokens, hash block, Mamba block, Eagle) -> the
position keyed at this chunk end, or None for none."""

CHECKPOINTS: dict[tuple[bool, str], Checkpoint] = {
    (True, "any_block"): any_block,
    (True, "in_block_drop"): in_block_drop,
    (True, "in_block"): in_block,
    (False, "any_block"): no_checkpoint,
    (False, "in_block_drop"): no_checkpoint,
    (False, "in_block"): no_checkpoint,
}
