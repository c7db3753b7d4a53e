"""W12 GEMM against bf16 at Llama-3-8B linear shapes, M = 1..64 rows (decode and verify sizes).

For each shape (seeded random bf16 weights, N(0, 0.02)) and each M it times, with CUDA graphs and
enough weight copies in rotation that nothing is served from L2:
  * ``cublas``     torch ``F.linear`` on the bf16 weights;
  * ``bf16_tri``   the same Triton kernel as W12 reading plain bf16 (the fair baseline for the
                   decode overhead), best of a small config sweep;
  * ``w12``        the W12 kernel (PTX byte-permute decode), best of the same sweep;
  * ``w12_ops``    the W12 kernel with the plain-Triton integer decode, best config of w12 (its
                   output must equal ``w12`` bit for bit: same bits, same summation order).
It checks each kernel against the fp64 product of the decoded weights (bound: half a bf16 ulp
plus K·2^-23·Σ|x||w|), measures device copy bandwidth in the same run, reports each variant's
fraction of the copy-bandwidth roofline (weight + activation bytes / copy bandwidth), the speedup
of W12 over bf16_tri and cuBLAS, and per-layer totals (the four shapes summed). A failing variant
is reported, not fatal. JSON to ``--out/w12_gpu.json`` (rewritten after every shape); the short
table is printed last.

GPU:  ``PYTHONPATH=src python3 bench/w12_gpu.py --out DIR``            (< 2 min on an H200)
CPU:  ``PYTHONPATH=src python3 bench/w12_gpu.py --out DIR --tiny``     (TRITON_INTERPRET=1, tiny)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench.records import git_rev
from specpilot.bench.script import guarded
from specpilot.costmodel.hardware import copy_bandwidth
from specpilot.kernels.gemm_common import GemmConfig, counter_buffer
from specpilot.kernels.w12_gemm import bf16_matmul, w12_matmul
from specpilot.mechanisms.w12_format import W12Tensor, decode, encode

LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
MS = (1, 2, 4, 8, 16, 32, 64)
ROTATE_BYTES = 320 << 20
"""Weight bytes in rotation per timed variant: several times the H200's 50 MB L2."""

SWEEP: dict[str, tuple[GemmConfig, ...]] = {
    "m1": (
        GemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, use_dot=False),
        GemmConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, use_dot=False),
        GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=False),
        GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
    ),
    "m16": (
        GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
        GemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
        GemmConfig(block_n=64, block_k=512, num_warps=8, num_stages=2),
        GemmConfig(block_n=128, block_k=256, num_warps=8, num_stages=3),
        GemmConfig(block_n=32, block_k=512, num_warps=4, num_stages=3),
        GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True),
        GemmConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, w_as_a=True),
        GemmConfig(block_n=64, block_k=512, num_warps=4, num_stages=2, w_as_a=True),
    ),
    "m64": (
        GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
        GemmConfig(block_n=64, block_k=256, num_warps=8, num_stages=3),
        GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True),
    ),
}
TINY_SWEEP: dict[str, tuple[GemmConfig, ...]] = {
    "m1": (GemmConfig(block_n=16, block_k=64, use_dot=False), GemmConfig(block_n=16, block_k=64)),
    "m16": (
        GemmConfig(block_n=16, block_k=64),
        GemmConfig(block_n=32, block_k=64, split_k=2, w_as_a=True),
    ),
    "m64": (GemmConfig(block_n=32, block_k=64),),
}


def sweep_key(m: int) -> str:
    return "m1" if m == 1 else "m16" if m <= 16 else "m64"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_calls(calls: Sequence[Callable[[], Any]], dev: torch.device, reps: int) -> float:
    """Seconds per call, the calls run round-robin ``reps`` times (CUDA graph when possible)."""
    for c in calls:
        c()
    sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            for c in calls:
                c()
        return (time.perf_counter() - t0) / (reps * len(calls))
    n = reps * len(calls)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for c in calls:
                    c()
        graph.replay()
        sync(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        sync(dev)
        return start.elapsed_time(end) / 1e3 / (3 * n)
    except Exception:  # graph capture refused: plain launches (includes launch overhead)
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            for c in calls:
                c()
        end.record()
        sync(dev)
        return start.elapsed_time(end) / 1e3 / n


def kernel_bench_setup(
    doc: str | None, budget_s: float, flags: Sequence[tuple[str, str]] = ()
) -> tuple[argparse.Namespace, torch.device, float]:
    """The kernel scripts' shared arguments (``--out --tiny --budget-s --rounds --reps
    --no-e2e``, plus the script's own on/off ``flags``: (name, help)), the device (exits without
    CUDA unless ``--tiny``: the interpreter) and the copy bandwidth measured now; ``--tiny``
    takes one round of one rep."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=budget_s, help="stop sweeping after this")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=6, help="calls per copy in one timed graph")
    ap.add_argument("--no-e2e", action="store_true")
    for name, help_text in flags:
        ap.add_argument(name, action="store_true", help=help_text)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.tiny:
        sys.exit("No CUDA GPU: run with --tiny (CPU, Triton interpreter).")
    if args.tiny:
        args.rounds, args.reps = 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    nbytes = (1 << 20) if args.tiny else (2 << 30)
    return args, dev, max(copy_bandwidth(dev, nbytes) for _ in range(3))  # read + write, eager


def error_ratio(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None
) -> float:
    """max |y - (x@w^T + add)| / bound, the exact result in fp64 (≤ 1 means within the stated
    bound; ``add [M, N]``: a residual added before the one rounding)."""
    xd, wd = x.double(), w.double()
    z = xd @ wd.T  # [M, N]
    if add is not None:
        z = z + add.double()
    k = x.shape[1]
    bound = 2.0**-8 * z.abs() + k * 2.0**-23 * (xd.abs() @ wd.abs().T) + 2.0**-133
    return float(((y.double() - z).abs() / bound).max())


@dataclass(slots=True)
class ShapeData:
    ws: list[torch.Tensor]  # copies of [N, K] bf16 (ws[0] is checked)
    bf16_ws: list[torch.Tensor]  # the copies timed for bf16 variants
    w12s: list[W12Tensor]  # W12 encodings of ws[: len(w12s)]
    counters: list[torch.Tensor]  # one split-K counter buffer per copy


def bench_m(
    data: ShapeData,
    x: torch.Tensor,  # [M, K] bf16
    sweep: dict[str, tuple[GemmConfig, ...]],
    best_cfg: dict[tuple[str, str], GemmConfig],
    dev: torch.device,
    copy_bw: float,
    reps: int,
    deadline: float,
) -> dict[str, Any]:
    """All variants at one M: time, best config, error ratio, roofline fraction."""
    m, k = x.shape
    n = data.ws[0].shape[0]
    act_bytes = 2 * m * k + 2 * m * n
    row: dict[str, Any] = {}

    def record(variant: str, seconds: float, weight_bytes: float, **extra: Any) -> None:
        row[variant] = {
            "us": seconds * 1e6,
            "roofline_frac": (weight_bytes + act_bytes) / copy_bw / seconds,
            **extra,
        }

    try:
        t = time_calls([partial(F.linear, x, w) for w in data.bf16_ws], dev, reps)
        record("cublas", t, 2 * n * k)
    except Exception as e:
        row["cublas"] = {"error": f"{type(e).__name__}: {e}"}

    key = sweep_key(m)
    for variant in ("bf16_tri", "w12", "w12_ops"):
        try:
            if variant == "w12_ops":
                cfgs: tuple[GemmConfig, ...] = (best_cfg.get(("w12", key)) or sweep[key][0],)
            elif time.perf_counter() > deadline and (variant, key) in best_cfg:
                cfgs = (best_cfg[(variant, key)],)  # out of time: no more sweeping
            else:
                cfgs = sweep[key]
            results: list[tuple[float, GemmConfig]] = []
            errors: list[str] = []
            for cfg in cfgs:
                if m != 1 and not cfg.use_dot:
                    continue
                try:
                    if variant == "bf16_tri":
                        calls = [
                            partial(bf16_matmul, x, w, c, cfg=cfg)
                            for w, c in zip(data.bf16_ws, data.counters, strict=False)
                        ]
                    else:
                        calls = [
                            partial(w12_matmul, x, t, c, cfg=cfg, prmt=variant == "w12")
                            for t, c in zip(data.w12s, data.counters, strict=False)
                        ]
                    results.append((time_calls(calls, dev, reps), cfg))
                except Exception as e:
                    errors.append(f"{cfg}: {type(e).__name__}: {str(e)[:300]}")
            if not results:
                row[variant] = {"error": "; ".join(errors) or "no config ran"}
                continue
            t, cfg = min(results, key=lambda r: r[0])
            if variant != "w12_ops":
                best_cfg[(variant, key)] = cfg
            if variant == "bf16_tri":
                y = bf16_matmul(x, data.ws[0], data.counters[0], cfg=cfg)
                wbytes: float = 2 * n * k
            else:
                y = w12_matmul(x, data.w12s[0], data.counters[0], cfg=cfg, prmt=variant == "w12")
                wbytes = data.w12s[0].nbytes()
                if variant == "w12_ops" and "y" in row.get("w12", {}):
                    row["prmt_equals_ops"] = bool(torch.equal(row["w12"].pop("y"), y))
            record(
                variant,
                t,
                wbytes,
                config=asdict(cfg),
                err_over_bound=error_ratio(y, x, data.ws[0]),
                configs_tried=len(results),
                config_errors=errors,
            )
            if variant == "w12":
                row["w12"]["y"] = y  # compared with w12_ops below, then dropped
        except Exception as e:
            row[variant] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-1500:],
            }
    try:
        row["cublas_err_over_bound"] = error_ratio(F.linear(x, data.ws[0]), x, data.ws[0])
    except Exception as e:
        row["cublas_err_over_bound"] = f"{type(e).__name__}: {e}"
    row.get("w12", {}).pop("y", None)
    for base in ("bf16_tri", "cublas"):
        if "us" in row.get("w12", {}) and "us" in row.get(base, {}):
            row[f"speedup_w12_vs_{base}"] = row[base]["us"] / row["w12"]["us"]
    return row


def bench_shape(
    name: str,
    n: int,
    k: int,
    ms: tuple[int, ...],
    sweep: dict[str, tuple[GemmConfig, ...]],
    dev: torch.device,
    copy_bw: float,
    reps: int,
    deadline: float,
) -> dict[str, Any]:
    gen = torch.Generator(device=dev)
    n_copies_bf16 = (
        max(2, min(16, math.ceil(ROTATE_BYTES / (2 * n * k)))) if dev.type == "cuda" else 1
    )
    n_copies_w12 = (
        max(2, min(24, math.ceil(ROTATE_BYTES / (1.5 * n * k)))) if dev.type == "cuda" else 1
    )
    ws: list[torch.Tensor] = []
    for i in range(max(n_copies_bf16, n_copies_w12)):
        gen.manual_seed(1000 * i + n + k)
        ws.append((0.02 * torch.randn(n, k, generator=gen, device=dev)).to(torch.bfloat16))
    w12s: list[W12Tensor] = []
    for w in ws[:n_copies_w12]:
        t = encode(w)
        if not torch.equal(decode(t).view(torch.int16), w.view(torch.int16)):
            raise RuntimeError(f"{name}: W12 round trip is not bit-exact")
        w12s.append(t)
    counters = [counter_buffer(n, dev) for _ in range(max(n_copies_bf16, n_copies_w12))]
    bf16_ws = ws[:n_copies_bf16]
    w12_bits = 8.0 * w12s[0].nbytes() / (n * k)
    shape_out: dict[str, Any] = {
        "N": n,
        "K": k,
        "w12_bits_per_weight": w12_bits,
        "w12_escapes": w12s[0].num_escapes,
        "copies": {"bf16": n_copies_bf16, "w12": n_copies_w12},
        "rows": {},
    }
    best_cfg: dict[tuple[str, str], GemmConfig] = {}
    for m in ms:
        gen.manual_seed(7 + m)
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)  # [M, K]
        data = ShapeData(ws, bf16_ws, w12s, counters)
        shape_out["rows"][str(m)] = bench_m(data, x, sweep, best_cfg, dev, copy_bw, reps, deadline)
    del ws, w12s, bf16_ws
    return shape_out


def summarize(shapes: dict[str, Any], ms: tuple[int, ...]) -> dict[str, Any]:
    """Per-M layer totals (sum over the shapes) and speedups."""
    out: dict[str, Any] = {}
    for m in ms:
        tot: dict[str, float] = {}
        for variant in ("cublas", "bf16_tri", "w12", "w12_ops"):
            us = [s["rows"].get(str(m), {}).get(variant, {}).get("us") for s in shapes.values()]
            if us and all(u is not None for u in us):
                tot[variant] = float(sum(us))
        entry: dict[str, Any] = {"layer_us": tot}
        if "w12" in tot:
            for base in ("bf16_tri", "cublas"):
                if base in tot:
                    entry[f"speedup_w12_vs_{base}"] = tot[base] / tot["w12"]
        out[str(m)] = entry
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"W12 GEMM  device={result['device']}  copy={result['copy_bw_TBps']:.2f} TB/s  "
        f"commit={result['commit']}  {result['date']}",
        f"{'shape':>8} {'M':>3} {'cublas':>8} {'bf16tri':>8} {'w12':>8} {'w12ops':>8} "
        f"{'x/tri':>6} {'x/cub':>6} {'roof%':>6} {'err/bd':>7} {'=ops':>4} bits",
    ]

    def us(row: dict[str, Any], v: str) -> str:
        e = row.get(v, {})
        return f"{e['us']:8.1f}" if "us" in e else f"{'ERR':>8}"

    for sname, s in result["shapes"].items():
        if "error" in s:
            lines.append(f"{sname:>8} ERROR {s['error'][:100]}")
            continue
        for m, row in s["rows"].items():
            w = row.get("w12", {})
            sp1 = row.get("speedup_w12_vs_bf16_tri")
            sp2 = row.get("speedup_w12_vs_cublas")
            errs = [
                row.get(v, {}).get("err_over_bound", 0.0) for v in ("bf16_tri", "w12", "w12_ops")
            ]
            same = {True: "yes", False: "NO"}.get(row.get("prmt_equals_ops"), "-")
            lines.append(
                f"{sname:>8} {m:>3} {us(row, 'cublas')} {us(row, 'bf16_tri')} {us(row, 'w12')} "
                f"{us(row, 'w12_ops')} {sp1 if sp1 else float('nan'):6.3f} "
                f"{sp2 if sp2 else float('nan'):6.3f} "
                f"{100 * w.get('roofline_frac', float('nan')):6.1f} {max(errs):7.3f} {same:>4} "
                f"{s['w12_bits_per_weight']:.3f}"
            )
    lines.append("layer totals (sum over the shapes):")
    for m, e in result["summary"].items():
        sp1 = e.get("speedup_w12_vs_bf16_tri", float("nan"))
        sp2 = e.get("speedup_w12_vs_cublas", float("nan"))
        tot = e["layer_us"]
        lines.append(
            f"  M={m:>2}  w12 {tot.get('w12', float('nan')):8.1f} us  "
            f"vs bf16_tri x{sp1:.3f}  vs cublas x{sp2:.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping configs after this")
    args = ap.parse_args()
    started = time.perf_counter()
    deadline = started + args.budget_s
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        shapes = {"a": (48, 64), "b": (32, 96)}
        ms: tuple[int, ...] = (1, 3, 17)
        sweep, reps, copy_bytes = TINY_SWEEP, 1, 1 << 20
    else:
        shapes, ms, sweep, reps, copy_bytes = LLAMA3_8B, MS, SWEEP, 4, 1 << 30
    if dev.type != "cuda" and not args.tiny:
        sys.exit("No CUDA GPU: run with --tiny (CPU, Triton interpreter).")
    args.out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(dev, copy_bytes)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
        "commit": git_rev(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "copy_bw_TBps": bw / 1e12,
        "ms": list(ms),
        "shapes": {},
        "notes": "seeded N(0, 0.02) bf16 weights; CUDA-graph timing with weight copies rotated "
        "past L2; roofline = (weight + x + y bytes) / measured copy bandwidth",
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    path = args.out / "w12_gpu.json"
    for sname, (n, k) in shapes.items():
        t0 = time.perf_counter()
        result["shapes"][sname] = guarded(
            lambda sname=sname, n=n, k=k: bench_shape(
                sname, n, k, ms, sweep, dev, bw, reps, deadline
            ),
            2000,
        )
        result["shapes"].get(sname, {})["seconds"] = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ok = {s: v for s, v in result["shapes"].items() if "error" not in v}
        result["summary"] = summarize(ok, ms) if len(ok) == len(shapes) else {}
        result["wall_s"] = time.perf_counter() - started
        path.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
