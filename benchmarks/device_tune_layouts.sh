#!/usr/bin/env bash
# One device call: `kvbuffer tune` measures the speculative-layout and conv kernels on the GPU (each
# config checked against the reference on fresh inputs before it is timed), for the Qwen3.5-9B and
# Nemotron-3-Nano shapes; then time-boxed GPU kernel tests (conv, and the thread-level templates).
#   run on the GPU machine from the repo root, with carry [".device"]: bash benchmarks/device_tune_layouts.sh
# Env: KERNELS_9B / KERNELS_NANO (--kernels lists), DRAFTS (4), TESTS (pytest args), TEST_TIMEOUT.
set -u
source benchmarks/device_setup.sh
tune() {  # MODEL KERNELS: measured tune into a scratch cache, the log under $OUT
  timeout ${TUNE_TIMEOUT:-200} python3 -m kvbuffer.cli.main tune --model "$1" --kernels "$2" --chunk-sizes 16 \
    --draft-tokens ${DRAFTS:-4} --batch-buckets 64,256 --max-configs ${MAX_CONFIGS:-2} --cache-dir /tmp/kvb_tune \
    2>&1 | grep -v -e INFO -e '^compiling' > "$OUT/tune_$1.log"
  echo "-- tune $1: exit ${PIPESTATUS[0]}"; grep -E 'kernel|verify|conv1d|flush|record|Error' "$OUT/tune_$1.log" | tail -24
}
tune qwen3.5-9b "${KERNELS_9B:-gdn_verify,gdn_flush,conv1d_step,conv1d_prefill,conv1d_verify,conv1d_accept}"
tune nemotron-3-nano "${KERNELS_NANO:-mamba2_verify,conv1d_step,conv1d_verify,conv1d_accept}"
left=$(( ${CALL_S:-570} - ($(date +%s) - T0) ))
if [ -n "${TESTS:-tests/gpu/test_conv1d_kernels.py}" ] && [ $left -gt 30 ]; then
  KVBUFFER_JIT=1 timeout $left python3 -m pytest -v --tb=short -p no:cacheprovider ${TESTS:-tests/gpu/test_conv1d_kernels.py} \
    2>&1 | grep -v INFO > "$OUT/tests.log"
  echo "-- tests: $(grep -c ' PASSED' "$OUT/tests.log") passed, $(grep -cE ' FAILED| ERROR' "$OUT/tests.log") failed"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -20; tail -n 1 "$OUT/tests.log"
fi
echo "== done in $(( $(date +%s) - T0 )) s =="
