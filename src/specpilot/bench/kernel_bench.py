"""What the GPU kernel micro-benchmarks under ``bench/`` share (``w12_gpu.py``,
``fused_gemv_gpu.py``, ``gemv_sweep_gpu.py``): the Llama-3-8B linear shapes, timing a round of
calls in one CUDA graph, the scripts' common arguments with the copy bandwidth measured in the
same run, and the fp64 error bound every kernel is checked against."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.runner import synchronize
from specpilot.costmodel.hardware import copy_bandwidth
from specpilot.tune.kernel_search import graph_time

LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def time_calls(calls: Sequence[Callable[[], Any]], dev: torch.device, reps: int) -> float:
    """Seconds per call, the calls run round-robin ``reps`` times (CUDA graph when possible)."""
    if dev.type == "cuda":
        try:
            return graph_time(calls, dev, reps)
        except Exception:  # graph capture refused: plain launches (includes launch overhead)
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                for c in calls:
                    c()
            end.record()
            synchronize(dev)
            return start.elapsed_time(end) / 1e3 / (reps * len(calls))
    for c in calls:
        c()
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in calls:
            c()
    return (time.perf_counter() - t0) / (reps * len(calls))


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
