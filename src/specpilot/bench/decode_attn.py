"""End to end for ``bench/decode_attn_gpu.py`` — the engine's AR step and a width-8 verify with
mechanism ``split-kv`` off and on — and the script's printed table.

One target (the llama3-8b shape with random bf16 weights on CUDA; ``tiny-llama`` in fp32 on the
CPU, under the Triton interpreter) and, per context, two engines over the same weights whose one
row holds a random prompt of that length: ``off`` captured while the model has no attention
kernel, ``on`` after ``install`` (a graph keeps the kernel it captured, so both arms replay side by
side). Each arm's forward is the engine's own verify step (``Engine.time_forward``), timed in
interleaved rounds; medians with the min-max spread. Beside each: the cost model's prediction
(``mechanisms/decode_attn_cost.py``) from the SDPA time the micro-benchmark measured at that
length and width, when it has one. Greedy tokens of both arms (AR, a few dozen) are compared:
equal in fp32; in bf16 a difference is a kernel-rounding near-tie, reported, not hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from specpilot.bench.gpu_hf import prefix_agree
from specpilot.bench.gpu_suite import _verify_engine, forcing_summary
from specpilot.engine import Engine, generate
from specpilot.kernels.decode_attn_plan import DecodeAttnConfig
from specpilot.mechanisms.decode_attn import install, uninstall
from specpilot.mechanisms.decode_attn_cost import ASSUMPTIONS, predict
from specpilot.synthetic import build_target, make_peaked
from specpilot.timing import spread

NAME = "split-kv"


def run_e2e(
    device: torch.device,
    contexts: list[int],
    widths: list[int],
    rounds: int,
    iters: int,
    bandwidth_Bps: float,
    launch_s: float,
    num_sms: int,
    sdpa_s: Mapping[tuple[int, int], float],
    knobs: DecodeAttnConfig,
    new_tokens: int,
    deadline_left: Callable[[], float],
) -> dict[str, Any]:
    """Per context: forward time per width, off vs on, with the prediction beside."""
    cpu = device.type == "cpu"
    shape, dtype = ("tiny-llama", torch.float32) if cpu else ("llama3-8b", torch.bfloat16)
    # peaked: clear top-1 margins, so that the two arms' AR tokens may be compared as well as forced
    model = make_peaked(
        build_target(shape, device, dtype, seed=0, max_positions=max(contexts) + 256)
    )
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"shape": shape, "assumptions": ASSUMPTIONS, "contexts": {}}
    for ctx in contexts:
        if deadline_left() < 40:  # one context: two 8B engines, captures and rounds
            out["contexts"][str(ctx)] = "skipped: budget"
            continue
        prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=gen).tolist()
        uninstall(model)
        off = _verify_engine(model, prompt, max(widths))
        for w in widths:  # capture the off arm's graphs before the kernel is installed
            off.time_forward(w, 1)
        kernel = install(model, knobs.keys_per_split, knobs.block_n, knobs.num_warps)
        on = _verify_engine(model, prompt, max(widths))
        arms = {"off": (off, None), "on": (on, kernel)}
        times: dict[str, dict[int, list[float]]] = {"off": {}, "on": {}}
        for r in range(rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                eng, attn = arms[name]
                model.dense_attention = attn  # what an eager step reads (graphs keep theirs)
                for w in widths:
                    times[name].setdefault(w, []).append(eng.time_forward(w, iters))
        model.dense_attention = None
        ar_off = generate(Engine(model), [prompt], new_tokens)[0].tokens
        model.dense_attention = kernel
        ar_on = generate(Engine(model), [prompt], new_tokens)[0].tokens
        uninstall(model)
        row: dict[str, Any] = {
            "ar_tokens": len(ar_off),
            "ar_tokens_equal": ar_off == ar_on,
            "ar_same_prefix": prefix_agree(ar_off, ar_on),
            # token forcing under the stock forward, which never uses the kernel
            "forcing": {
                n: forcing_summary(model, prompt, t) for n, t in (("off", ar_off), ("on", ar_on))
            },
            "widths": {},
        }
        for w in widths:
            t_off, t_on = spread(times["off"][w]), spread(times["on"][w])
            ratio = [a / b for a, b in zip(times["off"][w], times["on"][w], strict=True)]
            start = ctx - 1  # the pending token's slot: the engine's verify block starts there
            attn_len = on.bucket(start + w)
            near = [a for a, ww in sdpa_s if ww == w]  # the micro-bench's nearest bucket
            sdpa_len = min(near, key=lambda a: abs(a - attn_len)) if near else None
            measured = sdpa_s[(sdpa_len, w)] if sdpa_len is not None else None
            pred = predict(
                cfg, [start], w, attn_len, bandwidth_Bps, launch_s, num_sms, knobs,
                model.embed.element_size(), measured,
            )  # fmt: skip
            row["widths"][str(w)] = {
                "off_s": t_off,
                "on_s": t_on,
                "speedup": spread(ratio),
                "predicted_saved_s": pred.saved_s,
                "predicted_on_s": t_off["median"] - pred.saved_s,
                "attn_len": attn_len,
                "measured_sdpa_at_attn_len": sdpa_len,
            }
        out["contexts"][str(ctx)] = row
        del off, on
        if not cpu:
            torch.cuda.empty_cache()
    return out


def table(out: dict[str, Any]) -> str:
    """The short table ``bench/decode_attn_gpu.py`` prints last, from its JSON."""
    lines: list[str] = []
    sec = out["sections"]
    c = sec.get("checks") or {}
    if "copy_bandwidth_Bps" in c:
        lines.append(
            f"checks: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, launch "
            f"{c['launch_s'] * 1e6:.2f} us, {c['num_sms']} SMs"
        )
    cor = sec.get("correctness") or {}
    if "cases" in cor:
        worst = max(cor["cases"], key=lambda r: r["kernel_err"])
        lines.append(
            f"correctness: all ok {cor['all_ok']}; worst kernel |err| vs fp32 "
            f"{worst['kernel_err']:.2e} (SDPA {worst['sdpa_err']:.2e}) at L={worst['length']} "
            f"W={worst['width']} B={worst['batch']}; poisoned keys unread {cor['unread_ok']}; "
            f"deterministic {cor['deterministic']}; graph replay {cor['graph_ok']}"
        )
    elif cor:
        lines.append(f"correctness: {cor.get('error', cor)}")
    tim = sec.get("timing") or {}
    if tim.get("rows"):
        lines.append(
            f"{'L':>5} {'W':>3} {'SDPA+gather us':>15} {'split-kv us':>12} {'best variant':>22} "
            f"{'best us':>8} {'pred us':>8}"
        )
        for r in tim["rows"]:
            s, d, b = r["sdpa_s"], r["variants"][r["default"]], r["variants"][r["best"]]
            lines.append(
                f"{r['length']:>5} {r['width']:>3} {s['median'] * 1e6:>8.2f} "
                f"({s['lo'] * 1e6:.1f}-{s['hi'] * 1e6:.1f}) {d['s']['median'] * 1e6:>8.2f}   "
                f"{r['best']:>22} {b['s']['median'] * 1e6:>8.2f} {d['predicted_s'] * 1e6:>8.2f}"
            )
    e2e = sec.get("e2e") or {}
    for ctx, row in (e2e.get("contexts") or {}).items():
        if not isinstance(row, dict):
            lines.append(f"e2e ctx {ctx}: {row}")
            continue
        for w, r in row["widths"].items():
            lines.append(
                f"e2e {e2e['shape']} ctx {ctx} W={w}: off {r['off_s']['median'] * 1e3:.3f} ms, "
                f"on {r['on_s']['median'] * 1e3:.3f} ms, x{r['speedup']['median']:.3f} "
                f"({r['speedup']['lo']:.3f}-{r['speedup']['hi']:.3f}); predicted on "
                f"{r['predicted_on_s'] * 1e3:.3f} ms"
            )
        lines.append(
            f"e2e ctx {ctx}: AR tokens equal {row['ar_tokens_equal']} "
            f"(same prefix {row['ar_same_prefix']}/{row['ar_tokens']}); token forcing "
            + ", ".join(
                f"{n} {v['mismatches']} mismatches {v['near_ties']} near-ties"
                for n, v in row.get("forcing", {}).items()
            )
        )
    if "error" in e2e:
        lines.append(f"e2e: {e2e['error']}")
    return "\n".join(lines)


__all__ = ["NAME", "run_e2e", "table"]
