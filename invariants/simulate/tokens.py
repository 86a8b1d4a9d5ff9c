"""Token ids for a simulator that has no model: prompts and sampled tokens are seeded random draws.

Block accounting never depends on what a token is, only on which prefixes
repeat; so every prompt and every sampled token comes from one seeded
`random.Random`, in a fixed order, and the same seed gives the same run.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

from invariants.simulate.loop import Request, ScheduledChunk

VOCAB = 1 << 20


def random_tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> tuple[int, ...]:
    """`n` token ids drawn from `rng` (uniform over `vocab`)."""
    if vocab & (vocab - 1):
        return tuple(rng.randrange(vocab) for _ in range(n))
    # one draw of 4n bytes: ~50x faster than n randrange calls at 1M tokens
    return tuple(x & (vocab - 1) for x in array("I", rng.randbytes(4 * n)))


class RandomTokens:
    """The simulator's executor: computes nothing, samples a random token per completed request.

    Draws happen when the loop asks, request by request, so a callback that
    draws from the same `rng` between two samples (a session's next turn)
    sees the same sequence whatever the batch looks like.
    """

    def __init__(self, rng: random.Random, vocab: int = VOCAB) -> None:
        self.rng = rng
        self.vocab = vocab

    def compute(self, step: int, batch: Sequence[ScheduledChunk]) -> None:
        pass

    def sampled(self, req: Request) -> int | None:
        if req.computed < req.num_tokens:
            return None
        return self.rng.randrange(self.vocab)
