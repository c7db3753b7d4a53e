"""Cost-model profile of a synthetic deployment on the GPU with simulated acceptance (issue 4).

    PYTHONPATH=src python3 bench/profile_gpu.py --out DIR [--tiny] [--shape llama3-8b]

Builds the target shape with seeded random bf16 weights on the device, measures the ceilings
(copy bandwidth, bf16 matmul, per-kernel cost inside a CUDA graph), runs the static (CUDA-graph)
engine for plain AR and for a DFlash-like block drafter under **simulated acceptance**
(``specpilot.drafters.simulated``: real draft and verify compute, proposals from the target's own
continuation with injected misses), times every component of the target forward in isolation
(CUDA graphs, events) at the verify widths, and assembles the cost model's prediction next to the
measured speedup of the same run. Writes ``DIR/profile_gpu.json`` (and ``profile_gpu.png`` when
matplotlib is installed) and prints a short table last. ``--tiny`` runs tiny fp32 shapes on the
CPU (the code path of CI). Target: well under 2 minutes on an H200.
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

from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import block_drafter_work, total
from specpilot.costmodel.assemble import LoopCosts, assemble
from specpilot.costmodel.hardware import measure_ceilings
from specpilot.costmodel.measure import measure_forwards, time_device_accept
from specpilot.costmodel.report import plain_table
from specpilot.costmodel.shapes import BlockDrafterSpec
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.static_engine import StaticEngine
from specpilot.synthetic import BLOCK_DRAFTER_SHAPES, build_block_drafter, build_target


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
        "--path", choices=["static", "eager"], default="static", help="forward timed per component"
    )
    ap.add_argument(
        "--no-graphs", action="store_true", help="time components without CUDA graph capture"
    )
    args = ap.parse_args(argv)
    t = args.tiny
    args.shape = args.shape or ("tiny-llama" if t else "llama3-8b")
    args.drafter_shape = args.drafter_shape or ("tiny-block" if t else "dflash-b16")
    args.sim_accept = args.sim_accept or ("tau=3,block=9" if t else "tau=6.5,block=16")
    args.prompt_len = args.prompt_len or (12 if t else 128)
    args.new_tokens = args.new_tokens or (40 if t else 256)
    return args


def _decode(engine: StaticEngine, prompt: list[int], n: int) -> tuple[Any, float]:
    """Warm-up run (graphs captured outside the timing), then a timed one: (result, decode tok/s)."""
    engine.generate([prompt], n)
    res = engine.generate([prompt], n)[0]
    return res, max(len(res.tokens) - 1, 1) / engine.times.wall


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(dev, dtype, quick=args.tiny)
    print(f"[profile_gpu] ceilings {time.perf_counter() - start:.0f}s", flush=True)

    target = build_target(args.shape, dev, dtype, seed=args.seed, max_positions=2048)
    cfg = target.cfg
    rng = random.Random(args.seed)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)]
    n = args.new_tokens

    ar_engine = StaticEngine(target)
    _, ar_tok_s = _decode(ar_engine, prompt, n)
    ar_step_s = ar_engine.times.wall / max(ar_engine.times.cycles, 1)

    block = build_block_drafter(target, args.drafter_shape)
    profile = AcceptanceProfile.parse(args.sim_accept)
    sim = SimulatedAcceptance(block, profile, seed=args.seed)
    spec_engine = StaticEngine(target, sim, profile=True)
    spec_res, spec_tok_s = _decode(spec_engine, prompt, n)
    times = spec_engine.times
    cycles = max(times.cycles, 1)
    print(f"[profile_gpu] runs {time.perf_counter() - start:.0f}s", flush=True)

    curve = AcceptanceCurve.from_stats(spec_res.stats, source="simulated")
    context = args.prompt_len + n // 2
    k = block.k
    fwd = measure_forwards(
        target, [1, k + 1], context, args.path, args.rounds, graphs=not args.no_graphs
    )
    acc_ar = time_device_accept(0, dev)
    print(f"[profile_gpu] components {time.perf_counter() - start:.0f}s", flush=True)

    shape = BLOCK_DRAFTER_SHAPES[args.drafter_shape]
    bspec = BlockDrafterSpec(shape.num_layers, shape.block, shape.num_context_layers)
    elem = target.dtype.itemsize
    draft_roof = total(block_drafter_work(cfg, bspec, context, elem)).roofline_s(ceilings)
    cuda = dev.type == "cuda"
    # Spec loop terms: the engine's CUDA events per cycle (on the CPU there are none: the whole
    # loop time beyond the isolated forward lands in ``overhead``).
    spec_loop = (
        LoopCosts(times.draft / cycles, times.accept / cycles, times.other / cycles)
        if cuda
        else LoopCosts(0.0, 0.0, max(times.wall / cycles - fwd[k + 1].forward_s, 0.0))
    )
    ar_loop = LoopCosts(0.0, acc_ar, 0.0)
    label = f"{cfg.arch} {args.shape} · {args.drafter_shape} · {SIM_LABEL}"
    pred = assemble(
        cfg,
        elem,
        ceilings,
        curve,
        context,
        fwd,
        ar_loop=ar_loop,
        spec_loop=spec_loop,
        draft_roofline_s=draft_roof,
        label=label,
        measured_speedup=spec_tok_s / ar_tok_s,
        notes=(
            f"every speculative figure here is {SIM_LABEL} ({args.sim_accept}); weights are random",
            "target components: isolated CUDA-graph replays at the mean context; draft, accept, "
            "other: the engine's CUDA events in the run; AR step predicted as forward + accept",
        ),
    )
    result: dict[str, Any] = {
        "label": label,
        "date": datetime.date.today().isoformat(),
        "machine": {
            "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
        },
        "args": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items()},
        "ceilings": ceilings.to_dict(),
        "run": {
            "ar_tok_s": ar_tok_s,
            "ar_step_s": ar_step_s,
            "spec_tok_s": spec_tok_s,
            "tau_measured": spec_res.stats.mean_accepted_len,
            "profile_tau": profile.tau,
            "cycles": times.cycles,
            "cycle_times": times.to_dict(),
            "oracle_divergences": sim.divergences,
        },
        "forward_times": {str(w): t.to_dict() for w, t in fwd.items()},
        "checks": {
            "ar_step_in_run_s": ar_step_s,
            "ar_step_predicted_s": pred.ar.measured_s,
            "verify_in_run_s_per_cycle": times.verify / cycles if cuda else None,
            "verify_isolated_s": fwd[k + 1].forward_s,
            "draft_roofline_s": draft_roof,
        },
        "prediction": pred.to_dict(),
        "total_s": time.perf_counter() - start,
    }
    (args.out / "profile_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        from specpilot.costmodel.report import draw_chart

        draw_chart(args.out / "profile_gpu.png", pred, f"{result['machine']['device']}")
    except ImportError:
        print("[profile_gpu] matplotlib not installed: no chart", flush=True)
    c = ceilings
    print(
        f"ceilings: copy {c.bandwidth_Bps / 1e12:.3f} TB/s, matmul {c.matmul_flops / 1e12:.1f} "
        f"TFLOP/s, {c.launch_s * 1e6:.2f} us/kernel in a graph; AR {ar_tok_s:.1f} tok/s, "
        f"spec {spec_tok_s:.1f} tok/s ({SIM_LABEL}); {result['total_s']:.0f}s"
    )
    print(plain_table(pred))
    return result


if __name__ == "__main__":
    main()
