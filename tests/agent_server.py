"""A scripted OpenAI-compatible chat server for the agent tests: a real HTTP server (stdlib
``http.server``) on loopback, in this process, answering each chat call from a script.

A script is a function of the request's JSON body and the brief's direction (the text after
"Your direction this round: ") that returns a :class:`Reply`; a list of replies is played in
order (the last one repeated).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DIRECTION = re.compile(r"Your direction this round: ([^\s]+)\.")


@dataclass(frozen=True, slots=True)
class Reply:
    content: str = ""
    status: int = 200
    sleep: float = 0.0
    """Seconds to wait before answering (a slow agent: the client's timeout fires first)."""
    raw: bytes | None = None
    """A body sent as is (e.g. not JSON at all)."""
    usage: tuple[int, int] | None = (100, 20)
    refusal: str | None = None


def proposals(*items: dict[str, Any]) -> Reply:
    return Reply(json.dumps({"proposals": list(items)}))


Script = Callable[[dict[str, Any], str], Reply] | Sequence[Reply]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ScriptedServer:
    def __init__(
        self, script: Script, models: Sequence[str] = ("scripted",), key: str | None = None
    ):
        self.script, self.models, self.key = script, list(models), key
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._n = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def reply_for(self, body: dict[str, Any]) -> Reply:
        text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
        found = DIRECTION.search(text)
        with self._lock:
            self.requests.append(body)
            i, self._n = self._n, self._n + 1
        if callable(self.script):
            return self.script(body, found.group(1) if found else "")
        return self.script[min(i, len(self.script) - 1)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)  # unless the client gave up (its timeout)

            def _authorized(self) -> bool:
                if (
                    server.key is None
                    or self.headers.get("Authorization") == f"Bearer {server.key}"
                ):
                    return True
                self._send(401, json.dumps({"error": {"message": "bad key"}}).encode())
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path.rstrip("/") != "/v1/models":
                    self._send(404, b'{"error": {"message": "not found"}}')
                    return
                data = [
                    {"id": m, "object": "model", "created": 0, "owned_by": "t"}
                    for m in server.models
                ]
                self._send(200, json.dumps({"object": "list", "data": data}).encode())

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                r = server.reply_for(body)
                if r.sleep:
                    time.sleep(r.sleep)
                if r.raw is not None:
                    self._send(r.status, r.raw)
                    return
                if r.status != 200:
                    self._send(r.status, json.dumps({"error": {"message": r.content}}).encode())
                    return
                message: dict[str, Any] = {"role": "assistant", "content": r.content}
                if r.refusal is not None:
                    message = {"role": "assistant", "content": None, "refusal": r.refusal}
                out: dict[str, Any] = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", ""),
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                }
                if r.usage is not None:
                    p, c = r.usage
                    out["usage"] = {
                        "prompt_tokens": p,
                        "completion_tokens": c,
                        "total_tokens": p + c,
                    }
                self._send(200, json.dumps(out).encode())

        return Handler


@contextmanager
def scripted(script: Script, **kw: Any) -> Iterator[ScriptedServer]:
    srv = ScriptedServer(script, **kw)
    thread = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()
