"""Regression test exported by kvretain from a trace on vLLM's real Scheduler.

Known finding vllm-mamba-padded-admission-null-state: A one-token admission is padded to
1 + k tokens with placeholder drafts (a prefix hit that leaves one token, or a one-token
prompt admitted behind a running request). In align mode the Mamba manager puts the
running state in the column of the padded end and leaves the column before it null; with
k at least the Mamba block size the padded end lies a block past the real token. The
sample rejects the placeholders (num_computed_tokens rolls back), and the next step ends
at the real next token, whose state column cdiv(end, block_size) - 1 is that null entry
in the worker's table too (nothing new is shipped for it): the worker copies the state
into block 0 and the forward pass writes the running state there. Block 0 is shared by
every request, so two requests in this case read each other's state
(tests/data/mamba_state_in_null_block_two_requests.json). Here: Full2 + Mamba2, a draft
model with k = 2; r1 caches [1,3,3]'s first block; r2 [1,3,3] hits 2 tokens and is
padded to 3 (Mamba table [3, 0, 6, 7, 8]); the sample rejects both placeholders; the
next step ends at token 4, column 1: the null block. It needs k >= the Mamba block size,
which vLLM's hybrid block sizes (hundreds of tokens) do not meet in serving
configurations; found through the real Scheduler and AsyncScheduler, not confirmed on a
GPU nor filed upstream.

How the steps are driven: this file makes exactly the calls kvretain's "vllm"
target made on vLLM 0.33.0 when it found this (seed None), as straight-line code.
Each schedule() is the engine's own: nothing of the scheduler is written, and the
queues it starts from and its built budget are checked against the recorded ones;
the model runner is a synthetic ModelRunnerOutput handed to
update_from_output (the sampled tokens). The drafter's proposals go to update_draft_token_ids. Each step's
scheduled tokens are checked against the values recorded then: a difference raises
SetupDiverged (the trace no longer reaches the finding's state: re-derive it). Only
the final check is the property.

Recorded violation: mamba_state_in_worker_table: r2 writes its state into column 1 of its worker table
(group 1): the null block
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
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

STAND_IN = "KvretainStandInForCausalLM"
NUM_BLOCKS = 24
MAX_MODEL_LEN = 4096
SCHEDULER_BLOCK_SIZE = 2
HASH_BLOCK_SIZE = 2
ENABLE_CACHING = True
NUM_SPECULATIVE_TOKENS = 2


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
        block_size=SCHEDULER_BLOCK_SIZE, enable_prefix_caching=ENABLE_CACHING, mamba_cache_mode="align"
    )
    cache.num_gpu_blocks = NUM_BLOCKS
    parallel = ParallelConfig()
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=5,
            max_num_scheduled_tokens=3,
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
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"],
                FullAttentionSpec(
                    block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            ),
            KVCacheGroupSpec(
                ["layer1"],
                MambaSpec(
                    block_size=2, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align", num_speculative_blocks=NUM_SPECULATIVE_TOKENS
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


def test_vllm_mamba_padded_admission_null_state() -> None:
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory(prefix="kvretain-model-") as model_dir:
        driver = Driver(make_scheduler(model_dir))
    # op 0: op=add, rid=r1, prompt=3 tokens
    driver.add('r1', [1, 3, 3])
    # op 1: op=step, rids=['r1'], budget=3
    out0 = driver.step([], [], ['r1'], budget=3)
    expect("op 1: tokens scheduled", dict(out0.num_scheduled_tokens), {'r1': 2})
    # op 2: op=finish, rid=r1
    driver.finish('r1')
    # op 3: op=add, rid=r2, prompt=3 tokens
    driver.add('r2', [1, 3, 3])
    # op 4: op=step, rids=['r2'], budget=3
    driver.update(out0, {'r1': 2}, total=2, sampled={'r1': []})
    out1 = driver.step([], [], ['r2'], budget=3)
    expect("op 4: tokens scheduled", dict(out1.num_scheduled_tokens), {'r2': 3})
    # op 5: op=sample, rid=r2, token=1
    driver.update(out1, {'r2': 3}, total=3, sampled={'r2': [1]})
    driver.s.update_draft_token_ids(DraftTokenIds(['r2'], [[]]))
    # op 6: op=step, rids=['r2'], budget=3
    # The property:
    out2 = driver.step(['r2'], [], [], budget=3)
    table = driver.tables['r2'][1]
    null = driver.s.kv_cache_manager.block_pool.null_block.block_id
    assert table[1] != null, (
        f"r2 writes its Mamba state into column 1 of its worker table (group 1): "
        f"the null block (table {table})"
    )
