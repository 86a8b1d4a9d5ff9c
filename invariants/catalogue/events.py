"""KV-event invariants: a consumer of the events sees the true hash map."""

from __future__ import annotations

from collections.abc import Sequence

from invariants.catalogue.context import CheckContext
from model.contract.observation import BlockStored
from model.contract.prefix import Prefix, extend


def events_match_hash_map(ctx: CheckContext) -> list[str]:
    """Replaying every BlockStored / BlockRemoved / AllBlocksCleared so far
    gives exactly the hash map (key -> number of holding blocks): every block
    that entered or left the map was announced, once."""
    actual = {k: len(v) for k, v in ctx.after.cached.items()}
    shadow = ctx.history.shadow
    if actual == shadow:  # equal maps differ at no key: the usual verdict, in one comparison
        return []
    out = [
        f"{k.short()}: events say {shadow.get(k, 0)} holder(s), map has {actual.get(k, 0)}"
        for k in set(actual) | set(shadow)
        if shadow.get(k, 0) != actual.get(k, 0)
    ]
    return sorted(out)


def stored_tokens_match_hashes(ctx: CheckContext) -> list[str]:
    """Each BlockStored names only stored blocks, and its token ids chain from
    its parent to exactly its hashes (#42258 review: with masked SWA blocks the
    token range must be filtered too). Two messages, judged apart: the count
    of token ids against the hashes, and whether every hash names, in order, a
    block of the event's token range. A release whose events carry the whole
    range (vLLM #44451, a known finding) fails the first only; the second
    still holds it to hashes that chain."""
    out = []
    for ev in ctx.after.events:
        if not isinstance(ev, BlockStored):
            continue
        bs, hashes, tokens = ev.block_size, ev.block_hashes, ev.token_ids
        parent = ev.parent
        if ev.lookahead_token_ids is not None or any(h.ahead is not None for h in hashes):
            out += _lookahead_mismatches(ev)
            hashes = tuple(h.plain for h in hashes)
            parent = None if parent is None else parent.plain
        if len(tokens) != len(hashes) * bs:
            out.append(
                f"BlockStored(group {ev.group}) has {len(hashes)} hash(es) of {bs} tokens "
                f"but {len(tokens)} token ids"
            )
        # With exactly the stored token ids the i-th hash is the i-th block; with
        # more, the hashes must be a subsequence of the range's blocks. The fast form
        # compares content and heads, so it also holds hashes named under a request's
        # identity (`model.contract.extra_keys`), which `extend` (plain tokens) cannot name.
        if _name_blocks_of_range(parent, hashes, tokens, bs):
            continue
        chained, matched = parent, 0
        for i in range(len(tokens) // bs):
            if matched == len(hashes):
                break
            chained = extend(chained, tokens[i * bs : (i + 1) * bs])
            if hashes[matched] is chained:
                matched += 1
            elif len(tokens) == len(hashes) * bs:
                break
        if matched < len(hashes):
            out.append(
                f"BlockStored(group {ev.group}) hash {matched} does not chain from its parent and tokens"
            )
    return out


def _lookahead_mismatches(ev: BlockStored) -> list[str]:
    """Under lookahead hashes (`model.contract.prefix.looked`): the event lists, per hash, exactly the
    tokens past its block that the hash covers (`lookahead_token_ids`), and those past a block
    inside the event's range are the range's next tokens."""
    ahead, where = ev.lookahead_token_ids, f"BlockStored(group {ev.group})"
    if ahead is None:
        return [f"{where}: its hashes cover lookahead tokens but it lists none (lookahead_token_ids None)"]
    if len(ahead) != len(ev.block_hashes):
        return [f"{where}: {len(ahead)} lookahead_token_ids entries for {len(ev.block_hashes)} hash(es)"]
    out = []
    base = 0 if ev.parent is None else len(ev.parent)
    for i, (h, listed) in enumerate(zip(ev.block_hashes, ahead, strict=True)):
        covered = () if h.ahead is None else h.ahead[0]
        if tuple(listed) != covered:
            out.append(
                f"{where} hash {i} covers lookahead tokens {covered} but the event lists {tuple(listed)}"
            )
            continue
        end = len(h) - base
        inside = tuple(ev.token_ids[end : end + len(covered)])
        if len(inside) == len(covered) and inside != covered:
            out.append(
                f"{where} hash {i}: lookahead tokens {covered} are not the tokens after its block {inside}"
            )
    return out


def _name_blocks_of_range(
    parent: Prefix | None, hashes: Sequence[Prefix], tokens: Sequence[int], bs: int
) -> bool:
    """Do `hashes` name, in order, whole blocks of `parent + tokens`? The fast
    form of the subsequence walk for an event carrying a long range (a 1M-token
    prompt's masked SWA blocks): the longest hash's content is compared chunk by
    chunk against the tokens (no prefix is named), each shorter hash must be its
    head. False sends the caller to the exact walk, which names the bad hash."""
    if not hashes:
        return True
    base = 0 if parent is None else len(parent)
    lengths = [len(h) - base for h in hashes]
    if any(n <= 0 or n % bs or n > len(tokens) for n in lengths) or lengths != sorted(set(lengths)):
        return False
    last = hashes[-1]
    below = last.head(base)
    if below is not parent and not (parent is None and len(below) == 0):
        return False
    node: Prefix | None = last
    while node is not None and node.length > base:
        start = node.length - len(node.chunk)
        lo = max(start, base)
        if node.chunk[lo - start :] != tuple(tokens[lo - base : node.length - base]):
            return False
        node = node.parent
    return all(hashes[i + 1].head(len(hashes[i])) is hashes[i] for i in range(len(hashes) - 1))
