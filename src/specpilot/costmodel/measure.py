"""Measurements: per-component times of the engine's forward, and a real AR-vs-speculative run.

Component times come from the closures of ``components`` (the engine's own :class:`Forward`,
the step's shapes), timed in interleaved rounds so that a noisy machine (shared CPU cores) shifts
every component alike, and summarised by the median. CPU: ``perf_counter`` around single calls.
CUDA (the engine replays graphs): each closure is captured in a CUDA graph and replayed in bursts
between events; eager on CUDA (``--no-graphs``): the same bursts without capture.

The run (:func:`run_engines`) decodes every prompt with the stock AR engine and the speculative
engine through :func:`~specpilot.engine.scheduler.generate`, alternating, and keeps decode-only
figures (prefill excluded, its token not counted) from the engine's own timers
(:class:`~specpilot.engine.types.CycleTimes`): tokens, wall seconds, cycles and the draft /
verify / accept / other split of the speculative engine (its ``profile`` timers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specpilot.costmodel.components import (
    ForwardPieces,
    Thunk,
    attention_length,
    forward_pieces,
    random_cache,
)
from specpilot.engine import AcceptanceStats, Engine, generate
from specpilot.engine.accept import accept_and_commit
from specpilot.engine.rows import RowState
from specpilot.models.forward import Forward
from specpilot.models.transformer import Transformer
from specpilot.timing import time_burst

PHASES = ("draft", "verify", "accept", "other")
"""The engine's decode-time split (``CycleTimes``): other = wall − draft − verify − accept."""


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


def capture_graph(fn: Thunk, device: torch.device, pool: Any = None) -> Thunk:
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream); returns its replay.

    ``pool``: a ``torch.cuda.graph_pool_handle()`` shared by graphs that replay one at a time on
    one stream (as the engine's :class:`~specpilot.engine.runner.Runner` does)."""
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


def as_forward(source: Forward | Transformer) -> Forward:
    """The forward to time: an engine's ``fwd``, or a model's default one (what
    ``Engine(model)`` builds: fused Triton kernels on CUDA, torch references on the CPU)."""
    return source if isinstance(source, Forward) else Forward(source)


class ForwardTimer:
    """Component and whole-forward timings of a :class:`Forward` at several widths, one context.

    Each :meth:`round` takes one sample of every (width, component) and of every whole forward;
    :meth:`results` keeps the medians. Rounds can be interleaved with a real run (``profile``
    does, between prompts) so that a shared, noisy machine affects both alike. ``graphs``: time
    the pieces as CUDA-graph replays, as the engine runs them (default: on CUDA);
    :meth:`for_engine` takes the forward, runner mode and attention bucket of an engine.

    Under graphs every width's pieces are built first (in ``__init__``); each round then captures
    one width's pieces, replays, times and drops them before the next width is captured. The
    other order (build width 1, capture it, then build and capture width 17, then replay width 1)
    crashed on the H200 with an illegal memory access in width 1's first GEMM piece (llama3-8b,
    32 layers; 2 layers or one width did not), with the old static forward; building every piece
    before any capture did not crash (``bench/graph_capture_check.py``). Capture costs
    milliseconds per piece and stays outside the timed bursts.
    """

    def __init__(
        self,
        source: Forward | Transformer,
        widths: Sequence[int],
        context: int,
        graphs: bool | None = None,
        attn_bucket: int = 128,
        clock: str = "wall",
        capacity: int | None = None,
    ) -> None:
        """``capacity``: KV slots of the cache the pieces attend over (the engine's slots;
        default: the widest forward's attention length). One cache serves every width."""
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        self.fwd = as_forward(source)
        self.context, self.clock = context, clock
        self.device = self.fwd.model.device
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device; time eagerly on the CPU.")
        self.attn_bucket = attn_bucket
        self.iters = 10 if cuda else 1
        self._fns: dict[int, dict[str, Thunk]] = {}
        self.attn_lens: dict[int, int] = {}
        widest = attention_length(max(widths), context, self.graphs, attn_bucket)
        with torch.inference_mode():
            cache = random_cache(self.fwd.model, capacity or widest)
            for w in sorted(set(widths)):
                pieces: ForwardPieces = forward_pieces(
                    self.fwd, w, context, self.graphs, attn_bucket, cache=cache
                )
                fns = {**pieces.components, "__forward__": pieces.forward}
                for fn in fns.values():  # warm-up (Triton JIT, cuBLAS handles)
                    fn()
                self._fns[w] = fns
                self.attn_lens[w] = pieces.attn_len
        self._samples: dict[int, dict[str, list[float]]] = {
            w: {name: [] for name in fns} for w, fns in self._fns.items()
        }
        self.rounds = 0

    @classmethod
    def for_engine(
        cls, engine: Engine, widths: Sequence[int], context: int, clock: str = "wall"
    ) -> ForwardTimer:
        """The pieces ``engine`` runs: its forward, its runner's mode, its attention bucket, a
        cache as long as its rows' (``engine.slots``)."""
        graphs, bucket = engine.runner.use_graphs, engine.attn_bucket
        return cls(engine.fwd, widths, context, graphs, bucket, clock, engine.slots)

    @property
    def widths(self) -> list[int]:
        return list(self._fns)

    @torch.inference_mode()
    def round(self) -> None:
        for w, fns in self._fns.items():
            runs = fns
            if self.graphs:
                pool = torch.cuda.graph_pool_handle()
                runs = {name: capture_graph(fn, self.device, pool) for name, fn in fns.items()}
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
    source: Forward | Transformer,
    tokens: int,
    context: int,
    rounds: int = 5,
    graphs: bool | None = None,
) -> ForwardTimes:
    """Per-component and whole-forward times of one forward shape."""
    return measure_forwards(source, [tokens], context, rounds, graphs=graphs)[tokens]


def measure_forwards(
    source: Forward | Transformer,
    widths: Sequence[int],
    context: int,
    rounds: int = 5,
    clock: str = "wall",
    graphs: bool | None = None,
    attn_bucket: int = 128,
    capacity: int | None = None,
) -> dict[int, ForwardTimes]:
    timer = ForwardTimer(source, widths, context, graphs, attn_bucket, clock, capacity)
    for _ in range(rounds):
        timer.round()
    return timer.results()


@torch.inference_mode()
def time_device_accept(
    k: int, device: torch.device, rounds: int = 5, graphs: bool | None = None, clock: str = "wall"
) -> float:
    """Seconds of the engine's on-device accept + commit over ``k`` drafts of one row
    (``engine/accept.py``; a CUDA-graph replay on CUDA unless ``graphs=False``)."""
    st = RowState.allocate(1, 256, max(k, 1), device)
    st.active.fill_(1)

    def fn() -> None:  # commits grow committed_len; writes past the capacity are clamped
        accept_and_commit(st, k)

    use_graphs = device.type == "cuda" if graphs is None else graphs
    run: Thunk = capture_graph(fn, device) if use_graphs else fn
    return time_rounds({"a": run}, device, rounds, iters=10, clock=clock)["a"]


# ---------------------------------------------------------------------- a real run
@dataclass(slots=True)
class EngineRun:
    """Decode-only totals of one engine over a prompt set (medians over repeats per prompt)."""

    tokens: int = 0
    """Decode tokens: committed tokens after prefill's first."""
    seconds: float = 0.0
    cycles: int = 0
    """Verify forwards (AR: steps)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds in the engine's phases during decode (``PHASES``; 0 without profile timers)."""
    rows_verified: int = 0
    """Packed rows verified (packed and tree plans; bucket padding included), else 0."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_s(self) -> float:
        """Seconds per cycle (AR: per step)."""
        return self.seconds / self.cycles if self.cycles else 0.0

    def per_cycle(self, phase: str) -> float:
        return self.phases.get(phase, 0.0) / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "cycles": self.cycles,
            "tok_s": self.tok_s,
            "phases_s": dict(self.phases),
            "rows_verified": self.rows_verified,
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
    """Prompts whose speculative tokens equal AR's (every repeat of both)."""
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


@dataclass(slots=True)
class _Once:
    tokens: list[int]
    stats: AcceptanceStats
    seconds: float
    phases: dict[str, float]
    cycles: int
    rows_verified: int


def _decode_once(
    engine: Engine, ids: Sequence[int], max_new: int, eos: Sequence[int], clock: str
) -> _Once:
    """One generation through the scheduler; decode-only seconds and phases.

    ``wall``: the engine's own timers (``CycleTimes.wall``: decode steps only, prefill and
    simulated-acceptance reference runs excluded). ``process``: CPU seconds of the generation
    minus those of a prefill-only generation of the same prompt; the phases are scaled from
    wall to CPU time by the same ratio.
    """
    now = CLOCKS[clock]
    c0 = now()
    res = generate(engine, [ids], max_new, eos)[0]
    cpu = now() - c0
    t = engine.times
    phases = {"draft": t.draft, "verify": t.verify, "accept": t.accept, "other": t.other}
    rows = int(getattr(engine.plan, "rows_verified", 0) or 0)
    once = _Once(res.tokens, res.stats, t.wall, phases, t.cycles, rows)
    if clock == "wall":
        return once
    c0 = now()
    generate(engine, [ids], 1, eos)  # prefill and its token only
    decode = max(cpu - (now() - c0), 0.0)
    scale = decode / t.wall if t.wall else 1.0
    once.seconds = decode
    once.phases = {k: v * scale for k, v in phases.items()}
    return once


def run_engines(
    ar_engine: Engine,
    spec_engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    repeats: int = 1,
    between: Callable[[], None] | None = None,
    clock: str = "wall",
) -> RunMeasurement:
    """Decode each prompt with AR then speculative, ``repeats`` times, alternating;
    ``between()`` runs after every (prompt, repeat) pair (e.g. a round of component timings)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    ar, spec = EngineRun(), EngineRun()
    stats = AcceptanceStats()
    identical, ctx_sum, ctx_n = 0, 0.0, 0
    for ids in prompts:
        per: dict[str, list[_Once]] = {"ar": [], "spec": []}
        for rep in range(repeats):
            for name, engine in (("ar", ar_engine), ("spec", spec_engine)):
                once = _decode_once(engine, ids, max_new_tokens, eos_ids, clock)
                per[name].append(once)
                if name == "spec" and rep == 0:
                    stats.merge(once.stats)
            if between is not None:
                between()
        want = per["ar"][0].tokens
        identical += int(all(r.tokens == want for r in per["ar"] + per["spec"]))
        n_new = len(per["spec"][0].tokens)
        ctx_sum += (len(ids) + n_new / 2) * n_new
        ctx_n += n_new
        for name, run in (("ar", ar), ("spec", spec)):
            rows = per[name]
            run.seconds += statistics.median(r.seconds for r in rows)
            for phase in PHASES:
                run.phases[phase] = run.phases.get(phase, 0.0) + statistics.median(
                    r.phases[phase] for r in rows
                )
            run.cycles += rows[0].cycles
            run.tokens += len(rows[0].tokens) - 1
            run.rows_verified += rows[0].rows_verified
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
