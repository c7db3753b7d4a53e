"""Write a synthetic deployment (a real shape, seeded random weights) as a HF model directory.

    python3 bench/make_hf_dir.py --shape llama3-8b --tokenizer TOKDIR --out /tmp/llama3-8b

The weights are generated on the GPU when there is one (seconds for 8B), then written as bf16
safetensors shards with a config.json and the tokenizer of ``TOKDIR`` (padded to the shape's
vocabulary). ``--tiny`` writes a tiny fp32 model (the CPU test of this script).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specpilot.bench.hf_dir import write_hf_dir
from specpilot.synthetic import build_target, make_peaked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None, help="a saved HF tokenizer folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument(
        "--peaked",
        action="store_true",
        help="give the random target a trained model's clear top-1 margins (synthetic.make_peaked: "
        "same shapes and timings; no bf16 near-ties, so simulated acceptance holds its profile)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    model = build_target(args.shape, dev, dtype, seed=args.seed, max_positions=256)
    if args.peaked:
        make_peaked(model)
    t1 = time.perf_counter()
    write_hf_dir(model, args.out, args.tokenizer)
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 1e9
    print(
        f"{args.shape} ({args.dtype}, seed {args.seed}{', peaked' if args.peaked else ''}) -> "
        f"{args.out}: {size:.2f} GB; "
        f"weights {t1 - t0:.1f}s, written in {time.perf_counter() - t1:.1f}s"
    )


if __name__ == "__main__":
    main()
