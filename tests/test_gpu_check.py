"""gpu_check on CPU: batch invariance, bitwise equivalence across cache modes, negative controls.

There is no GPU here: the CUDA device path is not run; the Triton kernel is
run under the Triton interpreter (TRITON_INTERPRET=1, a subprocess) only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu_check.cli import add_parser
from gpu_check.hybrid import HybridModel, ModelDims, SeqChunk
from gpu_check.kernels import AttnBatch, InvariantKernels, NaiveKernels, det_exp, tree_sum
from gpu_check.mutants import reuse_without_evict
from gpu_check.runner import Mode, default_config, default_modes, run_check
from gpu_check.workload import make_workload
from invariants.simulate.loop import LoopConfig
from invariants.targets.model_target import ModelTarget
from invariants.targets.reference import ReferenceTarget

ROOT = Path(__file__).resolve().parent.parent
SMALL = LoopConfig(token_budget=40, max_running=3, max_steps=20_000)


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------- kernels


def test_tree_sum_and_det_exp_are_accurate() -> None:
    x = torch.randn(5, 37, 3, dtype=torch.float64)
    assert torch.allclose(tree_sum(x, 1), x.sum(1))
    e = torch.linspace(-80, 80, 1001)
    assert torch.allclose(det_exp(e), torch.exp(e), rtol=1e-6, atol=0)
    assert det_exp(torch.tensor([-1e4]))[0] == 0.0


@pytest.mark.parametrize("kind", ["linear", "rmsnorm", "sigmoid"])
def test_invariant_rowwise_ops_alone_equal_in_batch_of_37(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, generator=g) * 3
    w = torch.randn(32, 96, generator=g)
    k = InvariantKernels()
    fn = {
        "linear": lambda t: k.linear(t, w),
        "rmsnorm": lambda t: k.rmsnorm(t, w[:, 0]),
        "sigmoid": k.sigmoid,
    }[kind]
    batch = fn(x)
    for i in range(37):
        assert _bits_equal(fn(x[i : i + 1]), batch[i : i + 1]), f"row {i}"


def test_naive_linear_is_not_batch_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, generator=g)
    w = torch.randn(32, 96, generator=g)
    batch = NaiveKernels().linear(x, w)
    differing = [
        i for i in range(37) if not _bits_equal(NaiveKernels().linear(x[i : i + 1], w), batch[i : i + 1])
    ]
    assert differing, "plain matmul happened to be batch-invariant on this machine"


def _paged(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nb, bs, H, dh = 24, 16, 2, 16
    page = torch.randn(nb, 2 * bs * H * dh + 5, generator=g)  # padded page: strided views, as in the engine
    buf = page[:, : 2 * bs * H * dh].view(nb, 2, bs, H, dh)
    tables = torch.tensor([[3, 5, 7, 9, 0, 0], [11, 12, 13, 14, 15, 16], [0, 0, 20, 21, 22, 0]])
    return buf[:, 0], buf[:, 1], tables


@pytest.mark.parametrize("window", [None, 24])
def test_invariant_attention_alone_equals_in_batch_of_37(window: int | None) -> None:
    kc, vc, tables = _paged()
    g = torch.Generator().manual_seed(3)
    seq = torch.tensor([i % 2 for i in range(37)])
    pos = torch.randint(0, 64, (37,), generator=g)
    q = torch.randn(37, 2, 16, generator=g)
    k = InvariantKernels()
    batch = k.attention(q, kc, vc, AttnBatch(pos, seq, tables, window, 16))
    for i in range(37):
        alone = k.attention(
            q[i : i + 1], kc, vc, AttnBatch(pos[i : i + 1], seq[i : i + 1], tables, window, 16)
        )
        assert _bits_equal(alone, batch[i : i + 1]), f"query {i}"
    # and it is attention: compare with a float64 reference
    ref = NaiveKernels().attention(
        q.double(), kc.double(), vc.double(), AttnBatch(pos, seq, tables, window, 16)
    )
    assert torch.allclose(batch.double(), ref, atol=1e-5)


def test_swa_attention_never_reads_outside_its_window() -> None:
    kc, vc, tables = _paged()
    q = torch.randn(1, 2, 16)
    meta = AttnBatch(torch.tensor([60]), torch.tensor([2]), tables, 24, 16)  # sees 37..60: blocks 2, 3
    before = InvariantKernels().attention(q, kc, vc, meta)
    kc[tables[2, :2]] = float("nan")  # blocks before the window (here null/0): poisoned
    vc[tables[2, :2]] = float("nan")
    kc[20, :5] = float("nan")  # positions 32..36 (table index 2 = block 20): outside the window
    vc[20, :5] = float("nan")
    after = InvariantKernels().attention(q, kc, vc, meta)
    assert _bits_equal(before, after)
    vc[20, 5] = float("nan")  # position 37: inside the window -> must show
    assert torch.isnan(InvariantKernels().attention(q, kc, vc, meta)).all()


def _model_step(kernels, chunks_spec):  # type: ignore[no-untyped-def]
    cfg = default_config(40)
    model = HybridModel(cfg, ModelDims(), seed=5, kernels=kernels)
    storage = model.new_storage(40)
    tokens = [int(t) for t in torch.randint(1, 64, (80,), generator=torch.Generator().manual_seed(4))]
    # prefill positions 0..47 once (tables: full 1-3, swa 4-6, mamba state at index 2 -> block 7)
    prefill = SeqChunk("a", tokens, 0, 48, ((1, 2, 3), (4, 5, 6), (0, 0, 7)), False)
    model.forward([prefill], storage)
    tables = ((1, 2, 3, 8), (0, 5, 6, 9), (0, 0, 7, 10))
    return model, storage, tokens, tables


@pytest.mark.parametrize("kernels", [InvariantKernels(), NaiveKernels()], ids=["invariant", "naive"])
def test_model_token_alone_vs_inside_batch_of_37(kernels) -> None:  # type: ignore[no-untyped-def]
    """The decode token at position 48 computed alone, then with 36 other tokens in the step."""
    model, storage, tokens, tables = _model_step(kernels, None)
    snapshot = [p.clone() for p in storage.pages]
    alone = model.forward([SeqChunk("a", tokens, 48, 49, tables, True)], storage)
    for p, s in zip(storage.pages, snapshot, strict=True):
        p.copy_(s)
    others = SeqChunk("b", tokens[::-1], 0, 36, ((11, 12, 13), (14, 15, 16), (0, 0, 17)), False)
    batch = model.forward([others, SeqChunk("a", tokens, 48, 49, tables, True)], storage)
    assert batch.layer_out.shape[0] == 37
    same = _bits_equal(alone.layer_out[0], batch.layer_out[36])
    if isinstance(kernels, InvariantKernels):
        assert same
        assert alone.next_tokens["a"] == batch.next_tokens["a"]
    else:
        assert not same, "the naive kernels happened to be batch-invariant for this token"


# ----------------------------------------------------------- equivalence


def _modes(base):  # type: ignore[no-untyped-def]
    return default_modes(base, intervals=[32])


def test_reference_target_all_modes_bit_identical() -> None:
    wl = make_workload(seed=7, sessions=4, turns=(2, 2))
    base = default_config(22)
    rep = run_check(ReferenceTarget, wl, base_config=base, modes=_modes(base), loop_config=SMALL)
    assert rep.ok, rep.table() + "\n" + "\n".join(r.detail for r in rep.results)
    assert [r.mode for r in rep.results] == ["off", "dense", "r0", "r32", "pinned"]
    assert rep.first_mismatch is None
    assert rep.tokens_checked > 1000
    off = rep.results[0].stats
    assert off is not None and off.accounting.preemptions > 0, "the pool is meant to force preemption"
    for r in rep.results[1:]:
        assert r.stats is not None and r.stats.accounting.hit_tokens > 0 and r.stats.storage.evictions > 0, (
            r.mode
        )
    pinned = rep.results[-1].stats
    assert pinned is not None and pinned.storage.max_pinned > 0


def test_model_target_all_modes_bit_identical() -> None:
    wl = make_workload(seed=3, sessions=3, turns=(2, 2))
    base = default_config(26)
    rep = run_check(ModelTarget, wl, base_config=base, modes=_modes(base), loop_config=SMALL)
    assert rep.ok, rep.table() + "\n" + "\n".join(r.detail for r in rep.results)


def test_negative_control_reuse_without_evicting_hash_is_a_mismatch() -> None:
    wl = make_workload(seed=7, sessions=4, turns=(2, 2))
    base = default_config(22)
    rep = run_check(reuse_without_evict, wl, base_config=base, modes=_modes(base), loop_config=SMALL)
    assert not rep.ok
    mm = rep.first_mismatch
    assert mm is not None, rep.table()
    assert mm.base_mode == "off" and mm.mode != "off"
    assert mm.describe().startswith(f"{mm.mode} vs off: request ")


def test_negative_control_naive_kernels_are_a_mismatch() -> None:
    wl = make_workload(seed=7, sessions=4, turns=(2, 2))
    base = default_config(22)
    rep = run_check(
        ReferenceTarget, wl, base_config=base, modes=_modes(base), loop_config=SMALL, kernels=NaiveKernels()
    )
    assert not rep.ok
    assert rep.first_mismatch is not None
    assert not rep.first_mismatch.nan  # a rounding difference, not a stale read


def test_a_caching_mode_without_hits_is_vacuous() -> None:
    wl = make_workload(seed=7, sessions=2, turns=(1, 1))
    base = default_config(40)
    modes = [
        Mode("off", {"enable_caching": False}, expect_hits=False),
        Mode("nohit", {"enable_caching": False}),  # claims to cache, serves nothing
    ]
    rep = run_check(ReferenceTarget, wl, base_config=base, modes=modes, loop_config=SMALL)
    assert [r.verdict for r in rep.results] == ["pass", "vacuous"]
    assert not rep.ok


def test_a_pool_too_small_for_one_request_is_a_fault_not_a_hang() -> None:
    wl = make_workload(seed=7, sessions=2, turns=(1, 1))
    base = default_config(6)  # every request needs more blocks than the whole pool
    rep = run_check(ReferenceTarget, wl, base_config=base, modes=_modes(base)[:2], loop_config=SMALL)
    assert [r.verdict for r in rep.results] == ["fault"], rep.table()
    assert "does not fit the pool of 6 blocks even alone" in rep.results[0].detail
    assert not rep.ok


def test_same_seed_same_verdict_and_figures() -> None:
    wl = make_workload(seed=11, sessions=2, turns=(2, 2))
    base = default_config(30)
    modes = _modes(base)[:3]
    a = run_check(ModelTarget, wl, base_config=base, modes=modes, loop_config=SMALL)
    b = run_check(
        ModelTarget,
        make_workload(seed=11, sessions=2, turns=(2, 2)),
        base_config=base,
        modes=modes,
        loop_config=SMALL,
    )
    assert a.ok and b.ok
    fa = [(r.verdict, r.tokens_checked, r.stats.accounting.hit_tokens if r.stats else 0) for r in a.results]
    fb = [(r.verdict, r.tokens_checked, r.stats.accounting.hit_tokens if r.stats else 0) for r in b.results]
    assert fa == fb


# ------------------------------------------------------------------ CLI


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["gpu-check", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA usage error")
def test_cli_cuda_without_cuda_is_bad_usage(capsys) -> None:  # type: ignore[no-untyped-def]
    args = _args("--device", "cuda")
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]


def test_cli_bad_sessions_is_bad_usage(capsys) -> None:  # type: ignore[no-untyped-def]
    args = _args("--sessions", "0")
    assert args.func(args) == 2
    assert "--sessions" in capsys.readouterr().err


def test_cli_quick_run_passes_and_prints_seed_and_table(capsys) -> None:  # type: ignore[no-untyped-def]
    args = _args("--quick", "--sessions", "2", "--seed", "3", "--target", "model")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "seed 3" in out and "gpu-check PASS" in out and "tokens checked:" in out
    assert "mode    verdict" in out and "hit adm" in out


def test_cli_naive_kernels_exit_1(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "trace.json"
    args = _args(
        "--quick", "--sessions", "2", "--kernels", "naive", "--target", "model", "--trace-out", str(trace)
    )
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "first mismatch: " in out and "gpu-check FAIL" in out
    assert trace.exists()


# ------------------------------------------------- Triton (interpreter) and imports


def _run_py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_check_imports_do_not_import_triton() -> None:
    proc = _run_py(
        """
        import sys
        import gpu_check.cli, gpu_check.runner, gpu_check.triton_kernels, gpu_check.bench  # noqa
        print("triton" in sys.modules)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_the_command_line_imports_torch_only_when_gpu_check_runs() -> None:
    """Every `kvretain` command builds the parser, gpu-check's subcommand included: that
    imports no torch (2-3 s of CPU in each command that never needs it). Control: what
    gpu-check runs does import it, so the probe would see it."""
    proc = _run_py(
        """
        import sys
        from invariants.cli.main import build_parser
        build_parser().parse_args(["gpu-check", "--quick"])
        print("torch" in sys.modules)
        import gpu_check.runner  # noqa
        print("torch" in sys.modules)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_triton_kernel_under_interpreter_matches_torch_and_is_invariant() -> None:
    pytest.importorskip("triton")
    proc = _run_py(
        """
        import torch
        from gpu_check.kernels import AttnBatch, InvariantKernels
        from gpu_check.triton_kernels import paged_attention_triton
        g = torch.Generator().manual_seed(0)
        nb, bs, H, dh = 24, 16, 2, 16
        page = torch.randn(nb, 2 * bs * H * dh + 8, generator=g)
        buf = page[:, : 2 * bs * H * dh].view(nb, 2, bs, H, dh)
        kc, vc = buf[:, 0], buf[:, 1]
        tables = torch.tensor([[3, 5, 7, 9, 0, 0], [11, 12, 13, 14, 15, 16], [0, 0, 20, 21, 22, 0]])
        seq = torch.tensor([i % 2 for i in range(37)])
        pos = torch.randint(0, 64, (37,), generator=g)
        q = torch.randn(37, H, dh, generator=g)
        for w in (None, 24):
            meta = AttnBatch(pos, seq, tables, w, bs)
            tri = paged_attention_triton(q, kc, vc, meta)
            ref = InvariantKernels().attention(q, kc, vc, meta)
            assert (tri - ref).abs().max() < 1e-5, (tri - ref).abs().max()
            for i in (0, 17, 36):
                one = paged_attention_triton(q[i:i+1], kc, vc, AttnBatch(pos[i:i+1], seq[i:i+1], tables, w, bs))
                assert torch.equal(one.view(torch.int32), tri[i:i+1].view(torch.int32)), i
        print("ok")
        """,
        TRITON_INTERPRET="1",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
