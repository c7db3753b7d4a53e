"""The held-out compare at the end of ``specpilot tune``, kept inside the tune's budget.

The compare gets what is left of ``--budget``: it is cut to the held-out prompts whose rounds
fit (``compare_fit``), or skipped with the command that runs it; ``run.json`` beside the tuned
config records what the tune measured, so a later ``specpilot compare --engine tuned.json``
repeats it by default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from specpilot.bench.prompts import load_prompt_set
from specpilot.commands import compare
from specpilot.commands.compare import RUN_FILE


def held_out_compare(
    args: argparse.Namespace,
    tuned: Path,
    stock: Path,
    executor: Any,
    graphs: bool | None,
    rounds: int,
    started: float,
) -> int:
    """Tuned vs stock vs AR on the prompts after the tuning ones, within the budget left."""
    from specpilot.tune.executors import LocalExecutor

    held_out = len(load_prompt_set(args.prompts, args.limit + args.compare_limit)) - args.limit
    if held_out <= 0:
        print(f"no held-out prompts left in {args.prompts} after the tuning ones: compare skipped")
        return 0
    left = args.budget - (time.perf_counter() - started) - COMPARE_SLACK_S
    fit = compare_fit(left, held_out, args.max_new_tokens, executor.ar_tok_s, rounds)
    rerun = (
        f"specpilot compare --engine {tuned} --stock {stock} --prompts {args.prompts} "
        f"--skip {args.limit} --limit {held_out} --max-new-tokens {args.max_new_tokens}"
    )
    if fit == 0:
        need = compare_reserve_s(1, args.max_new_tokens, executor.ar_tok_s, rounds)
        print(
            f"[{time.perf_counter() - started:.0f}s] no time left in the {args.budget:.0f}s "
            f"budget for the held-out compare (one prompt needs about {need:.0f}s, "
            f"{max(left, 0):.0f}s are left): skipped; run it with\n  {rerun}"
        )
        return 0
    cut = f", cut from {held_out} to fit the budget" if fit < held_out else ""
    print(
        f"[{time.perf_counter() - started:.0f}s] compare on {fit} held-out prompts "
        f"of {args.prompts} (after the {args.limit} tuning ones{cut}):"
    )
    cmp_args = argparse.Namespace(
        engine=tuned,
        stock=stock,
        prompts=args.prompts,
        skip=args.limit,
        limit=fit,
        max_new_tokens=args.max_new_tokens,
        rounds=rounds,
        graphs=graphs,
        budget_s=max(args.budget - (time.perf_counter() - started) - COMPARE_SLACK_S, 1.0),
        threads=None,
        out=args.out / "compare.jsonl",
        json=False,
    )
    loaded = executor.evaluator.stock if isinstance(executor, LocalExecutor) else None
    rc = compare.run(cmp_args, target=loaded)
    total = time.perf_counter() - started
    over = total - args.budget
    budget_note = (
        f"within the {args.budget:.0f}s budget"
        if over <= 0
        else f"{over:.0f}s over the {args.budget:.0f}s budget (the machine ran slower than "
        "when the compare's time was reserved)"
    )
    print(f"[{total:.0f}s] done, {budget_note}")
    if fit < held_out:
        print(f"the whole held-out compare: {rerun}")
    return rc


def write_run(
    out: Path,
    prompts: str,
    tuning: int,
    held_out: int,
    max_new_tokens: int,
    rounds: int,
    search: dict[str, Any] | None = None,
) -> None:
    """``run.json`` beside ``tuned.json``: what this tune measured on, so that a later
    ``specpilot compare --engine tuned.json`` repeats its held-out compare by default; and, under
    ``search``, what the search cost (workers, device-seconds summed over them, wall time)."""
    run: dict[str, Any] = {
        "prompts": prompts,
        "skip": tuning,
        "limit": held_out,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
    }
    if search is not None:
        run["search"] = search
    (out / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")


COMPARE_SLACK_S = 10.0
"""Seconds kept after the compare's rounds for its token forcing and the summary."""


def compare_fit(
    left_s: float, prompts: int, max_new_tokens: int, ar_tok_s: float, rounds: int
) -> int:
    """Held-out prompts whose compare (``compare_reserve_s``) fits in ``left_s`` seconds."""
    for n in range(prompts, 0, -1):
        if compare_reserve_s(n, max_new_tokens, ar_tok_s, rounds) <= left_s:
            return n
    return 0


def compare_reserve_s(prompts: int, max_new_tokens: int, ar_tok_s: float, rounds: int) -> float:
    """Seconds to keep for the final compare: ``rounds`` interleaved rounds of AR, stock and
    tuned over every held-out prompt (speculative counted at AR speed, to be safe), token
    forcing (about one more pass), and building the engines (the loaded target is reused). The
    compare itself stops starting rounds when its time is up, and says so."""
    if prompts <= 0:
        return 0.0
    return (3 * rounds + 1) * prompts * max_new_tokens / max(ar_tok_s, 1e-6) + 10.0
