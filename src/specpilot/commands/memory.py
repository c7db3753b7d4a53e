"""``specpilot memory``: what tuning has tried and validated, per deployment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.errors import SpecPilotError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory",
        help="list, show or export the tuning memory",
        description="Read the SQLite memory that tune writes.",
    )
    p.add_argument(
        "--memory",
        type=Path,
        default=None,
        help="SQLite memory file (default: <cache>/memory.sqlite)",
    )
    msub = p.add_subparsers(dest="memory_cmd", required=True, metavar="{list,show,export}")
    msub.add_parser("list", help="deployments with their best validated speedup")
    s = msub.add_parser("show", help="the trials of one deployment")
    s.add_argument("deployment", help="deployment key (from memory list) or a unique prefix")
    e = msub.add_parser("export", help="everything as JSON")
    e.add_argument("--out", type=Path, default=None, help="file (default: stdout)")


def run(args: argparse.Namespace) -> int:
    from specpilot.commands.tune import default_memory
    from specpilot.engine.config import EngineConfig
    from specpilot.memory import MemoryStore
    from specpilot.tune.space import describe

    path = args.memory or default_memory()
    if not path.is_file():
        raise SpecPilotError(f"No memory at {path} yet; run specpilot tune first.")
    with MemoryStore(path) as store:
        if args.memory_cmd == "export":
            text = json.dumps(store.export(), indent=2)
            if args.out:
                args.out.write_text(text)
            else:
                print(text)
            return 0
        deployments = store.deployments()
        if args.memory_cmd == "list":
            for key, _fp, label in deployments:
                best = store.validated(key)
                trials = store.trials(deployment=key)
                summary = f"best {best[0]['speedup']:.2f}x" if best else "nothing validated"
                runs = len({t.run for t in trials})
                print(f"{key}  {label}  {len(trials)} trials in {runs} run(s), {summary}")
            return 0
        keys = [k for k, _, _ in deployments if k.startswith(args.deployment)]
        if len(keys) != 1:
            raise SpecPilotError(
                f"'{args.deployment}' matches {len(keys)} deployments; give more of the key."
            )
        for t in store.trials(deployment=keys[0]):
            verdict = "pass" if t.forcing_ok else "REJECTED"
            cfg = describe(EngineConfig.from_dict(t.config))
            print(
                f"run {t.run} round {t.round} {t.explorer:<22} {cfg:<40} {t.metrics['speedup']:.2f}x  {verdict}"
            )
    return 0
