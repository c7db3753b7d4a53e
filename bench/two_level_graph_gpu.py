"""Two-level verification on the CUDA-graph engine (issue 15 item 4): one-level vs two-level with
the cheap INT8 level inside the captured draft step (``mechanisms/two_level_device.py``).

    PYTHONPATH=src python3 bench/two_level_graph_gpu.py --out DIR          # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/two_level_graph_gpu.py --out DIR --tiny   # CPU smoke run (fp32)

The Llama-3-8B shape with seeded random bf16 weights made peaked, batch 1; the block drafter
(seeded random weights, block 8) under **simulated acceptance** with weak profiles (``tau=1.5``,
``2``, ``3``), CUDA graphs. Arms per profile: AR, ``one-level``, ``correct`` (the device
two-level drafter) and ``extend`` (``--extension`` cheap tokens), sharing one INT8 copy.

1. **correctness**: every arm's warm-up and last run commit exactly AR's tokens; the INT8 copy's
   teacher-forced ``agreement`` with the target on AR's continuation.
2. **components** (CUDA graphs and events, interleaved rounds): the target forward at the one-
   and two-level verify widths, the cheap forward of the block and of one extension token.
3. **end to end**: interleaved rounds of every arm: τ, tok/s, ms per cycle, ratios to AR and to
   one-level per round (median, spread), the cheap level's counters.
4. **prediction** (``two_level_cost.predict``) beside each two-level arm, from the one-level
   arm's survival and phase times, the agreement and part 2's component times.

JSON goes to ``DIR/two_level_graph_gpu.json`` after each profile; a short table is printed last.
Every figure is ``simulated acceptance`` on random weights: label it so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specpilot.bench.runner import run_prompts, synchronize
from specpilot.bench.script import (
    BenchScript,
    arm_row,
    e2e_rounds,
    guarded,
    peaked_target,
    prompt_tokens,
    random_prompts,
    script_parser,
    spread_text,
)
from specpilot.bench.two_level import agreement, survival
from specpilot.costmodel.measure import capture_graph
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
from specpilot.synthetic import init_random_on_device
from specpilot.timing import interleaved_rounds, spread

PROFILES = ("tau=1.5,block=8", "tau=2,block=8", "tau=3,block=8")
TINY_PROFILES = ("tau=1.5,block=6", "tau=3,block=6")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = script_parser(__doc__, 150.0, "tiny fp32 shapes on the CPU (smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5 / 2)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per run, each at batch 1")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 12)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny 16)")
    ap.add_argument("--extension", type=int, default=2, help="cheap tokens of the extend arm")
    ap.add_argument("--profiles", default=None, help="';'-separated (default the three weak)")
    args = ap.parse_args(argv)
    t = args.tiny
    args.rounds = args.rounds or (2 if t else 5)
    args.prompt_len = args.prompt_len or (12 if t else 256)
    args.new_tokens = args.new_tokens or (16 if t else 128)
    args.profiles = (
        args.profiles.split(";") if args.profiles else list(TINY_PROFILES if t else PROFILES)
    )
    return args


def block_drafter(target: Transformer, block: int, tiny: bool) -> BlockDrafter:
    """The DFlash-shaped block drafter (tiny: one layer), seeded; one per engine (an engine
    binds its drafter's buffers, which its graphs then read)."""
    layers, ctx = (1, 2) if tiny else (5, 5)
    drafter = BlockDrafter(target, layers, block, ctx)
    init_random_on_device(drafter.weights, 2)
    return drafter


def forward_step(model: Transformer, ctx: int, width: int) -> Callable[[], None]:
    """One forward of ``width`` tokens (argmax included) after ``ctx`` cached slots, batch 1: a
    CUDA graph's replay (eager on the CPU)."""
    dev, fwd = model.device, Forward(model)
    cache = model.allocate_cache(1, ctx + width + 1)
    tokens = torch.ones(1, width, dtype=torch.int64, device=dev)  # [1, W]
    start = torch.full((1,), ctx, dtype=torch.int64, device=dev)  # [1]
    out = torch.zeros(width, dtype=torch.int64, device=dev)  # [W]

    def step() -> None:
        out.copy_(fwd.argmax(fwd.dense(tokens, cache, start, ctx + width)))

    return capture_graph(step, dev) if dev.type == "cuda" else step


def components(
    target: Transformer, cheap: Transformer, ctx: int, k: int, ext: int, tiny: bool
) -> dict[str, Any]:
    """Part 2, interleaved: target at ``k + 1`` / ``k + 2`` / ``k + 2 + ext``, cheap at ``k + 2``
    (the block) and 1 (an extension token); seconds per forward (median, spread)."""
    rounds, iters = (3, 2) if tiny else (7, 10)
    jobs = {
        "target_w_one": (target, k + 1),
        "target_w_correct": (target, k + 2),
        "target_w_extend": (target, k + 2 + ext),
        "cheap_block": (cheap, k + 2),
        "cheap_step": (cheap, 1),
    }
    steps = {name: forward_step(model, ctx, width) for name, (model, width) in jobs.items()}
    for step in steps.values():  # warm-up (allocator, autotune) out of the timing
        step()
    got = interleaved_rounds(steps, target.device, rounds, iters=iters)
    return {n: spread(v) for n, v in got.items()}


def stats_of(sample: Any) -> AcceptanceStats:
    total = AcceptanceStats()
    for run in sample.payload:
        total.merge(run.result.stats)
    return total


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

    arms = {"ar": ar, **engines}
    meas, warm = e2e_rounds(arms, encoded, n_new, args.rounds, deadline)
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
            **arm_row(meas, name, arms[name], [a.cycles for a in st], ar_tokens, warm),
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
    del engines, drafters, arms, meas
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def table(out: dict[str, Any]) -> str:
    lines = [
        f"two_level_graph_gpu · {out['device']} · {out['target']} · batch 1 · "
        f"{SIM_LABEL} · agreement {out.get('agreement', float('nan')):.4f}",
        "profile          arm        |   tau | pred tau | tok/s (lo-hi)        | x one-level "
        "(lo-hi)     | pred x | ok",
    ]
    comp = out.get("components_s", {})
    if comp:
        cells = "  ".join(f"{n} {spread_text(v, '.3f', 1e3)}" for n, v in comp.items())
        lines.insert(1, f"components, ms (median lo-hi): {cells}")
    for p in out.get("profiles", []):
        if "error" in p:
            lines.append(f"  {p.get('profile', '?')}: ERROR {p['error']}")
            continue
        for name, r in p["arms"].items():
            xs = spread_text(r["x_one_level"]) if "x_one_level" in r else "-"
            pred = r.get("predicted", {})
            ptau = f"{pred['tau_two']:8.2f}" if pred else f"{'-':>8}"
            px = f"{pred['speedup_over_one_level']:6.3f}" if pred else f"{'-':>6}"
            ok = r["tokens_equal_ar"] and r["warmup_tokens_equal_ar"]
            lines.append(
                f"  {p['profile']:15s} {name:10s} | {r['tau']:5.2f} | {ptau} | "
                f"{spread_text(r['tok_s'], '7.1f')} | {xs:22s} | {px} | "
                f"{'ok' if ok else 'TOKENS DIFFER'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    label = f"{SIM_LABEL}; block drafter with seeded random weights; peaked random target"
    b = BenchScript(dev, args.out, "two_level_graph_gpu.json", args.budget_s, label=label)
    out = b.out
    del out["sections"]  # a flat record: agreement, components, profiles
    with torch.inference_mode():
        max_pos = args.prompt_len + args.new_tokens + 512
        target, out["target"] = peaked_target(args.tiny, dev, max_pos)
        out |= {"prompts": args.prompts, "args": vars(args), "profiles": []}
        cheap = cheap_model(target, DEVICE_MAX_M)
        prompts = random_prompts(target.cfg.vocab_size, args.prompt_len, args.prompts)
        encoded = [(f"p{i}", p) for i, p in enumerate(prompts)]
        ar = Engine(target, graphs=dev.type == "cuda")
        ar_tokens = prompt_tokens(run_prompts(ar, encoded, args.new_tokens, ()))
        seq = [*encoded[0][1], *ar_tokens[0]]
        k = AcceptanceProfile.parse(args.profiles[0]).k
        out["agreement"] = agree = agreement(target, cheap, seq, k + 2, args.prompt_len)
        ctx = args.prompt_len + args.new_tokens // 2
        out["components_s"] = comp = components(target, cheap, ctx, k, args.extension, args.tiny)
        synchronize(dev)
        b.save()
        deadline = b.t0 + args.budget_s
        for i, prof in enumerate(args.profiles):
            until = time.perf_counter() + (deadline - time.perf_counter()) / (
                len(args.profiles) - i
            )
            res = guarded(  # the other profiles still run
                lambda prof=prof, until=until: profile_section(
                    args, prof, target, cheap, ar, encoded, ar_tokens, comp, agree, until
                )
            )
            out["profiles"].append({"profile": prof, **res})
            b.save()
    print(table(out))
    return out


if __name__ == "__main__":
    main()
