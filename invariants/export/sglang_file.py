"""`kvretain export` of an SGLang finding: a standalone pytest file that imports only SGLang.

The file is the source of `sglang_preamble.py` (stand-ins, SGLang's real
cache and pools for the trace's layout, the scheduler-side driving, the
invariants by name), then the trace's layout and ops as literals, then one
test. The test replays the ops on the tree core that broke and asserts the
check that failed first:

- an invariant of the cache's state (SGLang's sanity check, pool
  conservation, slot disjointness, free-list uniqueness, justified refusal,
  locked paths, events replay, LRU eviction order) is asserted after every op;
- a check against the specification (the match rule's hit, the LRU
  eviction's prediction, a finished request's promised hit) is asserted at the
  op that broke it, with the specification's value as a literal computed here
  from kvretain's model; the results of the ops before it are checked with
  `expect`, which raises `SetupDiverged` (not an AssertionError) when the
  history no longer reaches the finding's state;
- a disagreement of the two tree cores replays both and compares each op's
  result and pool accounts;
- SGLang raising (`sglang_raised`) is the op raising again.

`plan_sglang_export` replays the trace with kvretain's checker first and
refuses (ExportError) a trace that records no violation or no longer fails.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.export.plan import ExportError
from invariants.export.pytest_file import tokens_literal
from model.radix.config import RadixLayout
from model.radix.ops import Admit, Evict, Finish, RadixOp, to_json

PREAMBLE_MARK = "# ---- SGLang replay kit (kvretain's invariants/export/sglang_preamble.py, verbatim) ----"
# Checked after every op by the file (state invariants).
STATE_CHECKS = (
    "sglang_sanity_check",
    "radix_hit_same_identity",
    "radix_pool_conservation",
    "radix_slots_disjoint",
    "radix_free_list_unique",
    "radix_refusal_justified",
    "radix_locked_paths_kept",
    "radix_events_replay",
    "radix_eviction_lru",
    "radix_running_prefix_backed",
)
# Checked at the op that broke them, against a literal from the specification.
LITERAL_CHECKS = ("radix_hit_matches_model", "radix_full_eviction_matches_model", "radix_full_promise_kept")
OTHER_CHECKS = ("radixcores_agree", "sglang_raised")


@dataclass
class SglangExport:
    layout: RadixLayout
    ops: list[RadixOp]
    invariant: str
    message: str
    core: str
    seed: int | None
    setup: list[dict[str, Any]] = field(default_factory=list)  # each op's result before the last
    literal: dict[str, Any] = field(default_factory=dict)


def _result(res: Any) -> dict[str, Any]:
    """The part of an op's result that the history's later state depends on."""
    out: dict[str, Any] = {"rejected": res.rejected is not None, "skipped": res.skipped}
    if res.hit is not None:
        out["hit"] = res.hit
    if res.evicted is not None:
        out["evicted"] = list(res.evicted)
    return out


def plan_sglang_export(path: Path) -> SglangExport:
    """Read a radix trace, replay it with kvretain's checker and compute the literals."""
    from invariants.harness.radix_check import RadixChecker
    from invariants.harness.radix_fuzz import read_trace, run_history

    try:
        data = json.loads(path.read_text())
        layout, ops = read_trace(path)
        layout.validate()
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ExportError(f"not a valid radix trace: {exc}") from None
    violation = data.get("violation")
    if not violation or not ops:
        raise ExportError("the trace records no violation: nothing to export")
    name, message = violation["invariant"], violation["message"]
    if name not in STATE_CHECKS + LITERAL_CHECKS + OTHER_CHECKS:
        raise ExportError(f"invariant {name!r} has no SGLang export")
    tag = re.match(r"\[(python|rust)\]", message)
    core = tag.group(1) if tag else "python"
    cores = ("python", "rust") if name == "radixcores_agree" or core == "rust" else ("python",)
    checker = RadixChecker(layout, cores)
    found, done = run_history(checker, ops)
    if found is None or found[0] != name or len(done) != len(ops):
        raise ExportError(
            f"replaying the trace here does not fail {name} at its last op "
            f"(got {found[0] if found else 'no violation'} after {len(done)} of {len(ops)} ops)"
        )
    plan = SglangExport(layout, ops, name, message, core, data.get("seed"))
    if name in LITERAL_CHECKS:
        _literals(plan)
    return plan


def _literals(plan: SglangExport) -> None:
    """Replay once more on the Python core, keeping each result and, at the last op, the
    specification's value for the broken check."""
    from invariants.harness.radix_check import RadixChecker
    from invariants.targets.sglang_snapshot import tree_view
    from model.radix.evict import evict_full
    from model.radix.match import expected_hit

    checker = RadixChecker(plan.layout, ("python",))
    driver = checker.primary
    for op in plan.ops[:-1]:
        plan.setup.append(_result(driver.apply(op)))
    last = plan.ops[-1]
    before = tree_view(driver)
    assert before is not None
    if plan.invariant == "radix_hit_matches_model":
        assert isinstance(last, Admit)
        plan.literal = {"hit": expected_hit(before, last.tokens, plan.layout, len(last.tokens) - 1)}
    elif plan.invariant == "radix_full_eviction_matches_model":
        assert isinstance(last, Evict)
        nodes, tokens = evict_full(before, last.full)
        plan.literal = {"removed": sorted(list(before.prefix(n)) for n in nodes), "evicted": tokens}
    else:
        assert isinstance(last, Finish)
        run = driver.running[last.rid]
        finished = tuple(run.tokens) + tuple(run.decoded)
        want = (len(finished) - 1) // plan.layout.page_size * plan.layout.page_size
        plan.literal = {"tokens": list(finished), "hit": want}


def test_name(plan: SglangExport) -> str:
    seed = "" if plan.seed is None else f"_seed{plan.seed}"
    return f"test_sglang_{plan.invariant}_{plan.layout.name.replace('+', '_').replace('-', '_')}{seed}"


def _layout_literal(layout: RadixLayout) -> str:
    fields = {
        "components": list(layout.components),
        "page_size": layout.page_size,
        "sliding_window": layout.sliding_window,
        "kv_size": layout.kv_size,
        "swa_size": layout.swa_size,
        "mamba_size": layout.mamba_size,
        "max_reqs": layout.max_reqs,
        "max_context": layout.max_context,
    }
    return "LAYOUT = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in fields.items()) + "}\n"


def _op_literal(op: RadixOp) -> str:
    data = to_json(op)
    parts = []
    for key, value in data.items():
        text = tokens_literal(tuple(value)) if isinstance(value, list) else repr(value)
        parts.append(f"{key!r}: {text}")
    return "{" + ", ".join(parts) + "}"


def _body(plan: SglangExport) -> str:
    name = plan.invariant
    if name in STATE_CHECKS:
        evict_only = name == "radix_eviction_lru"
        return (
            f"    replay = Replay(LAYOUT, {plan.core!r})\n"
            "    for op in OPS:\n"
            + (
                "        before = replay.tree() if op['op'] == 'Evict' and op['swa'] == op['mamba'] == 0 else None\n"
                if evict_only
                else "        before = None\n"
            )
            + "        replay.apply(op)\n"
            f"        CHECKS[{name!r}](replay, before=before)\n"
        )
    if name == "sglang_raised":
        return f"    replay = Replay(LAYOUT, {plan.core!r})\n    for op in OPS:\n        replay.apply(op)  # SGLang raised here\n"
    if name == "radixcores_agree":
        return (
            "    cores = {core: Replay(LAYOUT, core) for core in ('python', 'rust')}\n"
            "    for i, op in enumerate(OPS):\n"
            "        results = {core: r.apply(op) for core, r in cores.items()}\n"
            "        assert results['python'] == results['rust'], (i, op['op'], results)\n"
            "        accounts = {core: r.accounts() for core, r in cores.items()}\n"
            "        assert accounts['python'] == accounts['rust'], (i, op['op'], accounts)\n"
        )
    setup = "SETUP = [\n" + "".join(f"    {s!r},\n" for s in plan.setup) + "]\n"
    head = (
        "    replay = Replay(LAYOUT, 'python')\n"
        "    for i, op in enumerate(OPS[:-1]):\n"
        "        res = replay.apply(op)\n"
        "        got = {'rejected': 'rejected' in res, 'skipped': bool(res.get('skipped'))}\n"
        "        got.update({k: list(v) if k == 'evicted' else v for k, v in res.items() if k in ('hit', 'evicted')})\n"
        "        expect(got, SETUP[i], f\"op {i} ({op['op']})\")\n"
    )
    lit = plan.literal
    if name == "radix_hit_matches_model":
        tail = (
            "    hit = replay.apply(OPS[-1]).get('hit')\n"
            f"    assert hit == {lit['hit']}, f\"lookup of {{len(OPS[-1]['tokens'])}} tokens hit {{hit}}, "
            f'the match rule allows {lit["hit"]}"\n'
        )
    elif name == "radix_full_eviction_matches_model":
        tail = (
            "    before = replay.tree()\n"
            "    evicted = replay.apply(OPS[-1])['evicted'][0]\n"
            "    after = replay.tree()\n"
            "    removed = sorted(list(k) for k, n in before.items() if n['id'] not in {m['id'] for m in after.values()})\n"
            f"    assert (removed, evicted) == ({lit['removed']!r}, {lit['evicted']}), 'LRU over unlocked leaves'\n"
        )
    else:
        tail = (
            f"    tokens = tuple({tokens_literal(tuple(lit['tokens']))})\n"
            "    replay.apply(OPS[-1])\n"
            "    got = full_hit(replay, tokens, len(tokens) - 1)\n"
            f"    assert got >= {lit['hit']}, f'after finish, replaying its tokens hits {{got}} < {lit['hit']}'\n"
        )
    return setup + "\n\n" + f"def {test_name(plan)}() -> None:\n" + head + tail


def render_sglang_test(plan: SglangExport) -> str:
    """The standalone pytest file's source."""
    preamble = (Path(__file__).with_name("sglang_preamble.py")).read_text()
    header = (
        f'"""SGLang regression test exported by kvretain from a finding: {plan.invariant}.\n\n'
        f"Layout {plan.layout.name} ({', '.join(plan.layout.components)}; page {plan.layout.page_size}"
        f"{'' if plan.layout.sliding_window is None else f', window {plan.layout.sliding_window}'}), "
        f"tree core {plan.core}, seed {plan.seed}; {len(plan.ops)} scheduler ops.\n"
        f"kvretain saw: {plan.message[:300]}\n\n"
        "Imports only SGLang, torch and the standard library. Run: pytest THIS_FILE\n"
        '"""\n\n'
    )
    body = _body(plan)
    ops = "OPS = [\n" + "".join(f"    {_op_literal(op)},\n" for op in plan.ops) + "]\n"
    test = body if plan.invariant in LITERAL_CHECKS else f"def {test_name(plan)}() -> None:\n" + body
    return (
        header
        + PREAMBLE_MARK
        + "\n"
        + _strip_docstring(preamble)
        + "\n\n# ---- the finding ----\n\n"
        + _layout_literal(plan.layout)
        + "\n"
        + ops
        + "\n\n"
        + test
    )


def _strip_docstring(source: str) -> str:
    """The preamble without its module docstring (the file has its own)."""
    if source.startswith('"""'):
        end = source.index('"""', 3) + 3
        return source[end:].lstrip("\n")
    return source
