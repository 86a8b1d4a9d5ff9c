"""Speculative decoding as a scheduler decides it: drafts, padding, rejection.

The contract of vLLM 0.33.0's `Scheduler` (`vllm/v1/core/sched/scheduler.py`)
for a configuration with `num_spec_tokens = k` drafts per step (a
`SpeculativeConfig`: Eagle/MTP or a draft model, k = the configuration's
`num_lookahead_tokens`). Only a real scheduler speculates: the model applies
these rules when built with `num_spec_tokens > 0`, which the checker does for
targets that state `TargetFeatures.real_scheduler`.

- Drafts. After a sample the drafter proposes up to k tokens for the next step
  (`Scheduler.update_draft_token_ids`; `Sample.drafts`). A step schedules a
  running request `num_tokens + len(drafts) - num_computed` tokens, capped by
  the budget (`schedule`, running pass); the drafts it covers are verified by
  the step (`scheduled_spec_decode_tokens`), the rest are dropped, and the
  request's drafts are cleared either way. Preemption drops them
  (`_preempt_request`).
- Lookahead. Every allocation reserves `num_lookahead_tokens` slots past the
  step's tokens, drafts included (`KVCacheManager.allocate_slots`:
  `num_tokens_need_slot`); only tokens below `num_tokens` (drafts excluded)
  are cached.
- Padding. A waiting request admitted with exactly one token to compute is
  scheduled `1 + k` tokens, the k extra ones placeholder drafts, when the step
  has not run a prefill chunk and either ran a running request already or the
  admission has a hit (`schedule`, waiting pass, `pad_spec_decode`); a budget
  below `1 + k` ends the step's admissions instead (`padded_admission`). A
  Mamba split that clips the padded chunk leaves it unpadded (one token).
- Rejection. A sample of a step that verified d drafts accepts the first
  `accepted` of them (placeholders are never accepted): the request gains
  those drafts and the sampled token, and `num_computed` rolls back by
  `d - accepted` (`update_from_output`). Its blocks stay allocated, lookahead
  included; then the scheduler caches its blocks up to the rolled-back
  `num_computed` (`update_from_output` calls `KVCacheManager.cache_blocks` for
  every sampled request when k > 0).

With a KV connector (`model.machine.connector`; docs/semantics.md, the connector's "With speculative decoding"): an async
load's admission reserves no lookahead and leaves one decode step's slots
free, external tokens count as a hit for the padding, and the chunk after a
load is padded as an admission is.

Under async scheduling the scheduler never sees the drafts: the next step
verifies k slots (the proposal, then placeholders), and the sample's tokens
and rejection reach it one step late (`model.machine.async_scheduling`, 5).

Not modeled: the per-step input budget (`max_num_batched_tokens` less the
draft slots of each request, never binding at kvretain's sizes), the
`max_model_len` caps of drafts and padding (kvretain's requests stay far below
it), dynamic k, and drafts rejected by a grammar.

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
