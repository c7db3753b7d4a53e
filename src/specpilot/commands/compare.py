"""``specpilot compare``: tuned vs stock speculative vs plain AR, side by side, token-forced.

Use prompts the tuner did not see (``--skip`` the tuning prompts of the same set, or another
set), so the figure is not fitted to them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.records import RunRecord, append_records, make_record
from specpilot.bench.runner import force_records, timed_generate, warm_up
from specpilot.engine.build import build_engine
from specpilot.engine.config import EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.runtime import LoadedModel, dtype_name, parse_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="tuned engine vs stock speculative vs AR on held-out prompts",
        description="Run plain AR, the stock speculative engine and the tuned engine on the same "
        "prompts in one process, token-force every output, and print the speedups side by side.",
    )
    p.add_argument(
        "--engine", type=Path, required=True, help="tuned engine config (tune's tuned.json)"
    )
    p.add_argument(
        "--stock",
        type=Path,
        default=None,
        help="stock engine config (default: the tuned config without mechanisms, k and drafter knobs at their defaults)",
    )
    p.add_argument(
        "--prompts", default="copy-heavy", help="prompt set or .jsonl file (default: %(default)s)"
    )
    p.add_argument(
        "--skip",
        type=int,
        default=4,
        help="skip the first N prompts (the tuning ones; default: %(default)s)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=6,
        help="prompts compared after the skip (default: %(default)s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--out", type=Path, default=None, help="append JSONL run records")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def stock_of(tuned: EngineConfig) -> EngineConfig:
    """What the stock engine of a deployment is: the same drafter at its defaults, no mechanism."""
    k = 4 if tuned.deployment.drafter == "draft-model" else 8
    knobs: dict[str, int] = {"max_n": 3, "min_n": 1} if tuned.deployment.drafter == "ngram" else {}
    if "exit_layers" in tuned.drafter_knobs:  # the early-exit draft model keeps its depth
        knobs["exit_layers"] = int(tuned.drafter_knobs["exit_layers"])
    return EngineConfig(deployment=tuned.deployment, k=k, drafter_knobs=knobs)


def run(args: argparse.Namespace, target: LoadedModel | None = None) -> int:
    """``target``: the stock target already loaded by the caller (``tune``), to save a reload;
    it must be the unmodified model of the configs' deployment."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tuned_cfg = EngineConfig.load(args.engine)
    stock_cfg = EngineConfig.load(args.stock) if args.stock else stock_of(tuned_cfg)
    if stock_cfg.deployment.target != tuned_cfg.deployment.target:
        raise SpecPilotError(
            "The stock and tuned configs name different targets; compare needs one deployment."
        )
    prompts = load_prompt_set(args.prompts, args.skip + args.limit)[args.skip :]
    if not prompts:
        raise SpecPilotError(
            f"No prompts left after skipping {args.skip}; lower --skip or pick another set."
        )
    stock_build = build_engine(stock_cfg, target=None if stock_cfg.mechanisms else target)
    target = stock_build.target
    tok = target.tokenizer
    assert tok is not None
    tuned_build = build_engine(tuned_cfg, target=None if tuned_cfg.mechanisms else target)
    eos = tok.eos_token_ids
    engines = {
        "ar": stock_build.stock_engine(),
        "stock": stock_build.engine(),
        "tuned": tuned_build.engine(),
    }
    encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
    warm_up(list(engines.values()), encoded[0][1][-16:], eos)
    meta = {
        "target": tuned_cfg.deployment.target,
        "dtype": dtype_name(target.model.dtype),
        "device": str(parse_device(tuned_cfg.deployment.device)),
        "drafter": tuned_cfg.deployment.drafter,
    }
    totals: dict[str, list[float]] = {name: [0, 0.0] for name in engines}
    records: dict[str, list[RunRecord]] = {name: [] for name in engines}
    for pid, ids in encoded:
        for name, engine in engines.items():
            res, secs = timed_generate(engine, ids, args.max_new_tokens, eos)
            kind = "ar" if name == "ar" else "spec"
            rec = make_record(pid, kind, meta, ids, res.tokens, res.stop_reason, secs, k=engine.k)
            records[name].append(rec)
            totals[name][0] += len(res.tokens)
            totals[name][1] += secs
    if args.out:
        append_records(args.out, [r for rs in records.values() for r in rs])
    tok_s = {name: totals[name][0] / totals[name][1] for name in engines}
    reports = {name: force_records(stock_build.target.model, records[name]) for name in engines}
    ok = all(r.ok for r in reports.values())
    summary = {
        name: {
            "tok_s": tok_s[name],
            "vs_ar": tok_s[name] / tok_s["ar"],
            "forcing": reports[name].summary(),
            "forcing_ok": reports[name].ok,
        }
        for name in engines
    }
    tuned_vs_stock = tok_s["tuned"] / tok_s["stock"]
    if args.json:
        print(
            json.dumps(
                {"prompts": len(encoded), "tuned_vs_stock": tuned_vs_stock, **summary}, indent=2
            )
        )
    else:
        print(
            f"compare on {len(encoded)} held-out prompts of {args.prompts} ({meta['target']}, {meta['dtype']}, {meta['device']})"
        )
        for name in engines:
            print(
                f"  {name:<6} {tok_s[name]:8.1f} tok/s  {tok_s[name] / tok_s['ar']:.2f}x AR   {reports[name].summary()}"
            )
        print(f"  tuned over stock speculative: {tuned_vs_stock:.2f}x")
    return 0 if ok else 1
