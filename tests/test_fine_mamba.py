"""model.contract.fine_mamba: when fine-grained Mamba hits are on, the hit rules, and the
copies the model predicts (the vLLM agreement is in test_vllm_target)."""

from __future__ import annotations

import pytest

from invariants.targets.reference import ReferenceTarget
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.fine_mamba import eagle_margin, fine_full_hit, fine_hits_enabled, fine_mamba_hit
from model.contract.observation import block_key
from model.contract.ops import AddRequest, Finish, Probe, Schedule
from model.machine.allocator import AllocatorModel

FULL16_MAMBA64 = (GroupSpec("full", 16), GroupSpec("mamba", 64))
PROMPT150 = tuple(range(1000, 1150))


def fine_cfg(groups=FULL16_MAMBA64, **kw) -> Config:
    return Config(groups, num_blocks=kw.pop("num_blocks", 40), hash_block_size=16, **kw)


def test_fine_hits_enabled_follows_partial_hash_hits_enabled():
    assert fine_hits_enabled(fine_cfg(retention_interval=0))
    # Mamba no wider than the hash block: nothing to probe inside a block.
    assert not fine_hits_enabled(Config((GroupSpec("full", 16), GroupSpec("mamba", 16)), num_blocks=8))
    # An SWA group wider than the hash block cannot look up inside its blocks.
    swa32 = (*FULL16_MAMBA64, GroupSpec("swa", 32, sliding_window=40))
    assert not fine_hits_enabled(fine_cfg(swa32))
    swa16 = (*FULL16_MAMBA64, GroupSpec("swa", 16, sliding_window=40))
    assert fine_hits_enabled(fine_cfg(swa16))
    assert not fine_hits_enabled(fine_cfg(enable_caching=False))


def test_eagle_margin_is_one_hash_block_for_fine_lookups():
    cfg = fine_cfg(groups=(GroupSpec("full", 32), GroupSpec("mamba", 64)))
    assert eagle_margin(cfg, "full", 32) == 16
    off = Config((GroupSpec("full", 32), GroupSpec("mamba", 32)), num_blocks=8)  # hash block 32: no fine hits
    assert eagle_margin(off, "full", 32) == 32


def test_fine_full_hit_extends_into_the_next_block():
    keyed = {32, 64, 80}.__contains__  # two whole blocks, then boundary 80 inside block 2
    assert fine_full_hit(keyed, 127, 32, 16, 128, False) == ([32, 64, 80], 80)
    # Eagle gives back one hash block, and with it the tail block (nothing of it is read).
    assert fine_full_hit(keyed, 127, 32, 16, 128, True) == ([32, 64], 64)
    # Never past max_length, never past a missing whole block.
    assert fine_full_hit(keyed, 79, 32, 16, 128, False) == ([32, 64], 64)
    assert fine_full_hit({64, 80}.__contains__, 127, 32, 16, 128, False) == ([], 0)


def test_fine_mamba_hit_is_the_longest_keyed_boundary():
    keyed = {64, 144}.__contains__
    assert fine_mamba_hit(keyed, 149, 64, 16, 150) == ([None, None, 144], 144)
    assert fine_mamba_hit(keyed, 143, 64, 16, 150) == ([64], 64)
    assert fine_mamba_hit(keyed, 63, 64, 16, 150) == ([], 0)


@pytest.mark.parametrize("retention", [0, None])
def test_worked_example_150_token_resend(retention):
    """Full16 + Mamba64 (hash block 16), a 150-token prompt in 64-token chunks:
    chunks end at 64, 128, 144, 150; the state at 144 is keyed inside the third
    Mamba block and moved to a copy; the resend hits 144 and copies it again."""
    m = AllocatorModel(fine_cfg(retention_interval=retention))
    m.apply(AddRequest("a", PROMPT150))
    chunks = [m.apply(Schedule("a", 64)) for _ in range(4)]
    assert [c.scheduled for c in chunks] == [64, 64, 16, 6]
    ((src, moved_to),) = chunks[-1].copies
    assert m.pool.lookup(block_key(1, PROMPT150, 144)) == moved_to
    assert m.pool.lookup(block_key(1, PROMPT150, 128)) is not None
    assert src in m.groups[1].tables["a"] and m.pool.ref[src] == 1 and m.pool.ref[moved_to] == 0
    m.apply(Finish("a"))
    assert m.apply(Probe(PROMPT150)).hit == 144
    m.apply(AddRequest("b", PROMPT150))
    resend = m.apply(Schedule("b", 64))
    assert (resend.hit, resend.scheduled) == (144, 6)
    ((copied, private),) = resend.copies
    assert copied == moved_to and resend.new_blocks[1][0] == private
    # After the step the copy's retention is released: b holds its private copy once.
    assert m.groups[1].tables["b"][2] == private and m.pool.ref[private] == 1
    assert m.pool.ref[copied] == 0


def test_reference_target_refuses_fine_grained_configs():
    with pytest.raises(ConfigError, match="fine-grained"):
        ReferenceTarget(fine_cfg(retention_interval=0))


def resend(chk) -> list:
    """a computes the 150-token prompt in 64-token chunks and finishes; b resends it."""
    out = []
    for rid in ("a", "b"):
        out += chk.step(AddRequest(rid, PROMPT150))
        while chk.model.requests[rid].num_computed < len(PROMPT150):
            out += chk.step(Schedule(rid, 64))
        if rid == "a":
            out += chk.step(Finish("a"))
    return out


@pytest.mark.parametrize(
    "mutant", ["cow_copy_reversed", "mamba_fine_hit_floored_to_block", "producer_keys_not_moved"]
)
def test_fine_mamba_mutants_need_fine_configs(mutant):
    """Each zoo mutant of this feature is caught on the 150-token resend with a
    64-token Mamba block, and invisible on the same trace with a 16-token one
    (no hit or key ends inside a Mamba block, so the patched path never runs)."""
    from invariants.harness.checker import Checker
    from invariants.targets.vllm_env import vllm_available

    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    from invariants.zoo.mutants_vllm import activate
    from invariants.zoo.runner import known_tolerance

    known = known_tolerance("vllm-manager") or (lambda v: False)
    coarse = Config((GroupSpec("full", 16), GroupSpec("mamba", 16)), num_blocks=40, retention_interval=0)
    with activate(mutant) as factory:
        found = {mode: [] for mode in ("fine", "coarse")}
        for mode, cfg in (("fine", fine_cfg(retention_interval=0)), ("coarse", coarse)):
            found[mode] = [v.check for v in resend(Checker(factory(cfg), audit_every=1)) if not known(v)]
    assert {"observation", "snapshot"} & set(found["fine"]), found
    assert found["coarse"] == []


@pytest.mark.parametrize("target", ["model", "vllm-manager"])
def test_same_step_copy_finding_replays(target):
    """The known finding: a copy whose source the same step allocated (its KV is
    written by the forward pass that runs after the copy). Both targets show it,
    and only it."""
    from invariants.harness.checker import Checker
    from invariants.harness.known_findings import is_known_violation, load_known_findings
    from invariants.targets import target_factory
    from invariants.targets.vllm_env import vllm_available

    if target == "vllm-manager" and not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    [finding] = [f for f in load_known_findings() if f.id == "vllm-cow-copy-of-same-step-block"]
    chk = Checker(target_factory(target)(finding.trace.config), audit_every=1)
    found = [v for op in finding.trace.ops for v in chk.step(op)]
    assert [v.check for v in found if v.check != "stored_tokens_match_hashes"] == ["copies_sound"]
    assert all(is_known_violation(target, v) for v in found)
    assert chk.last_obs.copies[0] == (1, 5)


def test_conformance_row_agrees_and_sees_a_mutant(monkeypatch, capsys, tmp_path):
    """The fine-grained row agrees on vLLM 0.33.0 (reaching fine hits and both
    kinds of copy), and reports a finding once move_block_hashes is broken."""
    from invariants.targets.vllm_env import vllm_available

    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    import invariants.harness.conformance as conformance
    from invariants.zoo.mutants_vllm import activate

    row = conformance.FINE_MAMBA_ROW
    monkeypatch.setattr(conformance, "FEATURES", {row: conformance.FEATURES[row]})
    monkeypatch.setattr(conformance, "SCHEDULER_FEATURES", {})  # the vllm rows have their own tests
    monkeypatch.setattr(conformance, "ASYNC_SCHEDULER_FEATURES", {})  # and the vllm-async-scheduler rows
    monkeypatch.setattr(conformance, "check_validation", lambda: (0, []))
    rows: list = []
    assert conformance.run_conformance(steps=300, budget_s=20.0, out=tmp_path, sink=rows) == 0
    assert rows[-1].feature == row and rows[-1].ok and rows[-1].verdict.startswith("agrees")
    assert "fine-grained Mamba hits" not in capsys.readouterr().out.split("excluded from generation")[1]
    rows.clear()
    with activate("producer_keys_not_moved"):
        assert conformance.run_conformance(steps=300, budget_s=20.0, out=tmp_path, sink=rows) == 1
    assert rows[-1].verdict.startswith("FINDING")
