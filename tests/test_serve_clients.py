"""What clients do to the server: give up on a plain request, send an oversized body, leave out
``model``. A real uvicorn server on loopback, the official openai client and httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from specpilot.commands.serve import build_app
from test_serve import RunningServer, _Slow, free_port, serve_args

LIMIT = 4096


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RunningServer]:
    app = build_app(serve_args(model_dir, "--max-body-bytes", str(LIMIT)))
    with RunningServer(app, free_port()) as srv:
        yield srv


def metric(srv: RunningServer, name: str, **labels: str) -> float:
    return srv.app.state.worker.metrics.value(name, **labels) or 0.0


def test_a_plain_request_whose_client_gives_up_is_cancelled_at_once(model_dir):
    """The client times out after 0.3 s on a request that would run for seconds (one row, a
    drafter 0.1 s slower per cycle: at least 40 cycles for 200 tokens). The request is cancelled
    within a step, never completes, and the row is free for the next request at once."""
    app = build_app(serve_args(model_dir, "--max-concurrency", "1"))
    engine = app.state.worker.scheduler.engine
    engine.drafter = _Slow(engine.drafter, seconds=0.1)
    with RunningServer(app, free_port()) as srv:
        impatient = openai.OpenAI(
            base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=0.3
        )
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=None, prompt="hello", max_tokens=200)  # type: ignore[arg-type]
        gave_up = time.time()
        while not (
            metric(srv, "specpilot_cancelled_requests_total")
            or metric(srv, "specpilot_requests_total")
        ):
            assert time.time() < gave_up + 20, "the request neither ended nor was cancelled"
            time.sleep(0.02)
        assert metric(srv, "specpilot_cancelled_requests_total") == 1
        assert metric(srv, "specpilot_requests_total") == 0
        assert time.time() - gave_up < 3  # the whole generation takes 4 s or more
        assert metric(srv, "specpilot_cancel_delay_steps_bucket", le="1.0") == 1
        # the one row is free: a short request is served without waiting for the long one
        patient = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        start = time.time()
        r = patient.completions.create(model=None, prompt="hi", max_tokens=4)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason in ("length", "stop")
        assert time.time() - start < 3
        assert metric(srv, "specpilot_requests_total") == 1
        assert metric(srv, "specpilot_generated_tokens_total") == r.usage.completion_tokens


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    """Content-Length over the limit: refused before reading; a chunked body (no length) is
    read only up to the limit; both get one 413 in OpenAI's format, and nothing is queued."""
    url = server.url + "/v1/completions"
    big = b'{"prompt": "' + b"hello " * 2000 + b'", "max_tokens": 4}'
    assert len(big) > LIMIT
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
    err = _error(r)
    assert r.status_code == 413 and err["code"] == 413 and err["type"] == "invalid_request_error"
    assert f"limit of {LIMIT} bytes" in err["message"] and "--max-body-bytes" in err["message"]

    def chunks() -> Iterator[bytes]:
        for i in range(0, 1 << 20, 1024):  # 1 MiB in 1 KiB chunks, no Content-Length
            yield big[i % len(big) : i % len(big) + 1024].ljust(1024, b" ")

    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in _error(r)["message"]

    with pytest.raises(openai.APIStatusError, match="limit of") as e:
        openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0
        ).completions.create(
            model=None,  # type: ignore[arg-type]
            prompt="hello " * 2000,
            max_tokens=4,
        )
    assert e.value.status_code == 413
    assert metric(server, "specpilot_requests_total") == 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    # just under the limit is read and parsed as usual (here: too long for the context)
    under = b'{"prompt": "' + b"hello " * 600 + b'", "max_tokens": 4}'
    assert len(under) <= LIMIT
    r = httpx.post(url, content=under, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "context" in _error(r)["message"]


def test_a_request_without_model_is_served_by_the_one_model(server, model_dir):
    """No ``model`` (or ``""``) means the one served model, as in vLLM and SGLang; the answer
    names it. A name that is not served is a 404 (tests/test_serve.py)."""
    url, served = server.url + "/v1", str(model_dir)
    for body in ({}, {"model": ""}, {"model": None}, {"model": served}):
        r = httpx.post(url + "/completions", json={"prompt": "hello", "max_tokens": 3} | body)
        assert r.status_code == 200 and r.json()["model"] == served, (body, r.text)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3} | body
        r = httpx.post(url + "/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["model"] == served, (body, r.text)
    r = httpx.post(url + "/completions", json={"prompt": "hello", "model": "gpt-9"})
    assert r.status_code == 404 and _error(r)["param"] == "model"


def test_a_client_that_leaves_mid_body_is_counted_and_nothing_runs(server):
    """Headers and half a body, then the connection closes: counted as abandoned, never handed
    to the engine, and the server serves on."""
    import socket

    before = metric(server, "specpilot_abandoned_requests_total")
    submitted = metric(server, "specpilot_submitted_requests_total")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": "hel'
        )
        time.sleep(0.2)
    deadline = time.time() + 10
    while metric(server, "specpilot_abandoned_requests_total") == before:
        assert time.time() < deadline, "the abandoned request was not counted"
        time.sleep(0.02)
    assert metric(server, "specpilot_abandoned_requests_total") == before + 1
    assert metric(server, "specpilot_submitted_requests_total") == submitted
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200


def test_a_bad_body_limit_is_one_sentence_before_loading(capsys):
    from specpilot.cli import main
    from test_cli import assert_one_line_error

    code = main(["serve", "--max-body-bytes", "0", "--target", "/nonexistent"])
    assert_one_line_error(code, capsys.readouterr().err, "--max-body-bytes", "at least 1")
