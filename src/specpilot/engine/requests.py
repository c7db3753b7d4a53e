"""What passes in and out of the continuous-batching scheduler: requests, results, step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.engine.logprobs import TokenLogprob
from specpilot.engine.stats import AcceptanceStats
from specpilot.errors import PromptTooLongError


def check_fits(prompt_len: int, max_new_tokens: int, max_context: int, where: str) -> None:
    """One clear error, before any slow work, for a request that ``max_context`` tokens (prompt
    plus new ones) cannot hold; ``where``: what has that context, for the message."""
    if prompt_len == 0:
        raise PromptTooLongError("The prompt is empty; give at least one token.")
    if prompt_len + max_new_tokens > max_context:
        raise PromptTooLongError(
            f"A prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the "
            f"context of {max_context} {where}; shorten the prompt or lower --max-new-tokens."
        )


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request; ``id`` is the caller's handle (unique among live requests)."""

    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end the request (committed, then the request leaves): EOS ids."""
    draft_cap: int | None = None
    """Most drafts a cycle verifies for this request (0: no speculation; None: the plan's).
    Speed only: the committed tokens are the same."""
    logprobs: int | None = None
    """None: no logprobs; n >= 0: each committed token's logprob and the n most likely tokens
    at its position (``engine/logprobs.py``)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: max_new_tokens must be at least 1")
        if self.draft_cap is not None and self.draft_cap < 0:
            raise ValueError(f"request {self.id}: draft_cap must be at least 0")


@dataclass(slots=True)
class RequestResult:
    """A finished (or cancelled) request, with its own acceptance statistics and clock marks."""

    id: str
    prompt_ids: list[int]
    tokens: list[int]  # committed tokens after the prompt, stop token included
    stop_reason: str  # "eos" | "length" | "cancelled"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per committed token when the request asked for them."""
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    admitted_step: int = 0
    """Scheduler step at which the request took a slot."""
    first_token_step: int = -1
    """Step whose forward finished the prompt and produced the first token."""
    finished_step: int = -1


@dataclass(slots=True)
class StepReport:
    """What one scheduler step did: tokens committed per request, and the requests that left."""

    committed: list[tuple[str, list[int]]]  # (request id, tokens committed this step)
    finished: list[RequestResult]
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    """Per request that asked for them: the logprobs of the tokens it committed this step (its
    first token and its decode step together), in order."""
    rows_decoding: int = 0
    """Rows that verified a draft (or took an AR step) in this step's forward."""
    rows_prefilling: int = 0
    """Rows that fed a prompt segment in this step."""
    prefill_forwards: int = 0
    """Target forwards those segments took (packs and eager runs, ``engine/admission.py``)."""
    forward_tokens: int = 0
    """Width of the padded forward: rows x tokens per row (what the target computed)."""
    drafted: int = 0
    """Drafted tokens the forward verified, over all rows (after any draft pre-filter)."""
