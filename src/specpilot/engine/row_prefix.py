"""Decode steps over the first rows in use only: the part of :class:`~specpilot.engine.engine.Engine`
that narrows its buffers to rows ``0 .. n - 1`` while some steps run.

Every step used to run over all the batch's rows, so a lone request in a 32-row server paid a
32-row forward. ``first_rows(n)`` swaps in views of the row state, the KV cache and the hidden
buffers (the same storage: writes land in the full buffers) and a runner variant, so captured
graphs are per ``n``; ``live_rows`` picks ``n``, the power of two holding every decoding row
(the scheduler fills the lowest free rows first). Rows past ``n`` must not be decoding: they
are idle or frozen in prefill, and a step would commit nothing for them anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from specpilot.engine.rows import HostRows, RowState
    from specpilot.engine.runner import Runner
    from specpilot.models.kv_cache import KVCache


def rows_bucket(top: int, batch: int) -> int:
    """The rows a step covers when rows ``0 .. top - 1`` hold every decoding row: the power of
    two holding them, at most the batch."""
    return min(batch, 1 << (max(top, 1) - 1).bit_length())


def row_buckets(batch: int) -> list[int]:
    """Every row count :func:`rows_bucket` gives for a batch of ``batch`` rows (the graph
    variants of the steps over the first rows)."""
    return sorted({rows_bucket(t, batch) for t in range(1, batch + 1)})


class FirstRows:
    """Mixed into the engine, whose buffers these are."""

    batch: int
    host: HostRows
    runner: Runner
    cache: KVCache | None
    _state: RowState | None
    _final: Tensor | None
    _hidden: Tensor | None

    def live_rows(self) -> int:
        """Rows a decode step must cover: the first ``n`` (a power of two, at most the batch)
        holding every decoding row; the scheduler fills the lowest free rows first."""
        top = max((b + 1 for b, a in enumerate(self.host.active) if a), default=1)
        return rows_bucket(top, self.batch)

    @contextlib.contextmanager
    def first_rows(self, n: int) -> Iterator[None]:
        """Steps run meanwhile see rows ``0 .. n - 1`` only (views of the state, the cache and
        the hidden buffers; graphs of their own). A lone request in a 32-row server then costs a
        one-row forward, not a 32-row one. Rows past ``n`` must not be decoding."""
        if n >= self.batch:
            yield
            return
        saved = self._state, self.cache, self._final, self._hidden
        st, cache, final, hidden = saved
        assert st is not None and cache is not None and final is not None
        self._state, self.cache, self._final = st.head(n), cache.slice(0, n), final[:n]
        self._hidden = None if hidden is None else hidden[:, :n]
        try:
            with self.runner.variant(("rows", n)):
                yield
        finally:
            self._state, self.cache, self._final, self._hidden = saved
