"""Admission of prompts into rows of a running batch (segment by segment), between cycles.

The segments one step feeds go in as few target forwards as they can (``packed_admission``):
segments from slot 0 (a new prompt, or its first segment) are packed end to end, up to the
graphed prefill's token budget, into one forward each (``engine/prefill_graph.py``: CUDA graphs
per width bucket; the same step eagerly on the CPU), so a wave of requests arriving together is
admitted in one or two forwards; the other segments (later segments of a long prompt, and every
segment when the graphed path is off) run eagerly, rows that are contiguous in the batch
together, padded to the longest segment, in one forward over that slice of the KV cache. Either
way each segment's K/V lands at its row's own slots and the drafter sees the same segment (with
the target's hidden states when it reads them). Other rows are untouched, so their tokens
cannot change.

A row still in prefill is frozen at ``committed_len = prefilled + 1`` (see ``engine/rows.py``),
so the cycles that run over the batch in between only write past its prompt so far. When the
last segment is in, the target's argmax after the prompt is the row's first committed token and
the row decodes from the next cycle on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.drafters.base import Segment
from specpilot.engine.requests import check_fits

if TYPE_CHECKING:
    from specpilot.engine.view import EngineView


def contiguous_runs(rows: Sequence[int]) -> list[list[int]]:
    """Indices into ``rows`` grouped into runs of consecutive row numbers (sorted by row)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    runs: list[list[int]] = []
    for i in order:
        if runs and rows[runs[-1][-1]] + 1 == rows[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


@dataclass(frozen=True, slots=True)
class Admission:
    """Prompt segments to feed (``Engine.prefill``): segment ``i`` is
    ``prompts[i][starts[i] : starts[i] + seg_lens[i]]`` of row ``rows[i]``, whose request may
    then commit ``max_news[i]`` tokens."""

    rows: Sequence[int]
    prompts: Sequence[Sequence[int]]
    starts: Sequence[int]
    seg_lens: Sequence[int]
    max_news: Sequence[int]


def prefill_rows(engine: EngineView, adm: Admission) -> list[int | None]:
    rows, prompts, starts, seg_lens, max_news = (
        adm.rows, adm.prompts, adm.starts, adm.seg_lens, adm.max_news
    )  # fmt: skip
    """See :meth:`Engine.prefill`."""
    room = engine.capacity - engine.context_margin()
    for prompt, s, n, new in zip(prompts, starts, seg_lens, max_news, strict=True):
        check_fits(len(prompt), new, room, "that each row was opened for")
        if not (s >= 0 and n >= 1 and s + n <= len(prompt)):
            raise ValueError(f"segment [{s}, {s + n}) outside a prompt of {len(prompt)} tokens")
    firsts: list[int | None] = [None] * len(rows)
    packs, rest = packed_admission(engine, adm)
    groups = [(p, _prefill_pack) for p in packs] + [(r, _prefill_run) for r in rest]
    for group, feed in groups:
        for i, first in zip(group, feed(engine, group, adm), strict=True):
            firsts[i] = first
    engine.prefill_forwards += len(groups)
    return firsts


def packed_admission(engine: EngineView, adm: Admission) -> tuple[list[list[int]], list[list[int]]]:
    """Indices into ``adm.rows`` grouped into forwards: packs of segments from slot 0 for the
    graphed prefill (``engine/prefill_graph.py``; in row order, each up to its token budget),
    then runs of contiguous rows for the eager forward (the rest)."""
    graph = engine.prefill_graph() if graphable_prefill(engine) else None
    budget = 0 if graph is None else graph.w_max
    packs: list[list[int]] = []
    eager: list[int] = []
    used = budget
    for i in sorted(range(len(adm.rows)), key=lambda i: adm.rows[i]):
        n = adm.seg_lens[i]
        if adm.starts[i] != 0 or n > budget:
            eager.append(i)
            continue
        if used + n > budget:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    runs = contiguous_runs([adm.rows[i] for i in eager])
    return packs, [[eager[j] for j in run] for run in runs]


def graphable_prefill(engine: EngineView) -> bool:
    """Whether a prefill from slot 0 may take the graphed path (``engine/prefill_graph.py``): no
    drafter that reads the target's hidden states, and no LM-head plug that may not be captured
    (the graph holds the argmax)."""
    drafter, head = engine.drafter, engine.target.argmax_head
    reads_hidden = drafter is not None and bool(drafter.hidden_layers)
    return not reads_hidden and (head is None or bool(getattr(head, "graph_safe", False)))


def _prefill_pack(engine: EngineView, pack: list[int], adm: Admission) -> list[int | None]:
    """The segments of ``pack`` (from slot 0) in one graphed forward; then, for a drafter, the
    same segments by runs of contiguous rows, padded as the eager path gives them."""
    graph = engine.prefill_graph()
    assert graph is not None and engine.cache is not None
    rows = [adm.rows[i] for i in pack]
    segments = [adm.prompts[i][: adm.seg_lens[i]] for i in pack]
    w = graph.width(sum(len(s) for s in segments))
    assert w is not None
    st = engine.state
    tokens = graph.run(engine.runner, st, engine.fwd, engine.cache, rows, segments, w)
    out = _admit(engine, pack, adm, tokens, graph.x_last[: len(pack)], graph.first)
    drafter = engine.drafter
    if drafter is not None:
        for run in contiguous_runs(rows):
            r0, width = rows[run[0]], max(len(segments[j]) for j in run)
            padded = torch.zeros(len(run), width, dtype=torch.int64, device=engine.device)
            for j, k in enumerate(run):
                padded[j, : len(segments[k])].copy_(tokens[k])
            start = torch.zeros(len(run), dtype=torch.int64, device=engine.device)
            drafter.prefill(engine, Segment(r0, padded, start, engine.bucket(width), None))
    return out


def _prefill_run(engine: EngineView, run: list[int], adm: Admission) -> list[int | None]:
    """Segments of contiguous rows padded to the longest, in one eager forward."""
    drafter = engine.drafter
    layers = () if drafter is None else drafter.hidden_layers
    tokens, start, x_last, attn_len, hidden = _eager_forward(engine, run, adm, layers)
    first = engine.fwd.argmax(x_last)  # [b]
    per_row = [tokens[j, : adm.seg_lens[i]] for j, i in enumerate(run)]
    out = _admit(engine, run, adm, per_row, x_last, first)
    if drafter is not None:
        r0 = adm.rows[run[0]]
        drafter.prefill(engine, Segment(r0, tokens, start, attn_len, hidden))
    return out


def _admit(
    engine: EngineView,
    group: list[int],
    adm: Admission,
    tokens: Sequence[Tensor],  # per member: its segment's tokens [n] on the device
    x_last: Tensor,  # [b, H]: each member's last segment token's output
    first: Tensor,  # [>= b]: its argmax
) -> list[int | None]:
    """The row state after a forward fed the segments of ``group``: a row whose prompt is in
    commits ``first`` and decodes from the next cycle on; the others stay frozen in prefill."""
    rows, prompts, starts, seg_lens, max_news = (
        adm.rows, adm.prompts, adm.starts, adm.seg_lens, adm.max_news
    )  # fmt: skip
    st, h = engine.state, engine.host
    where = [rows[i] for i in group]
    engine.ahead.difference_update(where)  # their device state starts afresh
    index = torch.tensor(where, dtype=torch.int64, device=engine.device)
    engine.final_hidden[:, 0].index_copy_(0, index, x_last)  # the first token's logprobs read it
    firsts = first[: len(group)].tolist()
    out: list[int | None] = []
    for j, i in enumerate(group):
        row, s, n = rows[i], starts[i], seg_lens[i]
        st.tokens[row, s : s + n].copy_(tokens[j])
        if s == 0 and engine.plan is not None:  # a new sequence: the plan forgets the old
            engine.plan.reset_row(row)
        if s + n == len(prompts[i]):
            st.tokens[row, s + n] = first[j]
            st.pending[row] = first[j]
            st.active[row] = 1
            h.lens[row], h.final[row] = s + n + 1, s + n + max_news[i]
            h.contexts[row] = [*prompts[i], firsts[j]]
            h.active[row] = True
            h.filled.append(row)
            out.append(firsts[j])
        else:
            st.tokens[row, s + n] = 0
            st.pending[row] = 0
            st.active[row] = 0
            h.lens[row], h.final[row] = s + n + 1, s + n + 1
            h.contexts[row], h.active[row] = [], False
            out.append(None)
        st.committed_len[row] = s + n + 1
        st.prev_committed[row] = s + n + 1
        st.draft_lens[row] = 0
        st.accepted[row] = 0
    return out


def _eager_forward(
    engine: EngineView, run: list[int], adm: Admission, layers: Sequence[int]
) -> tuple[Tensor, Tensor, Tensor, int, Tensor | None]:
    """The run's rows padded to its longest segment in one eager forward over their slice of
    the cache. Returns the tokens ``[b, T]``, the starts ``[b]``, the last real token's output
    ``[b, H]``, the attention length and the outputs of ``layers`` (for the drafter)."""
    rows, prompts, starts, seg_lens = adm.rows, adm.prompts, adm.starts, adm.seg_lens
    cache, dev = engine.cache, engine.device
    assert cache is not None
    r0, b = rows[run[0]], len(run)
    width = max(seg_lens[i] for i in run)
    padded = torch.zeros(b, width, dtype=torch.int64)
    for j, i in enumerate(run):
        s = starts[i]
        padded[j, : seg_lens[i]] = torch.tensor(
            list(prompts[i][s : s + seg_lens[i]]), dtype=torch.int64
        )
    tokens = padded.to(dev)  # [b, T]
    start = torch.tensor([starts[i] for i in run], dtype=torch.int64, device=dev)  # [b]
    hidden = None
    if layers:
        cfg, dt = engine.target.cfg, engine.target.dtype
        hidden = torch.empty(len(layers), b, width, cfg.hidden_size, dtype=dt, device=dev)
    attn_len = engine.bucket(max(starts[i] + width for i in run))
    host_start = starts[run[0]] if b == 1 and not engine.runner.use_graphs else None
    view = cache.slice(r0, b)
    x = engine.fwd.dense(tokens, view, start, attn_len, layers, hidden, host_start)  # [b*T, H]
    last = torch.tensor([j * width + seg_lens[i] - 1 for j, i in enumerate(run)], device=dev)
    return tokens, start, x.index_select(0, last), attn_len, hidden
