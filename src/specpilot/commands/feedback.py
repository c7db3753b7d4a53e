"""What a command shows while it works: a spinner with the phase on a terminal, plain lines off one.

:class:`Feedback` is the :class:`~specpilot.progress.Progress` the commands hand to the library
(model fetch, conversion, loading) and use for their own phases (warm-up, the AR pass, token
forcing). On a terminal it is a spinner on stderr showing the current phase, its detail (a
tensor count, the bytes downloaded) and the seconds since the command started; lines printed
meanwhile appear above it. Off a terminal each phase is one flushed line on stderr with the
elapsed seconds, and details are dropped, so that a log shows what happened and when without a
line per tensor. Notes are printed either way.

A phase whose wall time is measured (the AR baseline, a bench round) is started with
:meth:`Feedback.timed_phase`: the spinner's refresh thread is stopped for it, so that it takes
no CPU from the runs it would otherwise slow unevenly; on a terminal the phase is then one line
whose detail is rewritten in place only when the command reports one (between prompts).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.text import Text


class _Label:
    """The spinner's text, with the elapsed seconds read each time rich redraws it."""

    def __init__(self, feedback: Feedback, text: str) -> None:
        self.feedback, self.text = feedback, text

    def __rich__(self) -> Text:
        return Text(f"{self.feedback._elapsed()} {self.text}")


class Feedback:
    """Phases on stderr for one stretch of a command; a context manager (the spinner stops at
    exit). ``started``: the clock reading the elapsed seconds count from (default: now)."""

    def __init__(self, started: float | None = None) -> None:
        self._console = Console(stderr=True)
        self._terminal = self._console.is_terminal
        self._status: Any = None  # the spinner while an untimed phase runs on a terminal
        self._open_line = False  # a timed phase's line on a terminal, awaiting its newline
        self._phase = ""
        self.started = time.perf_counter() if started is None else started

    def __enter__(self) -> Feedback:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop_spinner()
        self._end_line()

    def _elapsed(self) -> str:
        return f"[{time.perf_counter() - self.started:5.1f}s]"

    def _stop_spinner(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _end_line(self) -> None:
        if self._open_line:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._open_line = False

    def _line(self, text: str) -> None:
        print(f"specpilot: {self._elapsed()} {text}", file=sys.stderr, flush=True)

    def phase(self, text: str) -> None:
        """A new untimed step: the spinner's text on a terminal, a line elsewhere."""
        self._phase = text
        if not self._terminal:
            self._line(f"{text} ...")
            return
        self._end_line()
        label = _Label(self, f"{text} ...")
        if self._status is None:
            self._status = self._console.status(label)
            self._status.start()
        else:
            self._status.update(label)

    def timed_phase(self, text: str) -> None:
        """A new step whose wall time is measured: no spinner thread runs during it."""
        self._phase = text
        self._stop_spinner()
        self._end_line()
        if not self._terminal:
            self._line(f"{text} ...")
            return
        sys.stderr.write(f"specpilot: {self._elapsed()} {text} ...")
        sys.stderr.flush()
        self._open_line = True

    def detail(self, text: str) -> None:
        """How far the step is: on a terminal only (spinner text, or the timed line rewritten)."""
        if self._status is not None:
            self._status.update(_Label(self, f"{self._phase}: {text}"))
        elif self._open_line:
            sys.stderr.write(f"\r\x1b[2Kspecpilot: {self._elapsed()} {self._phase}: {text}")
            sys.stderr.flush()

    def counter(self, total: int) -> Callable[[], None]:
        """A callback to call once per item done; shows ``done/total`` as the step's detail."""
        done = 0

        def one() -> None:
            nonlocal done
            done += 1
            self.detail(f"{done}/{total}")

        return one

    def say(self, text: str, stream: TextIO) -> None:
        """A result line on ``stream`` (stdout or stderr) while the feedback runs, on a line of
        its own (above the spinner, after a timed phase's line)."""
        self._end_line()
        print(text, file=stream, flush=True)

    def note(self, text: str) -> None:
        """One line the user must see, whatever the output is."""
        self._end_line()
        if self._status is not None:  # printed above the spinner
            self._console.print(escape(f"specpilot: {text}"), soft_wrap=True, highlight=False)
        else:
            print(f"specpilot: {text}", file=sys.stderr, flush=True)
