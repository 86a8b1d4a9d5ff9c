"""Per-kind KV-cache managers: block tables, hit rules, masks and window slides.

One manager per KV-cache group. Contracts shared by all kinds:
- `req_to_blocks[rid]` is the request's block table, position-indexed (block
  i covers tokens [i*bs, (i+1)*bs)); positions the kind no longer needs hold
  the null block;
- `num_cached_block[rid]` = how many leading table entries went through
  caching; a masked or null entry is never revisited. Membership marks a
  request the manager has seen (running), as in vLLM;
- `find_longest_cache_hit` is pure, returns one block list per group id and a
  hit length that is a multiple of the alignment it is given; lists are
  null-padded on the left where the kind does not need the prefix;
- `reachable_block_mask` says which of blocks [start, end) can ever serve a
  hit at a retained boundary: None = all (dense).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

from .block import KVCacheBlock
from .block_pool import BlockPool
from .config import KVCacheGroupConfig
from .hashing import BlockHash, BlockHashWithGroupId
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def coarse_block_hashes(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """The group-block view of fine hashes: block j -> hash at its last hbs boundary."""
    scale = block_size // hash_block_size
    return block_hashes if scale == 1 else block_hashes[scale - 1 :: scale]


def trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    i = 0
    while i < len(blocks) and blocks[i].is_null:
        i += 1
    return blocks[i:]


class SingleTypeKVCacheManager:
    """Base manager: contiguous tables, every full block cacheable (dense)."""

    kind: ClassVar[str] = ""

    def __init__(
        self,
        spec: KVCacheGroupConfig,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        pin_swa_on_drop: bool = False,
        pin_min_drop_blocks: int = 1,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        # Hybrid coordinators overwrite this with their hit alignment.
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.use_eagle = False
        self.pin_swa_on_drop = pin_swa_on_drop
        self.pin_min_drop_blocks = pin_min_drop_blocks
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self._init_kind_state()

    def _init_kind_state(self) -> None:
        """Kind-specific state; subclasses extend."""

    # ------------------------------------------------------------- allocation
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Blocks this step takes from the free queue: new ones plus free hit blocks."""
        num_required = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            assert not new_computed_blocks
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_req_blocks
        num_new = max(num_required - max(num_skipped_blocks, num_local_blocks), 0)
        # Hits that fall out of the window are dropped, never touched.
        kept_hits = new_computed_blocks[max(0, num_skipped_blocks - num_req_blocks) :]
        return num_new + sum(1 for b in kept_hits if b.ref_cnt == 0 and not b.is_null)

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> None:
        """Adopt hit blocks: touched (ref +1), skipped prefix padded with nulls."""
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        num_skipped = self.get_num_skipped_tokens(num_local_computed_tokens) // self.block_size
        hits = list(new_computed_blocks[num_skipped:]) if num_skipped > 0 else list(new_computed_blocks)
        if self.enable_caching:
            self.block_pool.touch(hits)
        else:
            assert not hits, "no hits without prefix caching"
        req_blocks.extend([self._null_block] * num_skipped)
        req_blocks.extend(hits)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Grow the table to cover `num_tokens`; return exactly the blocks added."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    # ---------------------------------------------------------------- caching
    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Key the request's full blocks up to `num_tokens` that the mask keeps."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        boundaries = list(replay_boundaries)
        if request.shared_prefix_boundary:
            boundaries.append(request.shared_prefix_boundary)
            if self.use_eagle:
                boundaries.append(request.shared_prefix_boundary - self.block_size)
        mask = self.reachable_block_mask(
            num_cached,
            num_full,
            self.cache_hit_alignment_tokens,
            self.spec,
            self.use_eagle,
            retention_interval,
            boundaries,
        )
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[rid],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            mask,
        )
        self.num_cached_block[rid] = num_full

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        spec: KVCacheGroupConfig,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
    ) -> list[bool] | None:
        return None

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: KVCacheGroupConfig,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError

    # ---------------------------------------------------------------- freeing
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its table in allocation order, leading nulls trimmed."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return trim_null_head(blocks)

    def free(self, request_id: str) -> None:
        # Reversed: the tail of a request is the least likely to be shared, so it goes first.
        self.block_pool.free_blocks(list(reversed(self.pop_blocks_for_free(request_id))))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens whose KV this kind will never read again."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free and null the table prefix outside what the kind still reads."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        self._remove_blocks_in_range(request_id, 0, min(num_skipped_tokens // self.block_size, len(blocks)))

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        # Walk backwards and stop at the first null: everything before it was freed earlier.
        if request_id not in self.req_to_blocks or first_block >= last_block:
            return
        blocks = self.req_to_blocks[request_id]
        last_block = min(last_block, len(blocks))
        freed: list[KVCacheBlock] = []
        for i in range(last_block - 1, first_block - 1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self._on_blocks_dropped(freed)
            self.block_pool.free_blocks(freed)

    def _on_blocks_dropped(self, dropped: list[KVCacheBlock]) -> None:
        """Hook before a window slide frees `dropped` (descending index order)."""

    def new_step_starts(self) -> None:
        """A scheduler step begins."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: needs every block; hits grow left to right."""

    kind = "full"

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: KVCacheGroupConfig,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        bs = spec.block_size
        hashes = coarse_block_hashes(block_hashes, block_pool.hash_block_size, bs)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for j in range(min(max(max_length, 0) // bs, len(hashes))):
            cached = block_pool.get_cached_block(hashes[j], kv_cache_group_ids)
            if cached is None:
                break  # chained hashes: nothing after a miss can hit
            for lst, blk in zip(computed, cached, strict=True):
                lst.append(blk)
        hit = len(computed[0]) * bs
        if drop_eagle_block and hit > 0:
            hit -= min(alignment_tokens, bs)
        hit -= hit % alignment_tokens
        n = cdiv(hit, bs)
        for lst in computed:
            del lst[n:]
        return computed, hit

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        # vLLM registers the prompt tail's hbs boundary inside its block even when
        # fine-grained lookups are off (notes 3.2); mirrored for hash-map equality.
        hbs = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(
            request, blocks[idx], boundary, self.kv_cache_group_id, self.block_size
        )


class SlidingWindowManager(SingleTypeKVCacheManager):
    """SWA: a hit needs the `need` contiguous blocks before its end; older blocks are dropped."""

    kind = "swa"

    def _init_kind_state(self) -> None:
        assert self.spec.sliding_window is not None
        self.sliding_window: int = self.spec.sliding_window

    @staticmethod
    def contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        """`need`: blocks that hold the window before a boundary (+1 Eagle peek block)."""
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: KVCacheGroupConfig,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        assert spec.sliding_window is not None
        bs = spec.block_size
        hashes = coarse_block_hashes(block_hashes, block_pool.hash_block_size, bs)
        need = cls.contiguous_blocks_for_hit(spec.sliding_window, bs, drop_eagle_block)
        max_blocks = min(max(max_length, 0) // bs, len(hashes))
        null = block_pool.null_block
        computed: tuple[list[KVCacheBlock], ...] = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and bs != alignment_tokens:
                # The run's right edge (after an Eagle drop) must be a hit boundary.
                edge = i if drop_eagle_block else i + 1
                if (edge * bs) % alignment_tokens:
                    continue
            for lst, blk in zip(computed, cached, strict=True):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run :]
                found = True
                break
        if not found:
            # Only a run reaching block 0 serves (the prompt is shorter than the window).
            for lst in computed:
                del lst[run:]
            cls._pop_to_alignment(computed, bs, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for lst in computed:
                lst.pop()
            cls._pop_to_alignment(computed, bs, alignment_tokens)
        return computed, len(computed[0]) * bs

    @staticmethod
    def _pop_to_alignment(computed: tuple[list[KVCacheBlock], ...], bs: int, alignment_tokens: int) -> None:
        while bs != alignment_tokens and (len(computed[0]) * bs) % alignment_tokens:
            for lst in computed:
                lst.pop()

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        spec: KVCacheGroupConfig,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
    ) -> list[bool] | None:
        """Keep the `need` blocks before every boundary a hit can end at.

        Dense (None): every A-aligned boundary; 0: only `reachable_boundaries`;
        k: every k-token segment end plus `reachable_boundaries`. With Eagle the
        kept run shifts one block right (the peek block after the boundary).
        """
        assert spec.sliding_window is not None
        if alignment_tokens is None:
            return None
        bs = spec.block_size
        if alignment_tokens % bs:
            return None
        need = cls.contiguous_blocks_for_hit(spec.sliding_window, bs, use_eagle)
        shift = 1 if use_eagle else 0
        mask = [False] * (end_block - start_block)
        segment = alignment_tokens if retention_interval is None else (retention_interval or None)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = (boundary // alignment_tokens * alignment_tokens) // bs + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def _on_blocks_dropped(self, dropped: list[KVCacheBlock]) -> None:
        # PR #40676: pin the most recent window's worth of hashed blocks a slide drops,
        # so the anchor a future hit needs is reused last.
        if not self.pin_swa_on_drop or len(dropped) < self.pin_min_drop_blocks:
            return
        for block in self._select_blocks_to_pin(dropped):
            block.is_pinned = True

    def _select_blocks_to_pin(self, dropped: list[KVCacheBlock]) -> list[KVCacheBlock]:
        need = self.contiguous_blocks_for_hit(self.sliding_window, self.block_size, self.use_eagle)
        # The `need` most recent dropped blocks (highest index first); unkeyed ones are not pinned.
        return [b for b in dropped[:need] if b.block_hash is not None]


class MambaManager(SingleTypeKVCacheManager):
    """Mamba (align mode): one state block per chunk end; a hit is a single state.

    Table layout: position-indexed, null except at the latest state(s); the
    state a step reads from is freed by the next window slide once stale
    (`last_state_block_idx`). A state cached in the current step cannot serve a
    hit before the next step (same-step guard).
    """

    kind = "mamba"

    def _init_kind_state(self) -> None:
        self.mamba_cache_mode = self.spec.mamba_cache_mode
        assert self.mamba_cache_mode == "align" or not self.enable_caching
        self.drop_eagle_checkpoint_block = False
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: KVCacheGroupConfig,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        # Eagle never drops a Mamba block: draft models have no Mamba layers.
        bs = spec.block_size
        hashes = coarse_block_hashes(block_hashes, block_pool.hash_block_size, bs)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for i in range(min(max(max_length, 0) // bs, len(hashes)) - 1, -1, -1):
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if bs != alignment_tokens and ((i + 1) * bs) % alignment_tokens:
                continue
            for lst, blk in zip(computed, cached, strict=True):
                lst.extend([block_pool.null_block] * i)
                lst.append(blk)
            return computed, (i + 1) * bs
        return computed, 0

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        spec: KVCacheGroupConfig,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
    ) -> list[bool] | None:
        """Keep one state per retention segment and the state at each reachable boundary."""
        if retention_interval is None or alignment_tokens is None:
            return None
        bs = spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval > 0:
            per_segment = retention_interval // bs
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        for boundary in reachable_boundaries:
            k = (boundary // alignment_tokens * alignment_tokens) // bs - 1
            if start_block <= k < end_block:
                mask[k - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # A state cached this step is not written yet: refuse until the next step.
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
            )
        num_required = cdiv(num_tokens_main_model, self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        if num_new > 0:
            num_new = 1  # one physical state block per step, whatever the padding
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Append null padding and one state block at the chunk end's position."""
        if not self._align:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        req_blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens_main_model, self.block_size)
        if num_required <= len(req_blocks):
            self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(req_blocks)
        if prev_len > 0:
            # The running state (or, after a hit, the hit state) is read this step.
            self.last_state_block_idx[request_id] = prev_len - 1
        if prev_len < num_required - 1:
            req_blocks.extend([self._null_block] * (num_required - 1 - prev_len))
        new_blocks = self.block_pool.get_new_blocks(max(num_required - len(req_blocks), 0))
        returned = req_blocks[prev_len:] + new_blocks
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        return returned

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if not self._align:
            return
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(num_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if not blocks[idx].is_null:
                self.block_pool.free_blocks([blocks[idx]])
                blocks[idx] = self._null_block

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        if not self._align:
            super()._remove_blocks_in_range(request_id, first_block, last_block)
            return
        # Interior nulls are expected (states only at chunk ends): skip, don't stop.
        blocks = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if first_block >= last_block:
            return
        freed: list[KVCacheBlock] = []
        for i in range(last_block - 1, first_block - 1, -1):
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)
        self._num_retired_blocks[request_id] = last_block

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        after = self.num_cached_block.get(rid, 0)
        if self._align:
            key = self._cache_partial_tail_block(request, num_tokens)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        if after > before:
            blocks = self.req_to_blocks[rid]
            for idx in range(before, after):
                block = blocks[idx]
                if not block.is_null and block.block_hash is not None:
                    self.cached_blocks_this_step.add(block.block_hash)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> BlockHashWithGroupId | None:
        # The prompt's latest checkpoint boundary keeps its state even when the mask
        # (aligned to sbs) skipped it; vLLM does this at hash granularity.
        hbs = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        if num_tokens != mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hbs, self.drop_eagle_checkpoint_block
        ):
            return None
        blocks = self.req_to_blocks[request.request_id]
        idx = cdiv(num_tokens, self.block_size) - 1
        if idx >= len(blocks) or blocks[idx].is_null or blocks[idx].block_hash_num_tokens == num_tokens:
            return None
        # Generated configs keep Mamba block size == hbs, so this is never mid-block
        # (a mid-block tail would need vLLM's copy-on-write, which is not modelled).
        assert num_tokens % self.block_size == 0, "mid-block Mamba checkpoints are not supported"
        return self.block_pool.cache_partial_block(
            request, blocks[idx], num_tokens, self.kv_cache_group_id, self.block_size
        )

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


def mamba_prefill_checkpoint_position(num_tokens: int, block_size: int, drop_eagle_block: bool) -> int:
    """Latest reusable Mamba checkpoint of a `num_tokens` prefill (last token recomputed;
    with Eagle, one more block is recomputed instead)."""
    if drop_eagle_block:
        return max(num_tokens // block_size * block_size - block_size, 0)
    return max((num_tokens - 1) // block_size * block_size, 0)


DEFAULT_MANAGER_CLASSES: dict[str, type[SingleTypeKVCacheManager]] = {
    "full": FullAttentionManager,
    "swa": SlidingWindowManager,
    "mamba": MambaManager,
}
