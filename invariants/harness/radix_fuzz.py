"""Fuzzing SGLang's radix cache: seeded random scheduler histories, checked after every op.

`generate_ops(seed, layout, n)` draws a history a scheduler could produce:
requests whose prompts share prefixes from a small bank (so lookups hit, split
nodes and meet tombstones) or repeat a finished request's prompt (a next turn:
its insert runs over the whole cached path, SWA tombstones included), chunked prefill, decode with SWA window eviction,
finish, abort and explicit eviction (SWA evictions of up to 32 tokens,
which tombstone interior nodes) under a small pool (so allocation evicts).
A share of the requests (`identities`) carries an identity, two tenants' cache salts
and an adapter (`IDENTITIES`), drawn from a stream of its own (the token histories stay
those of the same seed without identities): identical prompts under different
identities are common, which is where a namespace defect shows.
`fuzz_layout` runs histories on one layout for a time budget through a
`RadixChecker` (both tree cores in lockstep) and stops at the first violation,
returning it with the seed and the ops that led there (a replayable trace).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.harness.radix_check import RadixChecker, Violation
from model.radix.config import RadixLayout
from model.radix.ops import Abort, Admit, Decode, Evict, Extend, Finish, RadixOp, from_json, to_json

# (adapter, salt) of a request with an identity: two tenants, an adapter, both.
IDENTITIES: tuple[tuple[str | None, str | None], ...] = (
    (None, "tenant-a"),
    (None, "tenant-b"),
    ("adapter-x", None),
    ("adapter-x", "tenant-a"),
)


def generate_ops(seed: int, layout: RadixLayout, n: int, identities: float = 0.3) -> list[RadixOp]:
    """A seeded history of `n` ops over at most `layout.max_reqs - 1` running requests;
    about `identities` of the admissions carry an adapter and/or a cache salt."""
    rng = random.Random(seed)
    who = random.Random(f"identity-{seed}")
    page = layout.page_size
    bank = [tuple(rng.randrange(1, 6) for _ in range(48)) for _ in range(3)]
    live: list[int] = []
    prompts: dict[int, tuple[int, ...]] = {}
    done: list[tuple[int, ...]] = []
    # The identity each prompt was admitted under: a next turn keeps it half the time (so
    # identity requests hit in their own namespace), otherwise draws again.
    who_of: dict[tuple[int, ...], tuple[str | None, str | None]] = {}
    recent: tuple[str | None, str | None] = (None, None)  # the last identity drawn: often drawn again
    next_rid = 0
    ops: list[RadixOp] = []
    for _ in range(n):
        roll = rng.random()
        if (roll < 0.3 or not live) and len(live) < layout.max_reqs - 1:
            # A prompt that repeats a finished one (a conversation's next turn) overlaps its
            # whole cached path, tombstones included; otherwise a shared-prefix prompt.
            turn = bool(done) and rng.random() < 0.3
            base = rng.choice(done) if turn else rng.choice(bank)
            cut = rng.randrange(1, len(base) + 1)
            tail = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(0, 3 * page + 2)))
            tokens = base[:cut] + tail
            if identities and turn and who.random() < 0.5:
                lora, salt = who_of.get(base, (None, None))
            elif who.random() < identities:
                lora, salt = (
                    recent if recent != (None, None) and who.random() < 0.6 else who.choice(IDENTITIES)
                )
                recent = (lora, salt)
            else:
                lora, salt = None, None
            who_of[tokens] = (lora, salt)
            chunk = rng.choice([len(tokens), page * 2, page * 3 + 1])
            ops.append(Admit(next_rid, tokens, chunk, lora=lora, salt=salt))
            prompts[next_rid] = tokens
            live.append(next_rid)
            next_rid += 1
        elif roll < 0.45:
            ops.append(Extend(rng.choice(live), rng.choice([page * 2, page * 4])))
        elif roll < 0.65:
            ops.append(
                Decode(rng.choice(live), tuple(rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))))
            )
        elif roll < 0.85:
            rid = live.pop(rng.randrange(len(live)))
            ops.append(Finish(rid))
            done.append(prompts[rid])
        elif roll < 0.92:
            rid = live.pop(rng.randrange(len(live)))
            ops.append(Abort(rid))
        else:
            ops.append(
                Evict(
                    rng.choice([0, page, 4 * page, 12 * page]),
                    rng.choice([0, page, 8, 32]),
                    rng.choice([0, 1]),
                )
            )
    return ops


@dataclass
class LayoutRun:
    layout: str
    seeds: int = 0
    ops: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    seed: int | None = None
    trace: list[RadixOp] = field(default_factory=list)
    coverage: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "seeds": self.seeds,
            "ops": self.ops,
            "seconds": round(self.seconds, 2),
            "violation": None
            if self.violation is None
            else {"invariant": self.violation[0], "message": self.violation[1]},
            "seed": self.seed,
            "coverage": dict(self.coverage),
            "trace": [to_json(op) for op in self.trace],
        }


def run_history(checker: RadixChecker, ops: list[RadixOp]) -> tuple[Violation | None, list[RadixOp]]:
    """Apply `ops` in order; the first violation and the ops up to and including it."""
    for i, op in enumerate(ops):
        try:
            found = checker.step(op)
        except Exception as exc:  # SGLang's own asserts (leak, double free) are findings too
            return (
                "sglang_raised",
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
            ), ops[: i + 1]
        if found:
            return found[0], ops[: i + 1]
    return None, ops


def shrink(
    layout: RadixLayout, ops: list[RadixOp], invariant: str, cores: tuple[str, ...], budget_s: float
) -> list[RadixOp]:
    """A shorter history on which `invariant` still fails: drop chunks of ops (halves,
    quarters, ... single ops) while the same invariant is still the first violation."""
    deadline = time.perf_counter() + budget_s
    best = list(ops)
    size = max(1, len(best) // 2)
    while size >= 1 and time.perf_counter() < deadline:
        i, shrunk = 0, False
        while i < len(best) and time.perf_counter() < deadline:
            candidate = best[:i] + best[i + size :]
            found, done = run_history(RadixChecker(layout, cores), candidate)
            if found is not None and found[0] == invariant:
                best, shrunk = done, True
            else:
                i += size
        if not shrunk:
            size //= 2
    return best


def fuzz_layout(
    name: str,
    layout: RadixLayout,
    budget_s: float,
    seed: int,
    cores: tuple[str, ...] = ("python", "rust"),
    ops_per_seed: int = 60,
    shrink_s: float = 0.0,
    identities: float = 0.3,
) -> LayoutRun:
    """Histories on `layout` for `budget_s` seconds (at least one), seeds seed, seed+1, ...;
    `identities`: the share of admissions with an adapter / salt (`generate_ops`)."""
    run = LayoutRun(layout=name)
    start = time.perf_counter()
    s = seed
    while run.seeds == 0 or time.perf_counter() - start < budget_s:
        checker = RadixChecker(layout, cores)
        ops = generate_ops(s, layout, ops_per_seed, identities)
        violation, trace = run_history(checker, ops)
        run.seeds += 1
        run.ops += checker.checked_ops
        run.coverage.update(checker.coverage)
        if violation is not None:
            if shrink_s > 0:
                trace = shrink(layout, trace, violation[0], cores, shrink_s)
                violation = run_history(RadixChecker(layout, cores), trace)[0] or violation
            run.violation, run.seed, run.trace = violation, s, trace
            break
        s += 1
    run.seconds = time.perf_counter() - start
    return run


def write_trace(run: LayoutRun, layout: RadixLayout, path: Path) -> None:
    """A replayable trace: the layout, the seed and the ops."""
    data = run.to_json()
    data["layout_fields"] = {
        "components": list(layout.components),
        "page_size": layout.page_size,
        "sliding_window": layout.sliding_window,
        "kv_size": layout.kv_size,
        "swa_size": layout.swa_size,
        "mamba_size": layout.mamba_size,
        "max_reqs": layout.max_reqs,
    }
    path.write_text(json.dumps(data, indent=1))


def read_trace(path: Path) -> tuple[RadixLayout, list[RadixOp]]:
    data = json.loads(path.read_text())
    fields = data["layout_fields"]
    layout = RadixLayout(
        components=tuple(fields["components"]),
        page_size=fields["page_size"],
        sliding_window=fields["sliding_window"],
        kv_size=fields["kv_size"],
        swa_size=fields.get("swa_size"),
        mamba_size=fields["mamba_size"],
        max_reqs=fields["max_reqs"],
    )
    return layout, [from_json(op) for op in data["trace"]]
