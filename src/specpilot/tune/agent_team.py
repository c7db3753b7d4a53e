"""N LLM agents working different directions in parallel, each behind its direction's explorer.

``tune --agent URL --agents N``: when a round starts (``RoundPlanner.start_round``), the first N
of its directions each get an agent: one chat call per direction, all in flight at once on a
thread pool, each with the brief of ``agent_brief.py``. The direction's explorer
(:class:`AgentExplorer`) then takes its agent's answer when the loop asks it to propose,
validates it (``agent_parse.py``) and hands the accepted proposals to the loop, topped up to the
round's count by the direction's TPE explorer; so the proposals are measured, token-forced and
integrated by the loop's one trial and gate code, exactly as TPE's are. Locally the loop
measures one direction after another, so the later directions' agents answer while the first
is measured.

A bad agent costs the search nothing but its own slot: a call that has not answered within its
timeout (or before the budget's deadline) is left behind and TPE proposes for that direction;
an error, prose, malformed JSON, garbage or repeated knobs are rejected with a reason that goes
into that direction's next brief; after ``MAX_FAILURES`` calls in a row that gave nothing
usable, per agent, the agents stand down and TPE searches alone. Every call is priced
(``agent_price.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from specpilot.engine.config import EngineConfig
from specpilot.tune.agent_brief import BriefContext, brief_messages
from specpilot.tune.agent_client import AgentClient, AgentFailure, AgentReply
from specpilot.tune.agent_parse import Accepted, parse_answer
from specpilot.tune.agent_price import AgentPrice, AgentRecord
from specpilot.tune.proposal import Proposal, Proposer
from specpilot.tune.space import Direction, config_hash, describe

MAX_FAILURES = 3
"""Calls in a row without one usable proposal, per agent, after which the agents stand down."""
FEEDBACK_KEPT = 6
"""Rejection reasons kept per direction for its next brief (the latest)."""


@dataclass(slots=True)
class _Call:
    future: Future[AgentReply | AgentFailure]
    started: float
    round: int


@dataclass
class AgentTeam:
    """The agents of one tune; the loop's ``RoundPlanner``."""

    client: AgentClient
    context: BriefContext
    agents: int
    directions: Sequence[Direction]
    trials: int
    """Proposals asked of each agent per round (the loop's trials per direction)."""
    log: Callable[[str], None] = print
    price: AgentPrice = field(init=False)
    records: list[AgentRecord] = field(default_factory=list)
    failures_in_a_row: int = 0
    stood_down: str | None = None
    """Why the agents stopped (None while they work)."""
    _pool: ThreadPoolExecutor = field(init=False, repr=False)
    _calls: dict[str, _Call] = field(default_factory=dict, repr=False)
    _feedback: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _seen: set[str] = field(default_factory=set, repr=False)
    _deadline: float = float("inf")
    _numbers: int = 0

    def __post_init__(self) -> None:
        self.price = AgentPrice(self.client.model, self.client.url, self.agents)
        self._pool = ThreadPoolExecutor(max_workers=self.agents, thread_name_prefix="agent")

    # ------------------------------------------------------------- RoundPlanner
    def explorer(self, direction: Direction, fallback: Proposer) -> Proposer:
        return AgentExplorer(direction, self, fallback)

    def start_round(
        self,
        round_: int,
        picked: Sequence[Direction],
        best: EngineConfig,
        rows: Sequence,
        deadline: float,
    ) -> None:
        if self.stood_down is not None:
            return
        self._deadline = deadline
        self._seen |= {r.config_hash for r in rows}
        asked = [d for d in picked if d.name not in self._calls][: self.agents]
        for d in asked:
            messages = brief_messages(
                self.context, self.directions, d, best, rows, self._feedback.get(d.name, []),
                self.trials,
            )  # fmt: skip
            future = self._pool.submit(self._call, messages)
            self._calls[d.name] = _Call(future, time.perf_counter(), round_)
        if asked:
            self.log(
                f"  [agents] round {round_}: {len(asked)} agent(s) of {self.client.model} asked "
                f"about {', '.join(d.name for d in asked)} (timeout {self.client.timeout_s:g} s)"
            )

    def _call(self, messages: list[dict[str, str]]) -> AgentReply | AgentFailure:
        out = self.client.chat(messages)
        self.price.record(out)
        return out

    # ------------------------------------------------------------ for explorers
    def collect(self, d: Direction, base: EngineConfig, n: int) -> list[Accepted]:
        """The accepted proposals of ``d``'s agent this round (none if it had no agent, failed,
        or did not answer in time); waits at most until its timeout or the budget's deadline."""
        call = self._calls.pop(d.name, None)
        if call is None or self.stood_down is not None:
            return []
        now = time.perf_counter()
        wait = min(call.started + self.client.timeout_s + 1.0, self._deadline) - now
        try:
            got = call.future.result(timeout=max(wait, 0.0))
        except FutureTimeout:
            got = AgentFailure(f"no answer within {max(now + wait - call.started, 0):.0f} s", 0.0)
        self.price.blocked_seconds += time.perf_counter() - now
        tag = f"  [agent:{d.name}]"
        if isinstance(got, AgentFailure):
            self.log(f"{tag} {got.reason}; TPE proposes for {d.name} this round")
            self._note(d, [f"your last call failed: {got.reason}"])
            self._failed(got.reason)
            return []
        known = [x.name for x in self.directions]
        parsed = parse_answer(got.text, d, known, self.context.not_searched, base, self._seen, n)
        self.price.proposals += len(parsed.accepted) + len(parsed.rejected)
        self.price.rejected += len(parsed.rejected)
        for why in parsed.rejected:
            self.log(f"{tag} rejected: {why}")
        self._note(d, parsed.rejected)
        tokens = (
            f"{got.prompt_tokens}+{got.completion_tokens} tokens"
            if got.prompt_tokens
            else "usage not reported"
        )
        self.log(
            f"{tag} {len(parsed.accepted)} proposal(s) accepted, {len(parsed.rejected)} rejected "
            f"({got.seconds:.1f} s, {tokens})"
        )
        if not parsed.accepted:
            self._failed(parsed.rejected[0] if parsed.rejected else "no proposal")
            return []
        self.failures_in_a_row = 0
        for a in parsed.accepted:
            h = config_hash(a.config)
            self._seen.add(h)
            self.records.append(
                AgentRecord(call.round, d.name, describe(a.config), h, a.hypothesis)
            )
            self.log(f"{tag} proposes {describe(a.config)}: {a.hypothesis or '(no hypothesis)'}")
        return parsed.accepted

    def number(self) -> int:
        """A trial number for an agent's proposal (negative: TPE's are its study's, from 0)."""
        self._numbers += 1
        return -self._numbers

    def told(self, trial_number: int, speedup: float) -> None:
        self.price.measured += 1

    def _note(self, d: Direction, reasons: Sequence[str]) -> None:
        kept = [*self._feedback.get(d.name, []), *reasons]
        self._feedback[d.name] = kept[-FEEDBACK_KEPT:]

    def _failed(self, reason: str) -> None:
        self.failures_in_a_row += 1
        limit = MAX_FAILURES * self.agents
        if self.failures_in_a_row >= limit and self.stood_down is None:
            self.stood_down = (
                f"{limit} agent calls in a row gave no usable proposal (last: {reason})"
            )

            self.log(f"  [agents] standing down: {self.stood_down}; TPE searches alone")

    def close(self) -> None:
        """Leaves any call still in flight behind (its own timeout ends it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class AgentExplorer:
    """A direction's explorer with an agent: the agent's accepted proposals first, then the
    direction's TPE (or local-search) explorer for the rest of the round's count."""

    direction: Direction
    team: AgentTeam
    fallback: Proposer
    _mine: set[int] = field(default_factory=set, repr=False)

    @property
    def name(self) -> str:
        return self.direction.name

    def propose(self, base: EngineConfig, n: int) -> list[Proposal]:
        out = []
        for a in self.team.collect(self.direction, base, n)[:n]:
            number = self.team.number()
            self._mine.add(number)
            out.append(Proposal(self.name, a.params, a.config, number))
        if len(out) < n:
            taken = {config_hash(p.config) for p in out}
            more = self.fallback.propose(base, n - len(out))
            out += [p for p in more if config_hash(p.config) not in taken]
        return out

    def tell(self, trial_number: int, speedup: float) -> None:
        if trial_number in self._mine:
            self.team.told(trial_number, speedup)
        else:
            self.fallback.tell(trial_number, speedup)


__all__ = ["MAX_FAILURES", "AgentExplorer", "AgentTeam"]
