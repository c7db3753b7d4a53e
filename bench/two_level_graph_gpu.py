"""Two-level verification on the CUDA-graph engine (issue 15 item 4): one-level vs two-level with
the cheap INT8 level inside the captured draft step (``mechanisms/two_level_device.py``).

    PYTHONPATH=src python3 bench/two_level_graph_gpu.py --out DIR          # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/two_level_graph_gpu.py --out DIR --tiny   # CPU smoke run (fp32)

Target: the Llama-3-8B shape, seeded random bf16 weights made peaked (``synthetic.make_peaked``:
clear top-1 margins, so a simulated oracle is not lost to bf16 near-ties), batch 1 (``--prompts``
prompts of ``--prompt-len`` random tokens, one at a time).
Drafter: the block drafter (5 layers at the target's width, block 8, seeded random weights)
under **simulated acceptance** with weak profiles (``tau=1.5``, ``2``, ``3`` at block 8), CUDA
graphs on. Arms per profile: AR, ``one-level`` (the simulated block drafter), ``correct``
(wrapped by the device two-level drafter) and ``extend`` (``correct-extend``, ``--extension``
cheap tokens); each two-level arm shares one INT8 copy of the target.

1. **correctness first**: every arm's warm-up run (graph capture) and its last timed run must
   commit exactly AR's tokens (``tokens_equal_ar``); the INT8 copy's teacher-forced agreement
   with the target on AR's continuation is measured (``agreement``).
2. **components** (CUDA graphs, CUDA events, interleaved rounds, median and spread): the target
   forward at the one- and two-level verify widths, the cheap forward of the block (width
   ``k + 2``) and of one extension token, at the decode context.
3. **end to end**: interleaved rounds of every arm; per arm τ (committed tokens per exact verify,
   bonus included), tok/s, ms per cycle, ratio to AR and to one-level per round (median,
   spread); the cheap level's counters (drafted tokens kept, replaced).
4. **prediction** (``two_level_cost.predict``) beside each two-level arm, from the one-level
   arm's measured survival (all its runs) and phase times (one extra profiled run: draft, and
   verify + accept + host per cycle), the measured agreement and the component times of part 2
   (cheap block and step; the verify's growth from width k + 1 to the two-level width): the
   predicted τ and speedup over one-level.

JSON goes to ``DIR/two_level_graph_gpu.json`` after each profile; a short table is printed last.
Every figure is ``simulated acceptance`` on random weights: label it so.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.protocol import interleave
from specpilot.bench.records import git_rev
from specpilot.bench.runner import run_prompts, synchronize
from specpilot.bench.two_level import agreement, survival
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.engine import Engine
from specpilot.engine.stats import AcceptanceStats
from specpilot.mechanisms.int8_copy import cheap_model
from specpilot.mechanisms.two_level import DEVICE_MAX_M
from specpilot.mechanisms.two_level_cost import predict
from specpilot.mechanisms.two_level_device import DeviceTwoLevelDrafter
from specpilot.models.forward import Forward
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_target, init_random_on_device, make_peaked
from specpilot.timing import time_burst

PROFILES = ("tau=1.5,block=8", "tau=2,block=8", "tau=3,block=8")
TINY_PROFILES = ("tau=1.5,block=6", "tau=3,block=6")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5 / 2)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per run, each at batch 1")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 12)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny 16)")
    ap.add_argument("--extension", type=int, default=2, help="cheap tokens of the extend arm")
    ap.add_argument("--profiles", default=None, help="';'-separated (default the three weak)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="no round starts past this")
    args = ap.parse_args(argv)
    t = args.tiny
    args.rounds = args.rounds or (2 if t else 5)
    args.prompt_len = args.prompt_len or (12 if t else 256)
    args.new_tokens = args.new_tokens or (16 if t else 128)
    args.profiles = (
        args.profiles.split(";") if args.profiles else list(TINY_PROFILES if t else PROFILES)
    )
    return args


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "lo": min(values), "hi": max(values)}


# ---------------------------------------------------------------------- building blocks
def block_drafter(target: Transformer, block: int, tiny: bool) -> BlockDrafter:
    """The DFlash-shaped block drafter (tiny: one layer), seeded; one per engine (an engine
    binds its drafter's buffers, which its graphs then read)."""
    layers, ctx = (1, 2) if tiny else (5, 5)
    drafter = BlockDrafter(target, layers, block, ctx)
    init_random_on_device(drafter.weights, 2)
    return drafter


def forward_time(
    model: Transformer, ctx: int, width: int, rounds: int, iters: int
) -> dict[str, float]:
    """Seconds of one forward of ``width`` tokens (argmax included) after ``ctx`` cached slots,
    batch 1: a CUDA graph replayed ``iters`` times per round (eager on the CPU)."""
    from specpilot.costmodel.measure import capture_graph

    dev, fwd = model.device, Forward(model)
    cache = model.allocate_cache(1, ctx + width + 1)
    tokens = torch.ones(1, width, dtype=torch.int64, device=dev)  # [1, W]
    start = torch.full((1,), ctx, dtype=torch.int64, device=dev)  # [1]
    out = torch.zeros(width, dtype=torch.int64, device=dev)  # [W]

    def step() -> None:
        out.copy_(fwd.argmax(fwd.dense(tokens, cache, start, ctx + width)))

    run = capture_graph(step, dev) if dev.type == "cuda" else step
    for _ in range(2):  # warm-up (allocator, autotune) out of the timing
        run()
    return spread([time_burst(run, dev, iters) for _ in range(rounds)])


def components(
    target: Transformer, cheap: Transformer, ctx: int, k: int, ext: int, tiny: bool
) -> dict[str, Any]:
    """Part 2, interleaved by width: target at ``k + 1`` / ``k + 2`` / ``k + 2 + ext``, cheap at
    ``k + 2`` (the block) and 1 (an extension token)."""
    rounds, iters = (3, 2) if tiny else (7, 10)
    jobs = {
        "target_w_one": (target, k + 1),
        "target_w_correct": (target, k + 2),
        "target_w_extend": (target, k + 2 + ext),
        "cheap_block": (cheap, k + 2),
        "cheap_step": (cheap, 1),
    }
    got: dict[str, list[dict[str, float]]] = {n: [] for n in jobs}
    for r in range(rounds):
        names = list(jobs)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, width = jobs[name]
            got[name].append(forward_time(model, ctx, width, 1, iters))
    return {n: spread([g["median"] for g in v]) for n, v in got.items()}


def stats_of(sample: Any) -> AcceptanceStats:
    total = AcceptanceStats()
    for run in sample.payload:
        total.merge(run.result.stats)
    return total


# ---------------------------------------------------------------------- one profile
def profile_section(
    args: argparse.Namespace,
    prof_text: str,
    target: Transformer,
    cheap: Transformer,
    ar: Engine,
    encoded: list[tuple[str, list[int]]],
    ar_tokens: list[list[int]],
    comp: dict[str, Any],
    agree: float,
    deadline: float,
) -> dict[str, Any]:
    prof = AcceptanceProfile.parse(prof_text)
    block, graphs = prof.k + 1, target.device.type == "cuda"

    def sim() -> SimulatedAcceptance:
        return SimulatedAcceptance(block_drafter(target, block, args.tiny), prof, seed=0)

    drafters: dict[str, Any] = {
        "one-level": sim(),
        "correct": DeviceTwoLevelDrafter(sim(), cheap, 0),
        "extend": DeviceTwoLevelDrafter(sim(), cheap, args.extension),
    }
    engines = {n: Engine(target, d, graphs=graphs) for n, d in drafters.items()}
    n_new = args.new_tokens

    def tokens_of(sample: Any) -> list[list[int]]:
        return [r.result.tokens for r in sample.payload]

    warm = {n: run_prompts(e, encoded, n_new, ()) for n, e in engines.items()}
    equal_warm = {n: tokens_of(s) == ar_tokens for n, s in warm.items()}
    arms = {"ar": ar, **engines}
    meas = interleave(
        {n: (lambda e=e: run_prompts(e, encoded, n_new, ())) for n, e in arms.items()},
        rounds=args.rounds,
        warmup=0,
        deadline=deadline,
    )
    # one profiled run of one-level: its phase times per cycle (CUDA events)
    one = engines["one-level"]
    one.profile, before = True, one.times.to_dict()
    prof_stats = stats_of(run_prompts(one, encoded, n_new, ()))
    for sample in meas.samples["one-level"]:  # the survival over every one-level run
        prof_stats.merge(stats_of(sample))
    one.profile = False
    after = one.times.to_dict()
    cycles = max(after["cycles"] - before["cycles"], 1.0)
    t_draft = (after["draft_s"] - before["draft_s"]) / cycles
    t_rest = (after["wall_s"] - before["wall_s"]) / cycles - t_draft  # verify, accept, other
    surv = survival(prof_stats)
    res: dict[str, Any] = {
        "profile": prof_text,
        "profile_tau": prof.tau,
        "one_level_phases_ms": {"draft": 1e3 * t_draft, "verify_accept_other": 1e3 * t_rest},
        "one_level_survival": surv,
        "arms": {},
    }
    for name in arms:
        samples = meas.samples[name]
        st = [stats_of(s) for s in samples]
        rec: dict[str, Any] = {
            "tau": statistics.median(s.mean_accepted_len for s in st),
            "tok_s": spread([s.tok_s for s in samples]),
            "cycle_ms": spread(
                [1e3 * s.seconds / max(a.cycles, 1) for s, a in zip(samples, st, strict=True)]
            ),
            "x_ar": meas.ratio(name, "ar").to_dict(),
            "rounds": len(samples),
            "warmup_tokens_equal_ar": equal_warm.get(name, True),
            "tokens_equal_ar": tokens_of(samples[-1]) == ar_tokens,
            "graph_captures": arms[name].runner.captures,
        }
        if name != "ar":
            rec["x_one_level"] = meas.ratio(name, "one-level").to_dict()
        d = drafters.get(name)
        if isinstance(d, DeviceTwoLevelDrafter):
            e = d.max_extension
            width = "target_w_extend" if e else "target_w_correct"
            extra = comp[width]["median"] - comp["target_w_one"]["median"]
            p = predict(
                surv, agree, e, t_draft, t_rest, t_rest + extra,
                comp["cheap_block"]["median"], comp["cheap_step"]["median"],
            )  # fmt: skip
            rec["predicted"] = {
                "tau_one": p.tau_one, "tau_two": p.tau_two, "speedup_over_one_level": p.speedup,
                "cycle_one_ms": 1e3 * p.cycle_one_s, "cycle_two_ms": 1e3 * p.cycle_two_s,
            }  # fmt: skip
            rec["cheap_counts"] = d.stats()
        res["arms"][name] = rec
    del engines, drafters, arms, meas, warm
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------- report
def table(out: dict[str, Any]) -> str:
    lines = [
        f"two_level_graph_gpu · {out['device']} · {out['target']} · batch 1 · "
        f"{SIM_LABEL} · agreement {out.get('agreement', float('nan')):.4f}",
        "profile          arm        |   tau | pred tau | tok/s (lo-hi)        | x one-level "
        "(lo-hi)     | pred x | ok",
    ]
    comp = out.get("components_s", {})
    if comp:
        lines.insert(
            1,
            "components, ms (median lo-hi): "
            + "  ".join(
                f"{n} {1e3 * v['median']:.3f} ({1e3 * v['lo']:.3f}-{1e3 * v['hi']:.3f})"
                for n, v in comp.items()
            ),
        )
    for p in out.get("profiles", []):
        if "error" in p:
            lines.append(f"  {p.get('profile', '?')}: ERROR {p['error']}")
            continue
        for name, r in p["arms"].items():
            t = r["tok_s"]
            x = r.get("x_one_level")
            xs = f"{x['median']:.3f} ({x['lo']:.3f}-{x['hi']:.3f})" if x else "-"
            pred = r.get("predicted", {})
            ptau = f"{pred['tau_two']:8.2f}" if pred else f"{'-':>8}"
            px = f"{pred['speedup_over_one_level']:6.3f}" if pred else f"{'-':>6}"
            ok = r["tokens_equal_ar"] and r["warmup_tokens_equal_ar"]
            lines.append(
                f"  {p['profile']:15s} {name:10s} | {r['tau']:5.2f} | {ptau} | "
                f"{t['median']:7.1f} ({t['lo']:.1f}-{t['hi']:.1f}) | {xs:22s} | {px} | "
                f"{'ok' if ok else 'TOKENS DIFFER'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shape = "tiny-llama" if args.tiny else "llama3-8b"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    max_pos = args.prompt_len + args.new_tokens + 512
    out: dict[str, Any] = {
        "label": f"{SIM_LABEL}; block drafter with seeded random weights; peaked random target",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "target": f"{shape} {str(dtype).removeprefix('torch.')}",
        "prompts": args.prompts,
        "torch": torch.__version__,
        "commit": git_rev(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "profiles": [],
    }
    path = args.out / "two_level_graph_gpu.json"

    def save() -> None:
        out["total_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(out, indent=1) + "\n")

    with torch.inference_mode():
        target = make_peaked(build_target(shape, dev, dtype, seed=0, max_positions=max_pos))
        cheap = cheap_model(target, DEVICE_MAX_M)
        rng = random.Random(0)
        vocab = target.cfg.vocab_size
        encoded = [
            (f"p{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)])
            for i in range(args.prompts)
        ]
        ar = Engine(target, graphs=dev.type == "cuda")
        ar_tokens = [r.result.tokens for r in run_prompts(ar, encoded, args.new_tokens, ()).payload]
        seq = [*encoded[0][1], *ar_tokens[0]]
        k = AcceptanceProfile.parse(args.profiles[0]).k
        out["agreement"] = agreement(target, cheap, seq, k + 2, args.prompt_len)
        ctx = args.prompt_len + args.new_tokens // 2
        out["components_s"] = comp = components(target, cheap, ctx, k, args.extension, args.tiny)
        synchronize(dev)
        save()
        deadline = t0 + args.budget_s
        for i, prof in enumerate(args.profiles):
            left = (deadline - time.perf_counter()) / (len(args.profiles) - i)
            try:
                res = profile_section(
                    args, prof, target, cheap, ar, encoded, ar_tokens, comp, out["agreement"],
                    time.perf_counter() + left,
                )  # fmt: skip
            except Exception as e:  # the other profiles still run
                import traceback

                res = {"profile": prof, "error": f"{type(e).__name__}: {e}"}
                res["trace"] = traceback.format_exc()
            out["profiles"].append(res)
            save()
    print(table(out))
    return out


if __name__ == "__main__":
    main()
