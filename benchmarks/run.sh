#!/usr/bin/env bash
# Regenerates every table in benchmarks/README.md (results/*.md, results/*.json). About an hour on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
KV=.venv/bin/kvguard
OUT=benchmarks/results
mkdir -p "$OUT"

.venv/bin/python benchmarks/foundation.py --models smollm2-135m,gemma3-270m | tee "$OUT/foundation.md"
for model in smollm2-135m gemma3-270m; do
  $KV eval --model "$model" --corpus prose,code --tokens 2048 --json "$OUT/$model-ppl.json" | tee "$OUT/$model-ppl.md"
done
$KV eval --model smollm2-135m --task speed --contexts 1024,4096 --new-tokens 64 \
  --methods fp16,int8,int4,kivi-4,kivi-2,hf-quanto-4,hf-quanto-2,hf-hqq-4 \
  --json "$OUT/smollm2-135m-speed.json" | tee "$OUT/smollm2-135m-speed.md"
$KV eval --model smollm2-135m --task passkey --lengths 512,1024,4096 --depths 0.1,0.5,0.9 --trials 2 \
  --methods fp16,int4,kivi-2,hf-quanto-4 --json "$OUT/smollm2-135m-passkey.json" | tee "$OUT/smollm2-135m-passkey.md"
$KV eval --model smollm2-135m --task recall --distances 512,1024,2048 --trials 3 --methods fp16,int4,int2 \
  --json "$OUT/smollm2-135m-recall.json" | tee "$OUT/smollm2-135m-recall.md"
# Not run here: benchmarks/engine_check.sh (needs `make engines`, 3.5 GB) and benchmarks/engine_skip.py (needs
# calibrated profiles); their tables are in benchmarks/README.md under "Inside the engines".
