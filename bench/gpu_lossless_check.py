"""Fast path vs stock path on the GPU in bf16, at real shapes with seeded random weights.

For each shape: greedy AR tokens of the stock ``SpecEngine`` (eager), of the static engine
(CUDA graphs, residual fused into the GEMM, as shipped) and of the static engine with the
residual add unfused (the stock rounding order); token-forcing verdicts of each with the first
mismatch's logit gap against the near-tie tolerance; decode tok/s. Then HF eager ``generate`` on
the first shape, in a process that has run no profiler.

``PYTHONPATH=src python3 bench/gpu_lossless_check.py --out DIR [--target-shape llama3-8b ...]``
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.gpu_hf import hf_generate, hf_model
from specpilot.bench.gpu_suite import forcing_summary
from specpilot.engine.loop import SpecEngine
from specpilot.engine.static_engine import StaticEngine
from specpilot.synthetic import build_target


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target-shape", action="append", dest="shapes")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    shapes = args.shapes or ["llama3-8b", "qwen3-8b"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    results: dict[str, Any] = {}
    for i, name in enumerate(shapes):
        target = build_target(name, dev, dtype, max_positions=2048)
        rng = random.Random(0)
        prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(128)]
        n = args.new_tokens
        row: dict[str, Any] = {}
        if i == 0:
            hf = hf_model(target)
            hf_generate(hf, prompt, 2, dev)
            _, t1 = hf_generate(hf, prompt, 1, dev)
            _, tn = hf_generate(hf, prompt, 32, dev)
            row["hf_eager_tok_s"] = 31 / (tn - t1)
            del hf
        _sync(dev)
        t0 = time.perf_counter()
        stock = SpecEngine(target).generate([prompt], n)[0].tokens
        _sync(dev)
        row["stock"] = {
            "tok_s_incl_prefill": n / (time.perf_counter() - t0),
            "forcing": forcing_summary(target, prompt, stock),
        }
        for label, fuse in (("static_fused", True), ("static_unfused", False)):
            eng = StaticEngine(target, fuse_residual=fuse)
            eng.generate([prompt], n)
            toks = eng.generate([prompt], n)[0].tokens
            agree = next((j for j, (a, b) in enumerate(zip(toks, stock, strict=True)) if a != b), n)
            row[label] = {
                "tok_s": (n - 1) / eng.times.wall,
                "agree_prefix_with_stock": agree,
                "forcing": forcing_summary(target, prompt, toks),
            }
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del target
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lossless_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
