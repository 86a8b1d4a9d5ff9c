"""Unit and scenario tests of reference_impl against the verified facts in vllm_notes.md.

Every expected value below was observed on vLLM 0.33.0 (shared/vllm_notes/scripts/out)
unless the test is about a seeds-only mechanism (pinned tier, event profile).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest

from reference_impl import (
    AllocatorConfig,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheGroupConfig,
    KVCacheManager,
    MambaManager,
    Request,
    Scheduler,
    SlidingWindowManager,
    replay_boundaries,
    validate,
)
from reference_impl.hashing import get_block_hash, get_group_id, make_block_hash_with_group_id
from reference_impl.kv_events import BlockRemoved, BlockStored

G = KVCacheGroupConfig
FULL16_SWA16 = (G("full", 16), G("swa", 16, 32))
FULL32_SWA16 = (G("full", 32), G("swa", 16, 32))


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def make(groups: tuple[KVCacheGroupConfig, ...], num_blocks: int = 64, **kw: object) -> Scheduler:
    return Scheduler(KVCacheManager(AllocatorConfig(groups=groups, num_blocks=num_blocks, **kw)))  # type: ignore[arg-type]


def run_to(
    s: Scheduler, rid: str, prompt: Sequence[int], total: int, chunk: int, tok: int = 50000
) -> Request:
    """Admit, prefill in chunks, decode; sample after each step that computed every token."""
    s.add_request(rid, prompt)
    req = s.requests[rid]
    while req.num_computed_tokens < total:
        out = s.schedule(rid, chunk)
        assert out.scheduled > 0, out
        if req.num_computed_tokens == req.num_tokens:
            tok += 1
            s.sample(rid, tok)
    return req


def free_queue(s: Scheduler) -> list[int]:
    return ids(s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks())


def group_keys(s: Scheduler, req: Request) -> dict[int, list[int]]:
    """group -> sorted fine-hash indices (the notes' "A:i" labels) in the hash map."""
    out: dict[int, list[int]] = {}
    for key, _ in s.kv_cache_manager.block_pool.cached_block_hash_to_block.items():
        out.setdefault(get_group_id(key), []).append(req.block_hashes.index(get_block_hash(key)))
    return {g: sorted(v) for g, v in sorted(out.items())}


# ------------------------------------------------------------------ free queue (notes §1)
def test_free_queue_verified_sequence() -> None:
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == list(range(8)) and q.num_free_blocks == 8
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(3)) == [1, 2, 3]
    q.remove(blocks[6])
    assert ids(q.get_all_free_blocks()) == [4, 5, 7]
    q.append(blocks[6])
    assert ids(q.get_all_free_blocks()) == [4, 5, 7, 6]
    q.prepend_n([blocks[3], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [3, 1, 4, 5, 7, 6]
    q.append_n([blocks[0], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [3, 1, 4, 5, 7, 6, 0, 2]
    assert q.num_free_blocks == 8 == len(q)
    assert q.popleft_n(0) == []
    with pytest.raises(RuntimeError, match="invalid block"):
        q.remove(KVCacheBlock(9))
    assert ids(q.popleft_n(8)) == [3, 1, 4, 5, 7, 6, 0, 2]
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks)


def test_second_queue_shares_links_without_stale_entries() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    regular, pinned = FreeKVCacheBlockQueue(blocks[:2]), FreeKVCacheBlockQueue()
    pinned.append_n(blocks[2:])
    pinned.remove(blocks[3])
    regular.append(blocks[3])
    assert ids(regular.get_all_free_blocks()) == [0, 1, 3] and ids(pinned.get_all_free_blocks()) == [2]


# ------------------------------------------------------------------ pool (notes §2.5)
def _hash(pool: BlockPool, block: KVCacheBlock, tag: bytes) -> None:
    pool._insert_block_hash(make_block_hash_with_group_id(tag, 0), block, 16)


def test_pool_free_routing_verified_example() -> None:
    pool = BlockPool(10, enable_caching=True, hash_block_size=16)
    assert (
        ids(pool.free_block_queue.get_all_free_blocks()) == list(range(1, 10))
        and pool.null_block.block_id == 0
    )
    b = pool.get_new_blocks(4)
    assert ids(b) == [1, 2, 3, 4]
    _hash(pool, b[1], b"h2")
    _hash(pool, b[3], b"h4")
    pool.free_blocks(list(reversed(b)))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 5, 6, 7, 8, 9, 4, 2]
    pool.touch([b[1]])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 5, 6, 7, 8, 9, 4] and b[1].ref_cnt == 1
    pool.free_blocks([b[1]])
    assert ids(pool.free_block_queue.get_all_free_blocks())[-1] == 2
    assert ids(pool.get_new_blocks(8)) == [3, 1, 5, 6, 7, 8, 9, 4]
    assert len(pool.cached_block_hash_to_block) == 1 and b[3].block_hash is None
    with pytest.raises(ValueError, match="Cannot get 2 free blocks from the pool"):
        pool.get_new_blocks(2)
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0


def test_pool_caching_off_is_lifo() -> None:
    pool = BlockPool(6, enable_caching=False, hash_block_size=16)
    b = pool.get_new_blocks(3)
    pool.free_blocks(list(reversed(b)))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4, 5]


def test_pool_duplicates_and_secondary_keys() -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=16)
    pool.enable_kv_cache_events = True
    a, b = pool.get_new_blocks(2)
    key = make_block_hash_with_group_id(b"k", 0)
    pool._insert_block_hash(key, a, 16)
    pool._insert_block_hash(key, b, 16)
    pool._insert_block_hash(make_block_hash_with_group_id(b"s", 0), a, 8)  # secondary
    assert ids(list(pool.cached_block_hash_to_block._cache[key].values())) == [1, 2]
    assert pool.cached_block_hash_to_block.get_one_block(key) is a
    pool.evict_blocks([1])
    assert [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)] == [b"k", b"s"]
    assert pool.cached_block_hash_to_block.get_one_block(key) is b and a.ref_cnt == 1


# ------------------------------------------------------------------ pinned tier (#40676)
def test_pinned_tier_routing_touch_demote_reset() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(4)
    for blk, tag in zip(b, (b"a", b"b", b"c", b"d"), strict=True):
        _hash(pool, blk, tag)
    b[0].is_pinned = b[2].is_pinned = True
    pool.free_blocks(b)
    assert ids(pool.pinned_block_queue.get_all_free_blocks()) == [1, 3]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 6, 7, 2, 4]
    assert pool.get_num_free_blocks() == 5 and pool.get_num_available_blocks() == 7
    pool.touch([b[0]])  # hit on a pinned block: leaves the pinned tier, keeps its pin
    assert ids(pool.pinned_block_queue.get_all_free_blocks()) == [3] and b[0].is_pinned
    pool.free_blocks([b[0]])  # pins survive hit-then-release: back to the pinned tail
    assert ids(pool.pinned_block_queue.get_all_free_blocks()) == [3, 1]
    assert pool.demote_n(1) == 1 and not b[2].is_pinned
    assert ids(pool.free_block_queue.get_all_free_blocks())[-1] == 3 and b[2].block_hash is not None
    assert pool.reset_prefix_cache()
    assert pool.get_num_pinned_blocks() == 0 and not b[0].is_pinned
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 6, 7, 2, 4, 3, 1]
    assert len(pool.cached_block_hash_to_block) == 0


def test_admission_demotes_only_the_shortfall() -> None:
    s = make((G("full", 16),), num_blocks=6)
    pool = s.kv_cache_manager.block_pool
    b = pool.get_new_blocks(4)
    for i, blk in enumerate(b):
        _hash(pool, blk, bytes([i]))
        blk.is_pinned = True
    pool.free_blocks(b)
    assert pool.get_num_free_blocks() == 1 and pool.get_num_pinned_blocks() == 4
    out = s.schedule(s.add_request("A", list(range(40))).request_id, 64)  # needs 3 blocks
    assert out.admitted and out.new_blocks == ((5, 1, 2),)
    assert ids(pool.pinned_block_queue.get_all_free_blocks()) == [3, 4]
    # a request that fits the whole pool is admitted (liveness): all pins demoted
    s.finish("A")
    s.add_request("B", [7] * 80)
    assert s.schedule("B", 80).admitted


def test_swa_window_slide_pins_last_window_with_min_drop() -> None:
    s = make(FULL16_SWA16, pin_swa_on_drop=True, pin_min_drop_blocks=2)
    req = run_to(s, "A", list(range(1, 101)), 120, 32)
    pool = s.kv_cache_manager.block_pool
    pinned = [b for b in pool.blocks if b.is_pinned]
    assert pinned and all(b.block_hash is not None for b in pinned)
    # chunk-sized slides drop 2 blocks and pin both; 1-block decode slides pin nothing
    assert len(pinned) == 4
    s.finish("A")
    assert {b.block_id for b in pool.pinned_block_queue.iter_blocks()} == {b.block_id for b in pinned}
    assert not set(ids(pool.free_block_queue.get_all_free_blocks())) & {b.block_id for b in pinned}
    assert s.probe(list(req.prompt_token_ids)).hit == 96


# ------------------------------------------------------------------ masks (notes §3.3, §3.4)
def _keep(mask: list[bool] | None, n: int) -> list[int] | None:
    return None if mask is None else [i for i in range(n) if mask[i]]


@pytest.mark.parametrize(
    ("bs", "w", "a", "r", "eagle", "bounds", "expected"),
    [
        (8, 8, 32, None, False, (), [3, 7, 11, 15]),
        (8, 8, 32, None, True, (), [3, 4, 7, 8, 11, 12, 15]),
        (16, 32, 16, 0, False, (99,), [4, 5]),
        (16, 32, 16, 64, False, (99,), [2, 3, 4, 5, 6, 7, 10, 11, 14, 15]),
        (16, 32, 16, 64, True, (80, 96), [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14, 15]),
        (16, 32, 16, None, False, (), None),
    ],
)
def test_swa_reachable_block_mask(bs, w, a, r, eagle, bounds, expected) -> None:  # type: ignore[no-untyped-def]
    spec = G("swa", bs, w)
    mask = SlidingWindowManager.reachable_block_mask(0, 16, a, spec, eagle, r, bounds)
    if expected is None:
        assert mask is None or all(mask)
    else:
        assert _keep(mask, 16) == expected
        # positions are absolute: incremental calls equal one call
        parts = SlidingWindowManager.reachable_block_mask(0, 5, a, spec, eagle, r, bounds)
        rest = SlidingWindowManager.reachable_block_mask(5, 16, a, spec, eagle, r, bounds)
        assert parts is not None and rest is not None and parts + rest == mask


@pytest.mark.parametrize(
    ("bs", "a", "r", "bounds", "expected"),
    [
        (16, 16, 0, (99,), [5]),
        (16, 16, 64, (99,), [3, 5, 7, 11, 15]),
        (16, 16, 32, (), [1, 3, 5, 7, 9, 11, 13, 15]),
        (16, 16, 16, (99,), None),
        (64, 16, 256, (150,), [1, 3, 7, 11, 15]),
        (16, 16, None, (99,), None),
    ],
)
def test_mamba_reachable_block_mask(bs, a, r, bounds, expected) -> None:  # type: ignore[no-untyped-def]
    mask = MambaManager.reachable_block_mask(0, 16, a, G("mamba", bs), False, r, bounds)
    assert _keep(mask, 16) == expected


def test_replay_boundaries() -> None:
    assert replay_boundaries(100, 16, False) == (99,)
    assert replay_boundaries(100, 16, True) == (80,)
    assert replay_boundaries(96, 16, False) == (95,)
    assert replay_boundaries(96, 16, True) == (64, 80)


# ------------------------------------------------------------------ validation (notes §4.1)
NO_GROUP_MSG = (
    "prefix_cache_retention_interval is set but this model has no sliding-window or Mamba KV cache "
    "group, so retention has no effect. Set it to 0 (it only applies to sliding-window and Mamba attention)."
)


@pytest.mark.parametrize("r", [-32, 40])
def test_validation_rejects_bad_intervals_with_vllm_text(r: int) -> None:
    with pytest.raises(ValueError) as info:
        validate(AllocatorConfig(groups=FULL16_SWA16, num_blocks=8, retention_interval=r))
    assert str(info.value) == (
        f"prefix_cache_retention_interval ({r}) must be non-negative and a multiple of scheduler_block_size (16)."
    )


def test_validation_full_only_and_other_rules() -> None:
    validate(AllocatorConfig(groups=FULL16_SWA16, num_blocks=8, retention_interval=48))
    validate(AllocatorConfig(groups=(G("full", 16),), num_blocks=8, retention_interval=0))
    validate(AllocatorConfig(groups=(G("full", 16),), num_blocks=8, retention_interval=None))
    for r in (64, -16):
        with pytest.raises(ValueError) as info:
            validate(AllocatorConfig(groups=(G("full", 16),), num_blocks=8, retention_interval=r))
        assert str(info.value) == NO_GROUP_MSG
    bad = [
        (AllocatorConfig(groups=(), num_blocks=8), "groups"),
        (AllocatorConfig(groups=(G("swa", 16),), num_blocks=8), "sliding_window"),
        (AllocatorConfig(groups=(G("full", 16, 8),), num_blocks=8), "only 'swa'"),
        (AllocatorConfig(groups=(G("full", 16),), num_blocks=1), "num_blocks"),
        (AllocatorConfig(groups=(G("full", 16),), num_blocks=8, hash_block_size=5), "hash_block_size"),
        (
            AllocatorConfig(groups=(G("full", 16),), num_blocks=8, scheduler_block_size=24),
            "scheduler_block_size",
        ),
        (AllocatorConfig(groups=(G("mamba", 16, mamba_cache_mode="none"),), num_blocks=8), "align"),
    ]
    for cfg, needle in bad:
        with pytest.raises(ValueError, match=needle):
            validate(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(
            AllocatorConfig(groups=FULL16_SWA16, num_blocks=8, retention_interval=32, enable_caching=False)
        )
    assert any("ignored" in str(w.message) for w in caught)


# ------------------------------------------------------------------ scenarios (notes §5.5, §7)
def test_dense_free_queue_layout_after_free() -> None:
    s = make(FULL16_SWA16)
    req = run_to(s, "A", list(range(1, 101)), 120, 32)
    assert s.kv_cache_manager.get_block_ids("A") == ([1, 2, 5, 6, 9, 10, 13, 15], [0, 0, 0, 0, 0, 12, 14, 16])
    assert group_keys(s, req) == {0: list(range(7)), 1: list(range(7))}
    s.finish("A")
    assert free_queue(s) == [16, 15, *range(17, 64), 4, 3, 8, 7, 11, 13, 10, 9, 6, 5, 2, 1, 14, 12]
    p = s.probe(list(range(1, 101)))
    assert (p.hit, p.hit_blocks) == (96, ((1, 2, 5, 6, 9, 10), (0, 0, 0, 0, 11, 12)))
    assert s.probe(list(req.all_token_ids) + [9] * 20).hit == 112


def test_retention_zero_keeps_only_replay_tail() -> None:
    s = make(FULL16_SWA16, retention_interval=0)
    req = run_to(s, "A", list(range(1, 101)), 120, 32)
    assert s.kv_cache_manager.get_block_ids("A") == ([1, 2, 5, 6, 4, 3, 8, 11], [0, 0, 0, 0, 0, 10, 7, 12])
    assert group_keys(s, req)[1] == [4, 5]
    s.finish("A")
    assert free_queue(s) == [12, 7, 11, *range(13, 64), 9, 8, 3, 4, 6, 5, 2, 1, 10]
    assert s.probe(list(range(1, 101))).hit == 96
    d = s.probe(list(req.all_token_ids) + [9] * 20)
    assert (d.hit, d.shared_prefix_boundary) == (96, 112)


@pytest.mark.parametrize(("r", "swa_keys"), [(None, list(range(10))), (0, [6, 7]), (64, [2, 3, 6, 7])])
def test_unequal_block_sizes_and_partial_tail_key(r: int | None, swa_keys: list[int]) -> None:
    s = make(FULL32_SWA16, retention_interval=r)
    req = run_to(s, "A", list(range(1, 151)), 170, 64)
    keys = group_keys(s, req)
    assert keys[1] == swa_keys
    assert keys[0] == [1, 3, 5, 7, 8, 9]  # 8 = the 144-token prompt-tail secondary key
    blk = s.kv_cache_manager.get_blocks("A").blocks[0][4]
    assert blk.block_hash_num_tokens == 160
    s.finish("A")
    assert s.probe(list(range(1, 151))).hit == 128
    assert s.probe(list(range(1, 145))).hit == 128


@pytest.mark.parametrize("r", [None, 0, 64])
def test_eagle_hits_drop_one_block(r: int | None) -> None:
    s = make(FULL16_SWA16, retention_interval=r, use_eagle=True)
    req = run_to(s, "A", list(range(1, 101)), 120, 32)
    if r == 0:
        assert group_keys(s, req)[1] == [3, 4, 5]
    s.finish("A")
    assert s.probe(list(range(1, 101))).hit == 80
    assert s.probe(list(range(1, 101)) + [7] * 40).hit == 80


def test_unitary_full_only_eagle() -> None:
    s = make((G("full", 16),), use_eagle=True)
    run_to(s, "A", list(range(1, 101)), 120, 32)
    s.finish("A")
    assert s.probe(list(range(1, 101))).hit == 80


def test_swa_hit_rules_right_to_left() -> None:
    s = make(FULL16_SWA16, num_blocks=80)
    req = run_to(s, "A", list(range(1, 161)), 160, 160)
    s.finish("A")
    prompt = list(range(1, 161))
    assert s.probe(prompt).hit == 144
    pool = s.kv_cache_manager.block_pool

    def block_of(group: int, idx: int) -> int:
        blk = pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(req.block_hashes[idx], group)
        )
        assert blk is not None
        return blk.block_id

    s.evict_blocks([block_of(1, 3)])
    assert s.probe(prompt).hit == 144
    s.evict_blocks([block_of(1, 8)])
    assert s.probe(prompt).hit == 128
    s.evict_blocks([block_of(0, 5)])
    assert s.probe(prompt).hit == 48
    s2 = make((G("full", 16), G("swa", 16, 64)))
    run_to(s2, "A", list(range(1, 41)), 40, 40)
    s2.finish("A")
    assert s2.probe(list(range(1, 41))).hit == 32


def test_three_groups_fixed_point() -> None:
    s = make((G("full", 16), G("swa", 16, 32), G("swa", 16, 64)), num_blocks=80, retention_interval=0)
    req = run_to(s, "A", list(range(1, 101)), 100, 32)
    s.finish("A")
    assert group_keys(s, req) == {0: [0, 1, 2, 3, 4, 5], 1: [4, 5], 2: [2, 3, 4, 5]}
    p = s.probe(list(range(1, 101)))
    assert (p.hit, p.shared_prefix_boundary) == (96, 0)


def test_mamba_table_layout_and_stale_state_freeing() -> None:
    s = make((G("full", 16), G("mamba", 16)))
    s.add_request("A", list(range(1, 101)))
    tables = []
    for _ in range(4):
        s.schedule("A", 32)
        tables.append(s.kv_cache_manager.get_block_ids("A")[1])
    assert tables == [[0, 3], [0, 3, 0, 6], [0, 0, 0, 6, 0, 9], [0, 0, 0, 0, 0, 9, 11]]


@pytest.mark.parametrize(
    ("r", "eagle", "keys", "hit"),
    [(0, True, [4], 80), (0, False, [5], 96), (64, False, [3, 5], 96)],
)
def test_mamba_retention_with_scheduler_split(r: int, eagle: bool, keys: list[int], hit: int) -> None:
    s = make((G("full", 16), G("mamba", 16)), retention_interval=r, use_eagle=eagle)
    s.add_request("A", list(range(1, 101)))
    req = s.requests["A"]
    ends = []
    while req.num_computed_tokens < 100:
        s.schedule("A", 32)
        ends.append(req.num_computed_tokens)
    assert ends == ([32, 64, 80, 100] if eagle else [32, 64, 96, 100])
    assert group_keys(s, req)[1] == keys
    s.finish("A")
    assert s.probe(list(range(1, 101))).hit == hit


def test_mamba_same_step_guard() -> None:
    s = make((G("full", 16), G("mamba", 16)))
    kvm = s.kv_cache_manager
    a = run_to(s, "A", list(range(1, 65)), 64, 64)
    mamba = kvm.coordinator.single_type_managers[1]
    assert isinstance(mamba, MambaManager)
    b = Request("B", list(range(1, 65)) + [5] * 16, 16)
    blocks, hit, _ = kvm.get_computed_blocks(b)
    assert hit == 64
    key = blocks.blocks[1][-1].block_hash
    assert key is not None
    mamba.cached_blocks_this_step.add(key)  # as if A cached it this step
    assert kvm.allocate_slots(b, 32, hit, blocks) is None
    kvm.new_step_starts()
    assert kvm.allocate_slots(b, 32, hit, blocks) is not None
    assert a.num_computed_tokens == 64


@pytest.mark.parametrize("groups", [FULL16_SWA16, (G("full", 16), G("mamba", 16))])
def test_shared_prefix_junction_retained_under_r0(groups: tuple[KVCacheGroupConfig, ...]) -> None:
    s = make(groups, retention_interval=0)
    system = list(range(1, 71))
    run_to(s, "A", system + [500 + i for i in range(40)], 110, 32)
    s.finish("A")
    b = run_to(s, "B", system + [600 + i for i in range(40)], 110, 32)
    assert b.shared_prefix_boundary == 64
    s.finish("B")
    c = s.probe(system + [700 + i for i in range(40)])
    assert (c.hit, c.shared_prefix_boundary) == (64, 0)


def test_caching_disabled_never_hits_and_prepends() -> None:
    s = make(FULL16_SWA16, num_blocks=16, enable_caching=False)
    run_to(s, "A", list(range(1, 41)), 40, 40)
    s.finish("A")
    assert s.probe(list(range(1, 41))).hit == 0
    assert len(s.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0
    assert free_queue(s)[:6] == [6, 5, 4, 3, 2, 1]  # group 1's table first (notes 5.5)


def test_allocation_failure_and_preemption_readmission() -> None:
    s = make((G("full", 16),), num_blocks=9)
    run_to(s, "A", list(range(1, 101)), 100, 128)
    s.add_request("B", list(range(500, 540)))
    out = s.schedule("B", 64)
    assert not out.admitted and out.new_blocks is None
    s.preempt("A")
    assert s.requests["A"].num_computed_tokens == 0
    assert s.schedule("B", 64).admitted
    s.finish("B")
    out = s.schedule("A", 128)  # B took A's uncached tail block and A's last cached block (freed first)
    assert out.admitted and out.hit == 80


# ------------------------------------------------------------------ events (seed profile)
def test_events_name_exactly_the_stored_blocks() -> None:
    s = make(FULL16_SWA16, retention_interval=0)
    req = run_to(s, "A", list(range(1, 101)), 100, 32)
    events = s.kv_cache_manager.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert all(e.block_hashes for e in stored)
    for e in stored:
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        for j, h in enumerate(e.block_hashes):
            idx = req.block_hashes.index(h)
            assert (
                tuple(req.all_token_ids[(idx + 1) * 16 - e.block_size : (idx + 1) * 16])
                == e.token_ids[j * e.block_size : (j + 1) * e.block_size]
            )
    swa = [h for e in stored if e.group_idx == 1 for h in e.block_hashes]
    assert [req.block_hashes.index(h) for h in swa] == [4, 5]
    assert s.reset_prefix_cache() is False
    s.finish("A")
    assert s.reset_prefix_cache() is True
    assert type(s.kv_cache_manager.take_events()[-1]).__name__ == "AllBlocksCleared"
