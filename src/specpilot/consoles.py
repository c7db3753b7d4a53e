"""Rich consoles for results: as wide as the terminal on one, and never wrapped off one.

Off a terminal (a file, a pipe, CI) rich assumes 80 columns and wraps tables and long lines
there, which breaks every line a reader greps for (issue 16). :func:`result_console` gives such
a console no width limit instead: tables keep their natural width, lines stay whole, and no
colour codes are written.
"""

from __future__ import annotations

from rich.console import Console

UNWRAPPED_WIDTH = 10_000
"""Columns of a console that is not on a terminal: more than any line we print."""


def result_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that wraps only on a terminal, at the terminal's width."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)
