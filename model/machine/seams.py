"""The machine's two declared interfaces: what it tells whoever watches it (`Observer`), and
what the connector's and the failed-block cut's rules may read and do on it (`Machine`).

`AllocatorModel` reports to an `Observer` and holds nothing for it: no coverage
counter, no decision log, no choice a judge made. The harness implements it
(`invariants.harness.observer`); a model built without one reports to
`UNOBSERVED`, which keeps nothing.

- `fired(rule)`: a rule only some traces reach fired (the fuzz summary counts them).
- `decided(decision)`: a scheduler decision inside an operation (`Decision`), in order:
  each allocation attempt and each preemption. A step's result alone cannot tell during
  whose allocation a request was preempted, nor the chunk of an admission that did not fit.
- `order_to_end(rids)`: where the contract leaves an order open (a "fail" report ending
  several requests at once: any order of exactly them is allowed), the order to take;
  the model takes it where it names exactly `rids`, else id order.

`Machine` is what `model.machine.connector` and `model.machine.failed_blocks` are given instead of
`AllocatorModel` (which implements it): its state, read and written as the rules
state, and the steps they compose (an allocation attempt, a chunk, caching, a free).
They reach nothing else of it, and import nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from model.contract.config import Config
    from model.contract.observation import ScheduleResult
    from model.machine.async_scheduling import InFlight
    from model.machine.pool import Pool
    from model.machine.state import GroupState, RequestState, SyncReport
    from model.policy.queues import QueueOrder

Blocks = tuple[tuple[int, ...], ...]  # block ids per group


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

    def order_to_end(self, rids: tuple[str, ...]) -> tuple[str, ...]: ...


class Unobserved:
    """The observer of a model nobody watches: it keeps nothing and chooses nothing."""

    def fired(self, rule: str) -> None:
        pass

    def decided(self, decision: Decision) -> None:
        pass

    def order_to_end(self, rids: tuple[str, ...]) -> tuple[str, ...]:
        return ()


UNOBSERVED = Unobserved()


class Machine(Protocol):
    """The allocator machine as the connector's rules see it (module docstring)."""

    cfg: Config
    num_spec_tokens: int  # drafts a step verifies
    requests: dict[str, RequestState]  # the live requests
    groups: list[GroupState]
    pool: Pool
    in_flight: InFlight | None  # async scheduling's unprocessed outputs (`model.machine.async_scheduling`)
    held: set[str]  # finished, blocks held until their load reports
    saving: set[str]  # the connector saves these at their finish
    sending: set[str]  # finished, blocks held until their save reports
    undelivered: dict[str, int]  # rid -> the latest step's tokens, output undelivered
    step_shares: frozenset[str]  # every share of the latest step's output
    sync_report: SyncReport | None  # the latest step's sync loads, until the next operation
    order: QueueOrder  # `running` and `holding` between steps (`model.policy.queues`)
    observer: Observer

    def allocate_slots(self, req: RequestState, n: int, hit: int, hit_blocks: Blocks | None) -> Blocks | None:
        """Blocks for `n` more tokens of `req` (None: they do not fit; nothing changed)."""
        ...

    def ran(self, req: RequestState, n: int) -> None:
        """`req` computes `n` more tokens this step (the drafts they reach are verified)."""
        ...

    def admit(
        self, req: RequestState, left: int, budget: int, ran_running: bool = False, ran_prefill: bool = False
    ) -> ScheduleResult:
        """A waiting request's admission: lookup, offer, first chunk of at most `left` tokens."""
        ...

    def chunk(self, req: RequestState, start: int, n: int, budget: int) -> int:
        """The chunk of `n` tokens from `start` after the Mamba split (`model.policy.scheduling`)."""
        ...

    def long_prefill_capped(self, num_tokens: int) -> int:
        """`num_tokens` under the step's long-prefill cap."""
        ...

    def cache_blocks(self, req: RequestState, num_tokens: int) -> None:
        """Cache `req`'s blocks up to `num_tokens` (`model.machine.caching`)."""
        ...

    def free(self, rid: str) -> None:
        """Free every block of `rid` (or fence them: `model.machine.async_scheduling`)."""
        ...

    def skipped_tokens(self, g: GroupState, computed: int) -> int:
        """Tokens of `computed` that group `g` never reads again (out of window, stale state)."""
        ...

    def remove_skipped(self, g: GroupState, rid: str, computed: int) -> None:
        """Free `rid`'s blocks of group `g` that no token after `computed` reads."""
        ...

    def draft_blocks(self, g: GroupState) -> int:
        """A Mamba group's draft state blocks (0 for the other kinds)."""
        ...

    def outputs_arrive(self, scheduled: dict[str, int] | None, cut: Callable[[], set[str]] = set) -> None:
        """Async scheduling: the previous step's output processed (`model.machine.async_scheduling`)."""
        ...
