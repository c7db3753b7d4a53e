#!/usr/bin/env bash
# Last device call of the third session: the static scheduler's CUDA-graph test and bench, and the
# W12 PTX decode test after its template refactor.   bash bench/device_final3.sh "$OUT"
set -u
out=${1:?output dir}
export PYTHONPATH=src
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-20}" "$out/$name.log"; }
TAIL=4 step pytest 100 python3 -m pytest -q tests/test_static_sched.py tests/test_w12.py -k "cuda or prmt_decode_on_gpu"
TAIL=20 step sched 175 python3 bench/static_sched_gpu.py --out "$out/sched"
