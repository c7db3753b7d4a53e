"""Fused decode GEMVs on the H200: per-matrix kernels at M = 1, 2, 4, then the engine's AR step.

1. Correctness per matrix and M: the fused prologue (through an identity weight) against the
   torch reference in bf16 ulps; the output against fp64 (``err/bd`` <= 1) and the cuBLAS path.
2. Kernels on the 8B matrices (CUDA graphs, weight copies rotated past L2): ``cublas`` (what the
   engine runs), ``gemv`` (the bf16 Triton GEMV between the same kernels), ``fused`` (one launch,
   a few tilings swept); the best of each in ``--rounds`` interleaved rounds, medians and spread.
3. Engine (``--no-e2e`` skips): a seeded 8B-shaped bf16 target with ``fused-gemv`` (step 2's best
   M = 1 tiling), token-forced; forward at widths 1, 2, 4, stock and fused interleaved, beside
   predictions from step 2 and the cost model; unless ``--no-w12``, W12 alone and with it too.

JSON to ``--out/fused_gemv_gpu.json`` (rewritten after every matrix); the short table is last.
GPU:  ``PYTHONPATH=src python3 bench/fused_gemv_gpu.py --out DIR``        (about 2-3 min, H200)
CPU:  ``PYTHONPATH=src python3 bench/fused_gemv_gpu.py --out DIR --tiny`` (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench import kernel_bench as kb
from specpilot.bench.gpu_suite import _verify_engine
from specpilot.bench.layer_gemv import (
    EPS,
    MATRICES,
    NORMED,
    TINY_MATRICES,
    call,
    make_inputs,
    prologue_ref,
)
from specpilot.bench.script import finish, guarded, random_prompts
from specpilot.engine import Engine, generate
from specpilot.forcing import force_tokens
from specpilot.kernels.fused_gemv import norm_gemv, silu_gemv
from specpilot.kernels.gemm_common import counter_buffer
from specpilot.kernels.w12_gemv import GemvConfig
from specpilot.mechanisms import fused_gemv
from specpilot.mechanisms.fused_gemv_cost import gemv_alone_eff, matrix_bytes, predict
from specpilot.mechanisms.w12 import install as install_w12
from specpilot.synthetic import build_target
from specpilot.timing import spread

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


def cfg_key(cfg: GemvConfig) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


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
        else:
            pro = silu_gemv(x, eye, ce, cfg=cfg)
        ref = prologue_ref(name, inp)
        out["prologue_max_ulps"] = ulps(pro, ref)
        out["prologue_frac_diff"] = float((pro != ref).float().mean())
        del eye
    else:
        pro = x
    add = inp["res"] if name not in NORMED else None
    y = call("fused", name, w, counter_buffer(w.shape[0], dev), inp, cfg)()
    out["err_over_bound"] = kb.error_ratio(y, pro, w, add)
    y_c = call("cublas", name, w, counter_buffer(w.shape[0], dev), inp, None)()
    # relative to the output's scale (ulps are meaningless at values near 0)
    out["rel_diff_vs_cublas"] = float(
        (y.float() - y_c.float()).abs().max() / y_c.float().abs().max()
    )
    out["frac_equal_vs_cublas"] = float((y == y_c).float().mean())
    return out


def bench_matrix(name: str, n: int, k: int, dev: torch.device, args: argparse.Namespace,
                 copy_bw: float, deadline: float) -> dict[str, Any]:  # fmt: skip
    copies = kb.rotated_copies(n, k, dev)
    ws, cs = kb.seeded_weights(n, k, copies, dev), [counter_buffer(n, dev) for _ in range(copies)]
    out: dict[str, Any] = {"N": n, "K": k, "copies": copies, "rows": {}}
    sweep_cfgs = TINY_SWEEP if args.tiny else SWEEP
    for m in args.ms:
        inp = make_inputs(name, n, k, m, dev)
        act = 2 * (inp["x"].numel() + 2 * m * n)  # x (+ gate_up) in, residual in, y out

        def calls(v: str, cfg: GemvConfig | None, inp: dict[str, torch.Tensor] = inp) -> list[Any]:
            return [call(v, name, w, c, inp, cfg) for w, c in zip(ws, cs, strict=True)]

        row: dict[str, Any] = {"check": check(name, ws[0], inp, sweep_cfgs[0])}
        best: dict[str, GemvConfig | None] = {}
        for variant in VARIANTS:
            cfgs = {"cublas": (None,), "gemv": sweep_cfgs[:1]}.get(variant, sweep_cfgs)
            times, errors = kb.sweep(calls, variant, cfgs, dev, args.reps, deadline)
            if errors:
                row.setdefault("errors", []).extend(errors)
            if times:
                best[variant] = min(times, key=times.__getitem__)
            cfg = best.get(variant)
            row[variant] = {
                "sweep_us": {
                    "cuBLAS" if c is None else cfg_key(c): 1e6 * t for c, t in times.items()
                },
                "config": None if cfg is None else asdict(cfg),
            }
        for v, ts in kb.best_rounds(calls, best, dev, args.rounds, args.reps).items():
            row[v] |= kb.us_stats(ts, 2 * n * k + act, copy_bw)
        out["rows"][str(m)] = row
    return out


def summarize(mats: dict[str, Any], ms: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        rows = {name: s["rows"][str(m)] for name, s in mats.items()}
        tot = kb.layer_totals(rows.values(), VARIANTS)
        e: dict[str, Any] = {"layer_us": tot}
        if "cublas" in tot and "fused" in tot:
            e["fused_speedup_vs_cublas"] = tot["cublas"] / tot["fused"]
            e["saved_us_per_layer"] = tot["cublas"] - tot["fused"]
        best = kb.best_common([r["fused"]["sweep_us"] for r in rows.values() if "fused" in r])
        if best is not None:
            e["best_fused_config"] = best
        out[str(m)] = e
    return out


def _checked_tokens(target: Any, prompt: list[int], n_tok: int, stock: list[int]) -> dict[str, Any]:
    """Greedy tokens of an engine built now (what is installed now), against the stock tokens
    and token-forced against the stock forward."""
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
    rows = {m: kern[m]["rows"][str(w)] for m in MATRICES}
    cub = {m: gemv_alone_eff(cfg, m, r["cublas"]["us"] * 1e-6, bw) for m, r in rows.items()}
    fus = {m: matrix_bytes(cfg, m) / bw / (r["fused"]["us"] * 1e-6) for m, r in rows.items()}
    return predict(cfg, bw, "all", rows=w, cublas_eff=cub, fused_eff=fus, l2_Bps=float("inf"))


def e2e(dev: torch.device, res: dict[str, Any], tiny: bool, rounds: int, w12: bool) -> dict[str, Any]:  # fmt: skip
    """Tokens and token forcing with the mechanism, then forward times: stock, fused, and with
    ``w12`` also W12 on qkv + gate_up (its M = 1 choice) alone and with the fused GEMVs."""
    target = build_target("tiny-llama" if tiny else "llama3-8b", dev, torch.bfloat16, max_positions=2048)  # fmt: skip
    cfg = target.cfg
    prompt = random_prompts(cfg.vocab_size, 64)[0]
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
    fused = fused_gemv.install(target, "all", max_m=4, **gemv)
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
        st = spread(times["stock"][w])["median"]
        row: dict[str, Any] = {}
        for label, ts in times.items():
            t = spread(ts[w])
            row[label] = {"ms": 1e3 * t["median"], "spread_ms": [1e3 * t["lo"], 1e3 * t["hi"]]}
            row[label]["speedup"] = st / t["median"]
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
    args, dev, copy_bw = kb.kernel_bench_setup(__doc__, 60.0, [no_w12])
    mats = TINY_MATRICES if args.tiny else MATRICES
    args.ms = (1, 3) if args.tiny else MS
    res = {**kb.kernel_header(dev, copy_bw), "ms": list(args.ms), "matrices": {}}
    path = args.out / "fused_gemv_gpu.json"
    deadline = started + args.budget_s
    bench = partial(bench_matrix, dev=dev, args=args, copy_bw=copy_bw, deadline=deadline)
    kb.per_matrix(res, "matrices", mats, bench, lambda ok: summarize(ok, args.ms), path, dev)
    if not args.no_e2e:
        res["e2e"] = guarded(lambda: e2e(dev, res, args.tiny, args.rounds, not args.no_w12), 2000)
    finish(res, path, started, table)


if __name__ == "__main__":
    main()
