"""The LLM agents' endpoint: any OpenAI-compatible chat server, through the official client.

``tune --agent URL`` talks to one endpoint (vLLM, SGLang, llama.cpp, ``specpilot serve``, a
hosted API). :func:`connect` checks it before anything slow (an unreachable URL or a refused key
is one clear error, before the target loads) and picks the model when none is named. Every call
afterwards is bounded by its own timeout, is never retried by the client (a retry would hide a
slow endpoint behind the budget), and comes back as an :class:`AgentReply` or an
:class:`AgentFailure` with a reason: the explorers never see an exception from the network.
What they cost is added up in ``tune/agent_price.py``.

The key: ``SPECPILOT_AGENT_KEY``, else ``OPENAI_API_KEY``, else none (local servers need none).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from specpilot.errors import SpecPilotError

KEY_VARIABLES = ("SPECPILOT_AGENT_KEY", "OPENAI_API_KEY")
CONNECT_TIMEOUT_S = 10.0
"""Seconds :func:`connect` waits for the endpoint's model list."""


def agent_key() -> str:
    """The key sent to the endpoint (``EMPTY`` when neither variable is set)."""
    for name in KEY_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return "EMPTY"


@dataclass(slots=True)
class AgentReply:
    text: str
    prompt_tokens: int | None
    """As the endpoint reported them (None: it reported no usage)."""
    completion_tokens: int | None
    seconds: float


@dataclass(slots=True)
class AgentFailure:
    reason: str
    """One sentence: what went wrong (timeout, refused, HTTP status and message, ...)."""
    seconds: float


class AgentClient:
    """One endpoint and model; thread-safe (the team's agents call it in parallel)."""

    def __init__(self, url: str, model: str, timeout_s: float, max_tokens: int) -> None:
        import openai

        self.url, self.model, self.timeout_s, self.max_tokens = url, model, timeout_s, max_tokens
        self._client = openai.OpenAI(
            base_url=url, api_key=agent_key(), timeout=timeout_s, max_retries=0
        )

    def chat(self, messages: list[dict[str, str]]) -> AgentReply | AgentFailure:
        """One chat completion; never raises for what the endpoint or the network does."""
        import openai

        t0 = time.perf_counter()
        try:
            resp = self._client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
            )
        except openai.APITimeoutError:
            return AgentFailure(f"no answer within {self.timeout_s:g} s", _since(t0))
        except openai.APIStatusError as e:
            return AgentFailure(
                f"the endpoint answered HTTP {e.status_code}: {_message(e)}",
                _since(t0),
            )
        except openai.APIConnectionError as e:
            return AgentFailure(f"cannot reach the endpoint ({_short(str(e))})", _since(t0))
        except Exception as e:  # a malformed body the client could not parse, ...
            return AgentFailure(
                f"unusable answer ({type(e).__name__}: {_short(str(e))})", _since(t0)
            )
        seconds = _since(t0)
        choices = getattr(resp, "choices", None) or []
        message = choices[0].message if choices else None
        text = (getattr(message, "content", None) or "") if message is not None else ""
        refusal = getattr(message, "refusal", None) if message is not None else None
        if not text.strip():
            why = f"it refused: {_short(str(refusal))}" if refusal else "an empty answer"
            return AgentFailure(why, seconds)
        usage = getattr(resp, "usage", None)
        return AgentReply(
            text,
            getattr(usage, "prompt_tokens", None),
            getattr(usage, "completion_tokens", None),
            seconds,
        )


def connect(url: str, model: str | None, timeout_s: float, max_tokens: int) -> AgentClient:
    """A client for ``url`` after one check that the endpoint answers (its model list); the model
    is ``model`` or, when none is named, the first the endpoint lists. Raises SpecPilotError
    with what to do when the endpoint cannot be used."""
    import openai

    if not url.startswith(("http://", "https://")):
        raise SpecPilotError(
            f"--agent must be an http(s) URL such as http://host:8000/v1, got {url!r}."
        )
    probe = openai.OpenAI(
        base_url=url, api_key=agent_key(), timeout=min(timeout_s, CONNECT_TIMEOUT_S), max_retries=0
    )
    listed: list[str] = []
    try:
        listed = [m.id for m in probe.models.list()]
    except openai.AuthenticationError:
        raise SpecPilotError(
            f"The agent endpoint {url} refused the key: set SPECPILOT_AGENT_KEY (or "
            "OPENAI_API_KEY) to a key it accepts."
        ) from None
    except openai.NotFoundError:
        pass  # a server without a model list: reachable, so go on with --agent-model
    except openai.APIStatusError as e:
        raise SpecPilotError(
            f"The agent endpoint {url} answered HTTP {e.status_code} to its model list "
            f"({_message(e)}); check --agent."
        ) from None
    except (openai.APIConnectionError, openai.APITimeoutError):
        raise SpecPilotError(
            f"Cannot reach the agent endpoint {url}: start the server or fix --agent (nothing "
            "was loaded)."
        ) from None
    if model is None:
        if not listed:
            raise SpecPilotError(
                f"The agent endpoint {url} lists no model: name one with --agent-model."
            )
        model = listed[0]
    return AgentClient(url, model, timeout_s, max_tokens)


def _message(e: Exception) -> str:
    """An API error's message without the client's ``Error code: 500 - `` prefix."""
    text = str(getattr(e, "message", e))
    return _short(re.sub(r"^Error code: \d+ - ", "", text))


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


__all__ = ["AgentClient", "AgentFailure", "AgentReply", "agent_key", "connect"]
