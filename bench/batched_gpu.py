"""Issue 8 part B on the GPU: batched AR vs stock batched speculative vs the batched mechanisms.

    PYTHONPATH=src python3 bench/batched_gpu.py --out DIR            # H200, < 6 minutes
    PYTHONPATH=src python3 bench/batched_gpu.py --out DIR --tiny     # CPU smoke run (fp32)

Llama-3-8B shape with seeded random bf16 weights (``specpilot.synthetic``), a DFlash-like block
drafter (block 16, real compute) under **simulated acceptance** with a different profile per row
(row b gets τ = 2, 4, 6.5 in turn: heterogeneous requests), at concurrency 16, 20, 24, all in the
static (CUDA-graph) engine:

* ``ar`` — batched plain AR (the baseline and the reference tokens);
* ``spec-stock`` — stock batched speculative: every row verifies the whole block (k + 1 = 16);
* ``ragged-fixed`` — the same widths through the packed ragged verify (``ragged-verify``);
* ``tiered-bN`` — packed verify + ``tiered-budget`` with N verify tokens per row per cycle;
* ``rowlen-tX`` — packed verify + ``row-block-len`` with survival threshold X.

Each variant runs once to warm up (graph capture; the trajectory is deterministic, so the timed run
replays the same graphs) and once timed; candidates and baseline share the process and the
weights. Every row's tokens are compared with batched AR; rows that differ are token-forced
(``specpilot.forcing``: near-ties are counted, a mismatch fails). Reported per variant: decode
tok/s over all rows (prefill excluded), speedup over AR, τ (committed tokens per row-cycle, bonus
included), verify ms per cycle (CUDA events), packed rows per cycle; and the packed verify's cost against
its rows (B, 2B, 4B, 8B, 16B rows; graph replays, median) at each concurrency. JSON goes to
``DIR/batched_gpu.json`` after every concurrency; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specpilot.bench.static_runs import (
    add_simulation_options,
    check_rows,
    run_header,
    run_twice,
    simulation_label,
    synthetic_deployment,
)
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.static_engine import StaticEngine
from specpilot.engine.widths import FixedWidths, RowBlockLength, TieredBudget, WidthPolicy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (smoke test)")
    ap.add_argument("--concurrency", default=None, help="comma list (default 16,20,24; tiny 2,3)")
    ap.add_argument("--taus", default=None, help="per-row τ cycle (default 2,4,6.5; tiny 1.5,3,5)")
    ap.add_argument("--budgets", default="4,6,8", help="tiered-budget tokens per row")
    ap.add_argument("--thresholds", default="0.25", help="row-block-len survival thresholds")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no concurrency after")
    ap.add_argument("--iters", type=int, default=None, help="replays per verify-cost point")
    ap.add_argument("--seed", type=int, default=0)
    add_simulation_options(ap)
    args = ap.parse_args(argv)
    t = args.tiny
    args.concurrency = args.concurrency or ("2,3" if t else "16,20,24")
    args.taus = args.taus or ("1.5,3,5" if t else "2,4,6.5")
    args.prompt_len = args.prompt_len or (10 if t else 128)
    args.new_tokens = args.new_tokens or (24 if t else 128)
    args.iters = args.iters or (2 if t else 20)
    return args


def variants(args: argparse.Namespace) -> dict[str, Callable[[], WidthPolicy | None]]:
    out: dict[str, Callable[[], WidthPolicy | None]] = {
        "spec-stock": lambda: None,
        "ragged-fixed": FixedWidths,
    }
    for b in (float(x) for x in args.budgets.split(",") if x):
        out[f"tiered-b{b:g}"] = lambda b=b: TieredBudget(b)
    for th in (float(x) for x in args.thresholds.split(",") if x):
        out[f"rowlen-t{th:g}"] = lambda th=th: RowBlockLength(th)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dep = synthetic_deployment(args.tiny, args.seed, args.peaked, max_positions=1024)
    target, block, dev = dep.target, dep.block, dep.target.device
    taus = [float(x) for x in args.taus.split(",")]
    bsize = block.k + 1
    profiles = [AcceptanceProfile.constant(tau, block.k) for tau in taus]
    label = (
        f"{dep.label()} · {SIM_LABEL}, per-row τ cycling "
        f"{{{', '.join(f'{x:g}' for x in taus)}}} at block {bsize}" + simulation_label(args)
    )
    result: dict[str, Any] = {
        **run_header(label, args, dev),
        "runs": [],
    }
    rng = random.Random(args.seed)
    vocab = target.cfg.vocab_size
    for conc in (int(x) for x in args.concurrency.split(",")):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"[batched_gpu] budget spent: concurrency {conc} skipped", flush=True)
            result.setdefault("skipped", []).append(conc)
            continue
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(conc)]
        ar = StaticEngine(target)
        ar_res, ar_tok_s = run_twice(ar, prompts, args.new_tokens, args.steady)
        ref = [r.tokens for r in ar_res]
        result["runs"].append(
            {
                "concurrency": conc,
                "variant": "ar",
                "tok_s": ar_tok_s,
                "speedup": 1.0,
                "tau": 1.0,
                "verify_ms": 1e3 * ar.times.wall / max(ar.times.cycles, 1),
                "rows_per_cycle": conc,
                "rows_equal_ar": conc,
                "near_ties": 0,
                "mismatches": 0,
                "forcing": True,
            }
        )
        print(f"[batched_gpu] B={conc} ar {ar_tok_s:.1f} tok/s", flush=True)
        for name, make in variants(args).items():
            sim = SimulatedAcceptance(block, profiles[0], seed=args.seed, row_profiles=profiles)
            policy = make()
            eng = StaticEngine(target, sim, profile=True, width_policy=policy)
            res, tok_s = run_twice(eng, prompts, args.new_tokens, args.steady)
            cycles = max(eng.times.cycles, 1)
            row_cycles = sum(r.stats.cycles for r in res)
            committed = sum(r.stats.committed for r in res)
            per_tau = {
                f"{tau:g}": sum(r.stats.mean_accepted_len for r in res[i :: len(taus)])
                / max(len(res[i :: len(taus)]), 1)
                for i, tau in enumerate(taus)
            }
            row = {
                "concurrency": conc,
                "variant": name,
                "tok_s": tok_s,
                "speedup": tok_s / ar_tok_s,
                "tau": committed / max(row_cycles, 1),
                "tau_by_profile": per_tau,
                "verify_ms": 1e3 * eng.times.verify / cycles,
                "draft_ms": 1e3 * eng.times.draft / cycles,
                "cycle_ms": 1e3 * eng.times.wall / cycles,
                "rows_per_cycle": (eng.rows_verified / cycles) if policy else conc * bsize,
                "cycles": cycles,
                "oracle_divergences": sim.divergences,
                "graph_captures": eng.runner.captures,
                **check_rows(target, prompts, ref, [r.tokens for r in res]),
            }
            result["runs"].append(row)
            if name == "ragged-fixed":  # verify cost vs packed rows at this concurrency
                curve = {}
                for m in sorted({conc * f for f in (1, 2, 4, 8)} | {conc * bsize}):
                    curve[str(m)] = 1e3 * eng.time_packed_verify(m, iters=args.iters)
                result.setdefault("packed_verify_ms_by_rows", {})[str(conc)] = curve
                print(f"[batched_gpu] B={conc} packed verify ms by rows {curve}", flush=True)
            print(
                f"[batched_gpu] B={conc} {name} {tok_s:.1f} tok/s ({row['speedup']:.2f}x), "
                f"τ {row['tau']:.2f}, verify {row['verify_ms']:.2f} ms, "
                f"{row['rows_equal_ar']}/{conc} rows = AR, {time.perf_counter() - t_start:.0f}s",
                flush=True,
            )
            del eng, sim
        result["total_s"] = time.perf_counter() - t_start
        (args.out / "batched_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{label}; decode tok/s over all rows, prefill excluded")
    head = f"{'B':>3} {'variant':<14} {'tok/s':>8} {'vs AR':>6} {'vs stock':>8} {'τ':>5}"
    print(head + f" {'verify ms':>9} {'rows/cyc':>8} {'=AR':>6} {'near-tie':>8} {'mism':>4}")
    stock = {r["concurrency"]: r["tok_s"] for r in result["runs"] if r["variant"] == "spec-stock"}
    for r in result["runs"]:
        vs_stock = r["tok_s"] / stock[r["concurrency"]] if r["concurrency"] in stock else 0.0
        print(
            f"{r['concurrency']:>3} {r['variant']:<14} {r['tok_s']:>8.1f} {r['speedup']:>5.2f}x "
            f"{vs_stock:>7.2f}x {r['tau']:>5.2f} {r['verify_ms']:>9.2f} "
            f"{r['rows_per_cycle']:>8.1f} {r['rows_equal_ar']:>3}/{r['rows']:<2} "
            f"{r['near_ties']:>8} {r['mismatches']:>4}"
            if "rows" in r
            else f"{r['concurrency']:>3} {r['variant']:<14} {r['tok_s']:>8.1f} {'1.00x':>6} "
            f"{'':>8} {'1.00':>5} {r['verify_ms']:>9.2f} {r['rows_per_cycle']:>8.1f}"
        )
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return result


if __name__ == "__main__":
    main()
