"""``specpilot tune``: search this deployment for a faster lossless engine, and save it."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpilot.commands.common import add_engine_args, config_from_args
from specpilot.commands.tune_agent import add_agent_args, connect_agent, kernel_asker, make_team
from specpilot.commands.tune_agent import check as check
from specpilot.commands.tune_compare import compare_reserve_s, write_run
from specpilot.commands.tune_scope import profiled_gaps, scope_notes
from specpilot.errors import SpecPilotError
from specpilot.loading.fetch import cache_dir

if TYPE_CHECKING:
    from specpilot.tune.ray_executor import RayExecutor


def default_memory() -> Path:
    return cache_dir() / "memory.sqlite"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search lossless mechanisms and knobs for this deployment",
        description="Rounds of: rank the gaps, explore the directions that attack them, evaluate "
        "candidates (every one token-forced), integrate the winners. Writes the tuned engine config, "
        "a report with charts and the price of the search, and updates the memory; then compares "
        "tuned vs stock vs AR on held-out prompts. With no flags it tunes the embedded default "
        "(SmolLM2-135M, n-gram and early-exit drafters) within 9 minutes.",
    )
    p.add_argument(
        "--prompts", default="copy-heavy", help="tuning prompt set (default: %(default)s)"
    )
    p.add_argument(
        "--limit", type=int, default=3, help="prompts used for tuning (default: %(default)s)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="most search rounds after the stock round (default: %(default)s)",
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
        "--budget",
        type=float,
        default=540.0,
        help="wall-clock seconds for the whole command, loading, search and final compare "
        "included; the search stops early enough to leave time for the compare (default: %(default)s)",
    )
    p.add_argument(
        "--explorer",
        choices=["auto", "tpe", "local"],
        default="auto",
        help="knob proposer: Optuna TPE, local search (no dependency), or TPE when Optuna is "
        "installed (default: %(default)s)",
    )
    p.add_argument(
        "--compare-limit",
        type=int,
        default=4,
        help="held-out prompts (after the tuning ones) for the final compare; 0 skips it "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="a winner must beat the best by more than both measured spreads and by this "
        "fraction (default: %(default)s)",
    )
    p.add_argument(
        "--measure-rounds",
        type=int,
        default=3,
        help="interleaved rounds of AR and each candidate per trial, after a warm-up; a "
        "speedup is their median with its spread (default: %(default)s)",
    )
    p.add_argument(
        "--executor", choices=["local", "ray"], default="local", help="(default: %(default)s)"
    )
    p.add_argument(
        "--ray-address", default=None, help="Ray cluster address (default: start a local one)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Ray workers, one GPU (or CPU) each (default: every GPU of the cluster, or 1 on the "
        "CPU)",
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
    p.add_argument(
        "--kernel-budget",
        type=float,
        default=None,
        help="seconds for the kernel search (W12 tensor-core tilings per shape and width on this "
        "GPU, kept in the memory by GPU fingerprint; tune/kernel_search.py); default a quarter "
        "of the search budget, at most 120; 0 skips it",
    )
    b = p.add_argument_group("batched mode (continuous batching, docs/TUNE.md 'Batched mode')")
    b.add_argument(
        "--mode",
        choices=["single", "batched"],
        default=None,
        help="single: candidates generate one prompt at a time; batched: they serve a request "
        "stream through the continuous-batching scheduler (default: the engine config's, else "
        "single)",
    )
    b.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="batched: scheduler slots, requests decoded together (default: %(default)s)",
    )
    b.add_argument(
        "--requests",
        type=int,
        default=None,
        help="batched: requests in the stream, tuning prompts cycled (default: 2 x concurrency)",
    )
    add_agent_args(p)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from specpilot.bench.prompts import load_prompt_set
    from specpilot.memory import MemoryStore, fingerprint_deployment
    from specpilot.runtime import parse_device
    from specpilot.tune.evaluate_batched import BatchedStream
    from specpilot.tune.executors import LocalExecutor
    from specpilot.tune.loop import STATIC_GAP_ORDER, TuneLoop, TuneSettings
    from specpilot.tune.report import write_report
    from specpilot.tune.space import directions_for

    started = time.perf_counter()
    agent = connect_agent(args)  # an unusable endpoint is an error before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_rounds < 1:
        raise SpecPilotError(f"--measure-rounds must be at least 1, got {args.measure_rounds}.")
    base = config_from_args(args)
    if args.mode is not None and args.mode != base.deployment.mode:
        base = dataclasses.replace(
            base, deployment=dataclasses.replace(base.deployment, mode=args.mode)
        )
    dep = base.deployment
    device = parse_device(dep.device)
    batched = dep.mode == "batched"
    stream = BatchedStream(args.concurrency, args.requests) if batched else None
    executor: LocalExecutor | RayExecutor
    prompts_spec = load_prompt_set(args.prompts, args.limit)
    from specpilot.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(dep.target))
    prompts = [tok.apply_chat_template(p.messages) for p in prompts_spec]
    what = "stock AR"
    if stream is not None:
        what = (
            f"batched AR ({stream.size} requests at concurrency {stream.concurrency}, "
            "continuous-batching scheduler)"
        )
    print(
        f"tuning {dep.target} with {dep.drafter} on {device} ({dep.dtype}, {dep.mode}); "
        f"{len(prompts)} prompts; loading and measuring {what} ...",
        flush=True,
    )
    graphs, rounds = args.graphs, args.measure_rounds
    say = lambda m: print(f"    [{time.perf_counter() - started:.0f}s] {m}", flush=True)  # noqa: E731
    if args.executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise SpecPilotError(
                "--executor ray needs Ray: pip install 'specpilot[tune]'."
            ) from None
        from specpilot.tune.ray_executor import RayExecutor

        executor = RayExecutor(
            base,
            prompts,
            args.max_new_tokens,
            args.ray_address,
            args.workers,
            stream,
            graphs,
            rounds,
            progress=say,
        )
    else:
        executor = LocalExecutor(
            base,
            prompts,
            args.max_new_tokens,
            stream,
            graphs,
            rounds,
            width=args.trials,
            progress=say,
        )
    arch, num_layers = executor.arch, executor.num_layers
    fp = fingerprint_deployment(
        dep.target, dep.drafter, dep.draft_model, device, dep.dtype, dep.mode
    )
    label = f"{dep.target} · {dep.drafter} · {fp.device_name} · {dep.dtype} · {dep.mode}"
    print(
        f"[{time.perf_counter() - started:.0f}s] loaded; "
        f"{'batched AR' if batched else 'stock AR'} {executor.ar_tok_s:.1f} tok/s",
        flush=True,
    )
    notes = scope_notes(base, stream, device.type, arch, rounds, graphs)
    for line in notes:
        print(line)
    gap_order: tuple[str, ...] = STATIC_GAP_ORDER
    gaps: tuple[str, ...] = ()
    compare_limit = 0 if batched else args.compare_limit  # compare runs one request at a time
    reserve = compare_reserve_s(compare_limit, args.max_new_tokens, executor.ar_tok_s, rounds)
    left = args.budget - (time.perf_counter() - started) - reserve
    if batched and args.rank_gaps == "profile":
        print("gaps ranked in the static order (the cost-model profile runs one request at a time)")
    elif args.rank_gaps == "profile" and isinstance(executor, LocalExecutor):
        if left < 0.6 * args.budget:  # a slow or busy machine: keep the time for the search
            print(f"only {max(left, 0):.0f}s left for the search: gaps ranked in the static order")
        else:
            print("profiling the stock engine to rank the gaps ...", flush=True)
            gap_order, gaps = profiled_gaps(executor.evaluator, base, prompts, args.max_new_tokens)
            print(f"gaps ranked by a profile of the stock engine: {', '.join(gap_order)}")
    search_budget = args.budget - (time.perf_counter() - started) - reserve
    print(
        f"[{time.perf_counter() - started:.0f}s] search budget "
        f"{max(search_budget, 0):.0f}s ({reserve:.0f}s kept for the final compare)"
    )
    settings = TuneSettings(
        rounds=args.rounds,
        trials_per_direction=args.trials,
        directions_per_round=args.directions,
        budget_seconds=max(search_budget, 0.0),
        min_gain=args.min_gain,
        seed=args.seed,
        explorer=args.explorer,
    )
    directions = directions_for(base, device.type, arch, num_layers)
    with MemoryStore(args.memory or default_memory()) as store:
        from specpilot.tune.kernel_search import search_for_tune

        team = None
        if agent is not None:
            what = f"{label}; {arch}, {num_layers} layers; {what} {executor.ar_tok_s:.1f} tok/s"
            log = lambda m: print(m, flush=True)  # noqa: E731
            team = make_team(agent, args, what, directions, gaps, notes, store, fp, log)
        kernel_record: dict[str, Any] = {}
        kernels, kernel_s = search_for_tune(
            args.kernel_budget, base, executor, device, search_budget, store, notes,
            kernel_record, kernel_asker(agent, args, store, team, device),
        )  # fmt: skip
        settings = dataclasses.replace(
            settings, budget_seconds=max(settings.budget_seconds - kernel_s, 0.0)
        )
        loop = TuneLoop(
            base,
            directions,
            executor,
            store,
            fp,
            label,
            settings,
            gap_order=gap_order,
            resume=args.resume,
            log=lambda m: print(m, flush=True),
            planner=team,
            kernels=kernels,
        )
        try:
            outcome = loop.run()
        finally:
            executor.close()
            if team is not None:
                team.close()
    if team is not None:
        outcome.agent, outcome.agent_records = team.price, team.records
    args.out.mkdir(parents=True, exist_ok=True)
    tuned, stock = args.out / "tuned.json", args.out / "stock.json"
    outcome.best.config.save(tuned)
    base.save(stock)
    search = outcome.usage.to_dict(outcome.wall_seconds) | kernel_record
    if outcome.agent is not None:
        search["agent"] = outcome.agent.to_dict()
    write_run(
        args.out, args.prompts, args.limit, args.compare_limit, args.max_new_tokens, rounds, search
    )
    report = write_report(outcome, label, args.out, tuned, notes)
    from specpilot.tune.report import verdict_lines

    print(
        f"tuned: {outcome.best.tok_s:.1f} tok/s, {outcome.best.spread_text()} AR; "
        f"stock speculative {outcome.stock.spread_text()} AR"
    )
    for line in verdict_lines(outcome):
        print(f"  {line}")
    print(f"search: {outcome.usage.summary(outcome.wall_seconds)}")
    if outcome.agent is not None:
        print(f"agents: {outcome.agent.summary()}")
    print(f"engine config: {tuned}\nreport: {report}")
    for r in outcome.reused:
        print(f"reused from memory: {r}")
    if batched:
        print(
            f"check it on other prompts: specpilot bench --mode batched --engine {tuned} "
            f"--concurrency {args.concurrency} --prompts {args.prompts}"
        )
        return 0
    if args.compare_limit <= 0:
        return 0
    from specpilot.commands.tune_compare import held_out_compare

    return held_out_compare(args, tuned, stock, executor, graphs, rounds, started)
