"""Measurements: per-component times of the engine's forward (the run itself: ``costmodel/run.py``).

Component times come from the closures of ``components`` (the engine's own :class:`Forward`,
the step's shapes), timed in interleaved rounds so that a noisy machine (shared CPU cores) shifts
every component alike, and summarised by the median. CPU: ``perf_counter`` around single calls.
CUDA (the engine replays graphs): each closure is captured in a CUDA graph and replayed in bursts
between events; eager on CUDA (``--no-graphs``): the same bursts without capture.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specpilot.costmodel.components import (
    ForwardPieces,
    Thunk,
    attention_length,
    forward_pieces,
    random_cache,
)
from specpilot.engine import Engine
from specpilot.engine.accept import accept_and_commit
from specpilot.engine.rows import RowState
from specpilot.models.forward import Forward
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


def capture_graph(fn: Thunk, device: torch.device, pool: Any = None) -> Thunk:
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream); returns its replay.

    ``pool``: a ``torch.cuda.graph_pool_handle()`` shared by graphs that replay one at a time on
    one stream (as the engine's :class:`~specpilot.engine.runner.Runner` does). Keep every graph
    of a pool alive while more are captured into it: when its last graph is freed torch releases
    the pool, and a capture into the same handle then fails an allocator assert."""
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
