"""Isolation on SGLang's radix cache: a hit never crosses adapters or tenants (issue #40).

The model's match rule walks the request's own namespace; the isolation invariant
(`radix_hit_same_identity`) judges, from the driver's slot provenance and not from the
model, that every slot a hit hands a request was written by the same identity. Both have
planted defects here; the SGLang half (driving the real cache with `lora_id` and
`cache_salt`, and the zoo's namespace mutant) is skipped when SGLang cannot be imported.
"""

from __future__ import annotations

import pytest

from invariants.catalogue import radix as inv
from invariants.targets.sglang_env import sglang_available
from model.radix.config import LAYOUTS, RadixLayout
from model.radix.match import expected_hit
from model.radix.ops import Admit, Finish, from_json, to_json
from model.radix.tree import DEFAULT_NAMESPACE, NodeView, TreeView

FULL1 = RadixLayout(("full",), 1)
TENANT_A = (None, "tenant-a")
ADAPTER = ("adapter-x", None)


def _two_namespaces() -> TreeView:
    """The same six tokens cached twice under the root: once for tenant A, once for the adapter."""
    return TreeView(
        root=0,
        nodes={
            0: NodeView(0, None, (), True),
            1: NodeView(1, 0, (1, 2, 3, 4, 5, 6), True, namespace=TENANT_A),
            2: NodeView(2, 0, (1, 2, 3), True, namespace=ADAPTER),
        },
    )


def test_match_never_crosses_namespaces() -> None:
    view = _two_namespaces()
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), FULL1, 6, TENANT_A) == 6
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), FULL1, 6, ADAPTER) == 3
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), FULL1, 6) == 0  # no identity: nothing of theirs
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), FULL1, 6, (None, "tenant-b")) == 0


def test_model_hit_check_is_per_namespace() -> None:
    view = _two_namespaces()
    assert inv.radix_hit_matches_model(view, (1, 2, 3, 4), FULL1, 3, 3, TENANT_A) == []
    # control: a hit that crossed into tenant A's path for an anonymous request
    assert inv.radix_hit_matches_model(view, (1, 2, 3, 4), FULL1, 3, 3, DEFAULT_NAMESPACE)


def test_hit_same_identity_holds_and_its_control_fails() -> None:
    writers = {10: TENANT_A, 11: TENANT_A, 12: DEFAULT_NAMESPACE}
    assert inv.radix_hit_same_identity([10, 11], writers, TENANT_A) == []
    msgs = inv.radix_hit_same_identity([10, 11, 12], writers, TENANT_A)  # control: slot 12 is anonymous
    assert len(msgs) == 1 and "slot 12" in msgs[0]
    assert inv.radix_hit_same_identity([10], writers, (None, "tenant-b"))  # another tenant
    assert inv.radix_hit_same_identity([99], writers, DEFAULT_NAMESPACE)  # a slot nobody wrote


def test_identity_round_trips_and_older_traces_load() -> None:
    op = Admit(3, (1, 2), 2, lora="adapter-x", salt="tenant-a")
    assert from_json(to_json(op)) == op
    assert "lora" not in to_json(Admit(3, (1, 2), 2))  # no identity: the older format
    assert from_json({"op": "Admit", "rid": 1, "tokens": [1], "chunk": 1}).namespace == DEFAULT_NAMESPACE


def test_generated_histories_carry_identities_on_the_same_tokens() -> None:
    from invariants.harness.radix_fuzz import generate_ops

    ops = generate_ops(0, LAYOUTS["full-p1"], 200)
    plain = generate_ops(0, LAYOUTS["full-p1"], 200, identities=0.0)
    admits = [op for op in ops if isinstance(op, Admit)]
    assert {op.namespace for op in admits} - {DEFAULT_NAMESPACE}
    assert all(op.namespace == DEFAULT_NAMESPACE for op in plain if isinstance(op, Admit))
    # the identity stream is separate: the token histories are those of the seed without it
    strip = [Admit(op.rid, op.tokens, op.chunk) if isinstance(op, Admit) else op for op in ops]
    assert strip == plain


_OK, _REASON = sglang_available()
needs_sglang = pytest.mark.skipif(not _OK, reason=f"sglang: {_REASON}")


@needs_sglang
@pytest.mark.parametrize("core", ["python", "rust"])
def test_sglang_hits_only_within_an_identity(core: str) -> None:
    from invariants.targets.sglang_drive import SglangDriver

    driver = SglangDriver(LAYOUTS["full-p1"], core)
    tokens = tuple(range(1, 10))
    identities = [DEFAULT_NAMESPACE, TENANT_A, (None, "tenant-b"), ADAPTER, ("adapter-x", "tenant-a")]
    for rid, (lora, salt) in enumerate(identities):
        assert driver.apply(Admit(rid, tokens, len(tokens), lora=lora, salt=salt)).hit == 0
        driver.apply(Finish(rid))
    for rid, (lora, salt) in enumerate(identities, start=10):
        res = driver.apply(Admit(rid, tokens, len(tokens), lora=lora, salt=salt))
        assert res.hit == 8, (lora, salt)  # its own identity's copy
        assert {driver.slot_writer[s] for s in res.prefix_slots} == {(lora, salt)}
        driver.apply(Finish(rid))


@needs_sglang
def test_sglang_tree_view_names_each_nodes_namespace() -> None:
    from invariants.targets.sglang_drive import SglangDriver
    from invariants.targets.sglang_snapshot import rust_tree_view, tree_view

    for core, read in (("python", tree_view), ("rust", rust_tree_view)):
        driver = SglangDriver(LAYOUTS["full-p1"], core)
        for rid, (lora, salt) in enumerate([TENANT_A, ADAPTER]):
            driver.apply(Admit(rid, (1, 2, 3, 4), 4, lora=lora, salt=salt))
            driver.apply(Finish(rid))
        view = read(driver)
        assert view is not None
        kids = view.children[view.root]
        assert sorted((view.nodes[k].namespace for k in kids), key=str) == sorted(
            [TENANT_A, ADAPTER], key=str
        )


@needs_sglang
def test_identity_histories_run_clean_and_are_counted() -> None:
    from invariants.harness.radix_check import RadixChecker
    from invariants.harness.radix_fuzz import generate_ops, run_history

    hits = admits = 0
    for seed in range(6):  # identity hits need a same-identity predecessor: a few per history
        checker = RadixChecker(LAYOUTS["full-p1"])
        violation, _ = run_history(checker, generate_ops(seed, LAYOUTS["full-p1"], 60))
        assert violation is None, (seed, violation)
        admits += checker.coverage["identity_admits"]
        hits += checker.coverage["identity_hits"]
    assert admits > 0 and hits > 0


@needs_sglang
def test_namespace_dropped_on_one_insert_path_is_reported() -> None:
    """The planted defect (the zoo's `namespace_dropped_on_chunk_insert`), on the same
    seed that runs clean unmutated above, is reported by the isolation invariant."""
    from invariants.zoo.mutants_sglang import hunt

    row = hunt("namespace_dropped_on_chunk_insert", budget_s=10.0)
    assert row.killed_by == "radix_hit_same_identity", row
