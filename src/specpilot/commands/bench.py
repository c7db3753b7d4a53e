"""``specpilot bench``: AR and speculative side by side on a prompt set, token-forced."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specpilot.bench.prompts import list_prompt_sets, load_prompt_set
from specpilot.bench.records import RunRecord, append_records, read_records
from specpilot.bench.runner import BenchSummary, force_records, run_pair, warm_up
from specpilot.commands.common import add_engine_args, build_deployment


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="AR vs speculative on a prompt set, with token forcing",
        description="Run our stock AR path and the speculative engine on each prompt of a set, in one "
        "process, and report tok/s, speedup, mean accepted length and the token-forcing verdict.",
    )
    p.add_argument(
        "--prompts",
        default="copy-heavy",
        help=f"prompt set: {', '.join(list_prompt_sets())} (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N prompts of the set")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument(
        "--out", type=Path, default=None, help="JSONL records (default: runs/bench-<time>.jsonl)"
    )
    p.add_argument("--resume", action="store_true", help="skip prompts already in --out")
    p.add_argument(
        "--hf",
        action="store_true",
        help="also time HF transformers generate (greedy) on the same prompts",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    b = p.add_argument_group("batched mode (continuous batching, docs/SERVE.md)")
    b.add_argument(
        "--mode",
        choices=["single", "batched"],
        default="single",
        help="single: one prompt at a time; batched: requests share a continuous batch "
        "(default: %(default)s)",
    )
    b.add_argument(
        "--concurrency",
        default="16,20,24",
        help="batched: slots (requests decoded together), comma-separated (default: %(default)s)",
    )
    b.add_argument(
        "--requests",
        type=int,
        default=None,
        help="batched: requests per concurrency, prompts cycled (default: 2 x concurrency)",
    )
    b.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="batched: Poisson arrivals per second; 0 = all at once (default: %(default)s)",
    )
    b.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        help="batched: prompt tokens a new request feeds per step (default: the engine config's "
        "segment_tokens, else 256)",
    )
    b.add_argument("--seed", type=int, default=0, help="batched: arrival seed (default: 0)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    if args.mode == "batched":
        from specpilot.commands.bench_batched import run_batched

        return run_batched(args)
    console = Console(stderr=True)
    dep = build_deployment(args)
    tok = dep.target.tokenizer
    assert tok is not None
    prompts = load_prompt_set(args.prompts, args.limit)
    out = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    done: set[str] = set()
    if args.resume and out.is_file():
        done = {r.id for r in read_records(out) if r.engine == "spec"}
    ar_engine, spec_engine = dep.engines()
    encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
    for _, ids in encoded:
        ar_engine.check_fits(len(ids), args.max_new_tokens)
    warm_up([ar_engine, spec_engine], encoded[0][1][-16:], dep.eos_ids)

    summary = BenchSummary()
    spec_records: list[RunRecord] = []
    hf_tokens, hf_seconds = 0, 0.0
    hf = None
    if args.hf:
        from specpilot.bench.hf_baseline import HFBaseline

        hf = HFBaseline(args.target, dep.dtype, dep.device)
        hf.generate(encoded[0][1][-16:], 8, dep.eos_ids)  # warm-up
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"bench {args.prompts}", total=len(encoded))
        for pid, ids in encoded:
            if pid in done:
                progress.advance(task)
                continue
            ar, spec, stats = run_pair(
                ar_engine, spec_engine, pid, ids, args.max_new_tokens, dep.eos_ids, dep.meta()
            )
            batch = [ar, spec]
            if hf is not None:
                hf_rec = hf.record(pid, ids, args.max_new_tokens, dep.eos_ids, dep.meta())
                hf_tokens += len(hf_rec.tokens)
                hf_seconds += hf_rec.seconds
                batch.append(hf_rec)
            append_records(out, batch)
            summary.add(ar, spec, stats)
            spec_records.append(spec)
            progress.advance(task)
        ftask = progress.add_task("token forcing", total=len(spec_records))
        summary.forcing = force_records(
            dep.target.model, spec_records, lambda: progress.advance(ftask)
        )

    result = summary_dict(summary, dep.meta(), args, out)
    if hf is not None and hf_seconds:
        result["hf_tok_s"] = hf_tokens / hf_seconds
        result["ar_over_hf"] = summary.ar_tok_s / result["hf_tok_s"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    assert summary.forcing is not None
    return 0 if summary.forcing.ok else 1


def summary_dict(
    s: BenchSummary, meta: dict[str, str], args: argparse.Namespace, out: Path
) -> dict:
    assert s.forcing is not None
    return {
        **meta,
        "prompt_set": args.prompts,
        "prompts": s.prompts,
        "max_new_tokens": args.max_new_tokens,
        "ar_tok_s": s.ar_tok_s,
        "spec_tok_s": s.spec_tok_s,
        "speedup": s.speedup,
        "identical_to_ar": f"{s.identical}/{s.prompts}",
        "acceptance": s.stats.to_dict(),
        "forcing": {
            "ok": s.forcing.ok,
            "matches": s.forcing.matches,
            "near_ties": s.forcing.near_ties,
            "mismatches": s.forcing.mismatches,
            "summary": s.forcing.summary(),
        },
        "records": str(out),
    }


def print_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"bench {r['prompt_set']} · {r['target']} · {r['dtype']} · {r['device']}")
    table.add_column("engine")
    table.add_column("tok/s", justify="right")
    table.add_column("speedup vs our AR", justify="right")
    if "hf_tok_s" in r:
        table.add_row(
            "HF transformers generate",
            f"{r['hf_tok_s']:.1f}",
            f"{r['hf_tok_s'] / r['ar_tok_s']:.2f}×",
        )
    table.add_row("our AR (stock path)", f"{r['ar_tok_s']:.1f}", "1.00×")
    table.add_row(f"speculative {r['drafter']}", f"{r['spec_tok_s']:.1f}", f"{r['speedup']:.2f}×")
    console.print(table)
    acc = r["acceptance"]
    console.print(
        f"mean accepted length τ = {acc['mean_accepted_len_incl_bonus']:.2f} tokens per verify (bonus included), "
        f"{acc['cycles']} cycles; outputs identical to AR: {r['identical_to_ar']}"
    )
    rates = acc["acceptance_rate_by_position"]
    if rates:
        console.print("acceptance by draft position:")
        for i, rate in enumerate(rates):
            console.print(f"  {i + 1:>2} {'█' * round(rate * 40):<40} {rate:6.1%}")
    style = "green" if r["forcing"]["ok"] else "bold red"
    console.print(f"[{style}]{r['forcing']['summary']}[/]")
    console.print(f"records: {r['records']}")
