"""W12 v3 against bf16 on the H200: Llama-3-8B linear shapes, M = 1, 2, 4, 8, 16; then end to end.

1. Correctness first, at every shape and M: every variant's output against the fp64 product of
   the decoded weights (bound: half a bf16 ulp + K·2^-23·Σ|x||w|), and the PTX decoders' outputs
   bit for bit against the plain-op decoders' (same bits, same order).
2. Timing, CUDA graphs of many calls with weight copies rotated past the 50 MB L2:
   ``cublas`` (F.linear), ``bf16_dot`` (the tl.dot kernel reading bf16), ``bf16_gemv`` (the GEMV
   reading bf16, M <= 4), ``v2`` (the previous W12 kernel and layout), ``v3_gemv`` (M <= 4) and
   ``v3_dot``. Each Triton variant first sweeps a few configs (one graph each); then the best
   config of every variant runs in ``--rounds`` interleaved rounds: medians with min-max spread.
3. Bandwidth: bytes read / time per variant and a device copy (2 GiB) measured in the same run,
   so each variant's fraction of the copy roofline is printed (``roof%``).
4. Layer totals (the four shapes summed), W12 vs the better bf16 kernel (named), and a
   replacement for ``kernels/w12_linear.py``'s ``CHOSEN`` table (the best v3 config per M by layer
   total, with its measured roofline fraction: the cost model's W12 kernel efficiency).
5. End to end (``--e2e``, default on the GPU): the engine's CUDA-graph forward of a seeded
   Llama-3-8B-shaped bf16 target at width 1 (AR step) and 16 (verify-16), stock vs every decoder
   matrix in W12 (the table as it is in the source), beside the cost-model prediction
   ``stock − layers · Σ_shapes (t_cuBLAS(M) − t_W12(M))`` from step 2's medians.

JSON to ``--out/w12_gpu.json`` (rewritten after every shape); the short table is printed last.

GPU:  ``PYTHONPATH=src python3 bench/w12_gpu.py --out DIR``        (about 2-3 min on an H200)
CPU:  ``PYTHONPATH=src python3 bench/w12_gpu.py --out DIR --tiny`` (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench import kernel_bench as kb
from specpilot.bench.gpu_suite import _verify_engine
from specpilot.bench.kernel_bench import LLAMA3_8B
from specpilot.bench.script import finish, guarded, random_prompts
from specpilot.costmodel.weight_format import predicted_w12_forward_s
from specpilot.kernels.gemm_common import GemmConfig, counter_buffer
from specpilot.kernels.w12_gemm import bf16_matmul, w12_matmul
from specpilot.kernels.w12_gemv import GemvConfig, bf16_gemv, w12_gemv
from specpilot.mechanisms.w12 import install as install_w12
from specpilot.mechanisms.w12_format import decode, encode
from specpilot.synthetic import build_target

MS = (1, 2, 4, 8, 16)
GEMV_SWEEP = (
    GemvConfig(block_n=32, block_k=512, num_warps=4),
    GemvConfig(block_n=64, block_k=512, num_warps=4),
    GemvConfig(block_n=16, block_k=512, num_warps=4),
    GemvConfig(block_n=32, block_k=256, num_warps=4, split_k=1),
    GemvConfig(block_n=64, block_k=256, num_warps=8),
)
DOT_SWEEP = (
    GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
    GemmConfig(block_n=128, block_k=256, num_warps=4, num_stages=3),
    GemmConfig(block_n=128, block_k=128, num_warps=4, num_stages=4),
    GemmConfig(block_n=64, block_k=512, num_warps=4, num_stages=2),
)
V2_SWEEP = {  # the previous kernel's own best configs (docs/BENCHMARKS.md, W12 v2)
    "m1": (GemmConfig(block_n=32, block_k=256, num_warps=4, use_dot=False),),
    "m16": (GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),),
}
TINY = {
    "gemv": (GemvConfig(block_n=16, block_k=64), GemvConfig(block_n=32, block_k=64, split_k=2)),
    "dot": (GemmConfig(block_n=16, block_k=64), GemmConfig(block_n=32, block_k=64, split_k=2)),
}
W12_VARIANTS = ("v2", "v3_gemv", "v3_dot")
BF16_VARIANTS = ("cublas", "bf16_dot", "bf16_gemv")


def cfg_key(cfg: Any) -> str:
    return f"{type(cfg).__name__}({', '.join(f'{k}={v}' for k, v in asdict(cfg).items())})"


def variant_calls(variant: str, cfg: Any, x: torch.Tensor, d: dict[str, Any]) -> list[Any]:
    """One call per weight copy (rotated past L2)."""
    if variant == "cublas":
        return [partial(F.linear, x, w) for w in d["bf16"]]
    if variant == "bf16_dot":
        return [
            partial(bf16_matmul, x, w, c, cfg=cfg) for w, c in zip(d["bf16"], d["cnt"], strict=True)
        ]
    if variant == "bf16_gemv":
        return [
            partial(bf16_gemv, x, w, c, cfg=cfg) for w, c in zip(d["bf16"], d["cnt"], strict=True)
        ]
    if variant == "v2":
        return [
            partial(w12_matmul, x, t, c, cfg=cfg) for t, c in zip(d["v2"], d["cnt"], strict=True)
        ]
    if variant == "v3_gemv":
        return [partial(w12_gemv, x, t, c, cfg=cfg) for t, c in zip(d["v3"], d["cnt"], strict=True)]
    return [partial(w12_matmul, x, t, c, cfg=cfg) for t, c in zip(d["v3"], d["cnt"], strict=True)]


def configs(variant: str, m: int, tiny: bool) -> tuple[Any, ...]:
    if variant == "cublas":
        return (None,)
    if variant in ("bf16_gemv", "v3_gemv"):
        return () if m > 4 else (TINY["gemv"] if tiny else GEMV_SWEEP)
    if variant == "v2":
        return (TINY["dot"][0],) if tiny else V2_SWEEP["m1" if m == 1 else "m16"]
    return TINY["dot"] if tiny else DOT_SWEEP


def check(variant: str, cfg: Any, x: torch.Tensor, d: dict[str, Any]) -> dict[str, Any]:
    """Error ratio against fp64, and PTX == plain-op decode for the W12 variants."""
    y = variant_calls(variant, cfg, x, d)[0]()
    out: dict[str, Any] = {"err_over_bound": kb.error_ratio(y, x, d["bf16"][0])}
    if variant == "v3_gemv":
        out["ptx_equals_ops"] = bool(torch.equal(y, w12_gemv(x, d["v3"][0], d["cnt"][0], cfg=cfg, ptx=False)))  # fmt: skip
    elif variant in ("v2", "v3_dot"):
        t = d["v2" if variant == "v2" else "v3"][0]
        out["ptx_equals_ops"] = bool(torch.equal(y, w12_matmul(x, t, d["cnt"][0], cfg=cfg, prmt=False)))  # fmt: skip
    return out


def bench_shape(n: int, k: int, dev: torch.device, args: argparse.Namespace, copy_bw: float,
                deadline: float) -> dict[str, Any]:  # fmt: skip
    copies = kb.rotated_copies(n, k, dev)
    d: dict[str, Any] = {"bf16": kb.seeded_weights(n, k, copies, dev), "v2": [], "v3": []}
    d["cnt"] = [counter_buffer(n, dev) for _ in range(copies)]
    for w in d["bf16"]:
        for layout in ("v2", "v3"):
            t = encode(w, layout)
            if not torch.equal(decode(t).view(torch.int16), w.view(torch.int16)):
                raise RuntimeError(f"{layout} round trip is not bit-exact at {n}x{k}")
            d[layout].append(t)
    t0 = d["v3"][0]
    out: dict[str, Any] = {"N": n, "K": k, "copies": copies, "bits_per_weight": t0.bits_per_weight(),
                           "escapes": t0.num_escapes, "rows": {}}  # fmt: skip
    gen = torch.Generator(device=dev)
    for m in args.ms:
        gen.manual_seed(7 + m)
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        w12_bytes = t0.stream_bytes() + 8 * t0.num_escapes
        act = 2 * m * k + 2 * m * n

        def calls(v: str, cfg: Any, x: torch.Tensor = x) -> list[Any]:
            return variant_calls(v, cfg, x, d)

        row: dict[str, Any] = {}
        best: dict[str, Any] = {}
        for variant in BF16_VARIANTS + W12_VARIANTS:
            cfgs = configs(variant, m, args.tiny)
            times, errors = kb.sweep(calls, variant, cfgs, dev, args.reps, deadline)
            if not times:
                if errors:
                    row[variant] = {"error": "; ".join(errors)[:1500]}
                continue
            best[variant] = cfg = min(times, key=times.__getitem__)
            sweep_us = {cfg_key(c) if c else "F.linear": 1e6 * t for c, t in times.items()}
            row[variant] = {"config": asdict(cfg) if cfg else None, "sweep_us": sweep_us,
                            "config_errors": errors}  # fmt: skip
            try:
                row[variant] |= check(variant, cfg, x, d)
            except Exception as e:
                row[variant]["check_error"] = f"{type(e).__name__}: {e}"[:400]
        for v, ts in kb.best_rounds(calls, best, dev, args.rounds, args.reps).items():
            nbytes = (w12_bytes if v in W12_VARIANTS else 2 * n * k) + act
            row[v] |= kb.us_stats(ts, nbytes, copy_bw)
            row[v]["TBps"] = nbytes / (row[v]["us"] * 1e-6) / 1e12
        out["rows"][str(m)] = row
    return out


def summarize(shapes: dict[str, Any], ms: tuple[int, ...], copy_bw: float) -> dict[str, Any]:
    """Layer totals per M, the ratio W12/bf16 against the better bf16 kernel, the best v3 table."""
    summ: dict[str, Any] = {}
    for m in ms:
        rows = [s["rows"][str(m)] for s in shapes.values()]
        tot = kb.layer_totals(rows, BF16_VARIANTS + W12_VARIANTS)
        e: dict[str, Any] = {"layer_us": tot}
        bf = {v: t for v, t in tot.items() if v in BF16_VARIANTS}
        w12 = {v: t for v, t in tot.items() if v in ("v3_gemv", "v3_dot")}
        if bf and w12:
            bb, bw = min(bf, key=lambda v: bf[v]), min(w12, key=lambda v: w12[v])
            e |= {"best_bf16": bb, "best_w12": bw, "speedup": bf[bb] / w12[bw],
                  "speedup_vs": {v: t / w12[bw] for v, t in bf.items()}}  # fmt: skip
            if "v2" in tot:
                e["v3_over_v2"] = tot["v2"] / w12[bw]
            # the config of the table: the swept config with the lowest sum over the shapes
            sweeps = [r[bw]["sweep_us"] for r in rows]
            key = kb.best_common(sweeps)
            if key is not None:
                byts = sum((s["N"] * s["K"] * 1.5 + 2 * m * (s["N"] + s["K"])) for s in shapes.values())  # fmt: skip
                e["table"] = {"kernel": "gemv" if bw == "v3_gemv" else "dot", "config": key,
                              "roofline_frac": byts / (1e-6 * sum(s[key] for s in sweeps)) / copy_bw}  # fmt: skip
        summ[str(m)] = e
    return summ


def e2e(dev: torch.device, kernel: dict[str, Any], tiny: bool) -> dict[str, Any]:
    """Forward times of the engine (CUDA graphs) at widths 1 and 16, stock vs W12."""
    target = build_target("tiny-llama" if tiny else "llama3-8b", dev, torch.bfloat16, max_positions=2048)  # fmt: skip
    prompt = random_prompts(target.cfg.vocab_size, 8 if tiny else 64)[0]
    iters = 1 if tiny else 20

    def engine() -> Any:
        eng = _verify_engine(target, prompt, 16)
        if tiny and dev.type == "cpu":  # interpreted: the small Triton ops are tested elsewhere
            eng.fwd._k = None
        return eng

    reps = 1 if tiny else 3
    stock = {w: engine().time_forward(w, iters, reps) for w in (1, 16)}
    stats = install_w12(target, layers="all", max_m=64)
    w12 = {w: engine().time_forward(w, iters, reps) for w in (1, 16)}
    out: dict[str, Any] = {"bits_per_weight": stats["bits_per_weight"], "widths": {}}
    for w in (1, 16):
        row = kernel.get(str(w), {}).get("layer_us", {})
        pred = None
        if "cublas" in row and "best_w12" in kernel.get(str(w), {}):
            saving = (
                target.cfg.num_layers * (row["cublas"] - row[kernel[str(w)]["best_w12"]]) * 1e-6
            )
            pred = stock[w] - saving
        eff = kernel.get(str(w), {}).get("table", {}).get("roofline_frac")
        cm = None
        if eff and "cublas" in row and not tiny:  # the cost model at the measured efficiency
            cub = [kernel["_shapes"][s]["rows"][str(w)]["cublas"]["us"] * 1e-6 for s in LLAMA3_8B]
            cm = predicted_w12_forward_s(stock[w], target.cfg.num_layers, LLAMA3_8B.values(), w,
                                         cub, kernel["_copy_bw"], eff)  # fmt: skip
        out["widths"][str(w)] = {"costmodel_w12_ms": None if cm is None else 1e3 * cm,
                                 "stock_ms": 1e3 * stock[w], "w12_ms": 1e3 * w12[w],
                                 "speedup": stock[w] / w12[w],
                                 "predicted_w12_ms": None if pred is None else 1e3 * pred,
                                 "predicted_speedup": None if pred is None else stock[w] / pred}  # fmt: skip
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"W12 v3  {res['device']}  copy {res['copy_TBps']:.2f} TB/s  commit {res['commit']}  {res['date']}",
             f"{'shape':>8} {'M':>3} " + " ".join(f"{v:>9}" for v in BF16_VARIANTS + W12_VARIANTS)
             + "   roof% (v3 best)  err/bd  ptx=ops"]  # fmt: skip
    for sname, s in res["shapes"].items():
        if "error" in s:
            lines.append(f"{sname:>8} ERROR {s['error'][:120]}")
            continue
        for m, row in s["rows"].items():
            us = [f"{row[v]['us']:9.1f}" if "us" in row.get(v, {}) else f"{'-':>9}" for v in BF16_VARIANTS + W12_VARIANTS]  # fmt: skip
            v3 = [row[v] for v in ("v3_gemv", "v3_dot") if "us" in row.get(v, {})]
            b = min(v3, key=lambda r: r["us"]) if v3 else {}
            errs = [row[v].get("err_over_bound", 0.0) for v in row if isinstance(row[v], dict)]
            same = all(row[v].get("ptx_equals_ops", True) for v in row if isinstance(row[v], dict))
            lines.append(f"{sname:>8} {m:>3} {' '.join(us)}   {100 * b.get('roofline_frac', float('nan')):6.1f}"
                         f"          {max(errs):6.3f}  {'yes' if same else 'NO'}")  # fmt: skip
    lines.append("layer totals (4 shapes): W12 v3 best vs the better bf16 kernel")
    for m, e in res.get("summary", {}).items():
        if "speedup" in e:
            vs = "  ".join(f"vs {v} x{r:.3f}" for v, r in e["speedup_vs"].items())
            lines.append(f"  M={m:>2}  {e['best_w12']} {e['layer_us'][e['best_w12']]:.1f} us  x{e['speedup']:.3f} vs {e['best_bf16']}"
                         f"  ({vs}; v3/v2 x{e.get('v3_over_v2', float('nan')):.2f})")  # fmt: skip
    lines.append("proposed kernels/w12_linear.py CHOSEN (best v3 config per M by layer total):")
    for m, e in res.get("summary", {}).items():
        if "table" in e:
            t = e["table"]
            lines.append(
                f"  M<={m:>2}: {t['kernel']:4s} {t['config']}  roofline_frac={t['roofline_frac']:.3f}"
            )
    for w, r in res.get("e2e", {}).get("widths", {}).items():
        p = r["predicted_speedup"]
        cm = r["costmodel_w12_ms"]
        cm_s = f"  cost model {r['stock_ms'] / cm:.3f}x" if cm else ""
        lines.append(f"e2e forward width {w:>2}: stock {r['stock_ms']:.3f} ms  W12 {r['w12_ms']:.3f} ms  "
                     f"x{r['speedup']:.3f}  predicted (kernel times) x{p:.3f}{cm_s}" if p else f"e2e width {w}: x{r['speedup']:.3f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    args, dev, copy_bw = kb.kernel_bench_setup(__doc__, 110.0)
    shapes = {"a": (32, 128)} if args.tiny else LLAMA3_8B
    args.ms = (1, 3) if args.tiny else MS
    res = {**kb.kernel_header(dev, copy_bw), "ms": list(args.ms), "shapes": {}}
    path = args.out / "w12_gpu.json"
    deadline = started + args.budget_s

    def bench(_name: str, n: int, k: int) -> dict[str, Any]:
        return bench_shape(n, k, dev, args, copy_bw, deadline)

    kb.per_matrix(
        res, "shapes", shapes, bench, lambda ok: summarize(ok, args.ms, copy_bw), path, dev
    )
    if not args.no_e2e:
        res["e2e"] = guarded(
            lambda: e2e(
                dev, {**res["summary"], "_shapes": res["shapes"], "_copy_bw": copy_bw}, args.tiny
            ),
            2000,
        )
    finish(res, path, started, table)


if __name__ == "__main__":
    main()
