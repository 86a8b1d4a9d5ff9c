"""Regression test exported by kvretain from a trace on vLLM's real Scheduler.

Known finding failed-load-rollback-reserves-against-itself: A request admitted to an
async KV-connector load joins the in-flight prefills (Scheduler._inflight_prefills),
whose remaining blocks every later async admission leaves free. If its load fails and
nothing of it is kept (failed_recving, or failed on its first block, under
kv_load_failure_policy 'recompute'), its promotion frees all its blocks
(_update_waiting_for_remote_kv: kv_cache_manager.free) but leaves it among the in-flight
prefills, where its reservation is now its whole sequence (_request_remaining_blocks on
a request holding nothing). Until it next runs a chunk, each async admission of the
request itself counts that reservation against its own blocks ('other in-flight
reservations' in vLLM's comment): it needs its sequence twice over, so a request that
fits the idle pool is refused, and refused again at every step while the connector
offers it an async load again: it never runs. Here: one full, two SWA groups (blocks
4/16/4), 28 blocks (27 usable); r0 (48 tokens) is offered 47 tokens async and admitted
(16 blocks), its load fails and is rolled back (its fresh admission in the same turn
does not fit either), then offered 46 tokens async: on an idle pool its admission needs
about 16 blocks (its first one took 16) but vLLM reserves 30 for r0 itself, and refuses
it. vLLM's Scheduler agrees step for step on this trace (engine steps, budget 64:
nothing steered), and `kvretain replay --target vllm` reports it:
fitting_request_admitted judges the last step's admission on an idle pool; with the real
scheduler's draft (num_spec_tokens 1) the async admission also leaves one decode step's
slots free (3 blocks), so it counts 19 blocks there, 16 on the model. The model
(model.machine.connector: in_flight_reserve counts every request whose prefill is in
flight, the rolled-back one included) states vLLM's behaviour, so
fitting_request_admitted flags it on the model and on vllm. A fix would discard the
request from _inflight_prefills when its failed load is rolled back (or leave the
admitting request out of its own reservation). Found by kvretain's model fuzz on vLLM
0.33.0's semantics and confirmed against its real Scheduler with the scripted connector
(CPU, no worker); not confirmed on a GPU with a real connector, and not filed upstream.

How the steps are driven: this file makes exactly the calls kvretain's "vllm"
target made on vLLM 0.33.0 when it found this (seed 82), as straight-line code.
Each schedule() is the engine's own: nothing of the scheduler is written, and the
queues it starts from and its built budget are checked against the recorded ones;
the model runner is a synthetic ModelRunnerOutput handed to
update_from_output (the sampled tokens; the worker's KVConnectorOutput: finished and failed loads, failed blocks, finished saves). The drafter's proposals go to update_draft_token_ids. Each step's
scheduled tokens are checked against the values recorded then: a difference raises
SetupDiverged (the trace no longer reaches the finding's state: re-derive it). Only
the final check is the property.

Recorded violation: fitting_request_admitted: admission of r0 (19 blocks) refused by an idle pool of 27
after its failed load was rolled back
"""

import dataclasses
import json
import os
import sys
import tempfile
import types

import torch
from torch import nn
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.model_executor.models.registry import ModelRegistry
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

STAND_IN = "KvretainStandInForCausalLM"
NUM_BLOCKS = 28
MAX_MODEL_LEN = 4096
SCHEDULER_BLOCK_SIZE = 16
HASH_BLOCK_SIZE = 4
ENABLE_CACHING = True
NUM_SPECULATIVE_TOKENS = 1


class SetupDiverged(Exception):
    """vLLM no longer walks the trace the finding was derived on."""


class StandIn(nn.Module):
    """Stands for the model: the scheduler reads only its configuration."""

    def __init__(self, *, vllm_config=None, prefix=""):
        super().__init__()

    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def forward(self, input_ids, positions, **kwargs):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError


class FakeConnector(KVConnectorBase_V1, SupportsHMA):
    """A minimal scheduler-side KV connector, scripted by the test: `offer(rid, n, async_load)`
    offers the first n tokens of rid past its local hit at its next lookup (never its last
    token); `save(rid)` makes rid's finish defer its free (delay_free_blocks=True) as a
    saving connector does. Loads and saves are reported by the worker's KVConnectorOutput,
    passed to update_from_output below. No worker side."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict = {}
        self.saving: set = set()

    def offer(self, rid: str, num_tokens: int, async_load: bool) -> None:
        self.offers[rid] = (num_tokens, async_load)

    def save(self, rid: str) -> None:
        self.saving.add(rid)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        offer = self.offers.get(request.request_id)
        if offer is None:
            return 0, False
        n = max(0, min(offer[0], request.num_tokens - 1) - num_computed_tokens)
        return n, offer[1] and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.offers.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        self.offers.pop(request.request_id, None)
        saves = request.request_id in self.saving and any(len(g) for g in block_ids)
        self.saving.discard(request.request_id)
        return saves, None

    def start_load_kv(self, forward_context, **kwargs):
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name):
        raise NotImplementedError

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        raise NotImplementedError

    def wait_for_save(self):
        raise NotImplementedError


def connector_module() -> str:
    """vLLM loads a connector class by module path: this file's module (registered under
    its name when the runner that loaded it did not)."""
    if getattr(sys.modules.get(__name__), "FakeConnector", None) is not FakeConnector:
        module = types.ModuleType(__name__)
        module.FakeConnector = FakeConnector
        sys.modules[__name__] = module
    return __name__


def make_scheduler(model_dir: str) -> Scheduler:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ModelRegistry.register_model(STAND_IN, StandIn)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": [STAND_IN],
                "model_type": "opt",
                "hidden_size": 16,
                "num_attention_heads": 1,
                "num_hidden_layers": 1,
                "ffn_dim": 16,
                "vocab_size": 64,
                "word_embed_proj_dim": 16,
                "max_position_embeddings": MAX_MODEL_LEN,
            },
            f,
        )
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32"
    )
    cache = CacheConfig(
        block_size=SCHEDULER_BLOCK_SIZE, enable_prefix_caching=ENABLE_CACHING
    )
    cache.num_gpu_blocks = NUM_BLOCKS
    parallel = ParallelConfig()
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=68,
            max_num_scheduled_tokens=64,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=0,
            is_encoder_decoder=False,
            watermark=0.0,
            scheduler_reserve_full_isl=False,
            async_scheduling=False,
        ),
        cache_config=cache,
        parallel_config=parallel,
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        speculative_config=SpeculativeConfig(
            method="draft_model",
            model=model.model,
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
            target_model_config=model,
            target_parallel_config=parallel,
            disable_lookahead_block_hashes=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FakeConnector",
            kv_connector_module_path=connector_module(),
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"],
                FullAttentionSpec(
                    block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer1"],
                SlidingWindowSpec(
                    block_size=16, sliding_window=34, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer2"],
                SlidingWindowSpec(
                    block_size=4, sliding_window=3, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
        ],
        prefix_cache_retention_interval=0,
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=SCHEDULER_BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        log_stats=False,
    )


class Driver:
    """The calls of the trace, by request name."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.requests: dict = {}
        self.tables: dict = {}  # the block table the worker holds per request, from the outputs

    def add(self, rid: str, tokens: list) -> None:
        hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256) if ENABLE_CACHING else None
        self.requests[rid] = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1 << 30),
            pooling_params=None,
            mm_features=None,
            block_hasher=hasher,
        )
        self.s.add_request(self.requests[rid])

    def step(self, running: list, holding: list, waiting: list, budget: int):
        """The engine's schedule(), from the queues and with the budget recorded (checked)."""
        s = self.s
        queues = [[r.request_id for r in q] for q in (s.running, s.kv_holding_waiting, s.waiting)]
        expect("the queues schedule() starts from", queues, [running, holding, waiting])
        expect("the token budget", s.max_num_scheduled_tokens, budget)
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                self.tables[rid] = [list(g) for g in ids]
            elif ids is not None:
                for table, new_ids in zip(self.tables[rid], ids):
                    table.extend(new_ids)
        return out

    def update(self, out, scheduled: dict, total: int, sampled: dict, connector=None) -> None:
        """update_from_output with the share of step output `out` that belongs to `scheduled`."""
        share = dataclasses.replace(
            out,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens={
                r: t for r, t in out.scheduled_spec_decode_tokens.items() if r in scheduled
            },
        )
        rids = list(sampled)
        self.s.update_from_output(
            share,
            ModelRunnerOutput(
                req_ids=rids,
                req_id_to_index={r: i for i, r in enumerate(rids)},
                sampled_token_ids=[list(sampled[r]) for r in rids],
                kv_connector_output=connector,
            ),
        )

    def finish(self, rid: str) -> None:
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def expect(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise SetupDiverged(f"{what}: vLLM gives {got!r}, the trace was derived on {expected!r}")


def test_failed_load_rollback_reserves_against_itself() -> None:
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory(prefix="kvretain-model-") as model_dir:
        driver = Driver(make_scheduler(model_dir))
    # op 0: op=add, rid=r0, prompt=48 tokens
    driver.add('r0', [3, 2, 1, 1, 3, 3, 1, 2, 3, 2, 2, 3, 1, 3, 3, 1, 2, 1, 3, 3, 3, 3, 1, 2, 1, 3, 3, 2, 3, 3, 1, 2, 3, 1, 2, 3, 3, 1, 1, 1, 1, 3, 3, 2, 2, 3, 2, 1])
    # op 1: op=offer, rid=r0, num_tokens=47, load=async
    driver.s.connector.offer('r0', 47, async_load=True)
    # op 2: op=step, rids=['r0'], budget=64
    out0 = driver.step([], [], ['r0'], budget=64)
    expect("op 2: tokens scheduled", dict(out0.num_scheduled_tokens), {})
    # op 3: op=loaded, rid=r0, ok=False
    driver.update(out0, {}, total=0, sampled={}, connector=KVConnectorOutput(finished_recving={'r0'}, failed_recving={'r0'}))
    # op 4: op=step, rids=['r0'], budget=64
    out1 = driver.step([], ['r0'], [], budget=64)
    expect("op 4: tokens scheduled", dict(out1.num_scheduled_tokens), {})
    # op 5: op=offer, rid=r0, num_tokens=46, load=async
    driver.s.connector.offer('r0', 46, async_load=True)
    # op 6: op=step, rids=['r0'], budget=64
    # The property:
    out2 = driver.step([], ['r0'], [], budget=64)
    held = [len(ids) for ids in driver.s.kv_cache_manager.get_block_ids('r0')]
    assert any(held), "r0 needs 19 blocks and is refused by an idle pool of 27"
