"""The operations a scheduler applies to a radix cache, as data.

Each operation names a request by `rid` (a small int) and is what SGLang's
scheduler does at one point of a request's life:

| op       | scheduler step (SGLang 0.5.23)                                              |
|----------|-----------------------------------------------------------------------------|
| `Admit`  | `Req.init_next_round_input` (match_prefix, Mamba copy-on-write), `lock`,    |
|          | request slot, KV for the first `chunk` tokens (evicting under pressure)     |
| `Extend` | `checkpoint_kv_cache` of the chunk so far (cache_unfinished_req), next chunk |
| `Decode` | `n` sampled tokens: the first after the prompt comes from the prefill (no  |
|          | slot); each later one is a decode step (`check_decode_mem`, SWA window      |
|          | eviction, one slot for the last sampled token: `alloc_for_decode_default`)  |
| `Finish` | `release_kv_cache(checkpoint=True)` (cache_finished_req)                    |
| `Abort`  | `release_kv_cache(checkpoint=False)`                                        |
| `Evict`  | `evict(num_tokens, swa_num_tokens, mamba_num)` under pressure                |

A trace is a list of these (JSON via `to_json`/`from_json`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Admit:
    """`lora` (an adapter name) and `salt` (a tenant's cache salt) are the request's
    identity: SGLang's `Req(lora_id=..., cache_salt=...)`, its radix namespace."""

    rid: int
    tokens: tuple[int, ...]
    chunk: int
    lora: str | None = None
    salt: str | None = None

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        return (self.lora, self.salt)


@dataclass(frozen=True)
class Extend:
    rid: int
    chunk: int


@dataclass(frozen=True)
class Decode:
    rid: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    rid: int


@dataclass(frozen=True)
class Abort:
    rid: int


@dataclass(frozen=True)
class Evict:
    full: int = 0
    swa: int = 0
    mamba: int = 0


RadixOp = Admit | Extend | Decode | Finish | Abort | Evict
OP_TYPES: dict[str, type] = {cls.__name__: cls for cls in (Admit, Extend, Decode, Finish, Abort, Evict)}


def to_json(op: RadixOp) -> dict[str, Any]:
    """One op as a JSON object: {"op": name, fields...}."""
    fields = asdict(op)
    for key in ("lora", "salt"):  # identity fields appear only when set (older traces lack them)
        if fields.get(key, 0) is None:
            del fields[key]
    for key, value in fields.items():
        if isinstance(value, tuple):
            fields[key] = list(value)
    return {"op": type(op).__name__, **fields}


def from_json(data: dict[str, Any]) -> RadixOp:
    """Inverse of `to_json`; ValueError naming the field on bad input."""
    name = data.get("op")
    if name not in OP_TYPES:
        raise ValueError(f"op: unknown operation {name!r}; known: {sorted(OP_TYPES)}")
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k != "op"}
    try:
        return OP_TYPES[name](**fields)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None
