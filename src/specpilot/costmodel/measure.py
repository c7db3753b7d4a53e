"""Measurements: per-component times of the real model, and a real AR-vs-speculative run.

Component times come from the closures of ``components`` (the model's own weights, the step's
shapes), timed in interleaved rounds so that a noisy machine (shared CPU cores) shifts every
component alike, and summarised by the median. CPU: ``perf_counter`` around single calls.
CUDA: each closure is captured in a CUDA graph (the engine's mode) and replayed between events.

The run (:func:`run_engines`) decodes every prompt with the stock AR engine and the speculative
engine, alternating, and keeps decode-only figures (prefill excluded, its token not counted):
tokens, wall seconds, cycles and the engine's phase timers, plus the acceptance counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specpilot.costmodel.components import ForwardPieces, Thunk, eager_pieces, static_pieces
from specpilot.engine import AcceptanceStats, SpecEngine
from specpilot.engine.loop import PhaseTimes
from specpilot.models.transformer import Transformer
from specpilot.timing import time_burst


@dataclass(frozen=True, slots=True)
class ForwardTimes:
    """Measured seconds of one forward of ``tokens`` tokens at ``context``, per component."""

    tokens: int
    context: int
    components: dict[str, float]
    forward_s: float
    """The whole forward (argmax included) timed the same way."""

    @property
    def overhead_s(self) -> float:
        """What the whole forward costs beyond its components (set-up, views, Python)."""
        return max(self.forward_s - sum(self.components.values()), 0.0)

    def as_terms(self) -> dict[str, float]:
        return {**self.components, "overhead": self.overhead_s}

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "context": self.context,
            "components_s": dict(self.components),
            "forward_s": self.forward_s,
            "overhead_s": self.overhead_s,
        }


def _graph(fn: Thunk, device: torch.device, pool: Any = None) -> Thunk:
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream); returns its replay.

    ``pool``: a ``torch.cuda.graph_pool_handle()`` shared by graphs that replay one at a time on
    one stream (as the engine's :class:`~specpilot.engine.cuda_graphs.GraphRunner` does)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    return g.replay


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "process": time.process_time}
"""CPU clocks. ``process`` (CPU seconds of this process) is for a shared, oversubscribed machine
with ``--threads 1``: time slices taken by other processes do not count, the work does."""


def _sample(fn: Thunk, device: torch.device, iters: int, clock: str = "wall") -> float:
    """Seconds per call of one timed burst of ``iters`` calls (CUDA: events; else ``clock``)."""
    return time_burst(fn, device, iters, CLOCKS[clock])


def time_rounds(
    fns: dict[str, Thunk], device: torch.device, rounds: int, iters: int = 1, clock: str = "wall"
) -> dict[str, float]:
    """Median seconds per call of each function, timed in ``rounds`` interleaved rounds of
    ``iters`` calls (CUDA events on a GPU, ``perf_counter`` on the CPU)."""
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_sample(fn, device, iters, clock))
    return {name: statistics.median(s) for name, s in samples.items()}


class ForwardTimer:
    """Component and whole-forward timings of ``model`` at several widths and one context.

    Each :meth:`round` takes one sample of every (width, component) and of every whole forward;
    :meth:`results` keeps the medians. Rounds can be interleaved with a real run (``profile``
    does, between prompts) so that a shared, noisy machine affects both alike.
    ``path``: ``eager`` (SpecEngine's forward) or ``static`` (the CUDA-graph engine's forward;
    captured in graphs on CUDA).

    On CUDA every width's pieces are built first (in ``__init__``); each round then captures one
    width's pieces in graphs, replays, times and drops them before the next width is captured.
    The earlier order (build width 1, capture it, then build and capture width 17, then replay
    width 1) crashed on the H200 with an illegal memory access in width 1's first GEMM piece
    (llama3-8b, 32 layers; 2 layers or one width did not). Building every piece before any
    capture did not crash, with or without a fixed cuBLAS workspace; the root cause is not
    pinned down (``bench/graph_capture_check.py`` holds the variants and their results).
    Capture costs milliseconds per piece and stays outside the timed bursts.
    """

    def __init__(
        self,
        model: Transformer,
        widths: Sequence[int],
        context: int,
        path: str = "eager",
        clock: str = "wall",
        graphs: bool = True,
    ) -> None:
        if path not in ("eager", "static"):
            raise ValueError(f"path must be eager or static, got {path!r}")
        self.model, self.context, self.path, self.clock = model, context, path, clock
        self.device = model.device
        self.iters = 10 if self.device.type == "cuda" else 1
        self.graphs = path == "static" and self.device.type == "cuda" and graphs
        self._fns: dict[int, dict[str, Thunk]] = {}
        with torch.inference_mode():
            for w in sorted(set(widths)):
                pieces: ForwardPieces = (
                    eager_pieces(model, w, context)
                    if path == "eager"
                    else static_pieces(model, w, context)
                )
                fns = {**pieces.components, "__forward__": pieces.forward}
                for fn in fns.values():  # warm-up (Triton JIT, cuBLAS handles)
                    fn()
                self._fns[w] = fns
        self._samples: dict[int, dict[str, list[float]]] = {
            w: {name: [] for name in fns} for w, fns in self._fns.items()
        }
        self.rounds = 0

    @torch.inference_mode()
    def round(self) -> None:
        for w, fns in self._fns.items():
            runs = fns
            if self.graphs:
                pool = torch.cuda.graph_pool_handle()
                runs = {name: _graph(fn, self.device, pool) for name, fn in fns.items()}
                for run in runs.values():
                    run()
            for name, run in runs.items():
                self._samples[w][name].append(_sample(run, self.device, self.iters, self.clock))
            del runs  # this width's graphs die before the next width is captured
        self.rounds += 1

    def results(self) -> dict[int, ForwardTimes]:
        if not self.rounds:
            raise ValueError("no timing rounds were taken")
        out = {}
        for w, samples in self._samples.items():
            med = {name: statistics.median(s) for name, s in samples.items()}
            forward_s = med.pop("__forward__")
            out[w] = ForwardTimes(w, self.context, med, forward_s)
        return out


def measure_forward(
    model: Transformer, tokens: int, context: int, path: str = "eager", rounds: int = 5
) -> ForwardTimes:
    """Per-component and whole-forward times of one forward shape on ``model``."""
    return measure_forwards(model, [tokens], context, path, rounds)[tokens]


def measure_forwards(
    model: Transformer,
    widths: Sequence[int],
    context: int,
    path: str = "eager",
    rounds: int = 5,
    clock: str = "wall",
    graphs: bool = True,
) -> dict[int, ForwardTimes]:
    timer = ForwardTimer(model, widths, context, path, clock, graphs)
    for _ in range(rounds):
        timer.round()
    return timer.results()


@torch.inference_mode()
def time_greedy_verify(
    k: int, device: torch.device, rounds: int = 20, clock: str = "wall"
) -> float:
    """Seconds of one ``greedy_verify`` over k drafts (the accept step's device work)."""
    from specpilot.engine.verify import greedy_verify

    drafts = torch.zeros(1, k, dtype=torch.int64, device=device)
    lens = torch.full((1,), k, dtype=torch.int64, device=device)
    argmax = torch.zeros(1, k + 1, dtype=torch.int64, device=device)

    def fn() -> object:
        out = greedy_verify(drafts, lens, argmax)
        return out.accepted_len.tolist(), out.bonus.tolist()

    return time_rounds({"v": fn}, device, rounds, clock=clock)["v"]


# ---------------------------------------------------------------------- a real run
@dataclass(slots=True)
class EngineRun:
    """Decode-only totals of one engine over a prompt set (medians over repeats per prompt)."""

    tokens: int = 0
    """Decode tokens: committed tokens after prefill's first."""
    seconds: float = 0.0
    cycles: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds in the engine's phases during decode: draft, verify, commit."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def per_cycle(self, phase: str) -> float:
        return self.phases.get(phase, 0.0) / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "cycles": self.cycles,
            "tok_s": self.tok_s,
            "phases_s": dict(self.phases),
        }


@dataclass(slots=True)
class RunMeasurement:
    ar: EngineRun
    spec: EngineRun
    stats: AcceptanceStats
    """Acceptance counts of the speculative engine (first repeat)."""
    mean_context: float
    """Mean committed length at a decode step (prompt + half the generated tokens)."""
    prompts: int
    identical: int
    """Prompts whose speculative tokens equal AR's."""
    repeats: int
    clock: str = "wall"

    @property
    def measured_speedup(self) -> float:
        return self.spec.tok_s / self.ar.tok_s if self.ar.tok_s else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "ar": self.ar.to_dict(),
            "spec": self.spec.to_dict(),
            "measured_speedup": self.measured_speedup,
            "acceptance": self.stats.to_dict(),
            "mean_context": self.mean_context,
            "prompts": self.prompts,
            "identical_to_ar": self.identical,
            "repeats": self.repeats,
            "clock": self.clock,
            "note": "decode only (prefill and its token excluded); medians over repeats",
        }


def _decode_once(
    engine: SpecEngine, ids: Sequence[int], max_new: int, eos: Sequence[int], clock: str
) -> tuple[list[int], AcceptanceStats, float, dict[str, float]]:
    """One generation: (tokens, stats, decode seconds, phase seconds during decode).

    ``wall``: the engine's own phase timers (prefill excluded). ``process``: CPU seconds of the
    generation minus those of a prefill-only generation of the same prompt; the (small) draft
    and commit phases are scaled from wall to CPU time by the same ratio.
    """
    engine.times = PhaseTimes()
    now = CLOCKS[clock]
    c0 = now()
    res = engine.generate([ids], max_new, eos)[0]
    cpu = now() - c0
    t = engine.times
    wall = t.total() - t.prefill
    phases = {"draft": t.draft, "verify": t.verify, "commit": t.commit}
    if clock == "wall":
        return res.tokens, res.stats, wall, phases
    c0 = now()
    engine.generate([ids], 1, eos)  # prefill and its token only
    decode = max(cpu - (now() - c0), 0.0)
    scale = decode / wall if wall else 1.0
    return res.tokens, res.stats, decode, {k: v * scale for k, v in phases.items()}


def run_engines(
    ar_engine: SpecEngine,
    spec_engine: SpecEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    repeats: int = 1,
    between: Callable[[], None] | None = None,
    clock: str = "wall",
) -> RunMeasurement:
    """Decode each prompt with AR then speculative, ``repeats`` times, alternating;
    ``between()`` runs after every (prompt, repeat) pair (e.g. a round of component timings)."""
    ar, spec = EngineRun(), EngineRun()
    stats = AcceptanceStats()
    identical, ctx_sum, ctx_n = 0, 0.0, 0
    for ids in prompts:
        per: dict[str, list[tuple[float, dict[str, float], int, int]]] = {"ar": [], "spec": []}
        toks: dict[str, list[int]] = {}
        for rep in range(repeats):
            for name, engine in (("ar", ar_engine), ("spec", spec_engine)):
                tokens, st, decode_s, phases = _decode_once(
                    engine, ids, max_new_tokens, eos_ids, clock
                )
                per[name].append((decode_s, phases, st.cycles, len(tokens) - 1))
                toks[name] = tokens
                if name == "spec" and rep == 0:
                    stats.merge(st)
            if between is not None:
                between()
        identical += int(toks["ar"] == toks["spec"])
        n_new = len(toks["spec"])
        ctx_sum += (len(ids) + n_new / 2) * n_new
        ctx_n += n_new
        for name, run in (("ar", ar), ("spec", spec)):
            rows = per[name]
            run.seconds += statistics.median(r[0] for r in rows)
            for phase in ("draft", "verify", "commit"):
                run.phases[phase] = run.phases.get(phase, 0.0) + statistics.median(
                    r[1][phase] for r in rows
                )
            run.cycles += rows[0][2]
            run.tokens += rows[0][3]
    return RunMeasurement(
        ar=ar,
        spec=spec,
        stats=stats,
        mean_context=ctx_sum / ctx_n if ctx_n else 0.0,
        prompts=len(prompts),
        identical=identical,
        repeats=repeats,
        clock=clock,
    )


@torch.inference_mode()
def time_device_accept(k: int, device: torch.device, rounds: int = 5) -> float:
    """Seconds of the static engine's on-device accept + commit over k drafts (a CUDA graph on
    a GPU, as the engine replays it)."""
    from specpilot.engine.device_state import DecodeState, accept_and_commit

    st = DecodeState.allocate(1, 256, max(k, 1), device)
    st.active.fill_(1)

    def fn() -> None:  # commits grow committed_len; writes past the capacity are clamped
        accept_and_commit(st, k)

    run: Thunk = _graph(fn, device) if device.type == "cuda" else fn
    return time_rounds({"a": run}, device, rounds, iters=10)["a"]
