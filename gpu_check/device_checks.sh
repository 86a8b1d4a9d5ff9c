#!/usr/bin/env bash
# The CUDA checks of gpu_check in one run, for a machine with a GPU (no network needed:
# torch, triton, pytest and hypothesis come with the machine's image; kvretain runs from
# the checkout). Writes its logs under ${OUT:-gpu-check-out}; exit 0 only when every
# check gave its expected verdict (the naive kernels are the negative control: a pass
# there is recorded, not hidden).
set -u
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=dev
py=${PYTHON:-python3}
status=0
step() {  # step NAME EXPECTED_RC CMD...
    local name=$1 want=$2; shift 2
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ "$rc" = "$want" ] || { verdict=UNEXPECTED; status=1; }
    printf '%-22s exit %-3s (expected %s) %4ss  %s\n' "$name" "$rc" "$want" $((SECONDS - t0)) "$verdict" | tee -a "$out/summary.txt"
    tail -n 4 "$out/$name.log" | sed 's/^/    /'
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/summary.txt"
step pytest-cuda 0 $py -m pytest -p no:cacheprovider -q -o addopts= tests/test_gpu_check_cuda.py tests/test_gpu_check.py
gc="$py -m gpu_check.cli gpu-check --device cuda"
step triton-reference 0 $gc --bench
step triton-model 0 $gc --target model
step triton-seed1 0 $gc --seed 1 --sessions 16
step invariant-reference 0 $gc --kernels invariant
step naive-control 1 $gc --kernels naive --trace-out "$out/naive-trace.json"
# vLLM's real scheduler as the engine (the tables vLLM ships), where vLLM is installed.
if $py -c "import vllm" >/dev/null 2>&1; then
    step triton-vllm-scheduler 0 $gc --target vllm
else
    echo "triton-vllm-scheduler  skipped: vllm is not installed in this environment" | tee -a "$out/summary.txt"
fi
exit $status
