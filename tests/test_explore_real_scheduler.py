"""`kvretain explore` on vLLM's real scheduler ("vllm"), and its verify row.

- the grid a real scheduler runs: the Eagle instance with a lookahead slot (the
  plain one is refused there: the control), the lookahead-hashes instance, a
  connector instance for a target with a connector; the model's grid is unchanged;
- the alphabet: samples with drafts where the model speculates (none where it
  does not), offers, load and save reports where a connector is attached (none
  without), one `Step` per budget for a lone request on a real scheduler;
- the fingerprint: vLLM's hidden state separates two states the model's state
  alone merges; a fork carries it (a planted change is seen);
- the verify row runs on "vllm" and fails on a planted skip or an instance
  below its minimum depth (the unplanted grid passes);
- the configuration summary says what held and what was refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from invariants.cli import explore as cli_explore
from invariants.cli import verify
from invariants.explore.alphabet import alphabet
from invariants.explore.certificate import Certificate
from invariants.explore.configs import ENGINE_BUDGET, ConfigReport, check_configurations
from invariants.explore.fingerprint import HIDDEN_STATE
from invariants.explore.fork import Freezer
from invariants.explore.grid import GridReport
from invariants.explore.instances import (
    CONNECTOR,
    EAGLE,
    EAGLE_LOOKAHEAD,
    LOOKAHEAD_HASHES,
    Instance,
    default_grid,
    features_of,
    grid_by_name,
)
from invariants.explore.search import Limits, _is_valid, _state_of, explore, new_checker
from invariants.harness.checker import Checker, Violation
from invariants.targets import target_factory
from invariants.targets.base import TargetFeatures
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.ops import (
    AddRequest,
    Finish,
    Loaded,
    Offer,
    Op,
    Preempt,
    Sample,
    Save,
    Saved,
    Schedule,
    Step,
)

REAL = TargetFeatures(real_scheduler=True, connector=True)
TINY = grid_by_name(["full-p3-r1"])[0]
TWO = Instance(
    "full-p5-r2-verify",
    validate(Config(groups=(GroupSpec("full", 2),), num_blocks=5, max_model_len=24)),
    max_requests=2,
    prompt_lengths=(2,),
    budgets=(64,),
)


def _vllm() -> Any:
    try:
        return target_factory("vllm")
    except Exception as exc:  # noqa: BLE001 - any reason vLLM cannot load here
        pytest.skip(f"vllm target unavailable: {exc}")


def _checker(factory: Any, config: Config, ops: list[Op]) -> Checker:
    checker = new_checker(factory, config)
    for op in ops:
        assert not checker.step(op), op
    return checker


def _ops(
    inst: Instance, checker: Checker, next_rid: int, real: bool = False, engine: bool = False
) -> list[Op]:
    return alphabet(inst, checker.model, next_rid, _is_valid(checker), real, engine)


# ---------------------------------------------------------------------------- the grid


def test_real_scheduler_grid_runs_eagle_with_lookahead_and_a_connector_instance() -> None:
    grid = {i.name: i for i in default_grid(REAL)}
    assert EAGLE not in grid
    eagle = grid[EAGLE_LOOKAHEAD]
    assert eagle.config.eagle and eagle.config.num_lookahead_tokens == 1
    assert grid[CONNECTOR].config.kv_connector
    # The model's grid: as before, no connector instance, the plain Eagle instance.
    plain = [i.name for i in default_grid()]
    assert EAGLE in plain and CONNECTOR not in plain and EAGLE_LOOKAHEAD not in plain
    assert grid[LOOKAHEAD_HASHES].config.hash_lookahead == 1 and LOOKAHEAD_HASHES not in plain
    extra = (EAGLE_LOOKAHEAD, CONNECTOR, LOOKAHEAD_HASHES)
    assert [n for n in grid if n not in extra] == [n for n in plain if n != EAGLE]
    with_connector = [i.name for i in default_grid(TargetFeatures(connector=True))]
    assert CONNECTOR in with_connector and EAGLE in with_connector


@pytest.mark.vllm
def test_eagle_instance_is_searched_on_vllm_with_drafts_and_the_plain_one_is_refused() -> None:
    factory = _vllm()
    inst = grid_by_name([EAGLE_LOOKAHEAD], features_of(factory))[0]
    cert = explore(inst, factory, "vllm", Limits(3))
    assert cert.ok and not cert.skipped and cert.depth_completed == 3
    assert cert.op_kinds["Sample+drafts"] > 0
    # Control: the model grid's Eagle instance (no lookahead slot) is refused by vLLM.
    plain = explore(grid_by_name([EAGLE])[0], factory, "vllm", Limits(1))
    assert plain.skipped and "lookahead" in plain.skipped.lower()


# ---------------------------------------------------------------------------- the alphabet


CONNECTED = Instance(
    "connector-test",
    validate(Config(groups=(GroupSpec("full", 2),), num_blocks=6, max_model_len=24, kv_connector=True)),
    max_requests=2,
    prompt_lengths=(4,),
    budgets=(64,),
)


def test_alphabet_offers_and_reports_where_a_connector_is_attached() -> None:
    prompt = (1, 2, 1, 1)
    added = _checker(ModelTarget, CONNECTED.config, [AddRequest("r00", prompt)])
    ops = _ops(CONNECTED, added, 1)
    assert Offer("r00", 4, "sync") in ops and Offer("r00", 4, "async") in ops and Save("r00") in ops
    loading = _checker(
        ModelTarget,
        CONNECTED.config,
        [AddRequest("r00", prompt), Offer("r00", 4, "async"), Step(("r00",), 64)],
    )
    ops = _ops(CONNECTED, loading, 1)
    assert Loaded("r00", True) in ops and Loaded("r00", False) in ops
    sync = _checker(
        ModelTarget,
        CONNECTED.config,
        [AddRequest("r00", prompt), Offer("r00", 4, "sync"), Step(("r00",), 64)],
    )
    assert any(isinstance(op, Loaded) and op.invalid for op in _ops(CONNECTED, sync, 1))
    saving = _checker(
        ModelTarget, CONNECTED.config, [AddRequest("r00", prompt), Step(("r00",), 64), Save("r00")]
    )
    assert saving.step(Finish("r00")) == []
    assert Saved("r00") in _ops(CONNECTED, saving, 1)
    # Control: the same request without a connector is offered none of them.
    bare = Instance("bare", validate(CONNECTED.config.with_(kv_connector=False)), prompt_lengths=(4,))
    none = _ops(bare, _checker(ModelTarget, bare.config, [AddRequest("r00", prompt)]), 1)
    assert not [op for op in none if isinstance(op, (Offer, Loaded, Save, Saved))]


@pytest.mark.vllm
def test_alphabet_samples_carry_drafts_where_the_model_speculates() -> None:
    factory = _vllm()
    inst = grid_by_name([EAGLE_LOOKAHEAD], features_of(factory))[0]
    ran = _checker(factory, inst.config, [AddRequest("r00", (1, 2)), Step(("r00",), inst.budgets[0])])
    drafted = [op for op in _ops(inst, ran, 1, True, True) if isinstance(op, Sample) and op.drafts]
    assert drafted and all(len(op.drafts) == ran.model.num_spec_tokens == 1 for op in drafted)
    # Control: the model target does not speculate, so its samples carry none.
    model = _checker(ModelTarget, inst.config, [AddRequest("r00", (1, 2)), Schedule("r00", 64)])
    samples = [op for op in _ops(inst, model, 1) if isinstance(op, Sample)]
    assert samples and not [op for op in samples if op.drafts or op.accepted]


def test_real_scheduler_alphabet_sends_one_step_per_budget_for_a_lone_request() -> None:
    added = _checker(ModelTarget, TWO.config, [AddRequest("r00", (1, 2))])
    real = _ops(TWO, added, 1, True)
    assert not [op for op in real if isinstance(op, Schedule)]
    assert [op for op in real if isinstance(op, Step)] == [Step(("r00",), 64)]
    # Control: elsewhere the single-request Schedule is its own operation.
    assert Schedule("r00", 64) in _ops(TWO, added, 1)


ENGINE = TargetFeatures(real_scheduler=True, connector=True, engine_steps=True)


def test_an_engine_grid_builds_each_instance_with_the_budget_that_binds() -> None:
    """Where the engine decides every step, each instance states its token budget (the
    smallest of its budgets above its lookahead slots) and offers it alone; control: the
    same grid for a directed real scheduler, and the model's, state none."""
    engine = {i.name: i for i in default_grid(ENGINE)}
    directed = {i.name: i for i in default_grid(REAL)}
    assert engine.keys() == directed.keys()
    for name, inst in engine.items():
        wanted = min(b for b in directed[name].budgets if b > inst.config.num_lookahead_tokens)
        assert inst.config.max_num_batched_tokens == wanted and inst.budgets == (wanted,), name
        assert not directed[name].config.max_num_batched_tokens, name
    assert engine["full-p3-r1"].budgets == (1,) and engine[EAGLE_LOOKAHEAD].budgets == (2,)
    assert not [i for i in default_grid() if i.config.max_num_batched_tokens]
    assert grid_by_name(["full-p6-tenants"], ENGINE)[0].config.max_num_batched_tokens == 64


def test_engine_alphabet_offers_the_engines_step_and_nothing_steered() -> None:
    """One `Step` over every live request in the model's queue order with the built budget,
    none while a request awaits its sample (its samples instead), no `Preempt`, no step
    per request; control: the directed real-scheduler alphabet offers both."""
    inst = grid_by_name(["full-p5-r2"], ENGINE)[0]
    budget = inst.config.max_num_batched_tokens
    two = _checker(ModelTarget, inst.config, [AddRequest("r00", (1, 2)), AddRequest("r01", (1, 2, 1, 1, 2))])
    ops = _ops(inst, two, 2, True, True)
    assert [op for op in ops if isinstance(op, Step)] == [Step(("r00", "r01"), budget)]
    assert not [op for op in ops if isinstance(op, (Preempt, Schedule))]
    assert Finish("r00") in ops and Finish("r01") in ops
    ran = _checker(ModelTarget, inst.config, [AddRequest("r00", (1, 2)), Step(("r00",), budget)])
    ops = _ops(inst, ran, 1, True, True)
    assert not [op for op in ops if isinstance(op, Step)]
    assert Sample("r00", 1) in ops and Sample("r00", 2) in ops and Preempt("r00") not in ops
    directed = _ops(inst, two, 2, True)
    assert Step(("r00",), budget) in directed and Preempt("r00") in _ops(inst, ran, 1, True)


def test_configurations_reach_an_engine_target_with_a_budget() -> None:
    """Operation zero builds each configuration as the engine's grid is built: with a token
    budget where the target's engine decides every step; control: none for the model."""
    seen: list[int] = []

    class Engine(ModelTarget):
        features = replace(ModelTarget.features, engine_steps=True)

        def __init__(self, config: Config) -> None:
            seen.append(config.max_num_batched_tokens)
            super().__init__(config)

    engine = check_configurations(Engine)
    assert engine.ok and set(seen) == {ENGINE_BUDGET} and len(seen) == engine.checked
    seen.clear()
    plain = check_configurations(type("Plain", (Engine,), {"features": ModelTarget.features}))
    assert plain.ok and set(seen) == {0} and plain.checked == engine.checked


# ---------------------------------------------------------------------------- the fingerprint

# Two orders of the same operations, each the engine's own steps: the model's state is the
# same (one request running with two tokens computed, one finished), but after the second
# path vLLM's scheduler still holds r01's finish to report with its next step.
_FINISHED_BEFORE: list[Op] = [
    AddRequest("r00", (1, 2)),
    Finish("r00"),
    AddRequest("r01", (1, 2)),
    Step(("r01",), 2),
]
_FINISHED_AFTER: list[Op] = [
    AddRequest("r00", (1, 2)),
    Step(("r00",), 2),
    AddRequest("r01", (1, 2)),
    Finish("r01"),
]


@pytest.mark.vllm
def test_hidden_state_separates_states_the_model_alone_merges() -> None:
    factory = _vllm()
    cfg = grid_by_name(["full-p5-r2"])[0].config
    image = HIDDEN_STATE["vllm"]
    a, b = (_checker(factory, cfg, ops) for ops in (_FINISHED_BEFORE, _FINISHED_AFTER))
    assert _state_of(a, False) == _state_of(b, False)  # the model's state merges them
    assert _state_of(a, False, image=image) != _state_of(b, False, image=image)
    # Control: the same path twice gives the same fingerprint, hidden state included.
    again = _checker(factory, cfg, _FINISHED_BEFORE)
    assert _state_of(a, False, image=image) == _state_of(again, False, image=image)


@pytest.mark.vllm
def test_a_fork_carries_the_hidden_state() -> None:
    factory = _vllm()
    cfg = grid_by_name(["full-p5-r2"])[0].config
    image = HIDDEN_STATE["vllm"]
    checker = _checker(factory, cfg, _FINISHED_AFTER)
    freezer = Freezer()
    frozen = freezer.freeze(checker)
    thawed = freezer.thaw(frozen)
    assert _state_of(thawed, False, image=image) == _state_of(checker, False, image=image)
    # Control: a change to the scheduler's hidden state alone is seen.
    planted = freezer.thaw(frozen)
    planted.target.vllm_scheduler.finished_req_ids.clear()  # type: ignore[attr-defined]
    assert _state_of(planted, False) == _state_of(checker, False)
    assert _state_of(planted, False, image=image) != _state_of(checker, False, image=image)


@pytest.mark.vllm
def test_vllm_connector_instance_exercises_the_connector_and_says_what_it_merged() -> None:
    factory = _vllm()
    inst = grid_by_name([CONNECTOR], features_of(factory))[0]
    cert = explore(inst, factory, "vllm", Limits(4))
    assert cert.ok and cert.depth_completed == 4, cert.verdict_text()
    for kind in (
        "Offer(sync)",
        "Offer(async)",
        "Loaded(ok)",
        "Loaded(failed)",
        "Loaded(failed blocks)",
        "Save",
    ):
        assert cert.op_kinds[kind] > 0, kind
    assert "hidden state" in cert.merging and "left out" in cert.merging
    model_only = explore(inst, factory, "vllm", Limits(1), hidden_state=False)
    assert "assumes" in model_only.merging and "not compared" in model_only.merging


# ---------------------------------------------------------------------------- the verify row


class RefusesTwo(ModelTarget):
    """Planted: refuses the second instance's configuration, so it is skipped."""

    def __init__(self, config: Config) -> None:
        if config == TWO.config:
            raise ConfigError("planted refusal")
        super().__init__(config)


def test_verify_row_fails_on_a_planted_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    row = cli_explore.verify_row("model", instances=[TINY, TWO], factory=RefusesTwo)
    check, target, verdict, figure, _, good, _ = row
    assert not good and "skipped" in verdict and TWO.name in verdict
    assert f"minimum depth {cli_explore.VERIFY_MIN_DEPTH}" in figure and "1 skipped" in figure
    # Control: the same grid, nothing refused, holds.
    held = cli_explore.verify_row("model", instances=[TINY, TWO], factory=ModelTarget)
    assert held[5] and held[2] == "clean", held


def _report(depths: list[int], skipped: bool = False) -> GridReport:
    report = GridReport("vllm")
    for i, d in enumerate(depths):
        cert = Certificate(f"i{i}", "vllm", 6, depth_completed=d)
        report.certificates.append(cert)
    if skipped:
        report.certificates[-1].skipped = "the time budget was spent"
    return report


def test_verify_verdict_fails_below_the_minimum_depth_or_on_a_skip_or_violation() -> None:
    assert cli_explore.verify_verdict(_report([3, 4]), 3)[5]  # control: at the minimum
    shallow = cli_explore.verify_verdict(_report([3, 2]), 3)
    assert not shallow[5] and "below depth 3: i1 (2)" in shallow[2]
    assert not cli_explore.verify_verdict(_report([3, 3], skipped=True), 3)[5]
    bad = _report([3, 3])
    bad.certificates[0].violation = "planted"
    assert cli_explore.verify_verdict(bad, 3)[2].startswith("VIOLATION")


def test_verify_row_runs_on_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[str] = []

    def fake_row(target: str, quick: bool = False, out: Path | None = None) -> tuple[Any, ...]:
        calls.append(target)
        return ("explore", target, "clean", "-", 0.0, True, None)

    monkeypatch.setattr(cli_explore, "verify_row", fake_row)
    recorded: list[tuple[Any, ...]] = []
    run = SimpleNamespace(
        imported=lambda module: cli_explore,
        missing=lambda target: None,
        skipped=lambda *a: recorded.append(("skipped", *a)),
        record=lambda *a: recorded.append(a),
        args=SimpleNamespace(quick=True),
        out=tmp_path,
    )
    verify.row_explore(run)  # type: ignore[arg-type]
    assert calls == ["vllm"] and recorded[0][1] == "vllm"


# ---------------------------------------------------------------------------- configurations


def test_configuration_summary_says_what_held_and_what_was_refused() -> None:
    report = ConfigReport(checked=10, valid=6, refused=2, first_refusal="vLLM's Eagle needs lookahead")
    text = report.summary()
    assert "exactly what the model accepts" not in text
    assert "built none of the 4 the model rejects" in text
    assert "refused 2 of the 6 valid ones" in text and "built the other 4" in text
    # Control: a violation is reported as one.
    report.violations.append((TWO.config, Violation("config_rejection", "accepted a configuration")))
    assert "1 VIOLATION(s)" in report.summary()
