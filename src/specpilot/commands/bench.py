"""``specpilot bench``: AR and speculative side by side on a prompt set, token-forced."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specpilot.bench.prompts import list_prompt_sets, load_prompt_set
from specpilot.bench.protocol import Measurement, Sample
from specpilot.bench.records import append_records, read_records
from specpilot.bench.runner import force_records, records_of, side_by_side
from specpilot.commands.checks import at_least, writable_file
from specpilot.commands.common import add_engine_args, build_deployment
from specpilot.commands.feedback import Feedback
from specpilot.consoles import result_console
from specpilot.engine import AcceptanceStats
from specpilot.errors import SpecPilotError
from specpilot.forcing import ForcingReport

DEFAULT_ROUNDS = 3
"""Interleaved rounds of an offline bench when ``--rounds`` is not given."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="AR vs speculative on a prompt set, with token forcing",
        description="Run our stock AR path and the speculative engine on a prompt set in one "
        "process, warmed up and interleaved in repeated rounds, and report tok/s, the speedup "
        "with its spread, mean accepted length and the token-forcing verdict.",
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
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds of AR and speculative after a warm-up; the speedup is their "
        f"median, shown with its spread (default: {DEFAULT_ROUNDS})",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    b = p.add_argument_group("batched mode (continuous batching, docs/SERVE.md)")
    b.add_argument(
        "--mode",
        choices=["single", "batched", "serve"],
        default="single",
        help="single: one prompt at a time; batched: requests share a continuous batch; "
        "serve: load an OpenAI-compatible server at --url (TTFT / TPOT / ITL, vLLM's metric "
        "names; --prompts sharegpt for ShareGPT V3) (default: %(default)s)",
    )
    b.add_argument(
        "--concurrency",
        default="16,20,24",
        help="batched: slots (requests decoded together); serve: requests in flight; comma-separated (default: %(default)s)",
    )
    b.add_argument(
        "--requests",
        type=int,
        default=None,
        help="batched, serve: requests per concurrency, prompts cycled (default: 2 x concurrency)",
    )
    b.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="batched, serve: Poisson arrivals per second; 0 = all at once (default: %(default)s)",
    )
    b.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        help="batched: prompt tokens a new request feeds per step (default: the engine config's "
        "segment_tokens, else 256)",
    )
    b.add_argument("--seed", type=int, default=0, help="batched: arrival seed (default: 0)")
    b.add_argument("--url", default=None, help="serve: the server's base URL")
    b.add_argument(
        "--served-model", default=None, help="serve: model name (default: /v1/models' first)"
    )
    add_engine_args(p)


def loads_model(args: argparse.Namespace) -> bool:
    """``--mode serve`` measures a running server: no deployment to check or load here."""
    return bool(args.mode != "serve")


def check(args: argparse.Namespace) -> list[str]:
    """bench's own arguments, before anything is loaded (``commands/checks.py``); fetches the
    prompt set if it is not cached yet, so that a failed fetch costs no model load."""
    at_least(args, "rounds", 1)
    writable_file(args.out, "--out")
    if args.mode != "serve" and args.rounds is None:
        args.rounds = DEFAULT_ROUNDS
    if args.url and args.mode != "serve":
        raise SpecPilotError("--url is for --mode serve.")
    if args.mode == "serve":
        from specpilot.commands.bench_serve import check_serve

        at_least(args, "requests", 1)
        at_least(args, "arrival_rate", 0)
        check_serve(args)
        if args.prompts == "sharegpt":
            return []
    if args.mode == "batched":
        from specpilot.commands.bench_batched import parse_concurrency

        if args.resume:
            raise SpecPilotError("--resume is for --mode single; batched runs are one stream each.")
        if args.hf:
            raise SpecPilotError("--hf is for --mode single; HF generate serves no batch.")
        parse_concurrency(args.concurrency)
        at_least(args, "requests", 1)
        at_least(args, "arrival_rate", 0)
        at_least(args, "segment_tokens", 1)
    load_prompt_set(args.prompts, args.limit)
    return []


def run(args: argparse.Namespace) -> int:
    if args.mode == "serve":
        from specpilot.commands.bench_serve import run_serve

        return run_serve(args)
    if args.mode == "batched":
        from specpilot.commands.bench_batched import run_batched

        return run_batched(args)
    # Results as they come (the header, one line per round) go to stdout, flushed, so that
    # `bench > file` fills the file as it runs; with --json stdout holds only the JSON.
    results = sys.stderr if args.json else sys.stdout
    with Feedback() as feedback:
        dep = build_deployment(args, feedback)
        tok = dep.target.tokenizer
        assert tok is not None
        prompts = load_prompt_set(args.prompts, args.limit)
        out = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        done: set[str] = set()
        if args.resume and out.is_file():
            done = {r.id for r in read_records(out) if r.engine == "spec"}
        encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
        encoded = [(pid, ids) for pid, ids in encoded if pid not in done]
        if not encoded:
            feedback.say(
                f"every prompt of {args.prompts} is already in {out}; nothing to run", results
            )
            return 0
        ar_engine, spec_engine = dep.engines()
        for _, ids in encoded:
            spec_engine.check_fits(len(ids), args.max_new_tokens)
        meta = dep.meta()

        def say(line: str) -> None:
            feedback.say(line, results)

        say(
            f"bench {args.prompts}: {len(encoded)} prompts, AR and {dep.drafter_name} on "
            f"{meta['device']} ({meta['runner']}), warm-up then {args.rounds} interleaved rounds"
        )

        # With no drafter the speculative engine is plain AR: one arm, nothing to compare it with.
        spec = "spec" if dep.build.drafter is not None else "ar"

        def on_round(r: int, got: dict[str, Sample]) -> None:
            a, s_ = got["ar"].tok_s, got[spec].tok_s
            line = f"  round {r + 1}/{args.rounds}: AR {a:.1f} tok/s"
            say(line if spec == "ar" else f"{line}, spec {s_:.1f} tok/s ({s_ / a:.2f}x)")

        engines = {"ar": ar_engine} if spec == "ar" else {"ar": ar_engine, "spec": spec_engine}
        m = side_by_side(
            engines,
            encoded,
            args.max_new_tokens,
            dep.eos_ids,
            rounds=args.rounds,
            on_round=on_round,
            progress=feedback,
        )
        ar_records, _ = records_of(m.last("ar"), "ar", meta)
        spec_records, stats = records_of(m.last(spec), "spec", meta, k=spec_engine.k)
        batch = ar_records if spec == "ar" else [*ar_records, *spec_records]
        hf_tok_s = None
        if args.hf:
            from specpilot.bench.hf_baseline import HFBaseline

            feedback.phase("loading HF transformers' model")
            hf = HFBaseline(args.target, dep.dtype, dep.device)
            hf.generate(encoded[0][1][-16:], 8, dep.eos_ids)  # warm-up
            feedback.timed_phase("HF transformers generate (one run, not interleaved)")
            hf_records = []
            for i, (pid, ids) in enumerate(encoded):
                feedback.detail(f"prompt {i + 1}/{len(encoded)}")
                hf_records.append(hf.record(pid, ids, args.max_new_tokens, dep.eos_ids, meta))
            hf_tok_s = sum(len(r.tokens) for r in hf_records) / sum(r.seconds for r in hf_records)
            batch += hf_records
        append_records(out, batch)
        feedback.phase(f"token forcing {len(spec_records)} speculative outputs")
        forcing = force_records(dep.target.model, spec_records, feedback.counter(len(spec_records)))
    identical = sum(a.tokens == b.tokens for a, b in zip(ar_records, spec_records, strict=True))
    result = summary_dict(m, spec, stats, forcing, identical, meta, args, out, len(encoded))
    if hf_tok_s is not None:
        result["hf_tok_s"] = hf_tok_s
        result["ar_over_hf"] = result["ar_tok_s"] / hf_tok_s
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    return 0 if forcing.ok else 1


def summary_dict(
    m: Measurement,
    spec: str,
    stats: AcceptanceStats,
    forcing: ForcingReport,
    identical: int,
    meta: dict[str, str],
    args: argparse.Namespace,
    out: Path,
    prompts: int,
) -> dict:
    ratio = m.ratio(spec, "ar")
    return {
        **meta,
        "prompt_set": args.prompts,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "rounds": len(ratio.values),
        "ar_tok_s": m.tok_s("ar"),
        "spec_tok_s": m.tok_s(spec),
        "ar_tok_s_rounds": [x.tok_s for x in m.samples["ar"]],
        "speedup": ratio.median,
        "speedup_spread": ratio.to_dict(),
        "verdict": ratio.verdict(),
        "identical_to_ar": f"{identical}/{prompts}",
        "acceptance": stats.to_dict(),
        "forcing": forcing.totals(),
        "records": str(out),
    }


def print_summary(r: dict) -> None:
    from rich.table import Table

    console = result_console()
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
    if r["drafter"] == "none":
        console.print(table)
        rounds = ", ".join(f"{x:.1f}" for x in r["ar_tok_s_rounds"])
        console.print(f"AR tok/s per round after a warm-up: {rounds}")
        console.print(
            f"[green]{r['forcing']['summary']}[/]"
            if r["forcing"]["ok"]
            else f"[bold red]{r['forcing']['summary']}[/]"
        )
        console.print(f"records: {r['records']}")
        return
    sp = r["speedup_spread"]
    spread = f" ({sp['lo']:.2f}–{sp['hi']:.2f})" if r["rounds"] > 1 else ""
    table.add_row(
        f"speculative {r['drafter']}", f"{r['spec_tok_s']:.1f}", f"{r['speedup']:.2f}×{spread}"
    )
    console.print(table)
    verdict = {
        "faster": "faster than AR (every round)",
        "slower": "SLOWER than AR (every round)",
        "within noise": "within the noise of AR: no verdict",
        "undecided": "too few rounds for a verdict (use --rounds 3 or more)",
    }[r["verdict"]]
    console.print(
        f"{r['rounds']} interleaved rounds after a warm-up (median, lowest–highest round): {verdict}"
    )
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
