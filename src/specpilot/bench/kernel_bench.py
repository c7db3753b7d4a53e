"""What the GPU kernel micro-benchmarks under ``bench/`` share (``w12_gpu.py``,
``fused_gemv_gpu.py``, ``gemv_sweep_gpu.py``): the Llama-3-8B linear shapes, weight copies
rotated past L2, timing a round of calls in one CUDA graph, config sweeps and interleaved rounds
of the best, the scripts' common arguments with the copy bandwidth measured in the same run, the
per-matrix loop that saves after each matrix, and the fp64 error bound every kernel is checked
against."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.runner import synchronize
from specpilot.bench.script import guarded, run_info
from specpilot.costmodel.hardware import copy_bandwidth
from specpilot.tune.kernel_search import graph_time

LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


ROTATE_BYTES = 400 << 20
"""Weight bytes in rotation: eight times the H200's 50 MB L2, so no copy is read warm."""

Calls = Callable[[str, Any], list[Callable[[], Any]]]
"""(variant, config) -> one zero-argument call per weight copy."""


def rotated_copies(n: int, k: int, dev: torch.device) -> int:
    """How many copies of an ``[n, k]`` bf16 weight fill :data:`ROTATE_BYTES` (2 to 16; 1 off
    CUDA)."""
    return max(2, min(16, math.ceil(ROTATE_BYTES / (2 * n * k)))) if dev.type == "cuda" else 1


def seeded_weights(n: int, k: int, copies: int, dev: torch.device) -> list[torch.Tensor]:
    """``copies`` seeded ``[n, k]`` bf16 weights, N(0, 0.02)."""
    gen = torch.Generator(device=dev)
    out = []
    for i in range(copies):
        gen.manual_seed(1000 * i + n + k)
        out.append((0.02 * torch.randn(n, k, generator=gen, device=dev)).to(torch.bfloat16))
    return out


def layer_totals(rows: Iterable[Mapping[str, Any]], variants: Iterable[str]) -> dict[str, float]:
    """µs per layer of each variant timed in every row (one row per matrix)."""
    rows = list(rows)
    return {
        v: sum(r[v]["us"] for r in rows)
        for v in variants
        if all("us" in r.get(v, {}) for r in rows)
    }


def best_common(sweeps: Sequence[Mapping[str, float]]) -> str | None:
    """The config swept in every one of ``sweeps`` (config -> time) with the lowest total."""
    common = set.intersection(*(set(s) for s in sweeps)) if sweeps else set()
    return min(common, key=lambda c: sum(s[c] for s in sweeps)) if common else None


NOTES = (
    "seeded N(0, 0.02) bf16 weights; CUDA graphs, weight copies rotated past L2; medians of "
    "interleaved rounds of each variant's best swept config; roofline = (weight + activation "
    "bytes) / time / copy bandwidth (2 GiB device copy, read + write)"
)


def kernel_header(dev: torch.device, copy_bw: float, notes: str = NOTES) -> dict[str, Any]:
    """The head of a kernel script's JSON: the run's device and versions, the measured copy
    bandwidth and what the numbers are."""
    return {**run_info(dev, "cpu (interpreter)"), "copy_TBps": copy_bw / 1e12, "notes": notes}


def sweep(
    calls: Calls, variant: str, cfgs: Iterable[Any], dev: torch.device, reps: int, deadline: float
) -> tuple[dict[Any, float], list[str]]:
    """Seconds per call of ``variant`` at each config (after the first, none past
    ``deadline``), and the configs that failed, with their error."""
    times: dict[Any, float] = {}
    errors: list[str] = []
    for cfg in cfgs:
        if times and time.perf_counter() > deadline:
            break  # out of time: keep what was swept
        try:
            times[cfg] = time_calls(calls(variant, cfg), dev, reps)
        except Exception as e:
            errors.append(f"{variant} {cfg}: {type(e).__name__}: {e}"[:300])
    return times, errors


def best_rounds(
    calls: Calls, best: Mapping[str, Any], dev: torch.device, rounds: int, reps: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant at its ``best`` config in ``rounds`` interleaved rounds
    (every variant once per round)."""
    ts: dict[str, list[float]] = {v: [] for v in best}
    for _ in range(rounds):
        for v, cfg in best.items():
            ts[v].append(time_calls(calls(v, cfg), dev, reps))
    return ts


def us_stats(ts: Sequence[float], nbytes: int, copy_bw: float) -> dict[str, float]:
    """µs per call (median, min, max) and the fraction of the copy bandwidth streaming
    ``nbytes`` in the median time reaches."""
    med = statistics.median(ts)
    return {
        "us": 1e6 * med,
        "us_min": 1e6 * min(ts),
        "us_max": 1e6 * max(ts),
        "roofline_frac": nbytes / med / copy_bw,
    }


def per_matrix(
    res: dict[str, Any],
    key: str,
    shapes: Mapping[str, tuple[int, int]],
    bench: Callable[[str, int, int], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], dict[str, Any]],
    path: Path,
    dev: torch.device,
) -> None:
    """``res[key][name] = bench(name, n, k)`` for every shape (its error if it raises, and its
    seconds), then ``res["summary"]`` (once every shape succeeded) and the JSON to ``path``,
    after each shape: a run cut short keeps the shapes it finished."""
    for name, (n, k) in shapes.items():
        t0 = time.perf_counter()
        res[key][name] = guarded(partial(bench, name, n, k), 2000)
        res[key][name]["seconds"] = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ok = {s: v for s, v in res[key].items() if "error" not in v}
        res["summary"] = summarize(ok) if len(ok) == len(shapes) else {}
        path.write_text(json.dumps(res, indent=1))


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
