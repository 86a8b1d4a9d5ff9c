"""The long-prefill threshold (`Config.long_prefill_token_threshold`, `model.policy.scheduling`):
a step caps one request's chunk at it when another request is queued beside it, drafts
and padding included, and the Mamba split's "block wider than the budget" escape reads
the threshold whatever the queue.

The model alone, then vLLM's real `Scheduler` and `AsyncScheduler` against it on
scripted traces. Negative controls: the zoo's mutants (a lone request capped, the Mamba
split blind to the threshold) are caught on traces the unmutated scheduler passes; the targets with no scheduler refuse a
threshold; an invalid threshold is refused; the one case the fuzzer leaves out (a
threshold at or below the spec tokens) is shown to crash vLLM 0.33.0, which is why.
The vLLM parts are skipped, with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import pytest
from drive import Drive

from invariants.harness.observer import ModelObserver
from invariants.harness.trace import config_from_json, config_to_json
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.observation import StepResult
from model.contract.ops import AddRequest, Finish, Sample, Step
from model.machine.allocator import AllocatorModel
from model.policy.scheduling import capped, long_prefill_cap

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

PROMPT = (1, 2, 3, 3, 2, 1, 1, 2, 2, 3)
FULL_SWA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=30,
    retention_interval=0,
    max_model_len=4096,
    long_prefill_token_threshold=3,
)
MAMBA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 8)),
    num_blocks=30,
    retention_interval=8,
    max_model_len=4096,
    long_prefill_token_threshold=4,
)
DRAFTS = Config(
    groups=(GroupSpec("full", 4),),
    num_blocks=30,
    num_lookahead_tokens=2,
    max_model_len=4096,
    long_prefill_token_threshold=3,
)


def _scheduled(step: object) -> dict[str, int]:
    assert isinstance(step, StepResult)
    return {rid: r.scheduled for rid, r in step.results}


# ---------------------------------------------------------------- the rule, on the model alone
def test_the_cap_binds_only_beside_another_request() -> None:
    assert long_prefill_cap(8, 1) == 0 and long_prefill_cap(8, 2) == 8 and long_prefill_cap(0, 3) == 0
    assert capped(10, 8) == 8 and capped(5, 8) == 5 and capped(10, 0) == 10


def test_model_caps_chunks_beside_other_requests() -> None:
    m = AllocatorModel(FULL_SWA, observer=(m_seen := ModelObserver()))
    m.apply(AddRequest("r0", PROMPT))
    m.apply(AddRequest("r1", PROMPT[::-1]))
    assert _scheduled(m.apply(Step(("r0", "r1"), 64))) == {"r0": 3, "r1": 3}
    assert _scheduled(m.apply(Step(("r0",), 64))) == {"r0": 7}  # alone: nobody to starve
    assert m_seen.coverage["chunk capped by the long-prefill threshold"] == 2


def test_model_mamba_split_escapes_on_the_threshold() -> None:
    """Two Mamba prompts under a threshold of 4 < the Mamba block (8): sub-block chunks
    run (the split reads the threshold); without it no aligned chunk would ever fit."""
    m = AllocatorModel(MAMBA)
    m.apply(AddRequest("r0", PROMPT * 2))
    m.apply(AddRequest("r1", PROMPT))
    assert _scheduled(m.apply(Step(("r0", "r1"), 64))) == {"r0": 4, "r1": 4}
    uncapped = AllocatorModel(MAMBA.with_(long_prefill_token_threshold=0))
    uncapped.apply(AddRequest("r0", PROMPT * 2))
    assert _scheduled(uncapped.apply(Step(("r0",), 4))) == {"r0": 4}


def test_configuration_rules_and_json() -> None:
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        validate(FULL_SWA.with_(long_prefill_token_threshold=-1))
    with pytest.raises(ConfigError, match="cannot be greater than the max_model_len"):
        validate(FULL_SWA.with_(long_prefill_token_threshold=5000))
    assert config_from_json(config_to_json(FULL_SWA)) == FULL_SWA
    assert "long_prefill_token_threshold" not in config_to_json(
        FULL_SWA.with_(long_prefill_token_threshold=0)
    )
    with pytest.raises(ConfigError, match="long_prefill_token_threshold: must be an integer"):
        config_from_json({**config_to_json(FULL_SWA), "long_prefill_token_threshold": "3"})


def test_targets_without_a_scheduler_refuse_a_threshold() -> None:
    from invariants.targets.reference import ReferenceTarget

    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        ReferenceTarget(FULL_SWA)
    if _OK:
        from invariants.targets.vllm_target import VllmManagerTarget

        with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
            VllmManagerTarget(FULL_SWA)


# ---------------------------------------------------------------- through vLLM's real schedulers
def two_prompts(factory: object) -> Drive:
    """Full/SWA: two prompts capped at 3 beside each other; the second aborted, the first
    alone (uncapped: nobody to starve); a third arrives, capped at 3 beside the first's
    decodes. Every step the engine's own (a step names every request vLLM holds)."""
    d = Drive(FULL_SWA, factory).do(AddRequest("r0", PROMPT), AddRequest("r1", PROMPT[::-1]))
    d.do(Step(("r0", "r1"), 64), Finish("r1"), Step(("r0",), 64), Sample("r0", 1))
    d.do(AddRequest("r2", PROMPT[::-1]), Step(("r0", "r2"), 64))
    return d.do(Sample("r0", 2), Step(("r0", "r2"), 64), Finish("r0"), Finish("r2"))


def mamba_prompts(factory: object) -> Drive:
    """Full+Mamba: sub-block chunks under a threshold below the Mamba block; the second
    prompt aborted, the first goes on alone."""
    d = Drive(MAMBA, factory).do(AddRequest("r0", PROMPT * 2), AddRequest("r1", PROMPT))
    return d.do(Step(("r0", "r1"), 64), Step(("r0", "r1"), 64), Finish("r1"), Step(("r0",), 64))


def drafting(factory: object) -> Drive:
    """A decode with 2 drafts beside a prefill: 1 + 2 tokens fit under the threshold 3."""
    d = Drive(DRAFTS, factory).do(AddRequest("r0", PROMPT), Step(("r0",), 64), Sample("r0", 1, 0, (2, 3)))
    return d.do(AddRequest("r1", PROMPT * 2), Step(("r0", "r1"), 64), Sample("r0", 2, 1, (1, 1)))


TRACES = (two_prompts, mamba_prompts, drafting)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("target", ["vllm", "vllm-async-scheduler"])
def test_real_schedulers_agree_with_the_model(trace, target: str) -> None:  # type: ignore[no-untyped-def]
    from invariants.targets import target_factory

    if target == "vllm-async-scheduler" and trace is drafting:
        pytest.skip("its samples carry drafts the scheduler proposed itself (the async rows' form)")
    d = trace(target_factory(target))
    assert d.found == []
    assert d.checker.observer.coverage["chunk capped by the long-prefill threshold"] > 0


MUTANT_TRACES = {
    "long_prefill_caps_lone_request": two_prompts,
    "mamba_split_ignores_long_prefill": mamba_prompts,
}


@needs_vllm
@pytest.mark.vllm
def test_every_long_prefill_mutant_has_a_trace() -> None:
    from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS

    names = {n for n, m in SCHEDULER_MUTANTS.items() if m.strategy == "scheduler-long-prefill"}
    assert names == set(MUTANT_TRACES)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(MUTANT_TRACES))
def test_the_zoo_mutants_are_caught(name: str) -> None:
    """Negative controls: vLLM's scheduler capping a lone request, or splitting Mamba
    chunks without the threshold, disagrees with the model."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    assert MUTANT_TRACES[name](VllmSchedulerTarget).found == []
    with activate(name) as factory:
        assert MUTANT_TRACES[name](factory).found != []


@needs_vllm
@pytest.mark.vllm
def test_a_threshold_at_the_spec_tokens_crashes_vllm_0_33() -> None:
    """Why the fuzzer keeps a threshold above the spec tokens: vLLM 0.33.0 pads a
    one-token admission to 1 + k, clips it to the threshold, then asserts the padding."""
    from invariants.targets.vllm_env import vllm_version
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    if vllm_version() != "0.33.0":
        pytest.skip(f"stated for vLLM 0.33.0, installed {vllm_version()}")
    cfg = DRAFTS.with_(num_lookahead_tokens=3, long_prefill_token_threshold=2)
    d = Drive(cfg, VllmSchedulerTarget).do(AddRequest("r0", PROMPT * 2), Step(("r0",), 64), Finish("r0"))
    d.do(AddRequest("r1", (PROMPT * 2)[:17]), AddRequest("r2", (2, 2, 2)), Step(("r1", "r2"), 64))
    assert [v.check for v in d.found] == ["crash"] and "AssertionError" in d.found[0].message
