"""``specpilot bench --mode batched``: AR-batched vs speculative-batched serving of a request
stream at several concurrencies, every output token-forced."""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from specpilot.bench.batched import (
    BatchedRun,
    poisson_arrivals,
    request_stream,
    run_stream,
    warm_up_scheduler,
)
from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.records import RunRecord, append_records, make_record
from specpilot.bench.runner import force_records
from specpilot.commands.common import Deployment, build_deployment
from specpilot.engine.batching import BatchScheduler
from specpilot.engine.config import resolve_segment_tokens
from specpilot.errors import SpecPilotError


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SpecPilotError(
            f"--concurrency takes positive integers separated by commas, got '{text}'."
        )
    return values


def run_batched(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    if args.resume:
        raise SpecPilotError("--resume is for --mode single; batched runs are one stream each.")
    levels = parse_concurrency(args.concurrency)
    dep = build_deployment(args)
    segment_tokens = resolve_segment_tokens(dep.build.config, args.segment_tokens)
    tok = dep.target.tokenizer
    assert tok is not None
    prompts = load_prompt_set(args.prompts, args.limit)
    encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
    out = args.out or Path("runs") / f"bench-batched-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    max_context = max(len(ids) for _, ids in encoded) + args.max_new_tokens
    eos = frozenset(dep.eos_ids)

    def schedulers(c: int) -> dict[str, BatchScheduler]:
        b = dep.build
        return {
            "ar": b.stock_scheduler(c, segment_tokens, max_context),
            "spec": b.scheduler(c, segment_tokens, max_context),
        }

    # Warm-up: a few short requests through each engine, outside the timings.
    for sched in schedulers(min(levels)).values():
        warm_up_scheduler(sched, encoded[0][1], eos)

    console = Console(stderr=True)
    runs: list[tuple[BatchedRun, BatchedRun]] = []
    spec_records: list[RunRecord] = []
    identical = 0
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for c in levels:
            n = args.requests or 2 * c
            reqs = request_stream(encoded, n, args.max_new_tokens, eos)
            arrivals = poisson_arrivals(n, args.arrival_rate, args.seed)
            pair = []
            for name, sched in schedulers(c).items():
                task = progress.add_task(f"concurrency {c} · {name}", total=n)
                run = run_stream(name, sched, reqs, arrivals, partial(progress.advance, task))
                pair.append(run)
                append_records(out, _records(run, dep))
            ar, spec = pair
            runs.append((ar, spec))
            identical += sum(
                a.tokens == s.tokens for a, s in zip(ar.results, spec.results, strict=True)
            )
            spec_records.extend(_records(spec, dep))
        ftask = progress.add_task("token forcing", total=len(spec_records))
        forcing = force_records(dep.target.model, spec_records, lambda: progress.advance(ftask))

    result: dict[str, Any] = {
        **dep.meta(),
        "mode": "batched",
        "prompt_set": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "arrival_rate": args.arrival_rate,
        "segment_tokens": segment_tokens,
        "mechanisms": dict(dep.build.config.mechanisms),
        "levels": [_level(ar, spec) for ar, spec in runs],
        "identical_to_ar": f"{identical}/{len(spec_records)}",
        "forcing": {
            "ok": forcing.ok,
            "matches": forcing.matches,
            "near_ties": forcing.near_ties,
            "mismatches": forcing.mismatches,
            "summary": forcing.summary(),
        },
        "records": str(out),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0 if forcing.ok else 1


def _records(run: BatchedRun, dep: Deployment) -> list[RunRecord]:
    k = dep.build.config.k if run.engine == "spec" else 0
    return [
        make_record(
            res.id,
            run.engine,
            dep.meta(),
            res.prompt_ids,
            res.tokens,
            res.stop_reason,
            lat,
            k=k,
            stats={"concurrency": run.concurrency, "mode": "batched", **res.stats.to_dict()},
        )
        for res, lat in zip(run.results, run.latencies, strict=True)
    ]


def _level(ar: BatchedRun, spec: BatchedRun) -> dict[str, Any]:
    return {
        "concurrency": spec.concurrency,
        "requests": len(spec.results),
        "ar_tok_s": ar.tok_s,
        "spec_tok_s": spec.tok_s,
        "speedup": spec.tok_s / ar.tok_s if ar.tok_s else 0.0,
        "tau_incl_bonus": spec.stats.mean_accepted_len,
        "ar_latency_s": ar.latency(),
        "spec_latency_s": spec.latency(),
        "ar_steps": ar.steps,
        "spec_steps": spec.steps,
        "acceptance": spec.stats.to_dict(),
    }


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = f"bench --mode batched {r['prompt_set']} · {r['target']} · {r['dtype']} · {r['device']}"
    table = Table(title=title)
    for col in ("concurrency", "AR tok/s", f"spec {r['drafter']} tok/s", "speedup", "τ"):
        table.add_column(col, justify="right")
    table.add_column("latency s AR mean/p50/p99", justify="right")
    table.add_column("latency s spec mean/p50/p99", justify="right")
    for lv in r["levels"]:
        a, s = lv["ar_latency_s"], lv["spec_latency_s"]
        table.add_row(
            str(lv["concurrency"]),
            f"{lv['ar_tok_s']:.1f}",
            f"{lv['spec_tok_s']:.1f}",
            f"{lv['speedup']:.2f}×",
            f"{lv['tau_incl_bonus']:.2f}",
            f"{a['mean']:.2f}/{a['p50']:.2f}/{a['p99']:.2f}",
            f"{s['mean']:.2f}/{s['p50']:.2f}/{s['p99']:.2f}",
        )
    console.print(table)
    arrivals = "all at once" if not r["arrival_rate"] else f"Poisson {r['arrival_rate']}/s"
    console.print(
        f"arrivals: {arrivals}; τ = committed tokens per verify per request, bonus included; "
        f"outputs identical to AR: {r['identical_to_ar']}"
    )
    style = "green" if r["forcing"]["ok"] else "bold red"
    console.print(f"[{style}]{r['forcing']['summary']}[/]")
    console.print(f"records: {r['records']}")
