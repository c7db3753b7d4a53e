"""``specpilot generate``: one prompt, streamed, with its speedup over AR and a forcing verdict."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specpilot.bench.records import append_records, make_record
from specpilot.bench.runner import force_records, timed_generate, warm_up
from specpilot.commands.checks import writable_file
from specpilot.commands.common import add_engine_args, build_deployment
from specpilot.commands.feedback import Feedback
from specpilot.errors import SpecPilotError
from specpilot.loading import TextTokenizer

DEFAULT_PROMPT = (
    "Rewrite this function with the variable `lst` renamed to `items`, and return the whole code:\n\n"
    "def mean(lst):\n    if not lst:\n        return 0.0\n    total = 0.0\n    for x in lst:\n"
    "        total += x\n    return total / len(lst)\n"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from one prompt with speculative decoding",
        description="Generate greedily from one prompt with speculative decoding, then (by default) "
        "run plain AR decoding for the speedup and token-force the output to prove it lossless.",
    )
    p.add_argument(
        "prompt", nargs="?", default=None, help="prompt text (default: a small code-edit task)"
    )
    p.add_argument(
        "--messages",
        type=Path,
        default=None,
        help="JSON file with chat messages [{role, content}, ...]",
    )
    p.add_argument(
        "--raw", action="store_true", help="do not wrap the prompt in the model's chat template"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the AR run (no speedup figure)")
    p.add_argument("--no-verify", action="store_true", help="skip token forcing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--out", type=Path, default=None, help="append run records (JSONL) for `specpilot verify`"
    )
    add_engine_args(p)


def check(args: argparse.Namespace) -> list[str]:
    """generate's own arguments, before anything is loaded (``commands/checks.py``)."""
    if args.messages is not None:
        if args.prompt is not None:
            raise SpecPilotError("Give a prompt or --messages, not both.")
        read_messages(args.messages)
    writable_file(args.out, "--out")
    return []


def read_messages(path: Path) -> list[dict[str, str]]:
    try:
        messages = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPilotError(
            f"--messages {path} is not a readable JSON list of messages ({e})."
        ) from None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise SpecPilotError(
            '--messages must hold a JSON list of {"role": ..., "content": ...} objects.'
        )
    return messages


def _prompt_ids(args: argparse.Namespace, tok: TextTokenizer) -> list[int]:
    if args.messages is not None:
        return tok.apply_chat_template(read_messages(args.messages))
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.raw or not tok.has_chat_template:
        return tok.encode(text)
    return tok.apply_chat_template([{"role": "user", "content": text}])


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with Feedback(started) as feedback:
        dep = build_deployment(args, feedback)
        tok = dep.target.tokenizer
        assert tok is not None
        prompt_ids = _prompt_ids(args, tok)
        ar_engine, spec_engine = dep.engines()
        spec_engine.check_fits(len(prompt_ids), args.max_new_tokens)
        baseline = not args.no_baseline and dep.build.drafter is not None  # no drafter: it is AR
        # Only the engine that streams warms up before the first token; AR warms up after it,
        # before its own timed run.
        feedback.phase("warming up the engine")
        warm_up([spec_engine], [("prompt", prompt_ids)], args.max_new_tokens, dep.eos_ids)
        if args.json:  # nothing streams: say what runs
            feedback.timed_phase(
                f"generating up to {args.max_new_tokens} tokens ({dep.drafter_name})"
            )
            spec_res, spec_s = timed_generate(
                spec_engine, prompt_ids, args.max_new_tokens, dep.eos_ids
            )

    streamed: list[int] = []
    printed = ""

    def stream(row: int, tokens: list[int]) -> None:
        # Streaming costs the speculative run a decode per cycle; the AR run pays none (the
        # speedup is, if anything, understated).
        nonlocal printed
        streamed.extend(tokens)
        text = tok.decode(streamed, skip_special_tokens=True)
        if text.startswith(printed):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text

    meta = dep.meta()
    if not args.json:  # the tokens stream to stdout, with no spinner in between
        spec_res, spec_s = timed_generate(
            spec_engine, prompt_ids, args.max_new_tokens, dep.eos_ids, stream
        )
        sys.stdout.write("\n\n")
        sys.stdout.flush()
    spec = make_record(
        "prompt",
        "spec",
        meta,
        prompt_ids,
        spec_res.tokens,
        spec_res.stop_reason,
        spec_s,
        k=spec_engine.k,
        stats=spec_res.stats.to_dict(),
    )
    records = [spec]
    out: dict[str, object] = {
        "text": tok.decode(spec_res.tokens, skip_special_tokens=True),
        "tokens": len(spec.tokens),
        "tok_s": spec.tok_s,
        "mean_accepted_len_incl_bonus": spec_res.stats.mean_accepted_len,
        "drafter": dep.drafter_name,
        "mechanisms": dict(dep.build.config.mechanisms),
        "dtype": meta["dtype"],
        "device": meta["device"],
    }
    with Feedback(started) as feedback:
        if baseline:
            feedback.phase("warming up plain AR")
            warm_up([ar_engine], [("prompt", prompt_ids)], args.max_new_tokens, dep.eos_ids)
            feedback.timed_phase(
                f"plain AR on the same prompt, for the speedup ({args.max_new_tokens} tokens at most)"
            )
            ar_res, ar_s = timed_generate(ar_engine, prompt_ids, args.max_new_tokens, dep.eos_ids)
            ar = make_record(
                "prompt", "ar", meta, prompt_ids, ar_res.tokens, ar_res.stop_reason, ar_s
            )
            records.append(ar)
            out |= {
                "ar_tok_s": ar.tok_s,
                "speedup": spec.tok_s / ar.tok_s,
                "identical_to_ar": ar.tokens == spec.tokens,
            }
        verdict_ok = True
        if not args.no_verify:
            feedback.phase(f"token forcing the {len(spec.tokens)} committed tokens")
            report = force_records(dep.target.model, [spec])
            verdict_ok = report.ok
            out["forcing"] = report.to_dict(tok.decode)
            out["forcing_summary"] = report.summary()
    if args.out is not None:
        append_records(args.out, records)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        mechs = list(dep.build.config.mechanisms)  # they edit the target: AR runs them too
        with_ = " + ".join([dep.drafter_name, *mechs])
        line = f"{len(spec.tokens)} tokens at {spec.tok_s:.1f} tok/s with {with_}, τ = {spec_res.stats.mean_accepted_len:.2f} (incl. bonus)"
        if "speedup" in out:
            ar_name = "AR" + (f" + {' + '.join(mechs)}" if mechs else "")
            line += f"; {ar_name} {out['ar_tok_s']:.1f} tok/s → speedup {out['speedup']:.2f}× (one run each)"
            line += (
                ", output identical to AR" if out["identical_to_ar"] else ", output DIFFERS from AR"
            )
        print(line)
        if "forcing_summary" in out:
            print(out["forcing_summary"])
    return 0 if verdict_ok else 1
