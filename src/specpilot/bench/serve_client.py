"""A serving benchmark for any OpenAI-compatible server: streamed chat requests at a given
concurrency and arrival rate, timed per chunk, summarised under the names vLLM's
``benchmark_serving`` uses (``median_ttft_ms``, ``p99_itl_ms``, ``output_throughput``, ...).

Standard library only (``urllib`` and threads), so it runs wherever ``specpilot`` does and
measures a remote vLLM, SGLang or llama.cpp server as well as ours. Per request:

* **TTFT**: from sending the request to the first chunk that carries text;
* **ITL**: the gaps between successive text chunks (a speculative server may put several tokens
  in one chunk: its ITL is per chunk, as vLLM's benchmark measures it too);
* **TPOT**: (latency - TTFT) / (output tokens - 1), the tokens from the stream's usage chunk
  (``stream_options.include_usage``), else the number of text chunks;
* **E2EL**: the whole request.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specpilot.bench.batched import percentile, poisson_arrivals
from specpilot.errors import SpecPilotError

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """One request's timings (seconds) and token counts; ``error`` set when it failed."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def server_model(url: str, timeout: float = 10.0) -> str:
    """The first model ``url``'s ``/v1/models`` lists: one clear error if nothing answers."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as r:
            data = json.load(r).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SpecPilotError(
            f"No OpenAI-compatible server answers at {url} (GET /v1/models: {e})."
        ) from None
    if not data:
        raise SpecPilotError(f"{url}/v1/models lists no model; pass --served-model.")
    return str(data[0]["id"])


def stream_chat(
    url: str, model: str, messages: list[dict[str, str]], max_tokens: int, timeout: float
) -> RequestResult:
    """One streamed ``/v1/chat/completions`` request, timed chunk by chunk."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{url.rstrip('/')}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    res = RequestResult()
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                ev = json.loads(payload)
                if ev.get("usage"):
                    res.prompt_tokens = int(ev["usage"].get("prompt_tokens") or 0)
                    res.output_tokens = int(ev["usage"].get("completion_tokens") or 0)
                for ch in ev.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks
    if not res.error and chunks == 0:
        res.error = "the stream carried no text"
    return res


def run_load(
    url: str,
    model: str,
    prompts: Sequence[list[dict[str, str]]],
    *,
    max_tokens: int,
    concurrency: int,
    rate: float = 0.0,
    seed: int = 0,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt once: Poisson arrivals at ``rate`` per second (0: all at once), at
    most ``concurrency`` in flight. Returns the results in prompt order and the wall seconds."""
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    results: list[RequestResult] = [RequestResult() for _ in prompts]
    slots = threading.Semaphore(concurrency)
    start = time.perf_counter()

    def one(i: int) -> None:
        try:
            results[i] = stream_chat(url, model, list(prompts[i]), max_tokens, timeout)
        finally:
            slots.release()

    threads = []
    for i, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = [1e3 * s for s in seconds] or [0.0]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    out.update({f"p{q}_{name}_ms": percentile(ms, q) for q in PERCENTILES})
    return out


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM ``benchmark_serving``'s metrics over the completed requests."""
    ok = [r for r in results if not r.error]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("tpot", tpot))
    summary.update(_stats("itl", [g for r in ok for g in r.itl]))
    summary.update(_stats("e2el", [r.latency for r in ok]))
    summary["errors"] = sorted({r.error for r in results if r.error})
    return summary


def result_rows(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request records for the JSON file (timings and counts; the texts are not kept)."""
    return [asdict(r) for r in results]


__all__ = [
    "RequestResult",
    "result_rows",
    "run_load",
    "server_model",
    "stream_chat",
    "summarize",
]
