"""``specpilot verify``: token-force the committed tokens of a records file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from specpilot.bench.records import read_records
from specpilot.bench.runner import force_records
from specpilot.commands.feedback import Feedback
from specpilot.consoles import result_console
from specpilot.errors import SpecPilotError
from specpilot.forcing import ForcingReport
from specpilot.loading.fetch import check_model_spec
from specpilot.runtime import DEFAULT_MAX_CONTEXT, load_model, parse_device, parse_dtype


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="token-force a JSONL of engine runs against the stock target",
        description="For every record (prompt + committed tokens), run the stock target once, "
        "teacher-forced, and classify each committed token as match, near-tie or mismatch. "
        "Exit status 1 on any mismatch.",
    )
    p.add_argument("records", type=Path, help="JSONL written by generate --out or bench --out")
    p.add_argument(
        "--target", default=None, help="stock target (default: the one named in the records)"
    )
    p.add_argument(
        "--dtype", default=None, help="dtype of the stock target (default: the records')"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--engine", default=None, help="only records of this engine (ar, spec, hf)")
    p.add_argument("--json", type=Path, default=None, help="write the full report here")


def check(args: argparse.Namespace) -> list[str]:
    """verify's own arguments, before anything is loaded (``commands/checks.py``)."""
    if not args.records.is_file():
        raise SpecPilotError(
            f"Records file {args.records} does not exist; write one with generate --out or "
            "bench --out."
        )
    if args.dtype is not None:
        parse_dtype(args.dtype)
    parse_device(args.device)
    if args.target is not None:
        check_model_spec(args.target)
    return []


def run(args: argparse.Namespace) -> int:
    records = read_records(args.records)
    if args.engine:
        records = [r for r in records if r.engine == args.engine]
    if not records:
        raise SpecPilotError(f"{args.records} holds no records to verify.")
    targets = {r.target for r in records}
    dtypes = {r.dtype for r in records}
    if (args.target is None and len(targets) > 1) or (args.dtype is None and len(dtypes) > 1):
        raise SpecPilotError(
            "The records mix targets or dtypes; pass --target and --dtype, or --engine to filter."
        )
    target = args.target or targets.pop()
    dtype = parse_dtype(args.dtype or dtypes.pop())
    with Feedback() as feedback:
        device = parse_device(args.device)
        loaded = load_model(target, dtype, device, DEFAULT_MAX_CONTEXT, progress=feedback)
        feedback.phase(f"token forcing {len(records)} records")
        report = force_records(loaded.model, records, feedback.counter(len(records)))
    decode = loaded.tokenizer.decode if loaded.tokenizer is not None else None
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(decode), indent=2))
    print_report(report, decode)
    return 0 if report.ok else 1


def print_report(report: ForcingReport, decode: Callable[[list[int]], str] | None) -> None:
    from rich.table import Table

    console = result_console()
    table = Table(title=f"token forcing ({report.dtype})")
    for col in ("sequence", "match", "near-tie", "mismatch"):
        table.add_column(col, justify="left" if col == "sequence" else "right")
    for s in report.sequences:
        table.add_row(
            s.id, str(s.matches), str(s.near_ties), str(s.mismatches), style=None if s.ok else "red"
        )
    console.print(table)
    first = report.first_mismatch()
    if first is not None:
        seq_id, m = first
        show = (lambda ids: repr(decode(ids))) if decode else (lambda ids: str(ids))
        console.print(
            f"[bold red]first mismatch[/] in {seq_id} at committed position {m.position}: "
            f"token {m.token} {show([m.token])} (logit {m.logit:.4f})"
        )
        console.print(f"  context: …{show(m.context_ids)}")
        for tid, lg in m.top5:
            console.print(f"  target top-5: {tid:>7} {show([tid]):<20} logit {lg:.4f}")
    style = "green" if report.ok else "bold red"
    console.print(f"[{style}]{report.summary()}[/]")
