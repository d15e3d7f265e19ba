#!/usr/bin/env bash
# kvguard's FP8 export inside the real vLLM (the venv of `make engines`), on SmolLM2:
#   benchmarks/engine_check.sh [PROFILE]     (default benchmarks/profiles/smollm2-135m-64, calibrated if missing)
# 1. exports the profile's FP8 scales, builds the served model folder and reads every attention layer's
#    k_scale / v_scale back from vLLM (benchmarks/results/smollm2-135m-engine-check.md);
# 2. scores 1,024 evaluation tokens teacher-forced in vLLM (prompt_logprobs) with its own cache and with the
#    FP8 export, beside kvguard's fp16 / fp8 prediction (benchmarks/results/smollm2-135m-engine-ppl.md). vLLM's
#    CPU build runs an FP8 cache only on x86 with AVX-512 or AMX; elsewhere the table says so.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
profile=${1:-benchmarks/profiles/smollm2-135m-64}
out=benchmarks/results
export_dir=benchmarks/profiles/smollm2-135m-vllm-export
make engines
[[ -d "$profile" ]] || .venv/bin/kvguard calibrate --model smollm2-135m --samples 64 --out "$profile"
.venv/bin/kvguard export --profile "$profile" --format vllm --out "$export_dir" --check \
    --engine-python .venv-engines/bin/python 2>&1 | grep -v -E '^(INFO|WARNING|\(EngineCore)' | tee "$out/smollm2-135m-engine-check.md"
.venv/bin/python benchmarks/engine_ppl.py --export "$export_dir" --served "$export_dir/served-model" --tokens 1024 \
    | tee "$out/smollm2-135m-engine-ppl.md"
