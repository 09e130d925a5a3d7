#!/usr/bin/env bash
# One device call for the end-to-end numbers: engine GPU tests (CUDA graphs included), then
# `bench_e2e.py decode` for the Qwen3.5-9B and Nemotron-3-Nano shapes and `spec` for the presets in $SPEC_PRESETS.
#   run on the GPU machine from the repo root, with carry [".device"]: bash benchmarks/device_e2e.sh
# Kernels JIT-compile there (KVBUFFER_JIT=1), or with ARTIFACTS=DIR load only from that artifact cache
# (built here by `kvbuffer tune --gpu h200 --build-only ... --cache-dir DIR`, carried along; no JIT).
# Writes under $OUT: tests.log, e2e_*.json, bench_*.log.
set -u
source benchmarks/device_setup.sh
export KVBUFFER_JIT=1
if [ -n "${ARTIFACTS:-}" ]; then unset KVBUFFER_JIT; export KVBUFFER_CACHE_DIR=$(realpath "$ARTIFACTS"); fi
if [ -n "${TESTS:-tests/gpu/test_ops_and_engine.py}" ]; then
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -v --tb=short -p no:cacheprovider ${TESTS:-tests/gpu/test_ops_and_engine.py} \
    -k "${TEST_FILTER:-engine or graph}" 2>&1 | grep -v INFO > "$OUT/tests.log"; tail -8 "$OUT/tests.log"
fi
E2E="--prompt-len ${PROMPT_LEN:-24} --new-tokens ${NEW_TOKENS:-32} --chunk-size 16 --out $OUT ${ARTIFACTS:+--kernels true}"
for preset in ${PRESETS:-qwen3.5-9b nemotron-3-nano}; do
  timeout ${BENCH_TIMEOUT:-170} python3 benchmarks/bench_e2e.py decode --preset $preset \
    --batches ${BATCHES:-1,8,64,256,512} --profile-batch ${PROFILE_BATCH:-256} $E2E 2>&1 | grep -v INFO | tee "$OUT/bench_decode_$preset.log" | grep -v '^  ' | tail -12
  if [[ " ${SPEC_PRESETS:-} " == *" $preset "* ]]; then
    timeout ${BENCH_TIMEOUT:-170} python3 benchmarks/bench_e2e.py spec --preset $preset \
      --memory-budget ${BUDGET:-12} --draft-tokens ${DRAFTS:-2,4,8} $E2E 2>&1 | grep -v INFO \
      | tee "$OUT/bench_spec_$preset.log" | tail -8
  fi
done
echo "== done in $(( $(date +%s) - T0 )) s =="
