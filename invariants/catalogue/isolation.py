"""Isolation: a prefix-cache hit never crosses tenants, adapters, images or drafters' lookahead.

vLLM keeps requests apart only through a block hash's extra keys (`model.contract.extra_keys`:
the cache salt, the LoRA adapter, multimodal items). A defect there lets one tenant's
request read KV another tenant's prompt wrote (a side channel on its prompt through
time-to-first-token: why vLLM added `cache_salt`, #13734) or a request attend to KV
computed under another adapter's weights or another image. These invariants judge it
from what the target reported, never from the model:

- `hit_written_by_same_identity`: every block a hit hands out was written (allocated
  and computed, or copied from such a block) by a request whose identity over the
  prefix read equals the reader's: same salt, same adapter name and path, the same
  items at the same positions (`IsolationLedger.writer`, from each step's new blocks);
  under Eagle's lookahead hashes (`Config.hash_lookahead` L) also the same L tokens past
  each block read, which the drafter's KV at the block's last position was computed from
  (`IsolationLedger.wrote`: the writer's tokens);
- `events_carry_block_keys`: each BlockStored's `extra_keys` entry is exactly the keys
  of the block its hash names (`model.contract.extra_keys.event_keys` of that prefix's identity),
  and its `lora_name` the adapter of that identity;
- `router_sees_target_hits`: a router that rebuilds the cache from the events alone
  (`RouterIndex`: each block keyed by its parent's key, its token ids and its extra keys,
  as a KV-event consumer keys it) holds every full-attention block of every hit the
  target hands out; where the model is one full-attention group, it routes exactly the
  target's hit.

Lookahead hashing (`num_hash_lookahead_tokens`) widens an event's key window past its
block; the events' keys are then judged with that window (the name of a block does
not carry the items past its end, so an item there is not judged: counted in
`IsolationLedger.unjudged`), and each entry of `lookahead_token_ids` is the lookahead
its hash's name covers (`events.stored_tokens_match_hashes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from model.contract.extra_keys import NO_IDENTITY, Identity, MMItem, event_keys, identity_of
from model.contract.observation import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    ScheduleResult,
    StepResult,
)
from model.contract.ops import Op, Probe, Schedule
from model.contract.prefix import Prefix, Tokens

if TYPE_CHECKING:
    from invariants.catalogue.context import CheckContext, History, RequestHistory


def view(identity: Identity, n: int) -> tuple[Any, ...]:
    """What of `identity` a prefix of `n` tokens depends on: the namespace and the
    items that start in it, clipped to it."""
    items = tuple((m.identifier, m.offset, min(m.end, n)) for m in identity.mm if m.offset < n)
    return (identity.namespace(), items)


def prefix_identity(p: Prefix) -> Identity:
    """The identity a prefix's name carries (its namespace and its items, clipped)."""
    ns = p.namespace()
    salt, name, path = ns if ns is not None else (None, None, None)
    items: list[MMItem] = []
    for ident, a, b in p.items():
        if items and items[-1].identifier == ident and items[-1].end == a:
            last = items.pop()
            items.append(MMItem(ident, last.offset, b - last.offset))
        else:
            items.append(MMItem(ident, a, b - a))
    lora = (name, 0, path) if name is not None and path is not None else None
    return Identity(salt, lora, tuple(items))


class RouterIndex:
    """The cache as a KV-event consumer rebuilds it: per group, how many blocks hold
    each router key, a key being an interned (parent key, token ids, extra keys) of
    the event's block; nothing of the target's hash naming is read but to find a
    parent's key (the event names its parent by hash)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, ...], int] = {}
        self.key_of: dict[tuple[int, Prefix], int] = {}  # (group, hash name) -> router key
        self.held: dict[int, Counter[int]] = {}
        self.orphans = 0  # stored blocks whose parent the router never saw (not routable)

    def _intern(self, parent: int | None, tokens: tuple[int, ...], extra: object) -> int:
        key = (parent, tokens, extra)
        out = self._ids.get(key)
        if out is None:
            out = self._ids[key] = len(self._ids) + 1
        return out

    def key(self, parent: int | None, tokens: tuple[int, ...], extra: object) -> int | None:
        """The router key of a block (None: no block ever had it)."""
        return self._ids.get((parent, tokens, extra))

    def apply(self, events: Iterable[Event]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
                self.key_of.clear()
            elif isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                k = self.key_of.get((ev.group, ev.block_hash))
                held = self.held.get(ev.group)
                if k is not None and held is not None and held[k] > 0:
                    held[k] -= 1
                    if not held[k]:
                        del held[k]

    def stored_keys(
        self, ev: BlockStored, overlay: dict[tuple[int, Prefix], int] | None = None
    ) -> list[tuple[int, int]]:
        """(group, router key) of each hash of `ev`, interning them. With `overlay`, a
        look-ahead that leaves the index as it was (but for interning): the hashes'
        router keys go into `overlay`, which is read before `key_of`, and no orphan is counted."""
        out: list[tuple[int, int]] = []
        names = self.key_of if overlay is None else overlay
        parent = None
        if ev.parent is not None:
            pk = (ev.group, ev.parent)
            parent = self.key_of.get(pk) if overlay is None else overlay.get(pk, self.key_of.get(pk))
        if ev.parent is not None and parent is None:
            if overlay is None:
                self.orphans += 1
            return out
        bs, extra = ev.block_size, ev.extra_keys
        if len(ev.token_ids) != len(ev.block_hashes) * bs:
            return out  # a range with masked blocks: their parents are not named (not routable)
        ahead = ev.lookahead_token_ids
        for i, h in enumerate(ev.block_hashes):
            keys = extra[i] if extra else None
            if ahead is not None:  # lookahead hashes: the tokens past the block key it too
                keys = (keys, tuple(ahead[i]))
            k = self._intern(parent, tuple(ev.token_ids[i * bs : (i + 1) * bs]), keys)
            names[(ev.group, h)] = k
            out.append((ev.group, k))
            parent = k
        return out

    def _stored(self, ev: BlockStored) -> None:
        for g, k in self.stored_keys(ev):
            self.held.setdefault(g, Counter())[k] += 1


@dataclass
class IsolationLedger:
    """What the isolation invariants remember: `writer[b]` the identity of the request
    whose step last wrote block b; `router` the events' cache as of the operation
    before the one being judged, `pending` the judged operation's events."""

    writer: dict[int, Identity] = field(default_factory=dict)
    # The tokens of the request whose step last wrote block b (its history's, as they grow):
    # the lookahead a lookahead hash of the block covers is read from them.
    wrote: dict[int, RequestHistory] = field(default_factory=dict)
    # Per request, the blocks its latest admission's hit read, by (group, table index).
    read: dict[str, dict[tuple[int, int], int]] = field(default_factory=dict)
    router: RouterIndex = field(default_factory=RouterIndex)
    pending: tuple[Event, ...] = ()
    unjudged: Counter[str] = field(default_factory=Counter)


def note_isolation(
    history: History, op: Op, obs: object, events: tuple[Event, ...], tables: Mapping[str, Any] | None = None
) -> None:
    """Advance the ledger past `op` (after `advance_requests`): the previous
    operation's events enter the router; each block a scheduled request holds past
    its hit (`tables`, its blocks after `op`: an admission's external tokens' blocks
    are in no `new_blocks`) gets the request's identity as its writer."""
    ledger = history.isolation
    ledger.router.apply(ledger.pending)
    ledger.pending = events
    results: list[tuple[str, ScheduleResult]] = []
    if isinstance(op, Schedule) and isinstance(obs, ScheduleResult):
        results = [(op.rid, obs)]
    elif isinstance(obs, StepResult):
        results = list(obs.results)
    for rid, r in results:
        req = history.requests.get(rid)
        identity = identity_of(req.prompt) if req is not None else NO_IDENTITY
        for blocks in r.new_blocks or ():
            for b in blocks:
                if b:
                    ledger.writer[b] = identity
                    _wrote(ledger, b, req)
        if r.hit_blocks is not None:  # an admission: the blocks its hit reads, by table position
            ledger.read[rid] = {
                (g, j): b for g, blocks in enumerate(r.hit_blocks) for j, b in enumerate(blocks) if b
            }
        held = (tables or {}).get(rid)
        if not held or not r.scheduled:
            continue
        read = ledger.read.get(rid, {})
        for g, table in enumerate(held):
            for j, b in enumerate(table):
                # Past its hit a request writes its own tokens (computed, or loaded by a connector:
                # such blocks are in no `new_blocks`); a block it read keeps its writer.
                if b and read.get((g, j)) != b:
                    ledger.writer[b] = identity
                    _wrote(ledger, b, req)
    for src, dst in getattr(obs, "copies", ()) or ():
        if src in ledger.writer:
            ledger.writer[dst] = ledger.writer[src]
            _wrote(ledger, dst, ledger.wrote.get(src))


def _wrote(ledger: IsolationLedger, b: int, req: RequestHistory | None) -> None:
    if req is None:
        ledger.wrote.pop(b, None)
    else:
        ledger.wrote[b] = req


def _lookups(ctx: CheckContext) -> list[tuple[tuple[int, ...], int, tuple[tuple[int, ...], ...]]]:
    obs, op = ctx.obs, ctx.op
    if isinstance(op, Probe) and isinstance(
        obs, ScheduleResult
    ):  # (a probe's result is not a ScheduleResult)
        return []
    results: list[tuple[str, ScheduleResult]] = []
    if isinstance(op, Schedule) and isinstance(obs, ScheduleResult):
        results = [(op.rid, obs)]
    elif isinstance(obs, StepResult):
        results = list(obs.results)
    out = []
    for rid, r in results:
        if r.hit and r.hit_blocks is not None and rid in ctx.history.requests:
            out.append((ctx.history.requests[rid].tokens, r.hit, r.hit_blocks))
    return out


def hit_written_by_same_identity(ctx: CheckContext) -> list[str]:
    """Every block a hit hands out was last written by a request with the reader's
    identity over the prefix read (same cache salt, same LoRA name and path, the
    same multimodal items at the same positions): a tenant never reads another
    tenant's KV, a request never attends to KV of another adapter or image
    (vLLM `generate_block_hash_extra_keys`; `cache_salt`, vLLM #13734). Under Eagle's
    lookahead hashes the L tokens past each block read are part of the identity: the
    drafter's KV at the block's last position was computed from them (vLLM
    `get_request_block_hasher`; a hit on a block whose writer went on differently is
    a cross-identity hit)."""
    out = []
    writer = ctx.history.isolation.writer
    lookahead = ctx.config.hash_lookahead
    for tokens, hit, hit_blocks in _lookups(ctx):
        mine = identity_of(tokens)
        for g, blocks in enumerate(hit_blocks):
            spec = ctx.config.groups[g]
            for j, b in enumerate(blocks):
                if not b:
                    continue
                theirs = writer.get(b)
                if theirs is None:
                    ctx.history.isolation.unjudged["hit block of unknown writer"] += 1
                    continue
                n = (j + 1) * spec.block_size if spec.kind == "mamba" else min(hit, (j + 1) * spec.block_size)
                if view(mine, n) != view(theirs, n):
                    out.append(
                        f"hit {hit} reads group {g} block {b} (index {j}), written under identity "
                        f"{_show(theirs, n)}, by a request of identity {_show(mine, n)}"
                    )
                elif lookahead:
                    out += _other_lookahead(ctx, tokens, hit, g, j, b, min(hit, (j + 1) * spec.block_size))
    return out


def _other_lookahead(
    ctx: CheckContext, tokens: Tokens, hit: int, g: int, j: int, b: int, n: int
) -> list[str]:
    """A hit's block read up to token n whose writer went on, past n, with other lookahead
    tokens than the reader (`hit_written_by_same_identity` under lookahead hashes)."""
    lookahead = ctx.config.hash_lookahead
    source = ctx.history.isolation.wrote.get(b)
    theirs = None if source is None else source.tokens[n : n + lookahead]
    mine = tokens[n : n + lookahead]
    if theirs is None or len(theirs) < lookahead or len(mine) < lookahead:
        ctx.history.isolation.unjudged["hit block whose lookahead tokens are unknown"] += 1
        return []
    if tuple(theirs) == tuple(mine):
        return []
    return [
        f"hit {hit} reads group {g} block {b} (index {j}), written by a request whose lookahead "
        f"tokens past {n} are {tuple(theirs)}, by a request with {tuple(mine)} there (the drafter's "
        "KV at the block's last position differs: a cross-identity hit under lookahead hashes)"
    ]


def _show(identity: Identity, n: int) -> str:
    ns, items = view(identity, n)
    salt, lora, path = ns if ns is not None else (None, None, None)
    parts = [
        f"salt={salt}" if salt else "",
        f"lora={lora}:{path}" if lora else "",
        f"mm={list(items)}" if items else "",
    ]
    return "(" + ", ".join(p for p in parts if p) + ")" if any(parts) else "(none)"


def events_carry_block_keys(ctx: CheckContext) -> list[str]:
    """Each BlockStored publishes, per hash, exactly the extra keys of the block that
    hash names (`to_event_extra_keys` of `generate_block_hash_extra_keys` over the
    block, its lookahead window included), and the LoRA name of that block's adapter:
    a router or offloader that rebuilds the cache from events keeps tenants,
    adapters and images apart only through them (vLLM `BlockPool.cache_full_blocks`)."""
    out = []
    for ev in ctx.after.events:
        if not isinstance(ev, BlockStored) or not ev.block_hashes:
            continue
        extra = ev.extra_keys
        if extra is not None and len(extra) != len(ev.block_hashes):
            out.append(
                f"BlockStored(group {ev.group}): {len(extra)} extra keys for {len(ev.block_hashes)} hashes"
            )
            continue
        ahead = ev.lookahead_token_ids
        names: set[str | None] = set()
        for i, h in enumerate(ev.block_hashes):
            identity = prefix_identity(h)
            names.add(identity.lora[0] if identity.lora is not None else None)
            look = len(ahead[i]) if ahead else 0
            end = len(h)
            want = event_keys(identity, end - ev.block_size, end, look)
            got = extra[i] if extra is not None else None
            if look and got is not None:
                # An item starting in the lookahead window is past the name's end: not judged.
                kept = tuple(k for k in got if not (isinstance(k, tuple) and k[1] >= ev.block_size))
                if kept != got:
                    ctx.history.isolation.unjudged["event keys of an item past its block"] += 1
                got = kept or None
            if got != want:
                out.append(
                    f"BlockStored(group {ev.group}) hash {i} ({end} tokens): extra keys {got!r}, "
                    f"the block's are {want!r}"
                )
        if len(names) == 1 and ev.lora_name != next(iter(names)):
            out.append(
                f"BlockStored(group {ev.group}): lora_name {ev.lora_name!r}, the blocks' adapter {names}"
            )
    return out


def router_sees_target_hits(ctx: CheckContext) -> list[str]:
    """A router rebuilding the cache from the KV events alone (each block keyed by
    its parent, its token ids and its extra keys, and its lookahead tokens under lookahead
    hashes) holds every full-attention block
    the target's hits hand out, keyed by the reader's own identity; with one
    full-attention group (and no lookahead, drafts' block drop or connector) it
    routes exactly the target's hit. Events that mislabel a block's keys send a
    router's requests to the wrong replica or across tenants (vLLM `kv_events`)."""
    lookups = _lookups(ctx)
    if not lookups:
        return []
    ledger = ctx.history.isolation
    router = ledger.router
    fresh: dict[int, Counter[int]] = {}
    learnt: dict[tuple[int, Prefix], int] = {}  # the pending stores' hash names: the index stays as it is
    for ev in ledger.pending:  # this operation's stores may serve a later admission of its step
        if isinstance(ev, BlockStored):
            for g, stored in router.stored_keys(ev, learnt):
                fresh.setdefault(g, Counter())[stored] += 1
    cfg = ctx.config
    # Exactly the target's hit: one full-attention group, nothing that trims or extends a
    # hit, and no block left the cache during the operation (the router is as of before it).
    exact = (
        len(cfg.groups) == 1
        and not cfg.eagle
        and not cfg.kv_connector
        and not cfg.num_lookahead_tokens
        and not any(isinstance(ev, (BlockRemoved, AllBlocksCleared)) for ev in ledger.pending)
    )
    # Within those, a hit is bounded by the router as of before the operation (every block it
    # held can be hit) and as of after its stores (a request the step ran before the admission,
    # or an earlier admission, may store blocks the admission then hits): equal without stores.
    out = []
    for tokens, hit, hit_blocks in lookups:
        identity = identity_of(tokens)
        for g, spec in enumerate(cfg.groups):
            if spec.kind != "full":
                continue
            bs = spec.block_size
            held, new = router.held.get(g, Counter()), fresh.get(g, Counter())
            keys = _router_keys(tokens, identity, bs, cfg.hash_lookahead)
            seen = _routed(router, tokens, keys, bs, (held, new))
            want = len(hit_blocks[g]) * bs if g < len(hit_blocks) else 0
            if seen < min(want, hit // bs * bs):
                out.append(f"group {g}: the target hits {hit} tokens, a router from the events sees {seen}")
            elif exact:
                cap = (len(tokens) - 1) // bs * bs
                routed = min(_routed(router, tokens, keys, bs, (held,)), cap)
                reach = min(_routed(router, tokens, keys, bs, (held, new)), cap)
                if not routed <= hit <= reach:
                    out.append(
                        f"group {g}: the target hits {hit} tokens, a router from the events routes {routed}"
                        + (f" (up to {reach} with the operation's stores)" if reach != routed else "")
                    )
    return out


def _router_keys(tokens: tuple[int, ...], identity: Identity, bs: int, lookahead: int) -> list[Any]:
    """Per full block of `tokens` that its request hashes, the extra keys a router reads from
    its event (under lookahead hashes L: over the hash's window, with the L tokens past it)."""
    if not lookahead:
        return [event_keys(identity, j * bs, (j + 1) * bs) for j in range(len(tokens) // bs)]
    return [
        (
            event_keys(identity, j * bs, (j + 1) * bs, lookahead),
            tuple(tokens[(j + 1) * bs : (j + 1) * bs + lookahead]),
        )
        for j in range((len(tokens) - lookahead) // bs)
    ]


def _routed(
    router: RouterIndex, tokens: tuple[int, ...], keys: list[Any], bs: int, held: tuple[Counter[int], ...]
) -> int:
    """The longest run of `tokens`' full blocks whose router keys some counter of `held` holds, in tokens."""
    parent: int | None = None
    for j, extra in enumerate(keys):
        k = router.key(parent, tuple(tokens[j * bs : (j + 1) * bs]), extra)
        if k is None or not any(c[k] > 0 for c in held):
            return j * bs
        parent = k
    return len(keys) * bs
