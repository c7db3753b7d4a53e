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
        stream: bool,
        shape: Any,
    ) -> Response:
        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, budget, stops, loop, asyncio.Queue(), stream=stream)
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
            try:
                first = shape.first_chunk(rid, created)
                if first is not None:
                    yield sse(first)
                while True:
                    kind, payload = await job.out.get()
                    if kind == "delta":
                        yield sse(shape.chunk(rid, created, payload, None))
                    elif kind == "done":
                        yield sse(shape.chunk(rid, created, "", payload.finish_reason))
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
        return await run(
            request,
            prompt_ids,
            budget,
            req.stops(),
            req.stream,
            _CompletionShape(settings.model_name),
        )

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
        return await run(
            request, prompt_ids, budget, req.stops(), req.stream, _ChatShape(settings.model_name)
        )

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


@dataclass(frozen=True, slots=True)
class _CompletionShape:
    model: str
    prefix: str = "cmpl"

    def full(self, rid: str, created: int, out: Outcome, prompt: int) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        return _envelope(rid, "text_completion", created, self.model, choice) | {
            "usage": _usage(prompt, out)
        }

    def first_chunk(self, rid: str, created: int) -> dict[str, Any] | None:
        return None

    def chunk(self, rid: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _envelope(rid, "text_completion", created, self.model, choice)


@dataclass(frozen=True, slots=True)
class _ChatShape:
    model: str
    prefix: str = "chatcmpl"

    def full(self, rid: str, created: int, out: Outcome, prompt: int) -> dict[str, Any]:
        msg = {"role": "assistant", "content": out.text}
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": out.finish_reason}
        return _envelope(rid, "chat.completion", created, self.model, choice) | {
            "usage": _usage(prompt, out)
        }

    def first_chunk(self, rid: str, created: int) -> dict[str, Any] | None:
        return self.chunk(rid, created, "", None, first=True)

    def chunk(
        self, rid: str, created: int, text: str, finish: str | None, first: bool = False
    ) -> dict[str, Any]:
        delta = (
            {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        )
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _envelope(rid, "chat.completion.chunk", created, self.model, choice)
