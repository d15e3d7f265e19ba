#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run, each step bounded so the whole fits a short lease:
#   1. tests/test_triton_attention.py with the kernels compiled on the GPU (TRITON_INTERPRET=0), not interpreted;
#   2. benchmarks/triton_decode.py: the INT4 launch sweep at 32k tokens, then decode attention with the best launch at
#      8k and 32k tokens, batch 1 and 64, INT4/3/2/8, with CUDA-graph rows.
# Usage: benchmarks/gpu_checks.sh OUT_DIR    (PYTHON: a Python with CUDA torch, Triton and transformers 5.24;
# default python3). Each step's log and the benchmark's JSON go to OUT_DIR; the exit status is the first failure's.
# It needs nothing else of kvguard's install (src/ goes on PYTHONPATH). On a GPU machine that cannot reach an index,
# bring transformers' wheel (`pip download --no-deps transformers==5.24.0`) and install it first, e.g.
#   pip install --no-deps --target /tmp/site transformers-5.24.0-py3-none-any.whl && export PYTHONPATH=/tmp/site
# (the H200 run in benchmarks/README.md did that, with the machine's own torch 2.11 and Triton 3.6).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_checks.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__,
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name())" 2>&1 | tee -a "$out/gpu.txt"
timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py 2>&1 | tee "$out/tests.log" \
    || status=${status/#0/1}
timeout 320 "$py" benchmarks/triton_decode.py --contexts 8192,32768 --precisions int4,int3,int2,int8 \
    --batches 1,64 --graphs --sweep --json "$out/triton_decode.json" 2>&1 | tee "$out/triton_decode.log" \
    || status=${status/#0/2}
exit "$status"
