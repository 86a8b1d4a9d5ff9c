"""vLLM settings the model does not predict (`invariants.harness.checker.unpredicted`): the
priority scheduling policy. A run under it is judged by the engine contract, the catalogue
and crashes alone. Eagle's lookahead block hashes (vLLM 0.33.0's default for Eagle) are
predicted (`model.contract.eagle`; tests/test_lookahead_hashes.py).

Checked: which configurations are unpredicted; `model.contract.eagle`'s lookahead rules against the
scheduler vLLM builds (its `num_hash_lookahead_tokens` and `use_eagle_block_drop`); that
generation draws each value (lookahead hashes where asked, most often on); that under the
priority policy the model is out of the judging (a planted model defect passes) while a
crash is still found (a planted vLLM failure), and that the same planted model defect is
found under FCFS (the control); that lookahead-hashed runs are judged against the model.
The vLLM parts are skipped, with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from drive import Drive, patched
from hypothesis import HealthCheck, given, settings

import model.policy.admission as adm
from invariants.harness.checker import unpredicted
from invariants.harness.strategies import configs
from invariants.targets.vllm_env import vllm_available
from model.contract import eagle
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Step

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

A = tuple(range(1, 7))
B = tuple(range(20, 36))


def cfg(**kw: object) -> Config:
    base: dict[str, object] = {"groups": (GroupSpec("full", 2),), "num_blocks": 12, "max_model_len": 4096}
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def test_which_settings_are_unpredicted() -> None:
    assert unpredicted(cfg()) == ()
    assert unpredicted(cfg(scheduling_policy="priority")) == ("the priority scheduling policy",)
    eagle_cfg = cfg(eagle=True, num_lookahead_tokens=1, lookahead_block_hashes=True)
    assert unpredicted(eagle_cfg) == ()  # predicted (`model.contract.eagle`)
    assert unpredicted(eagle_cfg.with_(kv_connector=True)) == ()
    assert unpredicted(eagle_cfg.with_(enable_caching=False)) == ()


@pytest.mark.parametrize("asked", [False, True])
@pytest.mark.parametrize(("caching", "connector"), [(True, False), (False, False), (True, True)])
def test_lookahead_rules(asked: bool, caching: bool, connector: bool) -> None:
    c = cfg(
        eagle=True,
        num_lookahead_tokens=1,
        lookahead_block_hashes=asked,
        enable_caching=caching,
        kv_connector=connector,
    )
    lookahead = eagle.hash_lookahead_tokens(True, asked, caching, connector)
    assert bool(lookahead) == c.lookahead_hashes_in_force
    assert eagle.drops_last_block(True, lookahead) == (not lookahead)
    assert eagle.hashed_tokens(9, lookahead) == 9 - lookahead
    assert eagle.mamba_proof_limit(9, True, 0) == 9 and eagle.mamba_proof_limit(9, False, lookahead) == 8
    if not _OK:
        return
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    sched = VllmSchedulerTarget(c).vllm_scheduler
    assert sched.num_hash_lookahead_tokens == lookahead
    assert sched.use_eagle_block_drop == eagle.drops_last_block(True, lookahead)


def test_generation_draws_each_value() -> None:
    seen: Counter[tuple[str, bool]] = Counter()

    @settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        configs(allow_pinning=False, eagle=True, eagle_drafts=True, unpredicted=True, lookahead_hashes=None)
    )
    def draw(c: Config) -> None:
        seen[("priority", c.scheduling_policy == "priority")] += 1
        seen[("lookahead", c.lookahead_block_hashes)] += 1

    draw()
    assert seen[("priority", True)] and seen[("priority", False)], seen
    # vLLM's default most often, the legacy hashes too.
    assert seen[("lookahead", True)] > seen[("lookahead", False)] > 0, seen

    @settings(max_examples=50, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(configs(allow_pinning=False, eagle=True, eagle_drafts=True))
    def control(c: Config) -> None:  # not asked for: neither
        assert c.scheduling_policy == "fcfs" and not c.lookahead_block_hashes

    control()


@pytest.mark.parametrize(
    "target, priority", [("vllm", True), ("vllm-async-scheduler", True), ("vllm-manager", False)]
)
def test_only_engine_step_targets_draw_the_priority_policy(target: str, priority: bool) -> None:
    """The priority policy orders vLLM's own queues: the targets that run vLLM's own steps
    are sent it; one whose steps kvretain decides (vllm-manager: its caller is kvretain,
    which states the order) is not (the control)."""
    from invariants.harness.fuzz import _generated

    seen: Counter[bool] = Counter()

    @settings(max_examples=120, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_generated(target))
    def draw(c: Config) -> None:
        seen[c.scheduling_policy == "priority"] += 1

    draw()
    assert bool(seen[True]) == priority, seen


def trace(d: Drive) -> Drive:
    """B's first chunk fits beside A, its whole sequence does not (`test_admission_gates`)."""
    budget = d.checker.config.max_model_len
    d.do(AddRequest("a", A), Step(("a",), budget), AddRequest("b", B))
    d.steps(("a", "b"), budget)
    return d.do(Finish("a"), Step(("b",), budget))


GATED = {"reserve_full_isl": True, "long_prefill_token_threshold": 4}


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_runs_judge_without_the_model(policy: str) -> None:
    """The full-sequence gate reverted in the model: found under FCFS (the control), not
    under the priority policy, where the model is out of the judging."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    with patched(adm, "full_sequence_fits", lambda full, wm, free: True):
        d = Drive(cfg(scheduling_policy=policy, **GATED), VllmSchedulerTarget)
        with contextlib.suppress(AssertionError):  # the planted model's state went its own way
            trace(d)
        assert bool(d.audited()) == (policy == "fcfs")


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("planted", [False, True])
def test_unpredicted_runs_still_judge_the_contract(planted: bool) -> None:
    """Under the priority policy vLLM refusing a lone request on an idle pool (planted: every
    allocation fails) is still `fitting_request_admitted` (a contract invariant); unplanted,
    the same steps are clean."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    real = KVCacheManager.allocate_slots
    plant = (lambda self, *args, **kwargs: None) if planted else real
    with patched(KVCacheManager, "allocate_slots", plant):
        d = Drive(cfg(scheduling_policy="priority"), VllmSchedulerTarget)
        d.do(AddRequest("a", A), Step(("a",), 4096))
        found = d.audited()
    assert [v.check for v in found] == (["fitting_request_admitted"] if planted else []), found


@needs_vllm
@pytest.mark.vllm
def test_lookahead_hashes_run_clean_against_the_model() -> None:
    """Eagle with lookahead hashes on vLLM's real scheduler (its default): a prompt, its
    decode and a second request sharing its prefix, judged against the model too: clean."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    c = cfg(eagle=True, num_lookahead_tokens=1, lookahead_block_hashes=True, num_blocks=20)
    d = Drive(c, VllmSchedulerTarget)
    assert any("disable_lookahead_block_hashes=False" in s for s in d.checker.target.engine_settings())
    d.do(AddRequest("a", A + A), Step(("a",), 4096))
    d.steps(("a",), 4096, 2)
    d.do(Finish("a"), AddRequest("b", A + A + (9,)), Step(("b",), 4096))
    assert not d.checker.unpredicted
    assert d.audited() == []


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_known_crash_still_tolerated_under_unpredicted_settings(policy: str) -> None:
    """save-during-load-freed-at-first-report (a save of a request finished while its async
    load is in flight): the crash is raised under either policy and matches its known
    finding, its message whole (found by the 90 s vllm fuzz, where the contract-only
    message suffix had kept it from matching)."""
    from invariants.harness.checker import Checker
    from invariants.harness.known_findings import is_known_violation
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from model.contract.ops import Loaded, Offer, Save

    c = Config(
        groups=(GroupSpec("full", 4),),
        num_blocks=8,
        max_model_len=4096,
        kv_connector=True,
        scheduling_policy=policy,
    )
    chk = Checker(VllmSchedulerTarget(c), audit_every=1)
    found = []
    ops = [AddRequest("r0", tuple(range(1, 14))), Offer("r0", 12, "async"), Step(("r0",), 4096)]
    for op in [*ops, Save("r0"), Finish("r0"), Loaded("r0", True)]:
        found += chk.step(op)
    crashes = [v for v in found if v.check == "crash"]
    assert crashes and all(is_known_violation("vllm", v) for v in crashes), found
