#!/usr/bin/env bash
# One device call for the GPU tests: parallel precompile, then the engine/ops tests, the Mamba-2
# thread-level variant's kernel tests and the GDN kernel tests, each time-boxed, verbose logs under $OUT.
#   run on the GPU machine from the repo root, with carry [".device"]: bash benchmarks/device_tests.sh
# Env: PRE_TIMEOUT, ENGINE_TIMEOUT, M2_TIMEOUT (the GDN tests get what is left of CALL_S; GDN=0 skips them),
# ENGINE_FILTER, M2_FILTER (M2=0 skips them), EXTRA_TESTS (more test paths, run first, EXTRA_TIMEOUT);
# PRE_WHAT=engine precompiles only the engine tests' kernels; E2E_PRECOMPILE=1 then fills the compile cache for benchmarks/device_e2e.sh.
set -u
source benchmarks/device_setup.sh
CALL_S=${CALL_S:-570}
export KVBUFFER_JIT=1 KVB_ERROR_LOG="$OUT/errors.jsonl"
timeout ${PRE_TIMEOUT:-200} python3 benchmarks/precompile_ops.py 16 qwen3.5-9b 0 8 ${PRE_WHAT:-tests} 2>&1 | grep -v INFO \
  > "$OUT/precompile.log"; tail -3 "$OUT/precompile.log"
pytest_box() {  # LOG SECONDS ARGS...: one time-boxed verbose pytest run, its summary printed
  local log=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -v --tb=short -p no:cacheprovider "$@" 2>&1 | grep -v INFO > "$OUT/$log"
  echo "-- $log: $(grep -cE ' PASSED' "$OUT/$log") passed, $(grep -cE ' FAILED| ERROR' "$OUT/$log") failed"
  grep -E '^(FAILED|ERROR) ' "$OUT/$log" | head -20; tail -n 1 "$OUT/$log"
}
[ -n "${EXTRA_TESTS:-}" ] && pytest_box extra.log ${EXTRA_TIMEOUT:-120} $EXTRA_TESTS
pytest_box engine.log ${ENGINE_TIMEOUT:-220} tests/gpu/test_ops_and_engine.py -k "${ENGINE_FILTER:-not nothing}"
[ "${M2:-1}" = 1 ] && pytest_box mamba2_simt.log ${M2_TIMEOUT:-120} tests/gpu/test_mamba2_kernels.py -k "${M2_FILTER:-simt}"
left=$(( CALL_S - ($(date +%s) - T0) ))
[ "${GDN:-1}" = 1 ] && [ $left -gt 30 ] && pytest_box gdn.log $left tests/gpu/test_gdn_kernels.py
if [ "${E2E_PRECOMPILE:-0}" = 1 ]; then
  timeout ${E2E_PRE_TIMEOUT:-150} python3 benchmarks/precompile_ops.py 16 qwen3.5-9b 0 16 e2e 2>&1 | grep -v INFO | tail -3
fi
echo "== done in $(( $(date +%s) - T0 )) s =="
