"""A grid's time budget is shared by every unfinished instance (`invariants.explore.grid.Shares`).

- a deadline is an equal share of the slot-time left: `t + jobs * (end - t) / unfinished`
  at the start and after each finish, never past the end, never earlier than before
  (a property over any order of finishes);
- one job: each instance gets what is left over the instances still to run, as before;
- a search past its first deadline goes on while the shared deadline has moved later,
  and stops where it has not (`Limits.spent`);
- in a real two-job grid, a large instance that started with two thirds of the budget
  completes once the small ones beside it finish; with the deadline fixed at its start
  (planted: the old policy), it is cut.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from invariants.explore import grid as grid_module
from invariants.explore.grid import Shares, explore_grid
from invariants.explore.instances import grid_by_name
from invariants.explore.search import Limits
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config
from model.contract.observation import Observation
from model.contract.ops import Op


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_finish_passes_its_unused_time_to_every_unfinished_instance() -> None:
    clock = Clock()
    shares = Shares(100.0, instances=4, jobs=2, clock=clock)
    assert shares.deadline() == 50.0  # two rounds of two: half the budget each
    clock.now = 10.0
    shares.finish()  # one finished early: the three left share the 2 * 90 slot-seconds
    assert shares.deadline() == pytest.approx(70.0)
    clock.now = 20.0
    shares.finish()
    shares.finish()  # one left, a slot idle: it may run to the end, not past it
    assert shares.deadline() == 100.0


def test_one_job_gives_each_instance_what_is_left_over_those_to_run() -> None:
    clock = Clock()
    shares = Shares(90.0, instances=3, jobs=1, clock=clock)
    assert shares.deadline() == 30.0
    clock.now = 12.0
    shares.finish()
    assert shares.deadline() == pytest.approx(12.0 + 78.0 / 2)


@settings(max_examples=200, deadline=None)
@given(
    instances=st.integers(1, 12),
    jobs=st.integers(1, 4),
    gaps=st.lists(st.floats(0.0, 30.0, allow_nan=False), max_size=12),
)
def test_a_deadline_never_moves_earlier_nor_past_the_end(
    instances: int, jobs: int, gaps: list[float]
) -> None:
    clock = Clock()
    end = 100.0
    shares = Shares(end, instances, jobs, clock=clock)
    before = shares.deadline()
    for gap in gaps[: instances - 1]:
        clock.now = min(end, clock.now + gap)
        if clock.now > before:
            break  # every running instance was stopped by then: no finish can come later
        shares.finish()
        now = shares.deadline()
        assert before - 1e-9 <= now <= end
        before = now


def test_a_search_runs_on_while_its_deadline_moves_later() -> None:
    moved = [5.0]
    limits = Limits(3, deadline=5.0, moved=lambda: moved[0])
    assert not limits.spent(4.0)
    moved[0] = 8.0
    assert not limits.spent(6.0)  # past the first deadline, before the moved one
    assert limits.spent(9.0)
    # Control: the same deadline that nothing moves stops the search at 6 s.
    assert Limits(3, deadline=5.0).spent(6.0)
    assert not Limits(3).spent(1e9)


class SlowOnTheLargeInstance(ModelTarget):
    """The model, 20 ms per operation on the five-block instance: a search of known length
    (337 operations to depth 3, about 7 s) that does not depend on the machine's load."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.delay = 0.02 if config.num_blocks >= 5 else 0.0

    def apply(self, op: Op) -> Observation:
        time.sleep(self.delay)
        return super().apply(op)


def _grid_run() -> list[tuple[str, int, str]]:
    grid = grid_by_name(["full-p5-r2", "full-p3-r1", "full-p3-r1"])
    report = explore_grid(
        grid, SlowOnTheLargeInstance, "model", depth=3, max_states=10**6, budget_s=9.0, jobs=2
    )
    return [(c.instance, c.depth_completed, c.stopped) for c in report.certificates]


def test_a_running_instance_gets_the_time_its_small_neighbours_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two jobs, three instances: each starts with 2 * 9 / 3 = 6 s; the large one needs about 7 s.
    large, *small = _grid_run()
    assert large[1] == 3, large  # completed: the small ones' time passed to it while it ran
    assert all(depth == 3 for _, depth, _ in small)
    # Control: a deadline fixed when the instance starts (the policy before) cuts it.
    real = grid_module.Limits
    monkeypatch.setattr(grid_module, "Limits", lambda *a, moved=None, **k: real(*a, **k))
    large, *_ = _grid_run()
    assert large[1] < 3 and "budget spent" in large[2], large
