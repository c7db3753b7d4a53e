"""L2 prefetch on the H200 (issue 15 item 2): does prefetching the head of the next matrix during a
small phase speed up its GEMV, and does mechanism ``l2-prefetch`` speed up AR decode?

    PYTHONPATH=src python3 bench/l2_prefetch_gpu.py --out DIR          # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/l2_prefetch_gpu.py --out DIR --tiny   # CPU smoke run (no-op)

0. ``checks`` — the PTX of each instruction holds it (``prefetch.global.L2`` /
   ``cp.async.bulk.prefetch.L2``); device copy bandwidth; the time of the smallest prefetch launch
   in a graph (the cost model's launch time).
1. ``efficacy`` — prefetch X MiB of a cold matrix, sleep 50 µs, read those X MiB (a GEMV over the
   head rows): beside the cold read and an L2-warm read, so "served from L2" is visible directly.
2. ``micro`` — per pair (idle phase → matrix, Llama-3-8B shapes): a CUDA graph of R segments
   ``[idle kernels → GEMV(W_c)]`` over R weight copies (≥ 320 MB in rotation, so nothing stays in
   L2 between replays); variants: no prefetch, and X MiB of W_c prefetched at the idle phase on a
   side or the same stream, bulk or line, through the mechanism's own hooks (``PhasePrefetch``).
   Every variant's outputs must equal the no-prefetch outputs bit for bit. Interleaved rounds;
   per segment: median and spread (min-max over rounds), beside the cost model's prediction from
   the measured idle window, bandwidth and launch time.
3. ``e2e`` — AR decode of the llama3-8b shape (random bf16 weights) through ``build_engine``
   with ``l2-prefetch`` off and on (the best micro variant, then neighbours), interleaved rounds
   (``bench/protocol.interleave``), decode tok/s after the first commit; tokens must equal.
JSON to DIR/l2_prefetch_gpu.json (rewritten after each section); a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.gpu_ceilings import copy_bandwidth
from specpilot.bench.l2_prefetch import table
from specpilot.bench.records import git_rev, run_section
from specpilot.costmodel.measure import capture_graph
from specpilot.kernels import reference
from specpilot.kernels.l2_prefetch import PrefetchSpec, launch_mode, prefetch_l2
from specpilot.mechanisms.l2_prefetch import L2Prefetch, MiB, PhasePrefetch
from specpilot.mechanisms.l2_prefetch_cost import saved_time
from specpilot.timing import time_burst

ROTATE_BYTES = 320 << 20
PAIRS = {"attention->o": ("attention", 4096, 4096), "norm->gate_up": ("norm", 28672, 4096),
         "norm->qkv": ("norm", 6144, 4096)}  # fmt: skip
"""Pair → (idle phase, N, K of the matrix after it)."""
TINY_PAIRS = {"attention->o": ("attention", 128, 64), "norm->gate_up": ("norm", 256, 64)}


@dataclass(frozen=True, slots=True)
class Variant:
    nbytes: int  # 0: no prefetch
    stream: str = "side"
    spec: PrefetchSpec = field(default_factory=PrefetchSpec)

    def knobs(self) -> dict[str, Any] | None:
        """The mechanism's knobs for this variant (None: not expressible, e.g. another chunk;
        the tiny sizes of ``--tiny`` map to 1 MiB)."""
        if not self.nbytes or self.spec.chunk:
            return None
        return {
            "phases": "all",
            "mb": max(1, round(self.nbytes / MiB)),
            "stream": self.stream,
            "instruction": self.spec.instruction,
            "programs": self.spec.programs,
        }

    @property
    def name(self) -> str:
        if not self.nbytes:
            return "none"
        s = self.spec
        chunk = f"/{s.chunk_bytes >> 10}K" if s.instruction == "bulk" else ""
        return f"{self.nbytes / MiB:g}M {self.stream} {s.instruction}{chunk} p{s.programs}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="L2 prefetch on the GPU (issue 15 item 2)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--mib", default="2,4,8,16,32", help="prefetch sizes of the micro grid")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default by mode)")
    ap.add_argument("--contexts", default="512,4096", help="e2e prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=0, help="e2e tokens per run")
    ap.add_argument("--budget-s", type=float, default=165.0, help="skip what would end later")
    return ap.parse_args(argv)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "lo": min(xs), "hi": max(xs), "n": len(xs)}


def variants(tiny: bool, mibs: list[float]) -> list[Variant]:
    unit = 1024 if tiny else MiB
    out = [Variant(0)]
    for x in mibs:
        for stream in ("side", "same"):
            for instr in ("bulk", "line"):
                out.append(Variant(int(x * unit), stream, PrefetchSpec(instr, 8)))
    mid = int(16 * unit)
    out += [Variant(mid, "side", PrefetchSpec("bulk", p)) for p in (2, 32)]
    out += [Variant(mid, "side", PrefetchSpec("line", 32))]
    out += [Variant(mid, "side", PrefetchSpec("bulk", 8, chunk=c)) for c in (4096, 65536)]
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tiny = args, args.tiny
        self.dev = torch.device("cpu" if args.tiny else "cuda")
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.float32 if self.tiny else torch.bfloat16
        self.rounds = args.rounds or (3 if self.tiny else 15)
        self.t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.out: dict[str, Any] = {
            "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
            "git": git_rev(),
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "launch_mode": launch_mode(self.dev),
            "sections": {},
        }

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        (self.args.out / "l2_prefetch_gpu.json").write_text(json.dumps(self.out, indent=1))

    def graph(self, fn: Callable[[], None]) -> Callable[[], None]:
        return capture_graph(fn, self.dev, self.pool) if self.cuda else fn

    def rand(self, *shape: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        return 0.02 * torch.randn(*shape, device=self.dev, generator=g).to(self.dtype)

    def time_rounds(self, fns: dict[str, Callable[[], None]], per: int) -> dict[str, list[float]]:
        """Seconds per segment (``per`` segments per call) of each fn, per interleaved round."""
        names = list(fns)
        for fn in fns.values():
            fn()
        got: dict[str, list[float]] = {n: [] for n in names}
        for r in range(self.rounds):
            shift = r % len(names)
            for n in names[shift:] + names[:shift]:
                got[n].append(time_burst(fns[n], self.dev, 3) / per)
        return got

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
        if self.cuda:
            from specpilot.kernels import decode_triton

            def norm() -> None:
                decode_triton.rms_norm(h, nw, 1e-5)
        else:

            def norm() -> None:
                reference.rms_norm_ref(h, nw, 1e-5)

        if kind == "norm":
            return norm
        kv, d, g, ctx = (2, 16, 2, 64) if self.tiny else (8, 128, 4, 512)
        q, kc, vc = (
            self.rand(1, kv, g, d, seed=7),
            self.rand(1, kv, ctx, d, seed=8),
            self.rand(1, kv, ctx, d, seed=9),
        )
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


def pick_best(micro: dict[str, Any], tiny: bool, mibs: list[float]) -> dict[str, Any]:
    """Of the variants the mechanism's knobs can express, the one with the largest median saving
    summed over the pairs, each weighted by how often a layer has it (attention → o once; a norm
    before a matrix three times: qkv, gate_up, and down after SiLU·mul)."""
    knobs = {v.name: v.knobs() for v in variants(tiny, mibs)}
    total: dict[str, float] = {}
    for pair, res in micro.items():
        if not isinstance(res, dict) or "variants" not in res:
            continue
        weight = 1.0 if pair.startswith("attention") else 1.5
        for name, row in res["variants"].items():
            if knobs.get(name) is not None:
                total[name] = total.get(name, 0.0) + weight * row["saved_s"]["median"]
    name = max(total, key=lambda n: total[n]) if total else None
    return {"name": name, "knobs": knobs.get(name) if name else None, "scores": total}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    b = Bench(args)
    sec = b.out["sections"]

    def section(name: str, fn: Callable[[], Any]) -> Any:
        return run_section(b.out, name, fn, b.save)

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
