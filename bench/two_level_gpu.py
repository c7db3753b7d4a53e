"""Two-level verification on one GPU: the INT8 kernel, then one-level vs two-level end to end.

(a) Kernel: at the Llama-3-8B linear shapes (and its LM head) and M = 1, 4, 8, 16, the INT8
    weight-only kernel (best of a small config sweep) against bf16 ``F.linear`` (cuBLAS), CUDA-graph
    timed with weight copies rotated past L2 (``w12_gpu.time_calls``), each checked against the
    fp64 product of the dequantized weights; the ratio and each one's fraction of the device copy
    bandwidth measured in the same run.
(b) End to end on the llama3-8b shape with seeded random bf16 weights, eager ``SpecEngine``,
    batch 1: a drafter of **simulated acceptance** (the target's own AR continuation with misses
    injected to follow a profile) verified one-level, and two-level (``correct`` and
    ``correct-extend``). Per run: committed tokens per exact verify, tok/s (median of repeats),
    token equality with AR (token forcing where they differ), and the cost model's
    prediction (``two_level_cost.predict``) from the measured forward times and the INT8 copy's
    teacher-forced agreement with the bf16 target (random weights make that agreement very high;
    it is measured, not assumed). Every figure of (b) is labelled "simulated acceptance".

GPU:  ``PYTHONPATH=src python3 bench/two_level_gpu.py --out DIR``         (~3-4 min on an H200)
CPU:  ``TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/two_level_gpu.py --out DIR --tiny``
JSON to ``DIR/two_level_gpu.json`` (rewritten after each part); the short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from w12_gpu import copy_bandwidth, sync, time_calls

from specpilot.bench.records import git_rev
from specpilot.bench.two_level import agreement, forward_time
from specpilot.drafters.base import DraftProposal
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile
from specpilot.engine import SpecEngine
from specpilot.forcing import force_tokens
from specpilot.kernels.int8_gemm import counter_buffer, int8_matmul
from specpilot.kernels.w12_gemm import GemmConfig
from specpilot.mechanisms.int8_copy import cheap_model, dequantize, int8_nbytes, quantize
from specpilot.mechanisms.two_level import TwoLevelDrafter
from specpilot.mechanisms.two_level_cost import predict
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_target, make_peaked

SHAPES = {  # name: (N, K) of the Llama-3-8B linear layers and LM head
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
}  # fmt: skip
TINY_SHAPES = {"a": (48, 64), "b": (32, 96)}
SWEEP = [
    GemmConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
    for bn, bk, w, s in ((32, 256, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3),
                         (32, 512, 4, 2), (64, 512, 8, 2))
]  # fmt: skip
GEMV_SWEEP = [
    GemmConfig(block_n=bn, block_k=bk, use_dot=False) for bn, bk in ((32, 256), (64, 128))
]
TINY_SWEEP = [GemmConfig(block_n=16, block_k=32), GemmConfig(block_n=32, block_k=32, split_k=2)]
ROTATE_BYTES = 320 << 20


def err_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Within one bf16 rounding (plus K·2^-23·Σ|x||w| for fp32 order) of the fp64 product."""
    xd, wd = x.double(), w.double()
    z = xd @ wd.T
    bound = 2.0**-7 * z.abs() + x.shape[1] * 2.0**-23 * (xd.abs() @ wd.abs().T) + 1e-30
    return bool(((y.double() - z).abs() <= bound).all())


def bench_kernels(
    shapes: dict[str, tuple[int, int]], ms: Sequence[int], tiny: bool, dev: torch.device, bw: float
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reps = 1 if tiny else 4
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w0 = 0.02 * torch.randn(n, k, generator=g, device=dev, dtype=torch.float32)
        copies = 1 if tiny else max(2, -(-ROTATE_BYTES // (n * k)))
        qs = [quantize(w0)]
        qs += [type(qs[0])(q=qs[0].q.clone(), scale=qs[0].scale.clone()) for _ in range(copies - 1)]
        wb = [w0.bfloat16()] + [w0.bfloat16() for _ in range(max(1, copies // 2) - 1)]
        deq = dequantize(qs[0])
        del w0
        counters = [counter_buffer(n, dev) for _ in qs]
        for m in ms:
            x = torch.randn(m, k, generator=g, device=dev).bfloat16()
            t_bf16 = time_calls([lambda w=w, x=x: F.linear(x, w) for w in wb], dev, reps)
            best: tuple[float, str] | None = None
            ok = True
            sweep = TINY_SWEEP if tiny else SWEEP + (GEMV_SWEEP if m == 1 else [])
            for cfg in sweep:
                if not cfg.use_dot and m != 1:
                    continue
                try:
                    y = int8_matmul(x, qs[0].q, qs[0].scale, counters[0], None, cfg)
                    ok = ok and err_ok(y, x, deq)
                    calls = [
                        lambda q=q, c=c, x=x, cfg=cfg: int8_matmul(x, q.q, q.scale, c, None, cfg)
                        for q, c in zip(qs, counters, strict=True)
                    ]
                    t = time_calls(calls, dev, reps)
                except Exception as e:  # a config that does not compile here is skipped
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                if best is None or t < best[0]:
                    best = (t, f"bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} "
                               f"s{cfg.num_stages}{'' if cfg.use_dot else ' fma'}")  # fmt: skip
            if best is None:
                rows.append({"shape": name, "m": m, "error": "no config ran", "err_ok": False})
                continue
            b_int8 = n * k + 4 * n + 2 * m * (k + n)
            b_bf16 = 2 * n * k + 2 * m * (k + n)
            rows.append({
                "shape": name, "n": n, "k": k, "m": m,
                "bf16_us": t_bf16 * 1e6, "int8_us": best[0] * 1e6, "int8_config": best[1],
                "speedup": t_bf16 / best[0],
                "bf16_bw_frac": b_bf16 / t_bf16 / bw, "int8_bw_frac": b_int8 / best[0] / bw,
                "err_ok": ok,
            })  # fmt: skip
            print(f"  {name:8s} m={m:2d} bf16 {t_bf16 * 1e6:8.1f} us  int8 {best[0] * 1e6:8.1f} us"
                  f"  x{t_bf16 / best[0]:.2f}  {best[1]}  ok={ok}", flush=True)  # fmt: skip
        del qs, wb, deq, counters
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


class OracleDrafter:
    """Eager drafter of simulated acceptance for one row: proposes the target's own AR
    continuation (``oracle``) with the schedule's miss injected; the verify stays real."""

    def __init__(self, prompt: list[int], oracle: list[int], profile: AcceptanceProfile,
                 vocab: int, seed: int) -> None:  # fmt: skip
        self.name = f"oracle ({SIM_LABEL})"
        self.k = profile.k
        self.text = prompt + oracle
        self.schedule = profile.schedule(4 * len(oracle) + 64, seed)
        self.vocab = vocab
        self.cycle = 0
        self.divergences = 0

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        self.cycle = 0
        self.divergences = 0

    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        ctx = list(contexts[0])
        if ctx != self.text[: len(ctx)]:
            self.divergences += 1  # a bf16 near-tie left the oracle: drafts are then just wrong
        n = max(0, min(self.k, max_lens[0]))
        window = (self.text[len(ctx) : len(ctx) + n] + [0] * n)[:n]
        miss = self.schedule[self.cycle % len(self.schedule)]
        self.cycle += 1
        if miss < n:
            window[miss] = (window[miss] + 1) % self.vocab
        return DraftProposal(tokens=torch.tensor([window], dtype=torch.int64), lengths=[n])


def run_engine(target: Transformer, drafter: Any, prompt: list[int], max_new: int,
               reps: int, dev: torch.device) -> dict[str, Any]:  # fmt: skip
    walls, res, engine = [], None, None
    for _ in range(reps + 1):  # the first run is warm-up
        engine = SpecEngine(target, drafter, time_phases=False)
        sync(dev)
        t0 = time.perf_counter()
        res = engine.generate([prompt], max_new)[0]
        sync(dev)
        walls.append(time.perf_counter() - t0)
    assert res is not None
    wall = statistics.median(walls[1:])
    st = res.stats
    return {"tokens": res.tokens, "wall_s": wall, "tok_s": len(res.tokens) / wall,
            "cycles": st.cycles, "tau": st.committed / max(st.cycles, 1)}  # fmt: skip


def bench_e2e(
    tiny: bool, dev: torch.device, out: dict[str, Any], deadline: float, peaked: bool = False
) -> list[dict[str, Any]]:
    shape, dtype = ("tiny-llama", torch.float32) if tiny else ("llama3-8b", torch.bfloat16)
    prompt_len, max_new, reps = (12, 24, 1) if tiny else (64, 192, 2)
    target = build_target(shape, dev, dtype=dtype, seed=0, max_positions=1024)
    if peaked:  # clear top-1 margins: no bf16 near-ties, the INT8 copy sees the same argmax
        make_peaked(target)
    cheap = cheap_model(target)
    out["e2e_setup"] = {
        "shape": shape, "dtype": str(dtype), "prompt_len": prompt_len, "max_new": max_new,
        "int8_copy_GB": int8_nbytes(cheap) / 1e9, "label": SIM_LABEL + (" · peaked random target" if peaked else ""),
    }  # fmt: skip
    vocab = target.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    ar = run_engine(target, None, prompt, max_new, reps, dev)
    oracle = SpecEngine(target).generate([prompt], max_new + 32)[0].tokens
    agree = agreement(target, cheap, prompt + oracle, 16)
    out["e2e_setup"].update({"ar_tok_s": ar["tok_s"], "agreement": agree})
    print(f"  AR {ar['tok_s']:.1f} tok/s; INT8 teacher-forced agreement {agree:.4f}", flush=True)
    fr = 2 if tiny else 5
    rows: list[dict[str, Any]] = []
    profiles = {"tau1.5,k7": "tau=1.5,block=8", "tau3,k7": "tau=3,block=8",
                "tau5,k7": "tau=5,block=8"}  # fmt: skip
    for pname, ptext in profiles.items():
        if time.perf_counter() > deadline:  # stay inside the run's time limit
            out.setdefault("e2e_skipped", []).append(pname)
            print(f"  {pname}: skipped (time budget)", flush=True)
            continue
        profile = AcceptanceProfile.parse(ptext)
        k = profile.k
        t_v = {w: forward_time(target, prompt_len + 64, w, fr) for w in (k + 1, k + 2, k + 6)}
        t_cb = forward_time(cheap, prompt_len + 64, k + 1, fr)
        t_cs = forward_time(cheap, prompt_len + 64, 1, fr)
        for variant, ext in (("one-level", -1), ("correct", 0), ("correct-extend", 4)):
            inner = OracleDrafter(prompt, oracle, profile, vocab, seed=1)
            drafter = inner if ext < 0 else TwoLevelDrafter(inner, cheap, ext)
            r = run_engine(target, drafter, prompt, max_new, reps, dev)
            equal = r["tokens"] == ar["tokens"]
            row: dict[str, Any] = {
                "profile": pname, "variant": variant, "label": SIM_LABEL,
                "tau_measured": r["tau"], "tok_s": r["tok_s"], "cycles": r["cycles"],
                "speedup_vs_ar": r["tok_s"] / ar["tok_s"], "equal_to_ar": equal,
                "oracle_divergences": inner.divergences,
                "lossless_ok": equal,  # or, where the tokens differ, token forcing says ok
            }  # fmt: skip
            if not equal:
                rep = force_tokens(target, [("run", prompt, r["tokens"])])
                row["lossless_ok"] = rep.ok  # a bf16 near-tie is allowed, a mismatch is not
                row["forcing"] = {"ok": rep.ok, "near_ties": rep.near_ties,
                                  "mismatches": rep.mismatches}  # fmt: skip
            if ext >= 0:
                assert isinstance(drafter, TwoLevelDrafter)
                row["two_level_stats"] = drafter.stats.as_dict()
                p = predict(profile.survival(), agree, ext, 0.0, t_v[k + 1], t_v[k + 2 + ext],
                            t_cb, t_cs)  # fmt: skip
                row.update({"tau_predicted": p.tau_two, "tok_s_predicted": p.tok_s_two,
                            "speedup_predicted_vs_one_level": p.speedup})  # fmt: skip
            else:
                row.update(
                    {"tau_predicted": profile.tau, "tok_s_predicted": profile.tau / t_v[k + 1]}
                )
            row["times_ms"] = {"verify_k+1": t_v[k + 1] * 1e3, "verify_k+2": t_v[k + 2] * 1e3,
                               "verify_k+6": t_v[k + 6] * 1e3, "cheap_block": t_cb * 1e3,
                               "cheap_step": t_cs * 1e3}  # fmt: skip
            rows.append(row)
            print(f"  {pname:10s} {variant:15s} tau {r['tau']:.2f} (pred {row['tau_predicted']:.2f})"
                  f" {r['tok_s']:.1f} tok/s (pred {row['tok_s_predicted']:.1f}) equal={equal}",
                  flush=True)  # fmt: skip
    return rows


class _Skipped(Exception):
    """``--skip-kernel``: part (a) was not asked for."""


def table(result: dict[str, Any]) -> str:
    lines = ["== INT8 kernel vs bf16 F.linear (CUDA graphs, copies rotated past L2) =="]
    for r in result.get("kernel", []):
        if "error" in r:
            lines.append(f"{r['shape']:8s} m={r['m']:2d} ERROR {r['error']}")
            continue
        lines.append(f"{r['shape']:8s} m={r['m']:2d}  bf16 {r['bf16_us']:8.1f} us ({r['bf16_bw_frac']:.2f} bw)"
                     f"  int8 {r['int8_us']:8.1f} us ({r['int8_bw_frac']:.2f} bw)  x{r['speedup']:.2f}"
                     f"  ok={r['err_ok']}")  # fmt: skip
    setup = result.get("e2e_setup", {})
    lines.append(f"== two-level end to end, {setup.get('shape')} ({setup.get('label')}); AR "
                 f"{setup.get('ar_tok_s', 0):.1f} tok/s; INT8 agreement {setup.get('agreement', 0):.4f} ==")  # fmt: skip
    for r in result.get("e2e", []):
        lines.append(f"{r['profile']:10s} {r['variant']:15s} tau/verify {r['tau_measured']:.2f} "
                     f"(pred {r['tau_predicted']:.2f})  {r['tok_s']:7.1f} tok/s (pred "
                     f"{r['tok_s_predicted']:7.1f})  x{r['speedup_vs_ar']:.2f} vs AR  "
                     f"equal={r['equal_to_ar']} lossless={r['lossless_ok']}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU (TRITON_INTERPRET=1)")
    ap.add_argument(
        "--budget-s", type=float, default=210.0, help="start no new acceptance profile after this"
    )
    ap.add_argument("--peaked", action="store_true", help="peaked target (synthetic.make_peaked)")
    ap.add_argument("--skip-kernel", action="store_true", help="skip (a), the INT8 kernel timing")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.tiny:
        sys.exit("No CUDA GPU: run with --tiny (CPU, Triton interpreter).")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "two_level_gpu.json"
    started = time.perf_counter()
    bw = copy_bandwidth(dev, 1 << 20 if args.tiny else 1 << 30)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
        "commit": git_rev(), "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "copy_bw_TBps": bw / 1e12, "label_e2e": SIM_LABEL,
    }  # fmt: skip
    print("(a) INT8 kernel", flush=True)
    try:
        if args.skip_kernel:
            raise _Skipped
        shapes, ms = (TINY_SHAPES, (1, 4)) if args.tiny else (SHAPES, (1, 4, 8, 16))
        result["kernel"] = bench_kernels(shapes, ms, args.tiny, dev, bw)
    except _Skipped:
        result["kernel"] = []
    except Exception as e:
        result["kernel_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    path.write_text(json.dumps(result, indent=1))
    print("(b) two-level end to end", flush=True)
    try:
        result["e2e"] = bench_e2e(args.tiny, dev, result, started + args.budget_s, args.peaked)
    except Exception as e:
        result["e2e_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    result["seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(result, indent=1))
    print(table(result))
    if "kernel_error" in result or "e2e_error" in result:
        print(result.get("kernel_error", ""), result.get("e2e_error", ""), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
