#!/usr/bin/env bash
# One device call for both families: parallel precompile, Mamba-2 + GDN GPU tests, Mamba-2 benchmark,
# GDN benchmark (short). Run on the GPU machine from the repo root: bash benchmarks/device_linear.sh
# Writes under $OUT (default ./out): precompile.log, tests_*.log, errors.jsonl, mamba2_*.json/txt, gdn_*.json
set -u
source benchmarks/device_setup.sh
(cd benchmarks && timeout ${PRE_TIMEOUT:-150} python3 precompile_linear.py 15 2>&1 | grep -v INFO) > "$OUT/precompile.log"; tail -5 "$OUT/precompile.log"
KVB_ERROR_LOG="$OUT/errors.jsonl" timeout ${M2_TEST_TIMEOUT:-150} python3 -m pytest tests/gpu/test_mamba2_kernels.py -q -p no:cacheprovider 2>&1 \
  | grep -v INFO > "$OUT/tests_mamba2.log"; tail -12 "$OUT/tests_mamba2.log"
KVB_ERROR_LOG="$OUT/errors.jsonl" timeout ${GDN_TEST_TIMEOUT:-100} python3 -m pytest tests/gpu/test_gdn_kernels.py -q -p no:cacheprovider 2>&1 \
  | grep -v INFO > "$OUT/tests_gdn.log"; tail -12 "$OUT/tests_gdn.log"
timeout ${M2_BENCH_TIMEOUT:-150} python3 benchmarks/bench_mamba2.py --out "$OUT" ${M2_BENCH_ARGS:-} 2>&1 | grep -v INFO > "$OUT/bench_mamba2.log"; tail -22 "$OUT/bench_mamba2.log"
timeout ${GDN_BENCH_TIMEOUT:-60} python3 benchmarks/bench_gdn.py --out "$OUT" --batches 64,256,1024 2>&1 \
  | grep -v INFO > "$OUT/bench_gdn.log"; tail -10 "$OUT/bench_gdn.log"
