"""Production link, the coordinator's boundaries: vLLM 0.33.0's equal the model's on a bounded domain.

Two functions decide where caching keeps what a later hit needs:

- `replay_boundaries(num_prompt_tokens, scheduler_block_size, use_eagle)`
  (vLLM `kv_cache_coordinator.py`): where a replay of a prompt resumes,
  against the model's rule for 0.33.0 (`rules_of(MODELED).replay_boundaries`,
  `model.contract.eagle.replay_boundaries`). Exhaustive over prompts and scheduler
  block sizes (`REPLAY_QUICK`, `REPLAY_FULL`).
- `HybridKVCacheCoordinator.get_num_cacheable_tokens(num_computed, group)`:
  how many tokens a group may cache, against the model's
  (`AllocatorModel._cacheable_tokens`: every token under fine-grained hits,
  else `rules_of(MODELED).cacheable`, `model.contract.masks.floor_with_peek`). Over
  every configuration of the hybrid-hit domain (`coordinator_link.Domain`,
  coordinators built by vLLM's own `KVCacheManager`), every group, every
  computed length up to three scheduler blocks and two more tokens.

No fake here: the first is a pure function, the second reads only the
coordinator's own fields (alignment, the fine-grained switch, each manager's
block size and Eagle flag; no MTP re-prefill, as kvretain configures none).
"""

from __future__ import annotations

from typing import Any

from invariants.proofs import coordinator_link
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.profile import MODELED, rules_of

REPLAY_QUICK = (64, 8)  # prompts 1..64 tokens, scheduler blocks 1..8
REPLAY_FULL = (256, 32)


def check_replay_boundaries(v: dict[str, Any], bounds: tuple[int, int]) -> tuple[int, str | None]:
    """Every prompt length and scheduler block size in `bounds`, Eagle both: (cases, first disagreement)."""
    model_rule = rules_of(MODELED).replay_boundaries
    max_prompt, max_block = bounds
    cases = 0
    for sbs in range(1, max_block + 1):
        for p in range(1, max_prompt + 1):
            for eagle in (False, True):
                got = tuple(v["replay_boundaries"](p, sbs, eagle))
                want = tuple(model_rule(p, sbs, eagle))
                cases += 1
                if got != want:
                    return cases, (
                        f"prompt {p} tokens, scheduler block {sbs}, eagle={eagle}: vLLM resumes at "
                        f"{list(got)}, the model at {list(want)}"
                    )
    return cases, None


def check_cacheable(v: dict[str, Any], dom: coordinator_link.Domain) -> tuple[int, str | None]:
    """Every configuration of `dom`, group and computed length: (cases, first disagreement)."""
    cacheable = rules_of(MODELED).cacheable
    cases = 0
    seen = set()
    for inst in coordinator_link.instances(dom):
        cfg = inst.cfg
        if cfg in seen:  # the hashed tokens do not matter here
            continue
        seen.add(cfg)
        coord, _ = coordinator_link.build_coordinator(inst, v)
        sbs, fine = cfg.scheduler_block_size, fine_hits_enabled(cfg)
        for gid, g in enumerate(cfg.groups):
            for n in range(3 * sbs + 3):
                got = coord.get_num_cacheable_tokens(n, gid)
                want = n if fine else cacheable(n, sbs, g.block_size, cfg.eagle)
                cases += 1
                if got != want:
                    return cases, (
                        f"{inst.describe()}, group {gid}, {n} computed tokens: vLLM caches {got}, "
                        f"the model {want}"
                    )
    return cases, None
