"""What holds a served decode step at 1 and at 32 rows (issue 28): host or device time.

    PYTHONPATH=src python3 bench/step_profile_gpu.py --out DIR -- <serve flags>

Builds the engine thread's scheduler exactly as ``specpilot serve`` does (``build_worker``, the
same flags, graphs warmed unless ``--no-warm-graphs``), then for ``n`` = 1 and 32 requests
(random prompts of 48 tokens, long budgets, so every row decodes throughout):

* **scheduler step**: the wall time of ``Scheduler.step`` (one AR window of ``--stream-window``
  steps with the lookahead, the device synchronized after each), and tokens per step;
* **device step**: one AR step over the first ``n`` rows (``Engine.first_rows``: the graph the
  window replays), ``R`` of them queued between two CUDA events, per step;
* **host enqueue**: the host time to queue one such step (graph launches), no sync inside.

Aggregate rate over ``n`` rows = n x tokens per step / scheduler step; its ratio to one row's
says what ``n`` concurrent streams can give at most without the HTTP side. Writes
``DIR/step_profile.json``; prints a short table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from specpilot.cli import build_parser
from specpilot.commands.serve import build_worker
from specpilot.engine import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30, help="scheduler steps timed per n")
    ap.add_argument("--replays", type=int, default=50, help="device steps queued per timing")
    ap.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the serve flags")
    a = ap.parse_args()
    flags = a.serve[1:] if a.serve[:1] == ["--"] else a.serve
    worker, desc = build_worker(build_parser().parse_args(["serve", *flags]))
    sched = worker.scheduler
    engine = sched.engine
    vocab = engine.target.cfg.vocab_size
    rng = random.Random(0)
    result: dict[str, object] = {"engine": desc}
    rows = {}
    for n in (1, 32):
        if n > sched.num_slots:
            continue
        for i in range(n):
            prompt = tuple(rng.randrange(vocab) for _ in range(48))
            sched.submit(Request(f"n{n}-{i}", prompt, 4 * a.steps * 8 + 64, frozenset()))
        while sched.running < n or sched.waiting or not all(engine.host.active[:n]):
            sched.step()
        for _ in range(3):  # past the one-step windows of the first tokens
            sched.step()
        walls, toks = [], []
        for _ in range(a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = sched.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            toks.append(sum(len(t) for _, t in rep.committed) / n)
        # the device step over the first n rows, as the window replays it
        live = engine.live_rows()
        attn = engine.bucket(max(engine.host.lens) + 3 * a.replays + 8)  # past every step
        hosts, devs = [], []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            with engine.first_rows(live):
                start.record()
                t0 = time.perf_counter()
                for _ in range(a.replays):
                    engine.run_verify(1, attn, with_hidden=False)
                    engine.run_accept(0)
                hosts.append((time.perf_counter() - t0) / a.replays)
                end.record()
            torch.cuda.synchronize()
            devs.append(start.elapsed_time(end) / 1e3 / a.replays)
        for i in range(n):
            sched.cancel(f"n{n}-{i}")
        wall, tok = statistics.median(walls), statistics.median(toks)
        rows[n] = {
            "live_rows": live,
            "attn_len": attn,
            "scheduler_step_ms": [round(1e3 * w, 3) for w in walls],
            "tokens_per_row_per_step": tok,
            "ms_per_token_step": 1e3 * wall / tok,
            "device_step_ms": [round(1e3 * d, 3) for d in devs],
            "host_enqueue_ms": [round(1e3 * h, 3) for h in hosts],
            "aggregate_tok_s": n * tok / wall,
        }
    result["rows"] = rows
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "step_profile.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"graphs: {desc.get('warm_graphs')}")
    print(f"{'rows':>4} {'sched step ms':>14} {'tok/row/step':>12} {'ms/token-step':>13} "
          f"{'device step ms':>14} {'host enqueue ms':>15} {'agg tok/s':>10}")  # fmt: skip
    for n, r in rows.items():
        dev = statistics.median(r["device_step_ms"])  # type: ignore[arg-type]
        host = statistics.median(r["host_enqueue_ms"])  # type: ignore[arg-type]
        step = statistics.median(r["scheduler_step_ms"])  # type: ignore[arg-type]
        print(f"{n:>4} {step:>14.2f} {r['tokens_per_row_per_step']:>12.1f} "
              f"{r['ms_per_token_step']:>13.2f} {dev:>14.3f} {host:>15.3f} "
              f"{r['aggregate_tok_s']:>10.1f}")  # fmt: skip
    if 1 in rows and 32 in rows:
        ratio = rows[32]["aggregate_tok_s"] / rows[1]["aggregate_tok_s"]  # type: ignore[operator]
        print(f"32 rows / 1 row aggregate (engine thread alone, no HTTP): {ratio:.1f}x")


if __name__ == "__main__":
    main()
