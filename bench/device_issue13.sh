#!/usr/bin/env bash
# One device call for issue 13: the one engine on the H200 through the commands themselves.
#   bash bench/device_issue13.sh "$OUT" [part]     (part: all | tests | bench | tune | serve)
# Needs (carried): .whl (fastapi, uvicorn, openai and their deps), .carry/smollm2-tok (a saved HF
# tokenizer), .carry/cache/data (prompt sets). Writes logs and JSON under $OUT.
set -u
out=${1:?output dir}; part=${2:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=$PWD/.carry/cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
SP="python3 -m specpilot.cli"
DIR=${DIR:-/tmp/llama3-8b}      # PEAKED=1: synthetic.make_peaked weights (no bf16 near-ties)
DEP="--target $DIR --device cuda --dtype bf16"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
if [ "$part" = all ] || [ "$part" = tests ]; then
  TAIL=12 step pytest 240 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_scheduler.py tests/test_serve_worker.py tests/test_bench_batched.py tests/test_costmodel.py tests/test_w12.py -k "cuda_graphs or on_cuda or pieces_in_cuda or profile_on_cuda or prmt_decode"
fi
[ -d "$DIR" ] || TAIL=2 step hfdir 240 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$DIR" ${PEAKED:+--peaked}
if [ "$part" = all ] || [ "$part" = bench ]; then
  TAIL=8 step suite 200 python3 bench/gpu_suite.py --out "$out/suite" --target-shape llama3-8b --no-hf --no-profile --no-k8 --verify-widths 1,16
  for i in 1 2 3; do
    TAIL=4 step "bench_ar$i" 150 $SP bench $DEP --drafter none --prompts copy-heavy --limit 2 --max-new-tokens 256 --rounds 3 --json --out "$out/bench_ar$i.jsonl"
  done
fi
if [ "$part" = all ] || [ "$part" = tune ]; then
  TAIL=14 step tune_random 240 $SP tune $DEP --prompts copy-heavy --limit 2 --max-new-tokens 128 --budget 170 --compare-limit 1 --rank-gaps static --out "$out/tune_random" --memory "$out/mem.sqlite"
  TAIL=20 step tune_sim 330 $SP tune $DEP --drafter block --simulate-acceptance tau=6.5,block=16 --prompts copy-heavy --limit 2 --max-new-tokens 128 --budget 260 --compare-limit 1 --rank-gaps static --out "$out/tune_sim" --memory "$out/mem.sqlite"
fi
if [ "$part" = tune_sim ]; then
  TAIL=24 step tune_sim 330 $SP tune $DEP --drafter block --simulate-acceptance tau=6.5,block=16 --prompts copy-heavy --limit 2 --max-new-tokens 128 --trials 1 --budget 250 --compare-limit 1 --rank-gaps static --out "$out/tune_sim" --memory "$out/mem.sqlite"
fi
if [ "$part" = all ] || [ "$part" = serve ]; then
  TAIL=8 step serve 400 python3 bench/serve_concurrency.py --out "$out/serve" --concurrency 1,4,16 --max-tokens 128 -- $DEP --drafter none
fi
echo "== done $(date +%T)"
