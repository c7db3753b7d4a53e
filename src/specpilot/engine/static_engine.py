"""The static-shape decode engine: the GPU fast path (CUDA graphs), also runnable on the CPU.

Same contract and results as :class:`~specpilot.engine.loop.SpecEngine` (greedy, lossless; AR is
``drafter=None``), built for speed at batch 1 and static batch B:

* all decode state lives on the device (:class:`DecodeState`); a cycle is three graph replays —
  ``draft`` (drafter), ``verify`` (target forward of width k + 1 at an attention bucket) and
  ``accept`` (greedy acceptance and commit, on the GPU) — and **one** small device→host copy of
  the accepted length and the k + 1 argmax tokens;
* plain AR decoding queues ``sync_every`` steps before it reads the committed tokens back once;
  a row that hit EOS or its length limit mid-window had its surplus tokens dropped on the host;
* finished rows of a batch are frozen on the device (they commit nothing further).

Attention-length buckets are multiples of ``attn_bucket`` chosen on the host from the lengths
it already knows, so no extra sync is needed to pick a graph.

Batched ragged mode (``packed_bucket > 0`` or a ``width_policy``): each row verifies its own width
``w_b <= k + 1`` chosen on the host by the policy (``engine/widths.py``) from the accepted lengths
it already read back; the verify runs packed (``models/packed_forward.py``: projections, MLP and LM
head on ``sum(w_b)`` rows rounded up to ``packed_bucket``), one graph per (rows, attention bucket).

Tree mode (a ``tree_policy``): each row verifies a static draft tree chosen on the host per cycle
(``engine/tree_policy.py``; rows may differ), drafted from the drafter's per-position top-k,
verified packed under a tree mask, accepted and K/V-compacted on the device
(``engine/static_tree.py``). The drafter must implement ``draft_candidates``.

Continuous batching (``engine/static_rows.py``, used by ``batching/static_scheduler.py``):
``open_rows`` allocates idle rows once, ``fill_row`` starts a new prompt in one row between
cycles, ``release_row`` idles it again; chain verify only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.drafters.static_base import StaticDrafter
from specpilot.engine.cuda_graphs import GraphRunner
from specpilot.engine.device_state import DecodeState, accept_and_commit
from specpilot.engine.loop import GenerationResult
from specpilot.engine.static_rows import RowSteps
from specpilot.engine.static_steps import PackedSteps, TreeSteps
from specpilot.engine.static_tree import TreeBuffers
from specpilot.engine.tree_policy import TreePolicy
from specpilot.engine.verify import cut_at_stop
from specpilot.engine.widths import FixedWidths, WidthPolicy
from specpilot.errors import PromptTooLongError
from specpilot.models.kv_cache import KVCache
from specpilot.models.packed_forward import PackedLayout, PackedVerify
from specpilot.models.static_forward import StaticForward
from specpilot.models.transformer import Transformer
from specpilot.timing import time_call


@dataclass(slots=True)
class CycleTimes:
    """Decode-loop time split. GPU phases come from CUDA events when profiling (else 0).

    ``wall`` is host time of the decode loop (prefill and oracle reference runs excluded);
    ``other = wall - draft - verify - accept``: host bookkeeping, the per-cycle device→host
    copy and any GPU idle time between launches.
    """

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    wall: float = 0.0
    excluded: float = 0.0
    cycles: int = 0

    @property
    def other(self) -> float:
        return self.wall - self.draft - self.verify - self.accept

    def to_dict(self) -> dict[str, float]:
        return {
            "draft_s": self.draft,
            "verify_s": self.verify,
            "accept_s": self.accept,
            "other_s": self.other,
            "wall_s": self.wall,
            "excluded_reference_s": self.excluded,
            "cycles": float(self.cycles),
        }


class StaticEngine(PackedSteps, TreeSteps, RowSteps):
    def __init__(
        self,
        target: Transformer,
        drafter: StaticDrafter | None = None,
        use_graphs: bool | None = None,
        attn_bucket: int = 128,
        sync_every: int = 16,
        max_verify_width: int = 0,
        profile: bool = False,
        fuse_residual: bool | None = None,
        width_policy: WidthPolicy | None = None,
        packed_bucket: int = 0,
        tree_policy: TreePolicy | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.device = target.device
        self.fwd = StaticForward(target, fuse_residual=fuse_residual)
        cuda = self.device.type == "cuda"
        self.runner = GraphRunner(self.device, cuda if use_graphs is None else use_graphs)
        self.attn_bucket = attn_bucket
        self.sync_every = sync_every
        self.k = 0 if drafter is None else drafter.k
        self.tree_policy = tree_policy
        self.tree_width = self._check_trees(tree_policy, drafter, width_policy)
        self.k_max = max(self.k, max_verify_width - 1, self.tree_width - 1)
        self.profile = profile and cuda
        self.times = CycleTimes()
        self.cache: KVCache | None = None
        self.state: DecodeState | None = None
        self.verify_hidden: Tensor | None = None  # [n_sel, B, k+1, hidden]
        self._dev_len: list[int] = []  # host mirror of state.committed_len
        self._final_len: list[int] = []  # prompt + max_new_tokens per row
        if width_policy is not None and drafter is None:
            raise ValueError("A width policy needs a drafter; plain AR verifies one token per row.")
        if packed_bucket < 0:
            raise ValueError(f"packed_bucket must be at least 0, got {packed_bucket}.")
        self.width_policy: WidthPolicy | None = None
        if tree_policy is not None:
            self.packed_bucket = packed_bucket or 16
        elif width_policy is not None or packed_bucket > 0:
            self.width_policy = width_policy or FixedWidths()
            self.packed_bucket = packed_bucket or 16
        else:
            self.packed_bucket = 0
        self.packed = PackedVerify(self.fwd)
        self.layout: PackedLayout | None = None
        self.trees: TreeBuffers | None = None
        self._tree_widths: list[int] = []
        self.rows_verified = 0  # packed rows (bucket padding included) summed over cycles

    @staticmethod
    def _check_trees(
        policy: TreePolicy | None, drafter: StaticDrafter | None, width_policy: WidthPolicy | None
    ) -> int:
        """The static tree width ``1 + max nodes`` (0 without trees), after checking the setup."""
        if policy is None:
            return 0
        if drafter is None or width_policy is not None:
            raise ValueError("Tree verify needs a drafter and no width policy.")
        inner = getattr(drafter, "inner", drafter)  # a simulated-acceptance wrapper's drafter
        if not hasattr(inner, "draft_candidates"):
            raise ValueError(
                f"Tree verify needs a drafter with per-position candidates; '{drafter.name}' has "
                "none (use the block drafter, or disable the tree)."
            )
        if any(t.depth > drafter.k for t in policy.shapes):
            raise ValueError(f"A tree deeper than the drafter's {drafter.k} positions was given.")
        return 1 + max(t.nodes for t in policy.shapes)

    # ------------------------------------------------------------------ setup
    def bucket(self, need: int) -> int:
        assert self.cache is not None
        b = self.attn_bucket
        return min(-(-need // b) * b, self.cache.max_seq_len)

    def _prepare(self, batch: int, need: int) -> None:
        b = self.attn_bucket
        capacity = -(-need // b) * b
        if capacity > self.target.max_positions:
            capacity = self.target.max_positions
        cache = self.cache
        if cache is None or cache.batch_size != batch or cache.max_seq_len < capacity:
            self.runner.reset()
            self.cache = self.target.allocate_cache(batch, capacity)
            self.state = DecodeState.allocate(batch, capacity, self.k_max, self.device)
            layers = () if self.drafter is None else self.drafter.hidden_layers
            self.verify_hidden = (
                torch.zeros(
                    len(layers),
                    batch,
                    self.k + 1,
                    self.target.cfg.hidden_size,
                    dtype=self.target.dtype,
                    device=self.device,
                )
                if layers
                else None
            )
            self.layout = (
                PackedLayout.allocate(batch, self.k + 1, self.device)
                if self.width_policy is not None
                else None
            )
            self.trees = None
            if self.tree_policy is not None:
                ranks = 1 + max(t.max_rank for t in self.tree_policy.shapes)
                hid = None
                if self.verify_hidden is not None:
                    hid = (len(layers), self.target.cfg.hidden_size, self.target.dtype)
                self.trees = TreeBuffers.allocate(
                    batch, self.tree_width, self.k, ranks, hid, self.device
                )
                self.layout = PackedLayout.allocate(batch, self.tree_width, self.device)
            if self.drafter is not None:
                self.drafter.bind(self)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ steps
    def _verify_fn(self, k: int, attn_len: int) -> Callable[[], None]:
        st, cache = self.state, self.cache
        assert st is not None and cache is not None
        hidden = self.verify_hidden if (k == self.k and k > 0) else None
        layers = () if hidden is None or self.drafter is None else self.drafter.hidden_layers

        def step() -> None:
            inp = (
                torch.cat([st.pending[:, None], st.drafts[:, :k]], dim=1)
                if k
                else st.pending[:, None]
            )  # [B, k+1]
            logits = self.fwd(inp, cache, st.committed_len - 1, attn_len, layers, hidden)
            st.verify_argmax[:, : k + 1].copy_(logits.argmax(dim=-1))

        return step

    def _run_verify(self, k: int, attn_len: int) -> None:
        assert self.state is not None
        hidden = self.k > 0 and k == self.k and self.verify_hidden is not None
        self.runner.run(("verify", k, attn_len, hidden), self._verify_fn(k, attn_len), self.state)

    def _run_tree_draft(self) -> None:
        assert self.drafter is not None and self.state is not None and self.trees is not None
        drafter, st, trees = self.drafter, self.state, self.trees
        attn_len = drafter.attn_len(self, max(self._dev_len))

        def step() -> None:
            drafter.draft_candidates(self, attn_len, trees.candidates)  # type: ignore[attr-defined]
            trees.gather_tokens(st.pending)

        self.runner.run(("tree_draft", attn_len), step, st)

    def _run_accept(self, k: int) -> None:
        st = self.state
        assert st is not None
        self.runner.run(("accept", k), lambda: accept_and_commit(st, k), st)

    def _run_draft(self) -> None:
        assert self.drafter is not None and self.state is not None
        drafter = self.drafter
        attn_len = drafter.attn_len(self, max(self._dev_len))
        self.runner.run(("draft", attn_len), lambda: drafter.draft(self, attn_len), self.state)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], extra: int) -> list[int]:
        """Allocate for ``extra`` more tokens, run the prompts, commit the first token per row."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise PromptTooLongError("Every prompt needs at least one token.")
        lens = [len(p) for p in prompts]
        margin = self.context_margin()
        need = max(lens) + extra + margin
        if need > self.target.max_positions:
            raise PromptTooLongError(
                f"A prompt of {max(lens)} tokens plus {extra} new tokens exceeds the model's "
                f"context of {self.target.max_positions - margin} for this engine; shorten the "
                f"prompt or lower --max-new-tokens."
            )
        b = len(prompts)
        self._prepare(b, need)
        st, cache = self.state, self.cache
        assert st is not None and cache is not None
        dev, width = self.device, max(lens)
        padded = torch.zeros(b, width, dtype=torch.int64)
        for row, p in enumerate(prompts):
            padded[row, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
        padded_d = padded.to(dev)
        lens_d = torch.tensor(lens, dtype=torch.int64, device=dev)
        layers = () if self.drafter is None else self.drafter.hidden_layers
        hidden = (
            torch.empty(
                len(layers),
                b,
                width,
                self.target.cfg.hidden_size,
                dtype=self.target.dtype,
                device=dev,
            )
            if layers
            else None
        )
        start = torch.zeros(b, dtype=torch.int64, device=dev)
        logits = self.fwd(padded_d, cache, start, self.bucket(width), layers, hidden)
        first = logits[torch.arange(b, device=dev), lens_d - 1].argmax(dim=-1)  # [B]
        st.tokens.zero_()
        st.tokens[:, :width].copy_(padded_d)
        st.tokens.scatter_(1, lens_d[:, None], first[:, None])
        st.committed_len.copy_(lens_d + 1)
        st.prev_committed.copy_(lens_d + 1)
        st.pending.copy_(first)
        st.active.fill_(1)
        st.cycle.zero_()
        st.drafts.zero_()
        st.draft_lens.zero_()
        self._dev_len = [n + 1 for n in lens]
        self._final_len = [n + extra for n in lens]
        self.rows_verified = 0
        if self.width_policy is not None:
            self.width_policy.reset(b, self.k, self.packed_bucket)
        if self.tree_policy is not None:
            self.tree_policy.reset(b, self.k)
        if self.drafter is not None:
            self.drafter.prefill(self, padded_d, lens_d, hidden)
        return first.tolist()

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        until_first_done: bool = False,
    ) -> list[GenerationResult]:
        """Decode every row to ``max_new_tokens`` or EOS.

        ``until_first_done`` stops the loop at the end of the cycle in which the first row
        finishes: a steady-state window in which every row of the batch is decoding, as rows of a
        continuously refilled batch are (the other rows' tokens are a prefix of their output).
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        self.times = CycleTimes()
        first = self.prefill(prompts, max_new_tokens)
        st = self.state
        assert st is not None
        eos = set(eos_ids)
        results = [
            GenerationResult(prompt_ids=list(p), tokens=[], stop_reason="length") for p in prompts
        ]
        active = [True] * len(prompts)
        for row, tok in enumerate(first):
            self._append(row, [tok], results, active, eos, max_new_tokens)
        self._sync()
        t0, excluded0 = time.perf_counter(), self.times.excluded
        events: list[tuple[torch.cuda.Event, ...]] = []
        while all(active) if until_first_done else any(active):
            if self.drafter is None:
                self._ar_window(results, active, eos, max_new_tokens)
            else:
                self._spec_cycle(results, active, eos, max_new_tokens, events)
        self._sync()
        self.times.wall += time.perf_counter() - t0 - (self.times.excluded - excluded0)
        for e in events:
            self.times.draft += e[0].elapsed_time(e[1]) / 1e3
            self.times.verify += e[1].elapsed_time(e[2]) / 1e3
            self.times.accept += e[2].elapsed_time(e[3]) / 1e3
        return results

    def _ar_window(
        self, results: list[GenerationResult], active: list[bool], eos: set[int], max_new: int
    ) -> None:
        st = self.state
        assert st is not None
        left = max(max_new - len(r.tokens) for r, a in zip(results, active, strict=True) if a)
        steps = min(self.sync_every, left)
        base = max(self._dev_len)
        for s in range(steps):
            self._run_verify(0, self.bucket(base + s))
            self._run_accept(0)
        before = list(self._dev_len)
        for row, a in enumerate(active):
            if a:
                self._dev_len[row] += steps
        host = st.tokens[:, : max(self._dev_len)].cpu().tolist()
        self.times.cycles += steps
        for row, a in enumerate(active):
            if a:
                new = host[row][before[row] : before[row] + steps]
                for tok in new:
                    results[row].stats.record(0, 0, 1)
                    if not self._append(row, [tok], results, active, eos, max_new):
                        break

    def _spec_cycle(
        self,
        results: list[GenerationResult],
        active: list[bool],
        eos: set[int],
        max_new: int,
        events: list[tuple[torch.cuda.Event, ...]],
    ) -> None:
        st, k = self.state, self.k
        assert st is not None and self.drafter is not None
        ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4)) if self.profile else ()
        policy, tree_policy = self.width_policy, self.tree_policy
        trees = tree_policy.trees(active) if tree_policy is not None else []
        if trees:
            assert self.trees is not None
            self.trees.fill(trees)
            widths = [1 + t.nodes if a else 1 for t, a in zip(trees, active, strict=True)]
            drafted = [t.depth for t in trees]
        else:
            widths = policy.widths(active) if policy is not None else [k + 1] * len(active)
            drafted = [w - 1 for w in widths]
        if not trees and any(
            a and not 1 <= w <= k + 1 for a, w in zip(active, widths, strict=True)
        ):
            raise ValueError(f"A width policy must give every active row 1..{k + 1} tokens.")
        if ev:
            ev[0].record()
        if trees:
            self._run_tree_draft()
        else:
            self._run_draft()
        if ev:
            ev[1].record()
        if trees:
            self._run_tree_verify(widths, self.bucket(max(self._dev_len) + self.tree_width))
        elif policy is not None:
            self._run_packed_verify(widths, self.bucket(max(self._dev_len) + k))
        else:
            self._run_verify(k, self.bucket(max(self._dev_len) + k))
        if ev:
            ev[2].record()
        if trees:
            self._run_tree_accept()
        else:
            self._run_accept(k)
        if ev:
            ev[3].record()
            events.append(ev)
        out = torch.cat([st.accepted[:, None], st.verify_argmax[:, : k + 1]], dim=1).cpu().tolist()
        self.times.cycles += 1
        committed: list[tuple[int, int, list[int]]] = []
        for row, a in enumerate(active):
            if not a:
                continue
            n = out[row][0]
            toks = out[row][1 : n + 2]
            committed.append((row, self._dev_len[row], toks))
            self._dev_len[row] += n + 1
            self._append(row, toks, results, active, eos, max_new)
            results[row].stats.record(drafted[row], n, n + 1)
            if tree_policy is not None:
                tree_policy.observe(row, drafted[row], n)
            elif policy is not None:
                policy.observe(row, drafted[row], n)
        self.drafter.after_cycle(self, committed)

    def _append(
        self,
        row: int,
        toks: list[int],
        results: list[GenerationResult],
        active: list[bool],
        eos: set[int],
        max_new: int,
    ) -> bool:
        """Append to a row up to EOS or the limit; freeze the row on the device when it ends.
        Returns whether the row is still active."""
        res = results[row]
        keep, stopped = cut_at_stop(toks, max_new - len(res.tokens), eos)
        if stopped:
            res.stop_reason = "eos"
            active[row] = False
        res.tokens.extend(keep)
        if len(res.tokens) >= max_new:
            active[row] = False
        if not active[row] and self.state is not None:
            self.state.active[row] = 0
        return active[row]

    # ------------------------------------------------------------------ helpers for drafters / bench
    def committed_lens(self) -> list[int]:
        """Committed tokens per row (prompt included), as the host knows them."""
        return list(self._dev_len)

    def oracle_horizon(self) -> int:
        """Tokens of look-ahead a drafter needs to reach every row's length limit plus a draft."""
        assert self.state is not None
        need = max(f - d for f, d in zip(self._final_len, self._dev_len, strict=True)) + self.k + 2
        return max(1, min(need, self.state.capacity - max(self._dev_len) - 1))

    @torch.inference_mode()
    def reference_continuation(self, n: int) -> list[list[int]]:
        """The target's next ``n`` greedy tokens per row from the committed state, not committed.

        Runs plain AR steps through the same graphs, then restores the decode state (the KV it
        wrote lies past the committed length, where the next forward overwrites it).
        """
        st = self.state
        assert st is not None
        self._sync()
        t0 = time.perf_counter()
        snap = st.snapshot()
        st.active.fill_(1)
        base = max(self._dev_len)
        for s in range(n):
            self._run_verify(0, self.bucket(base + s))
            self._run_accept(0)
        host = st.tokens[:, : base + n].cpu().tolist()
        st.restore(snap)
        self._sync()
        self.times.excluded += time.perf_counter() - t0
        return [host[row][c : c + n] for row, c in enumerate(self._dev_len)]

    @torch.inference_mode()
    def time_forward(self, width: int, iters: int = 20) -> float:
        """Seconds per target forward of ``width`` tokens (a verify of ``width - 1`` drafts) at the
        current committed state, by replaying its graph (median of 3 runs of ``iters``)."""
        assert self.state is not None and width - 1 <= self.k_max
        k = width - 1
        attn_len = self.bucket(max(self._dev_len) + k)
        fn = self._verify_fn(k, attn_len)

        def once() -> None:
            self.runner.run(("time", k, attn_len), fn, self.state)  # type: ignore[arg-type]

        return time_call(once, self.device, iters, warmup=1)
