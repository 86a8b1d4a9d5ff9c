"""Render a vllm trace as a standalone pytest file that runs vLLM's real `Scheduler`.

The file imports only vLLM, torch and pytest. It builds the `Scheduler` the
"vllm" target builds (`invariants.targets.vllm_scheduler_build`: a
`VllmConfig` whose `ModelConfig` reads a small `config.json` written to a
temporary directory the test removes once the scheduler is built, a stand-in architecture registered with vLLM's
`ModelRegistry`, the trace's `KVCacheConfig`) and drives it as the target does
(`vllm_scheduler_drive`): `add_request`; a step is `update_from_output` of the
previous step's output (with the sampled tokens), then the engine's own
`schedule()`, whose queues are checked (never set) to hold the step's requests in
its order, under the batch caps the target built (a trace's budget that does not
bind gives the same step: what each step scheduled is checked); `finish_requests`
for a finish. A `Schedule` is the one-request step a real scheduler runs; a
`Preempt`, which no engine's client can ask, is not exported.

What each step scheduled and the block ids it ships to the worker
(`NewRequestData.block_ids`, `CachedRequestData.new_block_ids`) are compared
with the specification's literals (kvretain's executable model): an admitted
request ships its whole table, a running one its new blocks (None when no group
got one). Before the last step a difference raises the file's `SetupDiverged`
(the trace no longer reaches the finding's state); the last step's values are
the property and are asserted. Only traces that end with a step are exported
this way (`ExportError` otherwise).
"""

from __future__ import annotations

import json

from invariants.export.engine_file import batch_caps_lines
from invariants.export.plan import ExportError, ExportPlan
from invariants.export.pytest_file import (
    _SPECS,
    IDENTITY,
    IDENTITY_IMPORTS,
    _group_spec,
    _wrap,
    exported_test_name,
    has_identity,
    identity_call,
    tokens_literal,
)
from model.contract.config import Config
from model.contract.observation import StepResult
from model.contract.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)
from model.machine.allocator import AllocatorModel

DOC = '''"""Regression test exported by kvretain from a trace on vLLM's real Scheduler.

{what}

Replays {nops} operations (target {target}, seed {seed}) through vLLM's own
Scheduler, built offline on the CPU, and compares what each step scheduled and
the block ids it ships to the worker with the specification's values. A
difference before the last step raises SetupDiverged (the trace no longer
reaches the finding's state: re-derive it); the last step's values are asserted.

Recorded violation: {violation}
"""

import json
import os
import tempfile
from dataclasses import replace

import torch
from torch import nn
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.model_executor.models.registry import ModelRegistry
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
{kinds}
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
'''

CORE = '''
STAND_IN = "KvretainStandInForCausalLM"
NUM_BLOCKS = {num_blocks}
MAX_MODEL_LEN = {max_model_len}
SCHEDULER_BLOCK_SIZE = {sbs}
HASH_BLOCK_SIZE = {hbs}
ENABLE_CACHING = {caching}


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
            {{
                "architectures": [STAND_IN],
                "model_type": "opt",
                "hidden_size": 16,
                "num_attention_heads": 1,
                "num_hidden_layers": 1,
                "ffn_dim": 16,
                "vocab_size": 64,
                "word_embed_proj_dim": 16,
                "max_position_embeddings": MAX_MODEL_LEN,
            }},
            f,
        )
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32"
    )
    cache = CacheConfig(
        block_size=SCHEDULER_BLOCK_SIZE, enable_prefix_caching=ENABLE_CACHING{mamba_mode}
    )
    cache.num_gpu_blocks = NUM_BLOCKS
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
{batch_caps}            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            long_prefill_token_threshold={long_prefill},
            is_encoder_decoder=False,
            watermark=0.0,
            scheduler_reserve_full_isl=False,
        ),
        cache_config=cache,
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
{groups}
        ],
        prefix_cache_retention_interval={retention},
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
    """Steps over named requests; a request's share of a step's output waits for its
    sampled token when it finished its tokens in that step and no token came yet."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.requests: dict[str, Request] = {{}}
        self.pending = None
        self.samples: dict[str, int] = {{}}
        self.held: dict = {{}}

    def make_request(self, rid: str, tokens: list[int]) -> Request:
        hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256) if ENABLE_CACHING else None
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1 << 30),
            pooling_params=None,
            mm_features=None,
            block_hasher=hasher,
        )

    def add(self, rid: str, tokens: list[int]) -> None:
        self.requests[rid] = self.make_request(rid, tokens)
        self.s.add_request(self.requests[rid])

    def step(self, rids: tuple, budget: int):
        """The engine's schedule(): its queues must hold `rids`, in that order (checked, never
        set). `budget`, the trace's, gives the same step as the built one (what each step
        scheduled is checked)."""
        self.flush()
        s = self.s
        held = [r.request_id for q in (s.running, s.kv_holding_waiting, s.waiting) for r in q]
        expect("the requests schedule() starts from", held, list(rids))
        out = s.schedule()
        self.pending = out
        return out

    def sample(self, rid: str, token: int) -> None:
        self.samples[rid] = token
        if not (self.pending is not None and rid in self.pending.num_scheduled_tokens):
            self.deliver(self.held.pop(rid), [rid])

    def flush(self) -> None:
        out, self.pending = self.pending, None
        if out is None:
            return
        now = []
        for rid in out.num_scheduled_tokens:
            r = self.requests.get(rid)
            owes = (
                r is not None
                and rid not in self.samples
                and r.status == RequestStatus.RUNNING
                and r.num_computed_tokens >= r.num_tokens
            )
            if owes:
                self.held[rid] = out
            else:
                now.append(rid)
        self.deliver(out, now)

    def deliver(self, out, rids: list) -> None:
        if not rids:
            return
        scheduled = {{r: out.num_scheduled_tokens[r] for r in rids}}
        share = replace(
            out, num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values())
        )
        sampled = [[self.samples.pop(r)] if r in self.samples else [] for r in rids]
        self.s.update_from_output(
            share,
            ModelRunnerOutput(
                req_ids=rids,
                req_id_to_index={{r: i for i, r in enumerate(rids)}},
                sampled_token_ids=sampled,
            ),
        )

    def settle(self, rid: str) -> None:
        out = self.held.pop(rid, None)
        if out is not None:
            self.deliver(out, [rid])

    def finish(self, rid: str) -> None:
        self.settle(rid)
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        del self.requests[rid]

    def probe(self, tokens: list[int]) -> None:
        self.s.kv_cache_manager.get_computed_blocks(self.make_request("probe", tokens))


def shipped(out) -> dict:
    """Per scheduled request, the block ids the step ships to the worker."""
    ids = {{d.req_id: [list(g) for g in d.block_ids] for d in out.scheduled_new_reqs}}
    cached = out.scheduled_cached_reqs
    for rid, new in zip(cached.req_ids, cached.new_block_ids):
        ids[rid] = None if new is None else [list(g) for g in new]
    return ids


def expect(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise SetupDiverged(f"{{what}}: vLLM gives {{got!r}}, the trace was derived on {{expected!r}}")


def {name}() -> None:
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory(prefix="kvretain-model-") as model_dir:
        driver = Driver(make_scheduler(model_dir))
'''


def render_scheduler_test(plan: ExportPlan) -> str:
    """The pytest file's source for a vllm trace (see the module docstring)."""
    trace = plan.trace
    cfg = trace.config
    ops = [Step((op.rid,), op.budget) if isinstance(op, Schedule) else op for op in trace.ops]
    if not exportable_config(cfg):
        raise ExportError(
            "config: speculative decoding (eagle, num_lookahead_tokens) is not exported for vLLM's real scheduler"
        )
    if not isinstance(ops[-1], Step):
        raise ExportError(
            "trace.ops: a vllm trace is exported when it ends with a step "
            f"(its scheduled tokens and shipped tables are the property); it ends with {type(ops[-1]).__name__}"
        )
    preempt = next((i for i, op in enumerate(ops) if isinstance(op, Preempt)), None)
    if preempt is not None:
        raise ExportError(
            f"trace.ops[{preempt}]: a Preempt, which no client of vLLM's engine can ask (it preempts "
            "under pool pressure); vLLM's real scheduler refuses it"
        )
    mm = next((i for i, op in enumerate(ops) if isinstance(op, AddRequest) and op.mm), None)
    if mm is not None:
        raise ExportError(
            f"trace.ops[{mm}]: multimodal items are exported for the KV cache manager only (vLLM's real "
            "scheduler needs an encoder budget this file cannot state)"
        )
    model = AllocatorModel(cfg)
    body: list[str] = []
    for i, op in enumerate(ops):
        obs = model.apply(op)
        body += _op_lines(op)
        if isinstance(op, Step) and isinstance(obs, StepResult):
            body += _step_checks(i, obs, model, last=i == len(ops) - 1)
    what = (
        f"Known finding {plan.finding.id}: {plan.finding.description}"
        if plan.finding
        else f"The last step breaks {plan.expectation.property}: {plan.message}."
    )
    kinds = sorted({_SPECS[g.kind] for g in cfg.groups} | {"KVCacheConfig", "KVCacheGroupSpec"})
    mamba_modes = {g.mamba_cache_mode for g in cfg.groups if g.kind == "mamba"}
    head = DOC.format(
        what=_wrap(what, "").replace("\\", "\\\\"),
        nops=len(ops),
        target=trace.target,
        seed=trace.seed,
        violation=_wrap(trace.violation or "", "").replace("\\", "\\\\"),
        kinds="\n".join(f"    {k}," for k in kinds),
    )
    core = CORE.format(
        num_blocks=cfg.num_blocks,
        max_model_len=cfg.max_model_len,
        sbs=cfg.scheduler_block_size,
        hbs=cfg.hash_block_size,
        caching=cfg.enable_caching,
        mamba_mode=f", mamba_cache_mode={json.dumps(mamba_modes.pop())}" if mamba_modes else "",
        groups="\n".join(_group_spec(cfg, i) for i in range(len(cfg.groups))),
        retention=cfg.retention_interval,
        long_prefill=cfg.long_prefill_token_threshold,
        batch_caps=batch_caps_lines(cfg),
        name=exported_test_name(plan),
    )
    if has_identity(ops):
        # Requests with identities (salt, adapter): their Request arguments; a plain file is unchanged.
        at = head.index("from vllm.sampling_params")
        head = head[:at] + "\n".join(IDENTITY_IMPORTS) + "\n" + head[at:]
        core = core.replace(_PLAIN_MAKE, _IDENTITY_MAKE).replace(_PLAIN_ADD, _IDENTITY_ADD)
        core = core.replace("\n\ndef make_scheduler", "\n\n" + IDENTITY + "\n\ndef make_scheduler", 1)
    return head + core + "\n".join(f"    {line}" for line in body) + "\n"


_PLAIN_MAKE = """    def make_request(self, rid: str, tokens: list[int]) -> Request:
        hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256) if ENABLE_CACHING else None
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1 << 30),
            pooling_params=None,
            mm_features=None,
            block_hasher=hasher,
        )
"""
_IDENTITY_MAKE = """    def make_request(self, rid: str, tokens: list[int], **identity) -> Request:
        hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256) if ENABLE_CACHING else None
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1 << 30),
            pooling_params=None,
            mm_features=None,
            block_hasher=hasher,
            **identity,
        )
"""
_PLAIN_ADD = """    def add(self, rid: str, tokens: list[int]) -> None:
        self.requests[rid] = self.make_request(rid, tokens)
"""
_IDENTITY_ADD = """    def add(self, rid: str, tokens: list[int], **identity) -> None:
        self.requests[rid] = self.make_request(rid, tokens, **identity)
"""


def _op_lines(op: Op) -> list[str]:
    if isinstance(op, AddRequest):
        ident = identity_call(op)
        extra = f", **{ident}" if ident else ""
        return [f"driver.add({op.rid!r}, {tokens_literal(op.prompt)}{extra})"]
    if isinstance(op, Step):
        return [f"out = driver.step({op.rids!r}, {op.budget})"]
    if isinstance(op, Sample):
        return [f"driver.sample({op.rid!r}, {op.token})"]
    if isinstance(op, Finish):
        return [f"driver.finish({op.rid!r})"]
    if isinstance(op, Probe):
        return [f"driver.probe({tokens_literal(op.tokens)})"]
    if isinstance(op, ResetPrefixCache):
        return ["driver.s.reset_prefix_cache()"]
    if isinstance(op, EvictBlocks):
        return [f"driver.s.kv_cache_manager.evict_blocks({set(op.block_ids)!r})"]
    raise ExportError(f"trace.ops: {type(op).__name__} cannot be exported for vLLM's real scheduler")


def _step_checks(i: int, step: StepResult, model: AllocatorModel, last: bool) -> list[str]:
    """The step's scheduled tokens and shipped block ids, as the specification gives them."""
    tables = model.snapshot().tables
    scheduled = {rid: r.scheduled for rid, r in step.results if r.scheduled}
    ships: dict[str, list[list[int]] | None] = {}
    for rid, r in step.results:
        if not r.scheduled:
            continue
        if r.admitted:
            ships[rid] = [list(g) for g in tables[rid]]
        else:
            new = r.new_blocks or ()
            ships[rid] = [list(g) for g in new] if any(new) else None
    if last:
        return [
            "# The property: what the last step scheduled and ships to the worker.",
            f"assert dict(out.num_scheduled_tokens) == {scheduled!r}",
            f"assert shipped(out) == {ships!r}",
        ]
    return [
        f'expect("op {i}: tokens scheduled", dict(out.num_scheduled_tokens), {scheduled!r})',
        f'expect("op {i}: block ids shipped", shipped(out), {ships!r})',
    ]


def exportable_config(cfg: Config) -> bool:
    """Whether the exported file can build this configuration's scheduler (no drafts)."""
    return not (cfg.eagle or cfg.num_lookahead_tokens)
