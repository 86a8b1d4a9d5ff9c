"""A request's identity (`model.contract.extra_keys`) as vLLM's `Request` arguments.

`request_identity(identity)` gives the keyword arguments vLLM 0.33.0's
`Request.__init__` takes for it: `cache_salt`, a `LoRARequest(name, int id,
path)` and one `MultiModalFeatureSpec` per item (no data: only the identifier
and its `PlaceholderRange` are read by the block hasher, the events and the
scheduler). Only the arguments an identity sets are passed, so a release whose
`Request` lacks one still builds requests without it.

A prefix's identity (`identity_of_prefix`) is rebuilt from its name (the
namespace and the items' marks, `model.contract.prefix`), for the throw-away requests
that re-hash a prefix (`vllm_names.HashLearner.rehash`).
"""

from __future__ import annotations

from typing import Any

from model.contract.extra_keys import Identity, MMItem
from model.contract.prefix import Prefix

MODALITY = "image"  # the modality vLLM's features name (not read by the hasher)


def request_identity(identity: Identity) -> dict[str, Any]:
    """`Request` keyword arguments for `identity` (empty without one)."""
    out: dict[str, Any] = {}
    if identity.salt:
        out["cache_salt"] = identity.salt
    if identity.lora is not None:
        from vllm.lora.request import LoRARequest

        name, lid, path = identity.lora
        out["lora_request"] = LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path)
    if identity.mm:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        out["mm_features"] = [
            MultiModalFeatureSpec(
                data=None,
                modality=MODALITY,
                identifier=m.identifier,
                mm_position=PlaceholderRange(offset=m.offset, length=m.length),
            )
            for m in identity.mm
        ]
    return out


def identity_of_prefix(p: Prefix, lora_id: int = 1) -> Identity:
    """The identity a prefix's name carries, as far as its hash reads it: the
    namespace's salt and adapter (`lora_id` stands in for the unhashed int id)
    and each item clipped to the prefix."""
    ns = p.namespace()
    salt, name, path = ns if ns is not None else (None, None, None)
    items: list[MMItem] = []
    for ident, a, b in p.items():
        if items and items[-1].identifier == ident and items[-1].end == a:
            last = items.pop()
            items.append(MMItem(ident, last.offset, b - last.offset))
        else:
            items.append(MMItem(ident, a, b - a))
    lora = (name, lora_id, path) if name is not None and path is not None else None
    return Identity(salt, lora, tuple(items))


UNBOUNDED_ENCODER_CACHE = "invariants.targets.vllm_identity.UnboundedEncoderCache"


def encoder_cache_config(vllm_config_cls: Any) -> dict[str, Any]:
    """The `VllmConfig` argument that gives the scheduler kvretain's encoder cache
    (`UnboundedEncoderCache`), for a release that takes one (empty otherwise).

    kvretain's scheduler is built without a multimodal model config, so vLLM gives
    it no encoder budget (`MultiModalBudget`): a request would stop before its
    first item for ever. A multimodal model's budget is a configuration, not a
    prefix-cache rule; this cache never limits encoder work, so every item is
    scheduled with its placeholder tokens and encoder caching stays out of the
    judgement (README: what isolation kvretain checks)."""
    import dataclasses

    fields = getattr(vllm_config_cls, "model_fields", None) or {
        f.name: f for f in dataclasses.fields(vllm_config_cls)
    }
    if "ec_manager_config" not in fields:
        return {}
    from vllm.config.ec_manager_config import EncoderCacheManagerConfig

    return {"ec_manager_config": EncoderCacheManagerConfig(encoder_cache_manager_cls=UNBOUNDED_ENCODER_CACHE)}


_UNBOUNDED: list[Any] = []
_NO_LIMIT = 1 << 40


def __getattr__(name: str) -> Any:
    """`UnboundedEncoderCache`, made on first use (vLLM is imported only then)."""
    if name != "UnboundedEncoderCache":
        raise AttributeError(name)
    if not _UNBOUNDED:
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        class UnboundedEncoderCache(EncoderCacheManager):  # type: ignore[misc]
            """vLLM's encoder cache with no size or compute limit (`encoder_cache_config`)."""

            @classmethod
            def create_manager(cls, *, cache_size: int, vllm_config: Any) -> Any:
                return cls(cache_size=_NO_LIMIT)

            def can_allocate(
                self, request: Any, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
            ) -> bool:
                return bool(super().can_allocate(request, input_id, _NO_LIMIT, num_embeds_to_schedule))

        _UNBOUNDED.append(UnboundedEncoderCache)
    return _UNBOUNDED[0]
