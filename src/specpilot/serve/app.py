"""The FastAPI application: OpenAI-compatible completions and chat, health, models, metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specpilot.engine.logprobs import TokenLogprob
from specpilot.serve.guard import RequestGuard, default_max_body_bytes, error
from specpilot.serve.schemas import ChatCompletionRequest, CompletionRequest
from specpilot.serve.worker import EngineWorker, Job, Outcome


@dataclass(frozen=True, slots=True)
class ServeSettings:
    model_name: str
    """Name reported by /v1/models and accepted in requests."""
    context: int
    """Prompt + completion tokens the engine can hold."""
    default_max_tokens: int = 256
    api_key: str | None = None
    """When set, requests need ``Authorization: Bearer <key>``."""
    engine: dict[str, Any] = field(default_factory=dict)
    """What serves the model (drafter label, plan, mechanisms, runner, slots), shown on
    /v1/models; its ``drafter`` says ``simulated acceptance`` when the acceptance is simulated."""
    max_body_bytes: int | None = None
    """Largest request body read (413 above it); None: ``default_max_body_bytes(context)``."""

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes or default_max_body_bytes(self.context)


def create_app(worker: EngineWorker, settings: ServeSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="SpecPilot", version="0.1.0", lifespan=lifespan)
    app.state.worker = worker
    app.state.settings = settings

    @app.exception_handler(RequestValidationError)
    async def bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            return error(400, "The request body is not valid JSON.")
        return error(400, f"{where}: {msg}" if where else msg, param=where or None)

    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        max_body_bytes=settings.body_limit,
        on_abandoned=worker.metrics.abandoned.inc,
    )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": settings.model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "specpilot"}
        return {"object": "list", "data": [card | {"specpilot": settings.engine}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = worker.metrics.render()
        return Response(body, media_type=ctype)

    def check(
        req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]
    ) -> JSONResponse | int:
        # no model (or ""): the one served model, as vLLM and SGLang do (docs/SERVE.md)
        if req.model and req.model != settings.model_name:
            return error(
                404,
                f"Model '{req.model}' is not served here; this server serves '{settings.model_name}'.",
                param="model",
            )
        budget = req.budget(settings.default_max_tokens)
        if len(prompt_ids) + budget > settings.context:
            return error(
                400,
                f"The prompt has {len(prompt_ids)} tokens and max_tokens is {budget}, together more than "
                f"the context of {settings.context}; shorten the prompt or lower max_tokens.",
                param="max_tokens",
            )
        return budget

    async def run(
        request: Request,
        prompt_ids: list[int],
        budget: int,
        stops: list[str],
        req: CompletionRequest | ChatCompletionRequest,
        shape: Any,
    ) -> Response:
        loop = asyncio.get_running_loop()
        stream, top = req.stream, req.logprob_count()
        why = worker.scheduler.logprobs_refused() if top is not None else None
        if why is not None:  # the scheduler's own rule, answered before the job queues
            return error(400, why + ".", param="logprobs")
        job = Job(
            prompt_ids,
            budget,
            stops,
            loop,
            asyncio.Queue(),
            stream=stream,
            logprobs=top,
            draft_cap=req.draft_cap(),
        )
        try:
            worker.submit(job)
        except RuntimeError as e:
            return error(503, f"{e}.", "server_error")
        rid, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        if not stream:
            # Nothing is sent before the answer, so only the receive channel tells that the
            # client went away: watch it beside the job, and cancel the job when it says so.
            watch = asyncio.create_task(_client_gone(request, worker, job))
            try:
                kind, payload = await job.out.get()
            except asyncio.CancelledError:
                worker.cancel(job)
                raise
            finally:
                watch.cancel()
            if kind == "done":
                return JSONResponse(shape.full(rid, created, payload, len(prompt_ids)))
            if kind == "gone":  # nobody reads this
                return Response(status_code=499)
            return error(500, payload, "server_error")

        async def events() -> AsyncIterator[bytes]:
            offset = 0  # characters of the answer that the tokens sent so far spell
            try:
                first = shape.first_chunk(rid, created)
                if first is not None:
                    yield sse(first)
                while True:
                    kind, payload = await job.out.get()
                    if kind == "delta":
                        text, lps = payload
                        yield sse(shape.chunk(rid, created, text, None, lps, offset))
                        offset += _spelled(shape.tok, lps)
                    elif kind == "done":
                        rest = payload.unsent  # logprobs no delta carried yet
                        end = shape.chunk(rid, created, "", payload.finish_reason, rest, offset)
                        yield sse(end)
                        if req.include_usage():
                            usage = _usage(len(prompt_ids), payload)
                            yield sse(shape.usage_chunk(rid, created, usage))
                        yield b"data: [DONE]\n\n"
                        return
                    else:
                        yield sse({"error": {"message": payload, "type": "server_error"}})
                        return
            finally:  # the client went away, or we finished: either way nothing more is wanted
                worker.cancel(job)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        tok = worker.tokenizer
        prompt_ids = list(req.prompt) if isinstance(req.prompt, list) else tok.encode(req.prompt)
        budget = check(req, prompt_ids)
        if isinstance(budget, JSONResponse):
            return budget
        shape = _CompletionShape(settings.model_name, tok)
        return await run(request, prompt_ids, budget, req.stops(), req, shape)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        tok = worker.tokenizer
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            return error(400, f"messages: {e}.", param="messages")
        if not tok.has_chat_template:
            return error(400, "The served model has no chat template; use /v1/completions.")
        prompt_ids = tok.apply_chat_template(messages)
        budget = check(req, prompt_ids)
        if isinstance(budget, JSONResponse):
            return budget
        shape = _ChatShape(settings.model_name, tok)
        return await run(request, prompt_ids, budget, req.stops(), req, shape)

    return app


async def _client_gone(request: Request, worker: EngineWorker, job: Job) -> None:
    """Wait for the client to go away (``http.disconnect``), then cancel ``job`` and wake its
    waiter. The body was read already, so the channel has nothing else to say."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    worker.cancel(job)
    job.out.put_nowait(("gone", None))


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _usage(prompt: int, outcome: Outcome) -> dict[str, int]:
    n = len(outcome.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def _envelope(
    rid: str, obj: str, created: int, model: str, choice: dict[str, Any]
) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _piece(tok: Any, token: int) -> str:
    return str(tok.decode([token]))


def _chat_logprobs(tok: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: per token its text, logprob, bytes and top alternatives."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = _piece(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            entry(x.token, x.logprob) | {"top_logprobs": [entry(t, v) for t, v in x.top]}
            for x in lps
        ]
    }


def _spelled(tok: Any, lps: list[TokenLogprob]) -> int:
    """Characters that the tokens of ``lps`` spell, one by one (``text_offset``'s steps)."""
    return sum(len(_piece(tok, x.token)) for x in lps)


def _completion_logprobs(tok: Any, lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset
    (from ``offset``: a stream's chunks continue the offsets of the ones before)."""
    pieces = [_piece(tok, x.token) for x in lps]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{_piece(tok, t): v for t, v in x.top} for x in lps],
        "text_offset": offsets,
    }


@dataclass(frozen=True, slots=True)
class _CompletionShape:
    model: str
    tok: Any
    prefix: str = "cmpl"

    def full(self, rid: str, created: int, out: Outcome, prompt: int) -> dict[str, Any]:
        lps = _completion_logprobs(self.tok, out.logprobs) if out.logprobs else None
        choice = {"index": 0, "text": out.text, "logprobs": lps, "finish_reason": out.finish_reason}
        return _envelope(rid, "text_completion", created, self.model, choice) | {
            "usage": _usage(prompt, out)
        }

    def first_chunk(self, rid: str, created: int) -> dict[str, Any] | None:
        return None

    def chunk(
        self,
        rid: str,
        created: int,
        text: str,
        finish: str | None,
        lps: list[TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        logprobs = _completion_logprobs(self.tok, lps, offset) if lps else None
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return _envelope(rid, "text_completion", created, self.model, choice)

    def usage_chunk(self, rid: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
        env = _envelope(rid, "text_completion", created, self.model, {})
        return env | {"choices": [], "usage": usage}


@dataclass(frozen=True, slots=True)
class _ChatShape:
    model: str
    tok: Any
    prefix: str = "chatcmpl"

    def full(self, rid: str, created: int, out: Outcome, prompt: int) -> dict[str, Any]:
        msg = {"role": "assistant", "content": out.text}
        lps = _chat_logprobs(self.tok, out.logprobs) if out.logprobs else None
        choice = {"index": 0, "message": msg, "logprobs": lps, "finish_reason": out.finish_reason}
        return _envelope(rid, "chat.completion", created, self.model, choice) | {
            "usage": _usage(prompt, out)
        }

    def first_chunk(self, rid: str, created: int) -> dict[str, Any] | None:
        return self.chunk(rid, created, "", None, first=True)

    def chunk(
        self,
        rid: str,
        created: int,
        text: str,
        finish: str | None,
        lps: list[TokenLogprob] | None = None,
        offset: int = 0,
        first: bool = False,
    ) -> dict[str, Any]:
        """``offset``: unused (chat logprobs carry no text offsets)."""
        delta = (
            {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        )
        logprobs = _chat_logprobs(self.tok, lps) if lps else None
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _envelope(rid, "chat.completion.chunk", created, self.model, choice)

    def usage_chunk(self, rid: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
        env = _envelope(rid, "chat.completion.chunk", created, self.model, {})
        return env | {"choices": [], "usage": usage}
