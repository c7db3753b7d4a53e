"""The one engine: rows of a batch, and the propose → verify → accept → commit cycle over them.

Per step, for every decoding row at once:

1. **propose** — the drafter writes up to k drafted tokens per row into the row state;
2. **verify** — the target runs once over ``[pending, d_1..d_w]`` per row (the verify plan,
   ``engine/plans.py``, says how: a dense chain, a packed ragged block or a tree);
3. **accept** — on the device, the longest drafted prefix (or tree path) equal to the target's
   argmax, plus the target's bonus token (``engine/accept.py``), committed to the row state;
4. **commit** — one device→host copy of ``[accepted, a_0..a_{W-1}]`` per row; the host extends
   each row's context and reports the committed tokens.

With no drafter every step is AR (the k = 0 case of the same cycle): ``sync_every`` steps are
queued before the committed tokens are read back once (1 on the CPU, where reading is free).
The engine does not cut at stop tokens or length limits: its caller does (``engine/
scheduler.py``, the one loop over requests) and releases a finished row; a row may run up to
``context_margin`` slots past its limit before that, which every open batch keeps free.

The cycle bodies are in ``engine/cycles.py``; a verify head that may abstain (the graph-safe
exact-argmax head) has its verify redone with the stock head there (``engine/abstain.py``).

Every step runs through the :class:`~specpilot.engine.runner.Runner`: eagerly, or replayed from
CUDA graphs captured per shape key (the default on CUDA). The forward is the one layer body of
``models/forward.py``. Rows: ``engine/rows.py``; admission of prompts: :meth:`Engine.prefill`.
The engine implements :class:`~specpilot.drafters.base.DraftRows`, the view drafters get.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter, gateable
from specpilot.engine.cycles import ar_window, spec_cycle
from specpilot.engine.gate import SpecGate, gated_ar_window, resync_drafter
from specpilot.engine.plans import ChainPlan, TreePlan
from specpilot.engine.prefill_graph import GraphedPrefill, PrefillGraph
from specpilot.engine.requests import check_fits
from specpilot.engine.row_prefix import FirstRows
from specpilot.engine.rows import IDLE_LEN, HostRows, RowState
from specpilot.engine.runner import Runner
from specpilot.engine.steps import VerifySteps
from specpilot.engine.types import CycleTimes, PhaseClock, RowCommit
from specpilot.engine.view import VerifyPlan
from specpilot.errors import PromptTooLongError
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer


class Engine(VerifySteps, FirstRows, GraphedPrefill):
    """Greedy speculative decoding over the rows of a batch; ``drafter=None`` is plain AR."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        *,
        plan: VerifyPlan | None = None,
        graphs: bool | None = None,
        attn_bucket: int = 128,
        sync_every: int | None = None,
        fuse_residual: bool | None = None,
        profile: bool = False,
        capacity: int | None = None,
        verify_width: int = 0,
        gate: SpecGate | None = None,
    ) -> None:
        """``graphs``: run steps from CUDA graphs (default: on CUDA). ``plan``: the verify plan
        (default: the chain). ``profile``: time the draft, verify and accept phases.
        ``capacity``: KV slots per row (default: the model's RoPE table), allocated once, so
        that graphs captured on the buffers stay valid for every later request.
        ``verify_width``: the widest forward ``time_forward`` may time (verify-cost curves).
        ``gate``: turns drafting off for rows whose drafts stop paying (``engine/gate.py``)."""
        if plan is not None and drafter is None:
            raise ValueError("A verify plan needs a drafter; plain AR verifies one token per row.")
        self.target = target
        self.drafter = drafter
        self.device = target.device
        cuda = self.device.type == "cuda"
        self.fwd = Forward(target, fuse_residual=fuse_residual)
        self.runner = Runner(self.device, cuda if graphs is None else graphs)
        self.attn_bucket = attn_bucket
        self.sync_every = sync_every if sync_every is not None else (16 if cuda else 1)
        self.k = 0 if drafter is None else drafter.k
        self.plan: VerifyPlan | None = plan or (ChainPlan() if drafter is not None else None)
        width = self.plan.block_width(self.k) if self.plan is not None else 1
        depth = self.plan.depth(self.k) if isinstance(self.plan, TreePlan) else self.k
        self.k_max = max(self.k, width - 1, depth, verify_width - 1)
        self.profile = profile
        limit = target.max_positions
        self.slots = limit if capacity is None else min(capacity, limit)
        self.times = CycleTimes()
        self.batch = 0
        self.cache: KVCache | None = None
        self._state: RowState | None = None
        self._hidden: Tensor | None = None  # [n_sel, B, k_max+1, hidden]
        self._final: Tensor | None = None  # [B, k_max+1, hidden]
        self.draft_caps: list[int | None] = []
        """Per row: the most drafts it may verify per cycle (None: the plan's; 0: no drafting,
        AR steps when every decoding row has 0). Speed only: every committed token is the
        target's argmax either way. The caller sets it when a row takes a request."""
        self._draft_host: Tensor | None = None  # [B, k+1] pinned: host drafts + their lengths
        self.host = HostRows.idle(0)
        self.clock = PhaseClock(self.device)
        self.gate = gate if drafter is not None and gateable(drafter) else None
        self.unsynced: dict[int, int] = {}
        """Rows whose drafter paused (gated AR steps) -> their committed length then."""
        self.abstains = 0
        """Verifies (cycles or AR windows) redone with the stock head after its head abstained."""
        self.last_verify: tuple[Callable[[], None], Callable[[], None]] | None = None
        """The last cycle's verify and accept steps (redone when the verify head abstains)."""
        self.prefill_widths: tuple[int, ...] | None = None
        """Width buckets of the graphed (packed) prefill (``engine/prefill_graph.py``); None:
        ``PREFILL_WIDTHS`` when the runner uses graphs, else none (every prefill eager)."""
        self.prefill_forwards = 0
        """Target forwards that fed prompt segments since the engine was made (``Engine.prefill``
        runs one per pack or eager run, ``engine/admission.py``)."""
        self._prefill_graph: PrefillGraph | None = None
        self.ahead: set[int] = set()
        """Rows whose device state is one AR step past the host mirror (``ar_window``'s
        lookahead): the next read-back takes that step's token with its own."""

    # ------------------------------------------------------------------ sizes
    def context_margin(self) -> int:
        """Slots past a row's limit that a step may write (drafts, verify block, AR window)."""
        return 2 * (self.k_max + 1) + self.sync_every + 2

    @property
    def max_context(self) -> int:
        """Longest prompt + new tokens a row can hold (its slots less the margin)."""
        return self.slots - self.context_margin()

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """One clear error, before any slow work, for a request this engine cannot hold."""
        check_fits(prompt_len, max_new_tokens, self.max_context, "that this engine holds")

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.max_seq_len

    def bucket(self, need: int) -> int:
        """Attention length for ``need`` slots: exact when eager, rounded up to the bucket on
        CUDA graphs (one graph per bucket)."""
        cap = self.capacity
        if not self.runner.use_graphs:
            return min(need, cap)
        b = self.attn_bucket
        return min(-(-need // b) * b, cap)

    @property
    def verify_graph_safe(self) -> bool:
        head = self.target.argmax_head
        return (
            head is None
            or bool(getattr(head, "graph_safe", False))
            or hasattr(head, "abstain_flag")
        )

    @property
    def abstain_flag(self) -> Tensor | None:
        """``[1]`` int64: the verify head's abstain flag, if it has one (the abstain protocol)."""
        return getattr(self.target.argmax_head, "abstain_flag", None)

    # ------------------------------------------------------------------ the view drafters get
    @property
    def state(self) -> RowState:
        if self._state is None:
            raise RuntimeError("No rows are open; call open() first.")
        return self._state

    @property
    def verify_hidden(self) -> Tensor | None:
        return None if self._hidden is None else self._hidden[:, :, : self.k + 1]

    @property
    def final_hidden(self) -> Tensor:
        """``[B, k_max+1, hidden]``: the last layer's output (before the final norm) at each
        position of the latest verify block (after a prefill: at its last prompt token, column
        0), so committed token j of a cycle is the argmax of the LM head over column j."""
        if self._final is None:
            raise RuntimeError("No rows are open; call open() first.")
        return self._final

    @property
    def contexts(self) -> list[list[int]]:
        return self.host.contexts

    @property
    def active(self) -> list[bool]:
        return self.host.active

    def committed_lens(self) -> list[int]:
        return list(self.host.lens)

    def room(self) -> list[int]:
        """Per row: tokens it may still commit before its length limit (a verify wider than
        this drafts tokens its caller would cut)."""
        h = self.host
        return [max(f - n, 1) for f, n in zip(h.final, h.lens, strict=True)]

    def oracle_horizon(self) -> int:
        h = self.host
        rows = [b for b, a in enumerate(h.active) if a] or list(range(self.batch))
        need = max(h.final[b] - h.lens[b] for b in rows) + self.k + 2
        return max(1, min(need, self.capacity - max(h.lens) - 1))

    def write_drafts(self, drafts: Sequence[Sequence[int]]) -> list[int]:
        assert self._draft_host is not None and len(drafts) == self.batch
        return self.state.write_drafts(drafts, self._draft_host, self.k)

    def reference_continuation(self, n: int) -> list[list[int]]:
        """The target's next ``n`` greedy tokens per row, not committed (``engine/probes.py``)."""
        from specpilot.engine.probes import reference_continuation

        return reference_continuation(self, n)

    # ------------------------------------------------------------------ rows
    @torch.inference_mode()
    def open(self, batch: int, max_context: int) -> None:
        """Make ``batch`` idle rows, each for up to ``max_context`` tokens (prompt + new). Buffers
        (and the graphs captured on them) are kept while the batch size stays."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        if max_context > self.max_context:
            raise PromptTooLongError(
                f"A context of {max_context} tokens exceeds the model's context of "
                f"{self.max_context} for this engine; shorten the prompt or lower max_new_tokens."
            )
        if self.cache is None or self.batch != batch:
            self._allocate(batch, self.slots)
        self.state.reset(cut=self.k_max)
        self.host = HostRows.idle(batch)
        self.ahead = set()
        self.draft_caps = [None] * batch
        self.unsynced = {}
        if self.gate is not None:
            self.gate.reset(batch)
        if self.plan is not None:
            self.plan.bind(self)

    def _allocate(self, batch: int, capacity: int) -> None:
        self.runner.reset()
        self.batch = batch
        self.cache = self.target.allocate_cache(batch, capacity)
        self._state = RowState.allocate(batch, capacity, self.k_max, self.device)
        layers = () if self.drafter is None else self.drafter.hidden_layers
        cfg, dt = self.target.cfg, self.target.dtype
        self._final = torch.zeros(
            batch, self.k_max + 1, cfg.hidden_size, dtype=dt, device=self.device
        )
        self._hidden = (
            torch.zeros(
                len(layers), batch, self.k_max + 1, cfg.hidden_size, dtype=dt, device=self.device
            )
            if layers
            else None
        )
        pin = self.device.type == "cuda"
        self._draft_host = torch.zeros(batch, self.k + 1, dtype=torch.int64, pin_memory=pin)
        if self.drafter is not None:
            self.drafter.bind(self)

    @torch.inference_mode()
    def prefill(
        self,
        rows: Sequence[int],
        prompts: Sequence[Sequence[int]],
        starts: Sequence[int],
        seg_lens: Sequence[int],
        max_news: Sequence[int],
    ) -> list[int | None]:
        """Feed ``prompts[i][starts[i] : starts[i] + seg_lens[i]]`` to row ``rows[i]`` (its
        earlier segments are in). A row whose prompt ends with it starts decoding for up to
        ``max_news[i]`` tokens: its first token (the target's argmax after the prompt) is
        returned; None for rows still in prefill. Segments from slot 0 are packed into graphed
        forwards up to a token budget, the others run by contiguous rows (``admission.py``)."""
        from specpilot.engine.admission import Admission, prefill_rows

        t0 = time.perf_counter()
        firsts = prefill_rows(self, Admission(rows, prompts, starts, seg_lens, max_news))
        self.times.prefill += time.perf_counter() - t0
        return firsts

    @torch.inference_mode()
    def release(self, row: int) -> None:
        """Make ``row`` idle (frozen at ``IDLE_LEN``); its KV slice is scratch from now on."""
        st = self.state
        st.active[row] = 0
        st.committed_len[row] = IDLE_LEN
        st.prev_committed[row] = IDLE_LEN
        st.pending[row] = 0
        h = self.host
        h.lens[row], h.final[row], h.contexts[row], h.active[row] = IDLE_LEN, IDLE_LEN, [], False
        if row in h.filled:
            h.filled.remove(row)
        self.ahead.discard(row)
        self.unsynced.pop(row, None)
        self.draft_caps[row] = None
        if self.gate is not None:
            self.gate.reset_row(row)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(
        self,
        limit: int | None = None,
        interrupt: Callable[[], bool] | None = None,
        lookahead: bool = False,
    ) -> list[RowCommit]:
        """One cycle over every decoding row (up to ``sync_every`` AR steps without a drafter,
        or while the gate or the rows' draft caps have turned drafting off for every decoding
        row; ``limit`` and ``interrupt`` bound such a window, :func:`ar_window`; ``lookahead``
        queues the next window's first step behind its read-back, without a drafter only)."""
        if not any(self.host.active):
            return []
        t0, excluded0 = time.perf_counter(), self.times.excluded
        if self.host.filled and self.drafter is not None:
            self.drafter.admitted(self, list(self.host.filled))
        self.host.filled = []
        gate = self.gate
        if self.drafter is None:
            out = self.ar_window(limit, interrupt, lookahead)
        elif self._capped_off():
            for b, a in enumerate(self.host.active):  # the drafter catches up when it drafts
                if a:
                    self.unsynced.setdefault(b, self.host.lens[b])
            out = self.ar_window(limit, interrupt)
        elif gate is not None and (gate.all_off(self.host.active) or gate.wants_ar_time()):
            out = gated_ar_window(self, gate, limit, interrupt)
        else:
            resync_drafter(self)
            out = spec_cycle(self)
            if gate is not None:
                seconds = time.perf_counter() - t0 - (self.times.excluded - excluded0)
                gate.observe_cycle(seconds, [(c.row, len(c.tokens)) for c in out])
        self.times.wall += time.perf_counter() - t0 - (self.times.excluded - excluded0)
        return out

    def _capped_off(self) -> bool:
        """Every decoding row has a draft cap of 0 (a request that asked for no speculation)."""
        return all(c == 0 for c, a in zip(self.draft_caps, self.host.active, strict=True) if a)

    def ar_window(
        self,
        limit: int | None = None,
        interrupt: Callable[[], bool] | None = None,
        lookahead: bool = False,
    ) -> list[RowCommit]:
        """Up to ``sync_every`` AR steps (``limit`` at most; ``interrupt`` may end it early)
        read back once (``engine/cycles.py``)."""
        return ar_window(self, limit, interrupt, lookahead)

    def run_draft(self) -> list[int] | None:
        """The drafter's proposal for this cycle; host drafters' draft lengths, or None."""
        drafter, st = self.drafter, self.state
        assert drafter is not None
        attn_len = drafter.attn_len(self, max(self.host.lens))
        box: list[list[int] | None] = []
        self.runner.run(
            ("draft", attn_len),
            lambda: box.append(drafter.propose(self, attn_len)),
            st,
            drafter.graph_safe,
        )
        return box[-1] if box and not drafter.graph_safe else None

    # ------------------------------------------------------------------ timing
    def mark(self) -> None:
        """A phase boundary of the current cycle (recorded only when profiling)."""
        if self.profile:
            self.clock.mark()

    def time_forward(self, width: int, iters: int = 20, repeats: int = 3) -> float:
        """Seconds per target forward of ``width`` tokens per row (``engine/probes.py``)."""
        from specpilot.engine.probes import time_forward

        return time_forward(self, width, iters, repeats)
