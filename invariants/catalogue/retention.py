"""Mask and hit invariants: what is cached is needed, what is hit is cached."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import chain

from invariants.catalogue.context import CheckContext, RequestHistory
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled, is_fine_lookup
from model.contract.masks import cdiv, mamba_kept_blocks, replay_boundaries, swa_kept_blocks
from model.contract.observation import BlockKey, ProbeResult, ScheduleResult, StepResult, Tokens, block_key
from model.contract.ops import Probe, Schedule, Step
from model.contract.prefix import block_name
from model.policy.scheduling import mamba_checkpoint_position


def _kept_by_request(ctx: CheckContext, key: BlockKey, req: RequestHistory) -> bool:
    cfg = ctx.config
    spec = cfg.groups[key.group]
    bs, n, lookahead = spec.block_size, len(key.tokens), cfg.hash_lookahead
    tokens = req.tokens
    if (
        len(tokens) < n + lookahead
        or tokens[n - 1] != key.tokens.last
        or block_name(tokens, n, lookahead) is not key.tokens
    ):
        return False
    if spec.kind == "mamba" and n == mamba_checkpoint_position(
        len(req.prompt), cfg.hash_block_size, cfg.eagle_drop
    ):
        return True  # the prompt's checkpoint state (vLLM `_cache_partial_tail_block`)
    if n % bs:
        return False
    j = n // bs - 1
    boundaries = list(replay_boundaries(len(req.prompt), cfg.scheduler_block_size, cfg.eagle_drop))
    for spb in req.boundaries:
        boundaries.append(spb)
        if cfg.eagle_drop:
            boundaries.append(spb - bs)
    align = cfg.scheduler_block_size if len(cfg.groups) > 1 else bs
    if fine_hits_enabled(cfg):
        align = cfg.hash_block_size  # every group's hits align to the hash block
    if spec.kind == "swa":
        assert spec.sliding_window is not None
        kept = swa_kept_blocks(
            j,
            j + 1,
            block_size=bs,
            window=spec.sliding_window,
            alignment=align,
            eagle=cfg.eagle_drop,
            retention=cfg.retention_interval,
            boundaries=boundaries,
        )
    else:
        kept = mamba_kept_blocks(
            j, j + 1, block_size=bs, alignment=align, retention=cfg.retention_interval, boundaries=boundaries
        )
    return kept is None or j in kept


def no_waste(ctx: CheckContext) -> list[str]:
    """Every newly cached SWA / Mamba block lies in the tail (SWA) or is the
    state (Mamba) that some retained boundary of a request needs (#42258,
    #45845): a block no lookup can use is never cached."""
    out: list[str] = []
    d = ctx.delta
    if d is not None:
        new = {k for k, v in d.holders.items() if v and not d.before_holders.get(k)}
    else:
        new = set(ctx.after.cached) - set(ctx.before.cached)
    if not new:
        return out
    # The requests this operation scheduled are asked first: a key is new because
    # one of them cached it, so the search over every request usually ends there.
    rids = ctx.op.rids if isinstance(ctx.op, Step) else (getattr(ctx.op, "rid", None),)
    first = [ctx.history.requests[r] for r in rids if r in ctx.history.requests]
    for key in new:
        kind = ctx.config.groups[key.group].kind
        if kind == "full":
            continue
        if not any(_kept_by_request(ctx, key, r) for r in chain(first, ctx.history.all_requests())):
            # The kind leads the message so that a known finding can name one.
            out.append(f"{kind} {key.short()} cached but no retained boundary of any request needs it")
    return out


Lookup = tuple[Tokens, int, tuple[tuple[int, ...], ...]]


def _lookups(ctx: CheckContext) -> list[Lookup]:
    """Every prefix-cache lookup the operation made: (tokens, hit, hit blocks)."""
    obs, op = ctx.obs, ctx.op
    if isinstance(op, Probe) and isinstance(obs, ProbeResult):
        return [(op.tokens, obs.hit, obs.hit_blocks)]
    results: list[tuple[str, ScheduleResult]] = []
    if isinstance(op, Schedule) and isinstance(obs, ScheduleResult):
        results = [(op.rid, obs)]
    elif isinstance(obs, StepResult):
        results = list(obs.results)
    out = []
    for rid, r in results:
        if r.hit is not None and rid in ctx.history.requests:
            assert r.hit_blocks is not None
            out.append((ctx.history.requests[rid].tokens, r.hit, r.hit_blocks))
    return out


def _cached(ctx: CheckContext) -> Mapping[BlockKey, tuple[int, ...]]:
    """The hash map a lookup of this operation could see. In a step over a batch a
    later admission may hit blocks an earlier one cached; a block hit is held, so
    it is still cached after the step."""
    if not isinstance(ctx.obs, StepResult):
        return ctx.before.cached
    if ctx.delta is not None:
        return _Merged(ctx.before.cached, ctx.after.cached)
    merged = dict(ctx.before.cached)
    for key, blocks in ctx.after.cached.items():
        merged[key] = tuple(dict.fromkeys(merged.get(key, ()) + blocks))
    return merged


class _Merged(Mapping[BlockKey, tuple[int, ...]]):
    """Two hash maps as one: a key's holders in the first, then new ones in the second."""

    def __init__(
        self, first: Mapping[BlockKey, tuple[int, ...]], second: Mapping[BlockKey, tuple[int, ...]]
    ) -> None:
        self.first, self.second = first, second

    def __getitem__(self, key: BlockKey) -> tuple[int, ...]:
        value = tuple(dict.fromkeys(self.first.get(key, ()) + self.second.get(key, ())))
        if not value:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(dict.fromkeys([*self.first, *self.second]))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def hit_backed_by_cache(ctx: CheckContext) -> list[str]:
    """A hit of h tokens is served only by cached state: every full-attention
    block below h, the SWA blocks holding the window of token h, and the Mamba
    state at h are in the hash map. So a sparse hit never exceeds what a dense
    cache could serve, and no token is read from a block that does not hold it."""
    out: list[str] = []
    cached = _cached(ctx)
    for tokens, hit, _ in _lookups(ctx):
        out += _backed(ctx, tokens, hit, cached)
    return out


def _backed(
    ctx: CheckContext, tokens: Tokens, hit: int, cached: Mapping[BlockKey, tuple[int, ...]]
) -> list[str]:
    cfg = ctx.config
    if hit == 0:
        return []
    out = []
    if hit >= len(tokens):
        out.append(
            f"hit {hit} covers the whole {len(tokens)}-token request (its last token must be recomputed)"
        )
    for g, spec in enumerate(cfg.groups):
        bs = spec.block_size
        if is_fine_lookup(cfg, spec.kind, bs):
            out += _backed_fine(cfg, g, spec.kind, bs, tokens, hit, cached)
            continue
        if hit % bs:
            out.append(f"hit {hit} is not a multiple of group {g}'s block size {bs}")
            continue
        if spec.kind == "full":
            need = range(hit // bs)
        elif spec.kind == "swa":
            assert spec.sliding_window is not None
            need = range(max(0, hit - spec.sliding_window + 1) // bs, hit // bs)
        else:
            need = range(hit // bs - 1, hit // bs)
        missing = [j for j in need if _key(cfg, g, tokens, (j + 1) * bs) not in cached]
        if missing:
            out.append(f"hit {hit} but group {g} ({spec.kind}) blocks {missing} are not cached")
    return out


def _tail_keys(hbs: int, kind: str, bs: int, tokens: Tokens, hit: int, j: int) -> list[int]:
    """Prefix lengths whose key may name block j of a fine-grained hit of `hit` tokens:
    the block's end below the hit; for the tail block of a full-attention hit, any
    hash boundary in it at or past the hit (KV is append-only: a longer prefix's
    block holds the shorter one); for a Mamba state, exactly the hit (a state
    holds one prefix only)."""
    end = (j + 1) * bs
    if end <= hit:
        return [end] if kind == "full" or end == hit else []
    if kind == "mamba":
        return [hit]
    return list(range(max(hit, j * bs + hbs), min(end, len(tokens)) + 1, hbs))


def _key(cfg: Config, g: int, tokens: Tokens, n: int) -> BlockKey | None:
    """The key of `tokens`' first n in group g as the configuration hashes it (under lookahead
    hashes with the tokens past it: `Config.hash_lookahead`); None where those are not known."""
    lookahead = cfg.hash_lookahead
    return block_key(g, tokens, n, lookahead) if n + lookahead <= len(tokens) else None


def _backed_fine(
    cfg: Config,
    g: int,
    kind: str,
    bs: int,
    tokens: Tokens,
    hit: int,
    cached: Mapping[BlockKey, tuple[int, ...]],
) -> list[str]:
    """`hit_backed_by_cache` for a group whose hits may end inside a block
    (fine-grained hits): every block read up to the hit is keyed by a prefix it
    holds (`_tail_keys`); Mamba reads only the state at the hit."""
    hbs = cfg.hash_block_size
    if hit % hbs:
        return [f"hit {hit} is not a multiple of the hash block size {hbs} (group {g})"]
    read = range(cdiv(hit, bs) - 1, cdiv(hit, bs)) if kind == "mamba" else range(cdiv(hit, bs))
    missing = [
        j
        for j in read
        if not any(_key(cfg, g, tokens, n) in cached for n in _tail_keys(hbs, kind, bs, tokens, hit, j))
    ]
    return [f"hit {hit} but group {g} ({kind}) blocks {missing} are not cached"] if missing else []


def hit_blocks_hold_their_prefix(ctx: CheckContext) -> list[str]:
    """Each block a hit hands out carries the hash of exactly the prefix it
    stands for in the request (a reused block whose old hash survived would
    hand out someone else's KV: a corrupted output)."""
    out = []
    cached = _cached(ctx)
    for tokens, hit, hit_blocks in _lookups(ctx):
        out += _holds(ctx, tokens, hit, hit_blocks, cached)
    return out


def _holds(
    ctx: CheckContext,
    tokens: Tokens,
    hit: int,
    hit_blocks: tuple[tuple[int, ...], ...],
    cached: Mapping[BlockKey, tuple[int, ...]],
) -> list[str]:
    out = []
    cfg = ctx.config
    for g, blocks in enumerate(hit_blocks):
        spec = cfg.groups[g]
        bs = spec.block_size
        if spec.kind == "full" and len(blocks) != cdiv(hit, bs):
            out.append(f"group {g}: {len(blocks)} hit blocks for a hit of {hit} tokens")
        fine = is_fine_lookup(cfg, spec.kind, bs)
        for j, b in enumerate(blocks):
            lengths = (
                _tail_keys(cfg.hash_block_size, spec.kind, bs, tokens, hit, j) if fine else [(j + 1) * bs]
            )
            if b and not any(b in cached.get(_key(cfg, g, tokens, n), ()) for n in lengths):  # type: ignore[arg-type]
                out.append(f"group {g}: hit block {b} at index {j} does not hold that prefix")
    return out


def hit_serves_written_kv(ctx: CheckContext) -> list[str]:
    """A hit serves only KV that was written (computed by a step or loaded): no
    block it hands out is one a KV connector's load failed on that no step has
    computed whole again since (`History.unwritten`). A hit in a step may take a
    block that step recomputes (its forward pass writes each layer's KV before
    attention reads it); a probe reads the cache as it stands. A failed block's
    KV is garbage until recomputed: serving it corrupts the output (vLLM
    `Scheduler._handle_invalid_blocks`, `kv_load_failure_policy`)."""
    unwritten = ctx.history.unwritten
    if not unwritten:
        return []
    out = []
    for _, hit, hit_blocks in _lookups(ctx):
        for g, blocks in enumerate(hit_blocks):
            spec = ctx.config.groups[g]
            for j, b in enumerate(blocks):
                u = unwritten.get(b) if b else None
                # A hit reads a block's tokens below the hit (a Mamba state: the whole block).
                read = (
                    spec.block_size
                    if spec.kind == "mamba"
                    else min(hit - j * spec.block_size, spec.block_size)
                )
                if u is not None and u.written < read:
                    out.append(
                        f"hit {hit} reads group {g} block {b} (index {j}): {u.why} "
                        "and no step has written it since"
                    )
    return out
