"""Evaluate candidate engines: speed against plain AR measured interleaved in one process, a
cost-model sanity bound, and the token-forcing gate.

The stock target (no mechanism) is loaded once per evaluator; it runs the AR baseline and is the
reference for token forcing. A candidate that enables mechanisms gets a freshly loaded target,
since mechanisms modify the model they are applied to. Candidates are built through the same
composition root as every command (``engine/build.py``), so what is measured is what serves:
on CUDA the engine on CUDA graphs, eager on the CPU.

Measurement (``bench/protocol.py``): every arm — the AR baseline and each candidate of a chunk —
is warmed up (on CUDA graphs the whole workload once, so that every graph is captured before the
clock starts; eagerly a short run), then the arms run the workload in ``rounds`` interleaved
rounds. A candidate's speedup is the median of its per-round ratios over AR, with their spread.
A speedup that the cost model cannot explain — above ``τ · t_AR / (t_draft + t_verify)``
(``costmodel/bound.py``: every cycle costs at least one target forward as wide as what it
commits) by more than the noise — is measured again; if it persists the trial is an
**anomaly**: reported, never a winner.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specpilot.bench.protocol import Measurement, Ratio, Sample, interleave, timed
from specpilot.costmodel.bound import FORMULA, engine_speedup_bound
from specpilot.engine import AcceptanceStats, Engine, GenerationResult, generate
from specpilot.engine.build import build_engine
from specpilot.engine.config import EngineConfig
from specpilot.forcing import ForcingReport, force_tokens
from specpilot.runtime import (
    LoadedModel,
    free_device_memory,
    load_model,
    parse_device,
    parse_dtype,
)
from specpilot.tune.space import describe

if TYPE_CHECKING:
    from specpilot.memory.store import TrialRow

ANOMALY_SLACK = 0.05
"""Margin over the cost-model bound (AR's own per-step overhead) before a speedup is suspect."""


@dataclass(slots=True)
class TrialResult:
    config: EngineConfig
    tok_s: float
    speedup: float
    """Median over rounds of candidate tok/s over AR tok/s, measured interleaved."""
    tau: float
    """Mean accepted length, bonus included."""
    acceptance: list[float]
    forcing_ok: bool
    forcing: dict[str, Any]
    device_seconds: float
    wall_seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    rounds: list[float] = field(default_factory=list)
    """The speedup of every counted round (the spread is their range)."""
    bound: float | None = None
    """Most speedup the cost model allows this trial (τ · t_AR / t_forward)."""
    anomaly: str | None = None
    """Why the speedup could not be explained, when it could not: then it is never a winner."""
    worker: str = "local"
    """The worker that measured it: ``local`` (this process) or a Ray actor's name (``w0``...)."""
    busy_seconds: float = 0.0
    """Seconds its worker spent on it, as the executor measured them (``tune/usage.py``)."""

    @property
    def ratio(self) -> Ratio:
        return Ratio(list(self.rounds) or [self.speedup])

    @property
    def eligible(self) -> bool:
        """Passed token forcing, built and ran, and its speedup is explained by the cost model."""
        return self.forcing_ok and self.error is None and self.anomaly is None

    @property
    def rejected(self) -> bool:
        """Ran to the end and token forcing found a mismatch (a build or run failure is not this)."""
        return not self.forcing_ok and self.error is None

    def spread_text(self) -> str:
        return self.ratio.text()

    def verdict(self) -> str:
        """``ok``, or why not: failed (not run to the end), rejected by token forcing, anomaly."""
        if self.error is not None:
            return f"FAILED: {self.error}"
        if not self.forcing_ok:
            return f"REJECTED by token forcing {self.forcing}"
        if self.anomaly is not None:
            return f"ANOMALY: {self.anomaly}"
        return "ok"

    @classmethod
    def from_row(cls, config: EngineConfig, row: TrialRow) -> TrialResult:
        """A trial recorded earlier (``tune --resume``), as stored: nothing is spent on it now."""
        m = row.metrics
        return cls(
            config=config,
            tok_s=m["tok_s"],
            speedup=m["speedup"],
            tau=m["tau"],
            acceptance=m["acceptance"],
            forcing_ok=row.forcing_ok,
            forcing=row.forcing,
            device_seconds=0.0,
            wall_seconds=0.0,
            phase_seconds=m.get("phase_seconds", {}),
            error=m.get("error"),
            rounds=list(m.get("speedup_rounds", [])),
            bound=m.get("bound"),
            anomaly=m.get("anomaly"),
            worker=m.get("worker", "local"),
        )

    def metrics(self) -> dict[str, Any]:
        return {
            "tok_s": self.tok_s,
            "speedup": self.speedup,
            "speedup_rounds": list(self.rounds),
            "tau": self.tau,
            "acceptance": self.acceptance,
            "phase_seconds": self.phase_seconds,
            "bound": self.bound,
            "anomaly": self.anomaly,
            "error": self.error,
            "worker": self.worker,
            "busy_seconds": self.busy_seconds,
        }


def forcing_summary(report: ForcingReport) -> dict[str, Any]:
    """The gate's verdict as stored with a trial: counts, and the first mismatch if any."""
    first = report.first_mismatch()
    forcing: dict[str, Any] = {
        "matches": report.matches,
        "near_ties": report.near_ties,
        "mismatches": report.mismatches,
    }
    if first is not None:
        forcing["first_mismatch"] = {
            "sequence": first[0],
            "position": first[1].position,
            "token": first[1].token,
            "top5": first[1].top5,
        }
    return forcing


@dataclass(slots=True)
class _Candidate:
    config: EngineConfig
    engine: Any  # what ``Evaluator.workload`` runs (an Engine, or a Scheduler in batched mode)
    setup_s: float
    """Seconds to build and warm it up."""
    error: str | None = None


class Evaluator:
    """Holds the stock target, the tuning prompts and the AR baseline; evaluates candidates."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        max_context: int = 8192,
        graphs: bool | None = None,
        rounds: int = 3,
    ) -> None:
        dep = base.deployment
        self.base = base
        self.dtype, self.device = parse_dtype(dep.dtype), parse_device(dep.device)
        self.max_context = max_context
        self.graphs = graphs
        self.rounds = rounds
        self.progress: Callable[[str], None] | None = None
        """Told of each candidate built and each round measured, as it happens."""
        self.stock: LoadedModel = load_model(dep.target, self.dtype, self.device, max_context)
        tensors = {t.data_ptr(): t for t in self.stock.model.state_dict().values()}  # tied once
        self.target_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        """Bytes of one copy of the target (what each candidate with mechanisms loads anew)."""
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        tok = self.stock.tokenizer
        self.eos_ids = tok.eos_token_ids if tok is not None else self.stock.model.cfg.eos_token_ids
        self.baseline = self.make_baseline()
        self.warm(self.baseline)
        self.ar_tok_s = self.workload(self.baseline).tok_s

    # ------------------------------------------------------------------ workload (single mode)
    def make_baseline(self) -> Any:
        return Engine(self.stock.model, graphs=self.graphs)

    def make_candidate(self, config: EngineConfig) -> Any:
        target = self.stock if not config.mechanisms else None
        build = build_engine(config, self.max_context, target=target, graphs=self.graphs)
        return build.engine(profile=True)

    def workload(self, engine: Any) -> Sample:
        """Every tuning prompt once, one request at a time; payload: (results, phase times)."""
        eng: Engine = engine
        eng.times = type(eng.times)()

        def run() -> tuple[int, Any]:
            out: list[GenerationResult] = []
            for p in self.prompts:
                out += generate(eng, [p], self.max_new_tokens, self.eos_ids)
            return sum(len(r.tokens) for r in out), out

        sample = timed(self.device, run, lambda: eng.times.excluded)
        sample.payload = (sample.payload, eng.times.to_dict())
        return sample

    def warm(self, engine: Any) -> None:
        """Keep graph capture, autotune and allocation out of the timed rounds: on CUDA graphs
        the whole workload once (every graph it needs gets captured), eagerly a short run."""
        if self._runner(engine).use_graphs:
            self.workload(engine)
        else:
            generate(self._engine(engine), [self.prompts[0][-16:]], 8, self.eos_ids)

    def results(self, sample: Sample) -> list[tuple[str, list[int], list[int]]]:
        """(id, prompt, committed tokens) of every sequence a sample produced, for forcing."""
        out, _ = sample.payload
        return [(str(i), r.prompt_ids, r.tokens) for i, r in enumerate(out)]

    def stats(self, sample: Sample) -> tuple[AcceptanceStats, dict[str, float]]:
        out, times = sample.payload
        stats = AcceptanceStats()
        for r in out:
            stats.merge(r.stats)
        return stats, times

    @staticmethod
    def _engine(engine: Any) -> Engine:
        return engine if isinstance(engine, Engine) else engine.engine

    def _runner(self, engine: Any) -> Any:
        return self._engine(engine).runner

    def _ar_step(self) -> float:
        """Seconds of the stock AR step (one width-1 forward, replayed as the baseline runs
        it), timed next to the candidates it bounds."""
        return self._engine(self.baseline).time_forward(1, iters=10)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, config: EngineConfig) -> TrialResult:
        return self.evaluate_many([config])[0]

    def evaluate_many(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        """Build every candidate, warm each up, then measure them all interleaved with one AR
        baseline arm (its rounds are shared by the group). A candidate with mechanisms holds its
        own copy of the target: when the device has no room for another copy, the candidates
        built so far are measured and freed first, and the rest form the next group."""
        pending, out = list(configs), []
        while pending:
            cands = self._build_group(pending)
            out += self._measure(cands)
            del cands  # the group's engines (CUDA graphs, target copies) before the next group
            free_device_memory(self.device)
        return out

    def _build_group(self, pending: list[EngineConfig]) -> list[_Candidate]:
        """Build candidates from the front of ``pending`` (popped) while the device has room."""
        cands: list[_Candidate] = []
        while pending:
            c = pending[0]
            if cands and not self._room_for(c):
                self._say(f"no device memory for another candidate now: {len(cands)} measured "
                          f"first, {len(pending)} after them")  # fmt: skip
                break
            pending.pop(0)
            t0 = time.perf_counter()
            try:  # a candidate that cannot be built or run is a failed trial, not a crash
                engine = self.make_candidate(c)
                self.warm(engine)
                cands.append(_Candidate(c, engine, time.perf_counter() - t0))
                self._say(f"built and warmed up {describe(c)} ({time.perf_counter() - t0:.0f}s)")
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                cands.append(_Candidate(c, None, time.perf_counter() - t0, msg))
                free_device_memory(self.device)  # what the failed build had allocated
        return cands

    def _room_for(self, config: EngineConfig) -> bool:
        """Whether the device can hold one more candidate: a copy of the target (mechanisms
        modify the model) with a quarter more for its caches and graphs, plus 2 GiB."""
        if self.device.type != "cuda" or not config.mechanisms:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)  # the driver's, less what torch caches
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free >= 1.25 * self.target_bytes + (2 << 30)

    def _measure(self, cands: list[_Candidate]) -> list[TrialResult]:
        live = {f"c{i}": cd for i, cd in enumerate(cands) if cd.error is None}
        arms: dict[str, Callable[[], Sample]] = {"ar": lambda: self.workload(self.baseline)}
        for name, cd in live.items():
            arms[name] = functools.partial(self.workload, cd.engine)
        t0 = time.perf_counter()
        on_round = functools.partial(self._round_done, list(live))
        m = interleave(arms, self.rounds, warmup=0, on_round=on_round) if live else Measurement()
        share = (time.perf_counter() - t0) / max(len(live), 1)  # the AR rounds are shared
        ar_step = self._ar_step() if live else 0.0
        out = []
        for i, cd in enumerate(cands):
            if cd.error is not None:
                out.append(self._failed(cd.config, cd.error, cd.setup_s))
                continue
            out.append(self._judge(cd, f"c{i}", m, share, ar_step))
        return out

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def _round_done(self, names: list[str], r: int, got: dict[str, Sample]) -> None:
        ar = got["ar"].tok_s
        ratios = ", ".join(f"{got[n].tok_s / ar:.2f}x" if ar > 0 else "?" for n in names)
        self._say(f"timing round {r + 1}/{self.rounds}: AR {ar:.1f} tok/s; candidates {ratios}")

    def _judge(
        self, cd: _Candidate, name: str, m: Measurement, share: float, ar_step: float
    ) -> TrialResult:
        ratio, sample = m.ratio(name, "ar"), m.last(name)
        stats, times = self.stats(sample)
        tau = max(stats.mean_accepted_len, 1.0)
        bound = engine_speedup_bound(self._engine(cd.engine), tau, ar_step, iters=10).bound
        anomaly = None
        if ratio.median > bound * (1 + ANOMALY_SLACK + 2 * ratio.noise):
            again = interleave(
                {
                    "ar": lambda: self.workload(self.baseline),
                    name: lambda: self.workload(cd.engine),
                },
                self.rounds,
                warmup=0,
            )
            ratio = again.ratio(name, "ar")
            if ratio.median > bound * (1 + ANOMALY_SLACK + 2 * ratio.noise):
                anomaly = (
                    f"measured {ratio.text()} over AR twice, but the cost model allows at most "
                    f"{bound:.2f}x at τ {tau:.2f} ({FORMULA}); not a result"
                )
        t0 = time.perf_counter()
        report = force_tokens(self.stock.model, self.results(sample))
        wall = cd.setup_s + share + time.perf_counter() - t0
        return TrialResult(
            config=cd.config,
            tok_s=m.tok_s(name),
            speedup=ratio.median,
            tau=tau,
            acceptance=stats.acceptance_rates(),
            forcing_ok=report.ok,
            forcing=forcing_summary(report),
            device_seconds=wall if self.device.type == "cuda" else 0.0,
            wall_seconds=wall,
            phase_seconds=dict(times),
            rounds=list(ratio.values),
            bound=bound,
            anomaly=anomaly,
        )

    def _failed(self, config: EngineConfig, message: str, wall: float) -> TrialResult:
        return failed_trial(config, message, wall)


def failed_trial(
    config: EngineConfig, message: str, wall_seconds: float, worker: str = "local"
) -> TrialResult:
    """A trial that could not be built or run to the end: reported with why, never a winner."""
    return TrialResult(
        config=config,
        tok_s=0.0,
        speedup=0.0,
        tau=0.0,
        acceptance=[],
        forcing_ok=False,
        forcing={"error": message},
        device_seconds=0.0,
        wall_seconds=wall_seconds,
        error=message,
        worker=worker,
    )
