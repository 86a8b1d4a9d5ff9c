"""Hand-over: a violation fuzzing found, searched for again exhaustively, shortest first.

Contract of `shortest_trace(config, ops, violation, ...)`: a breadth-first
search (`invariants.explore.search`) from an empty allocator over the fuzz
trace's *vocabulary*: every distinct operation the trace holds, plus each
batched step restricted to every non-empty subset of its requests (in their
order). Request ids are the trace's own, so states are not merged under
renaming. Every sequence of at most d operations over that vocabulary is
checked before any of d + 1, so the first one that raises a violation of the
same check (not explained by a known finding) is a shortest one; a violation
of another check prunes its path and is counted, as does an operation the
target refuses (`REFUSED`: a step an engine target cannot run is no trace of
its crash). The search goes to the trace's length minus one (the trace itself
is a witness at its own length) or until the deadline, and the result says how
deep it completed: when nothing shorter exists within the vocabulary, the fuzz
trace is returned and said to be shortest there.

With budget left, a second search runs on the same configuration over the
explore alphabet (`invariants.explore.alphabet`: prompts over a 2-token
alphabet cut at the scheduler block, twice it plus one, and the trace's own
prompt lengths; two live requests), to one less than the shortest length
known (and at most `ALPHABET_DEPTH`): a different prompt can reach the same defect sooner than the trace's
own (a prompt that ends past a block boundary instead of decodes that cross it).

The result also carries one sentence naming the first observable that
differs (`invariants.explore.sentence`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from invariants.explore.certificate import Certificate
from invariants.explore.instances import Instance
from invariants.explore.search import Limits, Tolerate, explore
from invariants.explore.sentence import first_difference
from invariants.harness.checker import REFUSED, Violation
from invariants.targets.base import Target
from model.contract.config import Config
from model.contract.ops import AddRequest, Op, Step

# The second search (the explore alphabet) goes at most this deep: its states grow 4-6x a level.
ALPHABET_DEPTH = 6
# Subsets of a step's requests are offered up to this many requests (2^4 - 1 steps).
MAX_SUBSET_REQUESTS = 4


@dataclass
class Handover:
    """What the hand-over found. `ops` is the shortest trace known (the fuzz trace
    when the search found nothing shorter); `depth_completed` every sequence of at
    most that many operations over the vocabulary was checked."""

    ops: tuple[Op, ...]
    original: int
    violation: Violation
    sentence: str
    depth_completed: int
    states: int
    seconds: float
    stopped: str
    vocabulary: int
    other_violations: int

    @property
    def shorter(self) -> bool:
        return len(self.ops) < self.original

    def summary(self) -> str:
        """One line: the length found, from what, and how far every shorter one was checked."""
        if self.shorter:
            head = f"shortest trace {len(self.ops)} operations (fuzz: {self.original})"
        elif self.depth_completed >= self.original - 1:
            head = f"the fuzz trace's {self.original} operations are shortest over its vocabulary"
        else:
            head = f"nothing shorter than {self.original} operations found"
        return (
            f"{head}; every sequence of <= {self.depth_completed} operations drawn from its "
            f"{self.vocabulary} distinct ones checked ({self.states} states, {self.seconds:.1f} s, {self.stopped})"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "length": len(self.ops),
            "fuzz_length": self.original,
            "depth_completed": self.depth_completed,
            "states": self.states,
            "seconds": round(self.seconds, 3),
            "stopped": self.stopped,
            "vocabulary": self.vocabulary,
            "other_violations": self.other_violations,
            "first_difference": self.sentence,
        }


def vocabulary(ops: tuple[Op, ...] | list[Op]) -> tuple[Op, ...]:
    """The trace's distinct operations in order of first use, each batched step
    followed by its restrictions to fewer requests."""
    out: dict[Op, None] = {}
    for op in ops:
        out[op] = None
        if isinstance(op, Step) and 1 < len(op.rids) <= MAX_SUBSET_REQUESTS:
            for k in range(len(op.rids) - 1, 0, -1):
                for rids in itertools.combinations(op.rids, k):
                    out[Step(rids, op.budget)] = None
    return tuple(out)


def _search(
    instance: Instance,
    factory: Callable[[Config], Target],
    target: str,
    depth: int,
    tolerate: Tolerate,
    deadline: float,
    violation: Violation,
) -> Certificate:
    return explore(
        instance,
        factory,
        target,
        Limits(depth, max_states=200_000, deadline=deadline),
        tolerate=tolerate,
        wanted=lambda v: v.check == violation.check and v.check != REFUSED,
    )


def shortest_trace(
    config: Config,
    ops: tuple[Op, ...] | list[Op],
    violation: Violation,
    factory: Callable[[Config], Target],
    target: str,
    *,
    tolerate: Tolerate,
    deadline: float,
) -> Handover:
    """Search for a shorter trace raising `violation.check` (see the module docstring)."""
    start = time.monotonic()
    ops = tuple(ops)
    vocab = vocabulary(ops)
    found_ops, found_v, depth, states, stopped, pruned = ops, violation, 0, 0, "nothing to shorten", 0
    if len(ops) > 1:
        instance = Instance("hand-over", config, vocabulary=vocab)
        cert = _search(instance, factory, target, len(ops) - 1, tolerate, deadline, violation)
        depth, states, stopped, pruned = (
            cert.depth_completed,
            cert.states,
            cert.stopped,
            cert.other_violations,
        )
        if cert.path:
            found_ops = cert.path
            found_v = next(v for v in cert.found if v.check == violation.check)
    if len(found_ops) > 2 and time.monotonic() < deadline:
        lengths = (config.scheduler_block_size, 2 * config.scheduler_block_size + 1)
        own = tuple(len(op.prompt) for op in ops if isinstance(op, AddRequest))
        generated = Instance(
            "hand-over-alphabet",
            config,
            max_requests=2,
            prompt_lengths=tuple(dict.fromkeys(lengths + own[:1])),
        )
        depth2 = min(len(found_ops) - 1, ALPHABET_DEPTH)
        cert = _search(generated, factory, target, depth2, tolerate, deadline, violation)
        states, pruned = states + cert.states, pruned + cert.other_violations
        if cert.path:
            found_ops = cert.path
            found_v = next(v for v in cert.found if v.check == violation.check)
            stopped = f"{stopped}; the explore alphabet found {len(found_ops)}"
    sentence = first_difference(factory, config, found_ops, found_v)
    return Handover(
        found_ops,
        len(ops),
        found_v,
        sentence,
        depth,
        states,
        time.monotonic() - start,
        stopped,
        len(vocab),
        pruned,
    )
