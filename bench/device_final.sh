#!/usr/bin/env bash
# One H200 call for the mechanism measurements of issues 4, 6 and 7, plus the bf16 lossless check
# under the current near-tie tolerance. Each step has its own time limit; a failing step does not
# stop the others. Usage (on the device): bash bench/device_final.sh "$OUT"
set -u
out=${1:?output folder}
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p "$out"/w12 "$out"/mech "$out"/profile "$out"/lossless
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out"/gpu.txt
git rev-parse --short HEAD 2>/dev/null | tee -a "$out"/gpu.txt
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tail -n 40; echo "=== $name exit ${PIPESTATUS[0]}"; }
step w12 150 python3 bench/w12_gpu.py --out "$out"/w12 --budget-s 80
step mechanisms 140 python3 bench/mechanisms_gpu.py --out "$out"/mech --budget-s 80
step profile 110 python3 bench/profile_gpu.py --out "$out"/profile
step lossless 100 python3 bench/gpu_lossless_check.py --out "$out"/lossless --target-shape llama3-8b --new-tokens 256
