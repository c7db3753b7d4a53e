"""What a search cost, worker by worker: trials, busy seconds, deaths.

Every executor stamps each result it returns with the worker that measured it and the seconds
that worker spent on it (``TrialResult.worker``, ``TrialResult.busy_seconds``) and records it
here. A worker on CUDA holds one GPU, so the busy seconds summed over the workers are the
search's device-seconds (GPU-seconds); on the CPU they are CPU-seconds. Beside the loop's wall
time they say how well the workers were kept busy: ``busy / (workers x wall)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specpilot.tune.evaluate import TrialResult


@dataclass(slots=True)
class WorkerUsage:
    name: str
    trials: int = 0
    """Results it returned (a failed trial counts; a trial lost with it does not)."""
    busy_seconds: float = 0.0
    deaths: int = 0
    """Times its process died; each time its trial in flight went to another worker."""
    restarts: int = 0
    """Times it came back after a death (Ray restarted it; it loaded the target again)."""
    lost: bool = False
    """Gone for good (no restart left, or it did not come back): the pool shrank by one."""


@dataclass(slots=True)
class Usage:
    executor: str
    """``local`` (this process) or ``ray``."""
    device: str
    """What each worker holds: ``cuda`` (one GPU) or ``cpu``."""
    workers: dict[str, WorkerUsage] = field(default_factory=dict)

    @classmethod
    def of(cls, executor: str, device: str, names: Iterable[str]) -> Usage:
        return cls(executor, device, {n: WorkerUsage(n) for n in names})

    @classmethod
    def of_results(cls, executor: str, device: str, results: Iterable[TrialResult]) -> Usage:
        usage = cls(executor, device)
        for r in results:
            usage.record(r)
        return usage

    def record(self, r: TrialResult) -> None:
        w = self.workers.setdefault(r.worker, WorkerUsage(r.worker))
        w.trials += 1
        w.busy_seconds += r.busy_seconds

    @property
    def busy_seconds(self) -> float:
        """Busy seconds summed over every worker (device-seconds on CUDA)."""
        return sum(w.busy_seconds for w in self.workers.values())

    @property
    def unit(self) -> str:
        return "GPU-seconds" if self.device == "cuda" else "CPU-seconds"

    def where(self) -> str:
        n = len(self.workers)
        what = "worker" if n == 1 else "workers"
        if self.executor == "local":
            held = "one GPU" if self.device == "cuda" else "no GPU used"
            return f"{n} {what} (this process, {held})"
        each = "one GPU each" if self.device == "cuda" else "on the CPU, no GPU used"
        return f"{n} {what} (Ray actors, {each})"

    def summary(self, wall_seconds: float) -> str:
        """One line: workers, device-seconds summed over them, wall time, how busy they were."""
        held = len(self.workers) * wall_seconds
        busy = f" ({100 * self.busy_seconds / held:.0f}% of their time)" if held > 0 else ""
        return (
            f"{self.where()}: {self.busy_seconds:.1f} {self.unit} busy summed over them{busy}, "
            f"in {wall_seconds:.1f} s wall time"
        )

    def per_worker(self) -> list[str]:
        """A line per worker: its trials and busy seconds, and its deaths if any."""
        out = []
        for w in self.workers.values():
            fate = f"; died {w.deaths}x" if w.deaths else ""
            if w.restarts:
                fate += f", restarted {w.restarts}x"
            if w.lost:
                fate += ", lost for good" if w.deaths else "; lost for good"
            elif w.deaths > w.restarts:
                fate += ", not back by the end"
            out.append(f"{w.name}: {w.trials} trials, {w.busy_seconds:.1f} s busy{fate}")
        return out

    def to_dict(self, wall_seconds: float) -> dict[str, Any]:
        return {
            "executor": self.executor,
            "device": self.device,
            "workers": len(self.workers),
            "device_seconds": self.busy_seconds,
            "unit": self.unit,
            "wall_seconds": wall_seconds,
            "per_worker": {
                w.name: {
                    "trials": w.trials,
                    "busy_seconds": w.busy_seconds,
                    "deaths": w.deaths,
                    "restarts": w.restarts,
                    "lost": w.lost,
                }
                for w in self.workers.values()
            },
        }
