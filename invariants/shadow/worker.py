"""The shadow worker: what a GPU model runner does with each `SchedulerOutput`,
kept as provenance instead of tensors.

Contract judged (any scheduler policy that keeps it is correct):

- **Every read finds its own prefix.** For each position `p` a request's
  forward pass attends to (full attention: `[0, end)`; sliding window:
  `[start - window + 1, end)`), the slot its block table maps `p` to holds the
  provenance (`prefixes.PrefixIds`) of that request's own tokens `t[0..p]`:
  written by this step (the batch's KV is written before any request of the
  step reads it), by an earlier step, by another request with the same prefix
  (a hit), or copied there (`kv_cache_block_copies`). A slot never written, a
  zeroed slot, the null block, or another prefix's KV is a wrong read: the
  output would differ from a run with no cache.
- **Positions are the worker's own.** The worker computes positions
  `[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)` of the
  tokens it knows (a new request's prompt, then what it sampled, then the
  step's drafts): a step past them, a running request whose shipped
  `num_computed_tokens` differs from what the worker computed (its last step
  less the drafts its sample rejected), a cached request the worker does not
  hold (finished, preempted under the V2 runner, never added), or a sample
  after a step that stopped short of the request's last token (the worker
  samples at the last computed position) breaks it.
- **The drafter's lookahead is the reader's own** (Eagle's lookahead block hashes,
  `lookahead` L > 0): the drafter's KV at position `p` is computed from the L tokens
  past it, so a slot also holds the provenance of `t[0..p+L]` once those are known
  (`ahead`), and a read of it by a request that knows its own `t[p+L]` must find that
  provenance: a hit on a block whose hash covered other lookahead tokens reads another
  prefix's drafter KV. Judged under synchronous scheduling (one step ahead a slot's
  lookahead may be a token not returned yet).
- **Fresh blocks are zeroed before they are read** where the KV cache needs
  it (`KVCacheConfig.needs_kv_cache_zeroing`: Mamba layers share the pages,
  #35219): a block newly placed in a table past the computed tokens holds
  stale bytes until `new_block_ids_to_zero` zeroes it or the step writes it,
  and attention reads the masked tail of its last block too.

Runners followed (vLLM 0.33.0): the V2 runner (`vllm/v1/worker/gpu/
model_runner.py`: `finish_requests` drops finished and preempted requests,
`add_requests` installs `scheduled_new_reqs` with `prefill_token_ids`,
`update_requests` overwrites `num_computed_tokens`, appends `new_block_ids`,
zeroes, then copies) and the V1 runner (`gpu_model_runner._update_states`:
preempted requests keep their state, a `resumed_req_ids` entry replaces the
table, `all_token_ids` restores tokens). Left out (docs/shadow-worker.md):
Mamba state provenance (the catalogue's `steps` invariants judge it) and the
drafter's own KV. One step ahead (async scheduling) a step runs once the tokens
it reads are returned, in order (`synchronous` off); with drafts the shipped
count of a request includes the drafts of its share the scheduler had not seen
the output of, which the runner takes off once rejected (`_unrolled`), and the
drafts are the runner's own, shipped as placeholders (`_rewrite`). A KV connector's loads and saves are `connector`'s: it
writes a load's provenance through `hook` before a step's forward pass and
runs its other events in the worker's order (`after`); a block a failed load
left unwritten holds `FAILED`, and so does every slot a step computed over it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .prefixes import EMPTY, PrefixIds

NULL_BLOCK = 0
STALE = -1  # a slot of a fresh block not yet zeroed or written (zeroing configurations)
FAILED = -2  # a slot a failed KV load left unwritten, or one a step computed over such a slot

Runner = Literal["v1", "v2"]

READS = "worker_reads_own_prefix"
POSITIONS = "worker_positions_consistent"
ZEROED = "worker_blocks_zeroed"

# The shadow worker's checks: each a sentence, judged on every step it sees.
CHECKS: dict[str, str] = {
    READS: "every KV slot a step's attention reads holds the reading request's own prefix",
    POSITIONS: "the positions a step computes and samples are the worker's own count of them",
    ZEROED: "a fresh block is zeroed or written before attention reads it (where zeroing is needed)",
}


class StepHook(Protocol):
    """What a step's forward pass waits on besides the scheduler's output: a KV
    connector's loads (`invariants.shadow.connector`)."""

    def before_forward(self, out: Any) -> None: ...


Step = tuple[Any, dict[str, "Chunk"]]


@dataclass(frozen=True)
class WorkerGroup:
    """One KV-cache group as the worker lays it out: `kind` "full", "swa" or "mamba"."""

    kind: str
    block_size: int
    sliding_window: int | None = None


@dataclass
class WorkerFigures:
    """What the shadow worker checked: steps executed, slots read and written."""

    steps: int = 0
    reads: int = 0
    writes: int = 0
    zeroed: int = 0
    copies: int = 0
    problems: int = 0


@dataclass(eq=False)
class Chunk:
    """One request's share of one step: the positions the worker ran, and the tokens
    the runner returned for it (None: not yet)."""

    rid: str
    start: int = 0
    end: int = 0
    drafts: int = 0
    complete: bool = False
    ran: bool = False
    tokens: list[int] | None = None
    taken: int = 0  # how many returned tokens the worker appended for it
    output: int = -1  # the scheduler's output processing that returned its tokens (`processed`)
    # One step ahead: the request's share whose output the scheduler had not processed when it
    # scheduled this one (its count assumed every draft of it accepted), and, once that share's
    # tokens are taken, how many of its drafts were rejected (None: not known yet).
    after: Chunk | None = None
    rejected: int | None = None
    placeholders: bool = False  # its drafts were shipped as placeholders (async: the runner's own)


@dataclass
class RequestView:
    """One request as the worker holds it."""

    tokens: list[int]
    ids: list[int]  # ids[p]: the provenance of tokens[0..p]
    computed: int
    tables: list[list[int]]
    last: Chunk | None = None  # the share of the last step the worker ran for it
    fresh: bool = True  # installed by the step now running (new, resumed): its admission


@dataclass
class ShadowWorker:
    """A model runner's bookkeeping over real `SchedulerOutput`s, with a
    provenance per KV slot (see the module docstring for the contract).

    `execute(out)` consumes one `SchedulerOutput` as the runner does before its
    forward pass, then writes and reads; `returned(rid, tokens)` is the runner's
    sampled tokens for `rid` (accepted drafts, then the new token); `take_problems`
    drains what broke the contract, as (check, message)."""

    groups: tuple[WorkerGroup, ...]
    runner: Runner = "v2"
    zeroing: bool = False
    # Eagle's lookahead block hashes: tokens past a position its drafter KV depends on (0: unjudged).
    lookahead: int = 0
    # Synchronous scheduling: a step runs when it is told. One step ahead (async
    # scheduling) a step may read a token its predecessor samples, which the worker
    # has once that output is returned: steps then wait, in order, for their tokens.
    synchronous: bool = True
    figures: WorkerFigures = field(default_factory=WorkerFigures)
    prefixes: PrefixIds = field(default_factory=PrefixIds)
    requests: dict[str, RequestView] = field(default_factory=dict)
    # block -> its slots' provenance (None: never written since zeroed or allocated), as long
    # as the block size of the group that last wrote it (a block reused by a group of
    # another size is laid out anew).
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    # block -> per slot, the provenance of its prefix and the `lookahead` tokens past it (None:
    # not known when written); kept only while the slot's `kv` entry is the one it was made with.
    ahead: dict[int, list[int | None]] = field(default_factory=dict)
    # block -> the block it is a copy of, made before anything was written to that one (until
    # it is zeroed or placed anew): a read of its unwritten slots names the copy (a finding's view).
    early_copies: dict[int, int] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    # The blocks the last step placed in a table past the computed tokens (allocated, not hit).
    fresh: list[int] = field(default_factory=list)
    # Steps told but not run yet (waiting for a token), with their shares, in order; and
    # the actions told between them (a connector's reports), run in the same order.
    queue: deque[Step | Callable[[], None]] = field(default_factory=deque)
    # rid -> its shares whose tokens were not returned yet, oldest first.
    shares: dict[str, deque[Chunk]] = field(default_factory=dict)
    # Tokens that will never be returned (their share came back empty), one per position.
    phantoms: int = 0
    # A KV connector's loads, written before each step's forward pass (None: no connector).
    hook: StepHook | None = None
    # Requests a failed load's report may cut: their next shipped count may be lower.
    may_cut: set[str] = field(default_factory=set)
    # The last step run: each request's (view, start, end, ids) (a failed load's report reads it).
    ran: list[tuple[str, RequestView, int, int, list[int]]] = field(default_factory=list)
    # How many times the scheduler processed a step's output (`processed`): a failed load's report
    # skips only the samples returned with it, in the same processing.
    outputs: int = 0

    # ------------------------------------------------------------------ what the runner is told
    def execute(self, out: Any) -> None:
        """One step, as the runner is told it: run at once, or (one step ahead) once
        the tokens it reads are returned (`returned`)."""
        chunks = {rid: Chunk(rid) for rid in out.num_scheduled_tokens}
        for data in out.scheduled_new_reqs:
            self.shares[data.req_id] = deque()  # a new request: an earlier one's shares are void
        for rid, chunk in chunks.items():
            pending = self.shares.setdefault(rid, deque())
            chunk.after = pending[-1] if pending else None
            pending.append(chunk)
        self.queue.append((out, chunks))
        self._drain()

    def returned(self, rid: str, tokens: Sequence[int]) -> None:
        """The runner's output for `rid`'s oldest unreturned share: its accepted
        drafts, then the token it sampled (empty: no sample, the drafts unverified)."""
        pending = self.shares.get(rid)
        if not pending:
            return
        chunk = pending.popleft()
        chunk.output = self.outputs
        if chunk.ran:
            self._take(rid, chunk, list(tokens))
        else:
            chunk.tokens = list(tokens)
        self._drain()

    def processed(self) -> None:
        """The scheduler processed the output whose tokens were `returned` since the last call
        (and any connector report with it): a later report cuts no sample of it."""
        self.outputs += 1

    def after(self, action: Callable[[], None]) -> None:
        """Run `action` once every step told before it has run (at once when none waits)."""
        self.queue.append(action)
        self._drain()

    def take_problems(self) -> list[tuple[str, str]]:
        """The contract breaks found since the last call, as (check, message)."""
        out, self.problems = self.problems, []
        return out

    # ------------------------------------------------------------------ what a KV connector does
    def own_ids(self, rid: str, tokens: Sequence[int] = ()) -> list[int]:
        """The provenance of each prefix of `rid`'s tokens as the worker holds them, or
        (a request it holds none of) of `tokens`."""
        view = self.requests.get(rid)
        return list(view.ids) if view is not None else self.prefixes.chain(EMPTY, tokens)

    def attention(self) -> Iterable[tuple[int, WorkerGroup]]:
        """The groups whose slots hold provenance (Mamba state is left out)."""
        return self._attention()

    def slots(self, block: int, group: int) -> list[int | None]:
        """Block `block`'s slots as laid out for `group` (None: never written)."""
        row = self.kv.get(block)
        bs = self.groups[group].block_size
        return list(row) if row is not None and len(row) == bs else [None] * bs

    def write_slots(self, block: int, group: int, offset: int, ids: Sequence[int | None]) -> None:
        """A transfer writes `ids` into `block`'s slots from `offset` on (laid out for `group`)."""
        bs = self.groups[group].block_size
        row = self.kv.get(block)
        if row is None or len(row) != bs:
            row = self.kv[block] = [None] * bs
        row[offset : offset + len(ids)] = list(ids)
        self._clear_ahead(block, bs, offset, offset + len(ids))

    def _clear_ahead(self, block: int, bs: int, lo: int, hi: int) -> None:
        """Slots [lo, hi) of `block` were written anew: their lookahead provenance is unknown."""
        slots = self.ahead.get(block)
        if slots is None:
            return
        if len(slots) != bs:
            del self.ahead[block]
        else:
            slots[lo:hi] = [None] * (hi - lo)

    def fail_blocks(self, invalid: Iterable[int], output: int | None = None) -> None:
        """A load failed on `invalid`: their slots hold no KV (`FAILED`), nor does any slot
        the last step computed over one of them (attention read it first); each request
        holding one may be cut (its next shipped count may be lower), and a cut request's
        sample returned with the report (`output`: the processing that carried it, default
        the current one) is skipped."""
        output = self.outputs if output is None else output
        bad = {b for b in invalid if b != NULL_BLOCK}
        for b in bad:
            row = self.kv.get(b)
            if row is not None:
                self.kv[b] = [FAILED if v is not None else None for v in row]
        for rid, view, start, end, _ in self.ran:
            if self.requests.get(rid) is not view:
                continue
            chunk = view.last
            # Its blocks before the step, less those a window left behind (vLLM freed them, nulled
            # in its own table, whatever the worker's still names: a reused id is not its block).
            before = [
                table[_window_start(spec, start) // spec.block_size : -(-start // spec.block_size)]
                for table, spec in zip(view.tables, self.groups)
            ]
            riding = chunk is not None and chunk.taken and chunk.output == output  # its sample
            if chunk is not None and riding and any(b in bad for t in before for b in t):
                # vLLM skips the output it processes with the report of a request it cuts (its
                # blocks before the step hold a failed one): the runner's sample is overwritten
                # by the next (`_take`'s tokens). A sample processed before the report stands.
                del view.tokens[-chunk.taken :], view.ids[-chunk.taken :]
                chunk.taken = 0
            for g, spec in self._attention():
                bs, table = spec.block_size, view.tables[g]
                lo = (
                    max(0, start - spec.sliding_window + 1)
                    if spec.kind == "swa" and spec.sliding_window
                    else 0
                )
                hit = next(
                    (i for i in range(lo // bs, -(-end // bs)) if i < len(table) and table[i] in bad), None
                )
                if hit is None:
                    continue
                for p in range(max(hit * bs, start), end):
                    block = table[p // bs] if p // bs < len(table) else NULL_BLOCK
                    row = self.kv.get(block)
                    if block != NULL_BLOCK and row is not None and len(row) == bs:
                        row[p % bs] = FAILED
        for rid, view in self.requests.items():
            if any(b in bad for table in view.tables for b in table):
                self.may_cut.add(rid)

    # ------------------------------------------------------------------ running steps
    def _drain(self) -> None:
        while self.queue and self._ready(self.queue[0]):
            head = self.queue.popleft()
            if callable(head):
                head()
            else:
                self._run(*head)

    def _ready(self, step: Step | Callable[[], None]) -> bool:
        """Can this step run: does the worker have every token it computes (a share
        returned empty will never bring its token: the step runs on a token the worker
        sampled and nobody saw, a phantom)? An action runs at once."""
        if self.synchronous or callable(step):
            return True
        out, chunks = step
        cached, spec = out.scheduled_cached_reqs, out.scheduled_spec_decode_tokens
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            view = self.requests.get(rid)
            chunk = chunks.get(rid)
            if chunk is not None and chunk.after is not None and chunk.after.rejected is None:
                return False  # the drafts the scheduler counted as accepted are not known yet
            computed -= _unrolled(chunk)
            need = computed + out.num_scheduled_tokens.get(rid, 0) - len(spec.get(rid, ()))
            if view is None or need <= len(view.tokens):
                continue
            if any(c is not chunks.get(rid) for c in self.shares.get(rid, ())):
                return False  # an earlier share of it is still to be returned
            self._append(view, range(-self.phantoms - 1, -self.phantoms - 1 - (need - len(view.tokens)), -1))
            self.phantoms += need - len(view.tokens)
        return True

    def _run(self, out: Any, chunks: dict[str, Chunk]) -> None:
        """One step: the requests' state, zeroing and copies, then the forward pass."""
        self.figures.steps += 1
        self._forget(out)
        fresh: list[tuple[int, int]] = []  # (group, block) newly placed past the computed tokens
        for data in out.scheduled_new_reqs:
            self._install(data, fresh)
        self._update_cached(out.scheduled_cached_reqs, fresh, chunks)
        self.fresh = [b for _, b in fresh]
        for b in self.fresh:  # placed anew: whatever it was a copy of is gone
            self.early_copies.pop(b, None)
        if self.zeroing:
            for g, b in fresh:
                self.kv[b] = [STALE] * self.groups[g].block_size
        for b in out.new_block_ids_to_zero or ():
            self.kv[b] = []
            self.ahead.pop(b, None)
            self.early_copies.pop(b, None)
            self.figures.zeroed += 1
        for copy in getattr(out, "kv_cache_block_copies", None) or ():
            self.kv[copy.dst_block_id] = list(self.kv.get(copy.src_block_id, []))
            if not any(v is not None and v != STALE for v in self.kv[copy.dst_block_id]):
                self.early_copies[copy.dst_block_id] = copy.src_block_id  # nothing written to copy
            else:
                self.early_copies.pop(copy.dst_block_id, None)
            self.ahead.pop(copy.dst_block_id, None)
            if copy.src_block_id in self.ahead:
                self.ahead[copy.dst_block_id] = list(self.ahead[copy.src_block_id])
            self.figures.copies += 1
        if self.hook is not None:
            self.hook.before_forward(out)
        self._forward(out.num_scheduled_tokens, out.scheduled_spec_decode_tokens, chunks)
        for rid, chunk in chunks.items():
            if chunk.tokens is not None:  # returned before the step could run
                self._take(rid, chunk, chunk.tokens)

    def _take(self, rid: str, chunk: Chunk, tokens: list[int]) -> None:
        """The tokens returned for `chunk`, a share the worker ran."""
        view = self.requests.get(rid)
        if view is None or not chunk.ran:
            return
        chunk.rejected = chunk.drafts - (len(tokens) - 1) if tokens else chunk.drafts
        latest = view.last is chunk
        if not tokens:
            if latest:
                view.computed = chunk.end - chunk.drafts
            return
        if not chunk.complete:
            self._problem(
                POSITIONS,
                f"{rid} is sampled after a step that computed positions [{chunk.start}, {chunk.end}) of "
                f"its {len(view.tokens) + chunk.drafts} tokens: the worker samples at position "
                f"{chunk.end - 1}, not at the request's last token",
            )
        if latest:
            view.computed = chunk.end - (chunk.drafts - (len(tokens) - 1))
        self._append(view, tokens)
        chunk.taken = len(tokens)
        if chunk.placeholders and len(tokens) > 1:
            # The runner computed its own drafts, shipped as placeholders: the accepted ones'
            # slots hold the KV of the tokens now returned.
            first = chunk.end - chunk.drafts
            self._rewrite(view, first, first + len(tokens) - 1)
        if self.lookahead and latest:
            self._write_ahead(view, max(chunk.start, view.computed - self.lookahead), view.computed)

    # ------------------------------------------------------------------ bookkeeping
    def _forget(self, out: Any) -> None:
        scheduled_cached = set(out.scheduled_cached_reqs.req_ids)
        for rid in sorted(set(out.finished_req_ids) & scheduled_cached):
            self._problem(POSITIONS, f"{rid} is both finished and scheduled as a cached request")
        gone = set(out.finished_req_ids)
        if self.runner == "v2":
            gone |= set(out.preempted_req_ids or ())
        for rid in gone:
            self.requests.pop(rid, None)
        for view in self.requests.values():
            view.fresh = False

    def _install(self, data: Any, fresh: list[tuple[int, int]]) -> None:
        """A new request (under the V2 runner also a resumed one, with all its tokens)."""
        if self.runner == "v2" and data.prefill_token_ids is not None:
            tokens = list(data.prefill_token_ids)
        else:
            tokens = list(data.prompt_token_ids or ())
        view = RequestView([], [], data.num_computed_tokens, [list(g) for g in data.block_ids])
        self._append(view, tokens)
        self.requests[data.req_id] = view
        self.may_cut.discard(data.req_id)
        self._fresh_past(view, fresh)

    def _update_cached(self, cached: Any, fresh: list[tuple[int, int]], chunks: dict[str, Chunk]) -> None:
        resumed = set(cached.resumed_req_ids) if self.runner == "v1" else set()
        for i, rid in enumerate(cached.req_ids):
            view = self.requests.get(rid)
            if view is None:
                self._problem(
                    POSITIONS,
                    f"{rid} is scheduled as a cached request the worker does not hold "
                    "(finished, preempted under the V2 runner, or never sent as new)",
                )
                continue
            if self.runner == "v1" and rid in cached.all_token_ids:
                view.tokens, view.ids = [], []
                self._append(view, cached.all_token_ids[rid])
            # One step ahead the scheduler counted the drafts of the share it had not seen the
            # output of as accepted; the V2 runner takes its rejected ones off (`_unrolled`).
            shipped = cached.num_computed_tokens[i] - _unrolled(chunks.get(rid))
            # A failed load's cut (the worker reported the blocks) may only lower the count.
            cut = rid in self.may_cut and shipped <= view.computed
            self.may_cut.discard(rid)
            if rid not in resumed and shipped != view.computed and not cut:
                self._problem(
                    POSITIONS,
                    f"{rid} is told num_computed_tokens={shipped}; the worker computed {view.computed} "
                    "of its positions (its last step less the drafts its sample rejected)",
                )
            view.computed = shipped
            new = cached.new_block_ids[i]
            if rid in resumed:
                view.tables = [list(g) for g in new] if new is not None else [[] for _ in self.groups]
                view.fresh = True
                self._fresh_past(view, fresh)
            elif new is not None:
                for g, ids in enumerate(new):
                    view.tables[g].extend(ids)
                    fresh += [(g, b) for b in ids if b != NULL_BLOCK]

    def _fresh_past(self, view: RequestView, fresh: list[tuple[int, int]]) -> None:
        """The blocks of `view`'s table past its computed tokens: allocated, not hit."""
        for g, table in enumerate(view.tables):
            first = -(-view.computed // self.groups[g].block_size)
            fresh += [(g, b) for b in table[first:] if b != NULL_BLOCK]

    def _append(self, view: RequestView, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        view.ids += self.prefixes.chain(view.ids[-1] if view.ids else EMPTY, tokens)
        view.tokens += tokens

    # ------------------------------------------------------------------ the forward pass
    def _forward(
        self, scheduled: dict[str, int], drafts: dict[str, list[int]], shares: dict[str, Chunk]
    ) -> None:
        """Every request's writes, then every request's reads (a layer writes the
        batch's KV before its attention reads it)."""
        chunks: list[tuple[str, RequestView, int, int, list[int]]] = []
        for rid, n in scheduled.items():
            view = self.requests.get(rid)
            if view is None:
                continue  # reported by `_update_cached`
            spec = list(drafts.get(rid, ()))
            start, end = view.computed, view.computed + n
            known = len(view.tokens) + len(spec)
            if end > known:
                self._problem(
                    POSITIONS,
                    f"{rid} computes positions [{start}, {end}) but the worker knows {known} of its "
                    "tokens (prompt, samples and this step's drafts)",
                )
                continue
            ids = (
                view.ids + self.prefixes.chain(view.ids[-1] if view.ids else EMPTY, spec)
                if spec
                else view.ids
            )
            chunks.append((rid, view, start, end, ids))
            share = shares[rid]
            share.placeholders = any(t < 0 for t in spec)
            share.start, share.end, share.drafts, share.complete, share.ran = (
                start,
                end,
                len(spec),
                end == known,
                True,
            )
            view.last, view.computed = share, end
        for rid, view, start, end, ids in chunks:
            self._write(rid, view, start, end, ids)
        for rid, view, start, end, ids in chunks:
            self._read(rid, view, start, end, ids)
        self.ran = chunks

    def _attention(self) -> Iterable[tuple[int, WorkerGroup]]:
        return ((g, spec) for g, spec in enumerate(self.groups) if spec.kind != "mamba")

    def _write(self, rid: str, view: RequestView, start: int, end: int, ids: list[int]) -> None:
        for g, spec in self._attention():
            bs, table = spec.block_size, view.tables[g]
            for i in range(start // bs, -(-end // bs)):
                block = table[i] if i < len(table) else NULL_BLOCK
                if block == NULL_BLOCK:
                    where = "the null block" if i < len(table) else f"no block (its table has {len(table)})"
                    self._problem(
                        READS, f"{rid} writes position {max(start, i * bs)} of group {g} into {where}"
                    )
                    break
                row = self.kv.get(block)
                if row is None or len(row) != bs:
                    row = self.kv[block] = [None] * bs
                lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
                row[lo - i * bs : hi - i * bs] = ids[lo:hi]
                self._clear_ahead(block, bs, lo - i * bs, hi - i * bs)
            self.figures.writes += end - start
        if self.lookahead:
            self._write_ahead(view, start, end)

    def _rewrite(self, view: RequestView, start: int, end: int) -> None:
        """Positions [start, end) of `view` hold its own prefix where its table still has them."""
        for g, spec in self._attention():
            bs, table = spec.block_size, view.tables[g]
            for p in range(start, min(end, len(view.ids))):
                block = table[p // bs] if p // bs < len(table) else NULL_BLOCK
                row = self.kv.get(block)
                if block != NULL_BLOCK and row is not None and len(row) == bs:
                    row[p % bs] = view.ids[p]

    def _write_ahead(self, view: RequestView, start: int, end: int) -> None:
        """The lookahead provenance of `view`'s positions [start, end) whose L tokens past
        them the worker knows (a sampled token, never a draft) and whose slot holds its prefix."""
        L = self.lookahead
        for g, spec in self._attention():
            bs, table = spec.block_size, view.tables[g]
            for p in range(start, min(end, len(view.tokens) - L)):
                block = table[p // bs] if p // bs < len(table) else NULL_BLOCK
                row = self.kv.get(block)
                if block == NULL_BLOCK or row is None or len(row) != bs or row[p % bs] != view.ids[p]:
                    continue
                slots = self.ahead.setdefault(block, [None] * bs)
                slots[p % bs] = view.ids[p + L]

    def _read(self, rid: str, view: RequestView, start: int, end: int, ids: list[int]) -> None:
        for g, spec in self._attention():
            bs, table = spec.block_size, view.tables[g]
            first = (
                max(0, start - spec.sliding_window + 1) if spec.kind == "swa" and spec.sliding_window else 0
            )
            wrong, where = 0, ""
            kinds: set[object] = set()
            for i in range(first // bs, -(-end // bs)):
                lo, hi = max(first, i * bs), min(end, (i + 1) * bs)
                block = table[i] if i < len(table) else NULL_BLOCK
                row = self.kv.get(block) if block != NULL_BLOCK else None
                got = (
                    row[lo - i * bs : hi - i * bs]
                    if row is not None and len(row) == bs
                    else [None] * (hi - lo)
                )
                if got == ids[lo:hi]:
                    continue
                bad = [lo + k for k, (a, b) in enumerate(zip(got, ids[lo:hi])) if a != b]
                if not wrong:
                    where = f"position {bad[0]} of group {g} from " + self._what(
                        block, i, len(table), got[bad[0] - lo]
                    )
                wrong += len(bad)
                kind = "past" if i >= len(table) else "null" if block == NULL_BLOCK else None
                kinds |= {kind or got[p - lo] == FAILED for p in bad}
            self.figures.reads += end - first
            if self.lookahead and self.synchronous and not wrong:
                self._read_ahead(rid, view, g, first, end)
            if wrong:
                # Every wrong slot of one kind the message names (a known finding's view of it).
                each = {True: ", each one a failed load left unwritten", "null": ", each one in a null block"}
                each_one = each.get(kinds.pop(), "") if len(kinds) == 1 else ""
                step = "admission step" if view.fresh else "step"
                self._problem(
                    READS,
                    f"{rid}'s {step} [{start}, {end}) reads {where}, not its own prefix "
                    f"({wrong} of {end - first} positions read wrong{each_one})",
                )
            if self.zeroing and end % bs and (end - 1) // bs < len(table):
                block = table[(end - 1) // bs]
                row = self.kv.get(block) or []
                if STALE in row[end % bs :]:
                    self._problem(
                        ZEROED,
                        f"{rid}'s step [{start}, {end}) reads block {block} of group {g}, whose slots past "
                        "its last token were never zeroed (a fresh block missing from new_block_ids_to_zero)",
                    )

    def _read_ahead(self, rid: str, view: RequestView, g: int, first: int, end: int) -> None:
        """Each slot read whose lookahead provenance is known, where the reader knows its own
        tokens that far, holds the reader's (the drafter's KV at it read the same tokens)."""
        L, bs, table = self.lookahead, self.groups[g].block_size, view.tables[g]
        for p in range(first, min(end, len(view.tokens) - L)):
            block = table[p // bs] if p // bs < len(table) else NULL_BLOCK
            slots = self.ahead.get(block)
            got = None if slots is None or len(slots) != bs else slots[p % bs]
            if got is not None and got != view.ids[p + L]:
                self._problem(
                    READS,
                    f"{rid}'s step reads position {p} of group {g} from block {block}, whose drafter KV "
                    "was computed past it with "
                    "other tokens (lookahead hashes: another prefix's lookahead, not its own)",
                )
                return

    def _what(self, block: int, index: int, length: int, got: int | None) -> str:
        if index >= length:
            return f"past its table ({length} blocks)"
        if block == NULL_BLOCK:
            return f"the null block (index {index})"
        if got in (None, STALE) and block in self.early_copies:
            return f"block {block}, a copy of block {self.early_copies[block]} made before that block was written"
        if got is None:
            return f"block {block}, a slot no step wrote since it was zeroed or allocated"
        if got == STALE:
            return f"block {block}, a fresh slot never zeroed"
        if got == FAILED:
            return f"block {block}, a slot a failed KV load left unwritten"
        return f"block {block}, which holds another prefix's KV"

    def _problem(self, check: str, message: str) -> None:
        self.figures.problems += 1
        self.problems.append((check, message))


def _unrolled(chunk: Chunk | None) -> int:
    """The drafts a step's shipped count includes that the runner knows were rejected: those
    of the share before it whose output the scheduler had not processed (0: none)."""
    if chunk is None or chunk.after is None:
        return 0
    return chunk.after.rejected or 0


def _window_start(spec: WorkerGroup, start: int) -> int:
    """The first position a step from `start` may still read in `spec`'s group: a sliding
    window's `start - window + 1` (vLLM's skipped tokens), else 0."""
    if spec.kind == "swa" and spec.sliding_window:
        return max(0, start - spec.sliding_window + 1)
    return 0
