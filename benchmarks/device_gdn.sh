#!/usr/bin/env bash
# One device call: fill the kernel cache in parallel, run the GDN GPU tests, run the benchmark.
#   run on the GPU machine from the repo root: bash benchmarks/device_gdn.sh
# Writes under $OUT (default ./out): precompile.log, tests.log, errors.jsonl, gdn_*.json/png, bench.log
# Knobs: PRECOMPILE_ARGS (e.g. --no-tune), TESTS, PYTEST_ARGS, TEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT
set -u
source benchmarks/device_setup.sh
python3 benchmarks/precompile_gdn.py 15 ${PRECOMPILE_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/precompile.log" | tail -20
KVB_ERROR_LOG="$OUT/errors.jsonl" timeout ${TEST_TIMEOUT:-200} python3 -m pytest ${TESTS:-tests/gpu/test_gdn_kernels.py} \
  -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | grep -v INFO > "$OUT/tests.log"; tail -25 "$OUT/tests.log"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_gdn.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v INFO \
  | tee "$OUT/bench.log" | tail -40
