#!/usr/bin/env bash
# Regenerates the tables of benchmarks/README.md into benchmarks/results/, one section at a time or all of them:
#   benchmarks/run.sh                  # every section below, in order (several hours on 2 CPU cores)
#   benchmarks/run.sh quality loop     # some sections
#   benchmarks/run.sh --help           # the sections
# Profiles go to benchmarks/profiles/ (not committed); the sections after `calibrate` need its profiles. `engines`
# needs `make engines` (it is skipped without .venv-engines), `llamacpp` needs `make peers`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
KV=.venv/bin/kvguard
PY=.venv/bin/python
OUT=benchmarks/results
PROFILES=benchmarks/profiles
MODELS=(smollm2-135m gemma3-270m)
mkdir -p "$OUT" "$PROFILES"

# 0.75 / 0.60 / 0.45 x each model's uniform-int4 bytes at 2,048 tokens (0.3447 and 0.4054 of FP16).
declare -A TARGETS=([smollm2-135m]="kvguard@0.2585,kvguard@0.2068,kvguard@0.1551"
                    [gemma3-270m]="kvguard@0.3040,kvguard@0.2432,kvguard@0.1824")
declare -A BUDGET=([smollm2-135m]=0.34 [gemma3-270m]=0.40)
declare -A AGGRESSIVE=([smollm2-135m]=kvguard@0.22 [gemma3-270m]=kvguard@0.24)

quality() {  # Quality through the cache, uncalibrated methods and peers
  for m in "${MODELS[@]}"; do
    $KV eval --model "$m" --corpus prose,code --tokens 2048 --json "$OUT/$m-ppl.json" | tee "$OUT/$m-ppl.md"
  done
}

calibrate() {  # the 512-sample profiles every later section reads (logs: results/<m>-calibrate-512.log)
  for m in "${MODELS[@]}"; do
    { /usr/bin/time -f "wall %e s, max RSS %M KiB" $KV calibrate --model "$m" --samples 512 \
        --memory-budget "${BUDGET[$m]}" --out "$PROFILES/$m-512" 2>&1 | tr '\r' '\n' \
        | grep -v -E '(it/s|s/it|/s|s/batch|s/plan|s/tier)\]|^\s*$' ; } 2>&1 | tee "$OUT/$m-calibrate-512.log"
  done
}

frontier() {  # Calibrated plans and the low-bit frontier
  for m in "${MODELS[@]}"; do
    $KV eval --model "$m" --profile "$PROFILES/$m-512" --methods "fp16,int4,kvguard,${TARGETS[$m]}" \
      --corpus prose,code,dialog --tokens 2048 --json "$OUT/$m-frontier.json" | tee "$OUT/$m-frontier.md"
    $PY benchmarks/frontier.py --check "$OUT/$m-frontier.json" "$OUT/$m-ppl.json" "$OUT/$m-llamacpp.json" \
      | tee "$OUT/$m-frontier-check.md"
  done
}

llamacpp() {  # llama.cpp's KV-cache types on the same tokens
  for m in "${MODELS[@]}"; do
    $KV eval --model "$m" --corpus prose,code,dialog --tokens 2048 \
      --methods llamacpp-f16,llamacpp-q8_0,llamacpp-q5_0,llamacpp-q4_1,llamacpp-q4_0,llamacpp-iq4_nl,llamacpp-q8_0-q4_0 \
      --json "$OUT/$m-llamacpp.json" | tee "$OUT/$m-llamacpp.md"
  done
}

loop() {  # The feedback loop: over the calibrated plan, and over an aggressive plan with the backing tier
  for m in "${MODELS[@]}"; do
    $KV eval --model "$m" --profile "$PROFILES/$m-512" --methods kvguard,kvguard-live --corpus prose,code,dialog \
      --tokens 2048 --json "$OUT/$m-live.json" | tee "$OUT/$m-live.md"
  done
  $PY benchmarks/backing.py --model smollm2-135m --profile "$PROFILES/smollm2-135m-512" --base kvguard@0.22 \
    --corpus prose,code,dialog --tokens 2048 --variants restore,reencode --json "$OUT/smollm2-135m-backing.json" \
    | tee "$OUT/smollm2-135m-backing.md"
  $PY benchmarks/backing.py --model gemma3-270m --profile "$PROFILES/gemma3-270m-512" --base kvguard@0.24 \
    --corpus prose,code,dialog --tokens 2048 --variants reencode --json "$OUT/gemma3-270m-backing.json" \
    | tee "$OUT/gemma3-270m-backing.md"
}

speed() {  # Decode speed: side by side in one process, then each method in its own process beside llama.cpp
  for context in 4096 8192; do
    $PY benchmarks/fused_decode.py --context "$context" --steps 32 --precisions fp16,int4,int3,int2 \
      | tee "$OUT/smollm2-135m-fused-$context.md"
    $PY benchmarks/fused_decode.py --context "$context" --steps 32 --precisions fp16,int2,kvguard,kvguard@0.22 \
      --profile "$PROFILES/smollm2-135m-512" | tee "$OUT/smollm2-135m-fused-plans-$context.md"
  done
  $KV eval --model smollm2-135m --task speed --contexts 4096,8192 --new-tokens 64 \
    --methods fp16,int4,int2,kvguard,kvguard@0.22,kvguard-live,llamacpp-f16,llamacpp-q4_0 \
    --profile "$PROFILES/smollm2-135m-512" --json "$OUT/smollm2-135m-speed.json" | tee "$OUT/smollm2-135m-speed.md"
}

memory() {  # Memory and capacity: the process against the stored bytes, the largest batch, the loop's tiers, speed
  $PY benchmarks/memory.py --model smollm2-135m --batch 8 --context 4096 --methods fp16,int4,kvguard,kvguard@0.22 \
    --profile "$PROFILES/smollm2-135m-512" --json "$OUT/smollm2-135m-memory.json" | tee "$OUT/smollm2-135m-memory.md"
  $KV eval --model smollm2-135m --profile "$PROFILES/smollm2-135m-512" --task capacity --no-check \
    --methods fp16,int4,kvguard,kvguard@0.22 --json "$OUT/smollm2-135m-capacity.json" | tee "$OUT/smollm2-135m-capacity.md"
  $KV eval --model smollm2-135m --profile "$PROFILES/smollm2-135m-512" --methods kvguard@0.22,kvguard-live:kvguard@0.22 \
    --corpus prose --tokens 4096 --json "$OUT/smollm2-135m-live-4096.json" | tee "$OUT/smollm2-135m-live-4096.md"
  $KV eval --model smollm2-135m --profile "$PROFILES/smollm2-135m-512" --task speed --contexts 4096,8192 \
    --new-tokens 32 --rounds 3 --methods fp16,int4,kvguard --json "$OUT/smollm2-135m-speed-memory.json" \
    | tee "$OUT/smollm2-135m-speed-memory.md"
}

serving() {  # Serving many at once: the real server on loopback, driven by the OpenAI client
  $PY benchmarks/serve.py --table batching --profile "$PROFILES/smollm2-135m-512" --requests 16 --prompt-tokens 512 \
    --new-tokens 256 --json "$OUT/smollm2-135m-serve-batching.json" | tee "$OUT/smollm2-135m-serve-batching.md"
  $PY benchmarks/serve.py --table churn --profile "$PROFILES/smollm2-135m-512" --requests 64 --prompt-tokens 128 \
    --new-tokens 64 --json "$OUT/smollm2-135m-serve-churn.json" | tee "$OUT/smollm2-135m-serve-churn.md"
}

recall() {  # Long-range recall, and the pass key
  $KV eval --model smollm2-135m --task recall --distances 512,1024,2048 --trials 3 --methods fp16,int4,int2 \
    --json "$OUT/smollm2-135m-recall.json" | tee "$OUT/smollm2-135m-recall.md"
  $KV eval --model smollm2-135m --profile "$PROFILES/smollm2-135m-512" --task recall --distances 1024,2048 \
    --trials 10 --methods "fp16,${AGGRESSIVE[smollm2-135m]},kvguard-live:${AGGRESSIVE[smollm2-135m]}" \
    --json "$OUT/smollm2-135m-recall-live.json" | tee "$OUT/smollm2-135m-recall-live.md"
  $KV eval --model smollm2-135m --task passkey --lengths 512,1024,4096 --depths 0.1,0.5,0.9 --trials 2 \
    --methods fp16,int4,kivi-2,hf-quanto-4 --json "$OUT/smollm2-135m-passkey.json" | tee "$OUT/smollm2-135m-passkey.md"
}

qwen() {  # Qwen2.5-Coder-0.5B (key outliers): calibration time, plan and frontier against the peers, with tails
  local m=qwen2.5-coder-0.5b
  { /usr/bin/time -f "wall %e s, max RSS %M KiB" $KV calibrate --model "$m" --samples 512 --out "$PROFILES/$m-512" 2>&1 \
      | tr '\r' '\n' | grep -v -E '(it/s|s/it|/s|s/batch|s/plan|s/tier)\]|^\s*$' ; } 2>&1 | tee "$OUT/$m-calibrate-512.log"
  $KV eval --model "$m" --profile "$PROFILES/$m-512" --corpus prose,code,dialog --tokens 2048 \
    --methods fp16,int4,int3,int3+rot,int3+prerope,kivi-4,hf-quanto-4,kvguard,kvguard@0.2585,kvguard@0.2585/p99,kvguard@0.2068 \
    --json "$OUT/$m-frontier.json" | tee "$OUT/$m-frontier.md"
  $KV eval --model "$m" --corpus prose,code,dialog --tokens 2048 --methods llamacpp-f16,llamacpp-q4_0 \
    --json "$OUT/$m-llamacpp.json" | tee "$OUT/$m-llamacpp.md"
  $KV eval --model "$m" --profile "$PROFILES/$m-512" --corpus prose,code,dialog --tokens 2048 \
    --methods fp16,int3+rot+prerope,kvguard@0.2585+postrope,kvguard@0.3605 \
    --json "$OUT/$m-ablation.json" | tee "$OUT/$m-ablation.md"   # keys before / after RoPE at the same bytes
  $PY benchmarks/frontier.py --check "$OUT/$m-frontier.json" "$OUT/$m-ablation.json" "$OUT/$m-llamacpp.json" \
    | tee "$OUT/$m-frontier-check.md"
}

long() {  # Long context: 8,192 tokens through the calibrated plans (the models with the positions; needs their profiles)
  for m in gemma3-270m qwen2.5-coder-0.5b; do
    { /usr/bin/time -f "wall %e s, max RSS %M KiB" $KV eval --model "$m" --profile "$PROFILES/$m-512" \
        --corpus prose,code,dialog --tokens 8192 --methods fp16,int4,kvguard --json "$OUT/$m-8192.json" ; } 2>&1 \
      | tr '\r' '\n' | grep -v -E '(it/s|s/it|/s|s/chunk|s/tok)\]|^\s*$' | tee "$OUT/$m-8192.md"
  done
}

ray() {  # Calibration on Ray, 1 vs 2 workers (about 30 minutes; needs a quiet machine)
  $PY benchmarks/ray_scaling.py --samples 512 --workers 1,2 --out "$OUT/smollm2-135m-ray-scaling.md"
}

engines() {  # Inside the engines: vLLM reads the exported scales back, and scores the same tokens
  if [[ ! -x .venv-engines/bin/python ]]; then
    echo "run.sh engines: no .venv-engines (make engines installs vLLM, 3.5 GB): skipped"; return 0
  fi
  local profile="$PROFILES/smollm2-135m-64" export_dir="$PROFILES/smollm2-135m-vllm-export"
  [[ -d "$profile" ]] || $KV calibrate --model smollm2-135m --samples 64 --out "$profile"
  $KV export --profile "$profile" --format vllm --out "$export_dir" --check --force \
    --engine-python .venv-engines/bin/python 2>&1 | grep -v -E '^(INFO|WARNING|\(EngineCore)' \
    | tee "$OUT/smollm2-135m-engine-check.md"
  $PY benchmarks/engine_ppl.py --export "$export_dir" --served "$export_dir/served-model" --tokens 1024 \
    | tee "$OUT/smollm2-135m-engine-ppl.md"
  $KV export --profile "$profile" --format vllm --out "$PROFILES/smollm2-135m-vllm-skip" --force \
    --kv-cache-dtype int4_per_token_head --memory-budget 0.32 --max-skip 4 | tee "$OUT/smollm2-135m-engine-skip.md"
}

pages() {  # The pages: the tests that render the report and the status page in Chromium leave their screenshots
  KVGUARD_SCREENSHOTS="$OUT" $PY -m pytest -q -p no:cacheprovider \
    "tests/calibration/test_report.py::test_report_with_the_loops_timeline_renders_in_chromium" \
    "tests/serving/test_pages.py::test_status_page_renders_live_numbers_in_chromium"
}

SECTIONS=(quality calibrate frontier llamacpp qwen long loop speed memory serving recall ray engines pages)
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  echo "usage: benchmarks/run.sh [SECTION ...]   (default: all, in this order)"
  for s in "${SECTIONS[@]}"; do printf '  %-10s %s\n' "$s" "$(grep -m1 "^$s() {" "$0" | sed 's/.*# //')"; done
  exit 0
fi
for section in "${@:-${SECTIONS[@]}}"; do
  if [[ ! " ${SECTIONS[*]} " == *" $section "* ]]; then
    echo "run.sh: unknown section '$section'; one of: ${SECTIONS[*]}" >&2; exit 2
  fi
  echo "=== $section" >&2
  "$section"
done
