"""Fused decode GEMVs on the H200: per-matrix kernels at M = 1, 2, 4, then the engine's AR step.

1. Correctness first, per matrix and M: the fused prologue read back through an identity weight
   against the torch reference (``rms_norm_ref`` / ``silu_mul_ref``: bf16 ulps, expected 0, at
   most 1 at a few values), the fused output against the fp64 product of that prologue's output
   (+ residual; bound: half a bf16 ulp + K·2^-23·Σ|x||w|; ``err/bd`` must be <= 1), and against
   the engine's unfused cuBLAS path (max difference over max |y|: summation order only; on the
   CPU the interpreter's non-RNE bf16 cast in the unfused Triton kernels makes it larger).
2. Kernel timings, CUDA graphs of many calls with weight copies rotated past the 50 MB L2, for
   the 8B matrices (qkv 6144×4096 after input_norm, o 4096×4096 + residual, gate_up 28672×4096
   after post_attn_norm, down 4096×14336 with SiLU·mul + residual): ``cublas`` (what the engine
   runs now: Triton RMSNorm / SiLU·mul kernels, F.linear or addmm), ``gemv`` (the same separate
   kernels around the bf16 Triton GEMV: the GEMV's own share) and ``fused`` (one launch). The
   fused variant sweeps a few tilings first (``gemv`` runs the first); then the best of each runs in ``--rounds``
   interleaved rounds: medians with min-max spread; bandwidth fraction against a device copy
   measured in the same run (``roof%``: weight + activation bytes / time / copy bandwidth).
3. Engine (``--no-e2e`` skips): a seeded Llama-3-8B-shaped bf16 target; 32 greedy tokens with and
   without the mechanism (``matrices=all, max_m=4``, the best M = 1 tiling of step 2), token
   forcing of the fused engine's tokens against the stock forward (mismatches must be 0), then
   the CUDA-graph forward at widths 1, 2, 4 (AR step and verifies of 1 and 3 drafts), stock and
   fused interleaved, beside two predictions: from step 2's kernel medians, ``stock − layers ·
   Σ_m (t_cublas − t_fused)``, and from the cost model (``mechanisms/fused_gemv_cost.py``, the
   GPU_PATH per-kernel costs and step 2's measured bandwidth fractions). Unless ``--no-w12``, also
   W12 on qkv + gate_up (``w12 layers=gate_up_qkv max_m=1``, its M = 1 choice) alone and with the
   fused GEMVs (qkv and gate_up then fused in the W12 GEMV), each token-forced: which wins.

JSON to ``--out/fused_gemv_gpu.json`` (rewritten after every matrix); the short table is last.

GPU:  ``PYTHONPATH=src python3 bench/fused_gemv_gpu.py --out DIR``        (about 2-3 min, H200)
CPU:  ``PYTHONPATH=src python3 bench/fused_gemv_gpu.py --out DIR --tiny`` (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench.kernel_bench import error_ratio, kernel_bench_setup, time_calls
from specpilot.bench.records import git_rev
from specpilot.bench.script import finish, guarded
from specpilot.kernels import decode_triton, reference
from specpilot.kernels.fused_gemv import norm_gemv, residual_gemv, silu_gemv
from specpilot.kernels.gemm_common import counter_buffer
from specpilot.kernels.w12_gemv import GemvConfig, bf16_gemv

MATRICES = {
    "w_qkv": (6144, 4096),
    "w_o": (4096, 4096),
    "w_gate_up": (28672, 4096),
    "w_down": (4096, 14336),
}
TINY_MATRICES = {"w_qkv": (128, 64), "w_o": (64, 64), "w_gate_up": (192, 64), "w_down": (64, 96)}
MS = (1, 2, 4)
VARIANTS = ("cublas", "gemv", "fused")
SWEEP = (
    GemvConfig(block_n=32, block_k=512, num_warps=4),  # W12's M <= 2 GEMV tiling (w12_linear)
    GemvConfig(block_n=64, block_k=512, num_warps=4),
    GemvConfig(block_n=32, block_k=1024, num_warps=8),
)
"""Tilings the fused variant sweeps (each a Triton compile per M and matrix: kept few so the
script stays within 3 minutes); the ``gemv`` variant runs the first only."""
TINY_SWEEP = (GemvConfig(block_n=32, block_k=64), GemvConfig(block_n=16, block_k=64, split_k=2))
ROTATE_BYTES = 400 << 20
EPS = 1e-5
NORMED = ("w_qkv", "w_gate_up")


def cfg_key(cfg: GemvConfig) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


def make_inputs(name: str, n: int, k: int, m: int, dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(11 + m + n)
    out = {"res": torch.randn(m, n, generator=g, device=dev).to(torch.bfloat16)}
    if name in NORMED:
        out["x"] = (3 * torch.randn(m, k, generator=g, device=dev)).to(torch.bfloat16)
        out["nw"] = (1 + 0.2 * torch.randn(k, generator=g, device=dev)).to(torch.bfloat16)
    elif name == "w_down":
        out["x"] = (2 * torch.randn(m, 2 * k, generator=g, device=dev)).to(torch.bfloat16)
    else:
        out["x"] = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    return out


def call(variant: str, name: str, w: torch.Tensor, c: torch.Tensor, inp: dict[str, torch.Tensor],
         cfg: GemvConfig | None) -> Any:  # fmt: skip
    """One zero-argument call of ``variant`` on matrix ``name`` (what the layer body runs)."""
    x, res = inp["x"], inp["res"]
    if variant == "fused":
        assert cfg is not None
        if name in NORMED:
            return lambda: norm_gemv(x, inp["nw"], EPS, w, c, cfg=cfg)
        if name == "w_down":
            return lambda: silu_gemv(x, w, c, residual=res, cfg=cfg)
        return lambda: residual_gemv(x, w, c, res, cfg=cfg)

    def mm(a: torch.Tensor, add: bool) -> torch.Tensor:
        if variant == "cublas":
            return torch.addmm(res, a, w.t()) if add else F.linear(a, w)
        y = bf16_gemv(a, w, c, cfg=cfg)
        return res + y if add else y

    if name in NORMED:
        return lambda: mm(decode_triton.rms_norm(x, inp["nw"], EPS), False)
    if name == "w_down":
        return lambda: mm(decode_triton.silu_mul(x), True)
    return lambda: mm(x, True)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    def key(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((key(a) - key(b)).abs().max())


def check(name: str, w: torch.Tensor, inp: dict[str, torch.Tensor], cfg: GemvConfig) -> dict[str, Any]:  # fmt: skip
    """The prologue through an identity weight vs the torch reference; the fused output vs fp64
    of that prologue's output and vs the unfused cuBLAS path."""
    x, dev = inp["x"], inp["x"].device
    k = w.shape[1]
    out: dict[str, Any] = {}
    if name in NORMED or name == "w_down":
        eye = torch.eye(k, dtype=torch.bfloat16, device=dev)
        ce = counter_buffer(k, dev)
        if name in NORMED:
            pro = norm_gemv(x, inp["nw"], EPS, eye, ce, cfg=cfg)
            ref = reference.rms_norm_ref(x, inp["nw"], EPS)
        else:
            pro = silu_gemv(x, eye, ce, cfg=cfg)
            ref = reference.silu_mul_ref(x)
        out["prologue_max_ulps"] = ulps(pro, ref)
        out["prologue_frac_diff"] = float((pro != ref).float().mean())
        del eye
    else:
        pro = x
    add = inp["res"] if name not in NORMED else None
    y = call("fused", name, w, counter_buffer(w.shape[0], dev), inp, cfg)()
    out["err_over_bound"] = error_ratio(y, pro, w, add)
    y_c = call("cublas", name, w, counter_buffer(w.shape[0], dev), inp, None)()
    # relative to the output's scale (ulps are meaningless at values near 0)
    out["rel_diff_vs_cublas"] = float(
        (y.float() - y_c.float()).abs().max() / y_c.float().abs().max()
    )
    out["frac_equal_vs_cublas"] = float((y == y_c).float().mean())
    return out


def bench_matrix(name: str, n: int, k: int, dev: torch.device, args: argparse.Namespace,
                 copy_bw: float, deadline: float) -> dict[str, Any]:  # fmt: skip
    cuda = dev.type == "cuda"
    copies = max(2, min(16, math.ceil(ROTATE_BYTES / (2 * n * k)))) if cuda else 1
    gen = torch.Generator(device=dev)
    ws, cs = [], []
    for i in range(copies):
        gen.manual_seed(1000 * i + n + k)
        ws.append((0.02 * torch.randn(n, k, generator=gen, device=dev)).to(torch.bfloat16))
        cs.append(counter_buffer(n, dev))
    out: dict[str, Any] = {"N": n, "K": k, "copies": copies, "rows": {}}
    sweep_cfgs = TINY_SWEEP if args.tiny else SWEEP
    for m in args.ms:
        inp = make_inputs(name, n, k, m, dev)
        act = 2 * (inp["x"].numel() + 2 * m * n)  # x (+ gate_up) in, residual in, y out
        row: dict[str, Any] = {"check": check(name, ws[0], inp, sweep_cfgs[0])}
        best: dict[str, tuple[GemvConfig | None, float]] = {}
        for variant in VARIANTS:
            sweep: dict[str, float] = {}
            cfgs = {"cublas": (None,), "gemv": sweep_cfgs[:1]}.get(variant, sweep_cfgs)
            for cfg in cfgs:
                if sweep and time.perf_counter() > deadline:
                    break
                try:
                    calls = [call(variant, name, w, c, inp, cfg) for w, c in zip(ws, cs, strict=True)]  # fmt: skip
                    t = time_calls(calls, dev, args.reps)
                except Exception as e:
                    row.setdefault("errors", []).append(f"{variant} {cfg}: {type(e).__name__}: {e}"[:300])  # fmt: skip
                    continue
                sweep["cuBLAS" if cfg is None else cfg_key(cfg)] = 1e6 * t
                if variant not in best or t < best[variant][1]:
                    best[variant] = (cfg, t)
            row[variant] = {"sweep_us": sweep, "config": None if best.get(variant, (None,))[0] is None
                            else asdict(best[variant][0])}  # fmt: skip
        rounds: dict[str, list[float]] = {v: [] for v in best}
        for _ in range(args.rounds):  # interleaved: every variant once per round
            for v, (cfg, _t) in best.items():
                calls = [call(v, name, w, c, inp, cfg) for w, c in zip(ws, cs, strict=True)]
                rounds[v].append(time_calls(calls, dev, args.reps))
        for v, ts in rounds.items():
            med = statistics.median(ts)
            row[v] |= {"us": 1e6 * med, "us_min": 1e6 * min(ts), "us_max": 1e6 * max(ts),
                       "roofline_frac": (2 * n * k + act) / med / copy_bw}  # fmt: skip
        out["rows"][str(m)] = row
    return out


def summarize(mats: dict[str, Any], ms: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        rows = {name: s["rows"][str(m)] for name, s in mats.items()}
        tot = {v: sum(r[v]["us"] for r in rows.values()) for v in VARIANTS
               if all("us" in r.get(v, {}) for r in rows.values())}  # fmt: skip
        e: dict[str, Any] = {"layer_us": tot}
        if "cublas" in tot and "fused" in tot:
            e["fused_speedup_vs_cublas"] = tot["cublas"] / tot["fused"]
            e["saved_us_per_layer"] = tot["cublas"] - tot["fused"]
        sweeps = [r["fused"]["sweep_us"] for r in rows.values() if "fused" in r]
        common = set.intersection(*(set(s) for s in sweeps)) if sweeps else set()
        if common:
            e["best_fused_config"] = min(common, key=lambda c: sum(s[c] for s in sweeps))
        out[str(m)] = e
    return out


def _checked_tokens(target: Any, prompt: list[int], n_tok: int, stock: list[int]) -> dict[str, Any]:
    """Greedy tokens of an engine built now (what is installed now), against the stock tokens
    and token-forced against the stock forward."""
    from specpilot.engine import Engine, generate
    from specpilot.forcing import force_tokens

    toks = generate(Engine(target), [prompt], n_tok)[0].tokens
    report = force_tokens(target, [("p0", prompt, toks)])
    diverge = [i for i, (a, b) in enumerate(zip(stock, toks, strict=True)) if a != b]
    return {"tokens_equal_to_stock": f"{n_tok - len(diverge)}/{n_tok}",
            "first_divergence": diverge[0] if diverge else None,
            "forcing_mismatches": report.mismatches, "forcing_near_ties": report.near_ties}  # fmt: skip


def measured_prediction(cfg: Any, kern: dict[str, Any], bw: float, w: int) -> Any:
    """The cost model's prediction for all four matrices fused at ``w`` rows, fed the measured
    kernel times of step 2: cuBLAS's GEMV alone (its timing less the kernels fusing removes) and
    the fused kernel (whose time already holds its prologue's reads)."""
    from specpilot.mechanisms.fused_gemv_cost import gemv_alone_eff, matrix_bytes, predict

    rows = {m: kern[m]["rows"][str(w)] for m in MATRICES}
    cub = {m: gemv_alone_eff(cfg, m, r["cublas"]["us"] * 1e-6, bw) for m, r in rows.items()}
    fus = {m: matrix_bytes(cfg, m) / bw / (r["fused"]["us"] * 1e-6) for m, r in rows.items()}
    return predict(cfg, bw, "all", rows=w, cublas_eff=cub, fused_eff=fus, l2_Bps=float("inf"))


def e2e(dev: torch.device, res: dict[str, Any], tiny: bool, rounds: int, w12: bool) -> dict[str, Any]:  # fmt: skip
    """Tokens and token forcing with the mechanism, then forward times: stock, fused, and with
    ``w12`` also W12 on qkv + gate_up (its M = 1 choice) alone and with the fused GEMVs."""
    from specpilot.bench.gpu_suite import _verify_engine
    from specpilot.engine import Engine, generate
    from specpilot.mechanisms.fused_gemv import install
    from specpilot.mechanisms.w12 import install as install_w12
    from specpilot.synthetic import build_target

    target = build_target("tiny-llama" if tiny else "llama3-8b", dev, torch.bfloat16, max_positions=2048)  # fmt: skip
    cfg = target.cfg
    rng = random.Random(0)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(64)]
    widths, iters, n_tok = (1, 2) if tiny else (1, 2, 4), 1 if tiny else 20, 4 if tiny else 32
    engines: dict[str, Any] = {}

    def capture(label: str) -> None:  # an engine whose graphs hold what is installed now
        engines[label] = _verify_engine(target, prompt, 4)
        for w in widths:
            engines[label].time_forward(w, 1)

    capture("stock")
    stock_tokens = generate(Engine(target), [prompt], n_tok)[0].tokens
    best = res.get("summary", {}).get("1", {}).get("best_fused_config")
    knobs = dict(kv.split("=") for kv in best.split(",")) if best else {}
    gemv = {k: int(knobs[k]) for k in ("block_n", "block_k", "num_warps") if k in knobs}
    if tiny:
        gemv = {"block_n": 32, "block_k": 64}
    fused = install(target, "all", max_m=4, **gemv)
    capture("fused")
    out: dict[str, Any] = {"knobs": {"matrices": "all", "max_m": 4, **gemv}, "checks": {},
                           "widths": {}}  # fmt: skip
    out["checks"]["fused"] = _checked_tokens(target, prompt, n_tok, stock_tokens)
    out["fused_calls"] = sum(f.calls for f in fused)
    if w12:
        install_w12(target, layers="gate_up_qkv", max_m=1)
        capture("w12+fused")
        out["checks"]["w12+fused"] = _checked_tokens(target, prompt, n_tok, stock_tokens)
        out["w12_fused_calls"] = sum(f.w12_calls for f in fused)
        for layer in target.layers:
            layer.fused_steps = None
        capture("w12")
        out["checks"]["w12"] = _checked_tokens(target, prompt, n_tok, stock_tokens)
        for layer, f in zip(target.layers, fused, strict=True):
            layer.fused_steps = f
    times: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in engines}
    for _ in range(rounds):  # interleaved: every engine and width once per round
        for label, eng in engines.items():
            for w in widths:
                times[label][w].append(eng.time_forward(w, iters))
    kern = res.get("matrices", {})
    for w in widths:
        st = statistics.median(times["stock"][w])
        row: dict[str, Any] = {}
        for label, ts in times.items():
            med = statistics.median(ts[w])
            row[label] = {"ms": 1e3 * med, "spread_ms": [1e3 * min(ts[w]), 1e3 * max(ts[w])],
                          "speedup": st / med}  # fmt: skip
        saved = res.get("summary", {}).get(str(w), {}).get("saved_us_per_layer")
        if saved is not None and not tiny:  # tiny: H200 kernel costs do not apply
            row["fused"]["predicted_ms_kernels"] = 1e3 * (st - cfg.num_layers * saved * 1e-6)
        try:
            if tiny:
                raise ValueError("the cost model's kernel costs are the H200's")
            p = measured_prediction(cfg, kern, res["copy_TBps"] * 1e12, w)
            row["fused"]["predicted_ms_costmodel"] = 1e3 * (st - p.saved_s)
            row["fused"]["costmodel_kernels_removed"] = p.kernels_removed
        except (KeyError, ValueError) as e:
            row["fused"]["costmodel_error"] = f"{type(e).__name__}: {e}"[:200]
        out["widths"][str(w)] = row
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"fused GEMV  {res['device']}  copy {res['copy_TBps']:.2f} TB/s  commit {res['commit']}  {res['date']}",
             f"{'matrix':>10} {'M':>2} " + " ".join(f"{v + ' us':>16}" for v in VARIANTS)
             + "  roof% c/g/f         x(c/f)  pro-ulp err/bd rel-vs-c"]  # fmt: skip
    for name, s in res.get("matrices", {}).items():
        if "error" in s:
            lines.append(f"{name:>10} ERROR {s['error'][:120]}")
            continue
        for m, row in s["rows"].items():
            cells = [f"{row[v]['us']:7.1f} [{row[v]['us_min']:.0f}-{row[v]['us_max']:.0f}]" if "us" in row.get(v, {}) else f"{'-':>16}" for v in VARIANTS]  # fmt: skip
            roof = "/".join(f"{100 * row[v]['roofline_frac']:.0f}" if "us" in row.get(v, {}) else "-" for v in VARIANTS)  # fmt: skip
            sp = row["cublas"]["us"] / row["fused"]["us"] if "us" in row.get("fused", {}) and "us" in row.get("cublas", {}) else float("nan")  # fmt: skip
            ch = row["check"]
            lines.append(f"{name:>10} {m:>2} {' '.join(f'{c:>16}' for c in cells)}  {roof:>16}  x{sp:.3f}  "
                         f"{ch.get('prologue_max_ulps', '-'):>5}  {ch['err_over_bound']:6.3f} {ch['rel_diff_vs_cublas']:.1e}")  # fmt: skip
    for m, e in res.get("summary", {}).items():
        if "fused_speedup_vs_cublas" in e:
            lines.append(f"  layer M={m}: cublas {e['layer_us']['cublas']:.1f} us  fused {e['layer_us']['fused']:.1f} us  "
                         f"x{e['fused_speedup_vs_cublas']:.3f}  best fused tiling {e.get('best_fused_config')}")  # fmt: skip
    e = res.get("e2e", {})
    if "error" in e:
        lines.append(f"e2e ERROR {e['error'][:200]}")
    elif e:
        lines.append(f"e2e knobs {e['knobs']}")
        for label, c in e["checks"].items():
            lines.append(f"  {label:>9}: tokens equal {c['tokens_equal_to_stock']}  forcing mismatches {c['forcing_mismatches']}  near-ties {c['forcing_near_ties']}")  # fmt: skip
        for w, r in e["widths"].items():
            cells = "  ".join(f"{k} {v['ms']:.3f} ms x{v['speedup']:.3f}" for k, v in r.items())
            pk, pc = (
                r["fused"].get("predicted_ms_kernels"),
                r["fused"].get("predicted_ms_costmodel"),
            )
            lines.append(f"  forward width {w}: {cells}  | fused predicted (kernel times) {pk if pk is None else f'{pk:.3f}'}  (cost model) {pc if pc is None else f'{pc:.3f}'}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    no_w12 = ("--no-w12", "e2e without the W12 variants (W12 alone, W12 + fused)")
    args, dev, copy_bw = kernel_bench_setup(__doc__, 60.0, [no_w12])
    mats = TINY_MATRICES if args.tiny else MATRICES
    args.ms = (1, 3) if args.tiny else MS
    import triton

    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
        "commit": git_rev(), "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": copy_bw / 1e12,
        "ms": list(args.ms), "matrices": {},
        "notes": "seeded bf16 weights N(0, 0.02); CUDA graphs, weight copies rotated past L2; "
        "medians of interleaved rounds of each variant's best swept tiling; roof% = (weight + "
        "activation bytes) / time / copy bandwidth (2 GiB device copy, read + write)",
    }  # fmt: skip
    path = args.out / "fused_gemv_gpu.json"
    deadline = started + args.budget_s
    for name, (n, k) in mats.items():
        t0 = time.perf_counter()
        res["matrices"][name] = guarded(
            lambda n=n, k=k, name=name: bench_matrix(name, n, k, dev, args, copy_bw, deadline), 2000
        )
        res["matrices"][name]["seconds"] = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ok = {s: v for s, v in res["matrices"].items() if "error" not in v}
        res["summary"] = summarize(ok, args.ms) if len(ok) == len(mats) else {}
        path.write_text(json.dumps(res, indent=1))
    if not args.no_e2e:
        res["e2e"] = guarded(lambda: e2e(dev, res, args.tiny, args.rounds, not args.no_w12), 2000)
    finish(res, path, started, table)


if __name__ == "__main__":
    main()
