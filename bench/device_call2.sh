#!/usr/bin/env bash
# Device call: W12 kernel sweep (with the weight-as-A orientation), FP8 pre-filter, two-level on
# the peaked 8B target.   bash bench/device_call2.sh "$OUT"
set -u
out=${1:?output dir}
export PYTHONPATH=src
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-14}" "$out/$name.log"; }
TAIL=12 step w12 200 python3 bench/w12_gpu.py --out "$out/w12" --budget-s 90
TAIL=10 step fp8 200 python3 bench/fp8_prefilter_gpu.py --out "$out/fp8" --budget-s 120
TAIL=14 step twolevel 200 python3 bench/two_level_gpu.py --out "$out/tl" --peaked --skip-kernel --budget-s 110
