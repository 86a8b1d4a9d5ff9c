"""Kernels for the hybrid model: batch-invariant (fixed reduction order) and naive.

Contract of the batch-invariant set (`InvariantKernels`): the bits of every
output row depend only on that row's inputs (and, for attention, on the keys
and values its query may see), never on how many other rows share the call,
where the row sits in the batch, or how the keys are laid out in memory. This
holds on CPU and CUDA because every reduction has a fixed order that depends
only on fixed sizes (the model dimension, the tile size) or on absolute
positions (attention tiles are aligned to multiples of the block size), and
every transcendental is built from IEEE-exact elementwise operations:

- `tree_sum` reduces a dimension by a fixed pairwise tree (index i paired
  with i + n/2), using only elementwise adds, whose bits do not depend on
  vectorisation or on the batch.
- `det_exp` computes exp with a Cody-Waite range reduction, a Horner
  polynomial and an exponent built from integer bits. torch's own `exp` on
  CPU takes a SIMD (Sleef) path for most elements and a scalar (libm) path for
  the tail of a loop, so one value can round differently depending on where
  it sits in the tensor.
- attention is split-KV with split size = the KV block size, splits aligned
  to absolute token positions; the max is exact in any order; the per-split
  sums use `tree_sum`, splits are accumulated left to right.

`NaiveKernels` uses `torch.matmul`, `torch.softmax`, `torch.exp`: the usual
way, and not batch-invariant (a 1-row product differs from the same row inside
a 48-row product). It exists as a negative control.

The attention interface reads the paged cache through per-sequence block
tables: tiles outside a query's window are never gathered, and masked slots
are replaced (not multiplied) by zero so poisoned storage outside the window
cannot leak in, while poisoned storage inside it propagates as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class AttnBatch:
    """Where each query token sits: its sequence, absolute position, and the tables.

    - `q_pos[t]`: absolute position of query token t (0-based).
    - `seq_index[t]`: row of `tables` holding token t's block table.
    - `tables`: (S, max_blocks) int64 block ids of one KV-cache group, 0-padded.
    - `window`: sliding window w (a query at p sees keys p-w+1..p) or None.
    - `block_size`: the group's block size (tokens per block).
    """

    q_pos: Tensor
    seq_index: Tensor
    tables: Tensor
    window: int | None
    block_size: int


class Kernels(Protocol):
    name: str

    def linear(self, x: Tensor, w: Tensor) -> Tensor: ...

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor: ...

    def sigmoid(self, x: Tensor) -> Tensor: ...

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnBatch) -> Tensor: ...


def tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over `dim` by a fixed pairwise tree; the order depends only on x.shape[dim]."""
    dim = dim % x.ndim
    n = x.shape[dim]
    while n > 1:
        h = n // 2
        s = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
        if n % 2:
            s = torch.cat([s, x.narrow(dim, 2 * h, 1)], dim)
        x = s
        n = x.shape[dim]
    return x.squeeze(dim)


_LOG2E = 1.4426950408889634
# Cody-Waite split of ln 2: the high part has few mantissa bits, so k * hi is exact.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.42860682030941723212e-6


def det_exp(x: Tensor) -> Tensor:
    """exp(x) from exact elementwise operations only (same bits wherever x sits).

    Finite inputs only; results below the smallest normal are flushed to 0.
    Accuracy is a few ulp, which is irrelevant here: determinism is the point.
    """
    if x.dtype == torch.float64:
        lo_clamp, hi_clamp, bias, shift, itype, degree = -708.0, 709.0, 1023, 52, torch.int64, 13
    else:
        lo_clamp, hi_clamp, bias, shift, itype, degree = -87.0, 88.0, 127, 23, torch.int32, 7
    underflow = x < lo_clamp
    xc = x.clamp(lo_clamp, hi_clamp)
    k = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    # Horner on the Taylor series of exp(r), |r| <= ln2/2.
    p = torch.full_like(r, 1.0 / math.factorial(degree))
    for i in range(degree - 1, -1, -1):
        p = p * r + 1.0 / math.factorial(i)
    scale = ((k.to(itype) + bias) << shift).view(x.dtype)
    out = p * scale
    return torch.where(underflow, torch.zeros_like(out), out)


class InvariantKernels:
    """Batch-invariant torch kernels (CPU and CUDA); see the module docstring."""

    name = "invariant"

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x (M, K) @ w (K, N) with a fixed K-reduction tree per output element."""
        return tree_sum(x.unsqueeze(2) * w.unsqueeze(0), dim=1)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        ms = tree_sum(x * x, dim=-1) / x.shape[-1]
        inv = 1.0 / torch.sqrt(ms + eps)  # sqrt and division are correctly rounded everywhere
        return x * inv.unsqueeze(-1) * weight

    def sigmoid(self, x: Tensor) -> Tensor:
        return 1.0 / (1.0 + det_exp(-x))

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnBatch) -> Tensor:
        """Paged attention, one query row at a time in effect.

        q: (T, H, dh); k_cache, v_cache: (num_blocks, bs, H, dh) views of the
        paged storage. Returns (T, H, dh). Split size = bs; split j of query t
        covers absolute positions [(t0+j)*bs, (t0+j+1)*bs) where t0 is the
        first block of the query's visible range.
        """
        bs = meta.block_size
        pos = meta.q_pos
        lo = pos - meta.window + 1 if meta.window is not None else torch.zeros_like(pos)
        lo = lo.clamp(min=0)
        t0 = lo // bs
        nt = pos // bs - t0 + 1
        n_splits = int(nt.max().item())
        j = torch.arange(n_splits, device=q.device)
        tile = t0.unsqueeze(1) + j.unsqueeze(0)  # (T, NT) absolute block index
        tile_ok = j.unsqueeze(0) < nt.unsqueeze(1)
        rows = meta.tables[meta.seq_index]  # (T, max_blocks)
        tile_c = torch.where(tile_ok, tile, torch.zeros_like(tile)).clamp(max=rows.shape[1] - 1)
        block_ids = torch.where(tile_ok, torch.gather(rows, 1, tile_c), torch.zeros_like(tile))
        kpos = tile.unsqueeze(2) * bs + torch.arange(bs, device=q.device)  # (T, NT, bs)
        valid = (
            tile_ok.unsqueeze(2) & (kpos >= lo.view(-1, 1, 1)) & (kpos <= pos.view(-1, 1, 1))
        )  # (T, NT, bs)
        k = k_cache[block_ids]  # (T, NT, bs, H, dh)
        v = v_cache[block_ids]
        vmask = valid.view(*valid.shape, 1, 1)
        k = torch.where(vmask, k, torch.zeros_like(k))
        v = torch.where(vmask, v, torch.zeros_like(v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = tree_sum(q.view(q.shape[0], 1, 1, *q.shape[1:]) * k, dim=-1) * scale  # (T, NT, bs, H)
        smask = valid.unsqueeze(-1)
        neg_inf = torch.full_like(s, float("-inf"))
        m = torch.where(smask, s, neg_inf).amax(dim=(1, 2), keepdim=True)  # exact in any order
        p = torch.where(smask, det_exp(torch.where(smask, s - m, torch.zeros_like(s))), torch.zeros_like(s))
        l_split = tree_sum(p, dim=2)  # (T, NT, H)
        o_split = tree_sum(p.unsqueeze(-1) * v, dim=2)  # (T, NT, H, dh)
        l_acc = l_split[:, 0]
        o_acc = o_split[:, 0]
        for i in range(1, n_splits):  # splits past a query's range add exact zeros
            l_acc = l_acc + l_split[:, i]
            o_acc = o_acc + o_split[:, i]
        return o_acc / l_acc.unsqueeze(-1)


class NaiveKernels:
    """The usual kernels (matmul, softmax, torch.exp): NOT batch-invariant. Negative control."""

    name = "naive"

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        return x @ w

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def sigmoid(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnBatch) -> Tensor:
        """Per sequence: gather the visible blocks, q @ K^T, softmax, @ V."""
        out = torch.empty_like(q)
        bs = meta.block_size
        scale = 1.0 / math.sqrt(q.shape[-1])
        for s_idx in torch.unique(meta.seq_index).tolist():
            sel = (meta.seq_index == s_idx).nonzero().squeeze(1)
            pos = meta.q_pos[sel]
            first = int(pos.min().item())
            last = int(pos.max().item())
            lo = max(0, first - meta.window + 1) if meta.window is not None else 0
            b0, b1 = lo // bs, last // bs
            ids = meta.tables[s_idx, b0 : b1 + 1]
            k = k_cache[ids].reshape(-1, *k_cache.shape[2:])  # (NK, H, dh)
            v = v_cache[ids].reshape(-1, *v_cache.shape[2:])
            kpos = torch.arange(b0 * bs, (b1 + 1) * bs, device=q.device)
            allowed = kpos.unsqueeze(0) <= pos.unsqueeze(1)
            if meta.window is not None:
                allowed &= kpos.unsqueeze(0) > (pos.unsqueeze(1) - meta.window)
            allowed &= kpos.unsqueeze(0) >= lo
            v = torch.where(allowed.any(0).view(-1, 1, 1), v, torch.zeros_like(v))
            qh = q[sel].transpose(0, 1)  # (H, n, dh)
            scores = (qh @ k.permute(1, 2, 0)) * scale  # (H, n, NK)
            scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[sel] = (probs @ v.transpose(0, 1)).transpose(0, 1)
        return out


def get_kernels(name: str) -> Kernels:
    """'invariant' (default) or 'naive'; 'triton' is handled by `triton_attention`."""
    if name == "invariant":
        return InvariantKernels()
    if name == "naive":
        return NaiveKernels()
    raise ValueError(f"kernels: expected 'invariant' or 'naive', got {name!r}")
