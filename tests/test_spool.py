"""The production run's spooled trace gives back exactly the operations it was given."""

from __future__ import annotations

import random

from invariants.harness.production import random_tokens
from invariants.harness.spool import OpSpool
from model.contract.ops import AddRequest, EvictBlocks, Finish, Probe, Sample, Schedule, Step


def test_spool_round_trip_and_clear():
    rng = random.Random(3)
    ops = [
        AddRequest("a", random_tokens(rng, 5000)),
        Schedule("a", 8192),
        Step(("a", "b"), 16),
        Sample("a", 29_999),
        Probe(()),
        Probe((1 << 40, 2)),
        EvictBlocks((3, 1)),
        Finish("a"),
    ]
    spool = OpSpool()
    spool.extend(ops[:3])
    spool.extend(ops[3:])
    assert spool.ops() == ops and spool.count == len(ops)
    spool.extend(ops[:1])  # reading does not lose the place
    assert spool.ops() == ops + ops[:1]
    spool.clear()
    assert spool.ops() == [] and spool.count == 0
    spool.extend(ops[1:2])
    assert spool.ops() == ops[1:2]
    spool.close()


def test_random_tokens_are_seeded_and_in_the_vocabulary():
    a, b = random_tokens(random.Random(1), 1000), random_tokens(random.Random(1), 1000)
    assert a == b and len(a) == 1000 and all(1 <= t < 30000 for t in a)
    assert random_tokens(random.Random(2), 1000) != a
