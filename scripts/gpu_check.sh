#!/usr/bin/env bash
# The checks that need a GPU, in one run meant to take under 10 minutes on one GPU (not yet timed on
# one): scripts/gpu_check.py prints
# a PASS or FAIL line with its figure for every claim the docs make about GPUs (attention kernels,
# train-step MFU and memory, a profiled step, FP8, decode speed, int8 and offload savings), then
# scripts/bench_hf.py runs a Llama-3.2-1B-shaped model beside transformers where transformers is
# installed. Packages the GPU image lacks come as wheels in .whl/ (see docs/benchmarks.md, "GPU");
# the output goes to $OUT when set, else to /tmp. Extra arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
status=0
python3 scripts/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.txt" || status=$?
if python3 -c "import transformers, torch" 2>/dev/null; then
    python3 scripts/bench_hf.py 2>&1 | tee "${OUT:-/tmp}/bench_hf.txt" || status=$?
else
    echo "bench_hf: transformers and torch are not installed here (pip install -e '.[hf]'), so it did not run"
fi
exit "$status"
