"""Simulated acceptance: a drafter does its real compute, its proposal is then replaced by the
target's own greedy continuation with misses injected to follow a stated acceptance profile.

For timing at realistic shapes with random weights (which accept nothing), in the spirit of
SGLang's ``SGLANG_SIMULATE_ACC_LEN``, but lossless: verification stays real, so every committed
token is still the target's argmax, and the number accepted is whatever the real verify accepts.

Where the oracle comes from: a plain AR run of the *same* engine from the committed state
(``DraftRows.reference_continuation``), once after prefill. Its tokens are what the target
will commit, so drafting them makes the real verify accept exactly up to the injected miss. In
bf16 a verify forward (width k + 1) can round differently from the AR forward (width 1) and, at a
near-tie, pick another token; the trajectory then leaves the oracle. The wrapper sees that on the
host (committed ≠ oracle), counts a *divergence* and recomputes the oracle from there. Reference
runs are excluded from the engine's timed wall clock (``CycleTimes.excluded``). It wraps any\ndrafter; it is graph-safe when the drafter it wraps is.

Profiles: ``tau=6.5,block=16`` (τ = committed tokens per cycle **including the bonus**, drafts
per cycle = block - 1, every position accepted with the same conditional rate α solving
1 + α + … + α^k = τ) or ``rates=0.9,0.8,...`` (conditional rate per draft position; k = their
count, or ``block - 1`` padded with the last rate). Every draw is a Weyl sequence (``u_c =
frac(o + c·a)``, ``o`` from the seed, ``a`` irrational) indexed by the wrapper's own cycle count,
which runs on across ``Engine.open``: any stretch of consecutive cycles covers ``[0, 1)`` evenly,
so a run of a few prompts lands on the profile's τ, and prompts do not replay one draw. (Until
2026-12-05 the draws were stratified over windows of 64 cycles and indexed by the engine's cycle,
which every ``open`` resets: every prompt replayed the window's first 15-30 cycles, and seed 0
gave τ 6.79 for ``tau=6.5,block=16`` and 4.54 for ``rates=0.8,block=8`` against 4.16.)

Heterogeneous batches: ``row_profiles`` gives row b the profile ``row_profiles[b % len]`` (its
own schedule, seeded per row), so the rows of one batch accept at different rates, as requests of
a served batch do.

Trees (``draft_candidates``, for the static tree verify): the inner drafter's real top-R compute
runs, then the candidates of each block position d are replaced. The first branch (rank 0) holds
the target's true token wherever the chain schedule accepts (d before the cycle's miss), misses at
the scheduled miss, and past it holds the true token with the profile's chain probability
``rates[d]``; on a first-branch miss the true token is placed on the second branch (rank 1) with
probability ``p_sibling`` (each position's two draws a Weyl sequence of its own step, so that over
a run the depths behave as independent). Every other candidate is a wrong token. So a chain
verify sees exactly the chain profile, siblings can only add accepted tokens, and a tree's τ is
``AcceptanceProfile.tree_tau`` (``best_tree_tau``: the most any tree of a size can reach). Labels
name ``p_sibling`` beside the profile; a profile text may carry it (``tau=6.5,block=16,
sibling=0.5``), so that the commands' ``--simulate-acceptance`` can time trees too.

Every figure produced with this wrapper must be labelled ``SIM_LABEL``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter, DraftRows, Segment, gateable

if TYPE_CHECKING:
    from specpilot.drafters.static_tree import StaticTree

SIM_LABEL = "simulated acceptance"
_PHI = (5**0.5 - 1) / 2
"""The schedule's Weyl step (the golden ratio's fractional part: the most even coverage)."""


def _steps(n: int) -> list[float]:
    """``n`` Weyl steps ``frac(sqrt(p))`` over primes ``p != 5``: with ``_PHI`` (``sqrt(5)``) and 1
    linearly independent over the rationals, so the draws of different positions and of the
    schedule are jointly even, as independent draws would be."""
    out: list[float] = []
    p = 1
    while len(out) < n:
        p += 1
        if p != 5 and all(p % q for q in range(2, int(p**0.5) + 1)):
            out.append(p**0.5 % 1.0)
    return out


def weyl_hits(
    rates: Tensor,  # [B, k] float64: P(hit) per row and position
    cycles: int,
    steps: Sequence[float],  # [k] Weyl step per position
    seed: int,
) -> Tensor:  # [B, cycles, k] bool
    """Hit (u < rate) per row, cycle and position, ``u = frac(o + c·step)``, ``o`` from the seed."""
    rng = random.Random(seed)
    b, k = rates.shape
    offsets = torch.tensor(
        [[rng.random() for _ in range(k)] for _ in range(b)], dtype=torch.float64
    )
    c = torch.arange(cycles, dtype=torch.float64)[None, :, None]  # [1, S, 1]
    u = torch.frac(offsets[:, None, :] + c * torch.tensor(steps, dtype=torch.float64))  # [B, S, k]
    return u < rates[:, None, :]


@dataclass(frozen=True, slots=True)
class AcceptanceProfile:
    rates: tuple[float, ...]
    """Conditional acceptance rate of each draft position, given all earlier ones were accepted."""
    p_sibling: float = 0.0
    """Tree candidates: P(the true token is the second choice | the first choice missed)."""

    def __post_init__(self) -> None:
        if not self.rates or not all(0.0 <= r <= 1.0 for r in self.rates):
            raise ValueError("An acceptance profile needs at least one rate, each in [0, 1].")
        if not 0.0 <= self.p_sibling <= 1.0:
            raise ValueError(f"sibling must lie in [0, 1], got {self.p_sibling}")

    @property
    def k(self) -> int:
        return len(self.rates)

    def survival(self) -> list[float]:
        """P(accepted length ≥ i) for i = 1..k."""
        out, p = [], 1.0
        for r in self.rates:
            p *= r
            out.append(p)
        return out

    @property
    def tau(self) -> float:
        """Expected committed tokens per cycle, bonus included."""
        return 1.0 + sum(self.survival())

    def rank_hits(self) -> list[tuple[float, float]]:
        """Per depth, P(the rank-0 candidate is right), P(rank 1 is right): ``rates[d]`` and
        ``(1 - rates[d]) * p_sibling``; other ranks are never right, depths are independent."""
        return [(r, (1.0 - r) * self.p_sibling) for r in self.rates]

    def tree_tau(self, tree: StaticTree) -> float:
        """Expected committed tokens per cycle (bonus included) of a static tree under this
        profile (``rank_hits``): a node is accepted when its whole path is right, so τ = 1 + the
        sum of the nodes' path products."""
        hit = self.rank_hits()
        path: list[float] = []
        for par, dep, rank in zip(tree.parents, tree.depths, tree.ranks, strict=True):
            p = hit[dep - 1][rank] if dep <= self.k and rank < 2 else 0.0
            path.append(p * (path[par] if par >= 0 else 1.0))
        return 1.0 + sum(path)

    def best_tree_tau(self, nodes: int | None = None) -> float:
        """The largest ``tree_tau`` of any tree of ``nodes`` nodes (its ``nodes`` likeliest paths
        of ranks 0 / 1, prefixes first); None: every such path to depth k (the profile's cap)."""
        hit = self.rank_hits()  # [k] (rank 0, rank 1)
        if nodes is None:
            total, p = 1.0, 1.0
            for h0, h1 in hit:
                p *= h0 + h1
                total += p
            return total
        heap = [(-h, 0) for h in hit[0] if h > 0]  # (-path probability, depth index)
        heapq.heapify(heap)
        total = 1.0
        for _ in range(nodes):
            if not heap:
                break
            neg, d = heapq.heappop(heap)
            total -= neg
            if d + 1 < self.k:
                for h in hit[d + 1]:
                    if h > 0:
                        heapq.heappush(heap, (neg * h, d + 1))
        return total

    @classmethod
    def parse(cls, text: str) -> AcceptanceProfile:
        fields: dict[str, str] = {}
        for part in text.replace(" ", "").split(","):
            if "=" in part:
                key, val = part.split("=", 1)
                fields[key] = val
            elif "rates" in fields:  # rates=0.9,0.8,... continues after the first comma
                fields["rates"] += "," + part
            else:
                raise ValueError(f"Cannot read '{part}' in the acceptance profile '{text}'.")
        try:
            block = int(fields["block"]) if "block" in fields else None
            sibling = float(fields.get("sibling", 0.0))
            if "rates" in fields:
                rates = [float(x) for x in fields["rates"].split(",") if x]
                if block is not None:
                    if len(rates) > block - 1:
                        raise ValueError("more rates than draft positions (block - 1)")
                    rates += [rates[-1]] * (block - 1 - len(rates))
                return cls(tuple(rates), sibling)
            if "tau" in fields and block is not None:
                return cls(cls.constant(float(fields["tau"]), block - 1).rates, sibling)
        except ValueError as e:
            raise ValueError(f"Bad acceptance profile '{text}': {e}.") from None
        raise ValueError(
            f"Bad acceptance profile '{text}'; write 'tau=6.5,block=16' or 'rates=0.9,0.8,0.7' "
            "(either may add ',sibling=0.5')."
        )

    @classmethod
    def constant(cls, tau: float, k: int) -> AcceptanceProfile:
        if not 1.0 <= tau <= k + 1:
            raise ValueError(f"tau must lie in [1, {k + 1}] for {k} draft positions")
        lo, hi = 0.0, 1.0
        for _ in range(100):  # bisection on 1 + α + … + α^k = τ
            mid = (lo + hi) / 2
            if 1.0 + sum(mid**i for i in range(1, k + 1)) < tau:
                lo = mid
            else:
                hi = mid
        return cls(tuple([(lo + hi) / 2] * k))

    def schedule(self, cycles: int, seed: int) -> list[int]:
        """Accepted draft lengths of cycles ``0 .. cycles - 1``: cycle c accepts draft i when
        ``u_c < P(length >= i)``, ``u_c = frac(o + c·phi)`` (``o`` from the seed)."""
        o = random.Random(seed).random()
        surv = self.survival()
        return [sum(1 for p in surv if (o + c * _PHI) % 1.0 < p) for c in range(cycles)]


class SimulatedAcceptance:
    """Wraps a :class:`Drafter`; see the module docstring."""

    def __init__(
        self,
        inner: Drafter,
        profile: AcceptanceProfile,
        seed: int = 0,
        row_profiles: Sequence[AcceptanceProfile] = (),
        p_sibling: float | None = None,
    ) -> None:
        """``p_sibling``: None takes the profile's."""
        p_sibling = profile.p_sibling if p_sibling is None else p_sibling
        if not 0.0 <= p_sibling <= 1.0:
            raise ValueError(f"p_sibling must lie in [0, 1], got {p_sibling}.")
        for p in (profile, *row_profiles):
            if p.k != inner.k:
                raise ValueError(
                    f"The profile has {p.k} draft positions but the drafter drafts {inner.k}; "
                    f"give block={inner.k + 1}."
                )
        self.inner = inner
        self.profile = profile
        self.row_profiles = tuple(row_profiles)
        self.seed = seed
        self.p_sibling = p_sibling
        self.name = f"{inner.name} ({SIM_LABEL})"
        self.k = inner.k
        self.hidden_layers = inner.hidden_layers
        self.graph_safe = inner.graph_safe
        self.divergences = 0
        self.reference_runs = 0
        self.chunk = max(64, 4 * (inner.k + 1))
        """Tokens of oracle computed per reference run."""
        self._covered: list[int] = []  # per row: oracle known below this position
        self._oracle: Tensor | None = None  # [B, S] expected token at each position
        self._schedule: Tensor | None = None  # [B, S] accepted length per row and cycle
        self._host: list[list[int]] = []
        self._vocab = 1
        self._first_hit: Tensor | None = None  # [B, S, k] bool: rank 0 right past the miss
        self._sibling_hit: Tensor | None = None  # [B, S, k] bool: rank 1 right on a rank-0 miss
        self._tick: Tensor | None = None  # [1] int64: cycles drafted since bind, across opens

    def bind(self, rows: DraftRows) -> None:
        self.inner.bind(rows)
        st = rows.state
        self._oracle = torch.zeros_like(st.tokens)
        if self.row_profiles:
            n = len(self.row_profiles)
            sched = [
                self.row_profiles[b % n].schedule(st.capacity, self.seed + 1000 * b)
                for b in range(st.batch_size)
            ]
        else:  # one schedule shared by every row
            sched = [self.profile.schedule(st.capacity, self.seed)] * st.batch_size
        dev = st.tokens.device
        self._schedule = torch.tensor(sched, dtype=torch.int64, device=dev)
        self._vocab = rows.target.cfg.vocab_size
        profiles = self.row_profiles or (self.profile,)
        rates = torch.tensor(
            [list(profiles[b % len(profiles)].rates) for b in range(st.batch_size)],
            dtype=torch.float64,
        )  # [B, k]
        steps = _steps(2 * self.k)
        cap = st.capacity
        self._first_hit = weyl_hits(rates, cap, steps[: self.k], self.seed + 7).to(dev)
        sib = torch.full_like(rates, self.p_sibling)  # [B, k]
        self._sibling_hit = weyl_hits(sib, cap, steps[self.k :], self.seed + 8).to(dev)
        self._tick = torch.zeros(1, dtype=torch.int64, device=dev)
        self._host = [[-1] * st.capacity for _ in range(st.batch_size)]
        self._covered = [0] * st.batch_size
        self.divergences = 0
        self.reference_runs = 0

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        """The inner drafter sees the segment; these rows' oracles are forgotten (``admitted``
        computes them). Their acceptance draws go on from the wrapper's cycle count."""
        self.inner.prefill(rows, seg)
        for row in range(seg.first_row, seg.first_row + seg.rows):
            self._host[row] = [-1] * len(self._host[row])
            self._covered[row] = 0

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        """One reference run gives every newly decoding row its oracle."""
        self.inner.admitted(rows, which)
        self.reanchor(rows)

    @property
    def gateable(self) -> bool:
        return gateable(self.inner)

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        """The inner drafter catches up; the oracle is recomputed from the committed state."""
        self.inner.resync(rows, which, since)  # type: ignore[attr-defined]
        self.reanchor(rows)

    def reanchor(self, rows: DraftRows) -> None:
        """(Re)compute the next ``chunk`` oracle tokens from the committed state by a reference
        AR run of the engine."""
        assert self._oracle is not None
        n = min(rows.oracle_horizon(), self.chunk)
        cont = rows.reference_continuation(n)
        self.reference_runs += 1
        for row, (c, toks, a) in enumerate(
            zip(rows.committed_lens(), cont, rows.active, strict=True)
        ):
            if not a:
                continue
            self._host[row][c : c + len(toks)] = toks
            self._oracle[row, c : c + len(toks)] = torch.tensor(toks, dtype=torch.int64)
            self._covered[row] = c + len(toks)

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return self.inner.attn_len(rows, max_committed)

    def _next_cycle(self, period: int) -> Tensor:  # [1] int64
        """This cycle's index into the draws, then one step on (on the device: graph-safe). Not
        the engine's cycle, which ``Engine.open`` resets: that replayed one stretch per prompt."""
        tick = self._tick
        assert tick is not None
        cycle = tick % period
        tick.add_(1)
        return cycle

    def propose(self, rows: DraftRows, attn_len: int) -> None:
        self.inner.propose(rows, attn_len)  # the real compute; its proposal is then replaced
        st, oracle, sched = rows.state, self._oracle, self._schedule
        assert oracle is not None and sched is not None
        dev, k = oracle.device, self.k
        cycle = self._next_cycle(sched.shape[1])  # [1]
        miss_at = sched.index_select(1, cycle)  # [B, 1]
        pos = torch.arange(k, device=dev)[None, :]  # [1, k]
        idx = (st.committed_len[:, None] + pos).clamp_(max=st.capacity - 1)  # [B, k]
        window = oracle.gather(1, idx)  # [B, k] the target's own continuation
        wrong = (window + 1) % self._vocab
        st.drafts[:, :k].copy_(torch.where(pos == miss_at, wrong, window))
        st.draft_lens.fill_(k)

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """Tree candidates ``out [B, k, R]`` under the simulated profile (module docstring)."""
        self.inner.draft_candidates(rows, attn_len, out)  # type: ignore[attr-defined]
        st, oracle, sched = rows.state, self._oracle, self._schedule
        first, sib = self._first_hit, self._sibling_hit
        assert oracle is not None and sched is not None
        assert first is not None and sib is not None
        dev, k, r = oracle.device, self.k, out.shape[2]
        cycle = self._next_cycle(sched.shape[1])  # [1]
        miss_at = sched.index_select(1, cycle)  # [B, 1]
        pos = torch.arange(k, device=dev)[None, :]  # [1, k]
        idx = (st.committed_len[:, None] + pos).clamp_(max=st.capacity - 1)  # [B, k]
        window = oracle.gather(1, idx)  # [B, k] the target's own continuation
        later = first.index_select(1, cycle).squeeze(1)  # [B, k]
        hit0 = (pos < miss_at) | ((pos > miss_at) & later)  # [B, k]
        hit1 = ~hit0 & sib.index_select(1, cycle).squeeze(1)  # [B, k]
        ranks = torch.arange(r, device=dev)[None, None, :]  # [1, 1, R]
        wrong = (window[:, :, None] + 1 + ranks) % self._vocab  # [B, k, R] distinct, never right
        right = ((ranks == 0) & hit0[:, :, None]) | ((ranks == 1) & hit1[:, :, None])
        out.copy_(torch.where(right, window[:, :, None], wrong))
        st.drafts[:, :k].copy_(out[:, :, 0])

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        self.inner.observe(rows, committed)
        diverged = any(
            self._host[row][pos : pos + len(toks)] != toks for row, pos, toks in committed
        )
        if diverged:
            self.divergences += 1
        lens = rows.committed_lens()
        # the next cycle commits up to k drafts and the bonus: the oracle must reach past them
        short = any(lens[row] + self.k + 1 > self._covered[row] for row, _, _ in committed)
        if diverged or short:
            self.reanchor(rows)
