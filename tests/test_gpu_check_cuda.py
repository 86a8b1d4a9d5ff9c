"""gpu_check on CUDA: the kernels the device path runs, and the equivalence check on them.

Skipped, with the reason, on a machine without CUDA (CI has none); run on a GPU by
`gpu_check/device_checks.sh`, which records the figures. The CPU file
(`test_gpu_check.py`) holds the same properties for the CPU kernels.
"""

from __future__ import annotations

import pytest
import torch

from gpu_check.kernels import AttnBatch, InvariantKernels
from gpu_check.mutants import reuse_without_evict
from gpu_check.runner import default_config, default_modes, run_check
from gpu_check.workload import make_workload
from invariants.simulate.loop import LoopConfig
from invariants.targets.model_target import ModelTarget
from invariants.targets.reference import ReferenceTarget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = LoopConfig(token_budget=40, max_running=3, max_steps=20_000)
CUDA = "cuda"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _paged(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nb, bs, H, dh = 24, 16, 2, 16
    page = torch.randn(nb, 2 * bs * H * dh + 5, generator=g).to(CUDA)  # padded page: strided views
    buf = page[:, : 2 * bs * H * dh].view(nb, 2, bs, H, dh)
    tables = torch.tensor([[3, 5, 7, 9, 0, 0], [11, 12, 13, 14, 15, 16], [0, 0, 20, 21, 22, 0]]).to(CUDA)
    return buf[:, 0], buf[:, 1], tables


def _kernels() -> list[object]:
    out: list[object] = [InvariantKernels()]
    try:
        from gpu_check.triton_kernels import TritonKernels, triton_usable
    except ImportError:
        return out
    if triton_usable(CUDA)[0]:
        out.append(TritonKernels())
    return out


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kernels", _kernels(), ids=lambda k: type(k).__name__)
def test_attention_alone_equals_in_batch_of_37_on_cuda(kernels, window: int | None) -> None:  # type: ignore[no-untyped-def]
    kc, vc, tables = _paged()
    g = torch.Generator().manual_seed(3)
    seq = torch.tensor([i % 2 for i in range(37)]).to(CUDA)
    pos = torch.randint(0, 64, (37,), generator=g).to(CUDA)
    q = torch.randn(37, 2, 16, generator=g).to(CUDA)
    batch = kernels.attention(q, kc, vc, AttnBatch(pos, seq, tables, window, 16))
    for i in range(37):
        alone = kernels.attention(
            q[i : i + 1], kc, vc, AttnBatch(pos[i : i + 1], seq[i : i + 1], tables, window, 16)
        )
        assert _bits_equal(alone, batch[i : i + 1]), f"query {i}"
    ref = InvariantKernels().attention(
        q.cpu(), kc.cpu(), vc.cpu(), AttnBatch(pos.cpu(), seq.cpu(), tables.cpu(), window, 16)
    )
    assert (batch.cpu() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["linear", "rmsnorm", "sigmoid"])
def test_invariant_rowwise_ops_alone_equal_in_batch_of_37_on_cuda(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 32, generator=g) * 3).to(CUDA)
    w = torch.randn(32, 96, generator=g).to(CUDA)
    k = InvariantKernels()
    fn = {
        "linear": lambda t: k.linear(t, w),
        "rmsnorm": lambda t: k.rmsnorm(t, w[:, 0]),
        "sigmoid": k.sigmoid,
    }[kind]
    batch = fn(x)
    for i in range(37):
        assert _bits_equal(fn(x[i : i + 1]), batch[i : i + 1]), f"row {i}"


@pytest.mark.parametrize("factory", [ReferenceTarget, ModelTarget], ids=["reference", "model"])
@pytest.mark.parametrize("kernels", _kernels(), ids=lambda k: type(k).__name__)
def test_all_modes_bit_identical_on_cuda(factory, kernels) -> None:  # type: ignore[no-untyped-def]
    wl = make_workload(seed=7, sessions=4, turns=(2, 2))
    base = default_config(22)
    modes = default_modes(base, intervals=[32])
    rep = run_check(
        factory, wl, base_config=base, modes=modes, loop_config=SMALL, kernels=kernels, device=CUDA
    )
    assert rep.ok, rep.table() + "\n" + "\n".join(r.detail for r in rep.results)
    assert rep.tokens_checked > 1000


def test_negative_control_reuse_without_evicting_hash_is_a_mismatch_on_cuda() -> None:
    wl = make_workload(seed=7, sessions=4, turns=(2, 2))
    base = default_config(22)
    kernels = _kernels()[-1]
    rep = run_check(
        reuse_without_evict,
        wl,
        base_config=base,
        modes=default_modes(base, intervals=[32]),
        loop_config=SMALL,
        kernels=kernels,  # type: ignore[arg-type]
        device=CUDA,
    )
    assert not rep.ok
    assert rep.first_mismatch is not None, rep.table()
