"""`kvretain bench` (small workload): raw vLLM, the floor of any per-operation
differential check (the model beside vLLM, observations compared), and the
checked harness, each against vLLM's cycles; the floor really compares."""

from __future__ import annotations

from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.harness import bench  # noqa: E402
from model.contract.ops import Finish  # noqa: E402


def _ratio(lines: list[str], row: str) -> float:
    rows = "\n".join(lines).splitlines()
    return float(next(line for line in rows if line.startswith(row)).split()[-1])


def test_the_bench_places_the_floor_between_raw_and_checked() -> None:
    lines: list[str] = []
    assert bench.run_bench(requests=30, log=lines.append) == 0
    raw, floor = _ratio(lines, "vllm raw allocator"), _ratio(lines, "floor: model beside vllm")
    checked = _ratio(lines, "checked on vllm")
    assert raw == 1.0 and 0 < checked < floor < 1
    room = next(line for line in lines if line.startswith("above the floor"))
    assert "µs a cycle" in room and "they take" in room


def test_the_floor_compares_the_observations(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bench.lockstep_cycles(bench.workload(5, 0)) > 0
    apply = bench.ModelTarget.apply

    def wrong_on_finish(self: Any, op: Any) -> Any:
        obs = apply(self, op)
        return None if isinstance(op, Finish) else obs

    monkeypatch.setattr(bench.ModelTarget, "apply", wrong_on_finish)
    with pytest.raises(AssertionError):
        bench.lockstep_cycles(bench.workload(5, 0))


def test_the_bench_says_the_shadow_worker_ran_and_what_it_costs() -> None:
    """On vllm the shadow worker follows every step (slots read); both baselines run
    without it (none read); its cost and the whole engine contract's are printed."""
    lines: list[str] = []
    assert bench.run_bench(requests=30, log=lines.append) == 0
    (shadow,) = [line for line in lines if line.startswith("shadow worker on vllm: on (")]
    reads = int(shadow.split(" slots read")[0].rsplit("steps, ", 1)[1].replace(",", ""))
    assert reads > 0 and shadow.endswith("(0 slots read)")
    assert any(line.startswith("the shadow worker costs ") for line in lines)
    assert any(line.startswith("the engine contract (shadow worker, queue checks) costs ") for line in lines)


def test_the_cost_lines_say_when_the_shadow_costs_above_15_percent() -> None:
    """A baseline 20% faster than vllm is over the allowance, one 10% faster is not
    (control); the shadow's figures are quoted as counted."""
    figures = {"vllm": {"worker steps": 3, "slots read": 40, "slots written": 9, "queue checks": 6}}
    for faster, over in ((1.2, True), (1.1, False)):
        best = {
            "vllm": (100.0, 0.0, {}),
            bench.NO_SHADOW: (100 * faster, 0.0, {}),
            bench.NO_ENGINE_CONTRACT: (130.0, 0.0, {}),
        }
        lines = bench.engine_cost_lines(best, figures)
        assert "3 worker steps, 40 slots read, 9 written, 6 queue checks" in lines[0]
        assert lines[1].startswith(f"the shadow worker costs {faster - 1:.0%} ")
        assert ("above the 15%" in lines[1]) is over and "above the 15%" in lines[2]
