"""Free-queue routing: where a freed block goes, and the older releases' orders.

The rule (vLLM 0.33.0 `BlockPool.free_blocks`): a block whose ref count drops
to 0 goes
- to the pinned tier if it is pinned (#40676, the seeds' design);
- to the head of the regular queue if it carries no hash (reused first, most
  recently freed first), or whatever its hash when caching is off;
- to the tail if it carries a hash (reused last, least recently freed first).
A block still referenced elsewhere stays where it is; the null block never
moves. `route` states the rule for one block; `model.machine.pool.Pool.free` applies
it to a freed run inline (it runs once per freed block) and a test holds the
two together.

Release variants:
- `FREE_ORDERS` (profile switch `free_order`): before the pool routed every
  free (#42656), callers decided, and some appended whatever the hash:
  `FreeOrder` names, per kind of free, whether every block goes to the tail.
  Read from the releases' `BlockPool.free_blocks`: 0.22.0 appends every
  block, 0.23.0 takes the caller's `prepend=` (#43447 passes it for SWA's
  own frees), 0.24.0 splits every free itself (#42656).
- `CACHING_OFF_ORDERS` (profile switch `caching_off_free_to_head`): with
  prefix caching off, freed blocks went to the tail (FIFO) in 0.27.x only
  (#48017's fast path appended them; #51482 restored the head in 0.28.0).
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD, TAIL, PINNED = "head", "tail", "pinned"
KINDS = frozenset({"full", "swa", "mamba"})


def route(*, pinned: bool, hashed: bool, caching: bool, appended: bool, caching_off_to_head: bool) -> str:
    """Where a block whose ref count reached 0 goes: PINNED, HEAD or TAIL.

    `appended`: an older release's caller sent every block of this free to the
    tail (`FreeOrder`); `caching_off_to_head`: the caching-off variant
    (`CachingOff.to_head`).
    """
    if pinned:
        return PINNED
    if appended:
        return TAIL
    if not caching:
        return HEAD if caching_off_to_head else TAIL
    return TAIL if hashed else HEAD


# ------------------------------------------------------------------ variants
@dataclass(frozen=True)
class FreeOrder:
    """Which frees send every block to the tail instead of routing it (`route`'s `appended`).

    The kinds of free: a finished (or preempted) request's table, per group
    kind; blocks a request skipped (out of the SWA window, retired Mamba
    states); the stale Mamba state a new chunk leaves behind.
    """

    since: str
    finished_to_tail: frozenset[str]
    skipped_to_tail: bool
    stale_state_to_tail: bool


POOL_ROUTES = FreeOrder(
    "0.24.0 (#42656 'Apply LRU policy only to proper cache entries'): the pool routes every freed"
    " block, uncached to the head, cached to the tail",
    finished_to_tail=frozenset(),
    skipped_to_tail=False,
    stale_state_to_tail=False,
)
CALLER_ROUTES = FreeOrder(
    "0.23.0 (#43447, SWA's own frees): callers choose `prepend=`; SWA splits its frees into"
    " uncached (head) and cached (tail), a finished request's full-attention and Mamba blocks"
    " and a stale Mamba state are appended",
    finished_to_tail=frozenset({"full", "mamba"}),
    skipped_to_tail=False,
    stale_state_to_tail=True,
)
APPEND_ALL = FreeOrder(
    "0.21.0, 0.22.0 (before #43447): every freed block is appended to the tail",
    finished_to_tail=KINDS,
    skipped_to_tail=True,
    stale_state_to_tail=True,
)
FREE_ORDERS: dict[str, FreeOrder] = {"pool": POOL_ROUTES, "caller": CALLER_ROUTES, "append": APPEND_ALL}


@dataclass(frozen=True)
class CachingOff:
    """With prefix caching off, whether freed blocks go to the head (`route`'s `caching_off_to_head`)."""

    since: str
    to_head: bool


LIFO = CachingOff(
    "0.24.0 .. 0.26.0 (#42656: no block carries a hash, so each goes to the head) and 0.28.0 on"
    " (#51482): caching off, freed blocks go to the head (reused first)",
    to_head=True,
)
FIFO = CachingOff(
    "0.27.0, 0.27.1 (#48017's caching-off fast path appends): caching off, freed blocks go to the tail",
    to_head=False,
)
CACHING_OFF_ORDERS: dict[bool, CachingOff] = {True: LIFO, False: FIFO}
