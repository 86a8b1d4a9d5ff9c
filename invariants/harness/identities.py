"""Drawing request identities (`model.contract.extra_keys`) for the fuzzer, and counting them.

A defect in isolation shows where two requests with the SAME tokens but different
identities meet: so an add draws, about half the time, a prompt some earlier request
of the example had, and an identity among few tenants, two adapters (one of them
under two int ids: vLLM does not hash the id) and two images whose identifiers fix
their lengths (an identifier is the content's hash). Only the identity fields the
target expresses are drawn (`Target.identities`); the others are named in the
summary as not generated.

`FEATURES` are the summary's counters (`FuzzStats.features`); `summary_row` is the
one row of the fuzz summary (at most 120 characters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from model.contract.extra_keys import Identity, identity_of

SALTS = ("tenant-a", "tenant-b")
ADAPTERS = (("adapter-x", 1, "/lora/x"), ("adapter-x", 2, "/lora/x"), ("adapter-y", 3, "/lora/y"))
IMAGES = (("img-a", 3), ("img-b", 6))  # (identifier, length): an identifier fixes its length


SALTED = "identity: salted request"
ADAPTER = "identity: adapter request"
MULTIMODAL = "identity: multimodal request"
LOOKAHEAD = "identity: lookahead-hashed request"
REUSED = "identity: a prompt seen before, another identity"
OTHER_LOOKAHEAD = "identity: an earlier prompt's blocks, another token past them (lookahead hashes)"
FEATURES = (SALTED, ADAPTER, MULTIMODAL, LOOKAHEAD, REUSED, OTHER_LOOKAHEAD)


def _other_lookahead(prompt: tuple[int, ...], earlier: tuple[int, ...]) -> bool:
    """`prompt` shares a proper prefix with `earlier` and goes on with another token."""
    n = next((i for i, (a, b) in enumerate(zip(prompt, earlier)) if a != b), None)
    return n is not None and n > 0


def draw_prompt(
    data: st.DataObject, prompt: tuple[int, ...], earlier: Sequence[tuple[int, ...]]
) -> tuple[int, ...]:
    """`prompt`, or (about half the time, when there is one) an earlier request's prompt as it was."""
    if not earlier:
        return prompt
    again: bool = data.draw(st.booleans(), label="same prompt as an earlier request")
    if not again:
        return prompt
    return tuple(data.draw(st.sampled_from(list(earlier)), label="earlier prompt"))


def draw_sibling(
    data: st.DataObject, earlier: Sequence[tuple[int, ...]], block: int
) -> tuple[tuple[int, ...], dict[str, Any]] | None:
    """Under Eagle's lookahead hashes (`block`: the hash block), about a third of the time an
    earlier request's first whole blocks, under its identity, going on with another token:
    the same blocks under another lookahead, where a lookahead-hashing defect shows (most
    often cut at the earlier prompt's last hashed block, whose lookahead is its newest
    token). None: no such prompt drawn. Returns the prompt and its `AddRequest` fields."""
    longer = [p for p in earlier if len(p) > block]
    if not longer or not data.draw(st.sampled_from([False, False, True]), label="another lookahead?"):
        return None
    base = data.draw(st.sampled_from(longer), label="earlier prompt to go on from")
    last = (len(base) - 1) // block
    kept = last if data.draw(st.booleans(), label="cut at its last block?") else None
    cut = block * (kept or data.draw(st.integers(1, last), label="blocks kept"))
    other = base[cut] % 3 + 1  # another of the fuzzer's tokens (1..3)
    prompt = (
        tuple(base[:cut]) + (other,) + tuple(data.draw(st.lists(st.integers(1, 3), max_size=2), label="more"))
    )
    return prompt, fields(identity_of(base), len(prompt))


def fields(identity: Identity, prompt_len: int) -> dict[str, Any]:
    """`identity` as an `AddRequest`'s fields, its items that fit a `prompt_len`-token prompt."""
    out: dict[str, Any] = {}
    if identity.salt:
        out["salt"] = identity.salt
    if identity.lora is not None:
        out["lora"] = identity.lora
    items = tuple((m.identifier, m.offset, m.length) for m in identity.mm if m.end <= prompt_len)
    if items:
        out["mm"] = items
    return out


def draw_identity(data: st.DataObject, prompt: tuple[int, ...], supported: frozenset[str]) -> dict[str, Any]:
    """An `AddRequest`'s identity fields for `prompt` (empty: none), among `supported`."""
    out: dict[str, Any] = {}
    if "salt" in supported:
        salt = data.draw(st.sampled_from((None, *SALTS)), label="salt")
        if salt is not None:
            out["salt"] = salt
    if "lora" in supported:
        lora = data.draw(st.sampled_from((None, *ADAPTERS)), label="lora")
        if lora is not None:
            out["lora"] = lora
    if "mm" in supported and data.draw(st.booleans(), label="image"):
        ident, length = data.draw(st.sampled_from(IMAGES), label="image kind")
        if len(prompt) >= length:
            offset = data.draw(st.integers(0, len(prompt) - length), label="image offset")
            out["mm"] = ((ident, offset, length),)
    return out


def count(
    features: Any,
    identity: Identity,
    prompt: tuple[int, ...],
    seen: Mapping[tuple[int, ...], set[Identity]],
    lookahead_hashed: bool = False,
) -> None:
    """Count one added request's identity in `features` (a Counter); `seen`: the
    identities each earlier prompt of the example was added with; `lookahead_hashed`: the
    configuration hashes Eagle's lookahead tokens (`Config.hash_lookahead`)."""
    if lookahead_hashed:
        features[LOOKAHEAD] += 1
        if any(_other_lookahead(prompt, p) for p in seen):
            features[OTHER_LOOKAHEAD] += 1
    if identity.salt:
        features[SALTED] += 1
    if identity.lora is not None:
        features[ADAPTER] += 1
    if identity.mm:
        features[MULTIMODAL] += 1
    if prompt in seen and identity not in seen[prompt]:
        features[REUSED] += 1


def summary_row(features: Mapping[str, int], supported: frozenset[str]) -> str:
    """One row: how many requests of each identity the run generated ("-": not
    expressed by the target; lookahead hashing: counted where a run turns it on)."""
    fields = [
        f"salted {features.get(SALTED, 0)}" if "salt" in supported else "salted -",
        f"adapter {features.get(ADAPTER, 0)}" if "lora" in supported else "adapter -",
        f"multimodal {features.get(MULTIMODAL, 0)}" if "mm" in supported else "multimodal -",
        f"lookahead-hashed {features.get(LOOKAHEAD, 0)}",
        f"same prompt, other identity {features.get(REUSED, 0)}",
    ]
    return ("identities: " + ", ".join(fields))[:120]


NAMES = {"salt": "salted requests (cache_salt)", "lora": "LoRA adapters", "mm": "multimodal items"}


def not_generated(supported: frozenset[str]) -> tuple[str, ...]:
    """The identities a run does not draw, each with why (the fuzz summary's list)."""
    out = [f"{NAMES[k]} (the target takes none)" for k in sorted(NAMES) if k not in supported]
    out.append("prompt embeds (kvretain's operations carry token ids only)")
    return tuple(out)
