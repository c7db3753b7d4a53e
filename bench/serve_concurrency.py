"""Aggregate throughput of ``specpilot serve`` at several concurrencies, through the official
openai client, with every response checked.

    PYTHONPATH=src python3 bench/serve_concurrency.py --out DIR -- --target DIR --device cuda \\
        --dtype bf16 --drafter none

Everything after ``--`` goes to ``specpilot serve`` (the real command, started as a subprocess on
loopback, with ``--audit-rate 1``: the server token-forces every response it sends, in the
background between scheduler steps; each round waits until the audits of the previous ones are
done, so that no audit runs inside a timed round). Per
concurrency c: one untimed round of c requests (graph capture and allocator growth stay out),
then a timed round of c requests sent at once, each a different prompt (token ids, so nothing
depends on tokenization) asking for ``--max-tokens`` tokens; aggregate tok/s = completion tokens
of the round / its wall time. Then the same prompts run offline, one at a time, through the same
composition root, and every served text is compared with its offline text. Writes
``DIR/serve_concurrency.json``; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

AUDITED = "specpilot_audit_sequences"
"""The server's count of responses it has token-forced in the background."""


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"the server did not answer /health within {timeout:.0f}s")


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    return float("nan")


ENGINE_METRICS = (
    "specpilot_engine_step_seconds",
    "specpilot_engine_host_seconds",
    "specpilot_step_rows_sum",
    "specpilot_step_rows_count",
)
"""Where the engine thread's time went in a round (server metrics, read before and after)."""


def _round(client: Any, model: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Send every prompt at once (one thread each); wall time of the whole round."""
    out: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        r = client.completions.create(
            model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0
        )
        out[i] = (r.choices[0].text, r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in out)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "texts": [t for t, _ in out]}


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="copy-heavy")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    from openai import OpenAI

    from specpilot.bench.prompts import load_prompt_set
    from specpilot.cli import build_parser
    from specpilot.commands.common import build_deployment
    from specpilot.engine import generate

    ns = build_parser().parse_args(["serve", *serve_args])
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "specpilot.cli", "serve", *serve_args]
    cmd += ["--port", str(args.port), "--max-concurrency", str(max(levels)), "--audit-rate", "1"]
    log = open(args.out / "server.log", "wb")  # noqa: SIM115 (lives as long as the server)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    results: dict[str, Any] = {"serve_args": serve_args, "levels": {}}
    try:
        _wait_health(url, proc, args.ready_timeout)
        results["ready_s"] = time.perf_counter() - t0
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        results["model_card"] = client.models.list().data[0].model_dump()
        from specpilot.loading import load_tokenizer, resolve_model

        tok = load_tokenizer(resolve_model(ns.target))
        sets = load_prompt_set(args.prompts)
        prompts = [tok.apply_chat_template(p.messages) for p in sets]
        sent = 0

        def drained() -> None:  # the server audits in the background: never while timing
            t_wait = time.perf_counter()
            while _metric(url, AUDITED) < sent and time.perf_counter() - t_wait < 300:
                time.sleep(0.5)

        for c in levels:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            _round(client, model, batch, args.max_tokens)  # warm-up
            sent += c
            drained()
            before = {m: _metric(url, m) for m in ENGINE_METRICS}
            r = _round(client, model, batch, args.max_tokens)
            after = {m: _metric(url, m) for m in ENGINE_METRICS}
            d = {m.removeprefix("specpilot_"): after[m] - before[m] for m in ENGINE_METRICS}
            steps = max(d["step_rows_count"], 1.0)
            r["engine"] = {
                **d,
                "step_share": d["engine_step_seconds"] / r["wall_s"],
                "host_share": d["engine_host_seconds"] / r["wall_s"],
                "rows_per_step": d["step_rows_sum"] / steps,
                "ms_per_step": 1e3 * d["engine_step_seconds"] / steps,
            }
            sent += c
            drained()
            results["levels"][str(c)] = r
            print(f"[serve] concurrency {c}: {r['tok_s']:.1f} tok/s aggregate", flush=True)
        names = {
            "audited": AUDITED,
            "match": "specpilot_audit_match_tokens",
            "near_tie": "specpilot_audit_near_tie_tokens",
            "mismatch": "specpilot_audit_mismatch_tokens",
        }
        t_audit = time.perf_counter()
        while (
            _metric(url, names["audited"]) < 2 * sum(levels) and time.perf_counter() - t_audit < 120
        ):
            time.sleep(1.0)  # the audits run in the background, between scheduler steps
        results["audit"] = {k: _metric(url, v) for k, v in names.items()}
        results["responses"] = 2 * sum(levels)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    # Offline: the same prompts one at a time through the same composition root.
    dep = build_deployment(ns)
    engine = dep.build.engine()
    offline: dict[int, str] = {}
    for i in range(min(len(prompts), max(levels))):
        res = generate(engine, [prompts[i]], args.max_tokens, dep.eos_ids)[0]
        offline[i] = dep.target.tokenizer.decode(res.tokens, skip_special_tokens=True)  # type: ignore[union-attr]
    for r in results["levels"].values():
        same = [t == offline[i % len(prompts)] for i, t in enumerate(r["texts"])]
        r["equal_to_offline"] = f"{sum(same)}/{len(same)}"
        del r["texts"]
    single = results["levels"].get("1", {}).get("tok_s")
    for r in results["levels"].values():
        r["over_single"] = r["tok_s"] / single if single else None
    (args.out / "serve_concurrency.json").write_text(json.dumps(results, indent=1))
    print(
        "concurrency  aggregate tok/s  x single  equal to offline  in steps  host  rows/step  ms/step"
    )
    for c, r in results["levels"].items():
        over, e = r["over_single"], r["engine"]
        print(
            f"{c:>11}  {r['tok_s']:15.1f}  {over:8.2f}  {r['equal_to_offline']:>16}  "
            f"{e['step_share']:8.0%}  {e['host_share']:4.0%}  {e['rows_per_step']:9.1f}  "
            f"{e['ms_per_step']:7.2f}"
        )
    print(
        f"audit (the server token-forced {results['audit']['audited']:.0f} of "
        f"{results['responses']} responses): {results['audit']}"
    )


if __name__ == "__main__":
    main()
