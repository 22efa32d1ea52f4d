#!/usr/bin/env bash
# The checks that need a GPU, in one short run, most wanted first: a Llama-3.2-1B-shaped model
# converted both ways and run beside transformers on the GPU (scripts/bench_hf.py), train-step MFU
# per remat policy and the compiler's memory estimate against the measured peak
# (scripts/bench_gpu.py), FP8 projections' error, bf16-vs-FP8 step time on the 1B config and a
# count of the cuBLASLt FP8 GEMMs in the optimized HLO (scripts/bench_fp8.py, which fails when a
# projection is not one), and the fused attention kernels against XLA attention
# (scripts/bench_attention.py), and the serving engine's Pallas paged-attention kernel against its
# XLA path (tests/unit/test_engine.py, which needs pytest there). Packages the GPU image lacks come as wheels in .whl/ (see
# docs/benchmarks.md, "GPU"); results go to $OUT when set, else to stdout only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
python3 scripts/bench_hf.py 2>&1 | tee "${OUT:-/tmp}/bench_hf.txt"
python3 scripts/bench_gpu.py "$@" 2>&1 | tee "${OUT:-/tmp}/bench_gpu.txt"
python3 scripts/bench_fp8.py --config configs/1b.py --batch 8 --seq 2048 --steps 5 2>&1 | tee "${OUT:-/tmp}/bench_fp8.txt"
python3 scripts/bench_attention.py 2>&1 | tee "${OUT:-/tmp}/bench_attention.txt"
python3 scripts/bench_attention.py --kv-heads 4 2>&1 | tee -a "${OUT:-/tmp}/bench_attention.txt"
# The serving engine's Pallas paged-attention kernel on the GPU against its XLA path (fp32 and
# int8 pages): the test that runs it in the Pallas interpreter on CPU runs the kernel on a GPU.
if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_engine.py -k pallas_paged_kernel 2>&1 | tee "${OUT:-/tmp}/paged_attention.txt"
else
    echo "paged attention: pytest is not installed here, so its GPU check did not run" | tee "${OUT:-/tmp}/paged_attention.txt"
fi
