"""Do two requests that must stay apart hash a block alike? Asked of an installed vLLM release.

Run as a script by any release's interpreter (it imports vLLM and the standard library only,
never kvretain): `python invariants/targets/vllm_identity_probe.py` prints one JSON object,
probe name -> true when the two requests share a block hash (a prefix-cache hit across
identities), false when they do not. Each probe builds the two requests with that release's
own `Request` and `get_request_block_hasher` (block size 4, sha256), as its engine does;
`invariants/matrix/identity_keys.py` states which releases should share.

| probe | requests | block compared |
|---|---|---|
| `salt_equals_adapter_name` | adapter named X, no salt / base model, salt X | the first |
| `same_adapter_name_other_path` | adapter X at /a / adapter X at /b | the first |
| `incremental_block_drops_earlier_item` | items (e1 at 4, z at 5) / (e2 at 4, z at 5), 6-token prompt, 2 output tokens | the second (hashed once the outputs complete it) |
| `other_salt` (control) | salt A / salt B | the first |
| `other_adapter` (control) | adapter X / adapter Y | the first |
| `other_item_in_prompt` (control) | item e1 / e2 at 1 | the first |
"""

from __future__ import annotations

import json
from typing import Any

BLOCK = 4


def _request(rid: str, tokens: list[int], **identity: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **identity,
    )


def _lora(name: str, lid: int, path: str) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    return {"lora_request": LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path)}


def _items(*items: tuple[str, int, int]) -> dict[str, Any]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return {
        "mm_features": [
            MultiModalFeatureSpec(
                data=None, modality="image", identifier=i, mm_position=PlaceholderRange(offset=o, length=n)
            )
            for i, o, n in items
        ]
    }


def _same(a: Any, b: Any, block: int) -> bool:
    return bool(
        len(a.block_hashes) > block
        and len(b.block_hashes) > block
        and a.block_hashes[block] == b.block_hashes[block]
    )


def probes() -> dict[str, bool]:
    """Every probe of the module table, on the installed vLLM."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)  # once: the root hash is random per call unless PYTHONHASHSEED is set
    toks = list(range(1, 9))
    out: dict[str, bool] = {}
    out["salt_equals_adapter_name"] = _same(
        _request("a", toks, **_lora("X", 1, "/a")), _request("b", toks, cache_salt="X"), 0
    )
    out["same_adapter_name_other_path"] = _same(
        _request("a", toks, **_lora("X", 1, "/a")), _request("b", toks, **_lora("X", 2, "/b")), 0
    )
    six = list(range(1, 7))
    later = []
    for first in ("e1", "e2"):
        req = _request(first, six, **_items((first, 4, 1), ("z", 5, 1)))
        req.append_output_token_ids([7, 8])  # completes the second block: hashed now
        later.append(req)
    out["incremental_block_drops_earlier_item"] = _same(later[0], later[1], 1)
    out["other_salt"] = _same(_request("a", toks, cache_salt="A"), _request("b", toks, cache_salt="B"), 0)
    out["other_adapter"] = _same(
        _request("a", toks, **_lora("X", 1, "/x")), _request("b", toks, **_lora("Y", 2, "/y")), 0
    )
    out["other_item_in_prompt"] = _same(
        _request("a", toks, **_items(("e1", 1, 1))), _request("b", toks, **_items(("e2", 1, 1))), 0
    )
    return out


if __name__ == "__main__":
    import importlib.metadata

    print(json.dumps({"version": importlib.metadata.version("vllm"), "probes": probes()}))
