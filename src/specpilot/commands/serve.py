"""``specpilot serve``: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from specpilot.commands.checks import at_least, between
from specpilot.commands.common import add_engine_args, build_deployment
from specpilot.commands.feedback import Feedback
from specpilot.errors import SpecPilotError
from specpilot.progress import QUIET, Progress

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specpilot.serve.app import ServeSettings
    from specpilot.serve.worker import EngineWorker


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the engine over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (with streaming), /v1/models, "
        "/health and Prometheus /metrics. Greedy and lossless: temperature > 0 is refused.",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)"
    )
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECPILOT_API_KEY"),
        help="require this bearer key (default: $SPECPILOT_API_KEY, none)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id reported to clients (default: the target spec)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="when a request gives no max_tokens (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body read; a larger one gets a 413 before it is read (default: "
        "32 bytes per token of the context, at least 1 MiB: 1 MiB for a context of 8192)",
    )
    p.add_argument(
        "--audit-rate",
        type=float,
        default=0.0,
        help="fraction of responses token-forced in the background (default: %(default)s)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=4,
        help="requests decoded together in one continuous batch (default: %(default)s)",
    )
    p.add_argument(
        "--stream-window",
        type=int,
        default=4,
        help="AR steps between read-backs at most: streamed text arrives every N steps (the "
        "inter-token latency); 0 = the engine's own window, 16 on CUDA, for throughput "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-lookahead",
        dest="lookahead",
        action="store_false",
        help="read each AR window back before queuing the next one (default: the next window's "
        "first step is queued behind the read-back, so the GPU computes while tokens stream)",
    )
    p.add_argument(
        "--no-prefill-graphs",
        dest="prefill_graphs",
        action="store_false",
        help="run every prefill eagerly (default on CUDA graphs: a one-row prefill from a graph "
        "per width bucket, engine/prefill_graph.py)",
    )
    p.add_argument(
        "--no-warm-graphs",
        dest="warm_graphs",
        action="store_false",
        help="capture each step's CUDA graph on first use (default on CUDA graphs: every shape "
        "the steps can meet is captured at startup, before /health answers, so no request "
        "stalls for a capture; engine/warmup.py)",
    )
    p.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        help="prompt tokens a newly admitted request feeds per step (default: the engine "
        "config's segment_tokens, else 256)",
    )
    add_engine_args(p)


def check(args: argparse.Namespace) -> list[str]:
    """serve's own arguments, before anything is loaded (``commands/checks.py``)."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn")):
        raise SpecPilotError("Serving needs fastapi and uvicorn: pip install 'specpilot[serve]'.")
    between(args, "port", 0, 65535)
    at_least(args, "default_max_tokens", 1)
    between(args, "audit_rate", 0.0, 1.0)
    at_least(args, "max_concurrency", 1)
    at_least(args, "stream_window", 0)
    at_least(args, "segment_tokens", 1)
    at_least(args, "max_body_bytes", 1)
    return []


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise SpecPilotError(
            "Serving needs fastapi and uvicorn: pip install 'specpilot[serve]'."
        ) from None
    with Feedback() as feedback:
        app = build_app(args, feedback)
    print(f"specpilot serve: {startup_line(app.state.settings)}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
    return 0


def startup_line(settings: ServeSettings) -> str:
    """What the server runs, in one line (``simulated acceptance`` in it when it is)."""
    e = settings.engine
    mechs = ", ".join(e["mechanisms"]) or "none"
    warm = e.get("warm_graphs")
    graphs = "" if warm is None else f" · {warm}"
    return (
        f"{settings.model_name} · drafter {e['drafter']} · plan {e['plan']} · mechanisms {mechs} "
        f"· {e['runner']}{graphs} · {e['slots']} slots · context {settings.context} "
        f"· body ≤ {settings.body_limit} bytes"
    )


def build_worker(
    args: argparse.Namespace, progress: Progress = QUIET
) -> tuple[EngineWorker, dict[str, Any]]:
    """The engine thread over a scheduler from the composition root (every plan and mechanism
    the engine config enables; CUDA graphs by default on CUDA, ``--no-graphs``: eager), and a
    description of what it runs. Needs no HTTP package."""
    from specpilot.engine.config import resolve_segment_tokens
    from specpilot.serve.metrics import ServerMetrics
    from specpilot.serve.worker import EngineWorker

    if not 0.0 <= args.audit_rate <= 1.0:
        raise SpecPilotError(f"--audit-rate must be between 0 and 1, got {args.audit_rate}.")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise SpecPilotError(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}.")
    if args.max_concurrency < 1 or (args.segment_tokens is not None and args.segment_tokens < 1):
        raise SpecPilotError("--max-concurrency and --segment-tokens must be at least 1.")
    dep = build_deployment(args, progress)
    tok = dep.target.tokenizer
    if tok is None:
        raise SpecPilotError("Serving needs the target's tokenizer.")
    build = dep.build
    segment_tokens = resolve_segment_tokens(build.config, args.segment_tokens)
    sched = build.scheduler(
        args.max_concurrency,
        segment_tokens,
        window=args.stream_window or None,
        lookahead=args.lookahead,
    )
    if not args.prefill_graphs:
        sched.engine.prefill_widths = ()
    warmed = None  # the startup line says what was captured, and in how long
    if sched.engine.runner.use_graphs:
        warmed = "graphs captured on first use"
        if getattr(args, "warm_graphs", True):
            from specpilot.engine.warmup import warm_graphs

            progress.phase("capturing the CUDA graphs of every step shape")
            warmed = warm_graphs(sched).summary()
    worker = EngineWorker(sched, tok, dep.eos_ids, ServerMetrics(), audit_rate=args.audit_rate)
    plan, meta = sched.engine.plan, dep.meta()
    engine = {
        "target": dep.target.spec,
        "drafter": build.label,
        "simulated_acceptance": build.config.deployment.simulate_acceptance,
        "plan": "ar" if plan is None else plan.name,
        "mechanisms": list(build.config.mechanisms),
        "runner": meta["runner"],
        "dtype": meta["dtype"],
        "device": meta["device"],
        "slots": sched.num_slots,
        "segment_tokens": segment_tokens,
        "warm_graphs": warmed,
    }
    return worker, engine


def build_app(args: argparse.Namespace, progress: Progress = QUIET) -> FastAPI:
    """The HTTP app over :func:`build_worker`'s engine thread."""
    from specpilot.serve.app import ServeSettings, create_app

    worker, engine = build_worker(args, progress)
    settings = ServeSettings(
        model_name=args.served_model_name or engine["target"],
        context=worker.max_context,
        default_max_tokens=args.default_max_tokens,
        api_key=args.api_key,
        engine=engine,
        max_body_bytes=args.max_body_bytes,
    )
    return create_app(worker, settings)
