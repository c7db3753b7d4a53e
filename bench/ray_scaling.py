"""Issue 17: ``specpilot tune --executor ray`` on one GPU and on N, under one trial budget.

    PYTHONPATH=src python3 bench/ray_scaling.py --target /tmp/llama3-8b --out DIR --kill  # N GPUs
    PYTHONPATH=src python3 bench/ray_scaling.py --tiny --workers 2 --kill --out DIR       # CPU smoke

Deployment (as ``bench/device.sh tune``'s tune_sim): the Llama-3-8B shape in bf16, an HF
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
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specpilot.tune.scaling import default_trials, print_table, read_run, summarize

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
    setting = (
        "tiny model on the CPU (smoke check)"
        if args.tiny
        else "llama3-8b bf16, block drafter, simulated acceptance tau=6.5,block=16"
    )
    out = summarize(n, records, setting, args.trials)
    (args.out / "ray_scaling.json").write_text(json.dumps(out, indent=2) + "\n")
    print_table(out, n)
    return out


if __name__ == "__main__":
    main()
