"""How slow library work (fetching, converting, loading a model) tells its caller how far it is.

The library never prints progress itself: a caller that wants it passes a :class:`Progress`
(the commands pass a spinner on a terminal and plain lines elsewhere, ``commands/feedback.py``);
everyone else gets :data:`QUIET`. Three levels, so that a log off a terminal stays short:

* ``phase`` — a new step ("dequantizing model.gguf"); printed as a line when not on a terminal;
  ``timed_phase`` is a step whose wall time is measured (a bench round): the reporter must run
  nothing meanwhile (no spinner thread), so that it slows no measured run;
* ``detail`` — how far the current step is ("tensor 120/272", "41.9 MB"); shown only on a
  spinner, never as a line;
* ``note`` — something the user should see whatever the output is (a model is being fetched, a
  corrupt cache entry is rebuilt): always one line on stderr.
"""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    def phase(self, text: str) -> None:
        """A new step of the work begins."""

    def timed_phase(self, text: str) -> None:
        """A new step begins whose wall time is measured: report it without running anything."""

    def detail(self, text: str) -> None:
        """How far the current step is (may be called often)."""

    def note(self, text: str) -> None:
        """One line the user must see (printed, not only shown on a spinner)."""


class _Quiet:
    """Phases and details dropped, notes as one ``specpilot: ...`` line each on stderr
    (stateless, so one instance serves every caller)."""

    __slots__ = ()

    def phase(self, text: str) -> None:
        pass

    def timed_phase(self, text: str) -> None:
        pass

    def detail(self, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        print(f"specpilot: {text}", file=sys.stderr, flush=True)


QUIET: Progress = _Quiet()
"""The default for library calls: no progress, notes on stderr."""


def megabytes(n: int) -> str:
    """Bytes as the progress lines show them (``41.9 MB``)."""
    return f"{n / 1e6:.1f} MB"
