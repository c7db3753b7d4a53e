"""Issue 17: ``specpilot tune --executor ray`` on one GPU and on N, under one trial budget.

    PYTHONPATH=src python3 bench/ray_scaling.py --target /tmp/llama3-8b --out DIR --kill  # N GPUs
    PYTHONPATH=src python3 bench/ray_scaling.py --tiny --workers 2 --kill --out DIR       # CPU smoke

Deployment (as ``bench/device_issue13.sh``'s tune_sim): the Llama-3-8B shape in bf16, an HF
directory from ``bench/make_hf_dir.py`` (built here from ``--tokenizer`` when ``--target`` does not
exist; ``--peaked`` weights), the block drafter under **simulated acceptance** (``tau=6.5,block=16``),
copy-heavy prompts, CUDA graphs. ``--tiny``: a tiny fp32 model with random weights and the SmolLM2
tokenizer (from the cache), the n-gram drafter, on the CPU.

1. **One trial budget**: ``--rounds 1`` (the stock engine, then one round of every direction),
   ``--trials`` per direction (default: the fewest, at least the workers, whose round can
   reach 0.8 N: see 3.),
   static gap order, the local-search proposer, seed 0, a time budget no run reaches: every run
   measures the same configs and differs only in its workers. No held-out compare.
2. **Correctness first**, every run: exit status 0; its memory holds each of its trials exactly
   once, as many as its workers returned (``run.json``); none failed; every run measured the same
   configs. The tune itself token-forces every trial.
3. **Timing**: runs on 1 worker and on N alternate, ``--repeats`` of each; per arm the median
   search wall time (the loop's clock, ``run.json``) with its range, and the whole command's.
   Speedup = median(1 worker) / median(N workers), target >= 0.8 N. Beside it the speedup the
   loop's order allows: a round's trials of every direction go to the pool as one queue (round
   1's led by the stock trial), and a round's stacked trial runs alone after it; from the
   1-worker run's per-trial seconds, each queue dealt in order to N workers. With equal trials
   that is (M + I) / (ceil(M / N) + I), M = directions x trials + 1 in round 1's queue, I = 1
   if winners of two directions were stacked (else 0).
4. **Agreement**: each run's best config; the same, or within noise (each best's speedup range
   overlaps the other's as measured in the same run).
5. ``--kill``: one more N-worker run (untimed) in which worker w1 is killed with SIGKILL
   ``--kill-after`` s after round 1 starts (its pid from the tune's ``worker w1 ready (pid P)``
   line, which the actor reads with ``os.getpid()``). Checks: exit 0, the same configs measured as
   without a kill (none lost, none twice), none failed, the death and the re-sent trial logged.

Appends one record per tune run to ``DIR/runs.jsonl`` (a rerun with the same ``--out`` skips runs
already there), writes ``DIR/ray_scaling.json`` and prints a short table last.

The GPU machine has no Ray: carry the wheels of ``bench/ray_wheels.py`` (about 50 MB) and install
them first (``pip install --no-index --no-deps --target /tmp/site .whl/ray/*.whl``, then
``PYTHONPATH=/tmp/site:src``). A run that does not fit one call goes on in the next with the same
``--out`` on the same (warm) machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"worker (w\d+) ready \(pid (\d+)\)")
ROUND1 = "round 1: directions"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke check)")
    ap.add_argument("--target", type=Path, default=Path("/tmp/llama3-8b"), help="8B HF dir")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer to build a target")
    ap.add_argument("--workers", type=int, default=None, help="N (default: every GPU)")
    ap.add_argument("--trials", type=int, default=None, help="per direction (default: N)")
    ap.add_argument("--directions", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="runs per arm, interleaved")
    ap.add_argument("--limit", type=int, default=None, help="tuning prompts (default 1; tiny 3)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(default 64; tiny 48)")
    ap.add_argument("--measure-rounds", type=int, default=2)
    ap.add_argument("--kill", action="store_true", help="also the kill drill")
    ap.add_argument("--kill-after", type=float, default=None, help="s (default 5; tiny 0)")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="s per tune run")
    args = ap.parse_args(argv)
    args.limit = args.limit or (3 if args.tiny else 1)
    args.max_new_tokens = args.max_new_tokens or (48 if args.tiny else 64)
    args.kill_after = (
        args.kill_after if args.kill_after is not None else (0.0 if args.tiny else 5.0)
    )
    return args


# ----------------------------------------------------------------------------- the deployment
def tiny_target(out: Path, tokenizer: Path | None) -> Path:
    """A tiny random fp32 model with the SmolLM2 tokenizer (its vocabulary), as an HF dir."""
    import torch

    from specpilot.bench.hf_dir import write_hf_dir
    from specpilot.loading.fetch import cache_dir
    from specpilot.loading.tokenizer import load_tokenizer
    from specpilot.models import Transformer
    from specpilot.synthetic import TARGET_SHAPES, init_random_on_device

    if (out / "config.json").is_file():
        return out
    tok_dir = tokenizer or next((cache_dir() / "tokenizers").iterdir())
    vocab = load_tokenizer(tok_dir).vocab_size
    cfg = dataclasses.replace(TARGET_SHAPES["tiny-llama"], vocab_size=vocab)
    model = Transformer(cfg, dtype=torch.float32, device="cpu", max_positions=1024)
    init_random_on_device(model, 0)
    return write_hf_dir(model, out, tok_dir)


def gpu_target(args: argparse.Namespace) -> Path:
    if (args.target / "config.json").is_file():
        return args.target
    if args.tokenizer is None:
        sys.exit(f"{args.target} is not a model directory: pass --tokenizer DIR to build it")
    cmd = [sys.executable, str(ROOT / "bench/make_hf_dir.py"), "--shape", "llama3-8b"]
    cmd += ["--tokenizer", str(args.tokenizer), "--out", str(args.target), "--peaked"]
    subprocess.run(cmd, check=True, env=child_env())
    return args.target


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def tune_command(args: argparse.Namespace, target: Path, workers: int, run_dir: Path) -> list[str]:
    dep = ["--device", "cpu", "--dtype", "fp32", "-k", "2"]
    if not args.tiny:
        dep = ["--device", "cuda", "--dtype", "bf16", "--drafter", "block"]
        dep += ["--simulate-acceptance", "tau=6.5,block=16"]
    flags = {
        "--target": target,
        "--prompts": "copy-heavy",
        "--limit": args.limit,
        "--max-new-tokens": args.max_new_tokens,
        "--measure-rounds": args.measure_rounds,
        "--rounds": 1,
        "--trials": args.trials,
        "--directions": args.directions,
        "--budget": 100000,
        "--compare-limit": 0,
        "--rank-gaps": "static",
        "--explorer": "local",
        "--seed": 0,
        "--executor": "ray",
        "--workers": workers,
        "--out": run_dir,
        "--memory": run_dir / "memory.sqlite",
    }
    cmd = [sys.executable, "-m", "specpilot.cli", "tune", *dep]
    for k, v in flags.items():
        cmd += [k, str(v)]
    return cmd


# ----------------------------------------------------------------------------- one tune run
def run_tune(args: argparse.Namespace, cmd: list[str], run_dir: Path, kill: bool) -> dict[str, Any]:
    """Run one tune (killing w1 mid-run if ``kill``); its log, exit status, times, and memory."""
    shutil.rmtree(run_dir, ignore_errors=True)  # what a run cut short left
    run_dir.mkdir(parents=True)
    rec: dict[str, Any] = {"pids": {}, "killed": None}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
    )
    guard = threading.Timer(args.run_timeout, proc.kill)
    guard.start()
    timer: threading.Timer | None = None
    assert proc.stdout is not None
    with open(run_dir / "tune.log", "w") as log:
        for line in proc.stdout:
            log.write(line)
            m = READY.search(line)
            if m:
                rec["pids"][m[1]] = int(m[2])
            if kill and timer is None and ROUND1 in line and "w1" in rec["pids"]:
                timer = threading.Timer(args.kill_after, _kill, (rec, rec["pids"]["w1"], t0))
                timer.start()
    rec["rc"] = proc.wait()
    guard.cancel()
    if timer is not None:
        timer.join()
    rec["command_wall_s"] = time.perf_counter() - t0
    text = (run_dir / "tune.log").read_text()
    rec["died_mid_trial"] = "(pid" in text and "died after" in text
    rec["resent"] = "goes to the next free worker" in text
    rec.update(read_run(run_dir))
    return rec


def _kill(rec: dict[str, Any], pid: int, t0: float) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        rec["killed"] = {"worker": "w1", "pid": pid, "at_s": time.perf_counter() - t0}
    except ProcessLookupError:
        rec["killed"] = {"worker": "w1", "pid": pid, "at_s": None, "note": "already gone"}


def read_run(run_dir: Path) -> dict[str, Any]:
    """What the run left: run.json's search usage, every trial in its memory, its best config."""
    from specpilot.engine.config import EngineConfig
    from specpilot.tune.space import config_hash, describe

    out: dict[str, Any] = {"search": None, "trials": [], "best": None}
    run_json, tuned = run_dir / "run.json", run_dir / "tuned.json"
    if run_json.is_file():
        out["search"] = json.loads(run_json.read_text()).get("search")
    db_path = run_dir / "memory.sqlite"
    if db_path.is_file():
        db = sqlite3.connect(db_path)
        rows = db.execute(
            "SELECT round, explorer, config_hash, config, metrics FROM trials "
            "WHERE run = (SELECT max(id) FROM runs) ORDER BY id"
        ).fetchall()
        db.close()
        for round_, explorer, h, cfg, metrics in rows:
            m = json.loads(metrics)
            out["trials"].append(
                {
                    "round": round_,
                    "explorer": explorer,
                    "hash": h,
                    "config": describe(EngineConfig.from_dict(json.loads(cfg))),
                    "speedup_rounds": m.get("speedup_rounds") or [m.get("speedup", 0.0)],
                    "busy_seconds": m.get("busy_seconds", 0.0),
                    "worker": m.get("worker"),
                    "error": m.get("error"),
                }
            )
    if tuned.is_file():
        out["best"] = config_hash(EngineConfig.load(tuned))
    return out


# ----------------------------------------------------------------------------- the checks
def correctness(rec: dict[str, Any], reference: set[str] | None) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    bad = []
    hashes = [t["hash"] for t in rec["trials"]]
    if rec["rc"] != 0:
        bad.append(f"exit status {rec['rc']}")
    if not hashes:
        bad.append("no trial in its memory")
    if len(set(hashes)) != len(hashes):
        bad.append("a trial recorded twice")
    returned = sum(w["trials"] for w in (rec["search"] or {}).get("per_worker", {}).values())
    if rec["search"] is None or returned != len(hashes):
        bad.append(f"workers returned {returned} results, memory holds {len(hashes)}")
    failed = [t["config"] for t in rec["trials"] if t["error"]]
    if failed:
        bad.append(f"failed trials: {failed}")
    if reference is not None and set(hashes) != reference:
        bad.append(f"measured other configs than the first run ({len(set(hashes) ^ reference)})")
    return bad


def spread(rec: dict[str, Any], h: str | None) -> tuple[float, float, float] | None:
    """(lowest, median, highest) per-round speedup of config ``h`` in run ``rec``."""
    for t in rec["trials"]:
        if t["hash"] == h:
            v = t["speedup_rounds"]
            return min(v), statistics.median(v), max(v)
    return None


def agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``same``, ``within noise`` (each best within the other's range, measured in one run) or
    ``differ``."""
    if a["best"] == b["best"]:
        return "same"
    for run in (a, b):
        x, y = spread(run, a["best"]), spread(run, b["best"])
        if x is None or y is None or x[0] > y[2] or y[0] > x[2]:
            return "differ"
    return "within noise"


def schedule_bound(one: dict[str, Any], n: int) -> float:
    """Speedup the loop's order allows N workers, with the 1-worker run's per-trial seconds:
    each round's trials of every direction are one queue (round 1's led by the stock trial,
    unless a warm start ran in round 0), dealt in the order the loop sent them to the first free
    of N workers; a round's stacked (``integrate``) trial waits for its queue and runs alone;
    queues one after another (a round's decisions need all of its trials)."""
    warm = any(t["round"] == 0 and t["explorer"] == "memory" for t in one["trials"])
    batches: dict[tuple[int, str], list[float]] = {}
    for i, t in enumerate(one["trials"]):
        round_ = 1 if t["round"] == 0 and not warm else t["round"]
        if round_ == 0 or t["explorer"] in ("integrate", "confirm"):
            key = (round_, f"{t['explorer']}-{i}")  # alone
        else:
            key = (round_, "queue")
        batches.setdefault(key, []).append(t["busy_seconds"])
    total = makespan = 0.0
    for seconds in batches.values():
        free = [0.0] * n
        for s in seconds:
            i = free.index(min(free))
            free[i] += s
        total, makespan = total + sum(seconds), makespan + max(free)
    return total / makespan if makespan > 0 else 0.0


def wave_cap(n: int, queued: int, stacked: int) -> float:
    """The same bound with equal trials: ``queued`` trials in round 1's queue (the stock one
    included) take ceil(queued / n) waves, and each of ``stacked`` stacked trials one more."""
    return (queued + stacked) / (math.ceil(queued / n) + stacked) if queued else 0.0


def default_trials(n: int, directions: int) -> int:
    """The fewest trials per direction, at least ``n``, whose round 1 (with the stock trial)
    allows 0.8 N with equal trials and no stacked trial (``--trials N`` allows (3N + 1) / 4)."""
    t = n
    while wave_cap(n, directions * t + 1, 0) < 0.8 * n:
        t += 1
    return t


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.exit("Ray is not installed here: install it (pip install 'ray==2.60.0') and rerun")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        target = tiny_target(args.out / "tiny-model", args.tokenizer)
        n = args.workers or 2
    else:
        n = args.workers or torch.cuda.device_count()
        if n < 2 or torch.cuda.device_count() < n:
            sys.exit(f"needs at least 2 GPUs and --workers <= {torch.cuda.device_count()}")
        target = gpu_target(args)
    args.trials = args.trials or default_trials(n, args.directions)
    log_path = args.out / "runs.jsonl"
    done = [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []
    plan = [(w, r, False) for r in range(args.repeats) for w in ((1, n) if r % 2 == 0 else (n, 1))]
    plan += [(n, 0, True)] if args.kill else []
    records = []
    for workers, repeat, kill in plan:
        key = {"workers": workers, "repeat": repeat, "kill": kill, "per_direction": args.trials}
        old = [d for d in done if all(d.get(k) == v for k, v in key.items())]
        if old:
            records.append(old[0])
            continue
        name = f"w{workers}-r{repeat}" + ("-kill" if kill else "")
        print(f"== tune on {workers} worker(s) ({name}) ...", flush=True)
        cmd = tune_command(args, target, workers, args.out / name)
        rec = key | {"name": name} | run_tune(args, cmd, args.out / name, kill)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        records.append(rec)
    return summarize(args, n, records)


def summarize(args: argparse.Namespace, n: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    reference = {t["hash"] for t in records[0]["trials"]}
    checks = {r["name"]: correctness(r, reference) for r in records}
    arms: dict[int, dict[str, Any]] = {}
    for w in (1, n):
        runs = [r for r in records if r["workers"] == w and not r["kill"]]
        search = [r["search"]["wall_seconds"] for r in runs if r["search"]]
        whole = [r["command_wall_s"] for r in runs]
        arms[w] = {
            "runs": len(runs),
            "search_wall_s": search,
            "command_wall_s": whole,
            "median_search_s": statistics.median(search) if search else None,
            "median_command_s": statistics.median(whole) if whole else None,
            "device_seconds": [r["search"]["device_seconds"] for r in runs if r["search"]],
            "trials": [len(r["trials"]) for r in runs],
            "best": [r["best"] for r in runs],
        }
    one, many = arms[1], arms[n]
    speedup = (
        one["median_search_s"] / many["median_search_s"]
        if one["median_search_s"] and many["median_search_s"]
        else None
    )
    first = {w: next(r for r in records if r["workers"] == w and not r["kill"]) for w in (1, n)}
    kill = next((r for r in records if r["kill"]), None)
    out = {
        "setting": "tiny model on the CPU (smoke check)"
        if args.tiny
        else "llama3-8b bf16, block drafter, simulated acceptance tau=6.5,block=16",
        "workers": n,
        "trials_per_direction": args.trials,
        "correct": all(not v for v in checks.values()),
        "checks": checks,
        "arms": arms,
        "speedup_search": speedup,
        "speedup_command": (
            one["median_command_s"] / many["median_command_s"] if many["median_command_s"] else None
        ),
        "target": 0.8 * n,
        "met": speedup is not None and speedup >= 0.8 * n,
        "schedule_bound": schedule_bound(first[1], n),
        "wave_cap": wave_cap(n, *round_one(first[1])),
        "best_agree": agreement(first[1], first[n]),
        "best_config": {w: describe_best(first[w]) for w in (1, n)},
        "kill": None
        if kill is None
        else {
            "killed": kill["killed"],
            "rc": kill["rc"],
            "died_mid_trial": kill["died_mid_trial"],
            "resent": kill["resent"],
            "nothing_lost": not checks[kill["name"]],
        },
    }
    (args.out / "ray_scaling.json").write_text(json.dumps(out, indent=2) + "\n")
    print_table(out, n)
    return out


def round_one(rec: dict[str, Any]) -> tuple[int, int]:
    """(trials in round 1's queue, the stock one included; stacked trials) of a run."""
    queued = sum(t["round"] in (0, 1) and t["explorer"] != "integrate" for t in rec["trials"])
    return queued, sum(t["explorer"] == "integrate" for t in rec["trials"])


def describe_best(rec: dict[str, Any]) -> str:
    s = spread(rec, rec["best"])
    name = next((t["config"] for t in rec["trials"] if t["hash"] == rec["best"]), "?")
    return name + (f" {s[1]:.2f}x ({s[0]:.2f}-{s[2]:.2f})" if s else "")


def print_table(out: dict[str, Any], n: int) -> None:
    print(f"\n{out['setting']}; {n} workers; {out['trials_per_direction']} trials per direction")
    for name, bad in out["checks"].items():
        print(f"  check {name}: {'ok' if not bad else '; '.join(bad)}")
    print(
        f"{'arm':<10} {'runs':>4} {'search s':>9} {'command s':>10} {'device-s':>9} {'trials':>6}"
    )
    for w, a in out["arms"].items():
        dev = statistics.median(a["device_seconds"]) if a["device_seconds"] else 0.0
        rng = f"{min(a['search_wall_s']):.0f}-{max(a['search_wall_s']):.0f}" if a["runs"] else "-"
        print(
            f"{f'{w} worker' + ('s' if w > 1 else ''):<10} {a['runs']:>4} "
            f"{a['median_search_s'] or 0:>9.1f} {a['median_command_s'] or 0:>10.1f} "
            f"{dev:>9.1f} {','.join(map(str, a['trials'])):>6}  (search {rng} s)"
        )
    sp = out["speedup_search"] or 0.0
    print(
        f"speedup (search wall): {sp:.2f}x, target >= {out['target']:.1f}x: "
        f"{'MET' if out['met'] else 'MISSED'}; the loop's order allows {out['schedule_bound']:.2f}x "
        f"(equal trials: {out['wave_cap']:.2f}x); whole command {out['speedup_command'] or 0:.2f}x"
    )
    print(f"best configs: {out['best_agree']} ({out['best_config']})")
    k = out["kill"]
    if k is not None:
        print(
            f"kill drill: {k['killed']}; exit {k['rc']}; died mid-trial {k['died_mid_trial']}; "
            f"trial re-sent {k['resent']}; nothing lost {k['nothing_lost']}"
        )
    print(f"correct: {out['correct']}")


if __name__ == "__main__":
    main()
