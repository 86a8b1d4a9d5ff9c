"""Restoring a state in place (`invariants.explore.undo`) searches what thawing searches.

- a whole search with `restore="live"` gives the certificate `restore="pickle"`
  gives (distinct states per depth, transitions, verdict, the shortest
  counterexample), on the model and on vLLM's manager; a restore that drops
  one kind of contents (planted) gives a different one (negative control);
- after any operation a restored checker equals a fresh thaw (snapshot and
  fingerprint); a restore that skips lists does not (negative control);
- a graph holding an object whose contents cannot be recorded raises
  `Unrestorable`, and a search over such a target thaws and says so;
- interned prefixes are shared, not recorded;
- `kvretain explore --bench` prints both restores' states/s and their ratio, and
  exits 1 when their certificates differ (planted restore).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from test_explore import LeaksAfterResume

from invariants.cli.main import main
from invariants.explore import undo
from invariants.explore.bench import bench_restore
from invariants.explore.fork import Freezer
from invariants.explore.instances import Instance, grid_by_name
from invariants.explore.search import Limits, _state_of, explore, new_checker
from invariants.explore.undo import Checkpoint, Unrestorable
from invariants.harness.checker import Checker
from invariants.targets import target_factory
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec, validate
from model.contract.ops import AddRequest, EvictBlocks, Finish, Op, Preempt, ResetPrefixCache, Sample, Step
from model.contract.prefix import prefix

TINY = grid_by_name(["full-p3-r1"])[0]
DENSE = grid_by_name(["full+swa-p7-dense"])[0]
TWO = Instance(
    "full-p5-r2-restore",
    validate(Config(groups=(GroupSpec("full", 2),), num_blocks=5, max_model_len=24)),
    max_requests=2,
    prompt_lengths=(2, 3),
    budgets=(64,),
)


def _certificate(instance: Instance, factory: Any, target: str, depth: int, restore: str) -> dict[str, Any]:
    cert = explore(instance, factory, target, Limits(depth), restore=restore)
    out = cert.to_json()
    out.pop("seconds")
    assert out.pop("restore") == restore
    out["path"] = cert.path
    return out


def _vllm_manager() -> Any:
    try:
        return target_factory("vllm-manager")
    except Exception as exc:  # noqa: BLE001 - any reason vLLM cannot load here
        pytest.skip(f"vllm-manager target unavailable: {exc}")


def _drop_lists(self: Checkpoint) -> None:
    """Planted defect: a restore that leaves every list as the operation left it."""
    lists, self.lists = self.lists, []
    try:
        _RESTORE(self)
    finally:
        self.lists = lists


_RESTORE = Checkpoint.restore


@pytest.mark.parametrize("instance,depth", [(TWO, 4), (DENSE, 3)], ids=["full-p5-r2", "full+swa-p7-dense"])
def test_live_restore_gives_the_pickle_certificate_on_the_model(instance: Instance, depth: int) -> None:
    pickled = _certificate(instance, ModelTarget, "model", depth, "pickle")
    assert pickled["new_states_by_depth"][-1] > 0
    assert _certificate(instance, ModelTarget, "model", depth, "live") == pickled


def test_live_restore_gives_the_pickle_certificate_on_vllm_manager() -> None:
    factory = _vllm_manager()
    pickled = _certificate(TINY, factory, "vllm-manager", 4, "pickle")
    assert _certificate(TINY, factory, "vllm-manager", 4, "live") == pickled


def test_live_restore_finds_the_same_shortest_counterexample() -> None:
    pickled = _certificate(TINY, LeaksAfterResume, "model", 6, "pickle")
    assert pickled["verdict"] == "VIOLATION" and len(pickled["path"]) == 5
    assert _certificate(TINY, LeaksAfterResume, "model", 6, "live") == pickled


def test_a_restore_that_drops_lists_changes_the_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    pickled = _certificate(TWO, ModelTarget, "model", 4, "pickle")
    monkeypatch.setattr(Checkpoint, "restore", _drop_lists)
    assert _certificate(TWO, ModelTarget, "model", 4, "live") != pickled


def _parent(factory: Any) -> Checker:
    checker = new_checker(factory, DENSE.config)
    for op in (
        AddRequest("r00", (1, 2, 1, 1, 2)),
        Step(("r00",), 64),
        Sample("r00", 1),
        AddRequest("r01", (1, 2)),
    ):
        assert not checker.step(op), op
    return checker


OPS: list[Op] = [
    Step(("r00", "r01"), 64),
    Finish("r00"),
    ResetPrefixCache(),
    EvictBlocks((1,)),
    Preempt("r00"),
    Step(("r01",), 2),
]


def _restored_equal(factory: Any, planted: bool = False) -> list[bool]:
    freezer = Freezer()
    frozen = freezer.freeze(_parent(factory))
    live, fresh = freezer.thaw(frozen), freezer.thaw(frozen)
    checkpoint = Checkpoint.take(live)
    equal = []
    for op in OPS:
        try:
            live.step(op)
        except AssertionError:  # a planted restore left a state the model refuses
            equal.append(False)
            break
        if planted:
            _drop_lists(checkpoint)
        else:
            checkpoint.restore()
        same = live.target.snapshot() == fresh.target.snapshot()
        equal.append(same and _state_of(live, True) == _state_of(fresh, True))
    return equal


def test_a_restored_checker_equals_a_fresh_thaw_after_every_operation() -> None:
    assert all(_restored_equal(ModelTarget))
    assert not all(_restored_equal(ModelTarget, planted=True))


def test_a_restored_vllm_manager_equals_a_fresh_thaw_after_every_operation() -> None:
    factory = _vllm_manager()
    assert all(_restored_equal(factory))
    assert not all(_restored_equal(factory, planted=True))


class Ticking(ModelTarget):
    """A target holding an iterator: C state a checkpoint cannot record."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.ticks = itertools.count()


def test_an_unrecordable_object_is_refused_and_the_search_thaws_instead() -> None:
    with pytest.raises(Unrestorable, match="itertools.count"):
        Checkpoint.take({"a": [Ticking(TWO.config)]})
    cert = explore(TWO, Ticking, "model", Limits(3), restore="live")
    assert cert.restore.startswith("pickle (live restore unavailable") and "itertools.count" in cert.restore
    assert cert.new_states == explore(TWO, ModelTarget, "model", Limits(3), restore="pickle").new_states


def test_interned_prefixes_are_shared_and_plain_contents_restored() -> None:
    p = prefix((1, 2, 3))
    box: dict[str, Any] = {"p": p, "xs": [1, 2], "s": {3}}
    cp = Checkpoint.take([box])
    assert all(obj is not p for obj, _, _ in cp.slotted)
    box["xs"].append(9)
    box["s"].clear()
    box["new"] = object()
    cp.restore()
    assert box == {"p": p, "xs": [1, 2], "s": {3}} and box["p"] is p


def test_restore_must_be_known() -> None:
    with pytest.raises(ValueError, match="restore must be one of"):
        explore(TWO, ModelTarget, "model", Limits(1), restore="fork")
    assert undo.Checkpoint is Checkpoint


def test_bench_prints_both_restores_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explore", "--bench", "--target", "model", "--instance", "full-p3-r1", "--depth", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "depth 3" in out and "the certificates are identical" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("pickle ", "live "))]
    assert [r[0] for r in rows] == ["pickle", "live"] and rows[0][1:3] == rows[1][1:3]
    assert rows[0][5] == "1.00x"


def test_bench_fails_when_the_restores_search_differently(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Checkpoint, "restore", _drop_lists)
    bench = bench_restore(TWO, ModelTarget, "model", 4)
    assert not bench.same and "CERTIFICATES DIFFER" in bench.text()
    assert main(["explore", "--bench", "--target", "model", "--instance", "full-p5-r2", "--depth", "4"]) == 1
