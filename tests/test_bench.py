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
