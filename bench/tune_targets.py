"""Issue 5 targets: the loop against an exhaustive grid, and a warm start against a cold one.

    PYTHONPATH=src python3 bench/tune_targets.py --setting cpu --out DIR    # SmolLM2, real acceptance
    PYTHONPATH=src python3 bench/tune_targets.py --setting gpu --out DIR    # H200, 8B shape, <= 5 min
    PYTHONPATH=src python3 bench/tune_targets.py --setting both --tiny --out DIR   # CI path, CPU

Per setting, on a search space small enough to grid exhaustively (every knob categorical):
1. **Grid**: every distinct config, measured once in a seeded shuffled order, every one checked
   lossless (CPU fp32: tokens equal to AR's; GPU bf16: token forcing under the stock target).
2. **Loop**: ``TuneLoop`` on the same directions within ``--loop-fraction`` of the grid's wall
   time; its best looked up in the grid: loop best / grid best (target >= 0.95) and loop / grid
   cost seconds (target <= 0.20; CPU: process clock of one thread, GPU: wall seconds).
3. **Warm start**: a second deployment (CPU: mt-bench instead of copy-heavy; GPU: a lower
   simulated acceptance profile) tuned cold and warm (memory holding the first's result): cost
   seconds to the first trial within ``--reach`` of the better best. Target: warm <= cold / 2.

Knob proposals come from Optuna's TPE when installed, else from the local-search proposer
(``specpilot.tune.local_search``; the GPU machine has no Optuna): the JSON says which.
GPU figures use **simulated acceptance** (real draft and verify compute, proposals from the
target's own continuation with injected misses; weights are random) and are labelled so.
Writes ``DIR/tune_targets.json``; prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.script import write_json
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.mechanisms import Knob
from specpilot.memory import Fingerprint
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.grid_study import Measure, result, set_knobs, study
from specpilot.tune.space import Direction


# ----------------------------------------------------------------------------- CPU setting
def cpu_setting(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2 + n-gram, fp32, one torch thread, real prompts (``--tiny``: a random tiny model)."""
    from specpilot.bench.prompts import load_prompt_set
    from specpilot.engine import generate
    from specpilot.engine.build import build_engine
    from specpilot.runtime import LoadedModel, load_model
    from specpilot.synthetic import build_target

    torch.set_num_threads(1)
    if args.tiny:
        model = build_target("tiny-llama", torch.device("cpu"), torch.float32, seed=0)
        target = LoadedModel(spec="tiny-llama", model=model, tokenizer=None)
        rng = random.Random(0)
        motif = [rng.randrange(model.cfg.vocab_size) for _ in range(6)]
        sets = {"A": [motif * 4, motif[::-1] * 4], "B": [motif[:3] * 6, motif * 3]}
        eos: list[int] = []
        new_tokens, ks, max_ns = 16, (2, 4, 8), (2, 3)
    else:
        target = load_model("smollm2-135m", torch.float32, "cpu", 4096)
        tok = target.tokenizer
        assert tok is not None
        sets = {
            name: [tok.apply_chat_template(p.messages) for p in load_prompt_set(s, args.prompts)]
            for name, s in (("A", "copy-heavy"), ("B", "mt-bench"))
        }
        eos = list(tok.eos_token_ids)
        new_tokens, ks, max_ns = args.new_tokens or 48, (2, 4, 6, 8, 12, 16), (2, 3, 4, 5)
    dep = DeploymentSpec(target=target.spec, drafter="ngram", device="cpu", dtype="fp32")
    base = EngineConfig(deployment=dep, k=8, drafter_knobs={"max_n": 3, "min_n": 1})
    directions = [
        Direction("draft-length", ("draft", "verify"), (Knob("k", 8, choices=ks),), set_knobs("k")),
        Direction(
            "ngram-sizes",
            ("draft",),
            (Knob("max_n", 3, choices=max_ns), Knob("min_n", 1, choices=(1, 2, 3))),
            set_knobs("ngram"),
        ),
    ]

    def run(engine: Any, prompts: list[list[int]]) -> tuple[list[list[int]], float, float]:
        """Outputs, process-clock seconds and mean accepted length (bonus included)."""
        generate(engine, [prompts[0][-8:]], 4, eos)  # warm-up, outside the clock
        outs, secs, taus = [], 0.0, []
        for p in prompts:
            t0 = time.process_time()
            res = generate(engine, [p], new_tokens, eos)[0]
            secs += time.process_time() - t0
            outs.append(res.tokens)
            taus.append(res.stats.mean_accepted_len)
        return outs, secs, sum(taus) / len(taus)

    def make(prompts: list[list[int]]) -> tuple[Measure, float]:
        ar_cfg = EngineConfig(deployment=dataclasses.replace(dep, drafter="none"), k=0)
        ar_out, ar_s, _ = run(build_engine(ar_cfg, target=target).engine(), prompts)
        ar_tok_s = sum(map(len, ar_out)) / ar_s

        def measure(cfg: EngineConfig) -> TrialResult:
            t0 = time.process_time()
            outs, secs, tau = run(build_engine(cfg, target=target).engine(), prompts)
            ok = outs == ar_out
            forcing = {"equal_to_ar": ok}
            return result(
                cfg,
                sum(map(len, outs)) / secs,
                ar_tok_s,
                tau,
                ok,
                forcing,
                time.process_time() - t0,
            )

        return measure, ar_tok_s

    fp = Fingerprint(
        target.spec,
        "ngram",
        platform.processor() or "cpu",
        "",
        "",
        torch.__version__,
        "fp32",
        "single",
    )
    return study(args, "cpu", base, directions, make, sets, fp, clock="process")


# ----------------------------------------------------------------------------- GPU setting
def gpu_setting(args: argparse.Namespace) -> dict[str, Any]:
    """8B shape, bf16, the engine (CUDA graphs) + block drafter under simulated acceptance
    (``--tiny``: the tiny shapes in fp32 on the CPU, eagerly)."""
    from specpilot.drafters.block_drafter import BlockDrafter
    from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
    from specpilot.engine import CycleTimes, Engine, generate
    from specpilot.forcing import force_tokens
    from specpilot.synthetic import BLOCK_DRAFTER_SHAPES, build_target, init_random_on_device

    t = args.tiny
    dev = torch.device("cpu" if t else "cuda")
    dtype = torch.float32 if t else torch.bfloat16
    shape, dshape = ("tiny-llama", "tiny-block") if t else ("llama3-8b", "dflash-b16")
    target = build_target(shape, dev, dtype, seed=0, max_positions=1024)
    ds = BLOCK_DRAFTER_SHAPES[dshape]
    ks = (2, 4, 8) if t else (3, 5, 7, 9, 11, 15)
    buckets, syncs = ((32, 64), (4, 16)) if t else ((64, 256), (4, 32))
    new_tokens, prompt_len = (24, 12) if t else (args.new_tokens or 128, 64)
    rng = random.Random(0)
    prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(prompt_len)]
    # Per-position acceptance falls with depth, so a longer block is not free: k has an optimum.
    profiles = {
        "A": [max(0.97 - 0.045 * i, 0.05) for i in range(max(ks))],
        "B": [max(0.85 - 0.07 * i, 0.05) for i in range(max(ks))],
    }
    blocks: dict[int, BlockDrafter] = {}

    def drafter(k: int) -> BlockDrafter:
        if k not in blocks:
            blocks[k] = BlockDrafter(target, ds.num_layers, k + 1, ds.num_context_layers)
            init_random_on_device(blocks[k].weights, 2)
        return blocks[k]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    ar = Engine(target)
    generate(ar, [prompt], new_tokens)
    ar.times = CycleTimes()
    ar_res = generate(ar, [prompt], new_tokens)[0]
    ar_tok_s = max(len(ar_res.tokens) - 1, 1) / ar.times.wall

    def make(rates: list[float]) -> tuple[Measure, float]:
        def measure(cfg: EngineConfig) -> TrialResult:
            sync()
            t0 = time.perf_counter()
            kn = cfg.drafter_knobs
            sim = SimulatedAcceptance(drafter(cfg.k), AcceptanceProfile(tuple(rates[: cfg.k])))
            eng = Engine(
                target, sim, attn_bucket=int(kn["attn_bucket"]), sync_every=int(kn["sync_every"])
            )
            generate(eng, [prompt], new_tokens)  # warm-up: graph capture stays out of the timing
            walls = []
            for _ in range(2):
                eng.times = CycleTimes()
                res = generate(eng, [prompt], new_tokens)[0]
                walls.append(eng.times.wall)
            report = force_tokens(target, [("p", prompt, res.tokens)])
            sync()
            tok_s = max(len(res.tokens) - 1, 1) / min(walls)
            forcing = {"mismatches": report.mismatches, "near_ties": report.near_ties}
            return result(
                cfg,
                tok_s,
                ar_tok_s,
                res.stats.mean_accepted_len,
                report.ok,
                forcing,
                time.perf_counter() - t0,
            )

        return measure, ar_tok_s

    dep = DeploymentSpec(
        target=f"synthetic:{shape}",
        drafter=f"block ({SIM_LABEL})",
        device=dev.type,
        dtype="fp32" if t else "bf16",
    )
    base = EngineConfig(
        deployment=dep,
        k=max(ks),
        drafter_knobs={"attn_bucket": buckets[-1], "sync_every": syncs[-1]},
    )
    directions = [
        Direction(
            "block-length", ("draft", "verify"), (Knob("k", max(ks), choices=ks),), set_knobs("k")
        ),
        Direction(
            "graph-buckets",
            ("overhead",),
            (
                Knob("attn_bucket", buckets[-1], choices=buckets),
                Knob("sync_every", syncs[-1], choices=syncs),
            ),
            set_knobs("graphs"),
        ),
    ]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    fp = Fingerprint(
        f"synthetic:{shape}",
        f"block:{dshape}",
        name,
        "",
        "",
        torch.__version__,
        dep.dtype,
        "single",
    )
    out = study(args, "gpu", base, directions, make, profiles, fp, clock="wall (device held)")
    out["label"] = SIM_LABEL
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for tune_targets.json")
    ap.add_argument("--setting", choices=["cpu", "gpu", "both"], default="both")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (CI path)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per workload (CPU setting)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--loop-fraction", type=float, default=0.2, help="loop budget / grid time")
    ap.add_argument("--trials", type=int, default=3, help="candidates per direction and round")
    ap.add_argument("--patience", type=int, default=2, help="rounds with no winner")
    ap.add_argument("--explorer", choices=["auto", "tpe", "local"], default="auto")
    ap.add_argument("--min-gain", type=float, default=0.01)
    ap.add_argument("--reach", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": {"torch": torch.__version__, "cpu": platform.processor() or "cpu"},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    if args.setting in ("cpu", "both"):
        results["cpu"] = cpu_setting(args)
    if args.setting in ("gpu", "both"):
        results["gpu"] = gpu_setting(args)
    write_json(args.out / "tune_targets.json", results)
    print(
        f"{'setting':<8} {'grid best':>22} {'loop/grid best':>15} {'loop/grid s':>12} "
        f"{'cold s':>8} {'warm s':>8}  lossless"
    )
    for s in ("cpu", "gpu"):
        if s in results:
            r = results[s]
            w = r["warm_start"]
            print(
                f"{s:<8} {r['grid']['best']:>22} {r['loop']['best_fraction_of_grid']:>15.3f} "
                f"{r['loop']['cost_fraction_of_grid']:>12.3f} {w['cold_s_to_best'] or -1:>8.1f} "
                f"{w['warm_s_to_best'] or -1:>8.1f}  {r['grid']['all_lossless']}"
                + ("  (simulated acceptance)" if s == "gpu" else "")
            )
    return results


if __name__ == "__main__":
    main()
