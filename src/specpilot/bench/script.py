"""What the GPU bench scripts under ``bench/`` share: a time budget, a JSON record rewritten after
each section (so a run cut short still leaves its numbers), CUDA-graph capture into one pool,
and sections that report their failure instead of ending the run."""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.records import git_rev
from specpilot.costmodel.measure import capture_graph


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
        self.out: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if self.cuda else "cpu",
            "git": git_rev(),
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            **header,
            "sections": {},
        }

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / self.file_name).write_text(json.dumps(self.out, indent=1))

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
        record its seconds and save."""
        sec = self.out["sections"]
        t = time.perf_counter()
        sec[name] = guarded(fn, echo=True)
        self.out.setdefault("section_s", {})[name] = time.perf_counter() - t
        self.save()
        return sec[name]


__all__ = ["BenchScript", "guarded"]


def finish(res: dict[str, Any], path: Path, started: float, table: Callable[[dict[str, Any]], str]) -> None:  # fmt: skip
    """A kernel script's last step: its wall time into ``res``, ``res`` to ``path``, the short
    table printed last."""
    res["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
