"""``specpilot profile``: the deployment against its cost-model ceiling, gaps ranked.

Measured mode runs the deployment on the one engine (stock AR and speculative on a prompt set,
eager or from CUDA graphs as the deployment says), times every component of the engine's forward
in isolation, and prints predicted vs measured speedup, the ceiling, and the gaps with the
mechanisms that attack them. Under ``--simulate-acceptance`` every figure says so. ``--paper GPU --shape NAME`` predicts for a GPU from
the datasheet table without running anything.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from specpilot.bench.prompts import list_prompt_sets, load_prompt_set
from specpilot.commands.checks import at_least
from specpilot.commands.common import add_engine_args, build_deployment
from specpilot.commands.feedback import Feedback
from specpilot.errors import SpecPilotError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specpilot.costmodel.hardware import GPUS
    from specpilot.costmodel.shapes import BLOCK_DRAFTERS, DRAFT_MODELS, TARGETS

    p = sub.add_parser(
        "profile",
        help="hold a deployment against its cost-model ceiling and rank the gaps",
        description="Measure the deployment's ceilings, per-component times and acceptance; print "
        "predicted, ceiling and measured speedup over AR and the largest gaps with the mechanisms "
        "that attack them. With --paper, predict for a GPU from its datasheet without running.",
    )
    p.add_argument(
        "--prompts",
        default="copy-heavy",
        help=f"prompt set: {', '.join(list_prompt_sets())} (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=4, help="first N prompts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per prompt; medians are kept (default: 1)"
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="timing rounds per component (default: %(default)s)"
    )
    p.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="CPU timing clock; 'process' counts this process's CPU seconds, for a shared, "
        "oversubscribed machine with --threads 1 (default: %(default)s)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report")
    p.add_argument("--chart", type=Path, default=None, metavar="FILE.png", help="draw the cycle")
    paper = p.add_argument_group("on paper (a prediction; nothing runs)")
    paper.add_argument("--paper", default=None, metavar="GPU", help=f"one of {', '.join(GPUS)}")
    paper.add_argument(
        "--shape", default="dense-27b", help=f"one of {', '.join(TARGETS)} (default: %(default)s)"
    )
    paper.add_argument(
        "--paper-drafter",
        default="dflash-b16",
        help=f"ngram, {', '.join([*BLOCK_DRAFTERS, *DRAFT_MODELS])} (default: %(default)s)",
    )
    paper.add_argument(
        "--tau", type=float, default=6.2, help="assumed τ, bonus included (default: %(default)s)"
    )
    paper.add_argument(
        "--context", type=int, default=1024, help="tokens in context (default: %(default)s)"
    )
    add_engine_args(p)


def _run_paper(args: argparse.Namespace) -> int:
    from specpilot.costmodel.paper import PaperAssumptions, predict_on_paper
    from specpilot.costmodel.report import draw_chart, print_report, write_json

    try:
        pred = predict_on_paper(
            args.paper,
            args.shape,
            args.paper_drafter,
            args.tau,
            k=args.k,
            assume=PaperAssumptions(context=args.context),
        )
    except ValueError as e:
        raise SpecPilotError(str(e)) from None
    print_report(pred)
    if args.json is not None:
        write_json(args.json, pred, {"mode": "paper", "date": datetime.date.today().isoformat()})
    if args.chart is not None:
        draw_chart(args.chart, pred, "PREDICTION from datasheet figures — not a measurement")
    return 0


def check(args: argparse.Namespace) -> list[str]:
    """profile's own arguments, before anything is loaded (``commands/checks.py``)."""
    if args.paper is not None:  # nothing is loaded; _run_paper checks the names it looks up
        at_least(args, "tau", 1.0)
        at_least(args, "context", 1)
        return []
    at_least(args, "repeats", 1)
    at_least(args, "rounds", 1)
    if args.clock == "process" and (args.threads or 0) != 1:
        raise SpecPilotError(
            "--clock process counts CPU seconds of all threads; use it with --threads 1."
        )
    load_prompt_set(args.prompts, args.limit)
    return []


def run(args: argparse.Namespace) -> int:
    if args.paper is not None:
        return _run_paper(args)
    from specpilot.costmodel.hardware import measure_ceilings
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.costmodel.report import draw_chart, print_report, write_json

    with Feedback() as feedback:
        dep = build_deployment(args, feedback)
        if args.clock == "process" and dep.device.type != "cpu":
            raise SpecPilotError("--clock process is for the CPU; GPU timings use CUDA events.")
        tok = dep.target.tokenizer
        if tok is None:
            raise SpecPilotError("profile needs the target's tokenizer to encode the prompt set.")
        prompts = load_prompt_set(args.prompts, args.limit)
        encoded = [tok.apply_chat_template(p.messages) for p in prompts]
        ar_engine, spec_engine = dep.engines()
        longest = max(len(ids) for ids in encoded) + args.max_new_tokens
        if longest > min(ar_engine.max_context, spec_engine.max_context):
            raise SpecPilotError(
                f"A prompt plus {args.max_new_tokens} new tokens needs {longest} tokens of "
                f"context, more than this engine holds ({spec_engine.max_context}); lower "
                "--max-new-tokens or --limit, or raise --max-context."
            )
        feedback.timed_phase("measuring the machine's ceilings (copy, matmul, launch)")
        ceilings = measure_ceilings(dep.device, dep.dtype, process_clock=args.clock == "process")
        draft = dep.build.draft_model
        feedback.timed_phase(
            f"warm-up, then {len(encoded)} prompts with AR and the speculative engine, then "
            "each component of the forward"
        )
        result = profile_engines(
            ar_engine,
            spec_engine,
            encoded,
            args.max_new_tokens,
            dep.eos_ids,
            ceilings,
            draft_cfg=None if draft is None else draft.model.cfg,
            repeats=args.repeats,
            rounds=args.rounds,
            clock=args.clock,
            simulated=dep.build.simulated,
        )
    pred = result.prediction
    meta = dep.meta()
    header: dict[str, Any] = {
        "deployment": f"{meta['target']} · {meta['drafter']} · {meta['dtype']} · {meta['device']} "
        f"· {meta['runner']}",
        "prompts": f"{args.prompts} × {len(encoded)}, {args.max_new_tokens} new tokens",
        "ceilings": f"{ceilings.bandwidth_Bps / 1e9:.1f} GB/s copy (r+w), "
        f"{ceilings.matmul_flops / 1e9:.1f} GFLOP/s matmul, {ceilings.launch_s * 1e6:.2f} us/launch "
        f"({ceilings.source}; {ceilings.name})",
    }
    print_report(pred, header)
    if args.json is not None:
        extra = {
            "mode": "measured",
            "date": datetime.date.today().isoformat(),
            "deployment": meta,
            "prompt_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            **result.extra,
        }
        write_json(args.json, pred, extra)
    if args.chart is not None:
        draw_chart(args.chart, pred, header["deployment"])
    return 0
