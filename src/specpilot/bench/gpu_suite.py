"""The one-call GPU suite (issue 3): ceilings, then per synthetic shape AR vs roofline, the
verify-cost curve, speculative cycles at simulated acceptance with their time breakdown, and HF
transformers ``generate`` side by side. Prints a short table last; writes full JSON.

Conventions: tok/s counts decode tokens after the first (prefill excluded, prefill's token not
counted); τ is committed tokens per cycle including the bonus; t_verify(w) is one target forward
of w tokens (a verify of w - 1 drafts; t_verify(1) is the AR step); every speculative figure here
comes from simulated acceptance and is labelled so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from specpilot.bench import gpu_ceilings
from specpilot.bench.gpu_hf import hf_side, prefix_agree
from specpilot.bench.gpu_suite_report import table, targets
from specpilot.bench.records import git_rev
from specpilot.drafters.base import Drafter
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine import CycleTimes, Engine, generate
from specpilot.forcing import force_tokens
from specpilot.models.transformer import Transformer
from specpilot.runtime import free_device_memory
from specpilot.synthetic import (
    DRAFT_MODEL_FOR_TARGET,
    TARGET_SHAPES,
    build_block_drafter,
    build_draft_model,
    build_target,
    kv_bytes_per_token,
    streamed_weight_bytes,
)

FULL_SHAPES = ("llama3-8b", "smollm2-135m", "qwen3-8b", "dense-27b")
TINY_SHAPES = ("tiny-llama", "tiny-qwen3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU test of the path)")
    ap.add_argument("--target-shape", action="append", dest="shapes", help="repeatable")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument(
        "--sim-accept", default=None, help="block-drafter profile, e.g. tau=6.5,block=16"
    )
    ap.add_argument("--sim-accept-k8", default=None, help="k = 8 profile, e.g. tau=4.5,block=9")
    ap.add_argument("--verify-widths", default=None, help="comma list, e.g. 1,2,4,8,16,32,64")
    ap.add_argument("--hf-tokens", type=int, default=None, help="new tokens per HF generate")
    ap.add_argument("--hf-compile-shapes", default="llama3-8b", help="comma list, '' for none")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-assisted", action="store_true")
    ap.add_argument("--no-k8", action="store_true", help="skip the k = 8 draft-model cycles")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel-time profile")
    ap.add_argument("--budget-s", type=float, default=510.0, help="skip optional parts past this")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = args.tiny
    args.shapes = args.shapes or list(TINY_SHAPES if t else FULL_SHAPES)
    args.prompt_len = args.prompt_len or (12 if t else 128)
    args.new_tokens = args.new_tokens or (40 if t else 256)
    args.sim_accept = args.sim_accept or ("tau=3,block=9" if t else "tau=6.5,block=16")
    args.sim_accept_k8 = args.sim_accept_k8 or ("tau=3,block=9" if t else "tau=4.5,block=9")
    args.verify_widths = [int(w) for w in (args.verify_widths or "1,2,4,8,16,32,64").split(",")]
    args.hf_tokens = args.hf_tokens or (8 if t else 32)
    return args


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def forcing_summary(target: Transformer, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """Token-forcing counts plus, for the first mismatch, its logit gap against the tolerance."""
    report = force_tokens(target, [("run", prompt, tokens)])
    out: dict[str, Any] = {
        "ok": report.ok,
        "matches": report.matches,
        "near_ties": report.near_ties,
        "mismatches": report.mismatches,
    }
    first = report.first_mismatch()
    if first is not None:
        m = first[1]
        top = m.top5[0][1]
        out["first_mismatch"] = {
            "position": m.position,
            "gap": top - m.logit,
            "tolerance": m.tolerance,
            "top_logit": top,
        }
    return out


def _decode_rate(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, Any]:
    """Warm up (same length: same buffers and attention buckets, so every graph is captured
    outside the timed run), then one timed generate: (tokens, decode tok/s, result)."""
    generate(engine, [prompt], n)
    captures = engine.runner.captures
    engine.times = CycleTimes()
    res = generate(engine, [prompt], n)[0]
    assert engine.runner.captures == captures, "a graph was captured inside the timed run"
    steps = max(len(res.tokens) - 1, 1)
    return res.tokens, steps / engine.times.wall, res


def open_row(eng: Engine, prompt: list[int], width: int) -> Engine:
    """``eng`` with one row holding ``prompt`` and room for forwards up to ``width`` tokens
    (``Engine.time_forward``)."""
    eng.open(1, len(prompt) + width + 8)
    eng.prefill([0], [prompt], [0], [len(prompt)], [width + 8])
    return eng


def _verify_engine(target: Transformer, prompt: list[int], width: int) -> Engine:
    """An AR engine whose one row holds ``prompt``, able to time forwards up to ``width``."""
    return open_row(Engine(target, verify_width=width), prompt, width)


def _spec_run(
    target: Transformer,
    drafter: Drafter,
    profile_text: str,
    prompt: list[int],
    n: int,
    ar_tokens: list[int],
    ar_tok_s: float,
    seed: int,
) -> dict[str, Any]:
    profile = AcceptanceProfile.parse(profile_text)
    sim = SimulatedAcceptance(drafter, profile, seed=seed)
    eng = Engine(target, sim, profile=True)
    tokens, tok_s, res = _decode_rate(eng, prompt, n)
    t, cycles = eng.times, max(eng.times.cycles, 1)
    return {
        "label": SIM_LABEL,
        "drafter": drafter.name,
        "k": drafter.k,
        "profile": profile_text,
        "profile_tau": profile.tau,
        "tau_measured": res.stats.mean_accepted_len,
        "tok_s": tok_s,
        "speedup_vs_ar": tok_s / ar_tok_s,
        "cycles": t.cycles,
        "per_cycle_s": {
            "draft": t.draft / cycles,
            "verify": t.verify / cycles,
            "accept_commit": t.accept / cycles,
            "other": t.other / cycles,
            "total": t.wall / cycles,
        },
        "other_fraction": t.other / t.wall if t.wall else 0.0,
        "oracle_divergences": sim.divergences,
        "oracle_reference_runs": sim.reference_runs,
        "tokens_equal_ar": tokens == ar_tokens[: len(tokens)],
        "agree_prefix_with_ar": prefix_agree(tokens, ar_tokens),
        "forcing": forcing_summary(target, prompt, tokens),
    }


def run_shape(
    name: str, args: argparse.Namespace, dev: torch.device, ceil: dict[str, float], deadline: float
) -> dict[str, Any]:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    t0 = time.perf_counter()
    target = build_target(name, dev, dtype, seed=args.seed, max_positions=2048)
    _sync(dev)
    cfg = target.cfg
    out: dict[str, Any] = {
        "config": cfg.to_dict(),
        "params": cfg.num_params(),
        "build_s": time.perf_counter() - t0,
    }
    rng = random.Random(args.seed)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)]
    n = args.new_tokens

    ar_tokens, ar_tok_s, _ = _decode_rate(Engine(target), prompt, n)
    bw = ceil["copy_bandwidth_Bps"]
    ctx = args.prompt_len + n / 2
    wbytes = streamed_weight_bytes(cfg, dtype)
    step_bytes = wbytes + kv_bytes_per_token(cfg, dtype) * ctx
    out["ar"] = {
        "tok_s": ar_tok_s,
        "step_s": 1 / ar_tok_s,
        "mean_context": ctx,
        "streamed_weight_bytes": wbytes,
        "roofline_tok_s": bw / step_bytes,
        "roofline_fraction": ar_tok_s * step_bytes / bw,
        "roofline_tok_s_all_params": bw / (cfg.num_params() * target.dtype.itemsize),
    }

    vc = _verify_engine(target, prompt, max(args.verify_widths))
    iters = 2 if args.tiny else 20
    curve = {w: vc.time_forward(w, iters) for w in args.verify_widths}
    out["verify_curve"] = {
        str(w): {"s": s, "ratio_to_ar": s / curve[1] if 1 in curve else None}
        for w, s in curve.items()
    }
    del vc
    t_ar = curve.get(1, 1 / ar_tok_s)

    try:
        out["spec_block"] = _block_spec(target, args, prompt, n, ar_tokens, ar_tok_s, curve, t_ar)
    except Exception as e:
        out["spec_block"] = {
            "error": f"{type(e).__name__}: {e}"[:600],
            "tb": traceback.format_exc()[-2000:],
        }
    try:
        if not args.no_k8:
            out["spec_k8"] = _k8_spec(target, name, args, prompt, n, ar_tokens, ar_tok_s)
    except Exception as e:
        out["spec_k8"] = {
            "error": f"{type(e).__name__}: {e}"[:600],
            "tb": traceback.format_exc()[-2000:],
        }

    out["ar_forcing"] = forcing_summary(target, prompt, ar_tokens)

    if not args.no_hf:
        if time.perf_counter() < deadline - 30:
            try:
                out["hf"] = hf_side(target, name, args, prompt, ar_tokens, deadline)
            except Exception as e:
                out["hf"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        else:
            out["hf"] = {"skipped": "time budget"}
    out["shape_s"] = time.perf_counter() - t0
    return out


def _block_spec(
    target: Transformer,
    args: argparse.Namespace,
    prompt: list[int],
    n: int,
    ar_tokens: list[int],
    ar_tok_s: float,
    curve: dict[int, float],
    t_ar: float,
) -> dict[str, Any]:
    """DFlash-like block drafter at the simulated profile, against τ / (t_draft + t_verify)."""
    block = build_block_drafter(target, "tiny-block" if args.tiny else "dflash-b16")
    spec = _spec_run(target, block, args.sim_accept, prompt, n, ar_tokens, ar_tok_s, args.seed)
    w = block.k + 1
    t_verify_w = curve[w] if w in curve else vc_time(target, prompt, w, 5 if args.tiny else 20)
    t_draft = spec["per_cycle_s"]["draft"]
    predicted = spec["tau_measured"] / (t_draft + t_verify_w)
    spec["block_drafter_params"] = block.num_params()
    spec["t_verify_block_s"] = t_verify_w
    spec["predicted_tok_s"] = predicted
    spec["predicted_speedup"] = spec["tau_measured"] * t_ar / (t_draft + t_verify_w)
    spec["fraction_of_predicted"] = spec["tok_s"] / predicted
    return spec


def _k8_spec(
    target: Transformer,
    name: str,
    args: argparse.Namespace,
    prompt: list[int],
    n: int,
    ar_tokens: list[int],
    ar_tok_s: float,
) -> dict[str, Any]:
    """k = 8 cycles (the 1B-class draft model where the vocabulary has one) for the breakdown."""
    draft_shape = DRAFT_MODEL_FOR_TARGET.get(name)
    drafter: Drafter
    if draft_shape:
        draft = build_draft_model(draft_shape, target.device, target.dtype, max_positions=2048)
        drafter = DraftModelDrafter(draft, k=8, target_vocab_size=target.cfg.vocab_size)
    else:
        drafter = build_block_drafter(target, "tiny-block" if args.tiny else "dflash-b9")
    k8 = _spec_run(target, drafter, args.sim_accept_k8, prompt, n, ar_tokens, ar_tok_s, args.seed)
    k8["draft_shape"] = draft_shape or "dflash-b9"
    return k8


def _kernel_profile(name: str, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    from specpilot.bench.gpu_profile import profile_forward

    try:
        dtype = torch.float32 if args.tiny else torch.bfloat16
        target = build_target(name, dev, dtype, seed=args.seed, max_positions=2048)
        rng = random.Random(args.seed)
        prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(args.prompt_len)]
        vc = _verify_engine(target, prompt, 16)
        graph_s = {str(w): vc.time_forward(w, 2 if args.tiny else 20) for w in (1, 16)}
        return {
            "shape": name,
            "graph_replay_s": graph_s,
            "eager_kernels": {str(w): profile_forward(vc, w) for w in (1, 16)},
        }
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600]}


def vc_time(target: Transformer, prompt: list[int], width: int, iters: int) -> float:
    return _verify_engine(target, prompt, width).time_forward(width, iters)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "suite": "specpilot gpu suite (issue 3)",
        "note": f"speculative figures are {SIM_LABEL}; weights are seeded random",
        "date": datetime.date.today().isoformat(),
        "commit": args.commit or git_rev(),
        "machine": {
            "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else platform.processor(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shapes": {},
    }
    with torch.inference_mode():
        results["ceilings"] = gpu_ceilings.measure(dev, args.tiny)
    for name in args.shapes:
        if name not in TARGET_SHAPES:
            raise SystemExit(
                f"Unknown --target-shape '{name}'; choose one of {', '.join(TARGET_SHAPES)}."
            )
        print(f"[suite] {name} ...", flush=True)
        try:
            results["shapes"][name] = run_shape(name, args, dev, results["ceilings"], deadline)
        except Exception as e:  # record and go on to the next shape
            results["shapes"][name] = {
                "error": f"{type(e).__name__}: {e}"[:600],
                "traceback": traceback.format_exc()[-3000:],
            }
            print(results["shapes"][name]["traceback"], flush=True)
        free_device_memory(dev)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"[suite] {name} done at {time.perf_counter() - start:.0f}s", flush=True)
    if not args.no_profile:  # last: a profiler session slows later eager launches (HF)
        results["kernel_profile"] = _kernel_profile(args.shapes[0], args, dev)
    results["targets"] = targets(results)
    results["total_s"] = time.perf_counter() - start
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["targets"], indent=1))
    print(table(results))
    return results
