"""Triton paged attention that reads the block table directly (CUDA).

One program per (query token, head). It walks the query's visible blocks in
absolute order (`t0 = floor(max(0, p - w + 1) / bs)` .. `floor(p / bs)`),
reading each block id from the sequence's block table, in two passes: the
max (exact in any order), then the sums. Every reduction inside a program has
a fixed shape (bs keys, dh features) and programs never cooperate, so a
token's result is independent of the batch it is in: batch-invariant by
construction. The results are NOT bit-equal to the torch path (different
order), so one run uses one kernel set throughout.

Import-safe: `triton` is imported only when the kernel is first needed, and
only for CUDA tensors, or for CPU tensors under `TRITON_INTERPRET=1` (the
Triton interpreter, which the tests use because this project's CI has no GPU).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

from gpu_check.kernels import AttnBatch, InvariantKernels

_KERNEL: Any = None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: str) -> tuple[bool, str]:
    """(usable, reason): CUDA present and triton importable (or the interpreter on CPU)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
    elif not interpreter_enabled():
        return False, "the Triton path needs --device cuda (or TRITON_INTERPRET=1 for the interpreter)"
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return False, f"triton cannot be imported: {exc}"
    return True, ""


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attn(
        q_ptr,
        k_ptr,
        v_ptr,
        tab_ptr,
        seq_ptr,
        pos_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ko,
        stride_kh,
        stride_tab,
        stride_ot,
        stride_oh,
        window,
        scale,
        DH: tl.constexpr,
        BS: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        sq = tl.load(seq_ptr + t).to(tl.int64)
        if HAS_WINDOW:  # noqa: SIM108 - a constexpr branch, kept explicit for Triton
            lo = tl.maximum(pos - window + 1, 0)
        else:
            lo = pos * 0
        t0 = lo // BS
        t1 = pos // BS
        d = tl.arange(0, DH)
        o = tl.arange(0, BS)
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d).to(tl.float32)
        m = tl.zeros([1], dtype=tl.float32) - float("inf")
        # while, not range(t0, t1 + 1): Triton 3.6's interpreter cannot take tensor bounds
        # in range(); both loops run the same blocks in the same order either way.
        j = t0
        while j <= t1:
            blk = tl.load(tab_ptr + sq * stride_tab + j).to(tl.int64)
            kp = j * BS + o
            valid = (kp >= lo) & (kp <= pos)
            kptr = k_ptr + blk * stride_kb + o[:, None] * stride_ko + h * stride_kh + d[None, :]
            k = tl.load(kptr, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m = tl.maximum(m, tl.max(s, axis=0))
            j += 1
        den = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([DH], dtype=tl.float32)
        j = t0
        while j <= t1:
            blk = tl.load(tab_ptr + sq * stride_tab + j).to(tl.int64)
            kp = j * BS + o
            valid = (kp >= lo) & (kp <= pos)
            kptr = k_ptr + blk * stride_kb + o[:, None] * stride_ko + h * stride_kh + d[None, :]
            k = tl.load(kptr, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            p = tl.where(valid, tl.exp(s - m), 0.0)
            vptr = v_ptr + blk * stride_kb + o[:, None] * stride_ko + h * stride_kh + d[None, :]
            v = tl.load(vptr, mask=valid[:, None], other=0.0).to(tl.float32)
            den += tl.sum(p, axis=0)
            acc += tl.sum(p[:, None] * v, axis=0)
            j += 1
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, acc / den)

    return paged_attn


def paged_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnBatch) -> Tensor:
    """Same contract as `InvariantKernels.attention`; float32 only; CUDA (or the interpreter)."""
    global _KERNEL
    if q.device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            "the Triton paged-attention kernel runs on CUDA tensors (or under TRITON_INTERPRET=1)"
        )
    if q.dtype != torch.float32:
        raise TypeError(f"the Triton kernel supports float32, got {q.dtype}")
    T, H, DH = q.shape
    bs = meta.block_size
    if DH & (DH - 1) or bs & (bs - 1):
        raise ValueError(f"head dim ({DH}) and block size ({bs}) must be powers of two for the Triton kernel")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides with a contiguous head dimension")
    if _KERNEL is None:
        _KERNEL = _build()
    out = torch.empty_like(q)
    tables = meta.tables.contiguous()
    _KERNEL[(T, H)](
        q,
        k_cache,
        v_cache,
        tables,
        meta.seq_index.contiguous(),
        meta.q_pos.contiguous(),
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        meta.window if meta.window is not None else 0,
        1.0 / math.sqrt(DH),
        DH=DH,
        BS=bs,
        HAS_WINDOW=meta.window is not None,
    )
    return out


class TritonKernels(InvariantKernels):
    """The invariant torch projections with the Triton paged-attention kernel."""

    name = "triton"

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnBatch) -> Tensor:
        return paged_attention_triton(q, k_cache, v_cache, meta)
