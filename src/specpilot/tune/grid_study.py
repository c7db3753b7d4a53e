"""Issue 5's study of the search loop: an exhaustive grid of a small search space against the loop
on a fraction of the grid's seconds, and a warm start (memory of a similar deployment) against a
cold one. ``bench/tune_targets.py`` runs it on the CPU (SmolLM2) and the GPU (8B shape, simulated
acceptance); a setting supplies the base config, the directions and a ``make(workload)`` that
returns a measure function and the AR speed."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.explorers import optuna_available
from specpilot.tune.loop import TuneLoop, TuneOutcome, TuneSettings
from specpilot.tune.space import Direction, config_hash, describe

Measure = Callable[[EngineConfig], TrialResult]


def set_knobs(field: str) -> Callable[[EngineConfig, dict[str, Any]], EngineConfig]:
    """A derive that writes the given knobs into ``k`` or ``drafter_knobs``."""

    def derive(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
        knobs = dict(base.drafter_knobs)
        k = base.k
        for name, v in p.items():
            if name == "k":
                k = int(v)
            else:
                knobs[name] = v
        if field == "ngram":  # sizes are an unordered pair: (2, 4) and (4, 2) are one config
            lo, hi = sorted((int(knobs["min_n"]), int(knobs["max_n"])))
            knobs.update(min_n=lo, max_n=hi)
        return dataclasses.replace(base, k=k, drafter_knobs=knobs)

    return derive


def grid(base: EngineConfig, directions: Sequence[Direction]) -> list[EngineConfig]:
    """Every distinct config reachable by setting every knob of every direction."""
    out: dict[str, EngineConfig] = {}
    axes = [
        (
            d,
            [
                dict(zip([k.name for k in d.params], vs, strict=True))
                for vs in itertools.product(*[k.choices for k in d.params])
            ],
        )
        for d in directions
    ]
    for combo in itertools.product(*[vals for _, vals in axes]):
        cfg = base
        for (d, _), p in zip(axes, combo, strict=True):
            cfg = d.derive(cfg, p)
        out.setdefault(config_hash(cfg), cfg)
    return list(out.values())


class MeasureExecutor:
    """The loop's ``Executor`` over a measure function (one candidate at a time)."""

    width = 1

    def __init__(self, measure: Measure, ar_tok_s: float) -> None:
        self.measure, self.ar_tok_s = measure, ar_tok_s

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        return [self.measure(c) for c in configs]

    def close(self) -> None:
        pass


def result(
    cfg: EngineConfig,
    tok_s: float,
    ar_tok_s: float,
    tau: float,
    ok: bool,
    forcing: dict[str, Any],
    cost_s: float,
) -> TrialResult:
    speedup = tok_s / ar_tok_s
    return TrialResult(
        config=cfg,
        tok_s=tok_s,
        speedup=speedup,
        tau=tau,
        acceptance=[],
        forcing_ok=ok,
        forcing=forcing,
        device_seconds=cost_s,
        wall_seconds=cost_s,
        rounds=[speedup] * 3,  # one measurement taken as exact: the grid study needs no noise rule
    )


def run_loop(
    base: EngineConfig,
    directions: Sequence[Direction],
    measure: Measure,
    ar_tok_s: float,
    store: MemoryStore,
    fp: Fingerprint,
    budget_s: float,
    args: argparse.Namespace,
    tag: str,
) -> TuneOutcome:
    settings = TuneSettings(
        rounds=50,
        trials_per_direction=args.trials,
        directions_per_round=len(directions),
        budget_seconds=budget_s,
        min_gain=args.min_gain,
        seed=args.seed,
        explorer=args.explorer,
        patience=args.patience,
    )
    loop = TuneLoop(
        base,
        directions,
        MeasureExecutor(measure, ar_tok_s),
        store,
        fp,
        tag,
        settings,
        log=lambda m: print(f"[{tag}] {m}", flush=True),
    )
    return loop.run()


def time_to(outcome: TuneOutcome, speed: float) -> float | None:
    """Cost seconds until the first passing trial at ``speed`` or faster."""
    spent = 0.0
    for t in outcome.trials:
        spent += t.result.wall_seconds
        if t.result.forcing_ok and t.result.tok_s >= speed:
            return spent
    return None


def study(
    args: argparse.Namespace,
    setting: str,
    base: EngineConfig,
    directions: Sequence[Direction],
    make: Callable[[Any], tuple[Measure, float]],
    workloads: dict[str, Any],
    fp_a: Fingerprint,
    clock: str,
) -> dict[str, Any]:
    start = time.perf_counter()
    measure, ar_tok_s = make(workloads["A"])
    configs = grid(base, directions)
    random.Random(args.seed).shuffle(configs)
    print(f"[{setting}] grid of {len(configs)} configs; AR {ar_tok_s:.1f} tok/s", flush=True)
    table: dict[str, TrialResult] = {}
    t0 = time.perf_counter()
    for i, cfg in enumerate(configs):
        r = measure(cfg)
        table[config_hash(cfg)] = r
        print(
            f"[{setting}] grid {i + 1}/{len(configs)} {describe(cfg)}: {r.tok_s:.1f} tok/s "
            f"{'ok' if r.forcing_ok else 'NOT LOSSLESS'}",
            flush=True,
        )
    grid_wall = time.perf_counter() - t0
    grid_cost = sum(r.wall_seconds for r in table.values())
    lossless = all(r.forcing_ok for r in table.values())
    grid_best = max((r for r in table.values() if r.forcing_ok), key=lambda r: r.tok_s)

    with tempfile.TemporaryDirectory() as tmp:

        def loop_on(
            memory: str, measure_fn: Measure, ar: float, fp: Fingerprint, budget: float, tag: str
        ) -> TuneOutcome:
            """One loop run with the memory file ``memory`` (in ``tmp``: new, or kept from before)."""
            with MemoryStore(Path(tmp) / memory) as store:
                return run_loop(
                    base, directions, measure_fn, ar, store, fp, budget, args, f"{setting}/{tag}"
                )

        loop = loop_on("a.sqlite", measure, ar_tok_s, fp_a, args.loop_fraction * grid_wall, "loop")
        loop_cost = sum(t.result.wall_seconds for t in loop.trials)
        in_grid = table.get(config_hash(loop.best.config))
        loop_best_on_grid = in_grid.tok_s if in_grid is not None else float("nan")

        # warm start: deployment B, cold (empty memory) and warm (A's validated result)
        measure_b, ar_b = make(workloads["B"])
        fp_b = dataclasses.replace(fp_a, drafter=fp_a.drafter + " @B")
        budget_b = args.loop_fraction * grid_wall
        cold = loop_on("cold.sqlite", measure_b, ar_b, fp_b, budget_b, "B-cold")
        warm = loop_on("a.sqlite", measure_b, ar_b, fp_b, budget_b, "B-warm")
    ref = max(cold.best.tok_s, warm.best.tok_s) * (1 - args.reach)
    cold_t, warm_t = time_to(cold, ref), time_to(warm, ref)
    return {
        "setting": setting,
        "clock": clock,
        "proposer": args.explorer
        if args.explorer != "auto"
        else ("tpe" if optuna_available() else "local (no optuna)"),
        "ar_tok_s": ar_tok_s,
        "grid": {
            "configs": len(configs),
            "cost_s": grid_cost,
            "wall_s": grid_wall,
            "all_lossless": lossless,
            "best": describe(grid_best.config),
            "best_tok_s": grid_best.tok_s,
            "best_speedup": grid_best.speedup,
            "table": {describe(r.config): r.tok_s for r in table.values()},
        },
        "loop": {
            "trials": len(loop.trials),
            "cost_s": loop_cost,
            "best": describe(loop.best.config),
            "best_tok_s_loop": loop.best.tok_s,
            "best_tok_s_on_grid": loop_best_on_grid,
            "best_fraction_of_grid": loop_best_on_grid / grid_best.tok_s,
            "cost_fraction_of_grid": loop_cost / grid_cost,
            "target": ">= 0.95 of the grid best with <= 0.20 of its seconds",
        },
        "warm_start": {
            "deployment_b": "mt-bench prompts"
            if setting == "cpu"
            else "lower simulated acceptance",
            "reach": f"within {args.reach:.0%} of the better best",
            "cold_s_to_best": cold_t,
            "warm_s_to_best": warm_t,
            # each run's time to its own final best (noise can make the bests differ)
            "cold_s_to_own_best": time_to(cold, cold.best.tok_s),
            "warm_s_to_own_best": time_to(warm, warm.best.tok_s),
            "cold_best_tok_s": cold.best.tok_s,
            "warm_best_tok_s": warm.best.tok_s,
            "cold_best": describe(cold.best.config),
            "warm_best": describe(warm.best.config),
            "warm_reused": warm.reused,
            "ratio": (warm_t / cold_t) if cold_t and warm_t is not None else None,
            "target": "warm <= 0.5 x cold",
        },
        "total_s": time.perf_counter() - start,
    }
