"""Seeded workloads: multi-turn sessions sharing a few system prompts.

A session's turn i+1 prompt is turn i's prompt + its generated tokens + a new
user message, so later turns can hit what earlier turns cached; sessions that
share a system prompt can hit each other. Everything is drawn from one
`random.Random(seed)`: the same seed gives the same workload. `replay_sessions`
feeds a workload to the scheduler loop: a session's next turn arrives
`think_steps` steps after its previous turn finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from invariants.simulate.loop import OnFinish, Request, SchedulerLoop


@dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]
    max_tokens: int
    think_steps: int  # engine steps between the previous turn finishing and this one arriving


@dataclass(frozen=True)
class Session:
    sid: int
    system: tuple[int, ...]
    arrival_step: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    seed: int
    vocab: int
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def max_request_tokens(self) -> int:
        """Upper bound on any request's length (prompt + outputs)."""
        worst = 0
        for s in self.sessions:
            n = len(s.system)
            for t in s.turns:
                n += len(t.user) + t.max_tokens
            worst = max(worst, n)
        return worst


def make_workload(
    seed: int,
    sessions: int,
    vocab: int = 64,
    system_prompts: int = 2,
    system_len: tuple[int, int] = (40, 72),
    turns: tuple[int, int] = (2, 3),
    user_len: tuple[int, int] = (3, 28),
    max_tokens: tuple[int, int] = (3, 10),
    arrival_spread: int = 12,
    think: tuple[int, int] = (0, 4),
) -> Workload:
    """Draw a workload; lengths are inclusive ranges. Token 0 is never used."""
    rng = random.Random(seed)
    systems = [
        tuple(rng.randrange(1, vocab) for _ in range(rng.randint(*system_len))) for _ in range(system_prompts)
    ]
    out = []
    for sid in range(sessions):
        n_turns = rng.randint(*turns)
        ts = tuple(
            Turn(
                tuple(rng.randrange(1, vocab) for _ in range(rng.randint(*user_len))),
                rng.randint(*max_tokens),
                rng.randint(*think),
            )
            for _ in range(n_turns)
        )
        out.append(Session(sid, systems[rng.randrange(system_prompts)], rng.randint(0, arrival_spread), ts))
    return Workload(seed, vocab, tuple(out))


def replay_sessions(loop: SchedulerLoop, workload: Workload) -> None:
    """Submit every session's first turn at its arrival step, and each later turn when its time comes."""
    turn_of: dict[str, tuple[Session, int]] = {}

    def submit(session: Session, turn: int, history: tuple[int, ...], at_step: int) -> None:
        t = session.turns[turn]
        rid = f"s{session.sid}t{turn}"
        turn_of[rid] = (session, turn)
        loop.submit(Request(rid, history + t.user, t.max_tokens), at_step)

    def next_turn(req: Request) -> None:
        session, turn = turn_of.pop(req.rid)
        if turn + 1 < len(session.turns):
            think = session.turns[turn + 1].think_steps
            submit(session, turn + 1, req.all_tokens, loop.step_no + 1 + think)

    loop.add_observer(OnFinish(next_turn))
    for s in workload.sessions:
        submit(s, 0, s.system, s.arrival_step)
