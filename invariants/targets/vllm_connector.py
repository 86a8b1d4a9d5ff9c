"""A scripted KV connector for vLLM's real `Scheduler` (the "vllm" target).

`KvretainConnector` is a `KVConnectorBase_V1` (and `SupportsHMA`, so hybrid
layouts keep their groups), registered the way vLLM registers connectors
(`KVConnectorFactory.register_connector(CONNECTOR_NAME, module, class)`) and
selected by a `KVTransferConfig` (`transfer_config`): kv_role "kv_both" (it
loads and saves),
`kv_load_failure_policy` as `Config.kv_load_failure_policy`. It runs on the scheduler's side only:
the scheduler never builds a worker, and the worker-side methods raise.

It holds no KV. kvretain's operations script it (`model.machine.connector` states the
contract the model derives from them):

- `offer(rid, n, async_load)` (`Offer`): at `rid`'s admission lookups,
  `get_num_new_matched_tokens` offers the first `n` tokens past the local hit
  (never the last token), loaded asynchronously or not; the offer stands until
  `update_state_after_alloc` consumes it (the admission succeeded).
- `save(rid)` (`Save`): at `rid`'s finish `request_finished_all_groups`
  defers the free (`delay_free_blocks=True`) when it was handed a block, as
  a P/D producer connector does for a request it sends, and as an offloading
  (kv_both) one does for a request whose load is still in flight: vLLM then
  counts two deferrals of one free (`model.machine.connector`, a known finding).
- A load's or a save's outcome (`Loaded`, `Saved`) is not the connector's to
  report: it is the worker's `KVConnectorOutput` (`finished_recving`,
  `failed_recving`, `invalid_block_ids`, `finished_sending`), which the driver delivers in a
  synthetic `ModelRunnerOutput` (`connector_output`, `sent_output`).

It records what the scheduler asked of it: the loads it was given blocks for
(`loads`), the tokens of each step it would save (`saves`, from
`build_connector_meta`, the last `SAVES_KEPT` steps), the finished requests
handed to it (`finished`) and the block ids each was handed (`handed`).
Everything it is told also goes to `watch` when a target sets one (the shadow
worker's connector side, `invariants.shadow.connector`, duck-typed: `told_load`,
`built_meta`, `reported`, `finished`), which judges it against what the
request holds.

Imports only vLLM (and the standard library).
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

CONNECTOR_NAME = "KvretainConnector"
SAVES_KEPT = 64
WORKER_SIDE = "kvretain's connector runs on the scheduler's side only (no worker is built)"


@dataclass(frozen=True)
class Load:
    """A load the scheduler allocated blocks for: the request, its external
    tokens and the block ids per group it holds then."""

    rid: str
    num_external_tokens: int
    block_ids: tuple[tuple[int, ...], ...]


class KvretainMetadata(KVConnectorMetadata):
    """The (empty) metadata a step hands the worker side."""


class KvretainConnector(KVConnectorBase_V1, SupportsHMA):
    """The scripted connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, tuple[int, bool]] = {}
        self.loads: list[Load] = []
        self.saves: deque[dict[str, int]] = deque(maxlen=SAVES_KEPT)
        self.finished: list[str] = []
        self.handed: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.saving: set[str] = set()
        # Finished requests whose free it deferred (until the worker reports them sent).
        self.deferred: set[str] = set()
        # Async loads given blocks whose report (`update_connector_output`) has not come.
        self.loading: set[str] = set()
        # rid -> (the computed tokens it was asked to match past, the tokens it matched).
        self.matched: dict[str, tuple[int, int]] = {}
        # Told everything the scheduler tells the connector (None: nobody watches).
        self.watch: Any = None

    # ------------------------------------------------------------------ kvretain's script
    def offer(self, rid: str, num_tokens: int, async_load: bool) -> None:
        self.offers[rid] = (num_tokens, async_load)

    def save(self, rid: str) -> None:
        self.saving.add(rid)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a preempted request's output is never held back."""
        return False

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        offer = self.offers.get(request.request_id)
        if offer is None:
            return 0, False
        n = max(0, min(offer[0], request.num_tokens - 1) - num_computed_tokens)
        self.matched[request.request_id] = (num_computed_tokens, n)
        return n, offer[1] and n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        offer = self.offers.pop(request.request_id, None)
        if num_external_tokens and offer is not None and offer[1]:
            self.loading.add(request.request_id)
        if num_external_tokens:
            ids = tuple(tuple(g) for g in blocks.get_block_ids())
            self.loads.append(Load(request.request_id, num_external_tokens, ids))
            if self.watch is not None:
                start, matched = self.matched.get(request.request_id, (0, 0))
                self.watch.told_load(
                    request.request_id,
                    start,
                    matched,
                    num_external_tokens,
                    ids,
                    request.request_id in self.loading,
                    tuple(request.all_token_ids),
                )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.saves.append(dict(scheduler_output.num_scheduled_tokens))
        if self.watch is not None:
            self.watch.built_meta(scheduler_output)
        return KvretainMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        self.loading -= set(connector_output.finished_recving or ())
        self.deferred -= set(connector_output.finished_sending or ())
        if self.watch is not None:
            self.watch.reported(
                connector_output.finished_recving or (),
                connector_output.failed_recving or (),
                connector_output.invalid_block_ids or (),
                connector_output.finished_sending or (),
            )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.offers.pop(rid, None)  # an offer never admitted ends with its request (as the model's)
        self.finished.append(rid)
        self.handed[rid] = tuple(tuple(g) for g in block_ids)
        saves = rid in self.saving and any(len(g) for g in block_ids)
        self.saving.discard(rid)
        if saves:
            self.deferred.add(rid)
        if self.watch is not None:
            self.watch.finished(
                rid, self.handed[rid], saves, request.num_computed_tokens, tuple(request.all_token_ids)
            )
        return saves, None

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError(WORKER_SIDE)

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError(WORKER_SIDE)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError(WORKER_SIDE)

    def wait_for_save(self) -> None:
        raise NotImplementedError(WORKER_SIDE)


class ScriptedFailureLog(logging.Filter):
    """Drops the scheduler's report of a load failure that kvretain scripted itself
    (`Loaded(rid, False)` or failed blocks, under 'fail'): an expected line per failure,
    which would flood a run's output. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failing %d request(s) due to KV load failure")


def register() -> None:
    """Register the connector with vLLM's factory (once per process)."""
    # ValueError: registered already, by an earlier target of this process.
    with suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, KvretainConnector.__name__)
        logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(ScriptedFailureLog())


def transfer_config(failure_policy: Literal["recompute", "fail"] = "recompute") -> Any:
    """The `KVTransferConfig` selecting the connector (registered first)."""
    from vllm.config import KVTransferConfig

    register()
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_load_failure_policy=failure_policy
    )


def connector_output(rid: str, ok: bool, invalid: tuple[int, ...] = ()) -> Any:
    """The worker's report of `rid`'s async load: received, and failed unless `ok`
    (a failed receive is also a finished one: `KVConnectorTransferResults`), or
    failed on the blocks `invalid` names (`invalid_block_ids`)."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_recving={rid}, failed_recving=set() if ok else {rid}, invalid_block_ids=set(invalid)
    )


def invalid_output(invalid: tuple[int, ...]) -> Any:
    """The worker's report, with the output of the step that ran a sync load, of the
    blocks that load failed on (`invalid_block_ids`; no transfer finished)."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(invalid_block_ids=set(invalid))


def sent_output(rid: str) -> Any:
    """The worker's report that finished request `rid`'s KV was saved (`finished_sending`)."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_sending={rid})
