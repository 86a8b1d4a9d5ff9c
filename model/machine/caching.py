"""Which of a request's blocks are cached, and under which keys.

Caching is what `KVCacheManager.cache_blocks` does after an allocation (and,
with drafts or async scheduling, when an output arrives): every group keys its
full blocks up to the tokens it may cache, skipping the blocks the release's
retention masks drop (`model.contract.masks`: a block no replay boundary of the
request reaches is not worth keeping), and keys the partial tails vLLM keys
inside a block (`model.contract.partial_tails`: Full attention with bs != hbs at the
prompt's last hash boundary, Mamba at its checkpoint). A hybrid model caches
only up to a scheduler-block boundary, floored per group
(`Rules.cacheable`); fine-grained Mamba hits lift that floor.

`BlockCaching` is one part of `AllocatorModel` (which inherits it): it reads
the model's configuration, rules, pool and groups, and writes only the
groups' caching state (`num_cached`, `partial`, `cached_this_step`) and the
pool's keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.contract.config import Config
from model.contract.eagle import hashed_tokens
from model.contract.masks import cdiv
from model.contract.observation import BlockKey
from model.contract.profile import Rules
from model.machine.async_scheduling import arrival_limit
from model.machine.pool import Pool

if TYPE_CHECKING:
    from model.machine.seams import Observer
    from model.machine.state import GroupState, RequestState


class BlockCaching:
    """The caching step of the allocator model (see the module docstring)."""

    cfg: Config
    rules: Rules
    pool: Pool
    groups: list[GroupState]
    hybrid: bool
    fine: bool
    alignment: int
    observer: Observer

    def _cacheable_tokens(self, g: GroupState, n: int) -> int:
        if not self.hybrid or self.fine:
            # Fine-grained hits may end at any hash boundary: nothing to floor.
            return n
        return self.rules.cacheable(
            n, self.cfg.scheduler_block_size, g.bs, self.cfg.eagle_drop
        )  # model.contract.masks

    def _hashed_known(self, req: RequestState, unknown: int) -> int | None:
        """The tokens the scheduler's request has hashed over at an allocation: under lookahead
        hashes its known ones (the lookahead past a block must be known too); else None, all
        (`caching_limit` already stops at the known tokens, a block's own)."""
        return req.num_tokens - unknown if self.cfg.hash_lookahead else None

    def _token_arrives(self, req: RequestState, scheduled_since: int) -> None:
        """Async scheduling: a running request's sampled token reaches the scheduler, and the
        blocks the processed steps computed are cached (`update_from_output`'s `cache_blocks`)."""
        if req.running and self.cfg.enable_caching:
            before = sum(g.num_cached.get(req.rid, 0) for g in self.groups)
            self.cache_blocks(req, arrival_limit(req.num_computed, scheduled_since))
            if sum(g.num_cached.get(req.rid, 0) for g in self.groups) > before:
                self.observer.fired("async: a sampled token's arrival cached blocks")

    def cache_blocks(self, req: RequestState, num_tokens: int, known: int | None = None) -> None:
        """Key `req`'s blocks up to `num_tokens`, and only those it has hashed: a block once its
        tokens (and under lookahead hashes the lookahead past it) are among the `known` ones
        (the tokens the scheduler holds; all of them unless some are in flight)."""
        cfg = self.cfg
        boundaries = list(
            self.rules.replay_boundaries(len(req.prompt), cfg.scheduler_block_size, cfg.eagle_drop)
        )
        tokens = req.tokens
        hashed = (
            hashed_tokens(req.num_tokens if known is None else known, cfg.hash_lookahead)
            // cfg.hash_block_size
            * cfg.hash_block_size
        )
        for g in self.groups:
            n = self._cacheable_tokens(g, num_tokens)
            before = g.num_cached.get(req.rid, 0)
            num_full = min(n, hashed) // g.bs
            if before < num_full:
                reach = list(boundaries)
                if req.shared_prefix_boundary:
                    reach += self.rules.junction_reach(req.shared_prefix_boundary, g.bs, cfg.eagle_drop)
                kept = self._kept(g, before, num_full, reach)
                self.pool.cache_full_blocks(tokens, g.table(req.rid), before, num_full, g.bs, g.gid, kept)
                g.num_cached[req.rid] = num_full
            if g.spec.kind == "full" and g.bs != cfg.hash_block_size:
                self._cache_full_partial_tail(g, req, n)
            if g.spec.kind == "mamba":
                key = self._cache_mamba_partial_tail(g, req, n)
                if key is not None:
                    g.cached_this_step.add(key)
                table = g.table(req.rid)
                for i in range(before, g.num_cached.get(req.rid, 0)):
                    if table[i] and table[i] in self.pool.primary:
                        g.cached_this_step.add(self.pool.primary[table[i]])

    def _kept(self, g: GroupState, start: int, end: int, boundaries: list[int]) -> set[int] | None:
        """The blocks in [start, end) the group caches (None: all), by the release's masks (`model.contract.masks`)."""
        r = self.cfg.retention_interval
        alignment = self.rules.mask_grid.alignment(self.alignment, self.cfg.scheduler_block_size)
        if g.spec.kind == "swa":
            assert g.spec.sliding_window is not None
            return self.rules.swa_mask(
                start,
                end,
                block_size=g.bs,
                window=g.spec.sliding_window,
                alignment=alignment,
                eagle=self.cfg.eagle_drop,
                retention=r,
                boundaries=boundaries,
            )
        if g.spec.kind == "mamba":
            return self.rules.mamba_mask(
                start, end, block_size=g.bs, alignment=alignment, retention=r, boundaries=boundaries
            )
        return None

    def _cache_full_partial_tail(self, g: GroupState, req: RequestState, num_tokens: int) -> None:
        """Full attention with bs != hbs keys the prompt's last hash boundary inside its block
        (`model.contract.partial_tails`)."""
        boundary = self.rules.full_tail(
            len(req.prompt), req.num_tokens, self.cfg.hash_block_size, self.cfg.eagle_drop
        )
        if boundary == 0 or boundary > num_tokens or boundary % g.bs == 0:
            return
        table = g.table(req.rid)
        if boundary // g.bs < len(table):
            self.pool.cache_partial_block(req.tokens, table[boundary // g.bs], boundary, g.gid)

    def _cache_mamba_partial_tail(self, g: GroupState, req: RequestState, num_tokens: int) -> BlockKey | None:
        """Key the state at the prompt's reusable checkpoint (vLLM `_cache_partial_tail_block`)."""
        hbs = self.cfg.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        checkpoint = self.rules.checkpoint(num_tokens, len(req.prompt), hbs, g.bs, self.cfg.eagle_drop)
        if num_tokens != checkpoint:  # model.contract.partial_tails
            return None
        idx = cdiv(num_tokens, g.bs) - 1
        table = g.table(req.rid)
        if idx >= len(table) or table[idx] == 0:
            return None
        block = table[idx]
        if self.pool.primary_tokens.get(block) == num_tokens:
            return None
        key = self.pool.cache_partial_block(req.tokens, block, num_tokens, g.gid)
        if key is not None and num_tokens % g.bs:
            # Keyed mid-block: the next allocation moves the key to a copy (producer).
            g.partial[req.rid] = (idx, block)
            g.num_cached[req.rid] = idx
        return key
