#!/usr/bin/env bash
# Everything oslo checks on a CUDA GPU: the CUDA tests, then the GPU benchmarks.
#
#   bash benchmarks/gpu_session.sh [all|tests|bench] [OUTPUT_DIR]     # default: all, $OUT or ./gpu_output
#
# Each step has its own time limit and writes its log to OUTPUT_DIR; a failing step does not stop the
# next. The test files run at once; the benchmarks (benchmarks/fused_loss.py's GPU part,
# benchmarks/kernels_gpu.py, then benchmarks/gpu_step.py) run alone, one after the other. Runs from a
# checkout without installing it (PYTHONPATH=.). GPU_STEP_BUDGET (seconds, default 300) bounds benchmarks/gpu_step.py; GPU_STEP_ARGS adds
# arguments to it (--skip-compile: the eager variants and generation alone, about a minute). The tests that
# fork ranks run in their own pytest process: a parent that has used CUDA cannot fork CUDA users.
set -u
cd "$(dirname "$0")/.."
python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null || {
    echo "gpu_session.sh: no CUDA GPU visible to torch; nothing run" >&2
    exit 2
}
part="${1:-all}"
out="${2:-${OUT:-gpu_output}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    echo "=== $name (limit ${seconds}s): $*"
    timeout --kill-after=5 "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
    tail -n 12 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/device.txt"

if [ "$part" != bench ]; then  # six pytest processes at once: the GPU and 16 cores hold them, nothing is timed
    step tests_device 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_device_dtype.py -k cuda &
    step tests_gloo_cuda 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_cuda_gloo.py &
    # Inductor on CUDA traces a model once per shape and mode (three inductor compiles; 31 s on the 2-core CPU VM).
    step tests_compile_cuda 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_compile.py -k cuda &
    # The kernel tests in three parts: on a fresh machine Triton builds a launcher per kernel (one process took
    # over 200 s; three took 114 s on an H100).
    step tests_kernels_ngram 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_ngram.py &
    step tests_kernels_softmax 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_softmax.py &
    step tests_kernels_rest 200 python3 -m pytest -q -p no:cacheprovider tests/kernels \
        --ignore=tests/kernels/test_ngram.py --ignore=tests/kernels/test_softmax.py &
    wait
fi
if [ "$part" != tests ]; then
    step fused_loss 120 python3 benchmarks/fused_loss.py --device cuda --part d --n-embd 1024 \
        --chunk-rows 256 512 2048 4096
    step kernels_gpu 90 python3 benchmarks/kernels_gpu.py --quick
    budget="${GPU_STEP_BUDGET:-300}"
    # shellcheck disable=SC2086  # GPU_STEP_ARGS: extra arguments, word-split on purpose (--skip-compile, say)
    step gpu_step $((budget + 60)) python3 benchmarks/gpu_step.py --budget-s "$budget" --json "$out/gpu_step.json" \
        ${GPU_STEP_ARGS:-}
fi
