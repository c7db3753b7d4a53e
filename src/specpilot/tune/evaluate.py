"""Evaluate one candidate engine: speed on the tuning prompts, and the token-forcing gate.

The stock target (no mechanism) is loaded once per evaluator and is both the AR baseline and the
reference for token forcing. A candidate that enables mechanisms gets a freshly loaded target,
since mechanisms modify the model they are applied to.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.bench.runner import synchronize, timed_generate, warm_up
from specpilot.engine import AcceptanceStats, SpecEngine
from specpilot.engine.build import build_engine
from specpilot.engine.config import EngineConfig
from specpilot.forcing import ForcingReport, force_tokens
from specpilot.runtime import LoadedModel, load_model, parse_device, parse_dtype


@dataclass(slots=True)
class TrialResult:
    config: EngineConfig
    tok_s: float
    speedup: float
    """Candidate tok/s over the stock AR tok/s measured by the same evaluator."""
    tau: float
    """Mean accepted length, bonus included."""
    acceptance: list[float]
    forcing_ok: bool
    forcing: dict[str, Any]
    device_seconds: float
    wall_seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def metrics(self) -> dict[str, Any]:
        return {
            "tok_s": self.tok_s,
            "speedup": self.speedup,
            "tau": self.tau,
            "acceptance": self.acceptance,
            "phase_seconds": self.phase_seconds,
            "error": self.error,
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


class Evaluator:
    """Holds the stock target and the tuning prompts; evaluates candidate configs one by one."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        max_context: int = 8192,
    ) -> None:
        dep = base.deployment
        self.dtype, self.device = parse_dtype(dep.dtype), parse_device(dep.device)
        self.max_context = max_context
        self.stock: LoadedModel = load_model(dep.target, self.dtype, self.device, max_context)
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        tok = self.stock.tokenizer
        self.eos_ids = tok.eos_token_ids if tok is not None else self.stock.model.cfg.eos_token_ids
        self.ar_tok_s = self._measure_ar()

    def _measure_ar(self) -> float:
        engine = SpecEngine(self.stock.model)
        warm_up([engine], self.prompts[0][-16:], self.eos_ids)
        tokens, seconds = 0, 0.0
        for p in self.prompts:
            res, s = timed_generate(engine, p, self.max_new_tokens, self.eos_ids)
            tokens, seconds = tokens + len(res.tokens), seconds + s
        return tokens / seconds

    def evaluate(self, config: EngineConfig) -> TrialResult:
        t0 = time.perf_counter()
        target = self.stock if not config.mechanisms else None
        try:
            build = build_engine(config, self.max_context, target=target)
        except Exception as e:  # a candidate that cannot be built is a failed trial, not a crash
            return self._failed(config, f"{type(e).__name__}: {e}", t0)
        engine = build.engine()
        engine.time_phases = True
        warm_up([engine], self.prompts[0][-16:], self.eos_ids)
        engine.times = type(engine.times)()
        stats = AcceptanceStats()
        records, tokens, seconds = [], 0, 0.0
        for i, p in enumerate(self.prompts):
            res, s = timed_generate(engine, p, self.max_new_tokens, self.eos_ids)
            stats.merge(res.stats)
            tokens, seconds = tokens + len(res.tokens), seconds + s
            records.append((str(i), p, res.tokens))
        synchronize(self.device)
        report = force_tokens(self.stock.model, records)
        forcing = forcing_summary(report)
        tok_s = tokens / seconds
        wall = time.perf_counter() - t0
        times = engine.times
        return TrialResult(
            config=config,
            tok_s=tok_s,
            speedup=tok_s / self.ar_tok_s,
            tau=stats.mean_accepted_len,
            acceptance=stats.acceptance_rates(),
            forcing_ok=report.ok,
            forcing=forcing,
            device_seconds=wall if self.device.type == "cuda" else 0.0,
            wall_seconds=wall,
            phase_seconds={
                "draft": times.draft,
                "verify": times.verify,
                "commit": times.commit,
                "prefill": times.prefill,
            },
        )

    def _failed(self, config: EngineConfig, message: str, t0: float) -> TrialResult:
        wall = time.perf_counter() - t0
        return TrialResult(
            config=config,
            tok_s=0.0,
            speedup=0.0,
            tau=0.0,
            acceptance=[],
            forcing_ok=False,
            forcing={"error": message},
            device_seconds=0.0,
            wall_seconds=wall,
            error=message,
        )
