"""The model reproduces vLLM 0.33.0's verified behaviour (../shared/vllm_notes.md)."""

import pytest

from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.free_queue import FreeQueue, demote_n
from model.contract.lookup import full_hit, mamba_hit, swa_hit
from model.contract.masks import mamba_kept_blocks, replay_boundaries, swa_kept_blocks
from model.contract.ops import AddRequest, Finish, Probe, Sample, Schedule
from model.machine.allocator import AllocatorModel
from model.policy.scheduling import mamba_chunk


def test_free_queue_sequence_matches_vllm():
    q = FreeQueue(range(8))
    assert q.popleft() == 0
    assert q.popleft_n(3) == [1, 2, 3]
    q.remove(6)
    assert q.blocks == [4, 5, 7]
    q.append_n([6])
    q.prepend_n([3, 1])
    assert q.blocks == [3, 1, 4, 5, 7, 6]
    q.append_n([0, 2])
    assert q.blocks == [3, 1, 4, 5, 7, 6, 0, 2]
    with pytest.raises(AssertionError):
        q.append_n([4])


def test_demote_takes_oldest_pinned_first():
    pinned, regular = FreeQueue([5, 6, 7]), FreeQueue([1])
    assert demote_n(pinned, regular, 2) == [5, 6]
    assert regular.blocks == [1, 5, 6] and pinned.blocks == [7]


@pytest.mark.parametrize(
    "kw, kept",
    [
        (dict(block_size=8, window=8, alignment=32, eagle=False, retention=None), {3, 7, 11, 15}),
        (dict(block_size=8, window=8, alignment=32, eagle=True, retention=None), {3, 4, 7, 8, 11, 12, 15}),
        (dict(block_size=16, window=32, alignment=16, eagle=False, retention=0, boundaries=[99]), {4, 5}),
        (
            dict(block_size=16, window=32, alignment=16, eagle=False, retention=64, boundaries=[99]),
            {2, 3, 4, 5, 6, 7, 10, 11, 14, 15},
        ),
        (
            dict(block_size=16, window=32, alignment=16, eagle=True, retention=64, boundaries=[80, 96]),
            {2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14, 15},
        ),
    ],
)
def test_swa_masks_match_vllm(kw, kept):
    assert swa_kept_blocks(0, 16, **kw) == kept


def test_swa_mask_is_the_union_of_the_retained_tails():
    """The mask (built tail by tail, O(edges x need)) keeps exactly the blocks of
    [start, end) lying in some edge's tail, as the definition reads, on random inputs."""
    import random

    from model.contract.masks import boundary_edge, swa_tail_blocks

    rng = random.Random(3)
    for _ in range(400):
        bs = rng.choice((4, 16))
        kw = dict(
            block_size=bs,
            window=rng.randint(2, 5 * bs),
            alignment=bs * rng.choice((1, 2)),
            eagle=rng.random() < 0.5,
            retention=rng.choice((None, 0, bs * rng.randint(1, 6))),
            boundaries=[rng.randint(0, 40 * bs) for _ in range(rng.randint(0, 3))],
        )
        start = rng.randint(0, 200)
        end = start + rng.randint(0, 30)
        got = swa_kept_blocks(start, end, **kw)  # type: ignore[arg-type]
        need = swa_tail_blocks(kw["window"], bs, kw["eagle"])  # type: ignore[arg-type]
        shift, retention, align = int(bool(kw["eagle"])), kw["retention"], kw["alignment"]
        segment = align if retention is None else (retention or None)
        if segment is not None and need >= segment // bs:  # type: ignore[operator]
            assert got is None
            continue
        edges = set()
        if segment is not None:
            per = segment // bs  # type: ignore[operator]
            edges |= {k * per + shift for k in range(1, (end + need) // per + 2)}
        if retention is not None:
            edges |= {boundary_edge(b, align, bs) + shift for b in kw["boundaries"]}  # type: ignore[arg-type, attr-defined]
        assert got == {i for i in range(start, end) if any(e - need <= i < e for e in edges)}
    # Pinned: window 9 over 4-token blocks needs 2 blocks below the edge of boundary 30 (block 7).
    kept = swa_kept_blocks(
        0, 16, block_size=4, window=9, alignment=4, eagle=False, retention=0, boundaries=[30]
    )
    assert kept == {5, 6}


@pytest.mark.parametrize(
    "kw, kept",
    [
        (dict(block_size=16, alignment=16, retention=0, boundaries=[99]), {5}),
        (dict(block_size=16, alignment=16, retention=64, boundaries=[99]), {3, 5, 7, 11, 15}),
        (dict(block_size=16, alignment=16, retention=32, boundaries=[]), {1, 3, 5, 7, 9, 11, 13, 15}),
        (dict(block_size=16, alignment=16, retention=16, boundaries=[]), None),
        (dict(block_size=16, alignment=16, retention=None, boundaries=[99]), None),
    ],
)
def test_mamba_masks_match_vllm(kw, kept):
    assert mamba_kept_blocks(0, 16, **kw) == kept


def test_replay_boundaries():
    assert replay_boundaries(100, 16, False) == (99,)
    assert replay_boundaries(100, 16, True) == (80,)
    assert replay_boundaries(96, 16, True) == (64, 80)


def test_hit_rules_match_vllm_examples():
    cached = set(range(10))
    # w=32, bs=16 (need 2): resend of 150 tokens hits 144; a gap below the tail does not matter
    assert len(swa_hit(lambda j: j in cached, 149, 16, 16, 2, False)) * 16 == 144
    assert len(swa_hit(lambda j: j in cached - {3}, 149, 16, 16, 2, False)) * 16 == 144
    assert len(swa_hit(lambda j: j in cached - {8}, 149, 16, 16, 2, False)) * 16 == 128
    # window 64, prompt 40: the run from block 0 is shorter than need but counts
    assert len(swa_hit(lambda j: True, 40, 16, 16, 4, False)) * 16 == 32
    assert len(full_hit(lambda j: j < 5, 149, 16, 16, False)) == 5
    assert len(full_hit(lambda j: j < 5, 149, 16, 16, True)) == 4
    assert mamba_hit(lambda j: j == 3, 99, 16, 16) == [None, None, None, 3]
    assert mamba_hit(lambda j: j == 2, 99, 16, 32) == []


def test_mamba_chunk_split_stops_at_checkpoint_and_junction():
    kw = dict(
        budget=32, num_prompt_tokens=100, num_tokens=100, shared_prefix_boundary=0, block_size=16, eagle=False
    )
    assert mamba_chunk(start=64, num_new=32, **kw) == 32
    assert mamba_chunk(start=96, num_new=4, **kw) == 4
    assert mamba_chunk(start=0, num_new=100, **{**kw, "budget": 128}) == 96
    assert mamba_chunk(start=0, num_new=64, **{**kw, "shared_prefix_boundary": 40}) == 32
    assert mamba_chunk(start=64, num_new=32, **{**kw, "eagle": True}) == 16


def _run(cfg, prompt, total, chunk):
    m = AllocatorModel(cfg)
    m.apply(AddRequest("A", tuple(prompt)))
    tok = 50000
    while True:
        r = m.requests["A"]
        assert m.apply(Schedule("A", chunk)).scheduled
        if r.num_computed == r.num_tokens:
            tok += 1
            m.apply(Sample("A", tok))
        if r.num_computed >= total:
            return m


FULL_SWA = (GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=32))


@pytest.mark.parametrize(
    "retention, tables, swa_keys, queue_tail",
    [
        (
            None,
            ((1, 2, 5, 6, 9, 10, 13, 15), (0, 0, 0, 0, 0, 12, 14, 16)),
            [0, 1, 2, 3, 4, 5, 6],
            (4, 3, 8, 7, 11, 13, 10, 9, 6, 5, 2, 1, 14, 12),
        ),
        (0, ((1, 2, 5, 6, 4, 3, 8, 11), (0, 0, 0, 0, 0, 10, 7, 12)), [4, 5], (9, 8, 3, 4, 6, 5, 2, 1, 10)),
        (
            64,
            ((1, 2, 5, 6, 4, 3, 11, 13), (0, 0, 0, 0, 0, 10, 12, 14)),
            [2, 3, 4, 5, 6],
            (8, 7, 9, 11, 3, 4, 6, 5, 2, 1, 12, 10),
        ),
    ],
)
def test_full_swa_scenario_matches_vllm(retention, tables, swa_keys, queue_tail):
    """02_hybrid_full_swa.py: prompt 100, chunks of 32, decode to 120, free."""
    m = _run(Config(groups=FULL_SWA, num_blocks=64, retention_interval=retention), range(1, 101), 120, 32)
    snap = m.snapshot()
    assert snap.tables["A"] == tables
    assert sorted(len(k.tokens) // 16 - 1 for k in snap.cached if k.group == 1) == swa_keys
    m.apply(Finish("A"))
    assert m.snapshot().free_queue[-len(queue_tail) :] == queue_tail
    assert m.apply(Probe(tuple(range(1, 101)))).hit == 96
    assert m.apply(Probe(tuple(range(1, 101)) + (7,) * 40)).hit == 96


@pytest.mark.parametrize("retention, swa_keys", [(None, list(range(10))), (0, [6, 7]), (64, [2, 3, 6, 7])])
def test_unequal_block_sizes_and_partial_tail_key(retention, swa_keys):
    groups = (GroupSpec("full", 32), GroupSpec("swa", 16, sliding_window=32))
    m = _run(Config(groups=groups, num_blocks=64, retention_interval=retention), range(1, 151), 170, 64)
    snap = m.snapshot()
    assert sorted(len(k.tokens) // 16 - 1 for k in snap.cached if k.group == 1) == swa_keys
    # the full group also keys block 4 by the 144-token prompt tail (a secondary key)
    assert sorted(len(k.tokens) for k in snap.cached if k.group == 0) == [32, 64, 96, 128, 144, 160]
    m.apply(Finish("A"))
    assert m.apply(Probe(tuple(range(1, 151)))).hit == 128


def test_validation_texts():
    with pytest.raises(
        ConfigError, match=r"\(-32\) must be non-negative and a multiple of scheduler_block_size \(16\)"
    ):
        validate(Config(groups=FULL_SWA, num_blocks=8, retention_interval=-32))
    with pytest.raises(ConfigError, match=r"\(40\) must be non-negative"):
        validate(Config(groups=FULL_SWA, num_blocks=8, retention_interval=40))
    validate(Config(groups=FULL_SWA, num_blocks=8, retention_interval=48))
    validate(Config(groups=(GroupSpec("full", 16),), num_blocks=8, retention_interval=0))
    with pytest.raises(ConfigError, match="no sliding-window or Mamba KV cache group"):
        validate(Config(groups=(GroupSpec("full", 16),), num_blocks=8, retention_interval=64))
    with pytest.raises(ConfigError, match="sliding_window"):
        validate(Config(groups=(GroupSpec("swa", 16),), num_blocks=8))
    with pytest.raises(ConfigError, match="num_blocks"):
        validate(Config(groups=(GroupSpec("full", 16),), num_blocks=1))
    with pytest.warns(UserWarning, match="ignored because prefix caching is disabled"):
        validate(Config(groups=FULL_SWA, num_blocks=8, retention_interval=32, enable_caching=False))
