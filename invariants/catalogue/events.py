"""KV-event invariants: a consumer of the events sees the true hash map."""

from __future__ import annotations

from invariants.catalogue.context import CheckContext
from model.observation import BlockStored
from model.prefix import extend


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
        if len(tokens) != len(hashes) * bs:
            out.append(
                f"BlockStored(group {ev.group}) has {len(hashes)} hash(es) of {bs} tokens "
                f"but {len(tokens)} token ids"
            )
        # With exactly the stored token ids the i-th hash is the i-th block; with
        # more, the hashes must be a subsequence of the range's blocks.
        chained, matched = ev.parent, 0
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
