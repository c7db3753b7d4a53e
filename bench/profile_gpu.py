"""Cost-model profile of a synthetic deployment on the GPU with simulated acceptance.

    PYTHONPATH=src python3 bench/profile_gpu.py --out DIR [--tiny] [--shape llama3-8b] [--no-graphs]

Builds the target shape with seeded random bf16 weights on the device, measures the ceilings
(copy bandwidth, bf16 matmul, per-kernel cost inside a CUDA graph), and profiles the one engine
(``specpilot.costmodel.profile_run.profile_engines``): plain AR against a DFlash-like block
drafter under **simulated acceptance** (``specpilot.drafters.simulated``: real draft and verify
compute, proposals from the target's own continuation with injected misses), both run through
``generate`` from CUDA graphs (``--no-graphs``: eagerly), with the engine's phase timers on and
every component of the target forward timed in isolation as the engine runs it. Writes
``DIR/profile_gpu.json`` (and ``profile_gpu.png`` when matplotlib is installed) and prints a
short table last. ``--tiny`` runs tiny fp32 shapes on the CPU (the code path of CI). Target:
well under 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.costmodel.hardware import measure_ceilings
from specpilot.costmodel.profile_run import profile_engines
from specpilot.costmodel.report import plain_table
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine import Engine
from specpilot.synthetic import build_block_drafter, build_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for profile_gpu.json")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shape on the CPU (CI path)")
    ap.add_argument("--shape", default=None, help="target shape (default: llama3-8b; tiny-llama)")
    ap.add_argument("--drafter-shape", default=None, help="dflash-b16 (tiny: tiny-block)")
    ap.add_argument(
        "--sim-accept", default=None, help="e.g. tau=6.5,block=16 (tiny: tau=3,block=9)"
    )
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per component")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-graphs", action="store_true", help="run the engine (and time its pieces) eagerly"
    )
    args = ap.parse_args(argv)
    t = args.tiny
    args.shape = args.shape or ("tiny-llama" if t else "llama3-8b")
    args.drafter_shape = args.drafter_shape or ("tiny-block" if t else "dflash-b16")
    args.sim_accept = args.sim_accept or ("tau=3,block=9" if t else "tau=6.5,block=16")
    args.prompt_len = args.prompt_len or (12 if t else 128)
    args.new_tokens = args.new_tokens or (40 if t else 256)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(dev, dtype, quick=args.tiny)
    print(f"[profile_gpu] ceilings {time.perf_counter() - start:.0f}s", flush=True)

    target = build_target(args.shape, dev, dtype, seed=args.seed, max_positions=2048)
    cfg = target.cfg
    rng = random.Random(args.seed)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)]
    graphs = cuda and not args.no_graphs
    profile = AcceptanceProfile.parse(args.sim_accept)
    sim = SimulatedAcceptance(build_block_drafter(target, args.drafter_shape), profile, args.seed)
    ar_engine, spec_engine = Engine(target, graphs=graphs), Engine(target, sim, graphs=graphs)
    result = profile_engines(
        ar_engine, spec_engine, [prompt], args.new_tokens, (), ceilings,
        rounds=args.rounds, simulated=True,
    )  # fmt: skip
    pred = result.prediction
    print(f"[profile_gpu] run and components {time.perf_counter() - start:.0f}s", flush=True)
    label = f"{cfg.arch} {args.shape} · {args.drafter_shape} · {SIM_LABEL}"
    run = result.extra["run"]
    out: dict[str, Any] = {
        "label": label,
        "date": datetime.date.today().isoformat(),
        "machine": {
            "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "profile_tau": profile.tau,
        "oracle_divergences": sim.divergences,
        **result.extra,
        "prediction": pred.to_dict(),
        "total_s": time.perf_counter() - start,
    }
    (args.out / "profile_gpu.json").write_text(json.dumps(out, indent=1) + "\n")
    try:
        from specpilot.costmodel.report import draw_chart

        draw_chart(args.out / "profile_gpu.png", pred, f"{label} · {out['machine']['device']}")
    except ImportError:
        print("[profile_gpu] matplotlib not installed: no chart", flush=True)
    c = ceilings
    print(
        f"ceilings: copy {c.bandwidth_Bps / 1e12:.3f} TB/s, matmul {c.matmul_flops / 1e12:.1f} "
        f"TFLOP/s, {c.launch_s * 1e6:.2f} us/kernel{' in a graph' if cuda else ''}; AR "
        f"{run['ar']['tok_s']:.1f} tok/s, spec {run['spec']['tok_s']:.1f} tok/s ({SIM_LABEL}); "
        f"{out['total_s']:.0f}s"
    )
    print(plain_table(pred))
    return out


if __name__ == "__main__":
    main()
