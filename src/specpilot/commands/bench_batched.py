"""``specpilot bench --mode batched``: AR-batched vs speculative-batched serving of a request
stream at several concurrencies, every output token-forced.

Both arms are schedulers from the composition root over the same target weights
(``EngineBuild.scheduler(..., stock=True)`` is batched plain AR), measured with the interleaved
protocol of ``bench/protocol.py``: a warm-up round, then rounds in which each arm serves the
whole stream, order alternating; each speedup is the median per-round ratio, printed with its
spread, and called faster or slower only when the whole spread lies beyond 1."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from specpilot.bench.batched import BatchedRun, measure_stream, poisson_arrivals, request_stream
from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.protocol import Measurement
from specpilot.bench.records import RunRecord, append_records, make_record
from specpilot.bench.runner import force_records
from specpilot.commands.common import Deployment, build_deployment
from specpilot.commands.feedback import Feedback
from specpilot.consoles import result_console
from specpilot.drafters.simulated import SIM_LABEL
from specpilot.engine.config import resolve_segment_tokens
from specpilot.engine.stats import AcceptanceStats
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
    if args.resume:
        raise SpecPilotError("--resume is for --mode single; batched runs are one stream each.")
    levels = parse_concurrency(args.concurrency)
    rounds = getattr(args, "rounds", None) or DEFAULT_ROUNDS
    if rounds < 1:
        raise SpecPilotError(f"--rounds must be at least 1, got {rounds}.")
    with Feedback() as feedback:
        dep = build_deployment(args, feedback)
        build = dep.build
        segment_tokens = resolve_segment_tokens(build.config, args.segment_tokens)
        tok = dep.target.tokenizer
        assert tok is not None
        prompts = load_prompt_set(args.prompts, args.limit)
        encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
        out = args.out or Path("runs") / f"bench-batched-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        max_context = max(len(ids) for _, ids in encoded) + args.max_new_tokens
        eos = frozenset(dep.eos_ids)
        levels_out: list[dict[str, Any]] = []
        spec_records: list[RunRecord] = []
        identical = 0
        for c in levels:
            n = args.requests or 2 * c
            reqs = request_stream(encoded, n, args.max_new_tokens, eos)
            arrivals = poisson_arrivals(n, args.arrival_rate, args.seed)
            # batched AR and batched speculative on the same weights, from the composition root
            feedback.phase(f"concurrency {c}: building the AR and speculative schedulers")
            schedulers = {
                "ar": build.scheduler(c, segment_tokens, max_context, stock=True),
                "spec": build.scheduler(c, segment_tokens, max_context),
            }
            # measured: no spinner thread runs, the finished requests are counted in place
            total = 2 * n * (1 + rounds)
            feedback.timed_phase(
                f"concurrency {c}: a warm-up and {rounds} rounds of {n} requests, AR and spec"
            )
            finished = 0

            def on_finish(total: int = total) -> None:
                nonlocal finished
                finished += 1
                feedback.detail(f"{finished}/{total} requests")

            m = measure_stream(schedulers, reqs, arrivals, rounds, warmup=1, on_finish=on_finish)
            del schedulers  # the next level's engines replace these (KV caches, graphs)
            for r, (ar_s, spec_s) in enumerate(
                zip(m.samples["ar"], m.samples["spec"], strict=True)
            ):
                ar, spec = ar_s.payload, spec_s.payload
                append_records(out, _records(ar, dep, r) + _records(spec, dep, r))
                identical += sum(
                    a.tokens == s.tokens for a, s in zip(ar.results, spec.results, strict=True)
                )
                spec_records.extend(_records(spec, dep, r))
            levels_out.append(_level(m))
            lv = levels_out[-1]
            feedback.say(
                f"  concurrency {c}: AR {lv['ar_tok_s']:.1f} tok/s, spec {lv['spec_tok_s']:.1f} "
                f"tok/s, {lv['speedup_text']} ({lv['verdict']})",
                sys.stderr if args.json else sys.stdout,
            )
        feedback.phase(f"token forcing {len(spec_records)} speculative outputs")
        forcing = force_records(dep.target.model, spec_records, feedback.counter(len(spec_records)))

    result: dict[str, Any] = {
        **dep.meta(),
        "mode": "batched",
        "simulated_acceptance": build.config.deployment.simulate_acceptance,
        "prompt_set": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "arrival_rate": args.arrival_rate,
        "segment_tokens": segment_tokens,
        "rounds": rounds,
        "mechanisms": dict(build.config.mechanisms),
        "levels": levels_out,
        "identical_to_ar": f"{identical}/{len(spec_records)}",
        "forcing": forcing.totals(),
        "records": str(out),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0 if forcing.ok else 1


DEFAULT_ROUNDS = 3
"""Counted rounds per concurrency when the command gives no ``--rounds`` (the fewest that
allow a verdict, ``bench/protocol.MIN_ROUNDS_FOR_VERDICT``)."""


def _records(run: BatchedRun, dep: Deployment, round_: int) -> list[RunRecord]:
    k = dep.build.config.k if run.engine == "spec" else 0
    return [
        make_record(
            f"{res.id}@{round_}",
            run.engine,
            dep.meta(),
            res.prompt_ids,
            res.tokens,
            res.stop_reason,
            lat,
            k=k,
            stats={
                "concurrency": run.concurrency,
                "mode": "batched",
                "round": round_,
                **res.stats.to_dict(),
            },
        )
        for res, lat in zip(run.results, run.latencies, strict=True)
    ]


def _level(m: Measurement) -> dict[str, Any]:
    """One concurrency: median tok/s per arm, the per-round speedup with its spread and verdict;
    latencies, steps and acceptance of the last round."""
    ar, spec = m.last("ar").payload, m.last("spec").payload
    ratio = m.ratio("spec", "ar")
    stats = AcceptanceStats()
    for s in m.samples["spec"]:
        stats.merge(s.payload.stats)
    return {
        "concurrency": spec.concurrency,
        "requests": len(spec.results),
        "ar_tok_s": m.tok_s("ar"),
        "spec_tok_s": m.tok_s("spec"),
        "speedup": ratio.median,
        "speedup_spread": ratio.to_dict(),
        "speedup_text": ratio.text(),
        "verdict": ratio.verdict(),
        "tau_incl_bonus": stats.mean_accepted_len,
        "ar_latency_s": ar.latency(),
        "spec_latency_s": spec.latency(),
        "ar_steps": ar.steps,
        "spec_steps": spec.steps,
        "acceptance": stats.to_dict(),
    }


def _print(r: dict[str, Any]) -> None:
    from rich.table import Table

    console = result_console()
    title = f"bench --mode batched {r['prompt_set']} · {r['target']} · {r['dtype']} · {r['device']}"
    if r["simulated_acceptance"]:
        title += f" · {SIM_LABEL}"
    table = Table(title=title)
    cols = ("concurrency", "AR tok/s", f"spec {r['drafter']} tok/s", "speedup (spread)", "verdict")
    for col in (*cols, "τ"):
        table.add_column(col, justify="right")
    table.add_column("latency s AR mean/p50/p99", justify="right")
    table.add_column("latency s spec mean/p50/p99", justify="right")
    for lv in r["levels"]:
        a, s = lv["ar_latency_s"], lv["spec_latency_s"]
        table.add_row(
            str(lv["concurrency"]),
            f"{lv['ar_tok_s']:.1f}",
            f"{lv['spec_tok_s']:.1f}",
            lv["speedup_text"],
            lv["verdict"],
            f"{lv['tau_incl_bonus']:.2f}",
            f"{a['mean']:.2f}/{a['p50']:.2f}/{a['p99']:.2f}",
            f"{s['mean']:.2f}/{s['p50']:.2f}/{s['p99']:.2f}",
        )
    console.print(table)
    arrivals = "all at once" if not r["arrival_rate"] else f"Poisson {r['arrival_rate']}/s"
    console.print(
        f"arrivals: {arrivals}; {r['rounds']} rounds after a warm-up, arms alternating; speedup = "
        "median of per-round ratios (lowest-highest round); τ = committed tokens per verify per "
        f"request, bonus included; outputs identical to AR: {r['identical_to_ar']}"
    )
    if r["simulated_acceptance"]:
        console.print(
            f"{SIM_LABEL} ({r['simulated_acceptance']}): the drafter's proposals follow the "
            "profile; verification is real."
        )
    style = "green" if r["forcing"]["ok"] else "bold red"
    console.print(f"[{style}]{r['forcing']['summary']}[/]")
    console.print(f"records: {r['records']}")
