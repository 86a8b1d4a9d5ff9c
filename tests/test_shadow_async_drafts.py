"""The shadow worker under async scheduling with speculative decoding (vllm-async-scheduler).

One step ahead vLLM's scheduler counts the drafts of a step whose output it has not
processed as accepted and ships their slots as placeholders; the V2 runner takes the
rejected ones off the shipped count and computes its own drafts. The worker follows both
(`ShadowWorker`: `Chunk.after`, `_unrolled`, `_rewrite`). Checked on the trace a 40 s fuzz
found when the worker was first turned on there: clean; controls: without the correction
the shipped count disagrees (`worker_positions_consistent`), without the rewrite the next
step reads placeholder KV (`worker_reads_own_prefix`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from invariants.shadow import worker as shadow  # noqa: E402
from invariants.targets.vllm_env import vllm_available  # noqa: E402
from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.ops import AddRequest, Op, Sample, Step  # noqa: E402

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

CFG = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 2)),
    num_blocks=19,
    retention_interval=4,
    eagle=True,
    hash_block_size=2,
    max_num_batched_tokens=64,
    max_num_seqs=1,
    num_lookahead_tokens=3,
    long_prefill_token_threshold=16,
    reserve_full_isl=True,
)
OPS: list[Op] = [
    AddRequest("r0", (2,)),
    Step(("r0",), 64),
    Sample("r0", 1, drafts=(2, 1)),
    Step(("r0",), 64),
    Sample("r0", 1, accepted=2),
    Step(("r0",), 64),
    Sample("r0", 3),
    Step(("r0",), 64),
]
WORKER = {"worker_positions_consistent", "worker_reads_own_prefix"}


def _found() -> set[str]:
    from drive import async_drive

    d = async_drive(CFG)
    assert d.checker.target.steps.shadow is not None  # on, drafts and all
    d.do(*OPS)
    return {v.check for v in d.audited()} & WORKER


@needs_vllm
@pytest.mark.vllm
def test_the_worker_follows_async_drafts() -> None:
    assert _found() == set()


@needs_vllm
@pytest.mark.vllm
def test_control_without_the_runners_correction() -> None:
    from drive import patched

    with patched(shadow, "_unrolled", lambda chunk: 0):
        assert "worker_positions_consistent" in _found()


@needs_vllm
@pytest.mark.vllm
def test_control_without_the_runners_own_drafts() -> None:
    from drive import patched

    def nothing(self: Any, view: Any, start: int, end: int) -> None:
        return None

    with patched(shadow.ShadowWorker, "_rewrite", nothing):
        assert "worker_reads_own_prefix" in _found()
