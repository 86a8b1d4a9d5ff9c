"""Every disagreement on a release, put in one of four classes.

- **defect**: a catalogue invariant breaks on a release that has the mechanism
  the invariant guards (or a general one: accounting, hits, events), or vLLM
  itself raises: a bug that release ships.
- **predates**: an invariant of a mechanism the release does not have yet
  breaks (e.g. no_waste before #42258's block mask): the release's design of
  the time, named with the PR that changed it, never silently tolerated.
- **semantics**: the release and the model disagree (observation, snapshot)
  while no invariant breaks: a difference the model's profile lacks. The
  note names the profile the model predicted (its switches that differ from
  0.33.0, `Profile.describe`), so a reader sees which design was judged.
- **adapter**: the adapter could not drive the release (it passed an argument
  or called a method the release does not have): kvretain's gap, not vLLM's.

Invariants are mapped to the capability (`vllm_capabilities`) that guards them;
one absent from `GUARDED_BY` holds for every release.
"""

from __future__ import annotations

from dataclasses import dataclass

from invariants.targets.vllm_capabilities import MECHANISM_PR, Capabilities

CLASSES = ("defect", "predates", "semantics", "adapter")
# The classes every check counts and runs past: the release's design of the time,
# which its profile models (the report states them once per release).
KNOWN_DESIGN = frozenset({"predates"})

# invariant -> the capabilities it presumes (all must be present for a break to be a defect)
GUARDED_BY: dict[str, tuple[str, ...]] = {
    "uncached_reused_before_cached": ("free_order",),
    "scratch_never_flushes_cache": ("free_order",),
    "no_waste": ("block_mask", "mamba_retention"),
    "promise_kept": ("retention", "shared_prefix_junction"),
    "eagle_extra_block_kept": ("block_mask",),
}
DIFFERENTIAL = ("observation", "snapshot")
# Raised by the adapter's own bookkeeping or argument passing, not by vLLM's allocator.
ADAPTER_ERRORS = ("TypeError", "AttributeError", "ImportError", "NameError")


@dataclass(frozen=True)
class Verdict:
    kind: str
    note: str


def classify(check: str, message: str, caps: Capabilities) -> Verdict:
    """The class of one violation (`check`: an invariant name, a differential
    check or "crash") on the release whose capabilities are `caps`."""
    missing = set(caps.missing())
    if check in DIFFERENTIAL:
        lacks = ", ".join(f"{m} ({MECHANISM_PR.get(m, m)})" for m in sorted(missing)) or "nothing known"
        return Verdict(
            "semantics",
            f"the model predicted profile [{caps.profile().describe()}]; the release follows a rule "
            f"this profile lacks (mechanisms the release lacks: {lacks})",
        )
    if check == "crash":
        if message.startswith("ValueError: ") and " raised on " not in message:
            # The adapter refused an operation the model's bookkeeping allowed:
            # the two views of a request diverged after a semantics difference.
            return Verdict("semantics", "request states diverged after an earlier semantics difference")
        if (
            "the vLLM adapter (" in message
            or any(f"{err}:" in message for err in ADAPTER_ERRORS)
            or "comes from no known request" in message
        ):
            return Verdict("adapter", "the adapter does not drive this release's API")
        return Verdict("defect", "vLLM raised while serving a valid operation")
    absent = [m for m in GUARDED_BY.get(check, ()) if m in missing]
    if absent:
        prs = ", ".join(f"{m} ({MECHANISM_PR.get(m, m)})" for m in absent)
        return Verdict("predates", f"{check} guards a mechanism this release lacks: {prs}")
    return Verdict("defect", f"{check} breaks on a release that has the mechanisms it guards")
