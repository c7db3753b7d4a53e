#!/usr/bin/env bash
# The device work the fourth session of 2026-12-01 prepared but could not run (no GPU was lent):
# issue 15's items 4 and 5 and the tune levers. Each PART fits one call (<= 10 min).
#   bash bench/device_s21.sh "$OUT" PART
#   PART: tests | attn_gemv | head_twolevel | l2_tune | ray, or several joined by commas
#   (TEST_LIMIT and TEST_FILES trim the tests part when it shares a call with others)
# Carried (ignored paths; see device_s20.sh): .whl (server wheels, optuna), .carry/smollm2-tok.
# Nothing else travels: every model here is a seeded random 8B shape built on the device.
# What to look for is in each bench script's docstring and in docs/MECHANISMS.md; record every
# number in docs/BENCHMARKS.md with this command, the machine, the date and the commit.
set -u
out=${1:?output dir}; parts=,${2:?part},
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"; }
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 SPECPILOT_CACHE=/tmp/spcache
mkdir -p "$out"
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n "${TAIL:-6}" "$out/$name.log"; }
SP="python3 -m specpilot.cli"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
has() { case $parts in *,$1,*) return 0;; esac; return 1; }
NEW_TESTS="tests/test_exact_argmax_graph.py tests/test_two_level_device.py tests/test_decode_attn.py tests/test_fused_gemv.py tests/test_l2_prefetch.py"
if has tests; then  # every CUDA-only test of the new kernels and the abstain protocol
  # shellcheck disable=SC2086
  TAIL=20 step pytest_cuda ${TEST_LIMIT:-420} python3 -m pytest -q -p no:cacheprovider -k cuda --durations=8 \
    ${TEST_FILES:-$NEW_TESTS tests/test_graphs.py tests/test_scheduler.py}
fi
if has attn_gemv; then  # item 5: AR toward the roofline (split-kv, fused_gemv)
  TAIL=40 step decode_attn ${ATTN_LIMIT:-230} python3 bench/decode_attn_gpu.py --out "$out/decode_attn" --budget-s ${ATTN_BUDGET:-170}
  TAIL=40 step fused_gemv ${GEMV_LIMIT:-260} python3 bench/fused_gemv_gpu.py --out "$out/fused_gemv" --budget-s ${GEMV_BUDGET:-150}
fi
if has head_twolevel; then  # item 4: the exact head and two-level on graphs
  TAIL=30 step exact_head ${HEAD_LIMIT:-240} python3 bench/exact_head_gpu.py --out "$out/exact_head" --budget-s ${HEAD_BUDGET:-170}
  TAIL=30 step two_level ${TL_LIMIT:-230} python3 bench/two_level_graph_gpu.py --out "$out/two_level" --budget-s ${TL_BUDGET:-150}
fi
if has l2_tune; then  # item 2's micro-benchmark (the pool fix), then the tune with the tree seeds
  TAIL=30 step l2 ${L2_LIMIT:-130} python3 bench/l2_prefetch_gpu.py --out "$out/l2" --contexts 512 --budget-s ${L2_BUDGET:-100}
  DIR=/tmp/llama3-8b-peaked
  [ -d "$DIR" ] || TAIL=2 step hfdir 120 python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer .carry/smollm2-tok --out "$DIR" --peaked
  TAIL=40 step tune_tree ${TUNE_LIMIT:-330} $SP tune --target $DIR --device cuda --dtype bf16 --drafter block --simulate-acceptance ${PROFILE:-rates=0.8,block=8,sibling=0.5} --prompts copy-heavy --limit 2 --max-new-tokens 128 --trials ${TRIALS:-2} --budget ${BUDGET:-270} --compare-limit 1 --rank-gaps static --out "$out/tune_tree" --memory "$out/mem.sqlite"
fi
if has ray; then  # issue 17, only on a machine with several GPUs (nvidia-h200-x2 or more)
  # carry .whl/ray (bench/ray_wheels.py, ~46 MiB) in this call instead of the other wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/ray/*.whl > /dev/null 2>&1 || echo "ray wheels missing"
  TAIL=30 step ray_scaling ${RAY_LIMIT:-540} python3 bench/ray_scaling.py --out "$out/ray" --tokenizer .carry/smollm2-tok --kill ${RAY_ARGS:-}
fi
echo "== done $(date +%T)"
