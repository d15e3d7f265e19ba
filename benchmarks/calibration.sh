#!/usr/bin/env bash
# Calibrates both embedded models and evaluates the chosen plans next to the uncalibrated methods on the
# eval split (never calibration text). Writes benchmarks/results/<model>-calibrate*.log / -kvguard*.md|json
# and the profiles under benchmarks/profiles/ (not committed). Quick profiles: ~8 min (SmolLM2) and ~15 min
# (Gemma 3) on 2 CPU cores; FULL=1 adds the 5,000-sample SmolLM2 calibration (~50 min).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
KV=.venv/bin/kvguard
OUT=benchmarks/results
PROFILES=benchmarks/profiles
mkdir -p "$OUT" "$PROFILES"

calibrate() {  # model budget samples
  local log="$OUT/$1-calibrate-$3.log"
  # Progress bars go to the terminal only; the log keeps the stage lines, the ranking and the timing.
  { /usr/bin/time -f "wall %e s, max RSS %M KiB" $KV calibrate --model "$1" --samples "$3" --memory-budget "$2" \
      --out "$PROFILES/$1-$3" 2>&1 | tr '\r' '\n' | grep -v -E '(it/s|s/it|/s|s/batch|s/plan|s/tier)\]|^\s*$' ; } 2>&1 | tee "$log"
}

# SmolLM2's uniform INT4 takes 0.344 of the FP16 bytes at 2,048 tokens: a 0.34 budget asks for a plan that
# is at most that size. Gemma 3's uniform INT4 takes 0.404 (its sliding layers keep a 512-token window):
# 0.40 is the issue's "at least 60 % saved".
calibrate smollm2-135m 0.34 512
calibrate gemma3-270m 0.40 512
for model in smollm2-135m gemma3-270m; do
  $KV eval --model "$model" --profile "$PROFILES/$model-512" --methods fp16,int4,kivi-4,hf-quanto-4,kvguard \
    --corpus prose,code --tokens 2048 --json "$OUT/$model-kvguard.json" | tee "$OUT/$model-kvguard.md"
  $KV report --profile "$PROFILES/$model-512" --out "$OUT/report-$model"
done
if [[ "${FULL:-0}" == 1 ]]; then
  calibrate smollm2-135m 0.34 5000
fi
# The run-time feedback loop over those profiles (trigger rate, aggressive plan, pass key, speed, signal).
for model in smollm2-135m gemma3-270m; do
  benchmarks/live.sh "$model" "$PROFILES/$model-512"
done
