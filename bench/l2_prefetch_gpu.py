"""L2 prefetch on the H200 (issue 15 item 2): does prefetching the head of the next matrix during a
small phase speed up its GEMV, and does mechanism ``l2-prefetch`` speed up AR decode?

    PYTHONPATH=src python3 bench/l2_prefetch_gpu.py --out DIR          # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/l2_prefetch_gpu.py --out DIR --tiny   # CPU smoke run (no-op)

0. ``checks``: the PTX holds each instruction; copy bandwidth; a prefetch launch in a graph.
1. ``efficacy``: prefetch X MiB of a cold matrix, sleep 50 µs, read them (a GEMV over the head
   rows), beside the cold and an L2-warm read: the fraction served from L2.
2. ``micro``: per (idle phase -> matrix) pair of Llama-3-8B, a CUDA graph of segments ``[idle
   kernels -> GEMV]`` over weight copies rotated past L2; no prefetch, and X MiB prefetched at
   the idle phase (side or same stream, bulk or line) through the mechanism's ``PhasePrefetch``.
   Outputs equal bit for bit; interleaved rounds (median, spread) beside the cost model.
3. ``e2e``: AR decode of the llama3-8b shape (random bf16 weights) through ``build_engine`` with
   ``l2-prefetch`` off and on (the best micro variant, then neighbours), interleaved rounds,
   decode tok/s after the first commit; tokens must equal.
JSON to DIR/l2_prefetch_gpu.json (rewritten after each section); a short table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.gpu_ceilings import copy_bandwidth
from specpilot.bench.l2_prefetch import pick_best, table, variants
from specpilot.bench.script import BenchScript, script_parser
from specpilot.kernels import reference
from specpilot.kernels.l2_prefetch import PrefetchSpec, launch_mode, prefetch_l2
from specpilot.mechanisms.l2_prefetch import L2Prefetch, MiB, PhasePrefetch
from specpilot.mechanisms.l2_prefetch_cost import saved_time
from specpilot.timing import interleaved_rounds, spread

ROTATE_BYTES = 320 << 20
PAIRS = {"attention->o": ("attention", 4096, 4096), "norm->gate_up": ("norm", 28672, 4096),
         "norm->qkv": ("norm", 6144, 4096)}  # fmt: skip
"""Pair → (idle phase, N, K of the matrix after it)."""
TINY_PAIRS = {"attention->o": ("attention", 128, 64), "norm->gate_up": ("norm", 256, 64)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = script_parser(__doc__, 165.0, "tiny shapes on the CPU (smoke test)")
    ap.add_argument("--mib", default="2,4,8,16,32", help="prefetch sizes of the micro grid")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default by mode)")
    ap.add_argument("--contexts", default="512,4096", help="e2e prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=0, help="e2e tokens per run")
    return ap.parse_args(argv)


class Bench(BenchScript):
    def __init__(self, args: argparse.Namespace) -> None:
        dev = torch.device("cpu" if args.tiny else "cuda")
        super().__init__(
            dev, args.out, "l2_prefetch_gpu.json", args.budget_s, launch_mode=launch_mode(dev)
        )
        self.args, self.tiny = args, args.tiny
        self.dtype = torch.float32 if self.tiny else torch.bfloat16
        self.rounds = args.rounds or (3 if self.tiny else 15)

    def rand(self, *shape: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        return 0.02 * torch.randn(*shape, device=self.dev, generator=g).to(self.dtype)

    def time_rounds(self, fns: dict[str, Callable[[], None]], per: int) -> dict[str, list[float]]:
        """Seconds per segment (``per`` segments per call) of each fn, per interleaved round."""
        return interleaved_rounds(fns, self.dev, self.rounds, per)

    def sleep(self) -> None:
        if self.cuda:
            torch.cuda._sleep(100_000)  # ~50 µs: the prefetch completes before the read

    # ------------------------------------------------------------------ 0. checks
    def checks(self) -> dict[str, Any]:
        w = self.rand(64, 1024)
        res: dict[str, Any] = {}
        for instr in ("bulk", "line"):
            handle = prefetch_l2(w, 1 << 16, PrefetchSpec(instr, 1))
            ptx = handle.asm.get("ptx", "") if handle is not None else ""
            want = "cp.async.bulk.prefetch.L2" if instr == "bulk" else "prefetch.global.L2"
            res[f"ptx_has_{instr}"] = want in ptx
        res["copy_bandwidth_Bps"] = copy_bandwidth(self.dev, (1 << 22) if self.tiny else 2 << 30)
        res["l2_bytes"] = (
            torch.cuda.get_device_properties(self.dev).L2_cache_size if self.cuda else 0
        )
        pf = L2Prefetch(self.dev, PrefetchSpec("bulk", 1), None)
        pf.phases = [PhasePrefetch(pf, w, 16) for _ in range(16)]
        pf.compile()

        def launches() -> None:  # 16 prefetches of 16 bytes: the launch cost in a graph
            for p in pf.phases:
                p.start()

        g = self.graph(launches)
        res["launch_s"] = statistics.median(self.time_rounds({"launch": g}, 16)["launch"])
        return res

    # ------------------------------------------------------------------ 1. efficacy
    def efficacy(self) -> dict[str, Any]:
        """Per size: reads of heads carved from one 512 MiB pool (so every read is cold), with
        and without a prefetch of the head before a 50 µs sleep."""
        k = 64 if self.tiny else 4096
        pool = self.rand((1 << 14) if self.tiny else (512 * MiB) // (2 * k), k, seed=1)
        x = self.rand(1, k, seed=99)
        sizes = (1024, 8192) if self.tiny else tuple(m * MiB for m in (8, 16, 32, 48))
        return {f"{n / MiB:g}MiB": self.efficacy_size(pool, x, n) for n in sizes}

    def efficacy_size(self, pool: torch.Tensor, x: torch.Tensor, nbytes: int) -> dict[str, Any]:
        k = pool.shape[1]
        rows = nbytes // (k * pool.element_size())
        heads = [pool[i * rows : (i + 1) * rows] for i in range(min(64, pool.shape[0] // rows))]
        outs = [torch.empty(1, rows, device=self.dev, dtype=self.dtype) for _ in heads]

        def segments(spec: PrefetchSpec | None, twice: bool) -> None:
            for i, head in enumerate(heads):
                if twice:
                    torch.mm(x, head.t(), out=outs[i])
                if spec is not None:
                    prefetch_l2(head, nbytes, spec)
                self.sleep()
                torch.mm(x, head.t(), out=outs[i])

        specs = {f"{s.instruction}-p{s.programs}": s for s in
                 (PrefetchSpec("bulk", 8), PrefetchSpec("line", 8), PrefetchSpec("line", 32))}  # fmt: skip
        fns = {"cold": self.graph(lambda: segments(None, False))}
        fns["warm2x"] = self.graph(lambda: segments(None, True))
        for name, spec in specs.items():
            segments(spec, False)  # compile outside capture
            fns[name] = self.graph(lambda spec=spec: segments(spec, False))
        t = {n: statistics.median(v) for n, v in self.time_rounds(fns, len(heads)).items()}
        warm = t["warm2x"] - t["cold"]  # (read, sleep, read) - (sleep, read): a warm read
        row: dict[str, Any] = {"heads": len(heads), "cold_s": t["cold"], "warm_read_s": warm}
        for name in specs:
            frac = (t["cold"] - t[name]) / max(t["cold"] - warm, 1e-12)  # 1: all from L2
            row[name] = {"s": t[name], "l2_fraction": frac}
        return row

    # ------------------------------------------------------------------ 2. micro
    def micro(self, bw: float, launch_s: float) -> dict[str, Any]:
        mibs = [float(m) for m in self.args.mib.split(",")]
        res: dict[str, Any] = {}
        for pair, (idle_kind, n, k) in (TINY_PAIRS if self.tiny else PAIRS).items():
            if self.left() < 40:
                res[pair] = "skipped: budget"
                continue
            res[pair] = self.micro_pair(idle_kind, n, k, mibs, bw, launch_s)
            self.save()
        return res

    def idle_fn(self, kind: str, k: int) -> Callable[[], None]:
        """The small phase: an RMSNorm over one row, or (attention) that plus masked SDPA over
        a 512-token cache (the engine's two attention kernels: RoPE/K-V write, then SDPA)."""
        h, nw = self.rand(1, k, seed=5), 1.0 + self.rand(k, seed=6)
        rms_norm = reference.rms_norm_ref
        if self.cuda:
            from specpilot.kernels.decode_triton import rms_norm

        def norm() -> None:
            rms_norm(h, nw, 1e-5)

        if kind == "norm":
            return norm
        kv, d, g, ctx = (2, 16, 2, 64) if self.tiny else (8, 128, 4, 512)
        q = self.rand(1, kv, g, d, seed=7)
        kc, vc = (self.rand(1, kv, ctx, d, seed=seed) for seed in (8, 9))
        mask = torch.zeros(1, 1, g, ctx, device=self.dev, dtype=self.dtype)

        def attention() -> None:
            norm()
            F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)

        return attention

    def micro_pair(
        self, idle_kind: str, n: int, k: int, mibs: list[float], bw: float, launch_s: float
    ) -> dict[str, Any]:
        nbytes = n * k * (4 if self.tiny else 2)
        copies = 2 if self.tiny else max(2, -(-ROTATE_BYTES // nbytes))
        ws = [self.rand(n, k, seed=10 + c) for c in range(copies)]
        x = self.rand(1, k, seed=3)
        idle = self.idle_fn(idle_kind, k)
        fns: dict[str, Callable[[], None]] = {}
        outs: dict[str, list[torch.Tensor]] = {}
        for v in variants(self.tiny, mibs):
            side = torch.cuda.Stream(self.dev) if self.cuda and v.stream == "side" else None
            pf = L2Prefetch(self.dev, v.spec, side)
            pf.phases = [PhasePrefetch(pf, w, v.nbytes) for w in ws] if v.nbytes else []
            pf.compile()
            ys = [torch.empty(1, n, device=self.dev, dtype=self.dtype) for _ in ws]

            def run(pf: L2Prefetch = pf, ys: list[torch.Tensor] = ys) -> None:
                for i, w in enumerate(ws):
                    p = pf.phases[i] if pf.phases else None
                    if p is not None:
                        p.start()
                    idle()
                    if p is not None:
                        p.join()
                    torch.mm(x, w.t(), out=ys[i])

            fns[v.name], outs[v.name] = self.graph(run), ys

        def idle_only() -> None:
            for _ in ws:
                idle()

        ys_gemv = [torch.empty(1, n, device=self.dev, dtype=self.dtype) for _ in ws]

        def gemv_only() -> None:
            for w, y in zip(ws, ys_gemv, strict=True):
                torch.mm(x, w.t(), out=y)

        fns["idle only"], fns["gemv only"] = self.graph(idle_only), self.graph(gemv_only)
        rounds = self.time_rounds(fns, copies)
        equal = all(
            torch.equal(a, b)
            for name in outs
            for a, b in zip(outs[name], outs["none"], strict=True)
        )
        window = statistics.median(rounds["idle only"])
        base = rounds["none"]
        rows: dict[str, Any] = {}
        for v in variants(self.tiny, mibs):
            r = rounds[v.name]
            saved = [b - a for a, b in zip(r, base, strict=True)]
            pred = saved_time(v.nbytes, window, bw, launch_s, v.stream) if v.nbytes else 0.0
            rows[v.name] = {
                "segment_s": spread(r),
                "saved_s": spread(saved),
                "predicted_saved_s": pred,
            }
        return {
            "copies": copies, "matrix_bytes": nbytes, "outputs_equal": equal, "window_s": window,
            "gemv_s": spread(rounds["gemv only"]), "variants": rows,
        }  # fmt: skip

    # ------------------------------------------------------------------ 3. e2e
    def e2e(self, best: dict[str, Any], bw: float, launch_s: float) -> dict[str, Any]:
        from specpilot.bench.l2_prefetch import run_e2e

        micro = self.out["sections"].get("micro") or {}
        windows = {
            pair.split("->")[0]: res["window_s"] for pair, res in micro.items()
            if isinstance(res, dict) and "window_s" in res
        }  # fmt: skip
        contexts = [16, 48] if self.tiny else [int(c) for c in self.args.contexts.split(",")]
        new = self.args.new_tokens or (8 if self.tiny else 192)
        deadline = self.t0 + self.args.budget_s
        rounds = 2 if self.tiny else 5
        return run_e2e(
            self.dev, best.get("knobs"), contexts, new, rounds, deadline, bw, launch_s, windows
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    b = Bench(args)
    sec, section = b.out["sections"], b.section
    checks = section("checks", b.checks)
    bw = checks.get("copy_bandwidth_Bps", 4.25e12)
    launch_s = checks.get("launch_s", 2e-6)
    section("efficacy", b.efficacy)
    micro = section("micro", lambda: b.micro(bw, launch_s))
    sec["best"] = pick_best(micro, args.tiny, [float(m) for m in args.mib.split(",")])
    section("e2e", lambda: b.e2e(sec["best"], bw, launch_s))
    print(table(b.out))
    return b.out


if __name__ == "__main__":
    main()
