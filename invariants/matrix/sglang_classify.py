"""Classes of a disagreement on an SGLang release, in the vLLM matrix's terms (`classify`).

- **adapter**: kvretain could not drive the release (an argument or method it
  lacks: TypeError / AttributeError / ImportError / NameError, or a kernel with
  no CPU backend): kvretain's gap, not SGLang's.
- **semantics**: the release and kvretain's radix model (written for 0.5.23's
  unified cache) disagree on a prediction (`radix_hit_matches_model`,
  `radix_full_eviction_matches_model`, `radix_eviction_lru`,
  `radix_full_promise_kept`) while no accounting invariant breaks: a design of
  that cache family the model does not describe.
- **defect**: an invariant every radix cache must keep breaks (pool
  conservation, slot disjointness, double free, locked path kept, events
  replay, refusal justified, SGLang's own sanity check or assertion).

`aspect` names what a legacy-vs-unified disagreement concerns, so the report
can say per component what differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREDICTIONS = frozenset(
    {
        "radix_hit_matches_model",
        "radix_full_eviction_matches_model",
        "radix_eviction_lru",
        "radix_full_promise_kept",
    }
)
ADAPTER_ERRORS = ("TypeError:", "AttributeError:", "ImportError:", "NameError:", "active drivers")


@dataclass(frozen=True)
class Verdict:
    kind: str
    note: str


def classify(check: str, message: str, family: str) -> Verdict:
    """The class of one violation (`check` an invariant name or `sglang_raised`) on `family`."""
    if check == "sglang_raised" and any(err in message for err in ADAPTER_ERRORS):
        return Verdict("adapter", "the adapter does not drive this release's API")
    if check in PREDICTIONS:
        return Verdict(
            "semantics",
            f"the {family} cache follows a rule kvretain's radix model (0.5.23 unified) does not describe",
        )
    if check == "radixcores_agree":
        return Verdict("defect", "the Python and Rust tree cores of one release disagree")
    return Verdict("defect", f"{check} breaks on the {family} cache")


_POOL = re.compile(r"\('(full|swa|mamba)', (-?\d+), (-?\d+), (-?\d+)\)")


def aspect(op_kind: str, message: str) -> str:
    """What a `radixcores_agree` message between the unified and legacy caches concerns.

    `Admit: ... (hit, ...)` with different hits -> `hit length`; `Evict: ...`
    with different counts -> `eviction amount (full/swa/mamba)`; `pools after
    OP` -> `OP: <pool> <part>` for each pool part that differs (available,
    evictable, protected); otherwise `OP: result`.
    """
    if message.startswith("pools after"):
        first, _, second = message.partition(" != ")
        a = {m[0]: m[1:] for m in _POOL.findall(first)}
        b = {m[0]: m[1:] for m in _POOL.findall(second)}
        parts = ("available", "evictable", "protected")
        diffs = [
            f"{pool} {parts[i]}"
            for pool in ("full", "swa", "mamba")
            if pool in a and pool in b
            for i in range(3)
            if a[pool][i] != b[pool][i]
        ]
        return f"{op_kind}: " + (", ".join(diffs) or "pool accounts")
    tuples = re.findall(r"\((None|\d+), (None|\([^)]*\)), (True|False), (True|False)\)", message)
    if len(tuples) == 2:
        (h1, e1, r1, _), (h2, e2, r2, _) = tuples
        if h1 != h2:
            return f"{op_kind}: hit length"
        if e1 != e2:
            comps = [
                c
                for c, x, y in zip(
                    ("full", "swa", "mamba"), e1.strip("()").split(", "), e2.strip("()").split(", ")
                )
                if x != y
            ]
            return f"{op_kind}: eviction amount ({'/'.join(comps)})"
        if r1 != r2:
            return f"{op_kind}: admission (one cache refused)"
    return f"{op_kind}: result"
