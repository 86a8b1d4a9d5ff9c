"""Translating SGLang's cache into kvretain's terms: pool accounts, slot sets, tree view, events.

`pool_accounts` reads every pool's four parts the way SGLang's own
`SchedulerInvariantChecker` names them (available, evictable, protected, held
by running requests) plus its size; `slot_sets` reads the *sets* of slots
(free list, tree values, request rows) so a slot both free and cached shows
even when the counts happen to balance. `tree_view` walks the Python tree
core's nodes; `rust_tree_view` reads the Rust core's own nodes from its binding (structure, lengths, full locks, which
components hold a value) so each core can be judged on its own.
`replay_pages` turns KV events into the set of cached pages. A node's namespace (adapter,
cache salt) is read from its key on the Python core, and on the Rust core (whose binding
exposes no key) from the identity that wrote its first slot.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from invariants.targets.sglang_drive import SglangDriver
from model.radix.tree import DEFAULT_NAMESPACE, Namespace, NodeView, TreeView


@dataclass(frozen=True)
class PoolAccount:
    """One pool: available + evictable + protected + held must equal size."""

    pool: str
    available: int
    evictable: int
    protected: int
    held: int
    size: int

    @property
    def balance(self) -> int:
        return self.available + self.evictable + self.protected + self.held - self.size


def _ceil(n: int, page: int) -> int:
    return (n + page - 1) // page * page


def pool_accounts(driver: SglangDriver) -> list[PoolAccount]:
    """Every pool's account; `held` is what running requests own outside the tree."""
    cache, alloc, page = driver.cache, driver.parts.allocator, driver.layout.page_size
    reqs = [run.req for run in driver.running.values() if run.req.kv.holds_kv]
    held_full = sum(_ceil(r.kv.kv_allocated_len, page) - r.kv.cache_protected_len for r in reqs)
    full_available = alloc.full_available_size() if driver.layout.has_swa else alloc.available_size()
    out = [
        PoolAccount(
            "full",
            full_available,
            cache.full_evictable_size(),
            cache.full_protected_size(),
            held_full,
            alloc.size_full if driver.layout.has_swa else alloc.size,
        )
    ]
    if driver.layout.has_swa:
        held_swa = 0
        for r in reqs:
            freed = max(0, r.kv.get_evicted_seqlen(_swa_type()) - r.kv.swa_dead_lo(page))
            held_swa += _ceil(r.kv.kv_allocated_len, page) - r.kv.cache_protected_len - freed
        out.append(
            PoolAccount(
                "swa",
                alloc.swa_available_size(),
                cache.swa_evictable_size(),
                cache.swa_protected_size(),
                held_swa,
                alloc.size_swa,
            )
        )
    if driver.layout.has_mamba:
        pool = driver.parts.req_to_token_pool
        held_mamba = sum(_mamba_slots(run.req.kv) for run in driver.running.values())
        out.append(
            PoolAccount(
                "mamba",
                pool.mamba_allocator.available_size(),
                cache.mamba_evictable_size(),
                cache.mamba_protected_size(),
                held_mamba,
                pool.mamba_pool.size,
            )
        )
    return out


def _mamba_slots(kv: Any) -> int:
    """Mamba slots a request holds: its state, plus (extra-buffer mode, page > 1) the
    ping-pong tracking slots in use."""
    held = kv.mamba_pool_idx.numel() if kv.holds_mamba else 0
    if kv.mamba_ping_pong_track_buffer is not None:
        held += sum(1 for empty in kv.mamba_ping_pong_empty if not empty)
    return int(held)


def _swa_type() -> Any:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.SWA


def slot_sets(driver: SglangDriver) -> dict[str, set[int]]:
    """Full-attention slots: free (allocator), cached (tree values), held (request rows past the prefix)."""
    alloc, page = driver.parts.allocator, driver.layout.page_size
    full_alloc = alloc.full_attn_allocator if driver.layout.has_swa else alloc
    # The free list holds page ids (slot ids at page size 1).
    free_pages = full_alloc.get_all_free_pages().tolist()
    free = {int(p) * page + i for p in free_pages for i in range(page)}
    cached = set(driver.cache.all_values_flatten().tolist())
    held: set[int] = set()
    rows = driver.parts.req_to_token_pool.req_to_token
    for run in driver.running.values():
        kv = run.req.kv
        if kv.holds_kv:
            held.update(
                int(x) for x in rows[kv.req_pool_idx, kv.cache_protected_len : kv.kv_allocated_len].tolist()
            )
    return {"free": free, "cached": cached, "held": held}


def prefix_slots(driver: SglangDriver) -> dict[int, set[int]]:
    """Per running request, the full-attention slots of its matched prefix (row[0:cache_protected_len])."""
    rows = driver.parts.req_to_token_pool.req_to_token
    out: dict[int, set[int]] = {}
    for rid, run in driver.running.items():
        kv = run.req.kv
        if kv.holds_kv and kv.cache_protected_len > 0:
            out[rid] = {int(x) for x in rows[kv.req_pool_idx, : kv.cache_protected_len].tolist()}
    return out


def free_lists(driver: SglangDriver) -> dict[str, list[int]]:
    """The raw free lists (full pages; Mamba slots), duplicates kept: a slot freed twice shows twice."""
    alloc = driver.parts.allocator
    full_alloc = alloc.full_attn_allocator if driver.layout.has_swa else alloc
    out = {"full": [int(p) for p in full_alloc.get_all_free_pages().tolist()]}
    if driver.layout.has_mamba:
        slots = driver.parts.req_to_token_pool.mamba_allocator.free_slots
        out["mamba"] = [int(x) for x in slots.tolist()]
    return out


def mamba_slot_sets(driver: SglangDriver) -> dict[str, set[int]]:
    """Mamba slots: free, cached (tree states), held by running requests (state and ping-pong)."""
    pool = driver.parts.req_to_token_pool
    held: set[int] = set()
    for run in driver.running.values():
        kv = run.req.kv
        if kv.holds_mamba:
            held.update(int(x) for x in kv.mamba_pool_idx.reshape(-1).tolist())
        if kv.mamba_ping_pong_track_buffer is not None:
            buf = kv.mamba_ping_pong_track_buffer.reshape(-1).tolist()
            held.update(int(x) for x, empty in zip(buf, kv.mamba_ping_pong_empty, strict=False) if not empty)
    return {
        "free": {int(x) for x in pool.mamba_allocator.free_slots.tolist()},
        "cached": {int(x) for x in driver.cache.all_mamba_values_flatten().tolist()},
        "held": held,
    }


def _namespace(driver: SglangDriver, key: Any) -> Namespace:
    """A node key's (adapter name, cache salt): its `extra_key` (the adapter id the Req
    appended) read back as the adapter's name."""
    extra = getattr(key, "extra_key", None)
    lora = None if extra is None else driver.lora_by_id.get(extra, extra)
    return (lora, getattr(key, "cache_salt", None))


def tree_view(driver: SglangDriver) -> TreeView | None:
    """The Python tree core's nodes as a `TreeView`; None on the Rust core."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = driver.cache.tree_core
    if driver.parts.core != "python":
        return None
    root = core.root_node
    nodes: dict[int, NodeView] = {}
    stack = [root]
    swa, mamba = driver.layout.has_swa, driver.layout.has_mamba
    while stack:
        node = stack.pop()
        data = node.component_data
        full_cd = data[ComponentType.FULL]
        nodes[node.id] = NodeView(
            node_id=node.id,
            parent=None if node.parent is None else node.parent.id,
            tokens=tuple(node.key.token_ids) if node.key is not None and node is not root else (),
            full=full_cd.value is not None,
            swa=(data[ComponentType.SWA].value is not None) if swa else None,
            mamba=(data[ComponentType.MAMBA].value is not None) if mamba else None,
            full_lock=full_cd.lock_ref,
            swa_lock=data[ComponentType.SWA].lock_ref if swa else 0,
            mamba_lock=data[ComponentType.MAMBA].lock_ref if mamba else 0,
            last_access=float(node.last_access_time),
            namespace=_namespace(driver, node.key) if node is not root else DEFAULT_NAMESPACE,
        )
        stack.extend(reversed(list(node.children.values())))
    return TreeView(root=root.id, nodes=nodes)


class EventReplay:
    """Cached pages rebuilt from BlockStored / BlockRemoved / AllBlocksCleared events."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def feed(self, events: Iterable[Any]) -> None:
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.prefix_of.clear()
            elif kind == "BlockStored":
                base = () if ev.parent_block_hash is None else self.prefix_of.get(ev.parent_block_hash)
                if base is None:
                    raise AssertionError(f"BlockStored names unknown parent {ev.parent_block_hash}")
                for i, h in enumerate(ev.block_hashes):
                    base = base + tuple(ev.token_ids[i * self.page_size : (i + 1) * self.page_size])
                    self.prefix_of[h] = base
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    if self.prefix_of.pop(h, None) is None:
                        raise AssertionError(f"BlockRemoved names a block never stored: {h}")

    def pages(self) -> set[tuple[int, ...]]:
        return set(self.prefix_of.values())


_PRETTY_LINE = re.compile(r"^( *)\[(\d+)\] (\d+) full_lock=(\d+)((?: \w+=(?:yes|no))*)\s*$")


def _native_stdout(call: Any) -> str:
    """What `call()` writes to file descriptor 1 (native code included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as buf:
        os.dup2(buf.fileno(), 1)
        try:
            call()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        buf.seek(0)
        return buf.read().decode(errors="replace")


def rust_tree_view(driver: SglangDriver) -> TreeView:
    """The Rust tree core's nodes as a `TreeView`, read from the core alone.

    Structure, key lengths, full-attention lock counts and which components hold a value
    come from the binding's own `pretty_print`; a node's tokens are the tokens its
    full-attention slots were written with (`driver.slot_tokens`; -1 for a slot no request
    of this driver wrote, which would itself be a defect). Not exposed by the production
    binding, so absent here: SWA and Mamba lock counts (0) and access times (0.0: the
    checker judges eviction order with the model's recency, `model/radix/recency.py`).
    Raises RuntimeError when the dump cannot be parsed (a binding that changed its format)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    binding = driver.cache.tree_core._binding
    text = _native_stdout(binding.pretty_print)
    swa, mamba = driver.layout.has_swa, driver.layout.has_mamba
    nodes: dict[int, NodeView] = {}
    stack: list[tuple[int, int]] = []  # (indent, node id) of the open ancestors
    root: int | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _PRETTY_LINE.match(line)
        if m is None:
            raise RuntimeError(f"Rust tree core dump: unexpected line {line!r}")
        indent, nid, length, lock = len(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
        flags = dict(part.split("=") for part in m.group(5).split())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else None
        if parent is None:
            root = nid
        stack.append((indent, nid))
        tokens: tuple[int, ...] = ()
        namespace = DEFAULT_NAMESPACE
        full = flags.get("Full") == "yes"
        if parent is not None and full:
            value = binding.get_component_device_value(nid, int(ComponentType.FULL))
            slots = [] if value is None else value.tolist()
            tokens = tuple(driver.slot_tokens.get(int(s), -1) for s in slots)
            if slots:  # the binding exposes no key: the identity its first slot was written by
                namespace = driver.slot_writer.get(int(slots[0]), DEFAULT_NAMESPACE)
        if parent is not None and len(tokens) != length:
            tokens = tokens + (-1,) * (length - len(tokens))
        nodes[nid] = NodeView(
            node_id=nid,
            parent=parent,
            tokens=tokens,
            full=full,
            swa=(flags.get("Swa") == "yes") if swa else None,
            mamba=(flags.get("Mamba") == "yes") if mamba else None,
            full_lock=lock,
            namespace=namespace,
        )
    if root is None:
        raise RuntimeError("Rust tree core dump: no root")
    return TreeView(root=root, nodes=nodes)


def core_view(driver: SglangDriver) -> TreeView:
    """The tree of `driver`'s own core: `tree_view` (Python) or `rust_tree_view` (Rust)."""
    if driver.parts.core == "python":
        view = tree_view(driver)
        assert view is not None
        return view
    return rust_tree_view(driver)
