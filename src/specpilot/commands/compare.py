"""``specpilot compare``: tuned vs stock speculative vs plain AR, side by side, token-forced.

Use prompts the tuner did not see (``--skip`` the tuning prompts of the same set, or another
set), so the figure is not fitted to them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.protocol import Ratio
from specpilot.bench.records import append_records
from specpilot.bench.runner import force_records, records_of, side_by_side
from specpilot.drafters.simulated import SIM_LABEL
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
        "--prompts",
        default=None,
        help="prompt set or .jsonl file (default: the tune's, from run.json beside --engine; "
        "else copy-heavy)",
    )
    p.add_argument(
        "--skip",
        type=int,
        default=None,
        help="skip the first N prompts (default: the tune's tuning prompts; else 4)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="prompts compared after the skip (default: the tune's held-out count; else 6)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="(default: the tune's; else 128)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds of the three engines after a warm-up (default: the tune's; "
        "else 3)",
    )
    p.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        default=None,
        help="run every step eagerly on CUDA (default: CUDA graphs on CUDA)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--out", type=Path, default=None, help="append JSONL run records")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def stock_of(tuned: EngineConfig) -> EngineConfig:
    """What the stock engine of a deployment is: the same drafter at its defaults, no mechanism
    (under simulated acceptance the profile's draft length stays)."""
    from specpilot.commands.common import DEFAULT_K

    k = DEFAULT_K.get(tuned.deployment.drafter, 8)
    if tuned.deployment.simulate_acceptance is not None:
        k = tuned.k
    knobs: dict[str, int] = {"max_n": 3, "min_n": 1} if tuned.deployment.drafter == "ngram" else {}
    if "exit_layers" in tuned.drafter_knobs:  # the early-exit draft model keeps its depth
        knobs["exit_layers"] = int(tuned.drafter_knobs["exit_layers"])
    return EngineConfig(deployment=tuned.deployment, k=k, drafter_knobs=knobs)


RUN_FILE = "run.json"
"""What a tune writes beside its engine config (``commands/tune_compare.py``): its arguments and
results, read here for the defaults."""

FALLBACKS = {"prompts": "copy-heavy", "skip": 4, "limit": 6, "max_new_tokens": 128, "rounds": 3}
"""What compare uses when neither a flag nor the tune's run.json says."""


def resolve_defaults(args: argparse.Namespace) -> list[str]:
    """Fill every option left unset from ``run.json`` beside ``--engine`` (what the tune that
    wrote it measured), else from ``FALLBACKS``; returns the names taken from the run."""
    run: dict[str, object] = {}
    path = Path(args.engine).parent / RUN_FILE
    if path.is_file():
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            run = {}
    taken = []
    for name, fallback in FALLBACKS.items():
        if getattr(args, name, None) is not None:
            continue
        value = run.get(name, fallback)
        if name in run:
            taken.append(name)
        setattr(args, name, type(fallback)(value))  # type: ignore[call-arg]
    return taken


def run(args: argparse.Namespace, target: LoadedModel | None = None) -> int:
    """``target``: the stock target already loaded by the caller (``tune``), to save a reload;
    it must be the unmodified model of the configs' deployment."""
    import time

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    taken = resolve_defaults(args)
    if taken and not args.json:
        print(f"as the tune that wrote {args.engine} did: {', '.join(taken)} from its run.json")
    if args.rounds < 1:
        raise SpecPilotError(f"--rounds must be at least 1, got {args.rounds}.")
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
    graphs = getattr(args, "graphs", None)
    stock_build = build_engine(
        stock_cfg, target=None if stock_cfg.mechanisms else target, graphs=graphs
    )
    target = stock_build.target
    tok = target.tokenizer
    assert tok is not None
    tuned_build = build_engine(
        tuned_cfg, target=None if tuned_cfg.mechanisms else target, graphs=graphs
    )
    eos = tok.eos_token_ids
    engines = {
        "ar": stock_build.stock_engine(),
        "stock": stock_build.engine(),
        "tuned": tuned_build.engine(),
    }
    encoded = [(p.id, tok.apply_chat_template(p.messages)) for p in prompts]
    for _, ids in encoded:
        engines["tuned"].check_fits(len(ids), args.max_new_tokens)
    device = parse_device(tuned_cfg.deployment.device)
    meta = {
        "target": tuned_cfg.deployment.target,
        "dtype": dtype_name(target.model.dtype),
        "device": str(device),
        "drafter": tuned_build.label,
    }
    budget = getattr(args, "budget_s", None)
    deadline = None if budget is None else time.perf_counter() + budget
    m = side_by_side(
        engines, encoded, args.max_new_tokens, eos, rounds=args.rounds, deadline=deadline
    )
    rounds = len(m.samples["ar"])
    records = {
        name: records_of(m.last(name), "ar" if name == "ar" else "spec", meta, k=engines[name].k)[0]
        for name in engines
    }
    if args.out:
        append_records(args.out, [r for rs in records.values() for r in rs])
    reports = {name: force_records(stock_build.target.model, records[name]) for name in engines}
    ok = all(r.ok for r in reports.values())
    ratios = {name: m.ratio(name, "ar") for name in engines}
    tuned_vs_stock = m.ratio("tuned", "stock")
    summary = {
        name: {
            "tok_s": m.tok_s(name),
            "vs_ar": ratios[name].to_dict(),
            "forcing": reports[name].summary(),
            "forcing_ok": reports[name].ok,
        }
        for name in engines
    }
    if args.json:
        print(
            json.dumps(
                {
                    "prompts": len(encoded),
                    "rounds": rounds,
                    "simulated_acceptance": tuned_build.simulated,
                    "tuned_vs_stock": tuned_vs_stock.to_dict(),
                    "ar_drift": m.drift("ar"),
                    **summary,
                },
                indent=2,
            )
        )
        return 0 if ok else 1
    cut = f" (cut to {rounds} by the time budget)" if rounds < args.rounds else ""
    print(
        f"compare on {len(encoded)} held-out prompts of {args.prompts} ({meta['target']}, "
        f"{meta['dtype']}, {meta['device']}): {rounds} interleaved rounds after a warm-up{cut}"
    )
    if tuned_build.simulated:
        print(f"  ({SIM_LABEL}: {tuned_cfg.deployment.simulate_acceptance})")
    for name in engines:
        tau = records_of(m.last(name), "spec", meta)[1].mean_accepted_len
        print(
            f"  {name:<6} {m.tok_s(name):8.1f} tok/s  {ratios[name].text():>18} AR  τ {tau:4.2f}  "
            f"{reports[name].summary()}"
        )
    if tuned_cfg.to_json() == stock_cfg.to_json():  # no winner: two copies of one engine
        print(
            f"  tuned over stock speculative: {tuned_vs_stock.text()} — the tuned config is the "
            "stock config (the tune found no winner), so this ratio is only the noise between two "
            "copies of one engine (their buffers placed apart in memory): no verdict"
        )
    else:
        print(f"  tuned over stock speculative: {tuned_vs_stock.text()} — {_say(tuned_vs_stock)}")
    note = m.noise_note("ar")
    if note is not None:
        print(f"  note: {note}")
    return 0 if ok else 1


def _say(r: Ratio) -> str:
    return {
        "faster": "faster in every round",
        "slower": "slower in every round",
        "within noise": "within the noise: no verdict",
        "undecided": "too few rounds for a verdict",
    }[r.verdict()]
