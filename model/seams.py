"""What the machine tells whoever watches it, declared so that the spec keeps no judge state.

`AllocatorModel` reports to an `Observer` and holds nothing for it: no coverage
counter, no decision log, no choice a judge made. The harness implements it
(`invariants.harness.observer`); a model built without one reports to
`UNOBSERVED`, which keeps nothing.

- `fired(rule)`: a rule only some traces reach fired (the fuzz summary counts them).
- `decided(decision)`: a scheduler decision inside an operation (`Decision`), in order:
  each allocation attempt and each preemption. A step's result alone cannot tell during
  whose allocation a request was preempted, nor the chunk of an admission that did not fit.
- `end_order(rids)`: where the contract leaves an order open (a "fail" report ending
  several requests at once: any order of exactly them is allowed), the order to take;
  the model takes it where it names exactly `rids`, else id order.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Decision(NamedTuple):
    """One scheduler decision inside an operation (`Observer.decided`)."""

    kind: str  # "alloc": an allocation attempt; "preempt": a request preempted (its blocks freed)
    rid: str
    tokens: int = 0  # alloc: the chunk the attempt asked blocks for
    admission: bool = False  # alloc: it carried the request's prefix-cache hit (an admission)
    fits: bool = False  # alloc: the blocks were granted


class Observer(Protocol):
    """Who watches the machine (module docstring)."""

    def fired(self, rule: str) -> None: ...

    def decided(self, decision: Decision) -> None: ...

    def end_order(self, rids: tuple[str, ...]) -> tuple[str, ...]: ...


class Unobserved:
    """The observer of a model nobody watches: it keeps nothing and chooses nothing."""

    def fired(self, rule: str) -> None:
        pass

    def decided(self, decision: Decision) -> None:
        pass

    def end_order(self, rids: tuple[str, ...]) -> tuple[str, ...]:
        return ()


UNOBSERVED = Unobserved()
