"""The explore campaign's shards driven in one process (`invariants.campaign.explore.Shard`).

- shards reach the one-process search's distinct states per depth, with live
  restore thawing each expanded state once (as the one-process search does)
  where `restore="pickle"` thaws one per operation that moved it (control);
  a checker live restore cannot record falls back to thawing and says why;
- fingerprints travel between shards each part once (`campaign.wire`): what a
  receiver decodes equals what was sent, in fewer bytes than pickling it whole;
  control: a batch decoded out of order does not;
- an owner routed with kept part routes (`route_kept`) is `route`'s owner;
  control: a planted memo entry changes it, so the memo is what answers;
- a successor for another shard is frozen portably (`campaign.portable`): a
  module by name, a function with no importable name by value, loaded once per
  process; control: plain pickle cannot freeze that checker at all.

Ray is not started here: the shards are plain objects (the Ray tests are in
test_campaign.py).
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable, Hashable
from typing import Any

import pytest

pytest.importorskip("ray", reason="the optional Ray extra (requirements/ray.txt) is not installed")

from invariants.campaign import portable  # noqa: E402
from invariants.campaign.explore import Shard  # noqa: E402
from invariants.campaign.portable import Portable  # noqa: E402
from invariants.campaign.route import route, route_kept  # noqa: E402
from invariants.campaign.wire import Receiver, Sender  # noqa: E402
from invariants.explore.fork import Freezer  # noqa: E402
from invariants.explore.instances import Instance, grid_by_name  # noqa: E402
from invariants.explore.search import Limits, explore, new_checker  # noqa: E402
from invariants.targets.model_target import ModelTarget  # noqa: E402
from model.contract.config import Config  # noqa: E402
from model.contract.ops import AddRequest, Step  # noqa: E402

FULL, SWA = grid_by_name(["full-p5-r2", "swa-p5-r2"])


def _drive(
    instance: Instance, factory: Any, depth: int, n: int, restore: str = "live"
) -> tuple[list[int], list[Shard]]:
    """The campaign's protocol (`Driver`) over `n` shards in this process: new states per depth
    (each shard's `gave_up`: where live restore could not record, per depth)."""
    shards = [Shard(i, n) for i in range(n)]
    for s in shards:
        s.reset(instance, "model", factory, restore=restore)
    owned = [s.root()[0] for s in shards]
    assert sum(owned) == 1
    news = [1]
    for d in range(1, depth + 1):
        leaves = d == depth
        outs = [s.expand(leaves, None) for s in shards]
        for s in shards:
            if s.summary.unrestorable is not None:
                s.gave_up = [*getattr(s, "gave_up", []), s.summary.unrestorable]  # type: ignore[attr-defined]
        won = [shards[j].dedup(*[outs[i][j + 1] for i in range(n)]) for j in range(n)]
        news.append(sum(w[0] for w in won))
        if not leaves:
            ships = [s.ship(*[won[j][i + 1] for j in range(n)]) for i, s in enumerate(shards)]
            ships = [[x] for x in ships] if n == 1 else ships
            for j, s in enumerate(shards):
                s.adopt(*[ships[i][j] for i in range(n)])
    return news, shards


def _counting_thaws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    thaw = Freezer.thaw

    def counted(self: Freezer, data: bytes) -> Any:
        count[0] += 1
        return thaw(self, data)

    monkeypatch.setattr(Freezer, "thaw", counted)
    return count


@pytest.mark.parametrize(("instance", "depth"), [(FULL, 4), (SWA, 3)])
def test_shards_thaw_each_expanded_state_once_with_live_restore(
    monkeypatch: pytest.MonkeyPatch, instance: Instance, depth: int
) -> None:
    one = explore(instance, ModelTarget, "model", Limits(depth))
    thaws = _counting_thaws(monkeypatch)
    news, shards = _drive(instance, ModelTarget, depth, 2)
    assert news == one.new_states
    expanded = sum(one.new_states[:-1])  # every state but the deepest layer's
    assert thaws[0] == expanded and all(s.restore == "live" for s in shards)
    # Control: thawing per operation (the definition) thaws far more, for the same states.
    thaws[0] = 0
    assert _drive(instance, ModelTarget, depth, 2, restore="pickle")[0] == one.new_states
    assert thaws[0] > 3 * expanded


class Ticking(ModelTarget):
    """A target holding an iterator: C state a checkpoint cannot record."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        import itertools

        self.ticks = itertools.count()


def test_a_shard_thaws_where_live_restore_cannot_record() -> None:
    one = explore(FULL, Ticking, "model", Limits(3))
    news, shards = _drive(FULL, Ticking, 3, 2)
    assert news == one.new_states
    assert one.restore.startswith("pickle (live restore unavailable") and "itertools.count" in one.restore
    gave_up = [g for s in shards for g in getattr(s, "gave_up", [])]
    assert gave_up and all(
        s.restore == one.restore for s in shards
    )  # each shard gave up once, as one process
    assert [why for _, why in gave_up] == [
        one.restore.removeprefix("pickle (live restore unavailable: ")[:-1]
    ] * 2


def _fingerprints(depth: int) -> list[list[tuple[Any, Hashable]]]:
    """Per depth, every candidate (key, fingerprint) one shard produced."""
    shard = Shard(0, 1)
    shard.reset(FULL, "model", ModelTarget)
    shard.root()
    batches = []
    for d in range(1, depth + 1):
        out = shard.expand(False, None)
        batches.append(list(shard.outbox[0]))
        won = shard.dedup(out[1])
        if d < depth:
            shard.ship(won[1])
            shard.adopt([])
    return batches


def test_fingerprints_travel_each_part_once_and_arrive_equal() -> None:
    batches = _fingerprints(4)
    sender, receiver = Sender(), Receiver()
    whole = encoded = 0
    for batch in batches:
        data = pickle.dumps(sender.encode(batch), protocol=pickle.HIGHEST_PROTOCOL)
        got = receiver.decode(pickle.loads(data))
        assert got == batch and [hash(s) for _, s in got] == [hash(s) for _, s in batch]
        whole += len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        encoded += len(data)
    assert encoded < whole / 3
    # Control: the channel's numbers assume every batch decoded once, in order.
    sender, receiver = Sender(), Receiver()
    first, second = sender.encode(batches[2]), sender.encode(batches[3])
    with pytest.raises(IndexError):
        receiver.decode(second)
    assert receiver.decode(first) == batches[2]


def test_equal_values_arrive_equal_across_types() -> None:
    sender, receiver = Sender(), Receiver()
    sent = [((), (1, (2, 3))), ((1,), (True, (2, 3))), ((2,), frozenset({(1, 2), ("a", None)}))]
    got = receiver.decode(pickle.loads(pickle.dumps(sender.encode(sent))))
    assert got == sent and type(got[2][1]) is frozenset


def test_kept_routes_are_routes() -> None:
    states = [s for batch in _fingerprints(3) for _, s in batch]
    memo: dict[Any, int] = {}
    assert [route_kept(s[1], memo) for s in states] == [route(s[1]) for s in states]
    assert len(memo) > len(states)  # parts kept, not only whole states
    # Control: the memo is what answers a part routed before.
    part = states[-1][1]
    poisoned = {k: (v + 1 if k == part else v) for k, v in memo.items()}
    assert route_kept(part, poisoned) != route(part)


def _hasher() -> Callable[[int], int]:
    salt = 7

    def hasher(x: int) -> int:  # a closure: no importable name, as vLLM's request block hasher
        return x * salt

    return hasher


class HoldsModuleAndClosure(ModelTarget):
    """A target shaped like vLLM's manager where pickle is concerned: a module held as a
    value and a function with no importable name."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.lib = types
        self.hasher = _hasher()


def test_a_checker_plain_pickle_refuses_freezes_portably() -> None:
    checker = new_checker(HoldsModuleAndClosure, FULL.config)
    for op in (AddRequest("r00", (1, 2, 1)), Step(("r00",), 64)):
        assert not checker.step(op)
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        pickle.dumps(checker)  # control: what the portable freeze is for
    freezer = Freezer()
    freezer.freeze(checker)
    assert freezer.plain is False
    port = Portable()
    data = port.freeze(checker)
    assert port.whole is False  # plain pickle but for the module and the closure
    a, b = pickle.loads(data), pickle.loads(port.freeze(checker))
    assert a.target.snapshot() == checker.target.snapshot() == b.target.snapshot()
    assert a.target.lib is types and a.target.hasher(3) == 21
    assert a.target.hasher is b.target.hasher is not checker.target.hasher  # by value, once per process
    assert any(fn is a.target.hasher for fn in portable._LOADED.values())
