"""The watermark an admission leaves (`admission_keeps_watermark`) and the finding it
reports on vLLM 0.33.0: a Mamba external state left out of the gate's count
(`vllm-mamba-external-state-uncounted-watermark`, docs/semantics.md row 31).

Regression: `kvretain fuzz --target vllm-async-scheduler --budget-s 60 --seed 1` found
the model refusing an admission the AsyncScheduler made (an `observation` mismatch):
the model gated on what the admission takes, vLLM on its smaller count. The model now
predicts vLLM's admission and the invariant reports the breach as the known finding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from invariants.harness.known_findings import load_known_findings
from invariants.harness.replay import replay
from invariants.harness.trace import Trace, read_trace
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Offer, Sample, Step

FINDING = "vllm-mamba-external-state-uncounted-watermark"
FUZZ_TRACE = "tests/data/watermark_uncounted_async.json"


def _finding_trace() -> Trace:
    (f,) = [f for f in load_known_findings() if f.id == FINDING]
    return f.trace


def _judged(result):  # (check, known?) per violation a replay reported
    return [v.check for _, v in result.violations], [v.check for _, v in result.known]


@pytest.mark.parametrize("target", ["model", "vllm", "vllm-async-scheduler"])
def test_the_finding_is_reported_on_each_target(target: str) -> None:
    result = replay(_finding_trace(), target)
    assert result.clean and _judged(result) == ([], ["admission_keeps_watermark"]), result.violations


@pytest.mark.parametrize("target", ["model", "vllm"])
def test_without_a_watermark_the_same_admission_is_clean(target: str) -> None:
    """Control: the same trace with watermark 0 admits r0 as well and reports nothing."""
    trace = _finding_trace()
    result = replay(replace(trace, config=trace.config.with_(watermark=0.0)), target)
    assert result.clean and not result.known, (result.violations, result.known)


def test_the_fuzz_trace_agrees_with_the_model_and_is_the_finding() -> None:
    """The shrunk seed-1 trace: no observation mismatch left; the breach is the finding."""
    result = replay(read_trace(FUZZ_TRACE), "vllm-async-scheduler")
    assert result.clean and _judged(result) == ([], ["admission_keeps_watermark"]), result.violations


def test_the_finding_claims_only_the_mamba_shortfall() -> None:
    """The claim reads the shortfall: at most one block per align-mode Mamba group, with
    external tokens; a deeper breach, or one without external tokens, is a new violation."""
    (f,) = [f for f in load_known_findings() if f.id == FINDING]
    cfg, op = f.trace.config, f.trace.ops[-1]
    msg = "admission of r0 ({} external tokens) while a request ran left {} free block(s), below the watermark's {}"
    assert f.claims("admission_keeps_watermark", msg.format(8, 0, 1), cfg, op)
    assert not f.claims("admission_keeps_watermark", msg.format(0, 0, 1), cfg, op)
    assert not f.claims("admission_keeps_watermark", msg.format(8, 0, 2), cfg, op)
    assert not f.claims("admission_keeps_watermark", msg.format(8, 0, 1), cfg.with_(watermark=0.0), op)


def test_a_watermark_the_count_keeps_is_not_flagged() -> None:
    """Control: with one more block in the pool (and the same watermark) the admission
    leaves the watermark free on vLLM and the model."""
    cfg = Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="align")),
        num_blocks=9,
        hash_block_size=4,
        scheduler_block_size=4,
        kv_connector=True,
        watermark=0.2,
        max_num_batched_tokens=64,
    )
    ops = [
        AddRequest("ra", (7, 7, 7)),
        Step(("ra",), 64),
        Sample("ra", 7),
        AddRequest("r0", tuple(range(1, 10))),
        Offer("r0", 8, "sync"),
        Step(("ra", "r0"), 64),
    ]
    for target in ("model", "vllm"):
        result = replay(Trace(cfg, ops, seed=0, target="vllm"), target)
        assert result.clean and not result.known, (target, result.violations, result.known)
