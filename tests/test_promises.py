"""The replay promise as the design makes it: where a replay lands, and which
keys serve it.

Two unmutated traces that an earlier statement of `promise_kept` flagged: a
block-aligned prompt whose hybrid Eagle replay lands at the extension boundary
(its sibling cached the shared prefix first), and a request whose admission hit
lies above its promised boundary (below the hit it computed no SWA tail). Both
targets keep the restated promise; the controls show it still failing when the
serving keys are gone or the admission hit is forgotten.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
from drive import check_contexts

from invariants.catalogue import BY_NAME, CheckContext
from invariants.catalogue.promises import promised_boundary
from invariants.harness.checker import Checker
from invariants.harness.known_findings import load_known_findings
from invariants.harness.replay import replay
from invariants.harness.trace import Trace, read_trace
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec, validate
from model.contract.ops import Finish

DATA = Path(__file__).parent / "data"
SIBLING_HIT = DATA / "promise_eagle_swa_sibling_hit.json"
HIT_ABOVE = DATA / "promise_hit_above_boundary.json"
PROMISES = ("promise_kept", "eagle_extra_block_kept")

needs_vllm = pytest.mark.skipif(not vllm_available()[0], reason=vllm_available()[1])


def finish_context(trace: Trace) -> CheckContext:
    """The context the checker hands the invariants at the trace's last Finish."""
    with check_contexts(copy_history=True) as seen:
        chk = Checker(ModelTarget(trace.config))
        for op in trace.ops:
            chk.step(op)
    return next(c for c in reversed(seen) if isinstance(c.op, Finish))


def promise_violations(trace: Trace, target: str) -> list[str]:
    result = replay(trace, target)
    return [str(v) for _, v in result.violations + result.known if v.check in PROMISES]


@pytest.mark.parametrize(
    "groups, prompt_len, want",
    [
        (
            (GroupSpec("full", 8), GroupSpec("swa", 4, sliding_window=4)),
            24,
            16,
        ),  # aligned: extension boundary
        ((GroupSpec("full", 8), GroupSpec("swa", 4, sliding_window=4)), 23, 8),
        ((GroupSpec("full", 8),), 24, 8),  # one group: the lookup stops at P-1
    ],
)
def test_promised_boundary_with_eagle(groups, prompt_len: int, want: int) -> None:
    cfg = validate(Config(groups=groups, num_blocks=16, retention_interval=0, eagle=True))
    assert promised_boundary(cfg, prompt_len) == want
    assert promised_boundary(validate(replace(cfg, eagle=False)), prompt_len) == (prompt_len - 1) // 8 * 8


@pytest.mark.parametrize("path", [SIBLING_HIT, HIT_ABOVE], ids=["sibling-hit", "hit-above"])
def test_unmutated_model_keeps_the_promise(path: Path) -> None:
    assert promise_violations(read_trace(path), "model") == []


@needs_vllm
@pytest.mark.parametrize("path", [SIBLING_HIT, HIT_ABOVE], ids=["sibling-hit", "hit-above"])
def test_unmutated_vllm_keeps_the_promise(path: Path) -> None:
    assert promise_violations(read_trace(path), "vllm-manager") == []


def test_replay_reaches_the_promised_boundary() -> None:
    """Not vacuous: the keys are all cached, so the probe ran and reached it."""
    for path in (SIBLING_HIT, HIT_ABOVE):
        ctx = finish_context(read_trace(path))
        req = ctx.finished_request
        assert req is not None and ctx.probe is not None
        e = promised_boundary(ctx.config, len(req.prompt))
        assert e > 0 and ctx.probe(req.prompt).hit >= max(e, req.hit)


def test_control_serving_key_gone() -> None:
    ctx = finish_context(read_trace(SIBLING_HIT))
    assert BY_NAME["promise_kept"].check(ctx) == []
    tail = next(k for k in ctx.history.ever_cached if k.group == 1 and len(k.tokens) == 16)
    hist = copy.deepcopy(ctx.history)
    hist.ever_cached.discard(tail)
    cached = {k: v for k, v in ctx.after.cached.items() if k != tail}
    assert BY_NAME["promise_kept"].check(replace(ctx, history=hist, after=replace(ctx.after, cached=cached)))


def test_control_admission_hit_forgotten() -> None:
    """Below its hit the request computed no SWA tail: asking for the keys of the
    lower boundary (as if it had no hit) breaks the promise on the same run."""
    ctx = finish_context(read_trace(HIT_ABOVE))
    req = ctx.finished_request
    assert req is not None and req.hit > promised_boundary(ctx.config, len(req.prompt))
    assert BY_NAME["promise_kept"].check(ctx) == []
    assert BY_NAME["promise_kept"].check(replace(ctx, finished_request=replace(req, hit=0)))


def test_eagle_mamba_resend_reaches_extension_boundary() -> None:
    """The aligned-prompt Eagle + Mamba resend (a known finding up to vLLM 0.31):
    on 0.33.0 semantics the replay lands at the extension boundary, whose state
    the scheduler split computed."""
    trace = next(f.trace for f in load_known_findings() if f.id == "eagle-mamba-aligned-prompt-resend")
    assert promise_violations(trace, "model") == []
    ctx = finish_context(trace)
    assert ctx.finished_request is not None
    hit = ctx.probe(ctx.finished_request.prompt).hit if ctx.probe else None
    assert hit == promised_boundary(trace.config, len(ctx.finished_request.prompt)) == 8
