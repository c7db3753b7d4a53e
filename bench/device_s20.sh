#!/usr/bin/env bash
# One device session's work (2026-12-01, third session).
#   bash bench/device_s20.sh "$OUT" PART      PART: diag | train | dflash | kernels
# Carried (ignored paths), over consecutive calls on one warm machine (the tree is capped at 64 MiB
# and holds the 18.6 MB shipped drafter): .whl (server wheels + gguf), .carry/sg (ShareGPT's
# human turns, gzipped), .carry/cache (prompt sets), .carry/smollm2-tok, and the SmolLM2 GGUF
# xz-compressed (90.4 MB) in three parts .carry/gz1/p .carry/gz2/p .carry/gz3/p; each call keeps
# what it carried under /tmp/keep.
set -u
out=${1:?output dir}; part=${2:?part}
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"; }
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=/tmp/spcache
mkdir -p "$out" /tmp/spcache/data /tmp/spcache/models/smollm2-135m /tmp/keep
cp -rn .carry/cache/data/. /tmp/spcache/data/ 2>/dev/null
for i in 1 2 3; do [ -f .carry/gz$i/p ] && cp .carry/gz$i/p /tmp/keep/gz$i; done
[ -f .carry/sg/sharegpt_human.json.gz ] && cp .carry/sg/sharegpt_human.json.gz /tmp/keep/
ls /tmp/keep
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
SP="python3 -m specpilot.cli"
GGUF=/tmp/spcache/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
if [ "$part" = diag ]; then
  TAIL=40 step diag 120 python3 bench/diag_twin.py
  TAIL=14 step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_gate.py tests/test_graphs.py -k "cuda or graphs"
fi
if [ "$part" = tests ]; then
  TAIL=14 step pytest_cuda 240 python3 -m pytest -q -p no:cacheprovider tests/test_dflash.py tests/test_eagle3.py tests/test_graphs.py tests/test_gate.py -k "cuda" -x
fi
if [ "$part" = train ]; then
  [ -s "$GGUF" ] || cat /tmp/keep/gz1 /tmp/keep/gz2 /tmp/keep/gz3 | xz -d -T0 > "$GGUF"
  sha256sum "$GGUF" | cut -c1-16
  TAIL=30 step train ${TRAIN_LIMIT:-560} $SP train-drafter --target smollm2-135m --kind dflash --device cuda --dtype bf16 --minutes ${MINUTES:-9} --out /tmp/drafter-run --data /tmp/keep/sharegpt_human.json.gz ${TRAIN_ARGS:-}
  mkdir -p "$out/drafter" && cp -r /tmp/drafter-run/drafter/. "$out/drafter/" && cp /tmp/drafter-run/report.json "$out/" 2>/dev/null
  ls -la "$out/drafter"
fi
if [ "$part" = dflash ]; then
  D=${DRAFTER:-/tmp/drafter-run/drafter}
  for set in ${SETS:-mt-bench humaneval}; do
    TAIL=20 step "bench_dflash_$set" 200 $SP bench --target smollm2-135m --device cuda --dtype bf16 --drafter dflash --draft-model "$D" --prompts $set --limit 8 --max-new-tokens 256 --rounds 3 --out "$out/bench_dflash_$set.jsonl"
  done
fi
if [ "$part" = kernels ]; then  # issue 15: W12 v3, the fused tree accept, L2 prefetch
  K=/tmp/k; mkdir -p $K
  TAIL=4 step pytest_k 90 python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py tests/test_w12.py -k cuda
  TAIL=40 step w12v3 ${W12_LIMIT:-170} python3 bench/w12_v3_gpu.py --out $K/w12v3 --budget-s ${W12_BUDGET:-75}
  TAIL=30 step tree_accept ${TREE_LIMIT:-150} python3 bench/tree_accept_gpu.py --out $K/tree_accept --rounds 8 --e2e-rounds 3 --nodes 32,48
  TAIL=30 step l2 ${L2_LIMIT:-120} python3 bench/l2_prefetch_gpu.py --out $K/l2 --contexts 512 --budget-s ${L2_BUDGET:-95}
  tar czf "$out/kernels.tgz" -C $K . 2>/dev/null
fi
if [ "$part" = tune_tree ]; then  # issue 15: tune under an EAGLE-like simulated profile on the 8B shape
  DIR=/tmp/llama3-8b-peaked
  [ -d "$DIR" ] || TAIL=2 step hfdir 120 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$DIR" --peaked
  TAIL=40 step tune_tree ${TUNE_LIMIT:-380} $SP tune --target $DIR --device cuda --dtype bf16 --drafter block --simulate-acceptance ${PROFILE:-rates=0.8,block=8,sibling=0.5} --prompts copy-heavy --limit 2 --max-new-tokens 128 --trials ${TRIALS:-2} --budget ${BUDGET:-270} --compare-limit 1 --rank-gaps static --out "$out/tune_tree" --memory "$out/mem.sqlite"
fi
echo "== done $(date +%T)"
