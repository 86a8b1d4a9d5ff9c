"""Throughput figures for `gpu-check --bench`.

On CUDA: Triton paged attention (block table read in the kernel) against
torch's `scaled_dot_product_attention` on contiguous K/V of the same shapes
(decode: one query per sequence), both timed in this run with CUDA events; the
ratio is printed. On CPU there is no Triton path: the batch-invariant torch
attention is timed against the naive one instead. Both report what the
equivalence check itself achieved in checked tokens per minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_check.kernels import AttnBatch, InvariantKernels, NaiveKernels


@dataclass(frozen=True)
class BenchShape:
    seqs: int = 64
    context: int = 2048
    heads: int = 8
    head_dim: int = 64
    block_size: int = 16


def _paged_inputs(shape: BenchShape, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = shape.context // shape.block_size
    nb = shape.seqs * per_seq + 1
    k = torch.randn(nb, shape.block_size, shape.heads, shape.head_dim, generator=gen).to(device)
    v = torch.randn(nb, shape.block_size, shape.heads, shape.head_dim, generator=gen).to(device)
    perm = torch.randperm(nb - 1, generator=gen) + 1  # scattered block ids, as after churn
    tables = perm.view(shape.seqs, per_seq).to(device)
    q = torch.randn(shape.seqs, shape.heads, shape.head_dim, generator=gen).to(device)
    pos = torch.full((shape.seqs,), shape.context - 1, dtype=torch.long, device=device)
    seq = torch.arange(shape.seqs, device=device)
    return q, k, v, tables, pos, seq


def _time_cuda(fn: Callable[[], object], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def _time_cpu(fn: Callable[[], object], iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def bench_attention(
    device: str, shape: BenchShape | None = None, seed: int = 0, iters: int = 20
) -> list[str]:
    """Lines of figures; on CUDA Triton vs SDPA, on CPU invariant torch vs naive torch."""
    if device == "cuda":
        from gpu_check.triton_kernels import paged_attention_triton

        shape = shape or BenchShape()
        q, k, v, tables, pos, seq = _paged_inputs(shape, device, seed)
        meta = AttnBatch(pos, seq, tables, None, shape.block_size)
        kd = (
            k[tables]
            .reshape(shape.seqs, shape.context, shape.heads, shape.head_dim)
            .transpose(1, 2)
            .contiguous()
        )
        vd = (
            v[tables]
            .reshape(shape.seqs, shape.context, shape.heads, shape.head_dim)
            .transpose(1, 2)
            .contiguous()
        )
        qd = q.unsqueeze(2)  # (B, H, 1, dh)
        t_tri = _time_cuda(lambda: paged_attention_triton(q, k, v, meta), iters)
        t_sdpa = _time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd), iters)
        return [
            f"attention bench (decode, {shape.seqs} seqs x {shape.context} ctx, {shape.heads} heads x "
            f"{shape.head_dim}, bs {shape.block_size}, float32, CUDA):",
            f"  triton paged (block table in-kernel): {shape.seqs / t_tri:,.0f} queries/s ({t_tri * 1e6:.1f} us/call)",
            f"  torch SDPA (contiguous K/V):           {shape.seqs / t_sdpa:,.0f} queries/s ({t_sdpa * 1e6:.1f} us/call)",
            f"  ratio triton/SDPA throughput: {t_sdpa / t_tri:.2f}",
        ]
    shape = shape or BenchShape(seqs=16, context=256, heads=2, head_dim=16)
    q, k, v, tables, pos, seq = _paged_inputs(shape, "cpu", seed)
    meta = AttnBatch(pos, seq, tables, None, shape.block_size)
    inv, naive = InvariantKernels(), NaiveKernels()
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the check itself
    try:
        t_inv = _time_cpu(lambda: inv.attention(q, k, v, meta), iters)
        t_naive = _time_cpu(lambda: naive.attention(q, k, v, meta), iters)
    finally:
        torch.set_num_threads(prev)
    return [
        f"attention bench (decode, {shape.seqs} seqs x {shape.context} ctx, {shape.heads} heads x "
        f"{shape.head_dim}, bs {shape.block_size}, float32, CPU; Triton vs SDPA needs CUDA):",
        f"  invariant torch paged: {shape.seqs / t_inv:,.0f} queries/s ({t_inv * 1e6:.0f} us/call)",
        f"  naive torch paged:     {shape.seqs / t_naive:,.0f} queries/s ({t_naive * 1e6:.0f} us/call)",
        f"  ratio invariant/naive throughput: {t_naive / t_inv:.2f}",
    ]
