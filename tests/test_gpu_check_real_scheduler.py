"""gpu_check with vLLM's real scheduler as the engine (`gpu_check.engine`): the
paged kernels read the block tables vLLM shipped (the shadow worker's), and the
outputs stay bit-identical across retention modes with hits and preemptions; a
scheduler that ships a stale table fails the check (the negative control)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from gpu_check.runner import CheckReport, default_config, default_modes, run_check  # noqa: E402
from gpu_check.targets import target_factory  # noqa: E402
from gpu_check.workload import make_workload  # noqa: E402

pytestmark = pytest.mark.vllm


def check(num_blocks: int = 22) -> CheckReport:
    base = default_config(num_blocks)
    modes = [m for m in default_modes(base) if m.name in ("off", "dense", "r0", "r32")]
    return run_check(target_factory("vllm"), make_workload(0, 6), base_config=base, modes=modes)


@contextlib.contextmanager
def stale_tables() -> Iterator[None]:
    """A planted scheduler defect: blocks allocated for running requests are never shipped."""
    from vllm.v1.core.sched.scheduler import Scheduler

    make = Scheduler._make_cached_request_data

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = make(self, *args, **kwargs)
        data.new_block_ids = [None for _ in data.new_block_ids]
        return data

    Scheduler._make_cached_request_data = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._make_cached_request_data = make  # type: ignore[method-assign]


@contextlib.contextmanager
def runner(name: str) -> Iterator[None]:
    """vLLM paired with its V1 or V2 model runner (read when the scheduler is built)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if name == "v2" else "0")
        yield


@pytest.mark.parametrize("name", ["v2", "v1"])
def test_outputs_are_bit_identical_across_retention_modes_on_the_tables_vllm_ships(name: str) -> None:
    with runner(name):
        report = check()
    assert report.ok, [(r.mode, r.verdict, r.detail) for r in report.results]
    assert report.target == "vllm"
    cached = [r for r in report.results if r.mode != "off"]
    assert all(r.stats and r.stats.accounting.hit_tokens > 0 for r in cached)
    assert all(r.tokens_checked > 0 for r in cached)
    assert any(r.stats and r.stats.accounting.preemptions > 0 for r in report.results), "no preemption"


def test_a_stale_shipped_table_fails_the_check() -> None:
    with stale_tables():
        report = check()
    assert not report.ok
    assert report.results[0].verdict in ("fault", "mismatch")
