"""Continuous batching on the static (CUDA-graph) engine vs static batches run back to back.

    PYTHONPATH=src python3 bench/static_sched_gpu.py --out DIR            # H200, < 3 minutes
    PYTHONPATH=src python3 bench/static_sched_gpu.py --out DIR --tiny     # CPU smoke run (fp32)

Llama-3-8B shape with seeded random bf16 weights made peaked (``synthetic.make_peaked``: clear
top-1 margins, no bf16 near-ties), the DFlash-like block drafter ``dflash-b16`` (real compute)
under **simulated acceptance** (profile ``--profile``, default ``tau=5,block=16``). A stream of
``--requests`` (48) requests, prompts of ``--prompt-len`` (128) random tokens, ``max_new_tokens``
drawn uniformly from ``--min-new``..``--max-new`` (64..256) so rows finish at different times,
all queued at once, served at concurrency ``--concurrency`` (16) by:

* (a) ``continuous`` — ``StaticScheduler``: a finished row is refilled with the next request
  between cycles (``engine/static_rows.py``);
* (b) ``static batches`` — the stock approach: batches of 16 in arrival order, each
  ``StaticEngine.generate``-d to its longest request (a row past its own limit keeps computing
  and its surplus tokens are dropped, as a finished row of a static batch sits idle);
* (c) ``AR static batches`` — the same batches, plain AR (the static engine without a drafter).

Each variant runs once to warm up (graph capture) and once timed, in the same process on the
same weights; ``torch.cuda.synchronize`` before every clock. Throughput is the requests' own
tokens (first token and prefill included, surplus tokens excluded) over the wall time of the
whole stream, minus the simulated-acceptance oracle's reference runs (``CycleTimes.excluded``).
Tokens of (a) are compared per request with (b) and with (c); rows that differ are token-forced
(``check_rows``: near-ties counted, a mismatch fails). JSON to ``DIR/static_sched_gpu.json``; a
short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.static_runs import check_rows, run_header, synthetic_deployment
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.batching import Request
from specpilot.engine.batching.static_scheduler import StaticScheduler
from specpilot.engine.static_engine import StaticEngine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (smoke test)")
    ap.add_argument("--profile", default=None, help="acceptance profile (default tau=5,block=16)")
    ap.add_argument("--concurrency", type=int, default=None, help="rows (default 16; tiny 4)")
    ap.add_argument("--requests", type=int, default=None, help="stream length (default 48)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; tiny 10")
    ap.add_argument("--min-new", type=int, default=None, help="default 64; tiny 8")
    ap.add_argument("--max-new", type=int, default=None, help="default 256; tiny 32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = args.tiny
    args.profile = args.profile or ("tau=3,block=9" if t else "tau=5,block=16")
    args.concurrency = args.concurrency or (4 if t else 16)
    args.requests = args.requests or (12 if t else 48)
    args.prompt_len = args.prompt_len or (10 if t else 128)
    args.min_new = args.min_new or (8 if t else 64)
    args.max_new = args.max_new or (32 if t else 256)
    if not 1 <= args.min_new <= args.max_new:
        ap.error("need 1 <= --min-new <= --max-new")
    return args


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(
    dev: torch.device, engine: StaticEngine, run: Callable[[], list[list[int]]]
) -> tuple[list[list[int]], float, int]:
    """Warm-up run, then the timed run; its tokens, seconds (oracle reference runs out) and
    graph captures (should be 0: the warm-up captured every graph)."""
    run()
    sync(dev)
    excluded0, captures0 = engine.times.excluded, engine.runner.captures
    t0 = time.perf_counter()
    toks = run()
    sync(dev)
    wall = time.perf_counter() - t0 - (engine.times.excluded - excluded0)
    return toks, wall, engine.runner.captures - captures0


def static_batches(
    engine: StaticEngine, reqs: list[Request], size: int, counts: dict[str, int]
) -> list[list[int]]:
    """The stock approach: batches of ``size`` in order, each to its longest request; every row
    cut to its own limit. ``generate`` resets ``engine.times`` (and simulated acceptance its
    divergence count) per batch, so both are summed here; ``counts`` gets this run's sums."""
    out: list[list[int]] = []
    excluded = engine.times.excluded
    sim = engine.drafter if isinstance(engine.drafter, SimulatedAcceptance) else None
    counts.update(cycles=0, oracle_divergences=0)
    for i in range(0, len(reqs), size):
        batch = reqs[i : i + size]
        n = max(r.max_new_tokens for r in batch)
        res = engine.generate([list(r.prompt_ids) for r in batch], n)
        excluded += engine.times.excluded
        counts["cycles"] += engine.times.cycles
        counts["oracle_divergences"] += sim.divergences if sim is not None else 0
        out += [g.tokens[: r.max_new_tokens] for g, r in zip(res, batch, strict=True)]
    engine.times.excluded = excluded
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dep = synthetic_deployment(args.tiny, args.seed, peaked=True, max_positions=2048)
    target, block, dev = dep.target, dep.block, dep.target.device
    profile = AcceptanceProfile.parse(args.profile)
    label = (
        f"{dep.shape} {str(target.dtype).removeprefix('torch.')} · peaked random target · "
        f"{dep.draft_shape} · "
        f"{SIM_LABEL} ({args.profile}) · {args.requests} requests at concurrency "
        f"{args.concurrency}, max_new {args.min_new}..{args.max_new}"
    )
    rng = random.Random(args.seed)
    vocab = target.cfg.vocab_size
    reqs = [
        Request(
            f"r{i}",
            tuple(rng.randrange(vocab) for _ in range(args.prompt_len)),
            rng.randint(args.min_new, args.max_new),
        )
        for i in range(args.requests)
    ]
    prompts = [list(r.prompt_ids) for r in reqs]
    useful = sum(r.max_new_tokens for r in reqs)  # no stop tokens: every request runs to its limit
    result: dict[str, Any] = {**run_header(label, args, dev), "runs": []}
    out_file = args.out / "static_sched_gpu.json"

    def save() -> None:
        result["total_s"] = time.perf_counter() - t_start
        out_file.write_text(json.dumps(result, indent=1) + "\n")

    def record(name: str, toks: list[list[int]], wall: float, **extra: Any) -> None:
        assert [len(t) for t in toks] == [r.max_new_tokens for r in reqs], f"{name}: lengths"
        row = {"variant": name, "tokens": useful, "wall_s": wall, "tok_s": useful / wall, **extra}
        result["runs"].append(row)
        print(f"[static_sched] {row}", flush=True)
        save()

    # ---------------------------------------------------------------- (c) AR static batches
    ar = StaticEngine(target)
    n_c: dict[str, int] = {}
    ar_toks, wall, cap = timed(dev, ar, lambda: static_batches(ar, reqs, args.concurrency, n_c))
    record("AR static batches", ar_toks, wall, steps=n_c["cycles"], timed_captures=cap)

    # ---------------------------------------------------------------- (b) spec static batches
    sim_b = SimulatedAcceptance(block, profile, seed=args.seed)
    eng_b = StaticEngine(target, sim_b)
    n_b: dict[str, int] = {}
    b_toks, wall, cap = timed(
        dev, eng_b, lambda: static_batches(eng_b, reqs, args.concurrency, n_b)
    )
    vs_ar = check_rows(target, prompts, ar_toks, b_toks)
    record("static batches", b_toks, wall, **n_b, timed_captures=cap, vs_ar=vs_ar)

    # ---------------------------------------------------------------- (a) continuous
    sim_a = SimulatedAcceptance(block, profile, seed=args.seed)
    eng_a = StaticEngine(target, sim_a)
    max_context = args.prompt_len + args.max_new
    sched = StaticScheduler(eng_a, slots=args.concurrency, max_context=max_context)
    steps: list[int] = []
    stats: list[tuple[int, int]] = []

    def continuous() -> list[list[int]]:
        s0 = sched.steps
        sim_a.divergences = 0  # counted since bind; this run's only
        res = sched.run(reqs)
        steps.append(sched.steps - s0)
        stats[:] = [(r.stats.committed, r.stats.cycles) for r in res]
        return [r.tokens for r in res]

    a_toks, wall, cap = timed(dev, eng_a, continuous)
    record(
        "continuous",
        a_toks,
        wall,
        cycles=steps[-1],
        tau=sum(c for c, _ in stats) / max(sum(n for _, n in stats), 1),
        oracle_divergences=sim_a.divergences,
        timed_captures=cap,
        vs_static=check_rows(target, prompts, b_toks, a_toks),
        vs_ar=check_rows(target, prompts, ar_toks, a_toks),
    )

    runs = {r["variant"]: r for r in result["runs"]}
    ar_tok_s, b_tok_s = runs["AR static batches"]["tok_s"], runs["static batches"]["tok_s"]
    for r in result["runs"]:
        r["speedup_vs_ar"] = r["tok_s"] / ar_tok_s
        r["speedup_vs_static"] = r["tok_s"] / b_tok_s
    save()

    print(f"\n{label}; tok/s of the whole stream (prefill included)")
    print(f"{'variant':<18} {'tok/s':>9} {'wall s':>7} {'vs AR':>6} {'vs static':>9} {'equal':>11}")
    for r in result["runs"]:
        eq = r.get("vs_static") or r.get("vs_ar")
        equal = f"{eq['rows_equal_ar']}/{eq['rows']}" if eq else "ref"
        if eq and eq["rows_equal_ar"] < eq["rows"]:
            equal += f" f{'ok' if eq['forcing'] else 'FAIL'}"
        print(
            f"{r['variant']:<18} {r['tok_s']:>9.1f} {r['wall_s']:>7.2f} "
            f"{r['speedup_vs_ar']:>5.2f}x {r['speedup_vs_static']:>8.2f}x {equal:>11}"
        )
    print("equal: continuous vs static batches per request; static batches vs AR")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return result


if __name__ == "__main__":
    main()
