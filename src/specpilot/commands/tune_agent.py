"""``tune --agent URL``: the options of the LLM agents, their checks, and the team a tune gets.

The endpoint is checked (``tune/agent_client.connect``) first thing in ``tune``'s run, before
the target loads; the options themselves are checked with every other argument.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from specpilot.commands.checks import at_least
from specpilot.errors import SpecPilotError

if TYPE_CHECKING:
    from specpilot.memory import Fingerprint, MemoryStore
    from specpilot.tune.agent_client import AgentClient
    from specpilot.tune.agent_team import AgentTeam
    from specpilot.tune.space import Direction


def add_agent_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group(
        "agents (an OpenAI-compatible chat endpoint proposes candidates; docs/TUNE.md 'Agents')"
    )
    a.add_argument(
        "--agent",
        metavar="URL",
        default=None,
        help="the endpoint's base URL, e.g. http://localhost:8000/v1 (vLLM, SGLang, llama.cpp, "
        "specpilot serve, a hosted API); key from SPECPILOT_AGENT_KEY, else OPENAI_API_KEY",
    )
    a.add_argument(
        "--agent-model", default=None, help="model name (default: the first the endpoint lists)"
    )
    a.add_argument(
        "--agents",
        type=int,
        default=1,
        help="agents working different directions in parallel each round (default: %(default)s)",
    )
    a.add_argument(
        "--agent-timeout",
        type=float,
        default=60.0,
        help="seconds an agent's call may take; then TPE proposes instead (default: %(default)s)",
    )
    a.add_argument(
        "--agent-max-tokens",
        type=int,
        default=1024,
        help="most tokens an agent may answer with (default: %(default)s)",
    )
    a.add_argument(
        "--kernel-agent",
        type=int,
        default=0,
        metavar="N",
        help="before the kernel search (CUDA, w12), ask the agent for N Triton kernels of the "
        "w12-gemm slot at the target's shapes; each is judged in the sandbox, and the accepted "
        "ones join the search's candidates (docs/TUNE.md 'The kernel sub-agent'; default: 0)",
    )


def check(args: argparse.Namespace) -> list[str]:
    """The agent options, without contacting the endpoint."""
    at_least(args, "agents", 1)
    at_least(args, "agent_max_tokens", 1)
    at_least(args, "kernel_agent", 0)
    if args.agent_timeout <= 0:
        raise SpecPilotError(
            f"--agent-timeout must be more than 0 seconds, got {args.agent_timeout}."
        )
    if args.agent is None:
        given = [
            f
            for f, v in (
                ("--agent-model", args.agent_model),
                ("--agents", args.agents != 1),
                ("--kernel-agent", args.kernel_agent),
            )
            if v
        ]
        if given:
            raise SpecPilotError(f"{' and '.join(given)} need --agent URL (the agents' endpoint).")
        return []
    if not args.agent.startswith(("http://", "https://")):
        raise SpecPilotError(
            f"--agent must be an http(s) URL such as http://localhost:8000/v1, got {args.agent!r}."
        )
    if args.agents > args.directions:
        return [
            f"--agents {args.agents} > --directions {args.directions}: {args.agents - args.directions} agent(s) will have no direction"
        ]
    return []


def connect_agent(args: argparse.Namespace) -> AgentClient | None:
    """The agents' client after one check of the endpoint (None without ``--agent``)."""
    if args.agent is None:
        return None
    from specpilot.tune.agent_client import connect

    client = connect(args.agent, args.agent_model, args.agent_timeout, args.agent_max_tokens)
    print(f"agents: {args.agents} x {client.model} at {client.url}", flush=True)
    return client


def make_team(
    client: AgentClient,
    args: argparse.Namespace,
    deployment: str,
    directions: Sequence[Direction],
    gaps: Sequence[str],
    notes: Sequence[str],
    store: MemoryStore,
    fp: Fingerprint,
    log: Callable[[str], None],
) -> AgentTeam:
    """The team, briefed with what this tune knows before its search starts."""
    from specpilot.engine.config import EngineConfig
    from specpilot.tune.agent_brief import BriefContext
    from specpilot.tune.agent_team import AgentTeam
    from specpilot.tune.space import describe

    similar = []
    for label, _sim, row in store.similar_validated(fp):
        try:
            what = describe(EngineConfig.from_dict(row["config"]))
        except Exception:
            what = row["config_hash"]
        similar.append(f"{label}: {what} -> {row['speedup']:.2f}x")
    not_searched = {}
    for line in notes:
        if line.startswith("not searched: "):
            name, _, why = line.removeprefix("not searched: ").partition(": ")
            not_searched[name] = why
    ctx = BriefContext(deployment, tuple(gaps), tuple(similar), not_searched)
    return AgentTeam(client, ctx, args.agents, directions, args.trials, log=log)


__all__ = ["add_agent_args", "check", "connect_agent", "make_team"]


def kernel_asker(
    client: AgentClient | None,
    args: argparse.Namespace,
    store: MemoryStore,
    team: AgentTeam | None,
    device: Any,
) -> Callable[..., Any] | None:
    """``--kernel-agent N``: what the kernel search calls first, ``(matrices, widths, seconds)``
    -> N sandboxed proposals for the ``w12-gemm`` slot, priced with the team's calls."""
    if client is None or team is None or not args.kernel_agent:
        return None
    from specpilot.tune.kernel_agent import ask_for_kernels

    def ask(matrices: Any, widths: Sequence[int], seconds: float) -> None:
        print(
            f"kernel agent: {args.kernel_agent} W12 kernel(s) asked of {client.model}", flush=True
        )
        ask_for_kernels(
            client, store, team.price, device, matrices, widths, args.kernel_agent, seconds,
            log=lambda m: print(m, flush=True),
        )  # fmt: skip

    return ask
