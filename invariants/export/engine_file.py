"""Render a trace of vLLM's real scheduler (drafts, async scheduling, KV connectors) as a
standalone pytest file.

The file imports only vLLM, torch, pytest and the standard library. It builds the
`Scheduler` (or `AsyncScheduler`) kvretain's target built (`vllm_scheduler_build`: a
stand-in model, the trace's `KVCacheConfig`, a `SpeculativeConfig` with the trace's
draft tokens, and a minimal scheduler-side KV connector written into the file), and
drives it with exactly the calls the target made on the trace (`engine_record`), as
straight-line code: `add_request`; the connector's script (what it offers a request
at its lookup, whether it defers a finished request's free for a save); each step, the
engine's own `schedule()` (the queues it starts from and the budget it was built with
checked against the recorded ones, never written); `update_from_output` with the step
output's share and a synthetic `ModelRunnerOutput` (sampled tokens; the worker's
`KVConnectorOutput`: finished and failed loads, failed blocks, finished saves);
`update_draft_token_ids`; `finish_requests`.

Setup and property are told apart as in `pytest_file`: every step before the property
checks the tokens it scheduled against the values recorded on the vLLM the finding was
derived on, raising the file's `SetupDiverged`; only the property is an `assert`
(`PROPERTIES`: one per invariant, its values read from the recorded violation).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from invariants.export.engine_record import Call, Recording, record_calls
from invariants.export.plan import ExportError, ExportPlan
from invariants.export.pytest_file import _SPECS, _wrap, exported_test_name, has_identity, tokens_literal
from invariants.targets.vllm_scheduler_build import MAX_NUM_SEQS
from model.contract.config import Config
from model.policy.scheduling import build_budget, seq_cap

DOC = '''"""Regression test exported by kvretain from a trace on vLLM's real {cls}.

{what}

How the steps are driven: this file makes exactly the calls kvretain's "{target}"
target made on vLLM {version} when it found this (seed {seed}), as straight-line code.
Each schedule() is the engine's own: nothing of the scheduler is written, and the
queues it starts from and its built budget are checked against the recorded ones;
the model runner is a synthetic ModelRunnerOutput handed to
update_from_output (the sampled tokens{connector_words}).{drafts_words} Each step's
scheduled tokens are checked against the values recorded then: a difference raises
SetupDiverged (the trace no longer reaches the finding's state: re-derive it). Only
the final check is the property.

Recorded violation: {violation}
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
{config_imports}
)
from vllm.model_executor.models.registry import ModelRegistry
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.{sched_module} import {cls}
from vllm.v1.kv_cache_interface import (
{kinds}
)
from vllm.v1.outputs import {output_imports}
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
{connector_imports}'''

CONNECTOR = '''

class FakeConnector(KVConnectorBase_V1, SupportsHMA):
    """A minimal scheduler-side KV connector, scripted by the test: `offer(rid, n, async_load)`
    offers the first n tokens of rid past its local hit at its next lookup (never its last
    token); `save(rid)` makes rid's finish defer its free (delay_free_blocks=True) as a
    saving connector does. Loads and saves are reported by the worker's KVConnectorOutput,
    passed to update_from_output below. No worker side."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict = {{}}
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
'''

CORE = '''
STAND_IN = "KvretainStandInForCausalLM"
NUM_BLOCKS = {num_blocks}
MAX_MODEL_LEN = {max_model_len}
SCHEDULER_BLOCK_SIZE = {sbs}
HASH_BLOCK_SIZE = {hbs}
ENABLE_CACHING = {caching}
NUM_SPECULATIVE_TOKENS = {drafts}


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
{connector}

def make_scheduler(model_dir: str) -> {cls}:
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
    parallel = ParallelConfig()
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
{batch_caps}            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            long_prefill_token_threshold={long_prefill},
            is_encoder_decoder=False,
            watermark={watermark},
            scheduler_reserve_full_isl={reserve_full_isl},{policy}
            async_scheduling={async_scheduling},
        ),
        cache_config=cache,
        parallel_config=parallel,
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),{spec}{transfer}
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
{groups}
        ],
        prefix_cache_retention_interval={retention},
    )
    return {cls}(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=SCHEDULER_BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        log_stats=False,
    )


class Driver:
    """The calls of the trace, by request name."""

    def __init__(self, scheduler: {cls}) -> None:
        self.s = scheduler
        self.requests: dict = {{}}
        self.tables: dict = {{}}  # the block table the worker holds per request, from the outputs

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
            scheduled_spec_decode_tokens={{
                r: t for r, t in out.scheduled_spec_decode_tokens.items() if r in scheduled
            }},
        )
        rids = list(sampled)
        self.s.update_from_output(
            share,
            ModelRunnerOutput(
                req_ids=rids,
                req_id_to_index={{r: i for i, r in enumerate(rids)}},
                sampled_token_ids=[list(sampled[r]) for r in rids],
                kv_connector_output=connector,
            ),
        )

    def finish(self, rid: str) -> None:
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def expect(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise SetupDiverged(f"{{what}}: vLLM gives {{got!r}}, the trace was derived on {{expected!r}}")


def {name}() -> None:
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory(prefix="kvretain-model-") as model_dir:
        driver = Driver(make_scheduler(model_dir))
'''

_SPEC = """
        speculative_config=SpeculativeConfig(
            method="{method}",
            model=model.model,
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
            target_model_config=model,
            target_parallel_config=parallel,
            disable_lookahead_block_hashes={no_lookahead_hashes},
        ),"""

_TRANSFER = """
        kv_transfer_config=KVTransferConfig(
            kv_connector="FakeConnector",
            kv_connector_module_path=connector_module(),
            kv_role="kv_both",
            kv_load_failure_policy="{policy}",
        ),"""


def needs_engine_file(plan: ExportPlan) -> bool:
    """A real scheduler's trace the plain scheduler file cannot state: drafts, a KV
    connector, or async scheduling."""
    cfg, target = plan.trace.config, plan.trace.target or ""
    real = target.startswith("vllm") and target != "vllm-manager"
    return real and (bool(cfg.eagle or cfg.num_lookahead_tokens) or cfg.kv_connector or "async" in target)


def render_engine_test(plan: ExportPlan, rec: Recording | None = None) -> str:
    """The pytest file's source (see the module docstring); `rec`: the recorded calls
    (recorded here when None)."""
    if has_identity(plan.trace.ops):
        raise ExportError(
            "trace.ops: a request identity (cache salt, LoRA, multimodal items) is exported for the KV cache "
            "manager and the plain scheduler file, not yet with drafts, a KV connector or async scheduling"
        )
    rec = rec if rec is not None else record_calls(plan.trace)
    body, _ = _body(rec, plan)
    cls = "AsyncScheduler" if rec.async_scheduler else "Scheduler"
    return (
        _head(plan, rec, cls)
        + _core(plan, rec, cls)
        + "\n".join(f"    {line}" if line else "" for line in body)
        + "\n"
    )


def _head(plan: ExportPlan, rec: Recording, cls: str) -> str:
    """The file's docstring (what it found, how the steps are driven) and its imports:
    the config classes, KV cache specs and outputs the trace's configuration uses."""
    trace = plan.trace
    cfg = trace.config
    kinds = sorted({_SPECS[g.kind] for g in cfg.groups} | {"KVCacheConfig", "KVCacheGroupSpec"})
    config_imports = ["CacheConfig", "DeviceConfig", "KVEventsConfig", "ModelConfig", "ParallelConfig"]
    config_imports += ["SchedulerConfig", "VllmConfig"]
    if cfg.num_lookahead_tokens:
        config_imports.append("SpeculativeConfig")
    if cfg.kv_connector:
        config_imports.append("KVTransferConfig")
    what = (
        f"Known finding {plan.finding.id}: {plan.finding.description}"
        if plan.finding
        else f"The trace breaks {plan.expectation.property}: {plan.message}."
    )
    return DOC.format(
        cls=cls,
        what=_wrap(what, "").replace("\\", "\\\\"),
        target=trace.target,
        version=rec.version,
        seed=trace.seed,
        connector_words=(
            "; the worker's KVConnectorOutput: finished and failed loads, failed blocks, finished saves"
            if cfg.kv_connector
            else ""
        ),
        drafts_words=(
            " The drafter's proposals go to update_draft_token_ids." if cfg.num_lookahead_tokens else ""
        ),
        violation=_wrap(trace.violation or "", "").replace("\\", "\\\\"),
        config_imports="\n".join(f"    {k}," for k in sorted(config_imports)),
        sched_module="async_scheduler" if rec.async_scheduler else "scheduler",
        kinds="\n".join(f"    {k}," for k in kinds),
        output_imports=", ".join(
            [
                *(["DraftTokenIds"] if cfg.num_lookahead_tokens else []),
                *(["KVConnectorOutput"] if cfg.kv_connector else []),
            ]
            + ["ModelRunnerOutput"]
        ),
        connector_imports=(
            "from vllm.distributed.kv_transfer.kv_connector.v1.base import (\n"
            "    KVConnectorBase_V1,\n    KVConnectorMetadata,\n    SupportsHMA,\n)\n"
            if cfg.kv_connector
            else ""
        ),
    )


def batch_caps_lines(cfg: Config) -> str:
    """The scheduler's batch caps as the target built them (`vllm_scheduler_build`): the
    engine's budget binds in the exported steps as it did in the recorded ones."""
    tokens, seqs = build_budget(cfg), min(MAX_NUM_SEQS, seq_cap(cfg))
    lines = [f"max_num_seqs={seqs}", f"max_num_batched_tokens={tokens}"]
    if cfg.num_lookahead_tokens and not cfg.eagle:  # a draft model's drafting slot per request
        lines = [
            f"max_num_seqs={seqs}",
            f"max_num_batched_tokens={tokens + seqs}",
            f"max_num_scheduled_tokens={tokens}",
        ]
    return "".join(f"            {line},\n" for line in lines)


def _core(plan: ExportPlan, rec: Recording, cls: str) -> str:
    """The fixed part of the file, set to the trace's configuration: the settings, the
    fake connector, the scheduler built as the target built it, the driver, and the
    test function's header."""
    cfg = plan.trace.config
    mamba_modes = {g.mamba_cache_mode for g in cfg.groups if g.kind == "mamba"}
    return CORE.format(
        num_blocks=cfg.num_blocks,
        max_model_len=cfg.max_model_len,
        sbs=cfg.scheduler_block_size,
        hbs=cfg.hash_block_size,
        caching=cfg.enable_caching,
        drafts=cfg.num_lookahead_tokens,
        connector=CONNECTOR.format() if cfg.kv_connector else "",
        cls=cls,
        mamba_mode=f', mamba_cache_mode="{mamba_modes.pop()}"' if mamba_modes else "",
        long_prefill=cfg.long_prefill_token_threshold,
        batch_caps=batch_caps_lines(cfg),
        async_scheduling=rec.async_scheduler,
        spec=(
            _SPEC.format(
                method="eagle" if cfg.eagle else "draft_model",
                no_lookahead_hashes=not getattr(cfg, "lookahead_block_hashes", False),
            )
            if cfg.num_lookahead_tokens
            else ""
        ),
        watermark=getattr(cfg, "watermark", 0.0),
        reserve_full_isl=getattr(cfg, "reserve_full_isl", False),
        policy=(
            f'\n            policy="{cfg.scheduling_policy}",'
            if getattr(cfg, "scheduling_policy", "fcfs") != "fcfs"
            else ""
        ),
        transfer=_TRANSFER.format(policy=cfg.kv_load_failure_policy) if cfg.kv_connector else "",
        groups="\n".join(_group_spec(cfg, i) for i in range(len(cfg.groups))),
        retention=cfg.retention_interval,
        name=exported_test_name(plan),
    )


def _group_spec(cfg: Config, i: int) -> str:
    g = cfg.groups[i]
    args = f"block_size={g.block_size}"
    if g.kind == "swa":
        args += f", sliding_window={g.sliding_window}, num_kv_heads=1, head_size=1, dtype=torch.float32"
    elif g.kind == "mamba":
        args += f', shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="{g.mamba_cache_mode}"'
        if cfg.num_lookahead_tokens:
            args += ", num_speculative_blocks=NUM_SPECULATIVE_TOKENS"
    else:
        args += ", num_kv_heads=1, head_size=1, dtype=torch.float32"
    pad = " " * 12
    return (
        f'{pad}KVCacheGroupSpec(\n{pad}    ["layer{i}"],\n{pad}    {_SPECS[g.kind]}(\n'
        f"{pad}        {args}\n{pad}    ),\n{pad}),"
    )


def _call_lines(c: Call, outs: dict[int, str]) -> list[str]:
    if c.kind == "add":
        return [f"driver.add({c.rid!r}, {tokens_literal(c.tokens)})"]
    if c.kind == "offer":
        return [f"driver.s.connector.offer({c.rid!r}, {c.num}, async_load={c.flag})"]
    if c.kind == "save":
        return [f"driver.s.connector.save({c.rid!r})"]
    if c.kind == "step":
        running, holding, waiting = (list(q) for q in c.queues)
        out = outs.setdefault(c.index, f"out{c.index}")
        return [f"{out} = driver.step({running!r}, {holding!r}, {waiting!r}, budget={c.num})"]
    if c.kind == "update":
        sampled = {r: list(t) for r, t in c.sampled}
        args = f"{outs[c.index]}, {c.scheduled!r}, total={c.num}, sampled={sampled!r}"
        if c.connector is None:
            return [f"driver.update({args})"]
        fields = ", ".join(f"{k}={set(v)!r}" for k, v in c.connector.items() if v)
        return [f"driver.update({args}, connector=KVConnectorOutput({fields}))"]
    if c.kind == "finish":
        return [f"driver.finish({c.rid!r})"]
    if c.kind == "drafts":
        rids = [r for r, _ in c.sampled]
        drafts = [list(t) for _, t in c.sampled]
        return [f"driver.s.update_draft_token_ids(DraftTokenIds({rids!r}, {drafts!r}))"]
    if c.kind == "reset":
        return ["driver.s.reset_prefix_cache()"]
    raise ExportError(f"a recorded {c.kind} call cannot be written out")


def _body(rec: Recording, plan: ExportPlan) -> tuple[list[str], dict[int, str]]:
    """The test's body: the recorded calls, op by op; the property after the last."""
    ops = [i for i, c in enumerate(rec.calls) if c.kind == "op"]
    last_op = ops[-1]
    outs: dict[int, str] = {}
    body: list[str] = []
    for k, c in enumerate(rec.calls):
        if c.kind == "op":
            body.append(f"# op {c.index}: {_op_words(c)}")
            continue
        if k > last_op:
            break
        body += _call_lines(c, outs)
        if c.kind == "step" and not c.raised:
            got = f"dict({outs[c.index]}.num_scheduled_tokens)"
            body.append(f'expect("op {_op_of(rec, k)}: tokens scheduled", {got}, {c.scheduled!r})')
    tail = [_call_lines(c, outs) for c in rec.calls[last_op + 1 :]]
    body += ["# The property:", *_property(rec, plan, [line for lines in tail for line in lines], outs)]
    return body, outs


def _op_of(rec: Recording, k: int) -> int:
    return next(c.index for c in reversed(rec.calls[:k]) if c.kind == "op")


def _op_words(c: Call) -> str:
    from model.contract.ops import op_to_json

    d = op_to_json(c.op)  # type: ignore[arg-type]
    if "prompt" in d:
        d["prompt"] = f"{len(d['prompt'])} tokens"
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _last_step(calls: list[str]) -> str:
    for line in reversed(calls):
        m = re.match(r"(out\d+) = driver\.step", line)
        if m:
            return m.group(1)
    raise ExportError("the property reads the last step's output, and the last operation ran no step")


def _property(rec: Recording, plan: ExportPlan, calls: list[str], outs: dict[int, str]) -> list[str]:
    """The last operation's calls and the property's assertion (see the module docstring):
    a call that raised is asserted not to raise; otherwise the first of `PROPERTIES`
    whose invariant and message match the recorded violation writes the assertion."""
    prop, msg = plan.expectation.property, plan.message
    if prop == "crash" and any(c.raised for c in rec.calls):
        lines = ["try:", *(f"    {line}" for line in calls), "except Exception as exc:"]
        lines += [
            "    raise AssertionError(",
            '        f"the scheduler raised on a well-formed call: {type(exc).__name__}: {exc}"',
            "    ) from exc",
        ]
        return lines
    for props, pattern, render in PROPERTIES:
        m = re.search(pattern, msg)
        if prop in props and m:
            return [*calls, *render(m, calls, rec, plan)]
    raise ExportError(f"trace.violation: no property assertion for the real scheduler's {prop}: {msg[:80]}")


Match = re.Match[str]


def _freed_while_saving(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid = m.group(1)
    return [
        f"assert {rid!r} in driver.s.requests, (",
        f'    "{rid} was freed at its load\'s report while its save is in flight: "',
        '    "the save\'s report will find no request (assert req_id in self.requests)"',
        ")",
    ]


def _placeholders_kept(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid = m.group(1)
    return [
        f"placeholders = driver.requests[{rid!r}].num_output_placeholders",
        "assert placeholders == 0, (",
        f'    f"{rid} keeps {{placeholders}} output placeholder(s) after the failed blocks cut it: "',
        '    "its step output is skipped, nothing consumes them"',
        ")",
    ]


def _admission_refused(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid, need, free = m.groups()
    return [
        f"held = [len(ids) for ids in driver.s.kv_cache_manager.get_block_ids({rid!r})]",
        f'assert any(held), "{rid} needs {need} blocks and is refused by an idle pool of {free}"',
    ]


def _reads_unwritten(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    hit, reader, _, group, block, index = m.groups()
    out = _last_step(calls)
    size = plan.trace.config.groups[int(group)].block_size
    bound = int(index) * size
    if reader is None:
        reader = _reader_with_hit(rec, int(hit))
    return [
        f"start = driver.requests[{reader!r}].num_computed_tokens - {out}.num_scheduled_tokens[{reader!r}]",
        f"assert start <= {bound}, (",
        f'    f"{reader} resumes at {{start}}, reading block {block} (tokens [{bound}, {bound + size}) of group {group}): "',
        '    "a load failed on it and no step has written it since"',
        ")",
    ]


def _window_reads_null(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid, group, index = m.groups()
    return [
        f"table = driver.s.kv_cache_manager.get_block_ids({rid!r})[{group}]",
        "null = driver.s.kv_cache_manager.block_pool.null_block.block_id",
        f"assert table[{index}] != null, (",
        f'    f"{rid}\'s step reads block index {index} of group {group} through its window: it is the null block"',
        ")",
    ]


def _state_into_null(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid, col, group = m.groups()
    return [
        f"table = driver.tables[{rid!r}][{group}]",
        "null = driver.s.kv_cache_manager.block_pool.null_block.block_id",
        f"assert table[{col}] != null, (",
        f'    f"{rid} writes its Mamba state into column {col} of its worker table (group {group}): "',
        '    f"the null block (table {table})"',
        ")",
    ]


def _watermark_taken(m: Match, calls: list[str], rec: Recording, plan: ExportPlan) -> list[str]:
    rid, external = m.group(1), m.group(2)
    return [
        "free = driver.s.kv_cache_manager.block_pool.get_num_free_blocks()",
        "watermark = driver.s.kv_cache_manager.watermark_blocks",
        "assert free >= watermark, (",
        f'    f"the admission of {rid} ({external} external tokens), made while a request ran, "',
        '    f"left {free} free block(s), below the watermark\'s {watermark}"',
        ")",
    ]


_READS = r"(?:hit (\d+) reads|(\S+) computes tokens \[(\d+), \d+\) reading)"
# One per invariant: (the invariants it answers, the recorded message's pattern, the
# assertion's lines, written after the last operation's calls).
PROPERTIES: tuple[
    tuple[frozenset[str], str, Callable[[Match, list[str], Recording, ExportPlan], list[str]]], ...
] = (
    (
        frozenset({"crash"}),
        r"freed (\S+)'s blocks at its load's report while its save is in flight",
        _freed_while_saving,
    ),
    (frozenset({"crash"}), r"kept (\S+)'s (\d+) output placeholder", _placeholders_kept),
    (
        frozenset({"fitting_request_admitted"}),
        r"admission of (\S+) \((\d+) blocks\) refused by an idle pool of (\d+)",
        _admission_refused,
    ),
    (
        frozenset({"hit_serves_written_kv", "step_reads_written_kv"}),
        _READS + r" group (\d+) block (\d+) \(index (\d+)\)",
        _reads_unwritten,
    ),
    (
        frozenset({"step_blocks_stay_held"}),
        r"(\S+) computes tokens \[\d+, \d+\) but group (\d+) block index (\d+) is the null block",
        _window_reads_null,
    ),
    (
        frozenset({"admission_keeps_watermark"}),
        r"admission of (\S+) \((\d+) external tokens\) while a request ran left",
        _watermark_taken,
    ),
    (
        frozenset({"mamba_state_in_worker_table"}),
        r"(\S+) writes its state into column (\d+) of its worker table \(group (\d+)\)",
        _state_into_null,
    ),
)


def _reader_with_hit(rec: Recording, hit: int) -> str:
    """The request of the last step whose admission hit is `hit` (its only request if one)."""
    step = next(c for c in reversed(rec.calls) if c.kind == "step")
    named = [r for q in step.queues for r in q]
    if len(named) == 1:
        return named[0]
    raise ExportError(f"the last step admits several requests; which one hit {hit} tokens is not recorded")
