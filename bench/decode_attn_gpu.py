"""Split-KV decode attention on the H200 (issue 15 item 5): is it exact, how fast is it against
SDPA + gather, and what does mechanism ``split-kv`` take off the 8B AR step and a width-8 verify?

    PYTHONPATH=src python3 bench/decode_attn_gpu.py --out DIR                            # one H200, < 3 min
    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/decode_attn_gpu.py --out DIR --tiny  # CPU smoke run

0. ``checks``: copy bandwidth, the launch latency of a small kernel in a graph, the SM count.
1. ``correctness`` (first; every later number depends on it): Llama-3-8B attention shapes, keys
   L = 128..4096, block widths W = 1, 8, 16, batch 1 and 4 rows of different lengths, buckets of
   128: the kernel (bf16, fp32) and SDPA (bf16) against fp32 SDPA; K/V past each row's end
   poisoned with NaN; two launches bit-equal; a graph replayed after the lengths changed.
2. ``timing``: per (L, W) at batch 1, CUDA graphs over K/V caches rotated past L2:
   ``DenseLayout.gather(SDPA(mask))`` against ``SplitKVAttention`` at a few knob settings,
   interleaved rounds (median, min-max), the cost model's prediction beside each.
3. ``e2e``: the llama3-8b shape (random bf16 weights), the engine's verify step at W = 1 and 8,
   mechanism off and on, interleaved, at contexts 512 and 4096, beside the prediction; AR tokens
   of both arms compared.
JSON to DIR/decode_attn_gpu.json (rewritten after each section); a short table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.decode_attn import run_e2e, table
from specpilot.bench.gpu_ceilings import copy_bandwidth
from specpilot.bench.script import BenchScript, script_parser
from specpilot.kernels.decode_attn_plan import DecodeAttnConfig
from specpilot.kernels.reference import decode_attention_ref
from specpilot.mechanisms.decode_attn import SplitKVAttention
from specpilot.mechanisms.decode_attn_cost import predict
from specpilot.models.layout import DenseLayout
from specpilot.synthetic import TARGET_SHAPES
from specpilot.timing import interleaved_rounds, spread

BUCKET = 128
ROTATE_BYTES = 256 << 20
VARIANTS_W1 = {
    "auto": DecodeAttnConfig(),  # block_n and warps by query rows (decode_attn_plan.tiling_for_rows)
    "bn32w4": DecodeAttnConfig(block_n=32, num_warps=4),  # the default before 2026-12-02
    "kps128": DecodeAttnConfig(keys_per_split=128, block_n=32, num_warps=4),
    "kps256": DecodeAttnConfig(keys_per_split=256, block_n=32, num_warps=4),
    "kps512": DecodeAttnConfig(keys_per_split=512, block_n=32, num_warps=4),
    "bn64": DecodeAttnConfig(block_n=64, num_warps=4),
    "bn64w8": DecodeAttnConfig(block_n=64, num_warps=8),
    "w2": DecodeAttnConfig(block_n=32, num_warps=2),
    "w8": DecodeAttnConfig(block_n=32, num_warps=8),
    "w2kps128": DecodeAttnConfig(block_n=32, num_warps=2, keys_per_split=128),
    "w2bn64": DecodeAttnConfig(block_n=64, num_warps=2),
    "w2bn64kps128": DecodeAttnConfig(block_n=64, num_warps=2, keys_per_split=128),
    "bn64w8kps256": DecodeAttnConfig(block_n=64, num_warps=8, keys_per_split=256),
}
"""Knob settings timed at W = 1 (each one is expressible by the mechanism's knobs)."""
VARIANTS_WIDE = ("auto", "bn32w4", "kps128", "kps256", "w8", "bn64w8", "bn64w8kps256")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = script_parser(__doc__, 170.0, "tiny shapes on the CPU (interpreter)")
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--contexts", default="512,4096", help="e2e prompt lengths")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default by mode)")
    ap.add_argument("--skip", default="", help="sections to leave out, e.g. timing,e2e")
    return ap.parse_args(argv)


def bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


class Bench(BenchScript):
    def __init__(self, args: argparse.Namespace) -> None:
        shape = "tiny-llama" if args.tiny else "llama3-8b"
        dev = torch.device("cpu" if args.tiny else "cuda")
        super().__init__(dev, args.out, "decode_attn_gpu.json", args.budget_s, shape=shape)
        self.args, self.tiny = args, args.tiny
        cfg = TARGET_SHAPES["tiny-llama" if self.tiny else "llama3-8b"]
        self.cfg = cfg
        self.hkv, self.g, self.d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        self.lengths = [40] if self.tiny else [int(x) for x in args.lengths.split(",")]
        self.widths = [1, 3] if self.tiny else [int(x) for x in args.widths.split(",")]
        self.rounds = args.rounds or (2 if self.tiny else 12)

    def qkv(self, b: int, w: int, s: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        shapes = [(b, self.hkv, self.g * w, self.d), (b, self.hkv, s, self.d)]
        shapes.append(shapes[1])
        return [torch.randn(sh, device=self.dev, generator=g).to(dtype) for sh in shapes]

    def time_rounds(self, fns: dict[str, Callable[[], None]], per: int) -> dict[str, list[float]]:
        """Seconds per call (``per`` calls per fn) of each fn, per interleaved round."""
        return interleaved_rounds(fns, self.dev, self.rounds, per, 1 if self.tiny else 3)

    # ------------------------------------------------------------------ 0. checks
    def checks(self) -> dict[str, Any]:
        x = torch.zeros(16, device=self.dev)

        def launches() -> None:  # 64 tiny kernels: the cost of one launch inside a graph
            for _ in range(64):
                x.add_(1.0)

        g = self.graph(launches)
        launch_s = statistics.median(self.time_rounds({"launch": g}, 64)["launch"])
        sms = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.cuda else 4
        return {
            "copy_bandwidth_Bps": copy_bandwidth(self.dev, (1 << 22) if self.tiny else 2 << 30),
            "launch_s": launch_s,
            "num_sms": int(sms),
        }

    # ------------------------------------------------------------------ 1. correctness
    def correctness(self) -> dict[str, Any]:
        cases = []
        seed = 0
        for length in self.lengths:
            for w in self.widths:
                batch = (
                    (1, [length - w]),
                    (4, [length - w, 0, length // 3, max(length - 2 * w, 0)]),
                )
                for b, starts in batch:
                    seed += 1
                    cases.append(self.case(b, w, starts, bucket(length), seed))
        fp32 = [self.case(2, w, [self.lengths[-1] - w, 5], bucket(self.lengths[-1]), 99, torch.float32)
                for w in self.widths]  # fmt: skip
        ok = all(c["ok"] for c in cases + fp32)
        return {
            "cases": cases,
            "fp32": fp32,
            "all_ok": ok,
            "unread_ok": all(c["unread_ok"] for c in cases),
            "deterministic": all(c["deterministic"] for c in cases),
            "graph_ok": self.graph_replay(),
        }

    def case(
        self, b: int, w: int, starts: list[int], attn: int, seed: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> dict[str, Any]:  # fmt: skip
        q, k, v = self.qkv(b, w, attn, seed, dtype)
        start = torch.tensor(starts, device=self.dev)
        ref = decode_attention_ref(q.double(), k.double(), v.double(), start, w, attn)
        sdpa = decode_attention_ref(q, k, v, start, w, attn)
        lay = DenseLayout.build(start, w, attn, self.g, dtype)
        tiny_cfg = DecodeAttnConfig(keys_per_split=16, block_n=16)  # several splits at tiny L
        kernel = SplitKVAttention(tiny_cfg if self.tiny else DecodeAttnConfig())
        k_bad, v_bad = k.clone(), v.clone()
        for i, s in enumerate(starts):
            k_bad[i, :, s + w :] = float("nan")
            v_bad[i, :, s + w :] = float("nan")
        got = kernel(q, k_bad, v_bad, lay)
        again = kernel(q, k_bad, v_bad, lay)
        err = (got.double() - ref).abs().max().item()
        sdpa_err = (sdpa.double() - ref).abs().max().item()
        # bf16: within 2x SDPA's own error plus one bf16 ulp of the output scale; fp32: 1e-5
        tol = 1e-5 if dtype == torch.float32 else 2 * sdpa_err + 2**-8 * ref.abs().max().item()
        unread = bool(torch.isfinite(got).all())
        return {
            "batch": b, "width": w, "length": max(starts) + w, "attn_len": attn,
            "dtype": str(dtype), "kernel_err": err, "sdpa_err": sdpa_err, "tol": tol,
            "unread_ok": unread, "deterministic": bool(torch.equal(got, again)),
            "ok": unread and err <= tol and bool(torch.equal(got, again)),
        }  # fmt: skip

    def graph_replay(self) -> bool:
        """Captured once at a bucket; the lengths change on the device; replays match."""
        w, attn = self.widths[-1], bucket(self.lengths[-1])
        q, k, v = self.qkv(2, w, attn, 7, torch.bfloat16)
        start = torch.tensor([attn // 2, 3], device=self.dev)
        lay = DenseLayout.build(start, w, attn, self.g, torch.bfloat16)
        kernel = SplitKVAttention(DecodeAttnConfig())
        out = torch.empty(2 * w, self.hkv * self.g * self.d, device=self.dev, dtype=q.dtype)

        def step() -> None:
            out.copy_(kernel(q, k, v, lay))

        run = self.graph(step)
        ok = True
        for starts in ([attn // 2, 3], [attn - w, 0], [1, attn // 3], [attn - w, attn - w]):
            start.copy_(torch.tensor(starts))
            run()
            want = kernel(q, k, v, DenseLayout.build(start.clone(), w, attn, self.g, q.dtype))
            ok = ok and torch.equal(out, want)
        return ok

    # ------------------------------------------------------------------ 2. timing
    def timing(self, bw: float, launch_s: float, sms: int) -> dict[str, Any]:
        rows = []
        for length in self.lengths:
            if self.left() < 60:
                rows.append({"length": length, "skipped": "budget"})
                continue
            attn = bucket(length)
            per_cache = 2 * self.hkv * attn * self.d * 2
            copies = 2 if self.tiny else min(256, max(32, -(-ROTATE_BYTES // per_cache)))
            caches = [self.qkv(1, 1, attn, 100 + c, torch.bfloat16)[1:] for c in range(copies)]
            for w in self.widths:
                rows.append(self.time_shape(length, w, attn, caches, bw, launch_s, sms))
                self.save()
            del caches
        return {"rows": [r for r in rows if "skipped" not in r], "skipped": rows}

    def time_shape(
        self, length: int, w: int, attn: int, caches: list[list[torch.Tensor]], bw: float,
        launch_s: float, sms: int,
    ) -> dict[str, Any]:  # fmt: skip
        q = self.qkv(1, w, 1, length * 31 + w, torch.bfloat16)[0]
        start = torch.tensor([length - w], device=self.dev)
        lay = DenseLayout.build(start, w, attn, self.g, torch.bfloat16)
        names = list(VARIANTS_W1) if w == 1 else list(VARIANTS_WIDE)
        if self.tiny:  # the interpreter is slow: the code path, not the grid
            names = names[:2]

        def sdpa() -> None:
            for kc, vc in caches:
                a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=lay.mask)
                lay.gather(a).contiguous()

        fns = {"sdpa": self.graph(sdpa)}
        for name in names:
            kernel = SplitKVAttention(VARIANTS_W1[name])

            def split(kernel: SplitKVAttention = kernel) -> None:
                for kc, vc in caches:
                    kernel(q, kc, vc, lay)

            fns[name] = self.graph(split)
        for name, fn in fns.items():  # each graph runs once, alone, before any timing
            fn()
            try:
                torch.cuda.synchronize(self.dev) if self.cuda else None
            except Exception as e:
                raise RuntimeError(f"graph {name!r} at L={length} W={w} failed: {e}") from None
        t = self.time_rounds(fns, len(caches))
        variants = {}
        for name in names:
            p = predict(self.cfg, [length - w], w, attn, bw, launch_s, sms, VARIANTS_W1[name],
                        2, statistics.median(t["sdpa"]))  # fmt: skip
            variants[name] = {"s": spread(t[name]), "predicted_s": p.split_kv.seconds,
                              "bytes": p.split_kv.bytes, "programs": p.split_kv.programs}  # fmt: skip
        model = predict(self.cfg, [length - w], w, attn, bw, launch_s, sms)
        best = min(names, key=lambda n: variants[n]["s"]["median"])
        return {
            "length": length, "width": w, "attn_len": attn, "copies": len(caches),
            "sdpa_s": spread(t["sdpa"]), "sdpa_predicted_s": model.sdpa.seconds,
            "variants": variants, "default": "auto", "best": best,
        }  # fmt: skip

    # ------------------------------------------------------------------ 3. e2e
    def e2e(self, bw: float, launch_s: float, sms: int) -> dict[str, Any]:
        rows = (self.out["sections"].get("timing") or {}).get("rows", [])
        sdpa = {(r["attn_len"], r["width"]): r["sdpa_s"]["median"] for r in rows}
        contexts = [24] if self.tiny else [int(c) for c in self.args.contexts.split(",")]
        return run_e2e(
            self.dev, contexts, [1, 8], 1 if self.tiny else 5, 1 if self.tiny else 10, bw,
            launch_s, sms, sdpa, DecodeAttnConfig(), 4 if self.tiny else 32, self.left,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--tiny runs the Triton kernel on the CPU: set TRITON_INTERPRET=1.")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("No CUDA device; use --tiny (with TRITON_INTERPRET=1) on the CPU.")
    b = Bench(args)
    with torch.inference_mode():
        checks = b.section("checks", b.checks)
        bw = checks.get("copy_bandwidth_Bps", 4.25e12)
        launch_s = checks.get("launch_s", 2e-6)
        sms = checks.get("num_sms", 132)
        cor = b.section("correctness", b.correctness)
        if not cor.get("all_ok") or not cor.get("graph_ok"):
            print("correctness failed: timings follow but do not count", file=sys.stderr)
        skip = set(args.skip.split(","))
        if "timing" not in skip:
            b.section("timing", lambda: b.timing(bw, launch_s, sms))
        if "e2e" not in skip:
            b.section("e2e", lambda: b.e2e(bw, launch_s, sms))
    print(table(b.out))
    return b.out


if __name__ == "__main__":
    main()
