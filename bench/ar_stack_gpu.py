"""The 8B AR step with the measured kernel mechanisms stacked, against the HBM roofline (issue 15,
item 5), through the composition root.

Every arm is an engine from ``build_engine`` (what ``generate``, ``bench``, ``compare`` and
``serve`` build) over its own copy of one seeded, peaked Llama-3-8B-shaped bf16 target (the
mechanisms edit the model they are applied to, so arms never share one): ``stock`` (no
mechanism), then ``split-kv``, ``split-kv + fused-gemv``, ``split-kv + w12`` and
``split-kv + w12 + fused-gemv``, each mechanism at its registry defaults (``fused-gemv`` launches
its bf16 GEMVs with programmatic dependent launch), and two more: ``fused-gemv`` without it and W12
with it (``--arms`` picks).

1. Lossless: 32 greedy tokens of every arm, token-forced against the stock forward (which no
   mechanism touches): mismatches must be 0; tokens equal to the stock arm's are reported.
2. Step time: each arm's CUDA-graph forward at width 1 (``Engine.time_forward``) at a
   ``--context``-token cache, and its AR decode rate (``generate``, prefill excluded), in
   ``--rounds`` interleaved rounds: medians with min-max spread, ratios to ``stock`` per round.
3. Roofline: the bf16 step's bytes (weights less the embedding table, plus K/V at the context)
   over the device copy bandwidth measured in the same run; the fraction each arm reaches of
   that bf16 roofline, and (W12 arms) of its own bytes.

JSON to ``--out/ar_stack_gpu.json``; the short table is printed last.

GPU:  ``PYTHONPATH=src python3 bench/ar_stack_gpu.py --out DIR``            (about 3-4 min)
CPU:  ``PYTHONPATH=src python3 bench/ar_stack_gpu.py --out DIR --tiny``     (code path only)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.gpu_suite import forcing_summary, open_row
from specpilot.bench.l2_prefetch import decode_sample
from specpilot.bench.records import git_rev
from specpilot.bench.script import guarded
from specpilot.costmodel.hardware import copy_bandwidth
from specpilot.engine import generate
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.runtime import LoadedModel
from specpilot.synthetic import build_target, kv_bytes_per_token, make_peaked, streamed_weight_bytes
from specpilot.timing import spread

ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "stock": {},
    "split-kv": {"split-kv": {}},
    "split-kv+fused": {"split-kv": {}, "fused-gemv": {}},
    "split-kv+w12": {"split-kv": {}, "w12": {}},
    "split-kv+w12+fused": {"split-kv": {}, "w12": {}, "fused-gemv": {}},
    "split-kv+fused-no-pdl": {"split-kv": {}, "fused-gemv": {"pdl": False}},
    "split-kv+w12-pdl+fused": {"split-kv": {}, "w12": {"pdl": True}, "fused-gemv": {}},
}
DEFAULT_ARMS = ("stock", "split-kv", "split-kv+fused", "split-kv+w12", "split-kv+w12+fused")
"""What runs without ``--arms`` (every arm holds its own 16 GB copy of the 8B weights)."""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU")
    ap.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}"
    )
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    return ap.parse_args()


def build_arm(name: str, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    shape, dtype = ("tiny-llama", torch.float32) if args.tiny else ("llama3-8b", torch.bfloat16)
    model = make_peaked(
        build_target(shape, dev, dtype, seed=0, max_positions=args.context + args.new_tokens + 64)
    )
    loaded = LoadedModel(spec=f"{shape} (random peaked weights)", model=model, tokenizer=None)
    dep = DeploymentSpec(target=shape, drafter="none", dtype="fp32" if args.tiny else "bf16",
                         device=dev.type)  # fmt: skip
    mechs = {} if args.tiny else ARMS[name]  # the kernels are CUDA-only
    build = build_engine(EngineConfig(dep, k=0, mechanisms=mechs), target=loaded)
    return {"model": model, "decode": build.engine(), "step": build.engine(), "notes": build.notes}


def run(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    names = [n for n in args.arms.split(",") if n]
    unknown = set(names) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    bw = max(copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (1 << 22)) for _ in range(3))
    arms = {n: build_arm(n, args, dev) for n in names}
    cfg = arms[names[0]]["model"].cfg
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.context,), generator=gen).tolist()
    out: dict[str, Any] = {"copy_Bps": bw, "context": args.context, "arms": {}}
    stock_tokens = None
    for n, a in arms.items():  # lossless first
        toks = generate(a["decode"], [prompt], 32)[0].tokens
        stock_tokens = toks if stock_tokens is None else stock_tokens
        out["arms"][n] = {"mechanisms": ARMS[n], "notes": a["notes"],
                          "forcing": forcing_summary(a["model"], prompt, toks),
                          "tokens_equal_to_first_arm": toks == stock_tokens}  # fmt: skip
        open_row(a["step"], prompt, 1)
    step: dict[str, list[float]] = {n: [] for n in arms}
    rate: dict[str, list[float]] = {n: [] for n in arms}
    for r in range(args.rounds):  # interleaved, the order reversed every other round
        for n in names if r % 2 == 0 else names[::-1]:
            step[n].append(arms[n]["step"].time_forward(1, 1 if args.tiny else 20))
            s = decode_sample(arms[n]["decode"], None, prompt, 8 if args.tiny else args.new_tokens)
            rate[n].append(s.tokens / s.seconds)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    bf16_bytes = streamed_weight_bytes(cfg, dtype) + kv_bytes_per_token(cfg, dtype) * args.context
    out["bf16_step_bytes"] = bf16_bytes
    out["roofline_step_s"] = bf16_bytes / bw
    base = names[0]
    for n in names:
        med = statistics.median(step[n])
        ratio = [b / x for b, x in zip(step[base], step[n], strict=True)]
        rratio = [x / b for b, x in zip(rate[base], rate[n], strict=True)]
        out["arms"][n] |= {
            "step_s": spread(step[n]),
            "decode_tok_s": spread(rate[n]),
            "step_speedup": spread(ratio),
            "decode_speedup": spread(rratio),
            "bf16_roofline_frac": out["roofline_step_s"] / med,
        }
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"AR stack  {res['device']}  copy {res.get('copy_Bps', 0) / 1e12:.2f} TB/s  context "
             f"{res.get('context')}  bf16 roofline {1e3 * res.get('roofline_step_s', 0):.3f} ms  "
             f"commit {res['commit']}  {res['date']}",
             f"{'arm':>20} {'step ms':>18} {'x stock':>20} {'decode tok/s':>14} {'x stock':>8} "
             f"{'roof%':>6}  forcing"]  # fmt: skip
    for n, a in res.get("arms", {}).items():
        if "step_s" not in a:
            continue
        s, r, f = a["step_s"], a["step_speedup"], a["forcing"]
        lines.append(
            f"{n:>20} {1e3 * s['median']:7.3f} ({1e3 * s['lo']:.3f}-{1e3 * s['hi']:.3f}) "
            f"x{r['median']:.3f} ({r['lo']:.3f}-{r['hi']:.3f}) {a['decode_tok_s']['median']:14.1f} "
            f"x{a['decode_speedup']['median']:.3f} {100 * a['bf16_roofline_frac']:5.1f}%  "
            f"{f['matches']} match {f['near_ties']} near-tie {f['mismatches']} mismatch"
            f"{'' if a['tokens_equal_to_first_arm'] else ' (tokens differ from stock)'}"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "commit": git_rev(), "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
    }  # fmt: skip
    res |= guarded(lambda: run(args, dev), 3000, echo=True)
    res["wall_s"] = time.perf_counter() - t0
    gc.collect()
    (args.out / "ar_stack_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print(table(res))


if __name__ == "__main__":
    main()
