"""Model layouts derived by vLLM 0.33.0's own KV-cache grouping code.

`invariants/layouts/presets.py` hard-codes the full-size presets (`dsv4-flash`,
`gemma-like`, `kimi-linear-like`, and `dsv4-like`, the seeds' two-group view
of `dsv4-flash`, see `dsv4_main_view`); this module shows where their groups
come from. For each model family it builds the per-layer `KVCacheSpec` dict the way
the model's layers build it in vLLM 0.33.0 (real block sizes, windows,
`tokens_per_state`, head sizes and dtypes, so the page sizes are the ones vLLM
sees), hands it to vLLM's own grouping function and converts the resulting
groups into a kvretain `model.contract.config.Config`. `tests/test_presets.py` checks
that the hard-coded presets equal these derivations.

vLLM functions driven (all pure, CPU only; no model weights, no GPU):

- `vllm.v1.attention.backends.utils.resolve_kv_cache_layout`: the layout the
  engine core picks from the backends' declared layouts (DeepSeek-V4's indexer
  backend declares only block-outermost layouts, `BLHNC`/`BLNHC`).
- `vllm.v1.core.kv_cache_planning.get_kv_cache_groups`: the grouping the
  default `KVCacheConfigBuilder` runs for a model that does not implement
  `SupportsKVCacheGrouping` (none of these three does). It is the body of
  `get_global_kv_cache_groups` minus the speculative-decoding tagging (no
  MTP/Eagle here, so `extra_retained_tokens` stays 0). Depending on the page
  sizes it takes `_get_packed_kv_cache_groups` (mixed pages, block-outermost
  layout: DeepSeek-V4) or `unify_kv_cache_spec_page_size` +
  `_get_kv_cache_groups_uniform_page_size` (one page size: Gemma, Kimi-Linear).
- `vllm.v1.core.kv_cache_utils.generate_scheduler_kv_cache_config`: the
  scheduler's view (a `UniformTypeKVCacheSpecs` group becomes its first layer's
  spec), then `KVCacheSpecRegistry.get_manager_class` per group gives the
  manager vLLM's coordinator runs for it, which decides the kvretain kind:
  `FullAttentionManager` -> 'full' (FullAttentionSpec, MLAAttentionSpec),
  `SlidingWindowManager` -> 'swa' with the spec's window (SlidingWindowSpec,
  SlidingWindowMLASpec), `MambaManager` -> 'mamba'.
- `vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes`: the hash and
  scheduler block sizes (gcd of the prefix-cacheable groups' block sizes, lcm
  of all of them).
- `vllm.v1.core.kv_cache_utils.get_max_concurrency_for_kv_cache_config`: the
  "Maximum concurrency for N tokens per request" figure, used by
  `vllm_per_request_blocks` to check `invariants.presets.per_request_blocks`.

A group whose spec is not prefix-cacheable (`CircularBufferSpec`, or a
DeepSeek-V4.1 bounded-replay SWA cache) never enters the hash map and never
serves a hit; kvretain's model has no such group, so the derivation leaves it
out of the `Config` and lists it in `Derivation.dropped` (its block size still
counts in vLLM's scheduler block size, which the `Config` carries explicitly).
A group run by any other manager (chunked-local, RSWA, sink attention, ...)
raises `UnsupportedLayout`. None of the three families has either kind.

One step of vLLM's sizing cannot run on a CPU: for a hybrid Mamba model the
attention block size is chosen by `Platform._align_hybrid_block_size`
(`vllm/platforms/interface.py`) from the live model's layers and attention
backends. `hybrid_mamba_block_size` repeats its arithmetic (the page sizes
come from vLLM's own `MLAAttentionSpec` / `MambaSpec` and
`MambaStateShapeCalculator.kda_state_shape`), with the FlashMLA backend's
kernel block (64) and the MLA alignment to 128 tokens that function applies.

vLLM stays optional: importing this module never imports vLLM; every function
that needs it raises `LayoutUnavailable` (a `TargetUnavailable`) with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from invariants.targets.base import TargetUnavailable
from invariants.targets.vllm_build import group_specs
from model.contract.config import Config, ConfigError, GroupKind, GroupSpec, validate

FAMILIES = ("dsv4", "gemma3", "kimi-linear")

# --------------------------------------------------------------------------- model facts
# DeepSeek-V4-Flash, config.json `compress_ratios` (43 layers + 1 MTP slot, the
# MTP slot dropped here): two SWA-only layers (0), then compressed sparse
# attention (CSA, ratio 4, with the Lightning Indexer) and heavily compressed
# attention (HCA, ratio 128) alternating, ending on CSA: 21 CSA + 20 HCA. The
# installed packages do not ship this list (transformers' `DeepseekV4Config`
# defaults to a V4-Pro-like 2 x HCA + alternating schedule instead, see
# `DSV4_TRANSFORMERS_DEFAULT_RATIOS`); both group the same way.
DSV4_FLASH_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)
# transformers 5.23 `DeepseekV4Config()` defaults: 43 layers, layers 0-1 HCA,
# then HCA/CSA alternating (`configuration_deepseek_v4.py`, __post_init__).
DSV4_TRANSFORMERS_DEFAULT_RATIOS: tuple[int, ...] = (128, 128) + tuple(4 if i % 2 else 128 for i in range(41))

# Gemma 3 27B (google/gemma-3-27b config.json): 62 layers, every 6th global
# (`sliding_window_pattern` 6, i.e. 5 local : 1 global -> 52 SWA + 10 full),
# sliding window 1024, 16 KV heads of size 128. Block 16 is vLLM's default
# `--block-size` on CUDA.
GEMMA3_27B = {"num_layers": 62, "pattern": 6, "window": 1024, "num_kv_heads": 16, "head_dim": 128}

# Kimi-Linear-48B-A3B-Instruct config.json `linear_attn_config` (1-indexed
# layer numbers): 7 MLA full-attention layers, 20 KDA linear-attention layers
# (3:1 with a trailing MLA layer), KDA 32 heads x 128, short conv 4; MLA
# kv_lora_rank 512 + qk_rope_head_dim 64 = head size 576.
KIMI_LINEAR_FULL_LAYERS: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 27)
KIMI_LINEAR_NUM_LAYERS = 27
KIMI_LINEAR_KDA = {"num_heads": 32, "head_dim": 128, "conv_kernel": 4}
KIMI_LINEAR_MLA_HEAD_SIZE = 576
# #45845's E2E run: Kimi-Linear-48B-A3B-Instruct, TP4, block_size 512.
KIMI_LINEAR_TP = 4

# vLLM 0.33.0 defaults used for the "max concurrency" figure (see presets.py).
FLASHMLA_KERNEL_BLOCK = 64  # FlashMLABackend.get_supported_kernel_block_sizes()
MLA_HYBRID_BLOCK_ALIGNMENT = 128  # _align_hybrid_block_size: "multiple of 128" for MLA
DEFAULT_CUDA_BLOCK_SIZE = 16  # CacheConfig.block_size default before platform updates


class LayoutUnavailable(TargetUnavailable):
    """vLLM (needed to derive a layout) cannot be imported here."""


class UnsupportedLayout(ConfigError):
    """vLLM produced a group kvretain's model has no kind for."""


@dataclass(frozen=True)
class DerivedGroup:
    """One vLLM KV-cache group and how kvretain reads it."""

    spec_type: str  # vLLM spec class of the group's first layer (the scheduler's view)
    manager: str  # SingleTypeKVCacheManager class vLLM's coordinator runs for it
    num_layers: int
    block_size: int
    sliding_window: int | None
    tokens_per_state: Any
    page_size_bytes: int  # the group's page (all its layers' pages in a packed block)
    prefix_cacheable: bool
    layer_names: tuple[str, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Derivation:
    """What vLLM's grouping code made of a model, and the kvretain Config it maps to."""

    family: str
    params: dict[str, Any]
    layout: str  # resolved KV cache layout (e.g. BLHNC)
    groups: tuple[DerivedGroup, ...]  # every vLLM group, in vLLM's order
    config: Config  # prefix-cacheable groups only, vLLM's hash/scheduler block sizes
    hash_block_size: int
    scheduler_block_size: int
    dropped: tuple[str, ...] = ()  # groups left out of `config`, with the reason
    vllm_groups: list[Any] = field(default_factory=list, compare=False, repr=False)


# --------------------------------------------------------------------------- vLLM access
def _vllm() -> dict[str, Any]:
    """Import what the derivation needs, or raise LayoutUnavailable naming why."""
    from invariants.targets.vllm_env import vllm_available

    ok, reason = vllm_available()
    if not ok:
        raise LayoutUnavailable(f"invariants.layouts.derive needs vLLM: {reason}")
    try:
        import torch
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.model_executor.layers.mamba.mamba_utils import (
            MambaStateDtypeCalculator,
            MambaStateShapeCalculator,
        )
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core import kv_cache_planning, kv_cache_utils
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowMLASpec,
            SlidingWindowSpec,
            get_kv_quant_mode,
        )
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    except Exception as exc:  # an incompatible vLLM: say which import failed
        raise LayoutUnavailable(
            f"invariants.layouts.derive needs vLLM's KV-cache planning modules: {type(exc).__name__}: {exc}"
        ) from exc
    return dict(
        torch=torch,
        DeviceConfig=DeviceConfig,
        VllmConfig=VllmConfig,
        MambaStateDtypeCalculator=MambaStateDtypeCalculator,
        MambaStateShapeCalculator=MambaStateShapeCalculator,
        resolve_kv_cache_layout=resolve_kv_cache_layout,
        planning=kv_cache_planning,
        utils=kv_cache_utils,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        MambaSpec=MambaSpec,
        MLAAttentionSpec=MLAAttentionSpec,
        SlidingWindowMLASpec=SlidingWindowMLASpec,
        SlidingWindowSpec=SlidingWindowSpec,
        get_kv_quant_mode=get_kv_quant_mode,
        KVCacheSpecRegistry=KVCacheSpecRegistry,
    )


def vllm_config(
    *,
    block_size: int = DEFAULT_CUDA_BLOCK_SIZE,
    max_model_len: int = 1 << 20,
    max_num_batched_tokens: int = 8192,
    concurrent_batches: int = 2,
    mamba_cache_mode: str = "none",
    cache_dtype: str = "auto",
) -> Any:
    """A CPU `VllmConfig` carrying what grouping and capacity read.

    vLLM builds `model_config` from a checkpoint; none is loaded here, so it is
    a namespace with the two fields these functions read (`max_model_len`,
    `supports_kv_cache_grouping` False: the default builder groups). The hybrid
    KV-cache manager is on (`disable_hybrid_kv_cache_manager=False`, what
    vLLM resolves for these models), prefix caching on.
    `concurrent_batches` sets `VllmConfig.max_concurrent_batches` (1: no async
    scheduling; k>1: async scheduling with the V2 model runner and k-1
    pipeline stages; vLLM 0.33.0's default is 2).
    """
    v = _vllm()
    vc = v["VllmConfig"](device_config=v["DeviceConfig"](device="cpu"))
    vc.model_config = SimpleNamespace(max_model_len=max_model_len, supports_kv_cache_grouping=False)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    vc.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    if concurrent_batches < 1:
        raise ValueError("concurrent_batches: must be >= 1")
    vc.scheduler_config.async_scheduling = concurrent_batches > 1
    vc.parallel_config.pipeline_parallel_size = max(concurrent_batches - 1, 1)
    if vc.max_concurrent_batches != concurrent_batches:
        raise ValueError(
            f"concurrent_batches={concurrent_batches}: vLLM resolves {vc.max_concurrent_batches}"
        )
    vc.cache_config.enable_prefix_caching = True
    vc.cache_config.block_size = block_size
    vc.cache_config.mamba_cache_mode = mamba_cache_mode
    vc.cache_config.cache_dtype = cache_dtype
    return vc


# --------------------------------------------------------------------------- per-layer specs
def dsv4_layer_specs(
    compress_ratios: Sequence[int] = DSV4_FLASH_COMPRESS_RATIOS,
    *,
    block_size: int = 256,
    swa_block_size: int = 64,
    window: int = 128,
    head_dim: int = 512,
    index_head_dim: int = 128,
) -> dict[str, Any]:
    """DeepSeek-V4 per-layer specs, as vLLM 0.33.0's layers build them (fp8_ds_mla cache).

    Every layer (`models/deepseek_v4/attention.py`, `DeepseekV4Attention`):
    - `DeepseekV4SWACache` (`v1/attention/backends/mla/sparse_swa.py`):
      SlidingWindowMLASpec block 64, window = config.sliding_window (128),
      584 B/token packed, 576 B page alignment;
    - for compress ratio r > 1, the main cache (`get_kv_cache_spec`):
      MLAAttentionSpec block = cache_config.block_size (256: the only kernel
      block the DSv4 sparse-MLA and indexer backends take; `platforms/cpu.py`
      forces it too), tokens_per_state = r, 584 B per state;
    - its compressor state (`models/deepseek_v4/compressor.py`,
      `CompressorStateCache`): SlidingWindowMLASpec float32, state_dim
      2*coff*head_dim, block 4 window 8 for r = 4 (coff 2), block 8 window
      128 for r = 128 (coff 1);
    - for r = 4 only, the Lightning Indexer (`DeepseekV4Indexer`): its K cache
      `DeepseekV4IndexerCache` (MLAAttentionSpec block 256, tokens_per_state
      4, 128 fp8 + 4 B scale per state) and its own compressor state (r = 4,
      head 128).
    Insertion order follows module construction (indexer, SWA cache,
    attention, compressor), as `static_forward_context` records it. The MTP
    layer exists only with speculative decoding and is not included.
    """
    v = _vllm()
    fp8 = v["get_kv_quant_mode"]("fp8_ds_mla")
    specs: dict[str, Any] = {}
    for i, r in enumerate(compress_ratios):
        if r not in (0, 1, 4, 128):
            raise ValueError(
                f"compress_ratios[{i}]: DeepSeek-V4 layers use 0/1 (SWA only), 4 or 128, got {r}"
            )
        p = f"model.layers.{i}.attn"
        if r == 4:
            specs[f"{p}.indexer.k_cache"] = _dsv4_indexer_cache(v, block_size, index_head_dim)
            specs[f"{p}.indexer.compressor.state_cache"] = _dsv4_compressor_state(v, 4, index_head_dim)
        specs[f"{p}.swa_cache"] = _dsv4_swa_cache(v, fp8, swa_block_size, head_dim, window)
        if r > 1:
            specs[p] = _dsv4_compressed_cache(v, fp8, r, block_size, head_dim)
            specs[f"{p}.compressor.state_cache"] = _dsv4_compressor_state(v, r, head_dim)
    return specs


def _dsv4_compressor_state(v: dict[str, Any], ratio: int, dim: int) -> Any:
    """A compressor's state cache: float32 sliding-window state, block 4 window 8 for ratio 4
    (two overlapping windows), block 8 window 128 for ratio 128."""
    coff = 1 + (ratio == 4)
    return v["SlidingWindowMLASpec"](
        block_size=4 if ratio == 4 else 8,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=2 * coff * dim,
        dtype=v["torch"].float32,
        sliding_window=coff * ratio,
        alignment=576,
    )


def _dsv4_indexer_cache(v: dict[str, Any], block_size: int, index_head_dim: int) -> Any:
    """The Lightning Indexer's K cache: one fp8 state (plus a 4 B scale) per 4 tokens."""
    return v["MLAAttentionSpec"](
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=index_head_dim + index_head_dim // 128 * 4,
        dtype=v["torch"].uint8,
        tokens_per_state=4,
        alignment=576,
    )


def _dsv4_swa_cache(v: dict[str, Any], fp8: Any, swa_block_size: int, head_dim: int, window: int) -> Any:
    """Every layer's sliding-window cache: one packed 584 B fp8_ds_mla entry per token."""
    return v["SlidingWindowMLASpec"](
        block_size=swa_block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_dim,
        dtype=v["torch"].uint8,
        sliding_window=window,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=584,
        alignment=576,
        model_version="deepseek_v4",
        kv_quant_mode=fp8,
    )


def _dsv4_compressed_cache(v: dict[str, Any], fp8: Any, ratio: int, block_size: int, head_dim: int) -> Any:
    """A compressing layer's main cache: full attention over one 584 B state per `ratio` tokens."""
    return v["MLAAttentionSpec"](
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_dim,
        dtype=v["torch"].uint8,
        tokens_per_state=ratio,
        cache_dtype_str="fp8_ds_mla",
        alignment=576,
        model_version="deepseek_v4",
        kv_quant_mode=fp8,
        state_content_bytes=584,
    )


def gemma3_layer_specs(
    *,
    num_layers: int = GEMMA3_27B["num_layers"],
    pattern: int = GEMMA3_27B["pattern"],
    window: int = GEMMA3_27B["window"],
    block_size: int = DEFAULT_CUDA_BLOCK_SIZE,
    num_kv_heads: int = GEMMA3_27B["num_kv_heads"],
    head_dim: int = GEMMA3_27B["head_dim"],
) -> dict[str, Any]:
    """Gemma 3 per-layer specs (`model_executor/models/gemma3.py` -> `Attention.get_kv_cache_spec`).

    Layer i is global (FullAttentionSpec) when (i + 1) % pattern == 0, else
    local (SlidingWindowSpec, `per_layer_sliding_window` = config.sliding_window).
    Both kinds have the same head size, so the SWA layer keeps the primary
    block size (`attention.py`: "take the primary block size when the backend
    can run it unsplit") and every page is equal.
    """
    v = _vllm()
    torch = v["torch"]
    specs: dict[str, Any] = {}
    for i in range(num_layers):
        common = dict(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=torch.bfloat16
        )
        name = f"model.layers.{i}.self_attn.attn"
        if (i + 1) % pattern:
            specs[name] = v["SlidingWindowSpec"](sliding_window=window, **common)
        else:
            specs[name] = v["FullAttentionSpec"](**common)
    return specs


def kda_page_size(tp: int = KIMI_LINEAR_TP, **kda: int) -> int:
    """Bytes of one KDA state (conv bf16 + recurrent fp32) at tensor-parallel size `tp`."""
    v = _vllm()
    k = {**KIMI_LINEAR_KDA, **kda}
    shapes = v["MambaStateShapeCalculator"].kda_state_shape(
        tp, k["num_heads"], k["head_dim"], conv_kernel_size=k["conv_kernel"]
    )
    dtypes = v["MambaStateDtypeCalculator"].kda_state_dtype(v["torch"].bfloat16, "auto")
    return int(v["MambaSpec"](shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=-1).page_size_bytes)


def hybrid_mamba_block_size(
    attn_page_per_token: int,
    mamba_page: int,
    *,
    cache_block_size: int = DEFAULT_CUDA_BLOCK_SIZE,
    kernel_block: int = FLASHMLA_KERNEL_BLOCK,
    use_mla: bool = True,
    checkpoint_alignment: int | None = None,
) -> int:
    """The attention (and, in align mode, Mamba) block size vLLM picks for a hybrid model.

    Repeats `Platform._align_hybrid_block_size` (vllm/platforms/interface.py),
    which needs the live model's layers and so cannot run here: the smallest
    multiple of the kernel alignment (the backend's smallest kernel block, at
    least `cache_config.block_size`, raised to 128 for MLA, lcm'd with the
    Mamba prefill-checkpoint alignment) whose attention page holds the Mamba
    state; then rounded to the backends' kernel block.
    """
    align = max(kernel_block, cache_block_size)
    if use_mla:
        align = max(align, MLA_HYBRID_BLOCK_ALIGNMENT)
    if checkpoint_alignment:
        align = math.lcm(align, checkpoint_alignment)
    block = align * -(-mamba_page // (align * attn_page_per_token))
    block = kernel_block * -(-block // kernel_block)
    return max(block, cache_block_size)


def kimi_linear_layer_specs(
    *,
    num_layers: int = KIMI_LINEAR_NUM_LAYERS,
    full_layers: Sequence[int] = KIMI_LINEAR_FULL_LAYERS,
    tp: int = KIMI_LINEAR_TP,
    block_size: int | None = None,
) -> dict[str, Any]:
    """Kimi-Linear per-layer specs: MLA full attention + KDA (Mamba-like) state.

    MLA layers (`models/kimi_k3/nvidia/mla.py`): MLAAttentionSpec block =
    cache_config.block_size, head 576, bf16 (`--kv-cache-dtype auto`). KDA
    layers (`models/kimi_k3/nvidia/kda.py` -> `MambaBase.get_kv_cache_spec`):
    MambaSpec with `kda_state_shape` / `kda_state_dtype`, block =
    cache_config.mamba_block_size (= block_size in align mode), page padded to
    the attention page (`mamba_page_size_padded`), mamba_cache_mode 'align'
    (the only mode with prefix caching for this model), no speculative
    blocks, no prefill checkpoint block (the Triton KDA prefill backend; with
    FlashKDA each Mamba group would hold one more block per request).
    `block_size` None: what `hybrid_mamba_block_size` gives for `tp` (512 at
    TP4, as in #45845's run).
    """
    v = _vllm()
    torch = v["torch"]
    attn_page_per_token = v["MLAAttentionSpec"](
        block_size=1, num_kv_heads=1, head_size=KIMI_LINEAR_MLA_HEAD_SIZE, dtype=torch.bfloat16
    ).page_size_bytes
    if block_size is None:
        block_size = hybrid_mamba_block_size(attn_page_per_token, kda_page_size(tp))
    attn_page = block_size * attn_page_per_token
    k = KIMI_LINEAR_KDA
    shapes = tuple(
        v["MambaStateShapeCalculator"].kda_state_shape(
            tp, k["num_heads"], k["head_dim"], conv_kernel_size=k["conv_kernel"]
        )
    )
    dtypes = tuple(v["MambaStateDtypeCalculator"].kda_state_dtype(torch.bfloat16, "auto"))
    mamba_page = kda_page_size(tp)
    if mamba_page > attn_page:
        raise ValueError(
            f"block_size={block_size}: the attention page ({attn_page} B) must hold a "
            f"KDA state ({mamba_page} B)"
        )
    specs: dict[str, Any] = {}
    full = set(full_layers)
    for n in range(1, num_layers + 1):  # 1-indexed, as the checkpoint numbers them
        i = n - 1
        if n in full:
            specs[f"model.layers.{i}.self_attn.attn"] = v["MLAAttentionSpec"](
                block_size=block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=KIMI_LINEAR_MLA_HEAD_SIZE,
                dtype=torch.bfloat16,
                cache_dtype_str="auto",
            )
        else:
            specs[f"model.layers.{i}.self_attn"] = v["MambaSpec"](
                shapes=shapes,
                dtypes=dtypes,
                block_size=block_size,
                page_size_padded=None if mamba_page == attn_page else attn_page,
                mamba_cache_mode="align",
            )
    return specs


# --------------------------------------------------------------------------- grouping
def group_layers(
    specs: dict[str, Any], vc: Any, supported_layouts: Sequence[str] | None = None
) -> tuple[str, list[Any]]:
    """(resolved layout name, vLLM's KV-cache groups) for these per-layer specs."""
    v = _vllm()
    if supported_layouts is None:
        from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

        supported_layouts = [m.name for m in _DEFAULT_LAYOUT_PREFERENCE]
    if vc.cache_config.kv_cache_layout is None:
        v["resolve_kv_cache_layout"](vc, [list(supported_layouts)], list(specs.values()))
    groups = v["planning"].get_kv_cache_groups(vc, dict(specs))
    v["planning"]._check_exact_partition(groups, specs)
    return str(vc.cache_config.kv_cache_layout), list(groups)


def scheduler_groups(groups: list[Any], num_blocks: int = 2) -> Any:
    """The scheduler's KVCacheConfig for these groups (`generate_scheduler_kv_cache_config`)."""
    v = _vllm()
    kv_cfg = v["KVCacheConfig"](num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return v["utils"].generate_scheduler_kv_cache_config([kv_cfg])


_KIND_OF_MANAGER: dict[str, GroupKind] = {
    "FullAttentionManager": "full",
    "SlidingWindowManager": "swa",
    "MambaManager": "mamba",
}


def to_config(
    family: str,
    groups: list[Any],
    vc: Any,
    *,
    num_blocks: int = 2,
    name: str = "",
    retention_interval: int | None = 0,
) -> tuple[Config, tuple[DerivedGroup, ...], tuple[str, ...], int, int]:
    """Convert vLLM groups to a kvretain Config (+ per-group facts, dropped groups, hbs, sbs)."""
    v = _vllm()
    sched = scheduler_groups(groups)
    sbs, hbs = v["utils"].resolve_kv_cache_block_sizes(sched, vc)
    derived: list[DerivedGroup] = []
    out: list[GroupSpec] = []
    dropped: list[str] = []
    for i, (worker, g) in enumerate(zip(groups, sched.kv_cache_groups)):
        spec = g.kv_cache_spec
        manager = v["KVCacheSpecRegistry"].get_manager_class(spec, g.role)
        mname = manager.__name__ if manager is not None else "None"
        window = getattr(spec, "sliding_window", None)
        d = DerivedGroup(
            spec_type=type(spec).__name__,
            manager=mname,
            num_layers=len(worker.layer_names),
            block_size=int(spec.block_size),
            sliding_window=window if mname == "SlidingWindowManager" else None,
            tokens_per_state=getattr(spec, "tokens_per_state", None),
            page_size_bytes=int(worker.kv_cache_spec.page_size_bytes),
            prefix_cacheable=bool(spec.prefix_cacheable),
            layer_names=tuple(worker.layer_names),
        )
        derived.append(d)
        if not d.prefix_cacheable:
            dropped.append(f"group {i} ({d.spec_type}, {d.num_layers} layers): not prefix-cacheable")
            continue
        kind = _KIND_OF_MANAGER.get(mname)
        if kind is None:
            raise UnsupportedLayout(
                f"groups[{i}]: vLLM runs {mname} for {d.spec_type}; kvretain has no such kind"
            )
        if kind == "mamba":
            out.append(GroupSpec("mamba", d.block_size, mamba_cache_mode=spec.mamba_cache_mode))
        else:
            out.append(GroupSpec(kind, d.block_size, sliding_window=d.sliding_window))
    cfg = Config(
        groups=tuple(out),
        num_blocks=num_blocks,
        retention_interval=retention_interval,
        hash_block_size=int(hbs),
        scheduler_block_size=int(sbs),
        name=name or f"{family}-derived",
    )
    return validate(cfg), tuple(derived), tuple(dropped), int(hbs), int(sbs)


def derive(family: str, **params: Any) -> Derivation:
    """Run vLLM's grouping for `family` ('dsv4', 'gemma3', 'kimi-linear') and convert it.

    `params` go to the family's `*_layer_specs` function (e.g.
    `compress_ratios=...` for dsv4, `tp=8` for kimi-linear).
    """
    if family == "dsv4":
        vc = vllm_config(block_size=params.get("block_size", 256), cache_dtype="fp8_ds_mla")
        specs = dsv4_layer_specs(**params)
        # DeepseekV4IndexerBackend.supported_kv_cache_layouts(): the indexer pages
        # are packed beside the MLA pages, so only block-outermost layouts.
        layout, groups = group_layers(specs, vc, ["BLHNC", "BLNHC"])
    elif family == "gemma3":
        vc = vllm_config(block_size=params.get("block_size", DEFAULT_CUDA_BLOCK_SIZE))
        layout, groups = group_layers(gemma3_layer_specs(**params), vc)
    elif family == "kimi-linear":
        specs = kimi_linear_layer_specs(**params)
        bs = next(iter(specs.values())).block_size
        vc = vllm_config(block_size=bs, mamba_cache_mode="align")
        layout, groups = group_layers(specs, vc)
    else:
        raise ValueError(f"family: must be one of {FAMILIES}, got {family!r}")
    cfg, derived, dropped, hbs, sbs = to_config(family, groups, vc)
    return Derivation(family, dict(params), layout, derived, cfg, hbs, sbs, dropped, groups)


def layout_of(cfg: Config) -> tuple[tuple[GroupSpec, ...], int, int]:
    """What a derivation fixes of a Config: its groups (in order), hash and scheduler block sizes."""
    return cfg.groups, cfg.hash_block_size, cfg.scheduler_block_size


def matches(cfg: Config, d: Derivation) -> bool:
    """True when `cfg` has exactly the group layout vLLM's grouping produced in `d`."""
    return layout_of(cfg) == layout_of(d.config)


def dsv4_main_view(d: Derivation) -> tuple[GroupSpec, ...]:
    """The seeds' two-group view of a DeepSeek-V4 derivation: the main MLA and SWA caches.

    Keeps the groups holding a layer's main compressed-MLA cache (`...attn`)
    or its SWA cache (`...attn.swa_cache`), once each (vLLM splits the SWA
    cache into several identical groups); drops the compressor-state groups.
    This is what `dsv4-like` hard-codes (in the seeds' order, full first).
    """
    if d.family != "dsv4":
        raise ValueError(f"dsv4_main_view: a 'dsv4' derivation is needed, got {d.family!r}")
    cacheable = [g for g in d.groups if g.prefix_cacheable]
    out: list[GroupSpec] = []
    for g, spec in zip(cacheable, d.config.groups):
        main = any(n.endswith(".attn") or n.endswith(".attn.swa_cache") for n in g.layer_names)
        if main and spec not in out:
            out.append(spec)
    return tuple(out)


# --------------------------------------------------------------------------- capacity (vLLM's figure)
def _specs_for_config(cfg: Config) -> list[Any]:
    """Plain vLLM group specs for a kvretain Config (those the vLLM target builds)."""
    return group_specs(cfg, _vllm())


def vllm_per_request_blocks(
    groups_or_config: list[Any] | Config,
    max_len: int,
    *,
    max_num_batched_tokens: int = 8192,
    concurrent_batches: int = 2,
) -> int:
    """Blocks per request at `max_len`, as vLLM's own capacity report computes them.

    vLLM logs "Maximum concurrency for {max_model_len} tokens per request:
    {num_blocks / per_request}x" (`get_max_concurrency_for_kv_cache_config`,
    called by `update_kv_cache_capacity`); this returns its per-request
    divisor (computed with num_blocks = 1). Accepts vLLM groups (a
    `Derivation.vllm_groups`) or a kvretain Config (plain specs).
    """
    v = _vllm()
    groups = _specs_for_config(groups_or_config) if isinstance(groups_or_config, Config) else groups_or_config
    vc = vllm_config(
        max_model_len=max_len,
        max_num_batched_tokens=max_num_batched_tokens,
        concurrent_batches=concurrent_batches,
        mamba_cache_mode="align",
    )
    kv_cfg = v["KVCacheConfig"](num_blocks=1, kv_cache_tensors=[], kv_cache_groups=list(groups))
    concurrency = v["utils"].get_max_concurrency_for_kv_cache_config(vc, kv_cfg)
    return round(1 / concurrency)


def describe(d: Derivation) -> str:
    """A short table of a derivation (for docs and debugging)."""
    lines = [
        f"{d.family}: layout {d.layout}, hash block {d.hash_block_size}, scheduler block "
        f"{d.scheduler_block_size}"
    ]
    for i, g in enumerate(d.groups):
        w = f" window {g.sliding_window}" if g.sliding_window else ""
        lines.append(
            f"  {i}: {g.spec_type:22s} {g.manager:22s} {g.num_layers:3d} layers block {g.block_size}{w} "
            f"tokens/state {g.tokens_per_state} page {g.page_size_bytes} B"
        )
    lines += [f"  dropped: {x}" for x in d.dropped]
    return "\n".join(lines)
