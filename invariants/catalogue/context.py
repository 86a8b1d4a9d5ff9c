"""What an invariant sees: the operation, the target's observation, the
snapshots before and after it, and a history the state machine keeps from the
target's own observations (never from the model)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from invariants.catalogue.isolation import IsolationLedger
from model.contract.config import Config
from model.contract.observation import BlockIds, BlockKey, Event, Observation, ProbeResult, Snapshot, Tokens
from model.contract.ops import Op
from model.contract.prefix import grown
from model.contract.profile import MODELED, Profile


@dataclass
class RequestHistory:
    prompt: Tokens
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    running: bool = False
    ever_preempted: bool = False
    boundaries: set[int] = field(default_factory=set)
    hit: int = 0  # the prefix hit at its latest admission
    # Speculative decoding (`model.policy.spec_decode`): drafts proposed, drafts the last step verified.
    drafts: tuple[int, ...] = ()
    verifying: tuple[int, ...] = ()
    offered: int = 0  # a KV connector's standing offer (`model.contract.ops.Offer`), until an admission
    external: int = 0  # the tokens a KV connector supplied past the hit at its latest admission
    # Its failed async load was rolled back (freed, nothing computed) and it has not run since:
    # vLLM keeps it among the in-flight prefills (`model.machine.connector`, `in_flight_reserve`).
    rolled_back: bool = False
    # The worker's view (`model.contract.worker_table`), rebuilt from the shipped blocks: its table
    # (None while not running, or unknown: an admission with a connector's external tokens),
    # the end of the latest step that ran it, the drafts its sample accepted since, and the
    # (state end, accepted) the latest step read its Mamba state from.
    worker: tuple[BlockIds, ...] | None = None
    state_end: int = 0
    accepted: int = 0
    read_from: tuple[int, int] = (0, 0)

    # The joined tuple is kept (outputs grow, but for a dropped sample: `drop_outputs`), so
    # naming its prefixes is memoised.
    _joined: Tokens = field(default=(), init=False, repr=False, compare=False)

    def drop_outputs(self, n: int) -> None:
        """The last `n` sampled tokens taken back (a sample vLLM skipped: `model.machine.failed_blocks`)."""
        del self.outputs[len(self.outputs) - n :]
        self._joined = ()

    @property
    def tokens(self) -> Tokens:
        self._joined = grown(self.prompt, self.outputs, self._joined)
        return self._joined


@dataclass
class Unwritten:
    """A block whose KV a failed load left garbage: `why` names the load (for a
    report), `written` counts the tokens a step has computed into it since, from
    the block's start."""

    why: str
    written: int = 0


@dataclass
class History:
    """Facts accumulated over the trace, for properties that need the past.

    - `free_tick[b]`: the step at which block b last entered the regular queue;
    - `evicted_in_place`: free blocks whose hashes `evict_blocks` dropped where
      they stood (vLLM leaves them in place; they are exempt from ordering);
    - `ever_cached`: every key seen in the hash map (`forget` drops those neither
      cached nor a prefix of a live request);
    - `shadow`: the hash map as an event consumer rebuilds it (key -> holders);
    - `requests`: the live requests; `finished`: the last finished ones (at most
      `FINISHED_KEPT` of them and `FINISHED_TOKENS` tokens, the latest always);
    - `unwritten[b]`: KV validity (`model.machine.connector`, a failed load): a block a
      KV connector's load failed on holds no valid KV until written again, with
      the tokens a step has written into it since, from its start, and what
      left it unwritten (`history.note_failed_loads`, `note_written`).
    """

    tick: int = 0
    free_tick: dict[int, int] = field(default_factory=dict)
    evicted_in_place: set[int] = field(default_factory=set)
    ever_cached: set[BlockKey] = field(default_factory=set)
    shadow: dict[BlockKey, int] = field(default_factory=dict)
    requests: dict[str, RequestHistory] = field(default_factory=dict)
    finished: dict[str, RequestHistory] = field(default_factory=dict)
    finished_tokens: int = 0  # prompt and output tokens of `finished`
    # `forget` runs when ever_cached grows past this (then twice what it kept).
    forget_at: int = 4096
    # A failed KV connector load ends its request (`kv_load_failure_policy="fail"`).
    failed_load_ends: bool = False
    unwritten: dict[int, Unwritten] = field(default_factory=dict)
    # Each group's block size (the checker sets it): where a load or a step writes in a
    # table; left empty, no block is marked unwritten (no KV validity is tracked).
    block_sizes: tuple[int, ...] = ()
    # Who wrote each block and the cache a KV-event router rebuilds (`catalogue.isolation`).
    isolation: IsolationLedger = field(default_factory=IsolationLedger)

    def all_requests(self) -> Iterator[RequestHistory]:
        """Live requests first, then finished ones (a lazy walk: callers often stop early)."""
        yield from self.requests.values()
        yield from self.finished.values()


BlockState = tuple[int, BlockKey | None, int, int]
"""(ref count, primary key, previous and next block in the free queue); see `NOT_FREE`."""
NOT_FREE = -1


@dataclass
class Delta:
    """What one operation changed, as the target reported it (the fast path).

    `blocks` / `holders`: the touched blocks' state and touched keys' holders
    after the operation; `before_blocks` / `before_holders`: the same entries
    just before it. `uses[b]`: block-table entries naming b, over every request.
    `key_of`: every block's primary key after the operation. `free_uncached`:
    free blocks without a hash after it. `idle_before`: no block was in use
    before it.
    """

    blocks: dict[int, BlockState]
    before_blocks: dict[int, BlockState]
    holders: dict[BlockKey, BlockIds]
    before_holders: dict[BlockKey, BlockIds]
    uses: Mapping[int, int]
    key_of: Mapping[int, BlockKey]
    free_uncached: AbstractSet[int]
    idle_before: bool
    free_len: int

    def is_free(self, b: int) -> bool:
        return self.blocks[b][2] != NOT_FREE


class CachedView(Mapping[BlockKey, BlockIds]):
    """A hash map as `touched` overrides over a mirror (absent keys map to ())."""

    def __init__(self, mirror: Mapping[BlockKey, BlockIds], touched: Mapping[BlockKey, BlockIds]) -> None:
        self.mirror, self.touched = mirror, touched

    def __getitem__(self, key: BlockKey) -> BlockIds:
        value = self.touched[key] if key in self.touched else self.mirror[key]
        if not value:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        value = self.touched[key] if key in self.touched else self.mirror.get(key)  # type: ignore[index, call-overload]
        return bool(value)

    def get(self, key: BlockKey, default: BlockIds | None = None) -> BlockIds | None:  # type: ignore[override]
        value = self.touched[key] if key in self.touched else self.mirror.get(key)
        return value if value else default

    def __iter__(self) -> Iterator[BlockKey]:
        for k in self.mirror:
            if k not in self.touched:
                yield k
        yield from (k for k, v in self.touched.items() if v)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RefCounts:
    """Ref counts after an operation: the touched blocks' states over the mirror's."""

    def __init__(self, touched: Mapping[int, BlockState], mirror: Sequence[BlockState]) -> None:
        self.touched, self.mirror = touched, mirror

    def __getitem__(self, block: int) -> int:
        state = self.touched.get(block)
        return (state if state is not None else self.mirror[block])[0]


@dataclass(frozen=True)
class StateView:
    """The part of a snapshot the fast path can give without a full one: the hash
    map, the events, and the tables and ref counts of the requests an operation names."""

    cached: Mapping[BlockKey, BlockIds]
    events: tuple[Event, ...] = ()
    tables: Mapping[str, tuple[BlockIds, ...]] = field(default_factory=dict)
    ref_cnt: RefCounts | None = None


@dataclass
class CheckContext:
    config: Config
    op: Op
    obs: Observation
    before: Snapshot
    after: Snapshot
    history: History
    probe: Callable[[Tokens], ProbeResult] | None = None
    finished_request: RequestHistory | None = None
    # Set on the fast path: then `before` / `after` are `StateView`s, not snapshots.
    delta: Delta | None = None
    # The design the target is judged by (an older release's in the matrix).
    profile: Profile = MODELED
    # Draft state blocks per Mamba group (`model.contract.mamba`): the drafts a step verifies, 0 without.
    draft_blocks: int = 0

    @property
    def alignment(self) -> int:
        return self.config.scheduler_block_size
