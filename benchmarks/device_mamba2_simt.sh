#!/usr/bin/env bash
# The Mamba-2 thread-level ("simt") buffered variant on the GPU, one 10-minute device call per stage:
#   STAGE=tests bash benchmarks/device_mamba2_simt.sh   # precompile, then its GPU tests (-k simt)
#   STAGE=bench bash benchmarks/device_mamba2_simt.sh   # bench_mamba2 --reduce: both variants in one run
# Run from the repo root with carry [".device"]. Writes under $OUT: tests_m2simt.log, errors.jsonl, mamba2_*.
set -u
source benchmarks/device_setup.sh
case "${STAGE:-tests}" in
  tests)
    (cd benchmarks && timeout ${PRE_TIMEOUT:-150} python3 precompile_linear.py 15 mamba2 2>&1 | grep -v INFO | tail -3)
    KVB_ERROR_LOG="$OUT/errors.jsonl" timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_mamba2_kernels.py -k simt 2>&1 | grep -v INFO | tee "$OUT/tests_m2simt.log" | tail -30 ;;
  bench)
    timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_mamba2.py --reduce --out "$OUT" \
      --batches ${BATCHES:-1,16,64,256,1024} 2>&1 | grep -v INFO | tail -40 ;;
  *) echo "STAGE must be tests or bench" >&2; exit 2 ;;
esac
