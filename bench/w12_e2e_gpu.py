"""W12 end to end on the CUDA-graph engine: AR step, verify forward and decode speed, bf16 vs W12.

One process, one seeded Llama-3-8B-shaped bf16 target (peaked: clear top-1 margins, so bf16
near-ties do not blur the token comparison), the static engine with CUDA graphs:

1. stock: target forward time at width 1 (the AR step) and 16 (a verify of 15 drafts), AR decode
   tok/s, and speculative decode tok/s with a DFlash-b16-shaped block drafter of **simulated
   acceptance** (profile ``--profile``);
2. the same after ``mechanisms.w12.install`` (every decoder matrix read as W12 inside the same
   graphs; the LM head and embeddings stay bf16);
3. the prediction for each forward width: the stock forward minus, per layer, what the kernels
   save, ``L · Σ_shapes (t_cuBLAS(M) - t_W12(M))`` from ``bench/w12_gpu.py``'s JSON of the same
   call (``--kernel-json``; omitted: no prediction).

Tokens of every W12 run are compared with the stock run's (rows that differ are token-forced
against the stock target: near-ties are counted, a mismatch fails). JSON to ``DIR/w12_e2e.json``.

GPU:  ``PYTHONPATH=src python3 bench/w12_e2e_gpu.py --out DIR --kernel-json DIR/w12_gpu.json``
CPU:  ``PYTHONPATH=src python3 bench/w12_e2e_gpu.py --out DIR --tiny``   (interpreter smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench.static_runs import check_rows, run_header, run_twice
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.static_engine import StaticEngine
from specpilot.mechanisms.w12 import install
from specpilot.synthetic import build_block_drafter, build_target, make_peaked

WIDTHS = (1, 16)
"""Forward widths timed: the AR step and a verify of 15 drafts (fewer on the tiny drafter)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny bf16 shapes on the CPU (smoke test)")
    ap.add_argument("--kernel-json", type=Path, default=None, help="bench/w12_gpu.py output")
    ap.add_argument("--profile", default=None, help="simulated acceptance (default tau=5,block=16)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="graph replays per forward timing")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = args.tiny
    args.profile = args.profile or ("tau=3,block=9" if t else "tau=5,block=16")
    args.new_tokens = args.new_tokens or (12 if t else 192)
    args.iters = args.iters or (1 if t else 20)
    return args


def predicted_saving_s(kernel_json: Path, m: int, layers: int) -> float | None:
    """Seconds a forward of ``m`` rows saves over stock, from the kernel benchmark's rows."""
    shapes = json.loads(kernel_json.read_text()).get("shapes", {})
    total = 0.0
    for s in shapes.values():
        row = s.get("rows", {}).get(str(m), {})
        if "us" not in row.get("cublas", {}) or "us" not in row.get("w12", {}):
            return None
        total += row["cublas"]["us"] - row["w12"]["us"]
    return layers * total * 1e-6 if shapes else None


def measure(target: Any, block: Any, profile: AcceptanceProfile, prompt: list[list[int]],
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Forward times, AR and speculative decode of one configuration of ``target``."""
    out: dict[str, Any] = {}
    eng = StaticEngine(target, SimulatedAcceptance(block, profile, seed=args.seed))
    eng.prefill(prompt, 64)
    widths = [w for w in WIDTHS if w - 1 <= eng.k_max]
    out["forward_ms"] = {str(w): 1e3 * eng.time_forward(w, args.iters) for w in widths}
    del eng
    ar_res, out["ar_tok_s"] = run_twice(StaticEngine(target), prompt, args.new_tokens)
    out["ar_tokens"] = [r.tokens for r in ar_res]
    sim = SimulatedAcceptance(block, profile, seed=args.seed)
    spec_res, out["spec_tok_s"] = run_twice(StaticEngine(target, sim), prompt, args.new_tokens)
    out["spec_tokens"] = [r.tokens for r in spec_res]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if dev.type != "cuda" and not args.tiny:
        sys.exit("No CUDA GPU: run with --tiny (CPU, Triton interpreter).")
    args.out.mkdir(parents=True, exist_ok=True)
    shape, dshape = ("tiny-llama", "tiny-block") if args.tiny else ("llama3-8b", "dflash-b16")
    target = build_target(shape, dev, torch.bfloat16, seed=args.seed, max_positions=1024)
    make_peaked(target)
    block = build_block_drafter(target, dshape)
    profile = AcceptanceProfile.parse(args.profile)
    prompt = [torch.randint(0, target.cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(args.seed)).tolist()]  # fmt: skip
    label = f"{shape} bf16 peaked · {dshape} · {SIM_LABEL} ({args.profile}) · CUDA graphs"
    result: dict[str, Any] = run_header(label, args, dev)

    stock = measure(target, block, profile, prompt, args)
    stats = install(target, layers="all", max_m=64)
    w12 = measure(target, block, profile, prompt, args)
    result["w12_bits_per_weight"] = stats["bits_per_weight"]
    result["lossless"] = {
        "ar": check_rows(target, prompt, stock["ar_tokens"], w12["ar_tokens"]),
        "spec": check_rows(target, prompt, stock["ar_tokens"], w12["spec_tokens"]),
    }
    layers = target.cfg.num_layers
    result["forward"] = {}
    for w in (int(x) for x in stock["forward_ms"]):
        s_ms, w_ms = stock["forward_ms"][str(w)], w12["forward_ms"][str(w)]
        saving = predicted_saving_s(args.kernel_json, w, layers) if args.kernel_json else None
        result["forward"][str(w)] = {
            "stock_ms": s_ms,
            "w12_ms": w_ms,
            "speedup": s_ms / w_ms,
            "predicted_w12_ms": None if saving is None else s_ms - 1e3 * saving,
        }
    result["decode"] = {
        "ar": {"stock_tok_s": stock["ar_tok_s"], "w12_tok_s": w12["ar_tok_s"]},
        "spec": {"stock_tok_s": stock["spec_tok_s"], "w12_tok_s": w12["spec_tok_s"]},
    }
    result["total_s"] = time.perf_counter() - t0
    (args.out / "w12_e2e.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"== W12 end to end: {label} ({stats['bits_per_weight']:.3f} bits/weight) ==")
    for w, r in result["forward"].items():
        pred = r["predicted_w12_ms"]
        pred_s = "-" if pred is None else f"{pred:.3f} ms (x{r['stock_ms'] / pred:.3f})"
        print(f"forward width {w:>2}: stock {r['stock_ms']:.3f} ms  W12 {r['w12_ms']:.3f} ms  "
              f"x{r['speedup']:.3f}  predicted {pred_s}")  # fmt: skip
    for kind, r in result["decode"].items():
        print(f"{kind:4s} decode: stock {r['stock_tok_s']:.1f} tok/s  W12 {r['w12_tok_s']:.1f} "
              f"tok/s  x{r['w12_tok_s'] / r['stock_tok_s']:.3f}")  # fmt: skip
    for kind, r in result["lossless"].items():
        print(f"{kind:4s} tokens: {r['rows_equal_ar']}/{r['rows']} rows equal stock AR, "
              f"near-ties {r['near_ties']}, mismatches {r['mismatches']}, forcing ok={r['forcing']}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
