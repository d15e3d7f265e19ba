#!/usr/bin/env bash
# The run-time feedback loop's figures, for one model and its calibration profile:
#   benchmarks/live.sh smollm2-135m benchmarks/profiles/smollm2-135m-512
# Writes benchmarks/results/<model>-live*.{md,json}. Evaluation split only; thresholds come from the profile.
set -euo pipefail
model=$1
profile=$2
out=benchmarks/results
kv=".venv/bin/kvguard"
mkdir -p "$out"
# Trigger rate and memory on normal text with the calibrated plan, beside the same plan without the loop.
$kv eval --model "$model" --profile "$profile" --methods kvguard,kvguard-live --corpus prose,code,dialog \
    --tokens 2048 --json "$out/$model-live.json" | tee "$out/$model-live.md"
# An aggressive plan (all-INT2 in the profile's layout) with and without the loop.
$kv eval --model "$model" --profile "$profile" --methods int2,kvguard-live:int2 --corpus prose,code \
    --tokens 2048 --json "$out/$model-live-int2.json" | tee "$out/$model-live-int2.md"
# Pass-key retrieval at 4,096 tokens: the aggressive plan with and without the loop.
$kv eval --model "$model" --profile "$profile" --task passkey --methods int2,kvguard-live:int2 --lengths 4096 \
    --depths 0.1,0.5,0.9 --trials 2 --json "$out/$model-live-passkey.json" | tee "$out/$model-live-passkey.md"
# Decode speed with the monitor on (kvguard-live) and off (kvguard, the same plan and cache).
$kv eval --model "$model" --profile "$profile" --task speed --methods kvguard,kvguard-live --contexts 1024 \
    --new-tokens 64 --json "$out/$model-live-speed.json" | tee "$out/$model-live-speed.md"
# How well each signal predicts real error.
.venv/bin/python benchmarks/monitor_signal.py --model "$model" --profile "$profile" --tokens 2048 \
    --json "$out/$model-monitor-signal.json" | tee "$out/$model-monitor-signal.md"
