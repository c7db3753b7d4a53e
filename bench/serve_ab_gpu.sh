#!/usr/bin/env bash
# Idle TTFT and single-stream speed of `specpilot serve` (issue 28), servers A/B on one GPU:
# every server is started first, then rounds alternate between them (`specpilot bench --mode
# serve --concurrency 1`: one request at a time, so every request meets an idle server).
#
#   bash bench/serve_ab_gpu.sh OUT "name=SRCDIR:flags" ...    (run from the repository root)
#
# e.g. "base=../base/src:" "new=src:" "new-nolook=src:--no-lookahead". SRCDIR is put first on
# PYTHONPATH (a second checkout's sources run the baseline; the 2026-12-04 rows of
# docs/BENCHMARKS.md ran from a copy of this checkout in .carry/wt, the baseline from
# `git archive d121bc2 src | tar -x -C .carry/base`, both carried). Each server: the 8B random directory
# ($DIR, bench/make_hf_dir.py), bf16, --drafter none, --stream-window 4, --max-concurrency 32,
# CUDA graphs on. ROUNDS (3) rounds of REQUESTS (16) requests of TOKENS (128) tokens over the
# first 8 mt-bench prompts; one untimed round first (graph captures). Then, with the servers
# gone, offline `specpilot bench` AR on the same directory (OFFLINE=0 skips it). HOLD=FILE:
# the rounds wait while FILE exists (the servers load meanwhile). LEVELS=16,32: then each server
# at those concurrencies, PASSES (1) times, the order rotating every pass; LOAD_FIRST=1 runs
# those passes first, on servers that served nothing yet (no untimed round before them), so
# graph captures on first use land in the figures as they would for a fresh server's users.
# e.g. the graph warm-up A/B: LEVELS=1,4,16,32 PASSES=2 LOAD_FIRST=1 ... "warm=src:" \
# "cold=src:--no-warm-graphs". SPLIT=1: each level its own `bench` run, and after each the
# server's prefill counters (steps that fed prompts, their seconds, the rows they admitted and
# the target forwards they took, where the server has them) are appended to admissions.txt as
# that level's deltas: how a level's wave of arrivals was admitted. Ends with a table of each
# server's load passes (loads.txt).
set -u
out=${1:?output dir}; shift
mkdir -p "$out"
DIR=${DIR:-/tmp/llama3-8b} ROUNDS=${ROUNDS:-3} REQUESTS=${REQUESTS:-16} TOKENS=${TOKENS:-128}
SP="python3 -m specpilot.cli"
dep="--target $DIR --device ${DEVICE:-cuda} --dtype ${DTYPE:-bf16} --drafter none"
port=8200; names=(); ports=(); pids=()
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}; src=${rest%%:*} flags=${rest#*:}
  PYTHONPATH=/tmp/site:$src $SP serve $dep --stream-window 4 --max-concurrency 32 \
    --max-context ${MAX_CONTEXT:-2048} --port $port $flags > "$out/serve_$name.log" 2>&1 &
  names+=("$name"); ports+=($port); pids+=($!); port=$((port + 1))
done
for i in "${!ports[@]}"; do  # up to 200 s each; a server that died is not waited for
  for _ in $(seq 200); do
    curl -sf "http://127.0.0.1:${ports[$i]}/health" > /dev/null && break
    kill -0 "${pids[$i]}" 2> /dev/null || { echo "server ${names[$i]} died:"; tail -5 "$out/serve_${names[$i]}.log"; break; }
    sleep 1
  done
done
echo "servers up $(date +%T)"
while [ -e "${HOLD:-/nonexistent}" ]; do sleep 1; done  # e.g. tests still running on the GPU
load() {  # $1 port, $2 label, $3 requests
  PYTHONPATH=/tmp/site:src timeout 120 $SP bench --mode serve --url "http://127.0.0.1:$1" \
    --prompts mt-bench --limit 8 --concurrency 1 --requests "$3" --max-new-tokens "$TOKENS" \
    --out "$out/$2.json" 2>&1 | grep "concurrency" | sed "s/^/$2 /"
}
for i in "${!names[@]}"; do grep -h "specpilot serve:" "$out/serve_${names[$i]}.log" | sed "s/^/${names[$i]}: /"; done
admitted() {  # $1 port: the server's prefill counters (steps, seconds, rows, forwards)
  curl -s "http://127.0.0.1:$1/metrics" | awk '/^specpilot_prefill_step_seconds_count/ {a=$2}
    /^specpilot_prefill_step_seconds_sum/ {b=$2} /^specpilot_prefill_rows_sum/ {c=$2}
    /^specpilot_prefill_forwards_total/ {d=$2} END {print a+0, b+0, c+0, d+0}'
}
levels() {  # each server PASSES times under concurrent load at LEVELS, the order rotating
  [ -n "${LEVELS:-}" ] || return 0
  local each=$LEVELS
  [ "${SPLIT:-0}" = 1 ] && each=${LEVELS//,/ }
  for p in $(seq "${PASSES:-1}"); do
    for i in "${!names[@]}"; do
      j=$(( (i + p - 1) % ${#names[@]} ))
      for lv in $each; do
        local before; before=$(admitted "${ports[$j]}")
        PYTHONPATH=/tmp/site:src timeout 150 $SP bench --mode serve --url "http://127.0.0.1:${ports[$j]}" \
          --prompts mt-bench --limit 8 --concurrency "$lv" --max-new-tokens "$TOKENS" \
          --out "$out/load_p${p}_${names[$j]}_${lv//,/-}.json" 2>&1 | grep "concurrency " \
          | sed "s/^/load_p${p}_${names[$j]} /" | tee -a "$out/loads.txt"
        [ "${SPLIT:-0}" = 1 ] || continue
        echo "$before $(admitted "${ports[$j]}")" | awk -v n="${names[$j]}" -v p="$p" -v c="$lv" \
          '{printf "admit %s p%s c%s: %d prefill steps, %.1f ms each, %d rows, %d forwards\n", n, p, c,
            $5-$1, ($5>$1) ? 1e3*($6-$2)/($5-$1) : 0, $7-$3, $8-$4}' | tee -a "$out/admissions.txt"
      done
    done
  done
}
[ "${LOAD_FIRST:-0}" = 1 ] && levels
if [ "${ROUNDS}" -gt 0 ]; then
  for i in "${!names[@]}"; do load "${ports[$i]}" "warm_${names[$i]}" 8 > /dev/null; done
fi
for r in $(seq "$ROUNDS"); do
  for i in "${!names[@]}"; do
    j=$(( (i + r) % ${#names[@]} ))  # the order rotates every round
    load "${ports[$j]}" "r${r}_${names[$j]}" "$REQUESTS" | tee -a "$out/rounds.txt"
  done
done
[ "${LOAD_FIRST:-0}" = 1 ] || levels
for i in "${!names[@]}"; do
  curl -s "http://127.0.0.1:${ports[$i]}/metrics" > "$out/metrics_${names[$i]}.txt"
  kill "${pids[$i]}"
done
wait
if [ "${OFFLINE:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site:src timeout 200 $SP bench $dep --prompts mt-bench --limit 2 \
    --max-new-tokens "$TOKENS" --rounds 3 > "$out/offline.log" 2>&1
  tail -n 12 "$out/offline.log"
fi
touch "$out/rounds.txt" "$out/loads.txt"
python3 - "$out/rounds.txt" "$out/loads.txt" <<'EOF'
import re, statistics, sys
num = r"([\d.]+)"
pat = (rf"load_p(\d+)_(\S+)\s+concurrency\s+(\d+): \S+ ok\s+TTFT p50 {num} p99 {num} ms\s+"
       rf"TPOT p50 {num} ms\s+ITL p50 {num} p99 {num} ms\s+{num} tok/s")
loads = [re.match(pat, line) for line in open(sys.argv[2])]
if any(loads):
    print(f"{'server':<10} {'conc':>4} {'pass':>4} {'TTFT p50/p99 ms':>16} {'p99/p50':>7} "
          f"{'TPOT ms':>7} {'ITL p50/p99 ms':>15} {'tok/s':>9}")
    for m in sorted((m for m in loads if m), key=lambda m: (m[2], int(m[3]), int(m[1]))):
        p, name, c, t50, t99, tpot, i50, i99, tps = m.groups()
        print(f"{name:<10} {c:>4} {p:>4} {t50:>7}/{t99:<8} {float(t99) / float(t50):>7.2f} "
              f"{tpot:>7} {i50:>7}/{i99:<7} {tps:>9}")
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"r\d+_(\S+) .*TTFT p50 ([\d.]+) p99 ([\d.]+) ms\s+TPOT p50 ([\d.]+).*?([\d.]+) tok/s", line)
    if m:
        rows.setdefault(m[1], []).append([float(x) for x in m.groups()[1:]])
print(f"{'server':<14} {'TTFT p50 ms (rounds)':<26} {'TPOT p50 ms':<20} {'tok/s (rounds)':<24}")
for name, v in rows.items():
    t, tp, s = [r[0] for r in v], [r[2] for r in v], [r[3] for r in v]
    f = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    print(f"{name:<14} {f(t):<26} {f(tp):<20} {f(s):<24}")
EOF
