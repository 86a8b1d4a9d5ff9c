"""The operation vocabulary: what a scheduler asks of a KV-cache allocator.

Every target (the model, `reference_impl`, vLLM) is driven by the same operations; a
trace is a list of them. Each is one scheduler step (`new_step_starts()` first).

- `AddRequest(rid, prompt, salt, lora, mm)`: a request arrives and waits; its identity
  (`model.contract.extra_keys`) keys its blocks' hashes.
- `Schedule(rid, budget)`: one request's step: admission (lookup, then `allocate_slots`
  for the hit and the first chunk) or its next chunk, at most `budget` new tokens.
- `Step(rids, budget)`: one `Scheduler.schedule` over a batch in priority order under
  one token budget: running requests first (a failed allocation preempts the last
  running one), then admissions (the first failed one ends them).
- `Sample(rid, token, accepted, drafts)`: the step computed every known token of `rid`
  and sampled `token`: the accepted drafts and `token` are appended, rejected drafts
  rolled back, `drafts` kept for the next step (`model.policy.spec_decode`; one step
  late under `model.machine.async_scheduling`).
- `Finish(rid)` frees all its blocks; `Preempt(rid)` frees them and the request waits
  again with its tokens.
- `Probe(tokens)`: a pure lookup. `ResetPrefixCache()`: drop every cached hash if no
  block is in use. `EvictBlocks(ids)`: drop those blocks' hashes, nothing else.
- A KV connector's (`model.machine.connector`): `Offer(rid, n, load)` holds the first
  `n` tokens for the next admission ("sync" or "async"); `Loaded(rid, ok, invalid)` an
  async load reports (or a sync load's step output names failed blocks); `Save(rid)`
  defers the free to a save, `Saved(rid)` reports it.

Each operation's full contract: docs/semantics.md, "Operations".
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Union

from model.contract.extra_keys import Identity, MMItem, keyed, validate


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt: tuple[int, ...]
    # The request's identity (`model.contract.extra_keys`); at their defaults they are left out of JSON.
    salt: str | None = None
    lora: tuple[str, int, str] | None = None  # (name, int id, path)
    mm: tuple[tuple[str, int, int], ...] = ()  # (identifier, offset, length), sorted, disjoint

    def identity(self) -> Identity:
        return Identity(self.salt, self.lora, tuple(MMItem(*m) for m in self.mm))

    def tokens(self) -> tuple[int, ...]:
        """The prompt carrying the identity (`model.contract.extra_keys.Keyed`; plain without one)."""
        return keyed(self.prompt, self.identity())


@dataclass(frozen=True)
class Schedule:
    rid: str
    budget: int


@dataclass(frozen=True)
class Step:
    rids: tuple[str, ...]
    budget: int


@dataclass(frozen=True)
class Sample:
    rid: str
    token: int
    # Speculative decoding (`model.policy.spec_decode`); at their defaults they are left out of JSON.
    accepted: int = 0
    drafts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finish:
    rid: str


@dataclass(frozen=True)
class Preempt:
    rid: str


@dataclass(frozen=True)
class Probe:
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class EvictBlocks:
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Offer:
    rid: str
    num_tokens: int
    load: str  # "sync" | "async"


@dataclass(frozen=True)
class Loaded:
    rid: str
    ok: bool
    # Blocks the load failed on (vLLM `invalid_block_ids`); empty: none (left out of JSON).
    invalid: tuple[int, ...] = ()


@dataclass(frozen=True)
class Save:
    rid: str


@dataclass(frozen=True)
class Saved:
    rid: str


Op = Union[
    AddRequest,
    Schedule,
    Step,
    Sample,
    Finish,
    Preempt,
    Probe,
    ResetPrefixCache,
    EvictBlocks,
    Offer,
    Loaded,
    Save,
    Saved,
]

# How a connector's offered tokens are loaded (`Offer.load`).
LOAD_MODES = ("sync", "async")

OP_TYPES: dict[str, type] = {
    "add": AddRequest,
    "schedule": Schedule,
    "step": Step,
    "sample": Sample,
    "finish": Finish,
    "preempt": Preempt,
    "probe": Probe,
    "reset": ResetPrefixCache,
    "evict": EvictBlocks,
    "offer": Offer,
    "loaded": Loaded,
    "save": Save,
    "saved": Saved,
}
_OP_NAMES = {cls: name for name, cls in OP_TYPES.items()}


def op_to_json(op: Op) -> dict[str, Any]:
    """A JSON-ready dict: {"op": name, **fields}; tuples become lists."""
    out: dict[str, Any] = {"op": _OP_NAMES[type(op)]}
    defaults = _defaults(type(op))
    for key, value in vars(op).items():
        if key in defaults and value == defaults[key]:
            continue  # an optional field at its default: traces without it stay as they were
        out[key] = _json_value(value)
    return out


def _json_value(value: Any) -> Any:
    """Tuples (nested too: an add's multimodal items) become lists."""
    return [_json_value(v) for v in value] if isinstance(value, tuple) else value


def _defaults(cls: type) -> dict[str, Any]:
    """The optional fields of an operation and their defaults."""
    return {f.name: f.default for f in dataclass_fields(cls) if f.default is not MISSING}


def op_from_json(data: Any) -> Op:
    """Inverse of `op_to_json`; raises ValueError naming what is malformed."""
    if not isinstance(data, dict) or "op" not in data:
        raise ValueError(f"operation must be an object with an 'op' field, got {data!r}")
    name = data["op"]
    cls = OP_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown operation {name!r} (expected one of {sorted(OP_TYPES)})")
    fields = {k: v for k, v in data.items() if k != "op"}
    expected = {f.name for f in dataclass_fields(cls)}
    required = expected - set(_defaults(cls))
    if not required <= set(fields) <= expected:
        optional = f" (optional: {sorted(expected - required)})" if expected != required else ""
        raise ValueError(
            f"operation {name!r} needs fields {sorted(required)}{optional}, got {sorted(fields)}"
        )
    for key in ("prompt", "tokens", "block_ids", "drafts", "invalid"):
        if key in fields:
            value = fields[key]
            if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value
            ):
                raise ValueError(f"operation {name!r}: field {key!r} must be a list of integers")
            fields[key] = tuple(value)
    for key in ("budget", "token", "accepted"):
        if key in fields and (not isinstance(fields[key], int) or isinstance(fields[key], bool)):
            raise ValueError(f"operation {name!r}: field {key!r} must be an integer")
    if fields.get("accepted", 0) < 0:
        raise ValueError(f"operation {name!r}: field 'accepted' must be >= 0")
    if "budget" in fields and fields["budget"] < 1:
        raise ValueError(f"operation {name!r}: field 'budget' must be >= 1")
    if "rids" in fields:
        rids = fields["rids"]
        if not isinstance(rids, list) or not rids or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"operation {name!r}: field 'rids' must be a non-empty list of strings")
        if len(set(rids)) != len(rids):
            raise ValueError(f"operation {name!r}: field 'rids' names a request twice")
        fields["rids"] = tuple(rids)
    if "num_tokens" in fields and (
        not isinstance(fields["num_tokens"], int)
        or isinstance(fields["num_tokens"], bool)
        or fields["num_tokens"] < 1
    ):
        raise ValueError(f"operation {name!r}: field 'num_tokens' must be an integer >= 1")
    if "load" in fields and fields["load"] not in LOAD_MODES:
        raise ValueError(f"operation {name!r}: field 'load' must be one of {list(LOAD_MODES)}")
    if "ok" in fields and not isinstance(fields["ok"], bool):
        raise ValueError(f"operation {name!r}: field 'ok' must be true or false")
    if "rid" in fields and not isinstance(fields["rid"], str):
        raise ValueError(f"operation {name!r}: field 'rid' must be a string")
    if cls is AddRequest:
        _identity_fields(fields)
    op: Op = cls(**fields)
    return op


def _identity_fields(fields: dict[str, Any]) -> None:
    """An add's salt, lora and mm fields from JSON, validated (`model.contract.extra_keys.validate`)."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"operation 'add': {msg}")

    if "salt" in fields and not isinstance(fields["salt"], str):
        raise bad("field 'salt' must be a string")
    if "lora" in fields:
        lora = fields["lora"]
        if not isinstance(lora, list) or len(lora) != 3:
            raise bad("field 'lora' must be [name, id, path]")
        fields["lora"] = tuple(lora)
    if "mm" in fields:
        mm = fields["mm"]
        if not isinstance(mm, list) or not all(
            isinstance(m, list)
            and len(m) == 3
            and isinstance(m[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in m[1:])
            for m in mm
        ):
            raise bad("field 'mm' must be a list of [identifier, offset, length]")
        fields["mm"] = tuple(tuple(m) for m in mm)
    probe = AddRequest(
        "", tuple(fields.get("prompt", ())), fields.get("salt"), fields.get("lora"), fields.get("mm", ())
    )
    why = validate(probe.identity(), len(probe.prompt))
    if why is not None:
        raise bad(why)
