"""What the GPU bench scripts under ``bench/`` share: a time budget, a JSON record rewritten after
each section (so a run cut short still leaves its numbers), CUDA-graph capture into one pool,
sections that report their failure instead of ending the run, the run's header (device,
commit, versions) and the end-to-end arm rows of an interleaved measurement."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.protocol import Measurement, Sample, interleave
from specpilot.bench.records import git_rev
from specpilot.bench.runner import run_prompts, synchronize
from specpilot.costmodel.measure import capture_graph
from specpilot.engine import Engine, generate
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_target, make_peaked
from specpilot.timing import spread


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_info(device: torch.device, cpu: str = "cpu") -> dict[str, str]:
    """What a bench JSON names first: the device (``cpu`` off CUDA), commit, UTC date, torch and
    triton versions."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "commit": git_rev(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": package_version("triton"),
    }


def script_parser(doc: str | None, budget_s: float, tiny: str) -> argparse.ArgumentParser:
    """A script's parser with the arguments every script takes: ``--out`` (the JSON's folder),
    ``--tiny`` (its help: ``tiny``) and ``--budget-s``."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help=tiny)
    ap.add_argument("--budget-s", type=float, default=budget_s, help="skip what would end later")
    return ap


def random_prompts(vocab: int, length: int, n: int = 1, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` uniformly random token ids, one seeded stream."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON (what JSON cannot hold, a path say, as its ``str``)."""
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def peaked_target(tiny: bool, device: torch.device, max_positions: int) -> tuple[Transformer, str]:
    """The scripts' end-to-end target: the Llama-3-8B shape in bf16 (``tiny``: ``tiny-llama`` in
    fp32), seeded random weights made peaked (``synthetic.make_peaked``); and its label."""
    shape = "tiny-llama" if tiny else "llama3-8b"
    dtype = torch.float32 if tiny else torch.bfloat16
    model = make_peaked(build_target(shape, device, dtype, seed=0, max_positions=max_positions))
    return model, f"{shape} (seeded random {str(dtype).removeprefix('torch.')} weights, peaked)"


def repeated(fn: Callable[[], object], reps: int, device: torch.device) -> Callable[[], object]:
    """``reps`` calls of ``fn``; on CUDA one replay of a graph that captured them."""

    def calls() -> None:
        for _ in range(reps):
            fn()

    return capture_graph(calls, device) if device.type == "cuda" else calls


def spread_text(v: dict[str, float], spec: str = ".3f", scale: float = 1.0) -> str:
    """``median (lo-hi)`` of a :func:`~specpilot.timing.spread` (or a ratio's dict)."""
    m, lo, hi = (format(scale * v[key], spec) for key in ("median", "lo", "hi"))
    return f"{m} ({lo}-{hi})"


def decode_sample(engine: Engine, prompt: list[int], new_tokens: int) -> Sample:
    """One greedy decode of ``prompt``, timed from the first commit the host reads (prefill and
    the first step's read-back excluded) to the end, device synchronised; its tokens the
    payload."""
    first: list[float] = []

    def mark(_i: int, toks: list[int]) -> None:  # called once the host has read them
        if not first:
            first.extend((time.perf_counter(), len(toks)))

    res = generate(engine, [prompt], new_tokens, on_commit=mark)[0]
    synchronize(engine.device)
    end = time.perf_counter()
    return Sample(len(res.tokens) - int(first[1]), end - first[0], res.tokens)


def prompt_tokens(sample: Sample) -> list[list[int]]:
    """The tokens of every prompt of one :func:`~specpilot.bench.runner.run_prompts` sample."""
    return [run.result.tokens for run in sample.payload]


def e2e_rounds(
    arms: dict[str, Engine],
    encoded: list[tuple[str, list[int]]],
    new_tokens: int,
    rounds: int,
    deadline: float,
) -> tuple[Measurement, dict[str, list[list[int]]]]:
    """A warm-up run of every arm but ``ar`` (graph capture; what it committed is returned), then
    up to ``rounds`` interleaved rounds of every arm over the prompts (``deadline``: as
    :func:`~specpilot.bench.protocol.interleave`)."""
    runs = {n: e for n, e in arms.items() if n != "ar"}
    warm = {n: prompt_tokens(run_prompts(e, encoded, new_tokens, ())) for n, e in runs.items()}

    def arm(engine: Engine) -> Callable[[], Sample]:
        return lambda: run_prompts(engine, encoded, new_tokens, ())

    meas = interleave({n: arm(e) for n, e in arms.items()}, rounds, warmup=0, deadline=deadline)
    return meas, warm


def arm_row(
    meas: Measurement,
    name: str,
    engine: Engine,
    cycles: Sequence[int],
    ar_tokens: list[list[int]],
    warm: dict[str, list[list[int]]],
) -> dict[str, Any]:
    """One arm of :func:`e2e_rounds`: tok/s and ms per cycle (``cycles``: the arm's cycles per
    round) with their spread, the per-round ratio to ``ar``, and whether its warm-up and last
    runs committed AR's tokens."""
    samples = meas.samples[name]
    per_cycle = [1e3 * s.seconds / max(c, 1) for s, c in zip(samples, cycles, strict=True)]
    return {
        "tok_s": spread([s.tok_s for s in samples]),
        "cycle_ms": spread(per_cycle),
        "x_ar": meas.ratio(name, "ar").to_dict(),
        "rounds": len(samples),
        "warmup_tokens_equal_ar": warm.get(name, ar_tokens) == ar_tokens,
        "tokens_equal_ar": prompt_tokens(samples[-1]) == ar_tokens,
        "graph_captures": engine.runner.captures,
    }


def guarded(fn: Callable[[], Any], trace_chars: int | None = None, echo: bool = False) -> Any:
    """``fn()``, or, if it raises, ``{"error": ..., "trace": ...}`` (the last ``trace_chars`` of
    the traceback; all of it by default; ``echo``: also on stderr): one failing part of a GPU
    script is reported and the others still run."""
    try:
        return fn()
    except Exception as e:
        trace = traceback.format_exc()
        if echo:
            print(trace, file=sys.stderr)
        return {
            "error": f"{type(e).__name__}: {e}",
            "trace": trace[-trace_chars:] if trace_chars else trace,
        }


class BenchScript:
    """``out``: the JSON record (``sections`` filled by :meth:`section`), written to
    ``out_dir / file_name`` by :meth:`save`."""

    def __init__(
        self, device: torch.device, out_dir: Path, file_name: str, budget_s: float, **header: Any
    ) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.out_dir, self.file_name, self.budget_s = out_dir, file_name, budget_s
        self.t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: list[tuple[Callable[[], object], Callable[[], object]]] = []
        """(replay, fn) of every graph: keeps the pool's graphs and what they use alive (``graph``)"""
        self.out: dict[str, Any] = {**run_info(device), **header, "sections": {}}

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.out["total_s"] = time.perf_counter() - self.t0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.out_dir / self.file_name, self.out)

    def graph(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` captured in a CUDA graph into the run's one pool (its replay); ``fn`` itself off
        CUDA. Every graph is kept alive for the whole run: once the last graph of a pool is
        freed, torch releases the pool, and a later capture into the same handle trips the
        caching allocator's ``use_count > 0`` assert (what stopped the first H200 run of
        ``bench/l2_prefetch_gpu.py`` between its checks and its efficacy section). ``fn`` is
        kept too: a graph holds device addresses, not the objects behind them, so buffers that
        only ``fn``'s closure owns (a kernel object's arrival counters, say) would otherwise be
        freed and reused while the graph still reads and writes them."""
        if not self.cuda:
            return fn
        replay = capture_graph(fn, self.dev, self.pool)
        self.graphs.append((replay, fn))
        return replay

    def section(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one section into ``out["sections"][name]`` (its error and trace if it raises),
        record its seconds, save, and hand the memory it cached back to the device."""
        sec = self.out["sections"]
        t = time.perf_counter()
        sec[name] = guarded(fn, echo=True)
        self.out.setdefault("section_s", {})[name] = time.perf_counter() - t
        self.save()
        if self.cuda:
            torch.cuda.empty_cache()
        return sec[name]


def finish(res: dict[str, Any], path: Path, started: float, table: Callable[[dict[str, Any]], str]) -> None:  # fmt: skip
    """A kernel script's last step: its wall time into ``res``, ``res`` to ``path``, the short
    table printed last."""
    res["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
