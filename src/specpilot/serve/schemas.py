"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Only greedy decoding is served: ``temperature`` must be 0 (or absent), ``top_p`` 1, ``n`` 1.
Fields clients commonly send that change nothing here (``user``, ``presence_penalty`` = 0, ...)
are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

GREEDY_ONLY = (
    "this server decodes greedily and losslessly (every token is the target's argmax), so it "
    "serves temperature 0 only; drop temperature or set it to 0"
)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    """Accepted and ignored: greedy decoding has one answer."""
    stream_options: dict[str, Any] | None = None
    """``{"include_usage": true}``: a streamed answer ends with a usage chunk."""
    speculative: bool | None = None
    """Extra body field: false turns speculation off for this request (speed only)."""
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    """Extra body field (vLLM's name): the most drafts one cycle verifies for this request."""

    def draft_cap(self) -> int | None:
        if self.speculative is False:
            return 0
        return self.num_speculative_tokens

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @field_validator("temperature")
    @classmethod
    def _greedy(cls, v: float | None) -> float | None:
        if v is not None and v != 0:
            raise ValueError(GREEDY_ONLY)
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and v != 1:
            raise ValueError("top_p must be 1 (or absent): this server decodes greedily")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("n must be 1: greedy decoding has exactly one answer")
        return v

    def budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """The legacy field: the committed token's logprob and this many alternatives."""

    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
