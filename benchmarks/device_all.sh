#!/usr/bin/env bash
# One device call, everything GPU: parallel precompile, all GPU tests, a measuring `kvbuffer tune` run.
#   run on the GPU machine from the repo root, with carry [".device"]: bash benchmarks/device_all.sh
# Writes under $OUT (default ./out): precompile.log, gpu_tests.log, tune_h200.txt, tuning record JSON.
# Stages are time-boxed (PRE_TIMEOUT + TEST_TIMEOUT + TUNE_TIMEOUT = 490 s, plus ~20 s to unpack .device) to fit a 9-minute call.
set -u
source benchmarks/device_setup.sh
PRESET=${PRESET:-qwen3.5-9b}; CHUNKS=8,16,32; MAX_CONFIGS=${MAX_CONFIGS:-2}
CACHE=$(mktemp -d /tmp/kvb-cache.XXXX)
python3 -c "import torch, tilelang, tvm_ffi; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" 2>&1 | grep -v INFO

timeout ${PRE_TIMEOUT:-140} python3 benchmarks/precompile_ops.py 15 "$PRESET" "$MAX_CONFIGS" "$CHUNKS" 2>&1 \
  | grep -v INFO > "$OUT/precompile.log"; tail -3 "$OUT/precompile.log"

set -o pipefail
# this change's tests first, then the rest of tests/gpu (pytest drops the duplicate)
KVB_ERROR_LOG="$OUT/errors.jsonl" timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --maxfail=15 -p no:cacheprovider \
  tests/gpu/test_ops_and_engine.py tests/gpu 2>&1 | grep -v INFO | tee "$OUT/gpu_tests.log" | tail -30
TESTS_RC=$?
set +o pipefail

timeout ${TUNE_TIMEOUT:-110} python3 -m kvbuffer.cli.main tune --gpu h200 --model "$PRESET" --chunk-sizes "$CHUNKS" \
  --max-configs "$MAX_CONFIGS" --cache-dir "$CACHE" 2>&1 | grep -v INFO > "$OUT/tune_h200.txt"
TUNE_RC=${PIPESTATUS[0]}
tail -25 "$OUT/tune_h200.txt"
cp "$CACHE"/tunings/*.json "$OUT/" 2>/dev/null

echo "== summary ($(( $(date +%s) - T0 )) s) =="
echo "precompile: $(tail -1 "$OUT/precompile.log")"
echo "gpu tests (rc $TESTS_RC): $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1)"
echo "tune (rc $TUNE_RC): $(grep -E '^tuning record' "$OUT/tune_h200.txt" | tail -1)"
ls "$OUT"
