"""Issue 8 on the CPU: latency through the server vs the offline engine, and a load test with audit.

    PYTHONPATH=src python3 bench/serve_latency.py --out DIR            # the full run
    PYTHONPATH=src python3 bench/serve_latency.py --out DIR --quick    # 2 prompts, 2 clients

Three processes, all with SmolLM2-135M in fp32, the n-gram drafter and one torch thread (the GPU
machine has no FastAPI, so this runs on the CPU): this one (the official ``openai`` client), the
real server (``specpilot serve`` under uvicorn on a free loopback port) and the offline engine
(bench/serve_offline.py, built from the same serve flags, answering over a pipe).

1. **Single-request latency** (server with ``--max-concurrency --latency-slots``, default 1, and no
   audit, whose forcing passes share the engine thread and would delay the next request): for each
   copy-heavy prompt (chat template applied once, sent as token ids to ``/v1/completions``), a
   non-streaming completion, a streaming one (time to first text) and the offline
   ``specpilot.engine.generate`` (time to first committed token), interleaved and alternating which side
   goes first, so the machine's load falls on both alike. Per prompt: median server latency over
   median offline latency. Every server response must equal the offline output (text and
   completion token count, finish reason).
2. **Load test** (server with ``--max-concurrency --load-slots``, default 4, and
   ``--audit-rate``, default 1.0): ``--clients`` threads send ``--requests`` requests cycling through
   non-streaming, streaming, and both with a stop string taken from the middle of the expected
   output; one streaming request with a longer budget hangs up after its first text. Every other
   response must arrive and equal its offline output (cut at the stop string); /metrics must then
   show exactly one cancellation, every completed response audited, and 0 audit mismatches.
   Reported: throughput (committed tokens served over the load's wall time), request latency
   p50/p99, the largest queue depth polled from /metrics (every 0.25 s). Both servers are warmed up first.

Writes ``serve_latency.json`` (and the two processes' logs) under ``--out``, prints a table last,
exits 1 if any check fails. Timings on a shared machine are not results; compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import openai

from specpilot.bench.prompts import load_prompt_set

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This checkout's sources first, so the children run the code under test."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"PYTHONPATH": path}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``specpilot serve`` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log: IO[str] = log.open("w")
        cmd = [sys.executable, "-m", "specpilot.cli", "serve", *flags, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT
        )

    def __enter__(self) -> Server:
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see its log")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server did not answer /health within 600 s")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def client(self) -> Client:
        c = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)
        return Client(c, c.models.list().data[0].id)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {
            ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln and not ln.startswith("#")
        }


class Offline:
    """bench/serve_offline.py: the same engine, one JSON request and answer per line."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self._log: IO[str] = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "serve_offline.py"), *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env(),
            cwd=ROOT,
        )
        self._read()  # {"ready": true} once the engine is built and warm

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the offline engine exited; see its log")
        return dict(json.loads(line))

    def call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self._log.close()


@dataclass(slots=True)
class Reply:
    text: str
    seconds: float
    ttft: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Client:
    """The official openai client and the model id the server reports."""

    api: openai.OpenAI
    model: str


def complete(c: Client, ids: list[int], max_tokens: int, stop: str | None = None) -> Reply:
    t0 = time.perf_counter()
    r = c.api.completions.create(
        model=c.model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stop=stop,
    )
    seconds = time.perf_counter() - t0
    usage = r.usage.completion_tokens if r.usage is not None else None
    return Reply(r.choices[0].text, seconds, None, usage, r.choices[0].finish_reason)


def stream(
    c: Client, ids: list[int], max_tokens: int, stop: str | None = None, hang_up: bool = False
) -> Reply:
    """A streaming completion; with ``hang_up`` the connection is closed after the first text."""
    t0 = time.perf_counter()
    parts: list[str] = []
    ttft, finish = None, None
    with c.api.completions.create(
        model=c.model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stop=stop,
        stream=True,
    ) as events:
        for chunk in events:
            text = chunk.choices[0].text
            if text and ttft is None:
                ttft = time.perf_counter() - t0
                if hang_up:
                    break
            parts.append(text)
            finish = chunk.choices[0].finish_reason or finish
    return Reply("".join(parts), time.perf_counter() - t0, ttft, None, finish)


def finish_of(stop_reason: str) -> str:
    return "stop" if stop_reason == "eos" else "length"


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


# ------------------------------------------------------------------ 1. single-request latency
def latency_phase(
    srv: Server, off: Offline, ids: list[list[int]], refs: list[dict], args: argparse.Namespace
) -> dict[str, Any]:
    c = srv.client()
    for p in ids:  # warm-up: first-call costs stay out of the timings
        complete(c, p, args.max_tokens)
    times: dict[str, list[list[float]]] = {
        k: [[] for _ in ids] for k in ("server", "server_ttft", "offline", "offline_ttft")
    }
    mismatches: list[str] = []
    for rep in range(args.repeats):
        for i, (p, ref) in enumerate(zip(ids, refs, strict=True)):
            sides = ["server", "offline"] if (rep + i) % 2 == 0 else ["offline", "server"]
            for side in sides:
                if side == "offline":
                    o = off.call(op="generate", prompt_ids=p, max_tokens=args.max_tokens)
                    if o["tokens"] != ref["tokens"]:
                        mismatches.append(f"prompt {i}: the offline engine is not deterministic")
                    times["offline"][i].append(o["seconds"])
                    times["offline_ttft"][i].append(o["ttft"])
                    continue
                full = complete(c, p, args.max_tokens)
                streamed = stream(c, p, args.max_tokens)
                want = (ref["text"], len(ref["tokens"]), finish_of(ref["stop_reason"]))
                if (full.text, full.completion_tokens, full.finish_reason) != want:
                    mismatches.append(f"prompt {i}: the server's completion differs from offline")
                if (streamed.text, streamed.finish_reason) != (want[0], want[2]):
                    mismatches.append(f"prompt {i}: the server's stream differs from offline")
                times["server"][i].append(full.seconds)
                times["server_ttft"][i].append(streamed.ttft or streamed.seconds)
    per_prompt = []
    for i in range(len(ids)):
        med = {k: statistics.median(v[i]) for k, v in times.items()}
        per_prompt.append(
            {
                "prompt_tokens": len(ids[i]),
                "completion_tokens": len(refs[i]["tokens"]),
                **{f"{k}_s": v for k, v in med.items()},
                "ratio": med["server"] / med["offline"],
                "ttft_ratio": med["server_ttft"] / med["offline_ttft"],
                "server_spread_s": max(times["server"][i]) - min(times["server"][i]),
                "offline_spread_s": max(times["offline"][i]) - min(times["offline"][i]),
            }
        )
    return {
        "per_prompt": per_prompt,
        "median_ratio": statistics.median(p["ratio"] for p in per_prompt),
        "median_ttft_ratio": statistics.median(p["ttft_ratio"] for p in per_prompt),
        "mismatches": mismatches,
    }


# ------------------------------------------------------------------ 2. load test
@dataclass(slots=True)
class LoadJob:
    index: int
    prompt: int
    kind: str  # "plain" | "stream" | "stop" | "stop-stream" | "cancel"
    stop: str | None
    expected: str | None
    """The offline output, cut at the stop string; None for the cancelled request."""


def plan_load(refs: list[dict], requests: int) -> list[LoadJob]:
    kinds = ["plain", "stream", "stop", "stop-stream"]
    jobs = []
    for j in range(requests):  # job requests // 2 is the cancelled one; the rest cycle the kinds
        i, n = j % len(refs), j - (j > requests // 2)
        kind = "cancel" if j == requests // 2 else kinds[n % len(kinds)]
        text, stop = refs[i]["text"], None
        if kind.startswith("stop"):
            mid = len(text) // 2
            stop = text[mid : mid + 3] or "\n\n"
            text = text[: text.find(stop)] if stop in text else text
        jobs.append(LoadJob(j, i, kind, stop, None if kind == "cancel" else text))
    return jobs


def wait_for_audits(srv: Server, before: dict[str, float], rate: float) -> dict[str, float]:
    """/metrics once the audits of the responses completed since ``before`` have run.

    Audits run on the engine thread between steps, after their responses went out. At rate 1
    every completed response is audited; below it the sample is random, so wait until the audit
    count has not moved for 2 s. At most 600 s."""
    deadline, last, quiet_since = time.time() + 600, -1.0, time.time()
    while True:
        m = srv.metrics()
        audited, done = (
            m.get(name, 0.0) - before.get(name, 0.0)
            for name in ("specpilot_audit_sequences_total", "specpilot_requests_total")
        )
        if audited != last:
            last, quiet_since = audited, time.time()
        settled = audited >= done if rate >= 1.0 else time.time() - quiet_since > 2.0
        if rate <= 0.0 or settled or time.time() > deadline:
            return m
        time.sleep(0.2)


def load_phase(
    srv: Server, ids: list[list[int]], refs: list[dict], args: argparse.Namespace
) -> dict[str, Any]:
    jobs = plan_load(refs, args.requests)
    cancel_budget = min(args.max_tokens * 4, args.context - max(len(p) for p in ids))
    warm = srv.client()
    for p in ids:  # warm-up, then its audits drain before the counters are read
        complete(warm, p, args.max_tokens)
    before = wait_for_audits(srv, {}, args.audit_rate)
    depth: list[float] = [0.0]
    polling = threading.Event()

    def poll() -> None:
        while not polling.wait(0.25):
            depth.append(srv.metrics().get("specpilot_queue_depth", 0.0))

    def one(job: LoadJob) -> dict[str, Any]:
        c, p = srv.client(), ids[job.prompt]
        try:
            if job.kind == "cancel":
                r = stream(c, p, cancel_budget, hang_up=True)
            elif job.kind in ("plain", "stop"):
                r = complete(c, p, args.max_tokens, job.stop)
            else:
                r = stream(c, p, args.max_tokens, job.stop)
        except Exception as e:  # a lost request is a finding, not a crash of the bench
            return {**asdict(job), "ok": False, "error": f"{type(e).__name__}: {e}"}
        ok = job.kind == "cancel" or r.text == job.expected
        return {**asdict(job), "ok": ok, "got": r.text, "seconds": r.seconds}

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as ex:
        results = list(ex.map(one, jobs))
    wall = time.perf_counter() - t0
    polling.set()
    poller.join()

    def delta(name: str, m: dict[str, float]) -> float:
        return m.get(name, 0.0) - before.get(name, 0.0)

    after = wait_for_audits(srv, before, args.audit_rate)
    latencies = [r["seconds"] for r in results if r["kind"] != "cancel" and "seconds" in r]
    return {
        "results": results,
        "wall_s": wall,
        "throughput_tok_s": delta("specpilot_generated_tokens_total", after) / wall,
        "latency_p50_s": percentile(latencies, 50) if latencies else None,
        "latency_p99_s": percentile(latencies, 99) if latencies else None,
        "max_queue_depth": max(depth),
        "arrived": sum(r["ok"] or "got" in r for r in results if r["kind"] != "cancel"),
        "expected_arrivals": sum(j.kind != "cancel" for j in jobs),
        "equal_to_offline": sum(r["ok"] for r in results if r["kind"] != "cancel"),
        "requests_completed": delta("specpilot_requests_total", after),
        "cancelled": delta("specpilot_cancelled_requests_total", after),
        "audited": delta("specpilot_audit_sequences_total", after),
        "audit_match_tokens": delta("specpilot_audit_match_tokens_total", after),
        "audit_near_tie_tokens": delta("specpilot_audit_near_tie_tokens_total", after),
        "audit_mismatch_tokens": delta("specpilot_audit_mismatch_tokens_total", after),
    }


# ------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON and the logs")
    p.add_argument("--quick", action="store_true", help="2 prompts, 2 clients, 6 short requests")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("-k", type=int, default=None, help="n-gram draft length (default: serve's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    p.add_argument("--prompts", type=int, default=8, help="copy-heavy prompts (default 8)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per prompt and side")
    p.add_argument("--latency-slots", type=int, default=1, help="server slots for phase 1")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--load-slots", type=int, default=4, help="server slots for phase 2")
    p.add_argument("--audit-rate", type=float, default=1.0, help="audited fraction in phase 2")
    p.add_argument("--context", type=int, default=2048, help="--max-context of both engines")
    args = p.parse_args(argv)
    if args.requests < 2 or args.clients < 1 or args.prompts < 1 or args.repeats < 1:
        p.error(
            "--requests must be at least 2 (one is cancelled); --clients, --prompts, --repeats 1"
        )
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 2, 32, 1
        args.clients, args.requests, args.load_slots = 2, 6, 2
    return args


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--target", args.target, "--device", "cpu", "--dtype", "fp32", "--drafter", "ngram"]
    flags += ["--threads", str(args.threads), "--max-context", str(args.context)]
    return flags + (["-k", str(args.k)] if args.k is not None else [])


def table(lat: dict[str, Any], load: dict[str, Any], checks: dict[str, bool]) -> str:
    rows = ["prompt  tokens  server_s  offline_s  ratio  ttft_server_s  ttft_offline_s"]
    for i, p in enumerate(lat["per_prompt"]):
        rows.append(
            f"{i:>6}  {p['completion_tokens']:>6}  {p['server_s']:>8.3f}  {p['offline_s']:>9.3f}"
            f"  {p['ratio']:>5.3f}  {p['server_ttft_s']:>13.3f}  {p['offline_ttft_s']:>14.3f}"
        )
    rows.append(
        f"median server/offline latency ratio {lat['median_ratio']:.3f} (issue 8: <= 1.10), "
        f"TTFT ratio {lat['median_ttft_ratio']:.3f}"
    )
    rows.append(
        f"load: {load['equal_to_offline']}/{load['expected_arrivals']} equal to offline, "
        f"{load['throughput_tok_s']:.1f} tok/s, p50 {load['latency_p50_s']:.2f} s, "
        f"p99 {load['latency_p99_s']:.2f} s, max queue depth {load['max_queue_depth']:.0f}, "
        f"audited {load['audited']:.0f} ({load['audit_mismatch_tokens']:.0f} mismatching tokens)"
    )
    rows += [f"check {name}: {'PASS' if ok else 'FAIL'}" for name, ok in checks.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    flags = engine_flags(args)
    prompts = load_prompt_set("copy-heavy", limit=args.prompts)
    t_start = time.perf_counter()
    off = Offline(flags, args.out / "offline.log")
    try:
        ids = [off.call(op="encode", messages=p.messages)["prompt_ids"] for p in prompts]
        refs = [off.call(op="generate", prompt_ids=p, max_tokens=args.max_tokens) for p in ids]
        lat_flags = [*flags, "--max-concurrency", str(args.latency_slots)]
        with Server(lat_flags, args.out / "server_latency.log") as srv:
            lat = latency_phase(srv, off, ids, refs, args)
    finally:
        off.close()
    load_flags = [*flags, "--max-concurrency", str(args.load_slots)]
    load_flags += ["--audit-rate", str(args.audit_rate)]
    with Server(load_flags, args.out / "server_load.log") as srv:
        load = load_phase(srv, ids, refs, args)
    checks = {
        "latency_outputs_equal_offline": not lat["mismatches"],
        "load_every_response_arrived": load["arrived"] == load["expected_arrivals"],
        "load_outputs_equal_offline": load["equal_to_offline"] == load["expected_arrivals"],
        "load_cancel_registered": load["cancelled"] == 1
        and load["requests_completed"] == load["expected_arrivals"],
    }
    if args.audit_rate > 0:  # with the audit off there is nothing to check
        checks["audit_zero_mismatches"] = load["audit_mismatch_tokens"] == 0 and load["audited"] > 0
    if args.audit_rate >= 1.0:
        checks["audit_every_completed_response"] = load["audited"] == load["requests_completed"]
    report = {
        "bench": "serve_latency",
        "machine": "cpu",
        "note": "real SmolLM2 acceptance (not simulated) on copy-heavy prompts; CPU timings",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompt_ids": [p.id for p in prompts],
        "latency": lat,
        "load": load,
        "checks": checks,
        "all_checks_pass": all(checks.values()),
        "wall_s": time.perf_counter() - t_start,
    }
    (args.out / "serve_latency.json").write_text(json.dumps(report, indent=2))
    print(table(lat, load, checks))
    return 0 if report["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
