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
    token range must be filtered too)."""
    out = []
    for ev in ctx.after.events:
        if not isinstance(ev, BlockStored):
            continue
        bs = ev.block_size
        if len(ev.token_ids) != len(ev.block_hashes) * bs:
            out.append(
                f"BlockStored(group {ev.group}) has {len(ev.block_hashes)} hash(es) of {bs} tokens "
                f"but {len(ev.token_ids)} token ids"
            )
            continue
        chained = ev.parent
        for i, h in enumerate(ev.block_hashes):
            chained = extend(chained, ev.token_ids[i * bs : (i + 1) * bs])
            if h is not chained:
                out.append(
                    f"BlockStored(group {ev.group}) hash {i} does not chain from its parent and tokens"
                )
                break
    return out
