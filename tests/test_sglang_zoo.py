"""The SGLang zoo: each mutant of the real classes is killed, by the invariant written for its bug class.

This is the negative control of the radix invariants on the real engine: the
unmutated cache runs the same seeds clean (tests/test_sglang_target.py), and
after the hunt every original method is back. Skipped, with the reason, when
SGLang cannot be imported.
"""

from __future__ import annotations

import pytest

from invariants.targets.sglang_env import sglang_available

_OK, _REASON = sglang_available()
if not _OK:
    pytest.skip(f"sglang zoo: {_REASON}", allow_module_level=True)

from invariants.zoo.mutants_sglang import SGLANG_MUTANTS, hunt  # noqa: E402

# mutant -> the invariants written for its bug class (the first violation found must be one)
EXPECTED = {
    "swa_evicted_seqlen_dropped": ("radix_pool_conservation",),
    "mamba_slot_leaked_on_abort": ("radix_pool_conservation",),
    "swa_window_off_by_one": ("radix_hit_matches_model",),
    "eviction_mru": ("radix_eviction_lru", "radix_full_eviction_matches_model"),
    "block_removed_not_emitted": ("radix_events_replay",),
    "lock_not_taken": ("radix_locked_paths_kept",),
    "swa_evicted_by_full_count": ("radix_refusal_justified",),
    "swa_tombstone_stale_mapping_freed": ("radix_pool_conservation",),
    "tombstone_recovery_frees_locked_full": ("radix_running_prefix_backed",),
    "mamba_hit_refreshes_path": ("radix_mamba_eviction_lru",),
    "swa_finish_frees_window": ("radix_finished_prefix_promise",),
    "mamba_finish_drops_own_state": ("radix_finished_prefix_promise",),
    "namespace_dropped_on_chunk_insert": ("radix_hit_same_identity",),
    # hunted on the Rust core alone: killed by judging it against the model, not the Python core
    "rust_full_eviction_in_swa_scope": ("radix_eviction_scope", "radix_full_eviction_matches_model"),
}


def test_every_mutant_has_an_expected_killer() -> None:
    assert set(EXPECTED) == set(SGLANG_MUTANTS)


@pytest.mark.parametrize("name", sorted(SGLANG_MUTANTS))
def test_mutant_killed_and_restored(name: str) -> None:
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def current() -> tuple[object, ...]:
        return (
            UnifiedRadixCache.lock,
            UnifiedRadixCache.on_release,
            UnifiedRadixCache.checkpoint_into_tree,
            LRUStrategy.get_priority,
            SWAComponent.prepare_for_caching_req,
            MambaComponent.prepare_for_caching_req,
            MambaComponent.commit_insert_component_data,
            RustUnifiedTreeCore.evict_device_start,
            RustUnifiedTreeCore.evict_device_next_node,
        )

    originals = current()
    row = hunt(name, budget_s=10.0)
    assert row.killed_by in EXPECTED[name], row
    assert current() == originals
