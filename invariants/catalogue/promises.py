"""Promises: the hits retention says it keeps are kept."""

from __future__ import annotations

from invariants.catalogue.context import NOT_FREE, CheckContext
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.masks import cdiv, swa_tail_blocks
from model.contract.observation import BlockKey, Tokens, block_key
from model.contract.ops import Finish, Schedule, Step
from model.contract.profile import MODELED, Profile


def promised_boundary(cfg: Config, prompt_len: int, profile: Profile = MODELED) -> int:
    """The hit a replay of a `prompt_len`-token prompt reaches by design.

    Non-Eagle: the aligned boundary at or below P-1 (the last token is always
    recomputed). Eagle: the matched boundary minus one scheduler block, the peek
    block the lookup matches and drops. With one group the lookup stops at P-1;
    with several the coordinator lets it match one group block past P-1 (never
    past the hashed prompt), so a block-aligned prompt reaches the extension
    boundary floor(P/sbs)*sbs - sbs: the latest replayable prompt boundary,
    the one retention 0 keeps (#43447).
    """
    sbs = cfg.scheduler_block_size
    hybrid = len(cfg.groups) > 1
    align = sbs if hybrid else cfg.groups[0].block_size
    # Before 0.32.0 the look stopped at the lookup's limit, P-1 (model.contract.profile).
    reaches_p = cfg.eagle_drop and hybrid and profile.eagle_margin_to_hashed
    matched = prompt_len if reaches_p else prompt_len - 1
    e = matched // align * align
    return max(e - sbs, 0) if cfg.eagle_drop else e


def replay_keys(cfg: Config, tokens: Tokens, boundary: int) -> dict[BlockKey, str]:
    """The keys a replay landing at `boundary` needs, each mapped to a role label:
    full blocks below it, the SWA tail ending at it, the Mamba state at it, and
    with Eagle the peek block above it in every attention group. Under Eagle's lookahead
    hashes nothing is dropped, so no peek block is needed: the promise of the legacy hashes
    without the trailing drop, each key covering the token past its block (`Config.hash_lookahead`)."""
    keys: dict[BlockKey, str] = {}
    if boundary == 0:
        return keys
    eagle, lookahead = cfg.eagle_drop, cfg.hash_lookahead
    for g, spec in enumerate(cfg.groups):
        bs = spec.block_size
        top = boundary // bs
        if spec.kind == "full":
            idx = range(top + int(eagle))  # Eagle matches the block past the boundary, then drops it
        elif spec.kind == "swa":
            assert spec.sliding_window is not None
            need = swa_tail_blocks(spec.sliding_window, bs, eagle)
            idx = range(max(0, top + int(eagle) - need), top + int(eagle))
        else:
            idx = range(top - 1, top)
        for j in idx:
            role = (
                "Eagle peek block"
                if eagle and spec.kind != "mamba" and j == top
                else f"{spec.kind} block {j}"
            )
            keys[block_key(g, tokens, (j + 1) * bs, lookahead)] = role
    return keys


def promised_replay(ctx: CheckContext) -> tuple[int, dict[BlockKey, str]]:
    """The replay hit a finished request promises, and the keys serving it.

    The keys are those of the promised boundary, or of the request's own
    admission hit when that is higher: a request caches only the blocks past
    its hit (the mask covers [num_cached_block, num_full) and a hit sets
    num_cached_block to the hit's length), and below the hit its SWA and Mamba
    tables are null, so the tail at a lower boundary was never its to keep.
    The replay repeats the admission lookup and lands at least where it did.
    With fine-grained Mamba hits the boundary is the hash boundary at or below
    P-1 (`_fine_promise`).
    A KV connector's external tokens are like a hit (`model.machine.connector`): their
    blocks exist only inside the windows of the load's end
    (`allocate_external_computed_blocks`), so with a windowed group nothing is
    promised for a boundary below where the request's latest admission loaded to.
    """
    cfg, req = ctx.config, ctx.finished_request
    assert req is not None
    if fine_hits_enabled(cfg):
        return _fine_promise(ctx)
    e = promised_boundary(cfg, len(req.prompt), ctx.profile)
    if e == 0 or (req.external and cfg.has_retention_group and e < req.hit + req.external):
        return 0, {}
    return e, replay_keys(cfg, req.tokens, max(e, req.hit))


def _fine_promise(ctx: CheckContext) -> tuple[int, dict[BlockKey, str]]:
    """Fine-grained hits (`model.contract.fine_mamba`), without Eagle: the prompt's last
    hash boundary e <= P-1 is served by full attention's blocks below it (its
    tail block keyed at e), the SWA tail below e, and the Mamba state keyed at
    e (the prompt-tail checkpoint the scheduler stops at). With Eagle the
    replay boundaries (scheduler-block aligned) and the Mamba checkpoint
    (hash-block aligned) differ by design; no single boundary is promised.
    Nor where a KV connector's latest admission loaded to e or past it
    (`model.machine.connector`): the request computed no Mamba state up to there, and
    vLLM keys a state inside a block only where a chunk ends there
    (`MambaManager._cache_partial_tail_block`), while the chunk after the load
    overwrites the loaded state in its block."""
    cfg, req = ctx.config, ctx.finished_request
    assert req is not None
    hbs = cfg.hash_block_size
    e = (len(req.prompt) - 1) // hbs * hbs
    keys: dict[BlockKey, str] = {}
    if cfg.eagle_drop or e == 0 or (req.external and e <= req.hit + req.external):
        return 0, keys
    for g, spec in enumerate(cfg.groups):
        bs = spec.block_size
        if spec.kind == "full":
            ends = [min((j + 1) * bs, e) for j in range(cdiv(e, bs))]
        elif spec.kind == "swa":
            assert spec.sliding_window is not None
            need = swa_tail_blocks(spec.sliding_window, bs, False)
            ends = [(j + 1) * bs for j in range(max(0, e // bs - need), e // bs)]
        else:
            ends = [e]
        for n in ends:
            keys[block_key(g, req.tokens, n, cfg.hash_lookahead)] = (
                f"{spec.kind} state" if spec.kind == "mamba" else f"{spec.kind} block {(n - 1) // bs}"
            )
    return e, keys


def _applies(ctx: CheckContext) -> bool:
    req = ctx.finished_request
    return (
        isinstance(ctx.op, Finish)
        and req is not None
        and ctx.config.enable_caching
        and not req.ever_preempted
        and req.num_computed >= len(req.prompt)
    )


def promise_kept(ctx: CheckContext) -> list[str]:
    """Right after a request finishes, replaying its prompt hits at least the
    latest retained boundary it reaches by design (`promised_boundary`), unless
    blocks were reused since (#43447, #45845): every key serving that hit was
    cached at some point, and if all are still cached the probe hit reaches the
    boundary. The serving keys start at the request's own admission hit when
    that is higher: retention keeps the tails the request computed, and below
    its hit it computed none (`promised_replay`)."""
    if not _applies(ctx):
        return []
    e, keys = promised_replay(ctx)
    if e == 0:
        return []
    mode = (
        "with Eagle's lookahead hashes: "
        if ctx.config.hash_lookahead
        else "with Eagle: "
        if ctx.config.eagle
        else ""
    )
    never = [f"{role} ({k.short()})" for k, role in keys.items() if k not in ctx.history.ever_cached]
    if never:
        return [f"{mode}replay boundary {e}: {', '.join(never)} never cached (promised hit lost)"]
    if all(k in ctx.after.cached for k in keys) and ctx.probe is not None:
        assert ctx.finished_request is not None
        hit = ctx.probe(ctx.finished_request.prompt).hit
        if hit < e:
            return [f"{mode}replay hit {hit} < promised {e} although every needed block is cached"]
    return []


def eagle_extra_block_kept(ctx: CheckContext) -> list[str]:
    """With Eagle/MTP the SWA peek block above the replay boundary is cached,
    so the 0% hit-rate class (vLLM #42784, #44082, #51771) cannot occur. Under lookahead
    hashes nothing is dropped and no peek block is kept (`Config.eagle_drop`)."""
    if not ctx.config.eagle_drop or not _applies(ctx):
        return []
    _, keys = promised_replay(ctx)
    return [
        f"Eagle peek block {k.short()} never cached"
        for k, role in keys.items()
        if role == "Eagle peek block" and k not in ctx.history.ever_cached
    ]


def scratch_never_flushes_cache(ctx: CheckContext) -> list[str]:
    """A step never reuses a cached free block while an uncached free block is
    left over (concurrent SWA scratch must not flush cached prefixes; #43447):
    a `Schedule`, or a `Step` over a batch (a real scheduler's only kind), whose
    allocations all pop the same free queue.

    Left over: free and uncached before and after the step, and no endpoint of
    its copies. A block the step took and gave back (a copy-on-write
    destination that returns holding the moved keys) served the step. A step
    gives back no block it took otherwise: it preempts only requests it has not
    scheduled yet, and a rolled-back load frees blocks that were in use."""
    if not isinstance(ctx.op, (Schedule, Step)):
        return []
    if ctx.delta is not None:
        return _scratch_on_delta(ctx)
    b4, now = ctx.before, ctx.after
    flushed = [
        b
        for b in b4.free_queue
        if b in b4.block_hash and now.ref_cnt[b] > 0 and now.block_hash.get(b) != b4.block_hash[b]
    ]
    if not flushed:
        return []
    now_free = set(now.free_queue)
    served = _copy_endpoints(ctx)
    spared = [
        b
        for b in b4.free_queue
        if b not in b4.block_hash
        and b in now_free
        and b not in now.block_hash
        and b not in served
        and b not in ctx.history.evicted_in_place
    ]
    if spared:
        return [f"cached blocks {flushed[:5]} reused while uncached blocks {spared[:5]} stayed free"]
    return []


def _copy_endpoints(ctx: CheckContext) -> set[int]:
    """The blocks the step's copy-on-write copies read or wrote."""
    return {b for copy in getattr(ctx.obs, "copies", ()) for b in copy}


def _scratch_on_delta(ctx: CheckContext) -> list[str]:
    """`scratch_never_flushes_cache` from the touched blocks alone."""
    d = ctx.delta
    assert d is not None
    flushed = [
        b
        for b, (_, key, prev, _) in d.before_blocks.items()
        if prev != NOT_FREE
        and key is not None
        and b in d.blocks
        and d.blocks[b][0] > 0
        and d.blocks[b][1] != key
    ]
    if not flushed:
        return []
    exempt = ctx.history.evicted_in_place
    served = _copy_endpoints(ctx)
    # Free and uncached before, still so after: untouched ones are where they were.
    touched = [
        b
        for b, (_, key, prev, _) in d.before_blocks.items()
        if prev != NOT_FREE
        and key is None
        and b in d.blocks
        and d.is_free(b)
        and d.blocks[b][1] is None
        and b not in served
    ]
    untouched = (b for b in d.free_uncached if b not in d.blocks)
    spared = [b for b in touched if b not in exempt]
    for b in untouched:
        if len(spared) >= 5:
            break
        if b not in exempt:
            spared.append(b)
    if spared:
        return [
            f"cached blocks {sorted(flushed)[:5]} reused while uncached blocks {sorted(spared)[:5]} stayed free"
        ]
    return []
