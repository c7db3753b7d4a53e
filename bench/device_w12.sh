#!/usr/bin/env bash
# One device call for W12: GPU correctness of the PTX decode, kernel sweep, end to end.
#   bash bench/device_w12.sh "$OUT"
set -u
out=${1:?output dir}
export PYTHONPATH=src
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-25}" "$out/$name.log"; }
TAIL=3 step pytest 90 python3 -m pytest -q tests/test_w12.py -k "prmt_decode_on_gpu"
TAIL=12 step w12 170 python3 bench/w12_gpu.py --out "$out/w12" --budget-s 60
TAIL=8 step e2e 150 python3 bench/w12_e2e_gpu.py --out "$out/e2e" --kernel-json "$out/w12/w12_gpu.json"
