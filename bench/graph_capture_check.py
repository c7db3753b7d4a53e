"""Why does timing the cost model's component pieces in CUDA graphs crash? Variants, one process each.

An illegal memory access poisons the CUDA context, so every variant runs in its own process:
``ForwardTimer``-style capture of every (width, component) piece of the engine's forward (the
variants below were recorded with the old static forward, before the one engine), then
interleaved timing rounds of replays. Variants change one thing each: the layers, the widths, and
whether the graphs share one memory pool (as the engine's ``GraphRunner`` does) or each get a
private one.

    PYTHONPATH=src python3 bench/graph_capture_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specpilot.costmodel.components import forward_pieces
from specpilot.costmodel.measure import capture_graph
from specpilot.models.forward import Forward
from specpilot.models.transformer import Transformer
from specpilot.synthetic import TARGET_SHAPES, init_random_on_device

VARIANTS = {  # name: (layers, widths, mode, extra environment)
    # H200 2026-11-29, first run (pieces of width 17 built AFTER width 1 was captured, then
    # width 1 replayed): 32L w1,17 FAIL after (1, embedding) with private or shared pools, with
    # or without an engine run first; 32L w1 alone, 32L w17 alone and 2L w1,17 OK.
    # Second run (every piece built before any capture, the variants below): all OK.
    "32L w1,17 keep-all": (32, "1,17", "keep", {}),
    "32L w1,17 eager-warm-first": (32, "1,17", "warm-first", {}),
    "32L w1,17 cublas-ws-env": (32, "1,17", "keep", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "32L w1,17 ForwardTimer": (32, "1,17", "timer", {}),
}


def one(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    cfg = dataclasses.replace(TARGET_SHAPES[args.shape], num_layers=args.layers)
    model = Transformer(cfg, dtype=torch.bfloat16, device=dev, max_positions=2048)
    init_random_on_device(model, 0)
    widths = [int(x) for x in args.widths.split(",")]
    if args.mode == "timer":
        from specpilot.costmodel.measure import measure_forwards

        res = measure_forwards(model, widths, args.context, rounds=5, graphs=True)
        for w, ft in res.items():
            print(f"OK width {w}: forward {ft.forward_s * 1e3:.3f} ms", flush=True)
        print("ALL OK", flush=True)
        return
    runs = {}
    with torch.inference_mode():
        fns = {}
        fwd = Forward(model)
        for w in widths:
            pieces = forward_pieces(fwd, w, args.context, graphs=True)
            for name, fn in {**pieces.components, "__forward__": pieces.forward}.items():
                fns[(w, name)] = fn
                if args.mode == "warm-first":
                    fn()
        for key, fn in fns.items():
            runs[key] = capture_graph(fn, dev)
            runs[key]()
        torch.cuda.synchronize()
        print("captured", flush=True)
        for r in range(5):
            for key, run in runs.items():
                for _ in range(10):
                    run()
                torch.cuda.synchronize()
                if r == 0:
                    print(f"OK {key}", flush=True)
    print("ALL OK", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--widths", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="keep", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layers is not None:
        one(args)
        return
    rows = []
    for name, (layers, widths, mode, extra) in VARIANTS.items():
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--shape", args.shape, "--context", str(args.context),
               "--layers", str(layers), "--widths", widths, "--mode", mode]  # fmt: skip
        env = {**os.environ, **extra}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        ok = p.returncode == 0
        last_ok = [ln for ln in p.stdout.splitlines() if ln.startswith("OK")][-1:]
        err = "" if ok else (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        rows.append({"variant": name, "ok": ok, "last_ok": last_ok, "error": err,
                     "stdout": p.stdout[-2000:], "stderr": p.stderr[-3000:],
                     "s": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(f"{name:20} {'OK' if ok else 'FAIL after ' + str(last_ok) + ' ' + err}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graph_capture_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
