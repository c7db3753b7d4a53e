#!/usr/bin/env bash
# The one driver of the GPU reproducers: each PART re-runs what a figure in docs/BENCHMARKS.md
# states, through the commands (`specpilot bench | compare | tune | train-drafter`) or a bench
# script over the composition root. Each PART fits one device call (<= 10 min).
#
#   bash bench/device.sh "$OUT" PART[,PART...]
#
#   tests     every CUDA-only test (graphs, kernels, the abstain protocol, drafters on the GPU)
#   suite     bench/gpu_suite.py: ceilings, AR against the roofline, verify-cost curve (8B shape)
#   bench     `specpilot bench` AR on the 8B HF directory, three times (run-to-run spread)
#   stack     bench/ar_stack_gpu.py, then `specpilot compare` of AR + split-kv + w12 + fused-gemv
#   tune      `specpilot tune` on the random 8B directory, then with simulated acceptance on
#             the peaked one (τ 6.5, block 16: SIMULATED acceptance, labelled so in the report)
#   tree      `specpilot tune` under an EAGLE-like simulated tree profile (peaked 8B)
#   drafter   the block drafter's step with and without int8-drafter: `specpilot profile` of
#             each (per-part cycle, SIMULATED acceptance τ 6.5, block 16), then `specpilot
#             compare` of the two engines (peaked 8B)
#   gate      `specpilot bench` with the n-gram drafter, gate on and off (mt-bench)
#   serve     bench/serve_concurrency.py: `specpilot serve` at 1 / 4 / 16 concurrent clients
#   latency   `specpilot bench --mode serve` against `specpilot serve` (SERVES="none:4 none:0 ngram:4",
#             drafter:stream-window):
#             TTFT / TPOT / ITL at 1 / 4 / 16 / 32 concurrent (docs/SERVE.md)
#   ttft      bench/ttft_trace_gpu.py: where a served request's first step goes (prefill, decode;
#             SDPA with and without cuDNN on new prompt lengths), the server's own scheduler
#   kernels   the kernel micro-benchmarks: w12, gemv sweep, split-kv attention, fused GEMVs,
#             tree accept, L2 prefetch, exact head, two-level on graphs (KERNELS=w12,attn to pick)
#   train     `specpilot train-drafter` DFlash on SmolLM2 (carry the GGUF and ShareGPT, below)
#   dflash    `specpilot bench` of the trained drafter (DRAFTER=dir) on mt-bench and humaneval
#   ray       bench/ray_scaling.py (a machine with several GPUs; carry .whl/ray)
#
# Carried (git-ignored, `carry` of the device tool): .whl (server wheels, optuna; made by
# `pip download`), .carry/smollm2-tok (a saved HF tokenizer), .carry/cache/data (prompt sets);
# for train: the SmolLM2 GGUF in parts (.carry/gz1..3/p, xz) and .carry/sg/sharegpt_human.json.gz.
# Every 8B model is a seeded random shape built on the device (bench/make_hf_dir.py).
# Record a figure in docs/BENCHMARKS.md with this command, the machine, the date and the commit.
set -u
out=${1:?output dir}; parts=,${2:?part},
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"; }
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=/tmp/spcache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$out" /tmp/spcache/data /tmp/spcache/models/smollm2-135m
cp -rn .carry/cache/data/. /tmp/spcache/data/ 2>/dev/null
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
has() { case $parts in *,$1,*) return 0;; esac; return 1; }
SP="python3 -m specpilot.cli"
RANDOM_DIR=/tmp/llama3-8b PEAKED_DIR=/tmp/llama3-8b-peaked
hfdir() {  # $1: the directory; peaked weights have no bf16 near-ties in the argmax
  [ -d "$1" ] && return
  local flag=""; [ "$1" = "$PEAKED_DIR" ] && flag=--peaked
  TAIL=2 step "hfdir_$(basename "$1")" 240 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$1" $flag
}
dep() { echo "--target $1 --device cuda --dtype bf16"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader

if has tests; then
  TAIL=20 step pytest_cuda ${TEST_LIMIT:-480} python3 -m pytest -q -p no:cacheprovider --durations=8 \
    -k "cuda or graphs or gpu or hopper or ptx or sm90" tests/
fi
has suite && TAIL=8 step suite 300 python3 bench/gpu_suite.py --out "$out/suite" --target-shape llama3-8b --no-hf --no-profile --no-k8 --verify-widths 1,16
if has bench; then
  hfdir $RANDOM_DIR
  for i in 1 2 3; do
    TAIL=4 step "bench_ar$i" 150 $SP bench $(dep $RANDOM_DIR) --drafter none --prompts copy-heavy --limit 2 --max-new-tokens 256 --rounds 3 --json --out "$out/bench_ar$i.jsonl"
  done
fi
if has stack; then
  TAIL=10 step ar_stack 300 python3 bench/ar_stack_gpu.py --out "$out/ar_stack"
  hfdir $PEAKED_DIR
  printf '{"deployment": {"target": "%s", "drafter": "none", "dtype": "bf16", "device": "cuda"}, "k": 0, "mechanisms": {"split-kv": {}, "w12": {}, "fused-gemv": {}}}\n' "$PEAKED_DIR" > "$out/ar_stack_engine.json"
  TAIL=24 step compare 300 $SP compare --engine "$out/ar_stack_engine.json" --prompts copy-heavy --skip 0 --limit 2 --max-new-tokens 128 --rounds 3 --out "$out/compare.jsonl"
fi
if has tune; then
  hfdir $RANDOM_DIR; hfdir $PEAKED_DIR
  TAIL=14 step tune_random 240 $SP tune $(dep $RANDOM_DIR) --prompts copy-heavy --limit 2 --max-new-tokens 128 --budget 170 --compare-limit 1 --rank-gaps static --out "$out/tune_random" --memory "$out/mem.sqlite"
  TAIL=24 step tune_sim 420 $SP tune $(dep $PEAKED_DIR) --drafter block --simulate-acceptance tau=6.5,block=16 --prompts copy-heavy --limit 2 --max-new-tokens 128 --budget ${BUDGET:-360} --compare-limit 1 --rank-gaps static --out "$out/tune_sim" --memory "$out/mem.sqlite"
fi
if has tree; then
  hfdir $PEAKED_DIR
  TAIL=40 step tune_tree ${TUNE_LIMIT:-380} $SP tune $(dep $PEAKED_DIR) --drafter block --simulate-acceptance ${PROFILE:-rates=0.8,block=8,sibling=0.5} --prompts copy-heavy --limit 2 --max-new-tokens 128 --trials ${TRIALS:-2} --budget ${BUDGET:-270} --compare-limit 1 --rank-gaps static --out "$out/tune_tree" --memory "$out/mem.sqlite"
fi
if has drafter; then
  hfdir $PEAKED_DIR
  sim=${PROFILE:-tau=6.5,block=16}
  for mech in none int8-drafter; do
    m='{}'; [ $mech = none ] || m="{\"$mech\": {}}"
    printf '{"deployment": {"target": "%s", "drafter": "block", "dtype": "bf16", "device": "cuda", "simulate_acceptance": "%s"}, "k": 15, "mechanisms": %s}\n' "$PEAKED_DIR" "$sim" "$m" > "$out/drafter_$mech.json"
    TAIL=30 step "profile_$mech" 200 $SP profile --engine "$out/drafter_$mech.json" --prompts copy-heavy --limit 1 --max-new-tokens 96 --rounds 3 --json "$out/profile_$mech.json"
  done
  TAIL=12 step compare_drafter 240 $SP compare --engine "$out/drafter_int8-drafter.json" --stock "$out/drafter_none.json" --prompts copy-heavy --skip 0 --limit 2 --max-new-tokens 128 --rounds 3 --out "$out/compare_drafter.jsonl"
fi
if has gate; then
  hfdir $PEAKED_DIR
  for g in gate no_gate; do
    flag=""; [ $g = no_gate ] && flag=--no-gate
    TAIL=16 step "bench_ngram_$g" 200 $SP bench $(dep $PEAKED_DIR) --drafter ngram --prompts mt-bench --limit 3 --max-new-tokens 128 --rounds 5 $flag --out "$out/bench_ngram_$g.jsonl"
  done
fi
if has serve; then
  hfdir $RANDOM_DIR
  TAIL=10 step serve 420 python3 bench/serve_concurrency.py --out "$out/serve" --concurrency 1,4,16 --max-tokens 128 -- $(dep $RANDOM_DIR) --drafter none
fi
if has latency; then
  hfdir $RANDOM_DIR
  for cfg in ${SERVES:-none:4 none:0 ngram:4}; do  # drafter:stream-window (0: the engine's 16)
    d=${cfg%:*} w=${cfg#*:}
    $SP serve $(dep $RANDOM_DIR) --drafter $d --stream-window $w --port 8123 --max-concurrency 32 > "$out/serve_${d}_w$w.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do curl -sf http://127.0.0.1:8123/health > /dev/null && break; sleep 1; done
    TAIL=6 step "bench_serve_${d}_w$w" 240 $SP bench --mode serve --url http://127.0.0.1:8123 --prompts mt-bench --limit 8 --concurrency ${LEVELS:-1,4,16,32} --max-new-tokens 128 --out "$out/bench_serve_${d}_w$w.json"
    curl -s http://127.0.0.1:8123/metrics > "$out/metrics_${d}_w$w.txt"  # server-side TTFT, prefill
    kill $pid; wait $pid 2> /dev/null
  done
fi
if has ttft; then
  hfdir $RANDOM_DIR
  TAIL=14 step ttft_trace 300 python3 bench/ttft_trace_gpu.py --out "$out/ttft" --repeats 8 -- $(dep $RANDOM_DIR) --drafter none --stream-window 4 --max-concurrency 32
fi
if has kernels; then
  k=,${KERNELS:-w12,sweep,attn,gemv,tree,l2,head,twolevel},
  kh() { case $k in *,$1,*) return 0;; esac; return 1; }
  kh w12 && TAIL=40 step w12 ${W12_LIMIT:-170} python3 bench/w12_gpu.py --out "$out/w12" --budget-s ${W12_BUDGET:-120}
  kh sweep && TAIL=34 step sweep 420 python3 bench/gemv_sweep_gpu.py --out "$out/sweep" --budget-s 300
  kh attn && TAIL=16 step decode_attn 230 python3 bench/decode_attn_gpu.py --out "$out/decode_attn" --budget-s 170
  kh gemv && TAIL=40 step fused_gemv 260 python3 bench/fused_gemv_gpu.py --out "$out/fused_gemv" --budget-s 150
  kh tree && TAIL=30 step tree_accept 150 python3 bench/tree_accept_gpu.py --out "$out/tree_accept" --rounds 8 --e2e-rounds 3 --nodes 32,48
  kh l2 && TAIL=30 step l2 130 python3 bench/l2_prefetch_gpu.py --out "$out/l2" --contexts 512 --budget-s 100
  kh head && TAIL=30 step exact_head 240 python3 bench/exact_head_gpu.py --out "$out/exact_head" --budget-s 170
  kh twolevel && TAIL=30 step two_level 230 python3 bench/two_level_graph_gpu.py --out "$out/two_level" --budget-s 150
fi
GGUF=/tmp/spcache/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
if has train; then
  [ -s "$GGUF" ] || cat .carry/gz1/p .carry/gz2/p .carry/gz3/p | xz -d -T0 > "$GGUF"
  TAIL=30 step train ${TRAIN_LIMIT:-560} $SP train-drafter --target smollm2-135m --kind dflash --device cuda --dtype bf16 --minutes ${MINUTES:-9} --out /tmp/drafter-run --data .carry/sg/sharegpt_human.json.gz ${TRAIN_ARGS:-}
  mkdir -p "$out/drafter" && cp -r /tmp/drafter-run/drafter/. "$out/drafter/" && cp /tmp/drafter-run/report.json "$out/" 2>/dev/null
fi
if has dflash; then
  for set in ${SETS:-mt-bench humaneval}; do
    TAIL=20 step "bench_dflash_$set" 200 $SP bench --target smollm2-135m --device cuda --dtype bf16 --drafter dflash --draft-model "${DRAFTER:-/tmp/drafter-run/drafter}" --prompts $set --limit 8 --max-new-tokens 256 --rounds 3 --out "$out/bench_dflash_$set.jsonl"
  done
fi
if has ray; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/ray/*.whl > /dev/null 2>&1 || echo "ray wheels missing"
  TAIL=30 step ray_scaling ${RAY_LIMIT:-540} python3 bench/ray_scaling.py --out "$out/ray" --tokenizer .carry/smollm2-tok --kill ${RAY_ARGS:-}
fi
echo "== done $(date +%T)"
