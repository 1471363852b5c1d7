#!/usr/bin/env bash
# One benchmark call on the GPU machine, as docs/benchmarks.md gives them (carry the packed .bench folder along):
#
#   bash bench/device_call.sh CALL [run_bench.py options]      e.g.  bash bench/device_call.sh per-gpu
#
# Writes $OUT/results.json (the call's pairs and targets; merge it with bench/results.py merge) and $OUT/log.txt.
# NCCL_NVLS_ENABLE and its kin stay as the machine sets them (run_bench.py sets them to 0/1 for every run too).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
export PYTHONUNBUFFERED=1
python3 bench/run_bench.py "$@" --out "$OUT" 2>&1 | tee "$OUT/log.txt"
