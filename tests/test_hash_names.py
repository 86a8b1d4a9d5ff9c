"""The adapters' hash tables: exact both ways, and pruned to what the allocator holds.

`HashNames` alone (pure), then inside the vLLM adapter: a prefix the table
does not hold goes back to vLLM's own hash through vLLM's hasher, and after a
request finishes and its blocks are reused, pruning forgets its hashes while
the differential against the model still agrees.
"""

from __future__ import annotations

import pytest

from invariants.targets.hash_names import HashNames
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Schedule
from model.contract.prefix import prefix


def test_learn_name_and_prune():
    toks = tuple(range(1, 13))
    names = HashNames(slack=0)
    names.learn(toks, [b"h1" * 4, b"h2" * 4, b"h3" * 4], 0, 4)
    assert names.name(b"h2" * 4) is prefix(toks, 8)
    assert names.hash_of(prefix(toks, 8)) == b"h2" * 4
    assert names.name_int(int.from_bytes((b"h3" * 4)[-8:], "big")) is prefix(toks, 12)
    assert names.name(b"nope") is None and names.hash_of(prefix(toks, 4)) is None  # never named, no rehash
    assert names.should_prune()
    names.prune([b"h3" * 4])
    assert len(names) == 1 and names.name(b"h2" * 4) is None and names.hash_of(prefix(toks, 8)) is None
    assert names.name(b"h3" * 4) is prefix(toks, 12)


_OK, _REASON = vllm_available()
vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


@vllm
def test_vllm_adapter_rehashes_exactly_and_prunes_removed_hashes():
    from invariants.harness.checker import Checker
    from invariants.harness.known_findings import is_known_violation
    from invariants.targets.vllm_target import VllmManagerTarget

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=6)
    target = VllmManagerTarget(cfg)
    target.names.table = HashNames(target.names.rehash, slack=-1 << 30)  # prune at every read
    checker = Checker(target, audit_every=1)
    a, b = tuple(range(1, 18)), tuple(range(100, 117))
    ops = [AddRequest("a", a), Schedule("a", 32), Finish("a"), AddRequest("b", b), Schedule("b", 32)]
    for op in ops:
        assert not [v for v in checker.step(op) if not is_known_violation("vllm-manager", v)], op
    # a's blocks were reused by b: vLLM removed a's hashes, and so did the table.
    vllm_a = VllmManagerTarget(cfg)
    vllm_a.apply(AddRequest("a", a))
    a_hashes = [bytes(h) for h in vllm_a.requests["a"].block_hashes]
    assert a_hashes and not any(h in target.names.table for h in a_hashes)
    assert all(bytes(h) in target.names.table for h in target.requests["b"].block_hashes)
    # Control: with the default slack nothing is pruned yet on so short a run, and the check sees it.
    lazy = VllmManagerTarget(cfg)
    for op in ops:
        lazy.apply(op)
        lazy.snapshot()
    assert any(h in lazy.names.table for h in a_hashes)
    # A prefix the table no longer holds goes back to vLLM's hash of it, exactly.
    assert target.names.table.hash_of(prefix(a, 8)) == a_hashes[1]
    assert target.names.rehash(prefix(a, 6)) is None  # not a whole number of hash blocks


@vllm
def test_sampled_blocks_are_named_without_keeping_a_copy_of_the_request():
    from invariants.targets.vllm_target import VllmManagerTarget
    from model.contract.ops import Sample

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=40)
    target = VllmManagerTarget(cfg)
    prompt = tuple(range(1, 19))
    target.apply(AddRequest("a", prompt))
    target.apply(Schedule("a", 64))
    for t in range(50, 60):
        target.apply(Sample("a", t))
        target.apply(Schedule("a", 64))
    req = target.requests["a"]
    tokens = prompt + tuple(range(50, 60))
    for i, h in enumerate(req.block_hashes):
        assert target.names.table.name(bytes(h)) is prefix(tokens, 4 * (i + 1))
    # Every hash is named from the prompt or by extension: no tuple other than the prompt is held.
    held = {id(src[0]) for src in target.names.table._source.values() if isinstance(src, tuple)}
    assert held == {id(prompt)}
