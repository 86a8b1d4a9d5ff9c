"""Render an export plan as a standalone pytest file for vLLM's tests/v1/core.

The file imports only vLLM, torch (which vLLM needs for a spec's dtype) and
pytest. It builds the `KVCacheConfig` and `KVCacheManager` the trace used,
drives them with the calls vLLM's scheduler makes (the same calls kvretain's
vLLM target makes: `get_computed_blocks`, `allocate_slots`, `free`,
`take_kv_cache_block_copies`, ...), and ends with one assertion whose expected
value is a literal from the specification. A batched step is written as the
straight-line calls `Scheduler.schedule` makes for it, with the decisions the
specification took (see `plan.StepAction`; a step's chunk sizes, Mamba split
included, are the specification's literals, its hits are asserted against
vLLM's lookup); every `allocate_slots` passes the configuration's
`num_lookahead_tokens`. Mamba prefill chunks are clipped by
vLLM's own `Scheduler._mamba_block_aligned_split`, so a fix in the scheduler's
split shows in the test too.

Setup and property are told apart by the exception. Every value the trace
relies on before the broken property (each `Schedule`'s hit and tokens
scheduled, and its block ids in a `state` export; each step call's hit,
Mamba split and whether it found room) is checked by the file's `expect`,
which raises the file's own `SetupDiverged`; only the property is an `assert`.
Findings run as strict expected failures on `AssertionError`
(docs/findings/conftest.py), so a vLLM change that moves a setup value is a
failure that says "the trace no longer reaches the finding's state:
re-derive the finding", never an expected failure that hides the fix. In the
last step of a `state` or `crash` export the step's own values are the
property (the differential check compares them), so there they are asserted.
"""

from __future__ import annotations

import json
import keyword
import re
import textwrap
from collections.abc import Sequence

from invariants.export.plan import Expectation, ExportPlan, StepAction
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.observation import ScheduleResult
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

_SPECS = {"full": "FullAttentionSpec", "swa": "SlidingWindowSpec", "mamba": "MambaSpec"}


def tokens_literal(tokens: tuple[int, ...]) -> str:
    """A short Python expression for a token list: a range, a repeated pattern, or the list."""
    n = len(tokens)
    if n > 2 and all(tokens[i + 1] - tokens[i] == 1 for i in range(n - 1)):
        return f"list(range({tokens[0]}, {tokens[-1] + 1}))"
    for period in range(1, n // 2 + 1):
        if n % period == 0 and tokens == tokens[:period] * (n // period):
            return f"{list(tokens[:period])} * {n // period}"
    return repr(list(tokens))


def _wrap(text: str, indent: str, width: int = 88) -> str:
    return textwrap.fill(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def exported_test_name(plan: ExportPlan) -> str:
    base = plan.finding.id if plan.finding else f"{plan.expectation.property}_seed{plan.trace.seed}"
    return "test_" + re.sub(r"\W", "_", base).strip("_")


def _var(rid: str, taken: dict[str, str]) -> str:
    if rid in taken:
        return taken[rid]
    name = "req_" + re.sub(r"\W", "_", rid)
    if keyword.iskeyword(name) or name in taken.values():
        name += f"_{len(taken)}"
    taken[rid] = name
    return name


def _group_spec(cfg: Config, i: int) -> str:
    g = cfg.groups[i]
    args = f"block_size={g.block_size}"
    if g.kind == "swa":
        args += f", sliding_window={g.sliding_window}, num_kv_heads=1, head_size=1, dtype=torch.float32"
    elif g.kind == "mamba":
        args += (
            f", shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode={json.dumps(g.mamba_cache_mode)}"
        )
    else:
        args += ", num_kv_heads=1, head_size=1, dtype=torch.float32"
    pad = " " * 12
    return (
        f'{pad}KVCacheGroupSpec(\n{pad}    ["layer{i}"],\n{pad}    {_SPECS[g.kind]}(\n'
        f"{pad}        {args}\n{pad}    ),\n{pad}),"
    )


def _step_lines(
    op: Step, actions: tuple[StepAction, ...], names: dict[str, str], mamba: bool, setup: bool
) -> list[str]:
    """One `Scheduler.schedule` over the step's requests, call by call. `setup`: the
    decisions are checked with `expect` (SetupDiverged); otherwise this is the step
    under test of a differential export and they are asserted (`final=True`)."""
    final = "" if setup else ", final=True"
    lines = [
        f"# One scheduler step over {list(op.rids)}, token budget {op.budget} (Scheduler.schedule:",
        "# running requests first, the newest preempted when an allocation fails, then",
        "# waiting requests admitted in order, only if nobody was preempted).",
        "manager.new_step_starts()",
        "step_new.clear()  # the blocks this step hands out",
    ]
    left = op.budget
    for a in actions:
        var = _var(a.rid, names)
        # With a Mamba group the scheduler's own split must give the same chunk (the only
        # check run_chunk makes, so it takes `final` only then).
        split = f", left={left}, step_budget={op.budget}{final}" if mamba else ""
        if a.fits and a.kind != "preempt":
            left -= a.tokens
        if a.kind == "preempt":
            lines += [f"preempt(manager, {var})  # no room: preempt the newest running request, retry"]
        elif a.kind == "run":
            lines += [
                f"blocks = run_chunk(manager, {var}, {a.tokens}{split})  # running queue first"
                + (": the next chunk" if a.fits else ""),
                _room(f"{a.rid}: room for its next {a.tokens} token(s)", a.fits, setup),
                *(["step_new += blocks"] if a.fits else []),
            ]
        else:
            lines += [
                f"blocks = admit(manager, {var}, expected_hit={a.hit}, num_new_tokens={a.tokens}{split or final})  # waiting, in order",
                # An admission that does not fit ends the waiting pass.
                _room(f"{a.rid}: admitted (room for its first {a.tokens} token(s))", a.fits, setup),
                *(["step_new += blocks"] if a.fits else []),
            ]
    return lines + ["copies = take_copies(manager)  # once per step, as Scheduler.schedule does"]


def _room(what: str, fits: bool, setup: bool) -> str:
    """The check that an allocation found room (or, as the specification says, none)."""
    if setup:
        return f"expect({json.dumps(what)}, blocks is not None, {fits})"
    return f"assert blocks is {'not ' if fits else ''}None, {json.dumps(f'{what}: expected {fits}')}"


def _schedule_checks(res: ScheduleResult, rid: str, ids: bool) -> list[str]:
    """The model's result of a `Schedule` that the rest of the trace relies on."""
    lines = []
    if res.hit is not None:  # a running request does no lookup
        lines.append(f'expect("{rid}: prefix-cache hit", result.num_hit_tokens, {res.hit})')
    lines.append(f'expect("{rid}: tokens scheduled", result.num_scheduled, {res.scheduled})')
    if ids:
        new = None if res.new_blocks is None else [list(g) for g in res.new_blocks]
        lines.append(f'expect("{rid}: new block ids per group", result.new_block_ids, {new!r})')
    return lines


def _op_lines(plan: ExportPlan, i: int, names: dict[str, str], setup: bool = True) -> list[str]:
    """The calls of operation `i`. `setup`: with the checks of the values the rest of
    the trace relies on (`expect`); False for the last operation of a `state` or
    `crash` export, whose values are the property (asserted after it, or inside its step)."""
    op = plan.trace.ops[i]
    if isinstance(op, Step):
        # vLLM splits Mamba chunks only in 'align' mode (Scheduler.need_mamba_block_aligned_split).
        return _step_lines(op, plan.steps.get(i, ()), names, plan.trace.config.has_mamba_align, setup)
    if isinstance(op, AddRequest):
        ident = identity_call(op)
        extra = f", **{ident}" if ident else ""
        return [
            f"{_var(op.rid, names)} = make_request({json.dumps(op.rid)}, {tokens_literal(op.prompt)}{extra})"
        ]
    if isinstance(op, Schedule):
        call = f"schedule_step(manager, {_var(op.rid, names)}, token_budget={op.budget})"
        res = plan.schedules.get(i)
        if not setup or res is None:
            return [call]
        # Block ids are the finding's state only in a state export; elsewhere they may move.
        return [f"result = {call}", *_schedule_checks(res, op.rid, plan.expectation.kind == "state")]
    if isinstance(op, Sample):
        return [f"{_var(op.rid, names)}.append_output_token_ids({op.token})"]
    if isinstance(op, Finish):
        return [f"finish(manager, {_var(op.rid, names)})"]
    if isinstance(op, Preempt):
        return [f"preempt(manager, {_var(op.rid, names)})"]
    if isinstance(op, Probe):
        return [f'manager.get_computed_blocks(make_request("probe", {tokens_literal(op.tokens)}))']
    if isinstance(op, ResetPrefixCache):
        return ["manager.reset_prefix_cache()"]
    if isinstance(op, EvictBlocks):
        return [f"manager.evict_blocks({set(op.block_ids)!r})"]
    raise TypeError(f"unknown operation {op!r}")


def _assertion(
    cfg: Config, exp: Expectation, last: Op, last_lines: list[str], names: dict[str, str]
) -> list[str]:
    """The last step and the assertion of the broken property."""
    if exp.kind == "crash":
        return ["# The allocator raises on this well-formed step:", *last_lines]
    if exp.kind == "copies":
        return _copies_assertion(last_lines)
    if exp.kind == "replay_hit":
        return _replay_hit_assertion(exp, last_lines[0], names)
    if exp.kind == "stored_tokens":
        return _stored_tokens_assertion(cfg, exp, last_lines)
    return _state_assertion(exp, last, last_lines)


def _copies_assertion(last_lines: list[str]) -> list[str]:
    """No copy the last step queued reads a block that step handed out."""
    return [
        *last_lines,
        "# A copy runs before the step's forward pass: its source must hold cached",
        "# state, never a block this step handed out (nothing has written it yet).",
        "same_step = [(src, dst) for src, dst in copies if src in step_new]",
        "assert not same_step, (",
        '    f"copies (source, destination) {same_step}: source was allocated in the same step "',
        '    "(the copy runs before its content is written)"',
        ")",
    ]


def _replay_hit_assertion(exp: Expectation, last_line: str, names: dict[str, str]) -> list[str]:
    """Right after the request finishes, every block its promised replay needs is cached and a
    resend of its prompt hits at least the promised boundary."""
    assert exp.request is not None and exp.hit is not None
    var = names[exp.request]
    needed = [list(n) for n in exp.needed]
    return [
        last_line,
        f"# The replay boundary retention promises for this prompt: {exp.hit} tokens. Each",
        "# [group, tokens before the block's end, role] below must be in the hash map.",
        "needed = [",
        *(f"    {json.dumps(n)}," for n in needed),
        "]",
        "pool = manager.block_pool",
        "missing = [",
        "    (group, num_tokens, role)",
        "    for group, num_tokens, role in needed",
        "    if pool.get_cached_block(",
        f"        {var}.block_hashes[num_tokens // HASH_BLOCK_SIZE - 1], [group]",
        "    )",
        "    is None",
        "]",
        "assert not missing, (",
        f'    f"right after request {exp.request!r} finished, blocks its replay needs for "',
        f'    f"the promised {exp.hit}-token hit are not in the prefix cache: {{missing}}"',
        ")",
        f'replay = make_request("{exp.request}-replay", {var}.prompt_token_ids)',
        "_, num_hit_tokens, _ = manager.get_computed_blocks(replay)",
        f"assert num_hit_tokens >= {exp.hit}, (",
        f'    f"replaying the {len(exp.prompt)}-token prompt of request {exp.request!r} right "',
        f'    f"after it finished hits {{num_hit_tokens}} tokens; retention promised {exp.hit} "',
        '    "(every block the replay needs is cached and nothing was reused since)"',
        ")",
    ]


def _stored_tokens_assertion(cfg: Config, exp: Expectation, last_lines: list[str]) -> list[str]:
    """The BlockStored events of the last step carry, per group, exactly the token ids of the
    blocks that step put in the hash map."""
    lines = ["manager.take_events()  # only this step's events count", *last_lines]
    lines.append("stored = stored_token_ids(manager.take_events())")
    for g, toks in sorted(exp.stored.items()):
        nblocks = len(toks) // cfg.groups[g].block_size
        lines += [
            f"# group {g}: the tokens of the {nblocks} block(s) this step put in the hash map",
            f"expected_{g} = {tokens_literal(toks)}",
            f"assert stored.get({g}, []) == expected_{g}, (",
            f'    f"BlockStored events of group {g} carry {{len(stored.get({g}, []))}} token ids; "',
            f'    f"the blocks stored in group {g} hold {{len(expected_{g})}}: a consumer cannot tell "',
            '    "which tokens a block hash stands for"',
            ")",
        ]
    return lines


def _state_assertion(exp: Expectation, last: Op, last_lines: list[str]) -> list[str]:
    """After the last operation, its hit and new block ids (a Schedule or Probe), then the
    free queue, the ref counts and the cached blocks, equal the specification's."""
    if isinstance(last, Step):  # the state after a batched step (its calls are `last_lines`)
        return [*last_lines, *_state_lines(exp)]
    last_line = last_lines[0]
    lines = [f"result = {last_line}" if isinstance(last, (Schedule, Probe)) else last_line]
    if isinstance(last, Probe) and exp.hit is not None:
        lines += [
            "_, num_hit_tokens, _ = result",
            f'assert num_hit_tokens == {exp.hit}, f"prefix-cache hit {{num_hit_tokens}}, expected {exp.hit}"',
        ]
    if isinstance(last, Schedule):
        if exp.hit is not None:
            lines.append(
                f'assert result.num_hit_tokens == {exp.hit}, f"prefix-cache hit {{result.num_hit_tokens}}, '
                f'expected {exp.hit}"'
            )
        new = None if exp.new_blocks is None else [list(g) for g in exp.new_blocks]
        lines.append(
            f'assert result.new_block_ids == {new!r}, f"new block ids per group {{result.new_block_ids}}"'
        )
    return lines + _state_lines(exp)


def _state_lines(exp: Expectation) -> list[str]:
    return [
        "pool = manager.block_pool",
        "free_queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]",
        f"assert free_queue == {list(exp.free_queue)!r}, (",
        f'    f"free queue (head = reused first) is {{free_queue}}, expected {list(exp.free_queue)}"',
        ")",
        "ref_cnts = [b.ref_cnt for b in pool.blocks[1:]]",
        f'assert ref_cnts == {list(exp.ref_cnt)!r}, f"ref counts of blocks 1.. are {{ref_cnts}}"',
        "cached = cached_blocks(pool)",
        f'assert cached == {[list(c) for c in exp.cached]!r}, f"cached (group, block id) pairs are {{cached}}"',
    ]


DOC = '''"""Regression test for vLLM's prefix-cache allocator (vllm/v1/core).

{what}

{prop_text}

Exported by kvretain from a {nops}-operation trace (target {target}, seed {seed}); kvretain
reported: {violation}
It fails on the vLLM it was found on and passes once the allocator keeps the property.
Only the property is an `assert`: a setup step that no longer gives the value the trace
relies on raises SetupDiverged instead (the trace no longer reaches the finding's state).
Run with: pytest -q THIS_FILE (needs vllm and pytest only).
"""
'''

CONSTS = """HASH_BLOCK_SIZE = {hbs}
SCHEDULER_BLOCK_SIZE = {sbs}
USE_EAGLE = {eagle}
NUM_LOOKAHEAD_TOKENS = {lookahead}
"""

CORE = """def make_kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks={num_blocks},
        kv_cache_tensors=[],
        kv_cache_groups=[
{groups}
        ],
        prefix_cache_retention_interval={retention},
    )


def make_manager() -> KVCacheManager:
    init_none_hash(sha256)
    return KVCacheManager(
        make_kv_cache_config(),
        max_model_len={max_model_len},
        scheduler_block_size=SCHEDULER_BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        enable_caching={caching},
        use_eagle=USE_EAGLE,
        enable_kv_cache_events=True,
    )


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=1 << 30),
        pooling_params=None,
        mm_features=None,
        block_hasher={hasher},
    )
"""

MAMBA = '''def mamba_chunk(request: Request, num_new_tokens: int, num_hit_tokens: int, token_budget: int) -> int:
    """The chunk Scheduler.schedule() computes: its Mamba block-aligned split, run on
    the scheduler settings of this configuration (align mode, no spec tokens)."""
    settings = SimpleNamespace(
        block_size=SCHEDULER_BLOCK_SIZE,
        cache_config=SimpleNamespace(block_size=SCHEDULER_BLOCK_SIZE),
        hash_block_size=HASH_BLOCK_SIZE,
        use_eagle_block_drop=USE_EAGLE,
        num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit={partial},
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,
        max_num_scheduled_tokens=token_budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )
    return Scheduler._mamba_block_aligned_split(settings, request, num_new_tokens, num_hit_tokens)
'''

SCHEDULE = '''def schedule_step(manager: KVCacheManager, request: Request, token_budget: int) -> SimpleNamespace:
    """One scheduler step for one request, as Scheduler.schedule() drives the manager."""
    manager.new_step_starts()
    hit, new_block_ids = None, None
    if request.status == RequestStatus.RUNNING:
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, token_budget)
{mamba_running}        blocks = None
        if n > 0:
            blocks = manager.allocate_slots(request, n, num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS)
        if blocks is not None:
            request.num_computed_tokens += n
            new_block_ids = [list(ids) for ids in blocks.get_block_ids()]
    else:
        computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
        n = min(request.num_tokens - hit, token_budget)
{mamba_waiting}        blocks = None
        if n > 0:
            blocks = manager.allocate_slots(
                request,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=computed,
                num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS,
            )
        if blocks is not None:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit + n
            new_block_ids = [list(ids) for ids in blocks.get_block_ids()]
    # Scheduler.schedule(): drain copy-on-write copies, release their retained blocks.
    _, retained = manager.take_kv_cache_block_copies()
    if retained:
        manager.block_pool.free_blocks(retained)
    num_scheduled = n if blocks is not None else 0
    return SimpleNamespace(num_hit_tokens=hit, num_scheduled=num_scheduled, new_block_ids=new_block_ids)


def finish(manager: KVCacheManager, request: Request) -> None:
    manager.free(request)
    request.status = RequestStatus.FINISHED_STOPPED


def preempt(manager: KVCacheManager, request: Request) -> None:
    """As Scheduler._preempt_request: free the blocks, wait again from token 0."""
    manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1
'''

STEP = '''@RUN_DEF
    """Scheduler.schedule, running queue: allocate a running request's next chunk;
    the ids of the blocks it handed out, or None when there is no room."""
@RUN_SPLIT
    blocks = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS)
    if blocks is None:
        return None
    request.num_computed_tokens += num_new_tokens
    return [b for ids in blocks.get_block_ids() for b in ids if b]


@ADMIT_DEF
    """Scheduler.schedule, waiting queue: the prefix-cache lookup, then the first chunk."""
    computed, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
    expect(f"{request.request_id}: prefix-cache hit", hit, expected_hit@FINAL_ARG)
@ADMIT_SPLIT
    if num_new_tokens <= 0:
        return None
    blocks = manager.allocate_slots(
        request,
        num_new_tokens,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
        num_lookahead_tokens=NUM_LOOKAHEAD_TOKENS,
    )
    if blocks is None:
        return None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = hit + num_new_tokens
    return [b for ids in blocks.get_block_ids() for b in ids if b]


def take_copies(manager: KVCacheManager) -> list[tuple[int, int]]:
    """Scheduler.schedule: drain the copy-on-write copies, release their retained blocks."""
    copies, retained = manager.take_kv_cache_block_copies()
    if retained:
        manager.block_pool.free_blocks(retained)
    return [(c.src_block_id, c.dst_block_id) for c in copies]
'''


def _def(name: str, params: list[str], returns: str, width: int = 110) -> str:
    """A `def` laid out as ruff format lays it out: on one line, else its parameters on
    one indented line, else one parameter a line."""
    one = f"def {name}({', '.join(params)}) -> {returns}:"
    if len(one) <= width:
        return one
    inner = "    " + ", ".join(params)
    if len(inner) <= width:
        return f"def {name}(\n{inner}\n) -> {returns}:"
    return f"def {name}(\n" + "".join(f"    {p},\n" for p in params) + f") -> {returns}:"


def _step_helpers(mamba: bool, final: bool) -> str:
    """The step helpers; with a Mamba group each checks its chunk against the
    scheduler's split of the tokens left in the step's budget. `final`: they take
    the `final` flag of `expect` (a state export whose last operation is a step)."""
    arg = ", final" if final else ""
    split = ["left: int", "step_budget: int"] if mamba else []
    flag = ["final: bool = False"] if final else []
    returns = "list[int] | None"
    # run_chunk checks nothing but the Mamba split: it takes the flag only with one.
    run_params = ["manager: KVCacheManager", "request: Request", "num_new_tokens: int", *split]
    run_def = _def("run_chunk", run_params + (flag if mamba else []), returns)
    admit_params = ["manager: KVCacheManager", "request: Request", "expected_hit: int", "num_new_tokens: int"]
    admit_def = _def("admit", [*admit_params, *split, *flag], returns)
    check = f'    expect(f"{{request.request_id}}: Scheduler\'s Mamba split (tokens)", split, num_new_tokens{arg})\n'
    run = "    split = mamba_chunk(request, min(request.num_tokens - request.num_computed_tokens, left), 0, step_budget)\n"
    adm = "    split = mamba_chunk(request, min(request.num_tokens - hit, left), hit, step_budget)\n"
    return (
        STEP.replace("@RUN_DEF", run_def)
        .replace("@ADMIT_DEF", admit_def)
        .replace("@FINAL_ARG", arg)
        .replace("@RUN_SPLIT\n", run + check if mamba else "")
        .replace("@ADMIT_SPLIT\n", adm + check if mamba else "")
    )


SETUP = '''class SetupDiverged(Exception):
    """A setup step of the trace gave another value than on the vLLM the finding was
    found on: the trace no longer reaches the finding's state, so this test says
    nothing about the finding (re-derive it). Not an AssertionError on purpose: the
    expected failure is the property's assertion at the end, and nothing else."""


def expect(step: str, got: object, expected: object@FINAL_SIG) -> None:
    """A value the rest of the trace relies on: raise SetupDiverged, naming the step
    and both values, unless `got == expected`.@FINAL_DOC"""
@FINAL_BODY    if got != expected:
        raise SetupDiverged(
            f"{step}: got {got!r}, expected {expected!r} "
            "(the trace no longer reaches the finding's state: re-derive the finding)"
        )
'''


def _setup_helpers(final: bool) -> str:
    """`SetupDiverged` and `expect`; `final`: `expect` also asserts the values of the
    step under test (a state export whose last operation is a step)."""
    doc = " With `final=True` the value\n    belongs to the step under test: it is the property, asserted."
    body = (
        "    if final:\n"
        '        assert got == expected, f"{step}: got {got!r}, expected {expected!r}"\n'
        "        return\n"
    )
    return (
        SETUP.replace("@FINAL_SIG", ", final: bool = False" if final else "")
        .replace("@FINAL_DOC", doc if final else "")
        .replace("@FINAL_BODY", body if final else "")
    )


CACHED = '''def cached_blocks(pool) -> list[list[int]]:
    """[kv cache group id, block id] of every block that holds a hash."""
    return sorted(
        [int.from_bytes(b.block_hash[-4:], "big"), b.block_id]
        for b in pool.blocks
        if b.block_hash is not None
    )
'''

STORED = '''def stored_token_ids(events) -> dict[int, list[int]]:
    """Per group, the token ids of every BlockStored event, in order."""
    out: dict[int, list[int]] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            out.setdefault(ev.group_idx, []).extend(ev.token_ids)
    return out
'''

IDENTITY = '''def identity(cache_salt=None, lora=None, mm=()) -> dict:
    """A request's identity as vLLM's Request arguments: the tenant's cache salt, the
    adapter as LoRARequest(name, int id, path), and one MultiModalFeatureSpec per item
    (identifier and placeholder range; no data: the block hasher reads only these)."""
    out: dict = {}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    if lora is not None:
        out["lora_request"] = LoRARequest(lora_name=lora[0], lora_int_id=lora[1], lora_path=lora[2])
    if mm:
        out["mm_features"] = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for ident, offset, length in mm
        ]
    return out
'''

IDENTITY_IMPORTS = (
    "from vllm.lora.request import LoRARequest",
    "from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange",
)


def has_identity(ops: Sequence[Op]) -> bool:
    """Whether a request of the trace carries a salt, an adapter or multimodal items."""
    return any(
        isinstance(op, AddRequest) and (op.salt is not None or op.lora is not None or op.mm) for op in ops
    )


def identity_call(op: AddRequest) -> str:
    """`identity(...)` for `op`'s identity, as a literal call ("" without one)."""
    args = []
    if op.salt is not None:
        args.append(f"cache_salt={op.salt!r}")
    if op.lora is not None:
        args.append(f"lora={tuple(op.lora)!r}")
    if op.mm:
        args.append(f"mm={[tuple(m) for m in op.mm]!r}")
    return f"identity({', '.join(args)})" if args else ""


TEST_DEF = """def {name}():
    manager = make_manager()
"""


def _imports(cfg: Config, exp: Expectation) -> str:
    kinds = sorted({_SPECS[g.kind] for g in cfg.groups} | {"KVCacheConfig", "KVCacheGroupSpec"})
    utils = "get_request_block_hasher, init_none_hash" if cfg.enable_caching else "init_none_hash"
    lines = [
        "from types import SimpleNamespace",
        "",
        "import torch",
        *(["from vllm.distributed.kv_events import BlockStored"] if exp.kind == "stored_tokens" else []),
        "from vllm.sampling_params import SamplingParams",
        "from vllm.utils.hashing import sha256",
        "from vllm.v1.core.kv_cache_manager import KVCacheManager",
        f"from vllm.v1.core.kv_cache_utils import {utils}",
        *(["from vllm.v1.core.sched.scheduler import Scheduler"] if _has_mamba(cfg) else []),
        "from vllm.v1.kv_cache_interface import (",
        *(f"    {k}," for k in kinds),
        ")",
        "from vllm.v1.request import Request, RequestStatus",
    ]
    return "\n".join(lines) + "\n"


_PLAIN_MAKE = """def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=1 << 30),
        pooling_params=None,
        mm_features=None,
"""
_IDENTITY_MAKE = """def make_request(request_id: str, prompt_token_ids: list[int], **identity) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=1 << 30),
        pooling_params=None,
        mm_features=identity.pop("mm_features", None),
        **identity,
"""


def _has_mamba(cfg: Config) -> bool:
    return any(g.kind == "mamba" for g in cfg.groups)


def render_test(plan: ExportPlan) -> str:
    """The pytest file's source (see the module docstring); a vllm trace drives
    vLLM's real `Scheduler` instead (`scheduler_file`; with drafts, a KV connector or
    async scheduling, the recorded calls: `engine_file`)."""
    from invariants.export.engine_file import needs_engine_file, render_engine_test

    if needs_engine_file(plan):
        return render_engine_test(plan)
    if plan.trace.target == "vllm":
        from invariants.export.scheduler_file import render_scheduler_test

        return render_scheduler_test(plan)
    trace, exp = plan.trace, plan.expectation
    cfg = trace.config
    names: dict[str, str] = {}
    body: list[str] = []
    for i in range(len(trace.ops) - 1):
        body += _op_lines(plan, i, names)
    last = len(trace.ops) - 1
    # The last operation's own values are the property of a differential export.
    last_is_property = exp.kind in ("state", "crash")
    last_lines = _op_lines(plan, last, names, setup=not last_is_property)
    body += _assertion(cfg, exp, trace.ops[last], last_lines, names)
    final_step = last_is_property and isinstance(trace.ops[last], Step)
    checks = bool(plan.steps) or any(line.startswith("expect(") for line in body)
    what = (
        f"Known finding {plan.finding.id}: {plan.finding.description}"
        if plan.finding
        else f"After the last step below, the allocator breaks {exp.property}: {plan.message}."
    )
    mamba = _has_mamba(cfg)
    sections = [
        DOC.format(
            what=_wrap(what, "").replace("\\", "\\\\"),
            prop_text=_wrap(f"Property {exp.property}: {exp.guards}", "")
            + "\n"
            + _wrap(f"Asked for by: {exp.asked_by}.", ""),
            nops=len(trace.ops),
            target=trace.target or "?",
            seed=trace.seed,
            violation=_wrap(trace.violation or "", "").replace("\\", "\\\\"),
        ),
        _imports(cfg, exp),
        CONSTS.format(
            hbs=cfg.hash_block_size,
            sbs=cfg.scheduler_block_size,
            eagle=cfg.eagle,
            lookahead=cfg.num_lookahead_tokens,
        ),
        *([_setup_helpers(final_step)] if checks else []),
        CORE.format(
            num_blocks=cfg.num_blocks,
            groups="\n".join(_group_spec(cfg, i) for i in range(len(cfg.groups))),
            retention=cfg.retention_interval,
            max_model_len=cfg.max_model_len,
            caching=cfg.enable_caching,
            hasher="get_request_block_hasher(HASH_BLOCK_SIZE, sha256)" if cfg.enable_caching else "None",
        ),
        # Fine-grained Mamba hits add the prompt-tail stop (`Scheduler.mamba_partial_cache_hit`).
        *([MAMBA.format(partial=fine_hits_enabled(cfg))] if mamba else []),
        SCHEDULE.format(
            mamba_running="        n = mamba_chunk(request, n, 0, token_budget)\n" if mamba else "",
            mamba_waiting="        n = mamba_chunk(request, n, hit, token_budget)\n" if mamba else "",
        ),
        *([_step_helpers(cfg.has_mamba_align, final_step)] if plan.steps else []),
        *([CACHED] if exp.kind == "state" else []),
        *([STORED] if exp.kind == "stored_tokens" else []),
        TEST_DEF.format(name=exported_test_name(plan)),
    ]
    if plan.steps:
        body.insert(0, "step_new: list[int] = []")
    if has_identity(trace.ops):
        # Requests with identities: their Request arguments (the plain file is unchanged).
        sections[1] = _with_identity_imports(sections[1])
        core = next(i for i, text in enumerate(sections) if _PLAIN_MAKE in text)
        sections[core] = sections[core].replace(_PLAIN_MAKE, _IDENTITY_MAKE)
        sections.insert(core + 1, IDENTITY)
    head = sections[0] + "\n" + sections[1] + "\n" + "\n\n".join(sections[2:]).rstrip("\n")
    return head + "\n" + "\n".join(f"    {line}" for line in body) + "\n"


def _with_identity_imports(imports: str) -> str:
    """The import block with LoRARequest and the multimodal feature classes, in order."""
    lines = imports.rstrip("\n").split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("from vllm.sampling_params"))
    return "\n".join(lines[:at] + list(IDENTITY_IMPORTS) + lines[at:]) + "\n"
