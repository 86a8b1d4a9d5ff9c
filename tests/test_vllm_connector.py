"""KV connectors: the model's contract (`model.machine.connector`) and kvretain's scripted
connector in vLLM's real `Scheduler` ("vllm" with `Config.kv_connector`).

Model tests need no vLLM: what an external hit allocates, when an async load's
blocks are cached, what a failed load rolls back, when a finish's free is
deferred (a load in flight, a save), what a save is handed, where a load
failed on some blocks is cut, the connector operations' JSON round trip and
bad input. The vLLM tests drive
scripted traces against the model (every observation and snapshot must agree),
check the connector is vLLM's own registered kind and records what it was asked,
and run the zoo's connector mutants as negative controls (each caught on a
trace the unmutated scheduler passes), plus the checks' own controls.
"""

from __future__ import annotations

import pytest
from drive import Drive, own

from invariants.harness.checker import Checker, InvalidOp
from invariants.harness.observer import ModelObserver
from invariants.harness.trace import config_from_json, config_to_json
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.observation import Done, LoadCut, Queues, Saving, StepResult
from model.contract.ops import (
    AddRequest,
    Finish,
    Loaded,
    Offer,
    Op,
    Probe,
    Sample,
    Save,
    Saved,
    Step,
    op_from_json,
    op_to_json,
)
from model.machine.allocator import AllocatorModel
from model.machine.connector import external_tokens, remaining_blocks
from model.machine.failed_blocks import failable_blocks

FULL_SWA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=24,
    max_model_len=4096,
    kv_connector=True,
)
FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=16, max_model_len=4096, kv_connector=True)
PROMPT = tuple(range(1, 14))  # 13 tokens
# An engine's chunks (a build-time input): with another request queued, one request computes
# at most 4 (`SYNC_CUT`: r1's chunk in `sync_invalid_ops`) or 8 tokens a step (`SHARED_CUT`:
# r0's first chunk in `shared_invalid_ops`).
SYNC_CUT = FULL.with_(long_prefill_token_threshold=4)
SHARED_CUT = FULL.with_(long_prefill_token_threshold=8)

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


# ------------------------------------------------------------------ the contract, on the model
def test_external_tokens_never_cover_the_last_token() -> None:
    assert external_tokens(20, 13, 0) == 12
    assert external_tokens(9, 13, 4) == 5
    assert external_tokens(4, 13, 8) == 0
    assert remaining_blocks(13, [4, 2], [2, 7]) == 2 + 0


def test_sync_hit_allocates_external_blocks_and_caches_them() -> None:
    m = AllocatorModel(FULL)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Offer("r0", 9, "sync"))
    r = own(m.apply(Step(("r0",), 64)), "r0")
    assert (r.hit, r.external, r.scheduled, r.admitted) == (0, 9, 4, True)
    assert m.requests["r0"].num_computed == 13 and m.requests["r0"].offer is None
    # The external blocks were cached with the chunk's: a replay hits them.
    assert len(m.snapshot().tables["r0"][0]) == 4
    assert m.apply(Probe(PROMPT)).hit == 12  # type: ignore[union-attr]


def test_async_load_is_cached_only_at_promotion() -> None:
    m = AllocatorModel(FULL)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Offer("r0", 13, "async"))
    r = own(m.apply(Step(("r0",), 64)), "r0")
    assert (r.scheduled, r.admitted, r.external) == (0, False, 12)
    assert m.requests["r0"].load == "loading" and len(m.snapshot().tables["r0"][0]) == 3
    assert m.apply(Probe(PROMPT)).hit == 0  # type: ignore[union-attr]  # delayed caching
    # Not reported: passed over, back in the queue of requests holding blocks.
    assert m.apply(Step(("r0",), 64)) == StepResult((), (), queues=Queues((), ("r0",), ()))
    assert m.requests["r0"].load == "loading"
    m.apply(Loaded("r0", True))
    assert m.apply(Probe(PROMPT)).hit == 0  # type: ignore[union-attr]  # cached at promotion, not report
    r = own(m.apply(Step(("r0",), 64)), "r0")
    assert (r.scheduled, r.admitted, r.hit) == (1, True, None)
    assert m.apply(Probe(PROMPT)).hit == 12  # type: ignore[union-attr]


def test_failed_load_frees_everything_and_readmits() -> None:
    m = AllocatorModel(FULL, observer=(m_seen := ModelObserver()))
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Offer("r0", 13, "async"))
    m.apply(Step(("r0",), 64))
    loaded_blocks = set(m.snapshot().tables["r0"][0])
    m.apply(Loaded("r0", False))
    r = own(m.apply(Step(("r0",), 64)), "r0")
    assert (r.hit, r.external, r.scheduled, r.admitted) == (0, 0, 13, True)
    # The failed blocks went back to the pool before the re-admission took new ones.
    assert set(m.snapshot().tables["r0"][0]) <= loaded_blocks | set(range(1, 16))
    assert m_seen.coverage["connector: failed load rolled back"] == 1


def test_fail_policy_ends_the_request_and_frees_it() -> None:
    m = AllocatorModel(FULL.with_(kv_load_failure_policy="fail"))
    c = Checker(ModelTarget(FULL.with_(kv_load_failure_policy="fail")))
    for op in (AddRequest("r0", PROMPT), Offer("r0", 13, "async"), Step(("r0",), 64), Loaded("r0", False)):
        m.apply(op)
        assert c.step(op) == []
    assert "r0" not in m.requests and "r0" not in m.snapshot().tables and not m.held
    assert "r0" not in c.history.requests
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        AllocatorModel(FULL.with_(kv_load_failure_policy="retry"))  # type: ignore[arg-type]


def test_finish_during_a_load_defers_the_free_until_it_reports() -> None:
    m = AllocatorModel(FULL)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Offer("r0", 13, "async"))
    m.apply(Step(("r0",), 64))
    m.apply(Finish("r0"))
    snap = m.snapshot()
    assert "r0" in snap.tables and m.held == {"r0"}
    m.apply(Loaded("r0", True))
    assert "r0" not in m.snapshot().tables and not m.held
    assert m.apply(Probe(PROMPT)).hit == 0  # type: ignore[union-attr]  # never cached


def save_ops() -> list[Op]:
    """A saved request decoding past its prompt's last block (7 prompt tokens, 9
    computed: 3 blocks of 4), finished; another request admitted while the save is
    pending; the save reports; a save of a request that never ran (no block)."""
    return [
        AddRequest("s0", tuple(range(200, 207))),
        Save("s0"),
        Step(("s0",), 64),
        Sample("s0", 1),
        Step(("s0",), 64),
        Sample("s0", 2),
        Step(("s0",), 64),
        Finish("s0"),
        AddRequest("s1", PROMPT),
        Step(("s1",), 64),
        Saved("s0"),
        AddRequest("s2", PROMPT),
        Save("s2"),
        Finish("s2"),
        Sample("s1", 3),
        Save("s1"),
        Finish("s1"),
        Probe(PROMPT),
        Saved("s1"),
        Probe(PROMPT),
    ]


def test_a_save_defers_the_free_until_it_reports() -> None:
    m = AllocatorModel(FULL, observer=(m_seen := ModelObserver()))
    obs = {i: m.apply(op) for i, op in enumerate(save_ops()[:8])}
    table = m.snapshot().tables["s0"][0]
    # Handed the blocks of its 9 computed tokens (past the prompt's 2 blocks), held until `Saved`.
    assert obs[7] == Saving((table,)) and len(table) == 3 and m.sending == {"s0"}
    assert not set(table) & set(m.snapshot().free_queue)
    m.apply(save_ops()[8])
    m.apply(save_ops()[9])  # s1's admission takes no block s0 still holds
    assert not set(table) & set(m.snapshot().tables["s1"][0])
    m.apply(Saved("s0"))
    assert "s0" not in m.snapshot().tables and not m.sending
    assert set(table) <= set(m.snapshot().free_queue)
    # A request handed no block is not deferred; the observation still says what it was handed.
    m.apply(AddRequest("s2", PROMPT))
    m.apply(Save("s2"))
    assert m.apply(Finish("s2")) == Saving(((),)) and not m.sending
    assert m_seen.coverage["connector: freed when the save reported"] == 1


def invalid_ops() -> list[Op]:
    """Two async loads failing on some blocks (Full4, one group): r1 (hit 12 on blocks
    1-3, 3 external tokens in block 4) fails on block 3, cut to 8 with a valid prefix;
    r2 (12 external tokens in blocks 5-7, admitted while r1 loads) on block 5, cut to 0;
    both then promoted."""
    return [
        AddRequest("r0", PROMPT),
        Step(("r0",), 64),
        Sample("r0", 5),
        Finish("r0"),
        AddRequest("r1", PROMPT + (7, 7, 7)),
        Offer("r1", 16, "async"),
        Step(("r1",), 64),
        AddRequest("r2", tuple(range(30, 45))),
        Offer("r2", 12, "async"),
        Step(("r1", "r2"), 64),
        Loaded("r1", True, (3,)),
        Loaded("r2", True, (5,)),
        Step(("r1", "r2"), 64),
        Probe(PROMPT + (7, 7, 7)),
    ]


def test_a_load_failed_on_some_blocks_is_cut_at_the_first() -> None:
    m = AllocatorModel(FULL, observer=(m_seen := ModelObserver()))
    obs = [m.apply(op) for op in invalid_ops()[:10]]
    assert failable_blocks(m, m.requests["r1"]) == [1, 2, 3, 4] and failable_blocks(m, m.requests["r2"]) == [
        5,
        6,
        7,
    ]
    assert m.apply(Loaded("r1", True, (3,))) == LoadCut(8)
    assert m.apply(Loaded("r2", True, (5,))) == LoadCut(0)
    step = m.apply(Step(("r1", "r2"), 64))
    # r1 resumes at 8 with the blocks it holds (the valid prefix cached); r2 is re-admitted afresh.
    assert (own(step, "r1").scheduled, own(step, "r1").hit, own(step, "r1").new_blocks) == (8, None, ((),))
    assert (own(step, "r2").admitted, own(step, "r2").hit, own(step, "r2").external) == (True, 0, 0)
    assert m_seen.coverage["connector: valid prefix of a load kept"] == 1 and obs[3] == Done()
    # "fail": the cut request ends with an error, freed.
    f = AllocatorModel(FULL.with_(kv_load_failure_policy="fail"))
    for op in invalid_ops()[:10]:
        f.apply(op)
    assert f.apply(Loaded("r1", True, (4,))) == LoadCut(12, ended=("r1",)) and "r1" not in f.snapshot().tables
    # Two groups: block ids are unique per group only, vLLM refuses; none may be named.
    two = AllocatorModel(FULL_SWA)
    for op in invalid_ops()[:7]:
        two.apply(op)
    assert failable_blocks(two, two.requests["r1"]) == []


def sync_invalid_ops(policy: str = "recompute") -> list[Op]:
    """A sync load failed on some blocks (Full4, one group): r0's 12 external tokens in
    blocks 1-3 and its last token in block 4, in one step. "recompute" (on `SYNC_CUT`):
    r1, after it in the step, hits blocks 1-3 and computes 4 tokens of its own (the
    engine's long-prefill chunk); the output reports block 2: r0 is cut to 4 (it
    recomputes blocks 2-4), r1 back to its hit (12: r0 recomputes block 2 for it); both
    then run to their samples in 4-token chunks. "fail": r0 alone (saved), block 2
    failed: ended, blocks 2-4 evicted."""
    if policy == "fail":
        return [
            AddRequest("r0", PROMPT),
            Save("r0"),
            Offer("r0", 12, "sync"),
            Step(("r0",), 64),
            Loaded("r0", True, (2,)),
            Probe(PROMPT),
            AddRequest("r1", PROMPT),
            Step(("r1",), 64),
            Saved("r0"),
            Probe(PROMPT),
        ]
    return [
        AddRequest("r0", PROMPT),
        AddRequest("r1", PROMPT[:12] + tuple(range(50, 58))),
        Offer("r0", 12, "sync"),
        Step(("r0", "r1"), 64),
        Loaded("r0", True, (2,)),
        Step(("r0", "r1"), 64),
        Step(("r0", "r1"), 64),
        Sample("r1", 3),
        Step(("r0", "r1"), 64),
        Sample("r0", 3),
        Sample("r1", 4),
        Finish("r0"),
        Finish("r1"),
        Probe(PROMPT),
    ]


def test_a_sync_load_failed_on_some_blocks_cuts_every_request_holding_one() -> None:
    m = AllocatorModel(SYNC_CUT, observer=(m_seen := ModelObserver()))
    ops = sync_invalid_ops()
    step = [m.apply(op) for op in ops[:4]][-1]
    assert (own(step, "r1").hit, own(step, "r1").scheduled) == (12, 4)
    # The blocks the connector loaded; r1's own load has none (it is no sync load).
    assert failable_blocks(m, m.requests["r0"]) == [1, 2, 3] and failable_blocks(m, m.requests["r1"]) == []
    assert m.apply(ops[4]) == LoadCut(4, (("r1", 12),))
    step = m.apply(ops[5])  # each resumes at its cut (r0 at 4, r1 at 12), in 4-token chunks
    assert (own(step, "r0").scheduled, own(step, "r1").scheduled) == (4, 4)
    assert (m.requests["r0"].num_computed, m.requests["r1"].num_computed) == (8, 16)
    assert m_seen.coverage["connector: a request sharing a failed block cut"] == 1
    # "recompute" evicts nothing: block 2 keeps its hash and is recomputed in place.
    assert [m.apply(op) for op in ops[6:]][-1].hit == 12  # type: ignore[union-attr]


def test_a_sync_load_failed_under_fail_evicts_its_dependent_blocks() -> None:
    m = AllocatorModel(FULL.with_(kv_load_failure_policy="fail"), observer=(m_seen := ModelObserver()))
    obs = [m.apply(op) for op in sync_invalid_ops("fail")]
    # Cut at block 2 (4 tokens), ended and saved (the connector was handed block 1).
    assert obs[4] == LoadCut(4, ended=("r0",)) and obs[5].hit == 4  # type: ignore[union-attr]
    assert m_seen.coverage["connector: a sync load's failed blocks evicted ('fail')"] == 1
    assert m_seen.coverage["connector: freed when the save reported"] == 1
    # Without the eviction blocks 2-3 would keep the hashes of KV computed on block 2.
    kept = AllocatorModel(FULL.with_(kv_load_failure_policy="fail"))
    for op in sync_invalid_ops("fail")[:4]:
        kept.apply(op)
    assert {b for bs in kept.snapshot().cached.values() for b in bs} == {1, 2, 3}
    kept.apply(Loaded("r0", True, (2,)))
    assert {b for bs in kept.snapshot().cached.values() for b in bs} == {1}


def shared_invalid_ops() -> list[Op]:
    """An async load sharing a running request's blocks (Full4, one group, on `SHARED_CUT`):
    r0 computes 8 of its 13 tokens (the engine's long-prefill chunk; blocks 1-2, cached
    in the step); r1, after it in the step, extends its prompt, hits blocks 1-2 and
    loads 6 external tokens (blocks 3-4); its load fails on block 2, which r0 holds too.
    Both then run to their samples in 8-token chunks."""
    return [
        AddRequest("r0", PROMPT),
        AddRequest("r1", PROMPT + (7, 7)),
        Offer("r1", 15, "async"),
        Step(("r0", "r1"), 64),
        Loaded("r1", True, (2,)),
        Step(("r0", "r1"), 64),
        Step(("r0", "r1"), 64),
        Sample("r0", 3),
        Sample("r1", 3),
        Finish("r0"),
        Finish("r1"),
        Probe(PROMPT),
    ]


def test_an_async_load_failed_on_a_block_a_running_request_holds_cuts_both() -> None:
    m = AllocatorModel(SHARED_CUT, observer=(m_seen := ModelObserver()))
    ops = shared_invalid_ops()
    for op in ops[:4]:
        m.apply(op)
    assert failable_blocks(m, m.requests["r1"]) == [1, 2, 3, 4]
    assert m.apply(ops[4]) == LoadCut(4, (("r0", 4),))
    step = m.apply(ops[5])
    # r0 recomputes from block 2 on (9 tokens); r1, promoted, from its cut too (11): 8-token chunks.
    assert (own(step, "r0").scheduled, own(step, "r1").scheduled, own(step, "r1").admitted) == (8, 8, True)
    assert (m.requests["r0"].num_computed, m.requests["r1"].num_computed) == (12, 12)
    assert m_seen.coverage["connector: a running request holding a failed block cut"] == 1
    # "fail": blocks another live request holds are named too (both end at once);
    # not those of a running request awaiting its sample.
    f = AllocatorModel(SHARED_CUT.with_(kv_load_failure_policy="fail"))
    for op in ops[:4]:
        f.apply(op)
    assert failable_blocks(f, f.requests["r1"]) == [1, 2, 3, 4]
    w = AllocatorModel(FULL)
    for op in [ops[0], Step(("r0",), 64), *ops[1:3], Step(("r0", "r1"), 64)]:  # r0 computed all 13 tokens
        w.apply(op)
    assert w.requests["r0"].awaits_sample and failable_blocks(w, w.requests["r1"]) == [5]  # r0 holds 1-3


def test_a_sync_load_reports_only_right_after_its_step() -> None:
    c = Checker(ModelTarget(SYNC_CUT))
    for op in sync_invalid_ops()[:4]:
        c.step(op)
    with pytest.raises(InvalidOp, match="only the blocks it failed on"):
        c.step(Loaded("r0", True))
    with pytest.raises(InvalidOp, match="'invalid'"):
        c.step(Loaded("r0", True, (4,)))  # its last token's block is its own chunk's
    c.step(Probe(PROMPT))
    with pytest.raises(InvalidOp, match="no connector load in flight"):
        c.step(Loaded("r0", True, (2,)))
    # Another request of the step awaits its sample (no chunk: r1 computed all): the output cannot come whole.
    c = Checker(ModelTarget(FULL))
    for op in sync_invalid_ops()[:3] + [Step(("r0", "r1"), 64)]:
        c.step(op)
    assert c.model.requests["r1"].awaits_sample and failable_blocks(c.model, c.model.requests["r0"]) == []
    # "fail": a block another request holds is named too (both end at once).
    f = AllocatorModel(SYNC_CUT.with_(kv_load_failure_policy="fail"))
    for op in sync_invalid_ops()[:4]:
        f.apply(op)
    assert failable_blocks(f, f.requests["r0"]) == [1, 2, 3]
    ended = f.apply(Loaded("r0", True, (2,)))
    assert isinstance(ended, LoadCut) and ended.ended == ("r0", "r1")


def riding_sample_ops(policy: str) -> list[Op]:
    """r0's sync load (12 external tokens, blocks 1-3) and r1 (hitting them, its last
    token of its own) complete their prompts in one step; r1 is sampled, its token riding
    on the step's output, which then reports block 2 failed: r0 is cut to 4, r1 back to
    its hit (12), and vLLM skips r1's output, dropping the sample ("fail": both end)."""
    ops: list[Op] = [
        AddRequest("r0", PROMPT),
        AddRequest("r1", PROMPT[:12] + (99,)),
        Offer("r0", 12, "sync"),
        Step(("r0", "r1"), 64),
        Sample("r1", 5),
        Loaded("r0", True, (2,)),
    ]
    if policy == "fail":
        return [*ops, Probe(PROMPT), AddRequest("r3", tuple(range(100, 140))), Step(("r3",), 64)]
    return [*ops, Step(("r0", "r1"), 64), Sample("r0", 7), Sample("r1", 8), Finish("r0"), Probe(PROMPT)]


def test_a_sample_rides_on_the_sync_loads_report_and_a_cut_drops_it() -> None:
    m = AllocatorModel(FULL, observer=(m_seen := ModelObserver()))
    ops = riding_sample_ops("recompute")
    for op in ops[:4]:
        m.apply(op)
    assert failable_blocks(m, m.requests["r0"]) == []  # r1 awaits its sample: not whole
    m.apply(ops[4])
    assert m.sync_report is not None and m.sync_report.sampled == {"r1"}
    assert failable_blocks(m, m.requests["r0"]) == [1, 2, 3]
    assert m.apply(ops[5]) == LoadCut(4, (("r1", 12),), dropped=("r1",))
    assert m.requests["r1"].num_tokens == 13  # its sample dropped: it recomputes its last token
    assert m.requests["r1"].tokens == PROMPT[:12] + (99,)
    assert m_seen.coverage["connector: a sample riding on a sync load's failed blocks dropped"] == 1
    # Control: any other operation between the step and the report ends the report's turn.
    o = AllocatorModel(FULL)
    for op in [*ops[:4], Probe(PROMPT), ops[4]]:
        o.apply(op)
    assert o.sync_report is None and failable_blocks(o, o.requests["r0"]) == []


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_judges_history_takes_a_dropped_sample_back(policy: str) -> None:
    """The catalogue's history of the requests follows the report: the dropped sample's
    token taken back (`LoadCut.dropped`), and under "fail" every request it ended gone."""
    c = Checker(ModelTarget(FULL.with_(kv_load_failure_policy=policy)))  # type: ignore[arg-type]
    for op in riding_sample_ops(policy)[:6]:
        c.step(op)
    if policy == "fail":
        assert "r0" not in c.history.requests and "r1" not in c.history.requests
        return
    assert c.history.requests["r1"].tokens == c.model.requests["r1"].tokens == PROMPT[:12] + (99,)
    # Control: an observation naming no drop leaves the history's token in place.
    d = Checker(ModelTarget(FULL))
    for op in riding_sample_ops(policy)[:5]:
        d.step(op)
    from invariants.catalogue.history import advance_requests

    advance_requests(d.history, Loaded("r0", True, (2,)), LoadCut(4, (("r1", 12),)))
    assert d.history.requests["r1"].tokens == PROMPT[:12] + (99, 5)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_real_scheduler_agrees_on_a_sample_riding_on_a_sync_loads_report(policy: str) -> None:
    d = Drive(FULL.with_(kv_load_failure_policy=policy)).do(*riding_sample_ops(policy))  # type: ignore[arg-type]
    assert d.audited() == []
    cut = d.seen[5]
    assert isinstance(cut, LoadCut) and (cut.num_computed, cut.others) == (4, (("r1", 12),))
    assert sorted(cut.ended) == (["r0", "r1"] if policy == "fail" else []) and cut.dropped == ("r1",)
    # Negative control: a model that keeps the sample of a cut request disagrees with vLLM.
    if policy == "recompute":
        from invariants.harness import checker as checker_mod

        kept = Drive(FULL)
        real = checker_mod.AllocatorModel.apply

        def keep_sample(self: AllocatorModel, op: Op) -> object:
            if isinstance(op, Loaded) and self.sync_report is not None:
                self.sync_report = self.sync_report._replace(sampled=frozenset())
            return real(self, op)

        kept.checker.model.apply = keep_sample.__get__(kept.checker.model)  # type: ignore[method-assign]
        assert kept.do(*riding_sample_ops(policy)).audited() != []


def test_connector_ops_round_trip_and_bad_input() -> None:
    for op in (
        Offer("r0", 5, "async"),
        Loaded("r1", False),
        Save("r2"),
        Saved("r3"),
        Loaded("r4", True, (2, 3)),
    ):
        assert op_from_json(op_to_json(op)) == op
    assert "invalid" not in op_to_json(Loaded("r1", True))
    with pytest.raises(ValueError, match="'invalid'"):
        op_from_json({"op": "loaded", "rid": "r0", "ok": True, "invalid": [1, "x"]})
    with pytest.raises(ValueError, match="'load'"):
        op_from_json({"op": "offer", "rid": "r0", "num_tokens": 3, "load": "later"})
    with pytest.raises(ValueError, match="'num_tokens'"):
        op_from_json({"op": "offer", "rid": "r0", "num_tokens": 0, "load": "sync"})
    with pytest.raises(ValueError, match="'ok'"):
        op_from_json({"op": "loaded", "rid": "r0", "ok": 1})
    assert config_from_json(config_to_json(FULL)) == FULL
    assert "kv_connector" not in config_to_json(FULL.with_(kv_connector=False))
    with pytest.raises(ConfigError, match="kv_connector"):
        config_from_json({**config_to_json(FULL), "kv_connector": "yes"})


def test_checker_refuses_connector_ops_it_cannot_judge() -> None:
    c = Checker(ModelTarget(FULL.with_(kv_connector=False)))
    c.step(AddRequest("r0", PROMPT))
    with pytest.raises(InvalidOp, match="no KV connector"):
        c.step(Offer("r0", 4, "sync"))
    c = Checker(ModelTarget(FULL))
    c.step(AddRequest("r0", PROMPT))
    with pytest.raises(InvalidOp, match="no connector load"):
        c.step(Loaded("r0", True))
    with pytest.raises(InvalidOp, match="no connector save"):
        c.step(Saved("r0"))
    with pytest.raises(InvalidOp, match="unknown request"):
        c.step(Save("r9"))
    assert c.step(Save("r0")) == [] and c.step(Finish("r0")) == []
    assert c.last_obs == Saving(((),))  # never ran: handed no block, not deferred
    c = Checker(ModelTarget(FULL))
    for op in invalid_ops()[:7]:
        c.step(op)
    for bad in (Loaded("r1", False, (3,)), Loaded("r1", True, (9,))):
        with pytest.raises(InvalidOp, match="'invalid'"):
            c.step(bad)
    c = Checker(ModelTarget(FULL_SWA))
    for op in invalid_ops()[:7]:
        c.step(op)
    with pytest.raises(InvalidOp, match="single-group"):
        c.step(Loaded("r1", True, (3,)))


def test_targets_without_a_connector_refuse_one() -> None:
    from invariants.targets.reference import ReferenceTarget

    with pytest.raises(ConfigError, match="kv_connector"):
        ReferenceTarget(FULL)


# ------------------------------------------------------------------ vLLM's scheduler
def trace_ops() -> list[Op]:
    """Every connector path: sync hit, async load started (r0 decoding beside it), passed
    over while in flight and promoted, failed load, finish during a load."""
    return [
        AddRequest("r0", PROMPT),
        Offer("r0", 9, "sync"),
        Step(("r0",), 64),
        AddRequest("r1", PROMPT + (50, 51)),
        Offer("r1", 14, "async"),
        Sample("r0", 7),
        Step(("r0", "r1"), 64),
        Sample("r0", 8),
        Step(("r0", "r1"), 64),
        Loaded("r1", True),
        Sample("r0", 9),
        Step(("r0", "r1"), 64),
        *failed_and_finished_loads(),
        Finish("r0"),
        Finish("r1"),
        Finish("r2"),
        Probe(PROMPT),
    ]


def failed_and_finished_loads(split: bool = False) -> list[Op]:
    """r2's async load fails and it is re-admitted; r3 finishes while its load is in flight.
    r0 and r1 decode beside them (each sampled before a step, as an engine samples).
    `split`: the scheduler splits r2's prefill at a Mamba block (align): one more step."""
    beside = [Sample("r0", 4), Sample("r1", 4), Step(("r0", "r1", "r2"), 64)] * split
    return [
        AddRequest("r2", tuple(range(30, 45))),
        Offer("r2", 12, "async"),
        Sample("r0", 1),
        Sample("r1", 1),
        Step(("r0", "r1", "r2"), 64),
        Loaded("r2", False),
        Sample("r0", 2),
        Sample("r1", 2),
        Step(("r0", "r1", "r2"), 64),
        *beside,
        AddRequest("r3", tuple(range(60, 75))),
        Offer("r3", 12, "async"),
        Sample("r0", 3),
        Sample("r1", 3),
        Sample("r2", 3),
        Step(("r0", "r1", "r2", "r3"), 64),
        Finish("r3"),
        Loaded("r3", True),
    ]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize(
    "cfg", [FULL_SWA, FULL, FULL_SWA.with_(enable_caching=False, num_blocks=40)], ids=["swa", "full", "off"]
)
def test_real_scheduler_agrees_on_every_connector_path(cfg: Config) -> None:
    assert Drive(cfg).do(*trace_ops()).audited() == []


def fail_policy_ops() -> list[Op]:
    """Under "fail" a failed load ends its request (freed then), a good one is promoted."""
    return [
        AddRequest("r0", PROMPT),
        Offer("r0", 13, "async"),
        AddRequest("r1", PROMPT + (9, 9)),
        Offer("r1", 15, "async"),
        Step(("r0", "r1"), 64),
        Loaded("r0", False),
        Loaded("r1", True),
        Step(("r1",), 64),
        Probe(PROMPT),
        Finish("r1"),
    ]


@needs_vllm
@pytest.mark.vllm
def test_real_scheduler_agrees_under_the_fail_policy() -> None:
    d = Drive(FULL_SWA.with_(kv_load_failure_policy="fail")).do(*fail_policy_ops())
    assert d.found == [] and d.checker.audit() == []
    target = d.checker.target
    assert "r0" not in target.vllm_scheduler.requests and "r0" not in target.session.requests


@needs_vllm
@pytest.mark.vllm
def test_connector_is_registered_and_records_what_it_was_asked() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from invariants.targets.vllm_connector import CONNECTOR_NAME, KvretainConnector
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    target = VllmSchedulerTarget(FULL_SWA)
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is KvretainConnector
    connector = target.vllm_scheduler.connector
    assert isinstance(connector, KvretainConnector)
    for op in trace_ops()[:7]:
        target.apply(op)
    assert [(ld.rid, ld.num_external_tokens) for ld in connector.loads] == [("r0", 9), ("r1", 2)]
    assert {"r0": 4} in connector.saves  # r0's chunk after its 9 external tokens
    target.apply(Finish("r0"))
    assert connector.finished == ["r0"]
    assert VllmSchedulerTarget(FULL_SWA.with_(kv_connector=False)).vllm_scheduler.connector is None


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize(
    "cfg", [FULL_SWA, FULL, FULL_SWA.with_(enable_caching=False, num_blocks=40)], ids=["swa", "full", "off"]
)
def test_real_scheduler_agrees_on_saves(cfg: Config) -> None:
    d = Drive(cfg).do(*save_ops())
    assert d.found == [] and d.checker.audit() == []
    # vLLM's request_finished_all_groups got what the model says it was handed.
    target = d.checker.target
    connector = target.vllm_scheduler.connector
    assert Saving(connector.handed["s0"]) == d.seen[7] and len(connector.handed["s0"][0]) == 3
    assert "s0" not in target.vllm_scheduler.requests and not connector.saving


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("caching", [True, False])
def test_real_scheduler_agrees_on_loads_failed_on_some_blocks(policy: str, caching: bool) -> None:
    cfg = FULL.with_(kv_load_failure_policy=policy, enable_caching=caching)  # type: ignore[arg-type]
    d = Drive(cfg)
    checker = d.checker
    ops = invalid_ops()
    for op in ops:
        if isinstance(op, Loaded):  # the same cuts whatever the ids (caching off: no hit)
            blocks = failable_blocks(checker.model, checker.model.requests[op.rid])
            op = Loaded(op.rid, True, (blocks[2 if op.rid == "r1" else 0],))
        if op is ops[12] and policy == "fail":
            continue  # the promotions' step: both ended
        d.do(op)
    assert d.found == [] and checker.audit() == []
    cuts = [o for o in checker.observer.coverage if "some blocks" in o]
    assert cuts == ["connector: load failed on some blocks"]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_real_scheduler_agrees_on_sync_loads_failed_on_some_blocks(policy: str) -> None:
    cfg = (SYNC_CUT if policy == "recompute" else FULL).with_(kv_load_failure_policy=policy)  # type: ignore[arg-type]
    d = Drive(cfg).do(*sync_invalid_ops(policy))
    assert d.found == [] and d.checker.audit() == []
    assert d.seen[4] == (LoadCut(4, (("r1", 12),)) if policy == "recompute" else LoadCut(4, ended=("r0",)))
    assert "r0" not in d.checker.target.vllm_scheduler.requests


@needs_vllm
@pytest.mark.vllm
def test_real_scheduler_agrees_on_a_failed_block_a_running_request_holds() -> None:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    checker = Checker(VllmSchedulerTarget(SHARED_CUT), audit_every=1)
    seen = []
    for op in shared_invalid_ops():
        assert checker.step(op) == []
        seen.append(checker.last_obs)
    assert checker.audit() == [] and seen[4] == LoadCut(4, (("r0", 4),))


@needs_vllm
@pytest.mark.vllm
def test_a_cut_swa_load_reads_its_skipped_window_finding() -> None:
    """The finding swa-load-cut-reads-skipped-window: vLLM and the model agree on the cut,
    and step_blocks_stay_held flags the resumed request's window on both (on vLLM the
    shadow worker's read of the null block too, the finding's view); its claim is
    narrow (a null block inside the computed range is not it)."""
    from invariants.harness.known_findings import explain, load_known_findings
    from invariants.harness.replay import replay

    finding = next(f for f in load_known_findings() if f.id == "swa-load-cut-reads-skipped-window")
    for target in ("vllm", "model"):
        result = replay(finding.trace, target)
        shadow = ["worker_reads_own_prefix"] if target == "vllm" else []
        assert [v.check for _, v in result.known if explain(target, v) is finding] == [
            *shadow,
            "step_blocks_stay_held",
        ]
    cfg, step = finding.trace.config, finding.trace.ops[-1]
    read = "r1's admission step [4, 8) reads position 1 of group 0 from the null block (index {}), "
    read += "not its own prefix (3 of 7 positions read wrong, each one in a null block)"
    assert finding.claims("worker_reads_own_prefix", read.format(0), cfg, step)
    assert not finding.claims("worker_reads_own_prefix", read.format(1), cfg, step)
    # A running holder the cut reaches: the worker's table still names the block its window
    # freed, since reused (the read names the position, not the index).
    stale = "r0's step [4, 8) reads position {} of group 0 from block 7, which holds another prefix's KV, "
    stale += "not its own prefix (2 of 7 positions read wrong)"
    assert finding.claims("worker_reads_own_prefix", stale.format(1), cfg, step)
    assert not finding.claims("worker_reads_own_prefix", stale.format(5), cfg, step)  # inside the range
    unwritten = stale.format(1).replace(
        "which holds another prefix's KV", "a slot no step wrote since it was zeroed or allocated"
    )
    assert not finding.claims("worker_reads_own_prefix", unwritten, cfg, step)
    message = "r1 computes tokens [4, 8) but group 0 block index {} is the null block after the step"
    assert finding.claims("step_blocks_stay_held", message.format(0), cfg, step)
    assert not finding.claims("step_blocks_stay_held", message.format(1), cfg, step)
    assert not finding.claims("step_blocks_stay_held", message.format(0), cfg.with_(kv_connector=False), step)


@needs_vllm
@pytest.mark.vllm
def test_real_scheduler_saves_a_request_whose_load_reported_unpromoted() -> None:
    """Its load reported but not yet promoted: vLLM defers no free for the load, the
    connector defers it for the save (found by the zoo's control)."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    cfg = Config(groups=(GroupSpec("swa", 4, sliding_window=7),), num_blocks=11, kv_connector=True)
    checker = Checker(VllmSchedulerTarget(cfg), audit_every=1)
    ops: list[Op] = [AddRequest("r4", (2, 1)), Offer("r4", 1, "async"), Step(("r4",), 4), Loaded("r4", True)]
    ops += [Save("r4"), Finish("r4"), Saved("r4")]
    assert [v for op in ops for v in checker.step(op)] == [] and checker.audit() == []
    assert checker.observer.coverage["connector: freed when the save reported"] == 1


@needs_vllm
@pytest.mark.vllm
def test_plain_vllm_target_refuses_a_connector() -> None:
    from invariants.targets.vllm_target import VllmManagerTarget

    with pytest.raises(ConfigError, match="kv_connector"):
        VllmManagerTarget(FULL)


def reserve_trace() -> list[Op]:
    """An async load while a prefill is in flight (on `SHARED_CUT` with 9 blocks: r0's
    first chunk, 8 of 24 tokens in 2 blocks of 8 usable, then r1 in the same step): the
    load's 3 blocks fit the 6 free ones, not the 2 left once the 4 the prefill still
    needs are reserved, so it is not admitted."""
    return [
        AddRequest("r0", tuple(range(100, 124))),
        AddRequest("r1", PROMPT),
        Offer("r1", 13, "async"),
        Step(("r0", "r1"), 64),
    ]


def test_async_load_leaves_in_flight_prefills_their_blocks() -> None:
    m = AllocatorModel(SHARED_CUT.with_(num_blocks=9))
    obs = [m.apply(op) for op in reserve_trace()]
    r = own(obs[-1], "r1")
    assert (r.admitted, r.external, m.requests["r1"].load) == (False, 0, "")
    m2 = AllocatorModel(SHARED_CUT.with_(num_blocks=10))
    obs = [m2.apply(op) for op in reserve_trace()]
    assert own(obs[-1], "r1").external == 12
