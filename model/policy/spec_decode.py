"""Speculative decoding as a scheduler decides it: drafts, padding, rejection.

For a configuration with `num_spec_tokens = k` drafts per step (Eagle/MTP or a draft
model; only a real scheduler speculates, `TargetFeatures.real_scheduler`):

- Drafts: a step schedules a running request `num_tokens + len(drafts) - num_computed`
  tokens under the budget; the drafts it covers are verified, the rest dropped, and the
  request's drafts cleared either way. Preemption drops them.
- Lookahead: every allocation reserves `num_lookahead_tokens` slots past the step's
  tokens; only tokens below `num_tokens` (drafts excluded) are cached.
- Padding: a waiting request admitted with one token to compute is scheduled `1 + k`
  (k placeholder drafts) when the step ran no prefill chunk and either ran a running
  request or the admission has a hit; a budget below `1 + k` ends the admissions.
- Rejection: a sample of a step that verified d drafts accepts the first `accepted`;
  `num_computed` rolls back by `d - accepted`, blocks stay allocated, and the blocks up
  to the rolled-back `num_computed` are cached at once.

With a KV connector and under async scheduling, and what is not modeled:
docs/semantics.md, "Speculative decoding through the real scheduler".

vLLM's policy, read from `Scheduler.schedule` (`pad_spec_decode`) and
`update_draft_token_ids` in vLLM 0.33.0; predicted, no claim to be correct (the
drafts' verification and rollback are contract: docs/semantics.md, "Adopted behaviours").
"""

from __future__ import annotations

PLACEHOLDER = -1
"""A padded draft slot (`pad_spec_decode`): verified, never accepted."""


def acceptable(verifying: tuple[int, ...]) -> int:
    """How many of a step's verified drafts a sample may accept: those before the
    first placeholder (vLLM `strip_speculative_padding`)."""
    for i, token in enumerate(verifying):
        if token < 0:
            return i
    return len(verifying)


def verified_drafts(
    drafts: tuple[int, ...], num_computed: int, num_tokens: int, scheduled: int
) -> tuple[int, ...]:
    """The drafts a step of `scheduled` tokens verifies: those its tokens reach past
    the request's known tokens (`Scheduler.schedule`, `num_scheduled_spec_tokens`)."""
    reach = scheduled + num_computed - num_tokens
    return drafts[:reach] if reach > 0 else ()


def padded_admission(
    num_new: int, num_spec_tokens: int, hit: int, ran_running: bool, ran_prefill: bool
) -> int:
    """The placeholder drafts an admission of `num_new` tokens is padded with: k for a
    one-token admission that `pad_spec_decode` pads (see the module docstring), else 0."""
    if num_spec_tokens and num_new == 1 and not ran_prefill and (ran_running or hit > 0):
        return num_spec_tokens
    return 0
