"""Every argument checked before anything is loaded: one sentence each, exit status 2.

``cli.main`` runs ``commands.common.check_args`` first: :func:`check_shared` (the options
several commands share, by name), the deployment a command would build
(``common.check_deployment``), then the command's own ``check(args)`` when its module has one.
A check reads only small files (an engine config, a messages file, a prompt set) and never a
model, so a typo costs a second, not a model load. What a check wants the user to know without
refusing (``-k 0`` means plain AR) comes back as notes, which the CLI prints on stderr. This
module holds the helpers and imports no command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from specpilot.errors import SpecPilotError

MAX_K = 64
"""Most tokens a cycle may draft. Every cycle verifies k + 1 tokens in one target forward and
each row keeps 2·(k + 1) context slots free for the verify block (``Engine.context_margin``), so
past this the verify costs more than its drafts can return: greedy drafts are accepted in full
ever more rarely, DFlash drafts blocks of 16, and ``tune`` searches k up to 16."""

Check = Callable[[argparse.Namespace], list[str]]
"""A command's own check: raises SpecPilotError, or returns notes."""


def flag(dest: str) -> str:
    """The option a namespace attribute came from (``max_new_tokens`` → ``--max-new-tokens``)."""
    return "-k" if dest == "k" else "--" + dest.replace("_", "-")


def at_least(args: argparse.Namespace, dest: str, low: float) -> None:
    """``--dest`` must be at least ``low`` when it is given."""
    value = getattr(args, dest, None)
    if value is not None and value < low:
        raise SpecPilotError(f"{flag(dest)} must be at least {low}, got {value}.")


def between(args: argparse.Namespace, dest: str, low: float, high: float) -> None:
    value = getattr(args, dest, None)
    if value is not None and not low <= value <= high:
        raise SpecPilotError(f"{flag(dest)} must be between {low} and {high}, got {value}.")


def existing_file(path: Path | None, what: str) -> None:
    if path is not None and not Path(path).is_file():
        raise SpecPilotError(f"{what} {path} does not exist.")


def writable_file(path: Path | None, what: str) -> None:
    """An output file: not a directory, and its folder can be made."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise SpecPilotError(f"{what} {path} is a directory; give a file name.")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise SpecPilotError(f"{what} {path} cannot be written: {parent} is not a directory.")


def check_shared(args: argparse.Namespace) -> None:
    """Checks of the options several commands share, by their names."""
    at_least(args, "max_new_tokens", 1)
    at_least(args, "threads", 1)
    at_least(args, "limit", 1)
    at_least(args, "requests", 1)
    # tune's search options (commands/tune.py): only what no reading of them allows
    budget = getattr(args, "budget", None)
    if budget is not None and budget <= 0:
        raise SpecPilotError(f"--budget must be more than 0 seconds, got {budget}.")
    for dest in ("trials", "directions", "measure_rounds", "workers"):
        at_least(args, dest, 1)
    at_least(args, "compare_limit", 0)
    prompts = getattr(args, "prompts", None)
    if isinstance(prompts, str):
        from specpilot.bench.prompts import list_prompt_sets

        if prompts not in list_prompt_sets() and not prompts.endswith(".jsonl"):
            raise SpecPilotError(
                f"Unknown prompt set '{prompts}'; choose {', '.join(list_prompt_sets())} or give "
                'a .jsonl file of {"id", "prompt"} objects.'
            )
        if prompts.endswith(".jsonl"):
            existing_file(Path(prompts), "Prompt file")
