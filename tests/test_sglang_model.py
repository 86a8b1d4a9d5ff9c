"""The radix model (`model/radix/`) and the radix invariants, on hand-built trees.

No SGLang needed: these pin the match rule (full pages, SWA window since the
last tombstone, Mamba state at the node, partial nodes) and give every radix
invariant of `invariants/catalogue/radix.py` a planted defect it must report
next to a case where it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from invariants.catalogue import radix as inv
from model.radix.config import LAYOUTS, RadixLayout
from model.radix.evict import evict_full
from model.radix.match import expected_hit
from model.radix.ops import Admit, Decode, Evict, from_json, to_json
from model.radix.tree import NodeView, TreeView

FULL1 = RadixLayout(("full",), 1)
FULL2 = RadixLayout(("full",), 2)
SWA = RadixLayout(("full", "swa"), 1, sliding_window=4)
MAMBA = RadixLayout(("full", "mamba"), 1)


def chain(*edges: tuple[tuple[int, ...], dict[str, object]]) -> TreeView:
    """A root and one path of nodes 1, 2, ... with the given keys and fields."""
    nodes = {0: NodeView(0, None, (), True)}
    for i, (tokens, extra) in enumerate(edges, start=1):
        nodes[i] = NodeView(i, i - 1, tokens, True, **extra)  # type: ignore[arg-type]
    return TreeView(root=0, nodes=nodes)


def test_full_hit_is_whole_pages_within_the_limit() -> None:
    view = chain(((1, 2, 3, 4, 5, 6), {}))
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), FULL1, 6) == 6
    assert expected_hit(view, (1, 2, 3, 4, 5, 6), FULL1, 5) == 5  # input length - 1
    assert expected_hit(view, (1, 2, 3, 4, 5, 6), FULL2, 5) == 4  # floored to pages
    assert expected_hit(view, (1, 2, 9), FULL1, 2) == 2  # partial node: SGLang splits there
    assert expected_hit(view, (9, 2), FULL1, 1) == 0


def test_swa_hit_needs_a_window_since_the_last_tombstone() -> None:
    tomb = chain(((1, 2), {"swa": True}), ((3, 4), {"swa": False}), ((5, 6, 7), {"swa": True}))
    # after the tombstone only 3 live SWA tokens: the window (4) is not reached
    assert expected_hit(tomb, (1, 2, 3, 4, 5, 6, 7, 8), SWA, 7) == 2
    live = chain(((1, 2), {"swa": True}), ((3, 4), {"swa": False}), ((5, 6, 7, 8), {"swa": True}))
    assert expected_hit(live, (1, 2, 3, 4, 5, 6, 7, 8, 9), SWA, 8) == 8
    # no tombstone on the path: any node end is a valid end
    assert expected_hit(chain(((1,), {"swa": True})), (1, 2), SWA, 1) == 1


def test_mamba_hit_needs_a_state_at_the_node_end() -> None:
    view = chain(((1, 2), {"mamba": True}), ((3, 4, 5), {"mamba": False}), ((6,), {"mamba": True}))
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), MAMBA, 6) == 6
    assert expected_hit(view, (1, 2, 3, 4, 5), MAMBA, 5) == 2
    assert expected_hit(view, (1, 2, 3, 4, 5, 6, 7), MAMBA, 5) == 2  # a partial node has no state


def test_ops_round_trip_and_bad_input_names_the_field() -> None:
    for op in (Admit(1, (1, 2), 2), Decode(3, (4,)), Evict(1, 2, 0)):
        assert from_json(to_json(op)) == op
    with pytest.raises(ValueError, match="op: unknown"):
        from_json({"op": "Nope"})
    with pytest.raises(ValueError, match="Admit"):
        from_json({"op": "Admit", "rid": 1})


def test_layouts_validate_and_bad_layouts_name_the_field() -> None:
    for layout in LAYOUTS.values():
        layout.validate()
    with pytest.raises(ValueError, match="sliding_window"):
        RadixLayout(("full", "swa")).validate()
    with pytest.raises(ValueError, match="components"):
        RadixLayout(("swa",), sliding_window=2).validate()


@dataclass
class Acc:
    pool: str
    available: int
    evictable: int
    protected: int
    held: int
    size: int


def test_conservation_and_slot_disjointness_controls() -> None:
    assert inv.radix_pool_conservation([Acc("full", 5, 2, 1, 2, 10)]) == []
    assert inv.radix_pool_conservation([Acc("swa", 5, 2, 1, 1, 10)])  # one slot leaked
    assert inv.radix_slots_disjoint({"free": {1, 2}, "cached": {3}, "held": {4}}) == []
    assert inv.radix_slots_disjoint({"free": {1, 2}, "cached": {2}, "held": set()})  # free and cached


def test_running_prefix_backed_control() -> None:
    assert inv.radix_running_prefix_backed({0: {3, 4}}, free={1, 2}, cached={3, 4, 5}) == []
    assert inv.radix_running_prefix_backed({0: {3, 4}}, free={4}, cached={3, 5})  # its KV was freed
    assert inv.radix_running_prefix_backed({0: {3, 4}}, free=set(), cached={3})  # no longer in the tree


def test_hit_locked_promise_controls() -> None:
    view = chain(((1, 2, 3), {"full_lock": 1}))
    assert inv.radix_hit_matches_model(view, (1, 2, 3, 4), FULL1, 3, 3) == []
    assert inv.radix_hit_matches_model(view, (1, 2, 3, 4), FULL1, 3, 2)  # a lost hit
    assert inv.radix_locked_paths_kept(view, {7: 1}) == []
    assert inv.radix_locked_paths_kept(view, {7: 5})  # the locked node is gone
    assert inv.radix_locked_paths_kept(chain(((1,), {})), {7: 1})  # path present, lock lost
    assert inv.radix_full_promise_kept(view, (1, 2, 3, 4), FULL1) == []
    assert inv.radix_full_promise_kept(chain(((1,), {})), (1, 2, 3, 4), FULL1)


def test_events_and_eviction_order_controls() -> None:
    view = chain(((1, 2), {}))
    assert inv.radix_events_replay({(1,), (1, 2)}, view, 1) == []
    assert inv.radix_events_replay({(1,)}, view, 1)  # a page no event announced
    assert inv.radix_events_replay({(1,), (1, 2), (9,)}, view, 1)  # a stale page
    nodes = {
        0: NodeView(0, None, (), True),
        1: NodeView(1, 0, (1,), True, last_access=1.0),
        2: NodeView(2, 0, (2,), True, last_access=2.0),
    }
    before = TreeView(0, dict(nodes))
    lru_ok = TreeView(0, {0: nodes[0], 2: nodes[2]})
    mru = TreeView(0, {0: nodes[0], 1: nodes[1]})
    assert inv.radix_eviction_lru(before, lru_ok) == []
    assert inv.radix_eviction_lru(before, mru)  # the newer leaf went first


def test_full_eviction_model_lru_with_cascade() -> None:
    nodes = {
        0: NodeView(0, None, (), True),
        1: NodeView(1, 0, (1, 1), True, last_access=5.0),
        2: NodeView(2, 1, (2, 2, 2), True, last_access=1.0),
        3: NodeView(3, 0, (3,), True, last_access=3.0),
        4: NodeView(4, 0, (4,), True, full_lock=1, last_access=0.0),
    }
    view = TreeView(0, nodes)
    assert evict_full(view, 3) == ([2], 3)  # oldest leaf, whole node
    assert evict_full(view, 4) == ([2, 3], 4)
    assert evict_full(view, 100) == ([2, 3, 1], 6)  # node 1 became a leaf; locked node 4 stays
    after = TreeView(0, {k: v for k, v in nodes.items() if k not in (2,)})
    assert inv.radix_full_eviction_matches_model(view, after, 3, 3) == []
    assert inv.radix_full_eviction_matches_model(view, after, 3, 2)  # miscounted
    wrong = TreeView(0, {k: v for k, v in nodes.items() if k not in (3,)})
    assert inv.radix_full_eviction_matches_model(view, wrong, 1, 1)  # newer leaf removed


def test_refusal_justified_control() -> None:
    assert inv.radix_refusal_justified({"full": (8, 2, 4), "swa": (8, 8, 0)}) == []  # full short
    assert inv.radix_refusal_justified({"full": (8, 2, 6), "swa": (8, 1, 9)})  # both could serve


def test_free_list_unique_control() -> None:
    assert inv.radix_free_list_unique({"full": [1, 2, 3], "mamba": [4]}) == []
    assert inv.radix_free_list_unique({"full": [1, 2, 1]})  # freed twice


def test_mamba_eviction_lru_control() -> None:
    before = chain(((1,), {"mamba": True}), ((2,), {"mamba": True}), ((3,), {"mamba": True}))
    oldest_gone = chain(((1,), {"mamba": False}), ((2,), {"mamba": True}), ((3,), {"mamba": True}))
    newest_gone = chain(((1,), {"mamba": True}), ((2,), {"mamba": True}), ((3,), {"mamba": False}))
    use = {1: 1, 2: 2, 3: 3}
    assert inv.radix_mamba_eviction_lru(before, oldest_gone, use) == []
    assert inv.radix_mamba_eviction_lru(before, newest_gone, use)  # kept older states 1 and 2
    locked = chain(((1,), {"mamba": True, "mamba_lock": 1}), ((2,), {"mamba": True}), ((3,), {"mamba": True}))
    assert inv.radix_mamba_eviction_lru(locked, oldest_gone, {1: 1, 2: 2, 3: 3}) == []
