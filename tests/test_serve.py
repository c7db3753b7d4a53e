"""The OpenAI-compatible server, end to end over loopback with the official openai client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from specpilot.cli import build_parser
from specpilot.commands.common import build_deployment
from specpilot.commands.serve import build_app
from specpilot.drafters.wrapped import WrappedDrafter
from specpilot.engine import generate
from specpilot.engine.config import DeploymentSpec, EngineConfig

KEY = "sekret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RunningServer:
    def __init__(self, app, port: int) -> None:
        self.app = app
        self.port = port
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def serve_args(model_dir: Path, *extra: str):
    return build_parser().parse_args(
        ["serve", "--target", str(model_dir), "--device", "cpu", "-k", "4", *extra]
    )


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RunningServer]:
    app = build_app(
        serve_args(model_dir, "--api-key", KEY, "--audit-rate", "1.0", "--default-max-tokens", "24")
    )
    with RunningServer(app, free_port()) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(model_dir: Path):
    """Plain AR offline, one request at a time: what the server must return (fp32)."""
    dep = build_deployment(serve_args(model_dir))
    engine = dep.build.stock_engine()
    tok = dep.target.tokenizer

    def complete(prompt_ids: list[int], max_tokens: int) -> str:
        res = generate(engine, [prompt_ids], max_tokens, dep.eos_ids)[0]
        return tok.decode(res.tokens, skip_special_tokens=True)

    return tok, complete


def client(server: RunningServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_models_health_and_completion(server, offline, model_dir):
    tok, complete = offline
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == [str(model_dir)]
    card = models[0].model_extra["specpilot"]
    assert card["drafter"] == "ngram(k=4)" and card["plan"] == "chain"
    assert card["runner"] == "eager" and card["simulated_acceptance"] is None
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = c.completions.create(
        model=str(model_dir), prompt="hello world hello", max_tokens=20, temperature=0
    )
    assert r.choices[0].text == complete(tok.encode("hello world hello"), 20)
    assert r.usage.prompt_tokens == 3 and r.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_equals_non_streaming(server, offline):
    tok, complete = offline
    c = client(server)
    messages = [{"role": "user", "content": "hi hello world"}]
    full = c.chat.completions.create(model=None, messages=messages, max_tokens=30)  # type: ignore[arg-type]
    want = complete(tok.apply_chat_template(messages), 30)
    assert full.choices[0].message.content == want
    parts, finish = [], None
    for chunk in c.chat.completions.create(
        model=None, messages=messages, max_tokens=30, stream=True
    ):  # type: ignore[arg-type]
        if chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == want and finish == full.choices[0].finish_reason


def test_bad_requests_get_clear_4xx(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="greedily"):
        c.completions.create(model=None, prompt="hello", temperature=0.7)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model=None, prompt="hello " * 100, max_tokens=200)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="not served"):
        c.completions.create(model="gpt-9", prompt="hello")
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": []},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_metrics_and_background_audit(server):
    client(server).completions.create(model=None, prompt="world hello", max_tokens=10)  # type: ignore[arg-type]
    deadline = time.time() + 10
    while True:
        text = httpx.get(server.url + "/metrics").text
        values = {
            ln.split(" ")[0]: float(ln.split(" ")[1])
            for ln in text.splitlines()
            if ln and not ln.startswith("#")
        }
        if values.get("specpilot_audit_sequences_total", 0) >= 1 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert values["specpilot_generated_tokens_total"] > 0
    assert values["specpilot_mean_accepted_length"] >= 1.0
    assert values["specpilot_audit_sequences_total"] >= 1
    assert values["specpilot_audit_match_tokens_total"] > 0
    assert values["specpilot_audit_mismatch_tokens_total"] == 0


def test_concurrent_load_from_a_second_process(server, offline, tmp_path):
    tok, complete = offline
    prompts = ["hello", "world hello", "hi hi hi", "user hello world", "hello world world", "hi"]
    want = [complete(tok.encode(p), 16) for p in prompts]
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        from concurrent.futures import ThreadPoolExecutor
        import openai
        c = openai.OpenAI(base_url={server.url + "/v1"!r}, api_key={KEY!r}, max_retries=0)
        prompts = {prompts!r}
        def one(p):
            return c.completions.create(model=None, prompt=p, max_tokens=16).choices[0].text
        with ThreadPoolExecutor(6) as ex:
            print(json.dumps(list(ex.map(one, prompts * 2))))
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == want * 2


def test_client_disconnect_cancels_generation(model_dir):
    """A slow drafter makes generation long; closing the stream must stop it early."""
    app = build_app(serve_args(model_dir, "--default-max-tokens", "200"))
    slow = _slow_down(app)
    with RunningServer(app, free_port()) as srv:
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            json={"prompt": "hello", "max_tokens": 200, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # got the first token: hang up
        deadline = time.time() + 20
        while slow.metrics.value("specpilot_cancelled_requests_total") != 1.0:
            assert time.time() < deadline, "generation was not cancelled"
            time.sleep(0.05)
        assert slow.metrics.value("specpilot_requests_total") == 0.0


class _Slow(WrappedDrafter):
    """The inner drafter, ``seconds`` (20 ms) slower per proposal."""

    def __init__(self, inner, seconds: float = 0.02) -> None:
        super().__init__(inner, inner.name, inner.k)
        self.seconds = seconds

    def propose(self, rows, attn_len):
        time.sleep(self.seconds)
        return self.inner.propose(rows, attn_len)


def _slow_down(app):
    """The app's worker, with a drafter that sleeps 20 ms per proposal."""
    worker = app.state.worker
    engine = worker.scheduler.engine
    engine.drafter = _Slow(engine.drafter)
    return worker


def test_concurrent_streams_with_stop_strings_share_the_batch(server, offline):
    """Streams running together in the continuous batch, some cut by a stop string mid-batch,
    each equal to its own offline output (cut at the stop string)."""
    from concurrent.futures import ThreadPoolExecutor

    tok, complete = offline
    prompts = ["hello world", "world world hello", "hi", "user hi hello", "hello"]
    full = [complete(tok.encode(p), 20) for p in prompts]
    # a stop string that occurs inside some outputs (the first output's middle characters)
    stop = full[0][len(full[0]) // 2 : len(full[0]) // 2 + 2] or "x"
    want = [(f[: f.find(stop)] if stop in f else f) for f in full]

    def one(p: str) -> tuple[str, str | None]:
        parts, finish = [], None
        for chunk in client(server).completions.create(
            model=None,  # type: ignore[arg-type]
            prompt=p,
            max_tokens=20,
            stop=[stop],
            stream=True,
        ):
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(one, prompts))
    assert [text for text, _ in got] == want
    assert got[0][1] == "stop"


def _engine_file(tmp_path: Path, model_dir: Path, mechanisms: dict, drafter: str = "ngram") -> Path:
    path = tmp_path / "engine.json"
    dep = DeploymentSpec(target=str(model_dir), drafter=drafter, device="cpu", mode="batched")
    EngineConfig(dep, k=4, drafter_knobs={"max_n": 3, "min_n": 1}, mechanisms=mechanisms).save(path)
    return path


SERVED = {
    "tree": {"tree-verify": {"depth": 4, "width": 2, "max_nodes": 6}},
    "packed": {"ragged-verify": {"bucket": 8}, "adaptive-block": {"k_min": 1}},
    "tiered": {"tiered-budget": {"budget": 2.5}},
}


@pytest.mark.parametrize("plan", list(SERVED))
def test_every_plan_and_mechanism_serves_ar_output(plan, model_dir, offline, tmp_path):
    """No plan or mechanism is refused by the server: trees, packed ragged verify with a per-row
    width policy; concurrent streams each equal to their own AR output."""
    from concurrent.futures import ThreadPoolExecutor

    tok, complete = offline
    engine = _engine_file(tmp_path, model_dir, SERVED[plan])
    app = build_app(build_parser().parse_args(["serve", "--engine", str(engine)]))
    prompts = ["hello world hello world", "hi hi", "world hello", "user hello hi", "hello"]
    want = [complete(tok.encode(p), 18) for p in prompts]
    with RunningServer(app, free_port()) as srv:
        card = client(srv).models.list().data[0].model_extra["specpilot"]
        assert card["plan"] == {"tree": "tree", "packed": "packed", "tiered": "packed"}[plan]
        assert card["mechanisms"] == list(SERVED[plan])

        def one(p: str) -> str:
            r = client(srv).completions.create(model=None, prompt=p, max_tokens=18)  # type: ignore[arg-type]
            return r.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as ex:
            assert list(ex.map(one, prompts)) == want


def test_simulated_acceptance_is_labelled_and_lossless(model_dir, offline):
    """``--simulate-acceptance`` comes through the engine config; /v1/models and the startup
    line say so, and the outputs are still the target's own."""
    from specpilot.commands.serve import startup_line

    tok, complete = offline
    args = serve_args(  # no gate: its timing could turn drafting off on a loaded machine
        model_dir, "--simulate-acceptance", "tau=3,block=5", "--max-concurrency", "2", "--no-gate"
    )
    app = build_app(args)
    assert "simulated acceptance tau=3,block=5" in startup_line(app.state.settings)
    prompts = ["hello world", "hi hello hi", "world"]
    with RunningServer(app, free_port()) as srv:
        card = client(srv).models.list().data[0].model_extra["specpilot"]
        assert "simulated acceptance" in card["drafter"]
        assert card["simulated_acceptance"] == "tau=3,block=5"
        for p in prompts:
            r = client(srv).completions.create(model=None, prompt=p, max_tokens=20)  # type: ignore[arg-type]
            assert r.choices[0].text == complete(tok.encode(p), 20)
        mean = app.state.worker.metrics.value("specpilot_mean_accepted_length")
        assert mean > 1.5  # the oracle's drafts are accepted
