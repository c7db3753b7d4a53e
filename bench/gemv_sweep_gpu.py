"""Decode-GEMV tilings on the H200: the tiling that streams each Llama-3-8B matrix fastest.

``fused-gemv`` lost (docs/BENCHMARKS.md, fifth session) because the Triton GEMV streamed gate_up
and down below cuBLAS with the three tilings swept then, and W12's M <= 2 GEMV runs one tiling for
every shape. This script sweeps a grid (block_n × block_k × warps × stages × split-K) for:

* ``gemv``: the bf16 GEMV alone (``bf16_gemv``);
* ``fused``: the launch ``fused-gemv`` runs (RMSNorm prologue for qkv and gate_up, residual
  epilogue for o, SiLU·mul prologue + residual for down);
* ``w12``: the W12 v3 GEMV alone; ``w12f``: the W12 GEMV fused as ``fused`` is (the top ``w12``
  tilings only),

against ``cublas`` (``F.linear`` alone) and ``stock`` (what the engine runs around that matrix
today: the separate RMSNorm / SiLU·mul Triton kernels, ``F.linear`` or ``addmm``).

1. Every tiling is compiled first in ``--workers`` processes (Triton's disk cache), so the
   sweep's time is timing, not compiling.
2. Sweep: one CUDA-graph timing per tiling, weight copies rotated past the 50 MB L2; M = 1 over
   the whole grid, M = 2 and 4 over the ``--top`` tilings of M = 1 per kernel and matrix.
3. Check: each kernel's best tiling against the fp64 product (``err/bd`` <= 1; ``fused`` and
   ``w12f`` against their prologue's output, as ``fused_gemv_gpu.check``).
4. Rounds: ``stock``, ``cublas`` and each kernel's best tiling, ``--rounds`` interleaved rounds:
   medians with min-max spread; roofline fraction over a device copy measured in the same run.
5. Summary per M and kernel: the layer total with per-matrix best tilings against ``stock``,
   and the per-matrix tables to put in the source.

GPU:  ``PYTHONPATH=src python3 bench/gemv_sweep_gpu.py --out DIR``        (about 5-8 min)
CPU:  ``PYTHONPATH=src python3 bench/gemv_sweep_gpu.py --out DIR --tiny`` (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import itertools
import json
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from multiprocessing import get_context
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specpilot.bench import kernel_bench as kb
from specpilot.bench import layer_gemv
from specpilot.bench.script import guarded
from specpilot.kernels.gemm_common import counter_buffer
from specpilot.kernels.w12_gemv import GemvConfig, bf16_gemv, fits_registers, w12_gemv
from specpilot.mechanisms.w12_format import decode, encode

KERNELS = ("gemv", "fused", "w12", "w12f")
SPLITS = (0, 1, 2, 4, 8)


def grid(tiny: bool) -> list[GemvConfig]:
    """Every M = 1 tiling: block_n × block_k × warps × stages × split (0: the auto rule)."""
    if tiny:
        return [GemvConfig(block_n=16, block_k=64), GemvConfig(block_n=32, block_k=64, split_k=2)]
    return [
        GemvConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=st, split_k=sp)
        for bn, bk, nw, st, sp in itertools.product(
            (16, 32, 64), (256, 512, 1024), (2, 4, 8), (1, 2), SPLITS
        )
        if fits_registers(bn, bk, nw)  # the others spill (w12_gemv.MAX_TILE_PER_THREAD)
    ]


def key(cfg: GemvConfig) -> str:
    return "bn{block_n}-bk{block_k}-w{num_warps}-s{num_stages}-k{split_k}".format(**asdict(cfg))


def from_key(k: str) -> GemvConfig:
    bn, bk, w, s, sp = (int(p[2:] if p[:2] in ("bn", "bk") else p[1:]) for p in k.split("-"))
    return GemvConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sp)


class Matrix:
    """One matrix's weight copies (bf16 and W12 v3), counters and inputs per M."""

    def __init__(self, name: str, n: int, k: int, dev: torch.device, copies: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.w = kb.seeded_weights(n, k, copies, dev)  # [N, K] bf16 each
        self.t: list[Any] = [encode(w, "v3") for w in self.w]  # W12Tensor each
        self.c = [counter_buffer(n, dev) for _ in self.w]
        for w, t in zip(self.w, self.t, strict=True):
            if not torch.equal(decode(t).view(torch.int16), w.view(torch.int16)):
                raise RuntimeError(f"W12 round trip is not bit-exact at {n}x{k}")
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}

    def inp(self, m: int) -> dict[str, torch.Tensor]:
        if m not in self.inputs:
            d = layer_gemv.make_inputs(self.name, self.n, self.k, m, self.w[0].device)
            d["plain"] = d["x"][:, : self.k].contiguous()  # [M, K]: what the lone GEMV reads
            self.inputs[m] = d
        return self.inputs[m]

    def calls(self, kernel: str, m: int, cfg: GemvConfig | None) -> list[Any]:
        """One zero-argument call per weight copy."""
        inp = self.inp(m)
        x = inp["plain"]
        out = []
        for w, t, c in zip(self.w, self.t, self.c, strict=True):
            if kernel == "stock":
                out.append(layer_gemv.call("cublas", self.name, w, c, inp, None))
            elif kernel == "cublas":
                out.append(lambda w=w: F.linear(x, w))
            elif kernel == "gemv":
                out.append(lambda w=w, c=c: bf16_gemv(x, w, c, cfg=cfg))
            elif kernel == "w12":
                out.append(lambda t=t, c=c: w12_gemv(x, t, c, cfg=cfg))
            else:  # fused launches on bf16 or W12 weights (fused_gemv accepts either)
                out.append(
                    layer_gemv.call("fused", self.name, w if kernel == "fused" else t, c, inp, cfg)
                )
        return out

    def stream_bytes(self, kernel: str, m: int) -> int:
        inp = self.inp(m)
        wb = self.t[0].stream_bytes() + 8 * self.t[0].num_escapes if kernel in ("w12", "w12f") else 2 * self.n * self.k  # fmt: skip
        return wb + 2 * (inp["x"].numel() + 2 * m * self.n)

    def check(self, kernel: str, m: int, cfg: GemvConfig) -> float:
        """max |y − exact| / bound against fp64 of what the kernel multiplies (its prologue's
        output for the fused kernels, plus the residual)."""
        inp = self.inp(m)
        y = self.calls(kernel, m, cfg)[0]()
        a, add = inp["plain"], None
        if kernel in ("fused", "w12f"):
            a = layer_gemv.prologue_ref(self.name, inp)
            if self.name not in layer_gemv.NORMED:
                add = inp["res"]
        return kb.error_ratio(y, a, self.w[0], add)


def _compile_tasks(tasks: list[tuple[str, str, int, str]], tiny: bool) -> list[str]:
    """Worker: run each (kernel, matrix, M, tiling) once so that Triton compiles it to disk."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mats: dict[str, Matrix] = {}
    shapes = layer_gemv.TINY_MATRICES if tiny else layer_gemv.MATRICES
    errors = []
    for kernel, name, m, k in tasks:
        if name not in mats:
            mats[name] = Matrix(name, *shapes[name], dev, 1)
        try:
            mats[name].calls(kernel, m, from_key(k))[0]()
        except Exception as e:
            errors.append(f"{kernel} {name} M={m} {k}: {type(e).__name__}: {str(e)[:200]}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return errors


def precompile(tasks: list[tuple[str, str, int, str]], workers: int, tiny: bool) -> dict[str, Any]:
    """Compile ``tasks`` in parallel processes; one compile key (kernel, tiling, M) per worker."""
    t0 = time.perf_counter()
    if workers <= 1:
        return {"errors": _compile_tasks(tasks, tiny), "s": time.perf_counter() - t0}
    shards: list[list[tuple[str, str, int, str]]] = [[] for _ in range(workers)]
    for task in tasks:
        kernel, name, m, k = task
        prologue = name if kernel in ("fused", "w12f") else ""
        h = zlib.crc32(f"{kernel}|{prologue}|{m}|{k.rsplit('-', 1)[0]}".encode()) % workers
        shards[h].append(task)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
        errs = list(ex.map(_compile_tasks, shards, [tiny] * workers))
    return {"errors": [e for es in errs for e in es][:50], "s": time.perf_counter() - t0,
            "tasks": len(tasks)}  # fmt: skip


def sweep(mats: dict[str, Matrix], plan: dict[tuple[str, str, int], list[str]],
          dev: torch.device, reps: int, deadline: float) -> dict[tuple[str, str, int], dict[str, float]]:  # fmt: skip
    """µs per call of every planned tiling (a failing one is left out)."""
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for (kernel, name, m), keys in plan.items():
        res = out.setdefault((kernel, name, m), {})
        for k in keys:
            if res and time.perf_counter() > deadline:
                break
            try:
                res[k] = 1e6 * kb.time_calls(mats[name].calls(kernel, m, from_key(k)), dev, reps)
            except Exception:
                continue
    return out


def top(res: dict[str, float], n: int) -> list[str]:
    return sorted(res, key=res.__getitem__)[:n]


def run(args: Any, dev: torch.device, copy_bw: float, started: float) -> dict[str, Any]:
    shapes = layer_gemv.TINY_MATRICES if args.tiny else layer_gemv.MATRICES
    ms = (1, 2) if args.tiny else (1, 2, 4)
    deadline = started + args.budget_s
    g = [key(c) for c in grid(args.tiny)]
    plan1 = {(kn, name, 1): g for kn in ("gemv", "fused", "w12") for name in shapes}
    res: dict[str, Any] = {"grid": len(g)}
    res["compile_m1"] = precompile([(kn, nm, m, k) for (kn, nm, m), ks in plan1.items() for k in ks], args.workers, args.tiny)  # fmt: skip

    mats = {
        name: Matrix(name, n, k, dev, kb.rotated_copies(n, k, dev))
        for name, (n, k) in shapes.items()
    }
    swept = sweep(mats, plan1, dev, args.reps, deadline)
    plan2: dict[tuple[str, str, int], list[str]] = {}
    for name in shapes:
        plan2[("w12f", name, 1)] = top(swept[("w12", name, 1)], args.top)
        for kn in ("gemv", "fused", "w12", "w12f"):
            src = "w12" if kn == "w12f" else kn
            for m in ms[1:]:
                plan2[(kn, name, m)] = top(swept[(src, name, 1)], args.top)
    res["compile_rest"] = precompile([(kn, nm, m, k) for (kn, nm, m), ks in plan2.items() for k in ks], args.workers, args.tiny)  # fmt: skip
    swept |= sweep(mats, plan2, dev, args.reps, deadline + 60)
    rows: dict[str, Any] = {}
    for name, mat in mats.items():
        for m in ms:
            best = {kn: top(swept.get((kn, name, m), {}), 1) for kn in KERNELS}
            contenders: dict[str, GemvConfig | None] = {"stock": None, "cublas": None}
            contenders |= {kn: from_key(b[0]) for kn, b in best.items() if b}

            def calls(v: str, cfg: GemvConfig | None, mat: Matrix = mat, m: int = m) -> list[Any]:
                return mat.calls(v, m, cfg)

            ts = kb.best_rounds(calls, contenders, dev, args.rounds, args.reps)
            row: dict[str, Any] = {}
            for v, cfg in contenders.items():
                row[v] = kb.us_stats(ts[v], mat.stream_bytes(v, m), copy_bw)
                if cfg is not None:
                    err = guarded(partial(mat.check, v, m, cfg))
                    row[v] |= {
                        "config": key(cfg),
                        "err_over_bound": err,
                        "sweep_us": swept[(v, name, m)],
                    }
            rows[f"{name}/{m}"] = row
    res["rows"] = rows
    res["summary"] = summarize(rows, list(shapes), ms)
    return res


def summarize(rows: dict[str, Any], names: list[str], ms: tuple[int, ...]) -> dict[str, Any]:
    """Per M: layer totals of each contender (per-matrix best tilings), ratios to ``stock``."""
    out: dict[str, Any] = {}
    for m in ms:
        r = [rows[f"{n}/{m}"] for n in names]
        tot = kb.layer_totals(r, r[0])
        out[str(m)] = {"layer_us": tot, "vs_stock": {v: tot["stock"] / t for v, t in tot.items()},
                       "tilings": {v: {n: rows[f"{n}/{m}"][v].get("config") for n in names} for v in KERNELS if v in tot}}  # fmt: skip
    return out


def table(res: dict[str, Any]) -> str:
    head = ("stock", "cublas", *KERNELS)
    lines = [f"decode GEMV sweep  {res['device']}  copy {res['copy_TBps']:.2f} TB/s  grid {res.get('grid')}  "
             f"commit {res['commit']}  {res['date']}",
             f"{'matrix/M':>12} " + " ".join(f"{v:>15}" for v in head) + "  (us, roof%)  max err/bd"]  # fmt: skip
    for rk, row in res.get("rows", {}).items():
        cells = [f"{row[v]['us']:7.1f} {100 * row[v]['roofline_frac']:5.1f}%  " if v in row else f"{'-':>15}" for v in head]  # fmt: skip
        errs = [row[v].get("err_over_bound") for v in row if isinstance(row[v].get("err_over_bound"), float)]  # fmt: skip
        lines.append(f"{rk:>12} {' '.join(cells)}  {max(errs, default=float('nan')):.3f}")
    for m, s in res.get("summary", {}).items():
        ratios = "  ".join(f"{v} {t:.1f} us x{s['vs_stock'][v]:.3f}" for v, t in s["layer_us"].items())  # fmt: skip
        lines.append(f"layer M={m}: {ratios}")
        for v, tl in s["tilings"].items():
            lines.append(f"   {v:>5} tilings: " + ", ".join(f"{n}={c}" for n, c in tl.items()))
    for part in ("compile_m1", "compile_rest"):
        if part in res:
            lines.append(f"{part}: {res[part].get('s', 0):.0f} s, {len(res[part].get('errors', []))} errors")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    args, dev, copy_bw = kb.kernel_bench_setup(__doc__, 420.0)
    args.workers = int(os.environ.get("SWEEP_WORKERS", "14"))
    args.top = int(os.environ.get("SWEEP_TOP", "6"))
    res = kb.kernel_header(dev, copy_bw)
    res |= guarded(lambda: run(args, dev, copy_bw, started), 3000, echo=True)
    res["wall_s"] = time.perf_counter() - started
    (args.out / "gemv_sweep_gpu.json").write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
