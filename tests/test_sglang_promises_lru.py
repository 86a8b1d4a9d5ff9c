"""SGLang to the same standard (#38 item 8): the finished-prefix promise on every layout and
eviction judged on each tree core on its own, against the model.

Without SGLang: the model's recency (`model/radix/recency.py`), the eviction-scope and
finished-prefix invariants on hand-built trees, each with a planted defect it must report
next to a case where it holds. With SGLang (skipped, with the reason, without it): the
model's recency orders nodes exactly as the Python core's access times do on every
layout; the Rust core's own tree view equals the Python core's; the unmutated cache runs
clean with the new judges on each core alone (control); a finish that loses its SWA hit, or
its Mamba hit, on a valid tree, and a full-attention eviction that walks the SWA scope on the Rust core only,
are each reported by the new invariants, the latter on the Rust core alone (and the
Python core alone does not see it: it is the Rust core's defect).
"""

from __future__ import annotations

import pytest

from invariants.catalogue import radix as inv
from invariants.targets.sglang_env import sglang_available
from model.radix.config import LAYOUTS, RadixLayout
from model.radix.recency import advance, as_time
from model.radix.tree import NodeView, TreeView

FULL1 = RadixLayout(("full",), 1)
SWA = RadixLayout(("full", "swa"), 1, sliding_window=4)
MAMBA = RadixLayout(("full", "mamba"), 1)

_OK, _REASON = sglang_available()
needs_sglang = pytest.mark.skipif(not _OK, reason=f"sglang: {_REASON}")


def tree(*nodes: tuple[int, int | None, tuple[int, ...], dict[str, object]]) -> TreeView:
    """Nodes (id, parent, tokens, fields); node 0 is the root."""
    out = {0: NodeView(0, None, (), True)}
    for nid, parent, tokens, extra in nodes:
        out[nid] = NodeView(nid, parent, tokens, True, **extra)  # type: ignore[arg-type]
    return TreeView(root=0, nodes=out)


# -- the model's recency ------------------------------------------------------------------


def test_recency_match_stamps_its_path_deeper_newer_and_leaves_the_rest() -> None:
    view = tree((1, 0, (1,), {}), (2, 1, (2,), {}), (3, 0, (9,), {}))
    old = {1: (1, 0), 2: (1, 1), 3: (2, 0)}
    rec = advance(old, {0, 1, 2, 3}, view, [("match", (1, 2), (1, 2))], 3, has_mamba=False)
    assert rec[1] < rec[2] and rec[3] == (2, 0) and rec[3] < rec[1]
    # a lookup that validated nothing (ends at the root) refreshes nothing
    assert advance(old, {0, 1, 2, 3}, view, [("match", (), (1, 2))], 3, has_mamba=False) == old


def test_recency_split_stamps_head_then_tail_and_a_new_leaf_last() -> None:
    # before: 0 -> 2 (tokens 1,2,3); an insert of (1,2,7) splits it: head 4 (1,2), tail 2 (3), leaf 5 (7)
    after = tree((4, 0, (1, 2), {}), (2, 4, (3,), {}), (5, 4, (7,), {}))
    rec = advance({2: (1, 0)}, {0, 2}, after, [("insert", (4, 5), (4, 5))], 2, has_mamba=False)
    assert rec[4] < rec[2] < rec[5]
    # with Mamba, committing the state at the split head stamps it last
    after_end_at_head = tree((4, 0, (1, 2), {}), (2, 4, (3,), {}))
    rec = advance({2: (1, 0)}, {0, 2}, after_end_at_head, [("insert", (4,), (4,))], 2, has_mamba=True)
    assert rec[2] < rec[4]
    rec = advance({2: (1, 0)}, {0, 2}, after_end_at_head, [("insert", (4,), (4,))], 2, has_mamba=False)
    assert rec[4] < rec[2]  # control: without Mamba the tail's refresh comes last


def test_recency_orders_lru_eviction() -> None:
    """The model's recency decides `evict_full`: the least recently used leaf goes first."""
    from model.radix.evict import evict_full

    view = tree((1, 0, (1,), {}), (2, 0, (2,), {}))
    rec = advance({1: (1, 0), 2: (2, 0)}, {0, 1, 2}, view, [("match", (1,), (1,))], 3, has_mamba=False)
    timed = TreeView(
        0,
        {
            n: NodeView(n, v.parent, v.tokens, True, last_access=as_time(rec[n]) if n else 0.0)
            for n, v in view.nodes.items()
        },
    )
    assert evict_full(timed, 1)[0] == [2]  # node 1 was just used


# -- eviction scope ------------------------------------------------------------------------


def test_eviction_scope_full_removes_whole_unlocked_leaves_and_changes_no_survivor() -> None:
    before = tree(
        (1, 0, (1, 2), {"swa": True}),
        (2, 1, (3,), {"swa": True}),
        (3, 0, (9,), {"swa": True, "full_lock": 1}),
    )
    after_ok = tree((1, 0, (1, 2), {"swa": True}), (3, 0, (9,), {"swa": True, "full_lock": 1}))
    assert inv.radix_eviction_scope(before, after_ok, (1, 0, 0)) == []
    tombstoned = tree(
        (1, 0, (1, 2), {"swa": False}),
        (2, 1, (3,), {"swa": True}),
        (3, 0, (9,), {"swa": True, "full_lock": 1}),
    )
    assert "took ['swa'] from node 1" in inv.radix_eviction_scope(before, tombstoned, (1, 0, 0))[0]
    locked_gone = tree((1, 0, (1, 2), {"swa": True}), (2, 1, (3,), {"swa": True}))
    assert "which locked" in inv.radix_eviction_scope(before, locked_gone, (1, 0, 0))[0]


def test_eviction_scope_swa_touches_only_live_swa() -> None:
    before = tree((1, 0, (1, 2), {"swa": True, "mamba": True}), (2, 1, (3,), {"swa": False, "mamba": False}))
    tombstone = tree(
        (1, 0, (1, 2), {"swa": False, "mamba": False}), (2, 1, (3,), {"swa": False, "mamba": False})
    )
    assert inv.radix_eviction_scope(before, tombstone, (0, 2, 0)) == []  # Mamba goes with the SWA
    removed_dead = tree((1, 0, (1, 2), {"swa": True, "mamba": True}))
    assert "held no swa value" in inv.radix_eviction_scope(before, removed_dead, (0, 1, 0))[0]
    mamba_only = tree(
        (1, 0, (1, 2), {"swa": True, "mamba": False}), (2, 1, (3,), {"swa": False, "mamba": False})
    )
    assert "took ['mamba']" in inv.radix_eviction_scope(before, mamba_only, (0, 2, 0))[0]
    assert inv.radix_eviction_scope(before, mamba_only, (0, 0, 1)) == []  # a Mamba eviction may


# -- the finished-prefix promise -------------------------------------------------------------


def test_promise_full_every_cached_page() -> None:
    seq = (1, 2, 3, 4, 5)
    assert inv.radix_finished_prefix_promise(tree((1, 0, seq, {})), seq, 5, 0, 0, FULL1) == []
    short = tree((1, 0, (1, 2, 3), {}))
    msgs = inv.radix_finished_prefix_promise(short, seq, 5, 0, 0, FULL1)
    assert msgs and "hits 3 < promised 5" in msgs[0] and "no full-attention page at token 3" in msgs[0]


def test_promise_swa_window_tail_live() -> None:
    seq = tuple(range(1, 11))
    live = tree((1, 0, seq[:4], {"swa": False}), (2, 1, seq[4:], {"swa": True}))
    # the request freed its SWA below 4; its live span [4, 10) covers the window (4)
    assert inv.radix_finished_prefix_promise(live, seq, 10, 0, 4, SWA) == []
    lost = tree(
        (1, 0, seq[:4], {"swa": False}), (2, 1, seq[4:8], {"swa": True}), (3, 2, seq[8:], {"swa": False})
    )
    msgs = inv.radix_finished_prefix_promise(lost, seq, 10, 0, 4, SWA)
    assert msgs and "SWA tombstone on tokens [8, 10)" in msgs[0]
    # no promise when the request's own live span is shorter than the window
    assert inv.finished_prefix_promised(10, 7, 0, SWA) is None
    assert inv.radix_finished_prefix_promise(lost, seq, 10, 7, 0, SWA) == []


def test_promise_mamba_state_at_the_cached_prefix() -> None:
    seq = (1, 2, 3, 4)
    ok = tree((1, 0, (1, 2), {"mamba": True}), (2, 1, (3, 4), {"mamba": True}))
    assert inv.radix_finished_prefix_promise(ok, seq, 4, 0, 0, MAMBA) == []
    dropped = tree((1, 0, (1, 2), {"mamba": True}), (2, 1, (3, 4), {"mamba": False}))
    msgs = inv.radix_finished_prefix_promise(dropped, seq, 4, 0, 0, MAMBA)
    assert msgs and "hits 2 < promised 4" in msgs[0] and "no Mamba state at token 4" in msgs[0]


# -- on SGLang's real cache ------------------------------------------------------------------


@needs_sglang
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_model_recency_orders_nodes_as_the_python_core_does(layout: str) -> None:
    """The definition in `model/radix/recency.py` against SGLang's own access times: every pair
    of nodes is ordered the same way after every op (the Rust core exposes no times; it is
    judged with this recency)."""
    from invariants.harness.radix_fuzz import generate_ops
    from invariants.targets.sglang_drive import SglangDriver
    from invariants.targets.sglang_snapshot import tree_view

    lay = LAYOUTS[layout]
    compared = 0
    for seed in (0, 1):
        d = SglangDriver(lay, "python")
        view = tree_view(d)
        assert view is not None
        rec: dict[int, tuple[int, int]] = {}
        for clock, op in enumerate(generate_ops(seed, lay, 40), start=1):
            d.apply(op)
            after = tree_view(d)
            assert after is not None
            calls = [(c.kind, c.path, c.walked) for c in d.tree_calls]
            rec = advance(rec, set(view.nodes), after, calls, clock, lay.has_mamba)
            view = after
            nodes = sorted(n for n in after.nodes if n != after.root)
            by_model = sorted(nodes, key=lambda n: rec[n])
            by_sglang = sorted(nodes, key=lambda n: after.nodes[n].last_access)
            assert by_model == by_sglang, (layout, seed, clock, op)
            compared += len(nodes)
    assert compared > 0


@needs_sglang
@pytest.mark.parametrize("layout", ["swa-p4", "swa-mamba-p1"])
def test_rust_core_view_is_its_own_and_matches_the_python_core(layout: str) -> None:
    from invariants.harness.radix_fuzz import generate_ops
    from invariants.targets.sglang_drive import SglangDriver
    from invariants.targets.sglang_snapshot import rust_tree_view, tree_view

    def canon(v: TreeView) -> list[tuple[object, ...]]:
        return sorted(
            (v.prefix(n), x.full, x.swa, x.mamba, x.full_lock) for n, x in v.nodes.items() if n != v.root
        )

    lay = LAYOUTS[layout]
    py, rust = SglangDriver(lay, "python"), SglangDriver(lay, "rust")
    seen = 0
    for op in generate_ops(2, lay, 50):
        py.apply(op)
        rust.apply(op)
        vp, vr = tree_view(py), rust_tree_view(rust)
        assert vp is not None and canon(vp) == canon(vr), op
        seen += len(vr.nodes) - 1
    assert seen > 0


def _history(
    layout: str, cores: tuple[str, ...], seeds: range
) -> tuple[tuple[int, tuple[str, str]] | None, dict[str, int]]:
    """Run the seeded histories; (the first (seed, violation), coverage summed over the histories run).
    Without identities: these pin recency and promises on the histories they were written
    for (isolation has its own tests, tests/test_sglang_isolation.py)."""
    from invariants.harness.radix_check import RadixChecker
    from invariants.harness.radix_fuzz import generate_ops, run_history

    coverage: dict[str, int] = {}
    for seed in seeds:
        checker = RadixChecker(LAYOUTS[layout], cores)
        found, _ = run_history(checker, generate_ops(seed, LAYOUTS[layout], 60, identities=0.0))
        for k, v in checker.coverage.items():
            coverage[k] = coverage.get(k, 0) + v
        if found is not None:
            return (seed, found), coverage
    return None, coverage


@needs_sglang
@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("layout", ["swa-p1", "mamba-p1", "full-p4"])
def test_control_unmutated_cache_is_clean_on_each_core_alone(layout: str, core: str) -> None:
    found, coverage = _history(layout, (core,), range(6))
    assert found is None, found
    assert coverage.get("evict_judged", 0) > 0 and coverage.get("promise_checked", 0) > 0, coverage


@needs_sglang
def test_swa_hit_lost_at_finish_is_reported() -> None:
    from invariants.zoo.mutants_sglang import activate

    with activate("swa_finish_frees_window"):
        found, _ = _history("swa-p1", ("python", "rust"), range(6))
    assert found is not None
    _, (name, message) = found
    assert name == "radix_finished_prefix_promise", message
    assert "SWA tombstone" in message


@needs_sglang
def test_mamba_hit_lost_at_finish_is_reported() -> None:
    from invariants.zoo.mutants_sglang import activate

    with activate("mamba_finish_drops_own_state"):
        found, _ = _history("mamba-p1", ("python",), range(6))
    assert found is not None
    _, (name, message) = found
    assert name == "radix_finished_prefix_promise", message
    assert "no Mamba state" in message


@needs_sglang
def test_wrong_lru_scope_on_the_rust_core_only_is_reported_on_that_core_alone() -> None:
    from invariants.zoo.mutants_sglang import activate

    with activate("rust_full_eviction_in_swa_scope"):
        found, _ = _history("swa-p1", ("rust",), range(6))
        control, coverage = _history("swa-p1", ("python",), range(6))
    assert found is not None
    _, (name, message) = found
    assert name in ("radix_eviction_scope", "radix_full_eviction_matches_model"), message
    assert message.startswith("[rust]")
    # the Python core, judged alone under the same patch, is clean: the defect is the Rust core's
    assert control is None, control
    assert coverage.get("evict_judged", 0) > 0
