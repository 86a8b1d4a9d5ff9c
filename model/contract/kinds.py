"""Group kinds as rule objects: what a KV cache group of each kind reads, keeps and hands on.

A KV cache group is full attention, sliding-window attention (SWA) or Mamba
(`model.contract.config.GroupSpec.kind`). The rules that differ by kind live here, one object
per kind, looked up once per use (`rules_for(spec)`), so the machine states a rule
once and asks the group's kind for its part:

| rule                 | full | swa                             | mamba                                 |
|----------------------|------|---------------------------------|---------------------------------------|
| `skipped_tokens`     | 0    | tokens before the window's start | every token but the last (its state)  |
| `one_state`          | no   | no                              | in 'align' mode: one state per chunk  |
| `draft_blocks`       | 0    | 0                               | one state block per draft (k)         |
| `counts_step_slots`  | yes  | yes                             | no: it counts its draft blocks itself |
| `hands_computed_only`| yes  | yes                             | no: its whole table                   |

vLLM's single-type managers state the same per kind (`FullAttentionManager`,
`SlidingWindowManager`, `MambaManager`: `get_num_skipped_tokens`, the Mamba spec's
draft blocks, `get_block_ids_for_computed_tokens` clipping attention groups only).
What a lookup finds per kind is `model.contract.lookup` (its finders by kind).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.contract.config import GroupSpec


class KindRules:
    """Full attention (and the base of the other kinds): every token is read again."""

    name = "full"
    counts_step_slots = True  # a decode step's slots (1 + k + lookahead tokens) take blocks here
    hands_computed_only = True  # a finish hands the connector the blocks of its computed tokens only

    def skipped_tokens(self, spec: GroupSpec, computed: int) -> int:
        """Of `computed` tokens, those no later token reads (their blocks may go)."""
        return 0

    def one_state(self, spec: GroupSpec) -> bool:
        """One state block per chunk, the previous one freed (Mamba, 'align')."""
        return False

    def draft_blocks(self, num_spec_tokens: int) -> int:
        """State blocks the group keeps for `num_spec_tokens` drafts past its tokens."""
        return 0


class SwaRules(KindRules):
    """Sliding-window attention: a token reads the `sliding_window` tokens up to it."""

    name = "swa"

    def skipped_tokens(self, spec: GroupSpec, computed: int) -> int:
        assert spec.sliding_window is not None
        return max(0, computed - spec.sliding_window + 1)


class MambaRules(KindRules):
    """Mamba: the next token reads only the state after the last one."""

    name = "mamba"
    counts_step_slots = False
    hands_computed_only = False

    def skipped_tokens(self, spec: GroupSpec, computed: int) -> int:
        return computed - 1

    def one_state(self, spec: GroupSpec) -> bool:
        """'align' keeps one state per chunk; 'none' (caching off only) lays blocks out as
        the attention kinds do (vLLM's `MambaManager` defers to the base manager)."""
        return spec.mamba_cache_mode == "align"

    def draft_blocks(self, num_spec_tokens: int) -> int:
        """One per speculative token, as vLLM's Mamba layers declare them
        (`MambaBase.get_kv_cache_spec`)."""
        return num_spec_tokens


FULL, SWA, MAMBA = KindRules(), SwaRules(), MambaRules()
KINDS: dict[str, KindRules] = {r.name: r for r in (FULL, SWA, MAMBA)}


def rules_for(spec: GroupSpec) -> KindRules:
    """The rules of `spec`'s kind."""
    return KINDS[spec.kind]
