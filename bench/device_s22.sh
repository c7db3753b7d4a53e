#!/usr/bin/env bash
# The sixth session's device work (2026-12-02): issue 15 after the decode-GEMV tiling sweep.
#   bash bench/device_s22.sh "$OUT" PART[,PART...]
#   PART: tests   the CUDA tests of the kernels whose defaults changed (split-kv, fused-gemv, W12)
#         sweep   bench/gemv_sweep_gpu.py (270 tilings of the decode GEMVs, about 3 min)
#         attn    bench/decode_attn_gpu.py timing only (the split-kv tilings)
#         stack   bench/ar_stack_gpu.py (the 8B AR step with the mechanisms stacked)
#         compare `specpilot compare` of AR with split-kv + w12 + fused-gemv against plain AR, on
#                 a peaked 8B HF directory (what a user runs; carry .carry/smollm2-tok)
# Record every number in docs/BENCHMARKS.md with this command, the machine, the date and the commit.
set -u
out=${1:?output dir}; parts=,${2:?part},
export PYTHONPATH=src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=/tmp/spcache
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
has() { case $parts in *,$1,*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
if has tests; then
  TAIL=12 step pytest_cuda 240 python3 -m pytest -q -p no:cacheprovider -k cuda --durations=5 \
    tests/test_decode_attn.py tests/test_fused_gemv.py tests/test_w12.py tests/test_two_level_device.py
fi
has sweep && TAIL=34 step sweep 420 python3 bench/gemv_sweep_gpu.py --out "$out/sweep" --budget-s 300
has attn && TAIL=16 step decode_attn 150 python3 bench/decode_attn_gpu.py --out "$out/decode_attn" --skip e2e --lengths 512,1024,2048,4096 --widths 1,8,16 --budget-s 120
has stack && TAIL=10 step ar_stack 300 python3 bench/ar_stack_gpu.py --out "$out/ar_stack"
if has compare; then
  DIR=/tmp/llama3-8b-peaked
  [ -d "$DIR" ] || TAIL=2 step hfdir 150 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$DIR" --peaked
  printf '{"deployment": {"target": "%s", "drafter": "none", "dtype": "bf16", "device": "cuda"}, "k": 0, "mechanisms": {"split-kv": {}, "w12": {}, "fused-gemv": {}}}\n' "$DIR" > "$out/ar_stack_engine.json"
  TAIL=24 step compare 300 python3 -m specpilot.cli compare --engine "$out/ar_stack_engine.json" --prompts copy-heavy --skip 0 --limit 2 --max-new-tokens 128 --rounds 3 --out "$out/compare.jsonl"
fi
echo "== done $(date +%T)"
