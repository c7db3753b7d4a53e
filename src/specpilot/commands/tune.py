"""``specpilot tune``: search this deployment for a faster lossless engine, and save it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specpilot.commands.common import add_engine_args, config_from_args
from specpilot.errors import SpecPilotError
from specpilot.loading.fetch import cache_dir


def default_memory() -> Path:
    return cache_dir() / "memory.sqlite"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search lossless mechanisms and knobs for this deployment",
        description="Rounds of: rank the gaps, explore the directions that attack them, evaluate "
        "candidates (every one token-forced), integrate the winners. Writes the tuned engine config, "
        "a report with charts and the price of the search, and updates the memory.",
    )
    p.add_argument(
        "--prompts", default="copy-heavy", help="tuning prompt set (default: %(default)s)"
    )
    p.add_argument(
        "--limit", type=int, default=4, help="prompts used for tuning (default: %(default)s)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="search rounds after the stock round (default: %(default)s)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=3,
        help="candidates per direction and round (default: %(default)s)",
    )
    p.add_argument(
        "--directions",
        type=int,
        default=3,
        help="directions explored per round (default: %(default)s)",
    )
    p.add_argument(
        "--budget", type=float, default=1800.0, help="time budget in seconds (default: %(default)s)"
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="winner margin over the best (default: %(default)s)",
    )
    p.add_argument(
        "--executor", choices=["local", "ray"], default="local", help="(default: %(default)s)"
    )
    p.add_argument(
        "--ray-address", default=None, help="Ray cluster address (default: start a local one)"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="Ray workers (default: one per GPU, or 1)"
    )
    p.add_argument(
        "--memory",
        type=Path,
        default=None,
        help="SQLite memory file (default: <cache>/memory.sqlite)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the last run of this deployment, reusing its finished trials",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/tune"),
        help="output directory (default: %(default)s)",
    )
    p.add_argument(
        "--rank-gaps",
        choices=["profile", "static"],
        default="profile",
        help="order directions by a measured profile of the stock engine (default) or a fixed order",
    )
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from specpilot.bench.prompts import load_prompt_set
    from specpilot.memory import MemoryStore, fingerprint_deployment
    from specpilot.runtime import parse_device
    from specpilot.tune.executors import Executor, LocalExecutor, RayExecutor
    from specpilot.tune.loop import STATIC_GAP_ORDER, TuneLoop, TuneSettings
    from specpilot.tune.report import write_report
    from specpilot.tune.space import directions_for

    if args.threads:
        torch.set_num_threads(args.threads)
    base = config_from_args(args)
    dep = base.deployment
    device = parse_device(dep.device)
    executor: Executor
    prompts_spec = load_prompt_set(args.prompts, args.limit)
    from specpilot.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(dep.target))
    prompts = [tok.apply_chat_template(p.messages) for p in prompts_spec]
    print(
        f"tuning {dep.target} with {dep.drafter} on {device} ({dep.dtype}, {dep.mode}); {len(prompts)} prompts"
    )
    if args.executor == "ray":
        try:
            executor = RayExecutor(
                base, prompts, args.max_new_tokens, args.ray_address, args.workers
            )
        except ImportError:
            raise SpecPilotError(
                "--executor ray needs Ray: pip install 'specpilot[tune]'."
            ) from None
    else:
        executor = LocalExecutor(base, prompts, args.max_new_tokens)
    arch = (
        executor.evaluator.stock.model.cfg.arch if isinstance(executor, LocalExecutor) else "llama"
    )
    fp = fingerprint_deployment(
        dep.target, dep.drafter, dep.draft_model, device, dep.dtype, dep.mode
    )
    label = f"{dep.target} · {dep.drafter} · {fp.device_name} · {dep.dtype} · {dep.mode}"
    settings = TuneSettings(
        rounds=args.rounds,
        trials_per_direction=args.trials,
        directions_per_round=args.directions,
        budget_seconds=args.budget,
        min_gain=args.min_gain,
        seed=args.seed,
    )
    gap_order: tuple[str, ...] = STATIC_GAP_ORDER
    if args.rank_gaps == "profile" and isinstance(executor, LocalExecutor):
        gap_order = profiled_gap_order(executor.evaluator, base, prompts, args.max_new_tokens)
        print(f"gaps ranked by a profile of the stock engine: {', '.join(gap_order)}")
    with MemoryStore(args.memory or default_memory()) as store:
        loop = TuneLoop(
            base,
            directions_for(base, device.type, arch),
            executor,
            store,
            fp,
            label,
            settings,
            gap_order=gap_order,
            resume=args.resume,
        )
        try:
            outcome = loop.run()
        finally:
            executor.close()
    args.out.mkdir(parents=True, exist_ok=True)
    tuned = args.out / "tuned.json"
    outcome.best.config.save(tuned)
    report = write_report(outcome, label, device.type, args.out, tuned)
    print(
        f"tuned: {outcome.best.tok_s:.1f} tok/s, {outcome.best.speedup:.2f}x AR "
        f"({outcome.best.tok_s / outcome.stock.tok_s:.2f}x the stock speculative engine)"
    )
    print(f"engine config: {tuned}\nreport: {report}")
    for r in outcome.reused:
        print(f"reused from memory: {r}")
    return 0


def profiled_gap_order(
    evaluator: Any, base: Any, prompts: list[list[int]], max_new_tokens: int
) -> tuple[str, ...]:
    """Components ordered by the time they lose per generated token in the stock engine (largest
    first), measured by the cost model on the tuning prompts; unranked components follow."""
    from specpilot.costmodel.hardware import measure_ceilings
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.engine.build import build_engine
    from specpilot.tune.loop import STATIC_GAP_ORDER

    build = build_engine(base, target=evaluator.stock)
    ceilings = measure_ceilings(evaluator.device, evaluator.dtype)
    result = profile_engines(
        build.stock_engine(), build.engine(), prompts, max_new_tokens, evaluator.eos_ids, ceilings
    )
    ranked = [g.component for g in result.prediction.gaps() if g.lost_s_per_token > 0]
    return tuple(dict.fromkeys([*ranked, *STATIC_GAP_ORDER]))
