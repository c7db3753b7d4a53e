#!/usr/bin/env bash
# One device session's work (2026-12-01, second session): the gate, the server's time split, the
# CUDA-only tests, and training + measuring the SmolLM2 DFlash drafter.
#   bash bench/device_s19.sh "$OUT" PART      PART: tests | gate | serve | train | dflash
# Carried (ignored paths): .whl (server wheels), .carry/smollm2-tok, .carry/cache (prompt sets),
# .carry/ggufa + .carry/ggufb (the SmolLM2 GGUF in two halves, over two calls on one warm
# machine), .carry/sg (ShareGPT's human turns, gzipped).
set -u
out=${1:?output dir}; part=${2:?part}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=/tmp/spcache
mkdir -p "$out" /tmp/spcache/data /tmp/spcache/models/smollm2-135m
cp -rn .carry/cache/data/. /tmp/spcache/data/ 2>/dev/null
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
SP="python3 -m specpilot.cli"
DIR=/tmp/llama3-8b-peaked
DEP="--target $DIR --device cuda --dtype bf16"
GGUF=/tmp/spcache/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
if [ "$part" = tests ]; then
  TAIL=14 step pytest 300 python3 -m pytest -q -p no:cacheprovider tests/test_gate.py tests/test_graphs.py tests/test_scheduler.py tests/test_serve_worker.py tests/test_dflash.py -k "cuda or graphs"
fi
if [ "$part" = gate ] || [ "$part" = serve ]; then
  [ -d "$DIR" ] || TAIL=2 step hfdir 240 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$DIR" --peaked
fi
if [ "$part" = gate ]; then
  for g in gate no_gate; do
    flag=""; [ $g = no_gate ] && flag=--no-gate
    TAIL=16 step "bench_ngram_$g" 200 $SP bench $DEP --drafter ngram --prompts mt-bench --limit 3 --max-new-tokens 128 --rounds 5 $flag --out "$out/bench_ngram_$g.jsonl"
  done
fi
if [ "$part" = serve ]; then
  TAIL=10 step serve 420 python3 bench/serve_concurrency.py --out "$out/serve" --concurrency 1,4,16 --max-tokens 128 -- $DEP --drafter none
fi
if [ "$part" = train ]; then
  [ -f "$GGUF" ] || cat .carry/ggufa/part00 .carry/ggufb/part01 > "$GGUF"
  sha256sum "$GGUF"
  TAIL=30 step train 560 $SP train-drafter --target smollm2-135m --kind dflash --device cuda --dtype bf16 --minutes ${MINUTES:-8.6} --out /tmp/drafter-run --data .carry/sg/sharegpt_human.json.gz
  mkdir -p "$out/drafter" && cp -r /tmp/drafter-run/drafter/. "$out/drafter/" && cp /tmp/drafter-run/report.json "$out/" 2>/dev/null
  ls -la "$out/drafter"
fi
if [ "$part" = dflash ]; then
  D=${DRAFTER:-/tmp/drafter-run/drafter}
  for set in mt-bench humaneval; do
    TAIL=20 step "bench_dflash_$set" 200 $SP bench --target smollm2-135m --device cuda --dtype bf16 --drafter dflash --draft-model "$D" --prompts $set --limit 8 --max-new-tokens 256 --rounds 3 --out "$out/bench_dflash_$set.jsonl"
  done
fi
echo "== done $(date +%T)"
