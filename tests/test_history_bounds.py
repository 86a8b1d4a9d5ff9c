"""A long run keeps a bounded history, and forgetting never loses a fact a check reads.

- `forget` keeps the keys cached now and the prefixes of live requests, drops the rest;
- a long run with a low threshold stays bounded and clean (no promise reported lost
  because its keys were forgotten);
- finished requests beyond `FINISHED_KEPT`, or beyond `FINISHED_TOKENS` tokens,
  are dropped oldest first.
"""

from __future__ import annotations

import random

from invariants.catalogue import History, RequestHistory, forget
from invariants.catalogue import history as history_mod
from invariants.harness.checker import Checker
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec
from model.contract.observation import block_key
from model.contract.ops import AddRequest, Finish, Schedule

CFG = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)), num_blocks=24, retention_interval=0
)


def test_forget_keeps_cached_keys_and_live_prefixes():
    live = (1, 2, 3, 4, 5, 6, 7, 8)
    h = History(forget_at=0)
    h.requests["r"] = RequestHistory(live)
    cached, of_live, stale = (
        block_key(0, (9, 9, 9, 9), 4),
        block_key(1, live, 8),
        block_key(0, (5, 5, 5, 5), 4),
    )
    h.ever_cached = {cached, of_live, stale}
    forget(h, {cached: (3,)})
    assert h.ever_cached == {cached, of_live}
    assert h.forget_at == 4  # twice what it kept: the next pass waits for growth


def _cycles(checker: Checker, n: int, seed: int) -> None:
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(1, 50) for _ in range(8))
    for i in range(n):
        prompt = prefix + tuple(rng.randrange(1, 50) for _ in range(rng.randint(1, 9)))
        for op in (AddRequest(f"r{i}", prompt), Schedule(f"r{i}", 64), Finish(f"r{i}")):
            assert checker.step(op) == [], (i, op)


def test_a_long_run_keeps_a_bounded_history(monkeypatch):
    monkeypatch.setattr(history_mod, "FINISHED_KEPT", 8)
    checker = Checker(ModelTarget(CFG), audit_every=16)
    checker.history.forget_at = 32
    _cycles(checker, 150, seed=1)
    assert checker.audit() == []
    # 150 requests with their own tails cache a few hundred keys; about 2x the map is kept.
    assert len(checker.history.ever_cached) <= 2 * 32 + len(checker._holders)
    assert list(checker.history.finished) == [f"r{i}" for i in range(142, 150)]


def test_finished_requests_are_bounded_by_their_tokens(monkeypatch):
    # Few requests, long prompts: the count bound alone would keep every one of them.
    monkeypatch.setattr(history_mod, "FINISHED_TOKENS", 40)
    checker = Checker(ModelTarget(CFG), audit_every=16)
    _cycles(checker, 30, seed=2)
    h = checker.history
    assert h.finished_tokens == sum(len(r.prompt) + len(r.outputs) for r in h.finished.values())
    assert h.finished_tokens <= 40
    assert "r29" in h.finished and len(h.finished) < 30
