"""The shadow worker and the scheduler's queues: the engine's contract, judged on
what vLLM's real `Scheduler` tells its model runner (`invariants.shadow`).

Each check is shown failing on a planted defect of the class it guards (a
scheduler shipping the worker wrong positions, a dropped resumed flag, a fresh
block left unzeroed, a stale table, a finished request left running), next to
the same trace clean on vLLM as released. The worker's own rules are shown on
hand-written outputs first (no vLLM needed).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from invariants.shadow import POSITIONS, QUEUES, READS, ZEROED, ShadowWorker, WorkerGroup, queue_problems

# ---------------------------------------------------------------------- the worker's rules, by hand


def output(
    new: tuple[Any, ...] = (),
    cached: tuple[tuple[str, int, Any], ...] = (),
    scheduled: dict[str, int] | None = None,
    zero: list[int] | None = None,
    finished: frozenset[str] = frozenset(),
    resumed: frozenset[str] = frozenset(),
) -> SimpleNamespace:
    """A `SchedulerOutput` as the runner reads it: `cached` as (rid, computed, new block ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=set(resumed),
            all_token_ids={},
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
        new_block_ids_to_zero=zero,
        kv_cache_block_copies=None,
    )


def new_req(rid: str, prompt: list[int], blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=prompt,
        prefill_token_ids=prompt,
        block_ids=(blocks,),
        num_computed_tokens=computed,
    )


FULL4 = (WorkerGroup("full", 4),)


def checks(worker: ShadowWorker) -> list[str]:
    return [check for check, _ in worker.take_problems()]


def test_a_hit_on_blocks_of_the_same_prefix_reads_its_own_kv() -> None:
    w = ShadowWorker(FULL4)
    w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5], [1, 2]),), scheduled={"a": 5}))
    w.execute(output(new=(new_req("b", [1, 2, 3, 4, 9], [1, 3], computed=4),), scheduled={"b": 1}))
    assert checks(w) == []
    assert w.figures.reads == 5 + 5


def test_a_hit_on_another_prefixs_block_is_a_wrong_read() -> None:
    """Control: the same hit, but block 1 holds [1, 2, 3, 7]: b's read of it is wrong."""
    w = ShadowWorker(FULL4)
    w.execute(output(new=(new_req("a", [1, 2, 3, 7, 5], [1, 2]),), scheduled={"a": 5}))
    w.execute(output(new=(new_req("b", [1, 2, 3, 4, 9], [1, 3], computed=4),), scheduled={"b": 1}))
    assert checks(w) == [READS]


def test_a_running_request_continues_at_the_workers_own_position() -> None:
    w = ShadowWorker(FULL4)
    w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5, 6], [1]),), scheduled={"a": 4}))
    w.execute(output(cached=(("a", 4, ([2],)),), scheduled={"a": 2}))
    assert checks(w) == []
    # Control: told one position too many, the worker would skip position 4.
    w = ShadowWorker(FULL4)
    w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5, 6], [1]),), scheduled={"a": 4}))
    w.execute(output(cached=(("a", 5, ([2],)),), scheduled={"a": 1}))
    assert POSITIONS in checks(w)


def test_a_sample_after_a_short_step_is_at_the_wrong_position() -> None:
    w = ShadowWorker(FULL4, synchronous=False)  # only the sample is judged here
    w.execute(output(new=(new_req("a", [1, 2, 3], [1]),), scheduled={"a": 3}))
    w.returned("a", [7])
    assert checks(w) == []
    w.execute(output(new=(new_req("b", [1, 2, 3], [2]),), scheduled={"b": 2}))
    w.returned("b", [7])
    assert checks(w) == [POSITIONS]


def test_one_step_ahead_a_step_waits_for_the_token_it_reads() -> None:
    """Async scheduling tells step 2 before step 1's token is returned: step 2 runs when
    it is; a share returned empty never brings one, so the step runs on the token the
    worker sampled and nobody saw (a phantom) rather than wait for ever."""
    for token in ([7], []):
        w = ShadowWorker(FULL4, synchronous=False)
        w.execute(output(new=(new_req("a", [1, 2, 3], [1]),), scheduled={"a": 3}))
        w.execute(output(cached=(("a", 3, None),), scheduled={"a": 1}))
        assert w.figures.steps == 1  # step 2 reads position 3, whose token is not back
        w.returned("a", token)
        assert w.figures.steps == 2
        assert checks(w) == []


def test_a_resumed_request_under_the_v1_runner_replaces_its_table() -> None:
    """V1 keeps a preempted request's state; `resumed_req_ids` says its table is new."""

    def run(resumed: frozenset[str]) -> list[str]:
        w = ShadowWorker(FULL4, runner="v1")
        w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5, 6], [1, 2]),), scheduled={"a": 6}))
        w.returned("a", [7])
        # Preempted, then resumed with a 4-token hit on block 1 and a fresh block 3.
        w.execute(output(cached=(("a", 4, ([1, 3],)),), scheduled={"a": 3}, resumed=resumed))
        return checks(w)

    assert run(frozenset({"a"})) == []
    assert run(frozenset()) != []  # control: the flag dropped, the worker appends to a stale table


def test_a_fresh_block_is_zeroed_before_attention_reads_its_tail() -> None:
    def run(zero: list[int]) -> list[str]:
        w = ShadowWorker(FULL4, zeroing=True)
        w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5], [1, 2]),), scheduled={"a": 5}, zero=zero))
        return checks(w)

    assert run([1, 2]) == []
    assert run([1]) == [ZEROED]  # control: block 2's tail is read unzeroed


def test_a_finished_request_is_never_scheduled_again() -> None:
    w = ShadowWorker(FULL4)
    w.execute(output(new=(new_req("a", [1, 2, 3, 4, 5], [1, 2]),), scheduled={"a": 4}))
    w.execute(output(finished=frozenset({"a"})))
    w.execute(output(cached=(("a", 4, None),), scheduled={"a": 1}))
    assert checks(w) == [POSITIONS]


# ---------------------------------------------------------------------- on vLLM's real scheduler

from invariants.targets.vllm_env import vllm_available  # noqa: E402

_OK, _REASON = vllm_available()
vllm_only = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

sys.path.insert(0, str(Path(__file__).parent))
from drive import Drive, async_drive  # noqa: E402
from engine_drive_steps import engine_steps  # noqa: E402

from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.observation import StepResult  # noqa: E402
from model.contract.ops import AddRequest, Finish, Probe, ResetPrefixCache  # noqa: E402

# Built with an 8-token budget (the prompts run in chunks) and a pool small enough that
# two decoding requests run it dry (vLLM preempts one).
FULL_SWA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=14,
    retention_interval=0,
    max_model_len=4096,
    max_num_batched_tokens=8,
)
FULL_MAMBA = FULL_SWA.with_(groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)))
PROMPT = (1, 2, 3) * 6


def lifecycle(cfg: Config, one_step_ahead: bool = False) -> Drive:
    """Two requests chunked, sampled, a finish with a hit after it, a preemption under
    pool pressure and, once the other request finishes, the resume; every step the
    engine's own (`engine_steps`); `one_step_ahead`: on vLLM's `AsyncScheduler` (async
    scheduling, vLLM's default)."""
    d = async_drive(cfg) if one_step_ahead else Drive(cfg)
    d.do(AddRequest("r0", PROMPT), AddRequest("r1", (*PROMPT, 1)))
    engine_steps(d, 6).do(Finish("r0"), Probe(PROMPT), AddRequest("r2", PROMPT))
    for _ in range(12):  # decodes until the pool runs dry
        if engine_steps(d).preempted:
            break
    engine_steps(d.do(Finish("r1")), 2)
    return d.do(Finish("r2"), ResetPrefixCache())


def preempted_and_resumed(d: Drive) -> list[str]:
    """The requests a step preempted and a later step scheduled again."""
    steps = [obs for obs in d.seen if isinstance(obs, StepResult)]
    return [
        rid
        for i, obs in enumerate(steps)
        for rid in obs.preempted
        if any(r == rid and res.scheduled for later in steps[i + 1 :] for r, res in later.results)
    ]


@contextlib.contextmanager
def planted(name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """`Scheduler.name` wrapped by `wrap` until exit: a planted scheduler defect."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = getattr(Scheduler, name)
    setattr(Scheduler, name, wrap(original))
    try:
        yield
    finally:
        setattr(Scheduler, name, original)


@contextlib.contextmanager
def v1_runner() -> Iterator[None]:
    """vLLM paired with its V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`, read when the scheduler is built)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        yield


def found(d: Drive) -> set[str]:
    return {v.check for v in d.audited()}


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("cfg", [FULL_SWA, FULL_MAMBA], ids=["full+swa", "full+mamba"])
def test_vllm_as_released_keeps_the_engine_contract(cfg: Config) -> None:
    d = lifecycle(cfg)
    assert found(d) == set()
    assert preempted_and_resumed(d) == ["r2"]
    figures = d.checker.target.engine_figures()
    assert figures is not None and figures["slots read"] > 300 and figures["worker steps"] >= 10


def plus_one(make: Callable[..., Any]) -> Callable[..., Any]:
    """Every cached request's shipped `num_computed_tokens` one too many."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = make(self, *args, **kwargs)
        data.num_computed_tokens = [n + 1 for n in data.num_computed_tokens]
        return data

    return wrapped


def drop_resumed(make: Callable[..., Any]) -> Callable[..., Any]:
    """The resumed flags dropped (the V1 runner appends to the stale table)."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = make(self, *args, **kwargs)
        data.resumed_req_ids = set()
        return data

    return wrapped


def drop_last_zeroed(take: Callable[..., Any]) -> Callable[..., Any]:
    """The last fresh block of each step missing from `new_block_ids_to_zero`."""

    def wrapped(self: Any) -> Any:
        ids = take(self)
        return ids[:-1] or None if ids else ids

    return wrapped


def no_new_blocks(make: Callable[..., Any]) -> Callable[..., Any]:
    """Blocks allocated but none shipped to a running request (a stale table)."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = make(self, *args, **kwargs)
        data.new_block_ids = [None for _ in data.new_block_ids]
        return data

    return wrapped


def keep_running(finish: Callable[..., Any]) -> Callable[..., Any]:
    """A finished request left in `running`."""

    def wrapped(self: Any, request_ids: Any, status: Any, *args: Any, **kwargs: Any) -> Any:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        running = [r for r in self.running if r.request_id in ids]
        result = finish(self, request_ids, status, *args, **kwargs)
        self.running.extend(r for r in running if r not in self.running)
        return result

    return wrapped


# name -> (Scheduler method, wrapper, V1 runner, configuration of the trace, the checks that report it)
PLANTS: dict[str, tuple[str, Callable[..., Any], bool, Config, frozenset[str]]] = {
    "computed_off_by_one": ("_make_cached_request_data", plus_one, False, FULL_SWA, frozenset({POSITIONS})),
    "resumed_flag_dropped": (
        "_make_cached_request_data",
        drop_resumed,
        True,
        FULL_SWA,
        frozenset({POSITIONS, READS}),
    ),
    "block_not_zeroed": (
        "_get_new_block_ids_to_zero",
        drop_last_zeroed,
        False,
        FULL_MAMBA,
        frozenset({ZEROED}),
    ),
    "stale_table": ("_make_cached_request_data", no_new_blocks, False, FULL_SWA, frozenset({READS})),
    "finished_left_running": ("finish_requests", keep_running, False, FULL_SWA, frozenset({QUEUES})),
}


@contextlib.contextmanager
def plant(name: str) -> Iterator[None]:
    method, wrap, v1, _, _ = PLANTS[name]
    with contextlib.ExitStack() as stack:
        if v1:
            stack.enter_context(v1_runner())
        stack.enter_context(planted(method, wrap))
        yield


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_engine_defect_is_reported_on_the_lifecycle(name: str) -> None:
    """Each planted defect breaks the check that guards its class; unplanted, the same
    trace keeps the contract (`test_vllm_as_released_keeps_the_engine_contract`)."""
    _, _, v1, cfg, expected = PLANTS[name]
    if v1:
        with v1_runner():
            clean = lifecycle(cfg)
        assert clean.checker.target.steps.shadow.runner == "v1"
        assert found(clean) == set()
    with plant(name):
        assert found(lifecycle(cfg)) & expected


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_engine_defect_is_found_by_fuzzing(name: str, tmp_path: Path) -> None:
    """`kvretain fuzz --target vllm` with a budget finds each planted defect as the check
    that guards it (generated configurations, the known findings tolerated)."""
    from invariants.harness.fuzz import run_fuzz

    _, _, _, _, expected = PLANTS[name]
    with plant(name):
        report = run_fuzz("vllm", budget_s=40, seed=1, out_dir=tmp_path, progress=False)
    assert report.failure is not None, f"{name}: not found in {report.stats.steps} steps"
    assert {v.check for v in report.failure.violations} & expected, report.failure


@vllm_only
@pytest.mark.vllm
def test_the_fuzz_summary_states_the_engine_settings_and_what_the_worker_checked(tmp_path: Path) -> None:
    """A green run says which of vLLM's defaults were not in force and how much the shadow
    worker read; an example it did not follow (a KV connector) is counted as such."""
    from invariants.harness.fuzz import format_features, run_fuzz

    report = run_fuzz("vllm", steps=600, seed=2, out_dir=tmp_path, progress=False)
    assert report.failure is None, report.failure
    features = report.stats.features
    assert features["engine contract: slots read"] > 0
    assert features["engine contract: queue checks"] >= report.stats.steps // 2
    assert features["engine: scheduler_reserve_full_isl=False (not vLLM's default, True)"] > 0
    assert all(len(f) <= 80 for f in features if f.startswith("engine"))
    text = format_features([report])
    assert "engine contract: slots read" in text and "not vLLM's default" in text


def test_a_preempted_request_computes_nothing_unless_it_holds_a_loads_blocks() -> None:
    """An async load promotes a preempted request with its loaded tokens computed, in
    `kv_holding_waiting` (vLLM 0.33.0 `_handle_blocked_waiting_request`; a 90 s fuzz
    met it): that holds; the same request in `waiting` holds no blocks for its
    computed tokens (the control)."""
    status = SimpleNamespace(
        RUNNING=SimpleNamespace(name="RUNNING"), PREEMPTED=SimpleNamespace(name="PREEMPTED")
    )
    running = [SimpleNamespace(request_id="a", status=status.RUNNING, num_computed_tokens=4)]
    loaded = SimpleNamespace(request_id="b", status=status.PREEMPTED, num_computed_tokens=8)

    def problems(waiting: list[Any], holding: list[Any]) -> list[str]:
        sched = SimpleNamespace(
            running=running,
            waiting=waiting,
            kv_holding_waiting=holding,
            requests={r.request_id: r for r in running + waiting + holding},
        )
        return queue_problems(sched, lambda s: False, status.RUNNING, status.PREEMPTED)

    assert problems([], [loaded]) == []
    assert problems([loaded], []) != []


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(n for n, p in PLANTS.items() if not p[2]))
def test_one_step_ahead_the_worker_waits_for_its_tokens_and_judges_the_same(name: str) -> None:
    """Under async scheduling a step is told before the token it reads is returned: the
    worker runs it once the token is back. Clean as released; each planted defect found."""
    _, _, _, cfg, expected = PLANTS[name]
    clean = lifecycle(cfg, one_step_ahead=True)
    assert clean.checker.target.steps.shadow is not None
    assert found(clean) == set()
    with plant(name):
        assert found(lifecycle(cfg, one_step_ahead=True)) & expected
