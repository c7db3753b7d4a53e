"""Where a served request's time to first token goes (issue 28): the server's own scheduler.

    PYTHONPATH=src python3 bench/ttft_trace_gpu.py --out DIR -- <serve flags>

Builds the engine thread's scheduler exactly as ``specpilot serve`` does (``build_worker``, the
same flags), warms it up, then per repeat submits one chat prompt (mt-bench first turns, the
served chat template) to an idle scheduler and times, with the device synchronized: the prefill
forward (``Engine.prefill``), the first decode step, and the whole first scheduler step. Last,
a torch profile of one prefill: the ops by device time and by host time. Writes
``DIR/ttft_trace.json`` and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from specpilot.bench.prompts import load_prompt_set
from specpilot.cli import build_parser
from specpilot.commands.serve import build_worker
from specpilot.engine import Request
from specpilot.models import forward
from specpilot.models.forward import SDPA_BACKENDS


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, sink: list[float]) -> Any:
    """``fn`` wrapped: each call's seconds (device synchronized on both sides) go to ``sink``."""

    def call(*a: Any, **kw: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        sink.append(time.perf_counter() - t0)
        return out

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the serve flags")
    a = ap.parse_args()
    flags = a.serve[1:] if a.serve[:1] == ["--"] else a.serve
    worker, engine_desc = build_worker(build_parser().parse_args(["serve", *flags]))
    sched, tok = worker.scheduler, worker.tokenizer
    engine = sched.engine
    chats = [tok.apply_chat_template(p.messages) for p in load_prompt_set("mt-bench", a.repeats)]
    # A/B of SDPA's eager backends: each prefill a prompt length seen for the first time (the
    # cost in question is per new shape), the two arms alternating over lengths 40, 41, ...
    longest = max(chats, key=len)
    arms = {"cudnn-too": [*SDPA_BACKENDS, SDPBackend.CUDNN_ATTENTION], "default": None}
    times: dict[str, list[float]] = {}
    real_prefill, real_step = engine.prefill, engine.step
    warm = [chats[0], chats[1]]
    for i, (arm, p) in enumerate(
        [("warm-up", c) for c in warm]
        + [(arm, longest[: 40 + 2 * r + j]) for r in range(a.repeats) for j, arm in enumerate(arms)]
        + [("mt-bench", c) for c in chats]
    ):
        backends = arms.get(arm) or list(forward.SDPA_BACKENDS)
        sink = times.setdefault(arm, [])
        sched.submit(Request(f"r{i}", tuple(p), 16, frozenset(worker.eos_ids)))
        engine.prefill = timed(real_prefill, times.setdefault(f"{arm} prefill", []))  # type: ignore[method-assign]
        engine.step = timed(real_step, times.setdefault(f"{arm} decode", []))  # type: ignore[method-assign]
        saved, forward.SDPA_BACKENDS = forward.SDPA_BACKENDS, backends
        timed(sched.step, sink)()
        forward.SDPA_BACKENDS = saved
        engine.prefill, engine.step = real_prefill, real_step  # type: ignore[method-assign]
        while sched.has_work:
            sched.step()
    prompts = chats
    lens = [len(p) for p in prompts]
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sched.submit(Request("prof", tuple(prompts[0]), 1, frozenset()))
    with profile(activities=acts) as prof:
        sched.step()
        _sync()
    while sched.has_work:
        sched.step()
    by_dev = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    by_host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    ms = {k: [round(1e3 * v, 2) for v in vs] for k, vs in times.items()}
    result = {"engine": engine_desc, "prompt_tokens": lens, "ms": ms}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ttft_trace.json").write_text(json.dumps(result, indent=1, default=str))
    (a.out / "profile.txt").write_text(by_dev + "\n\n" + by_host)
    print(by_dev[-4000:])
    print(by_host[-4000:])
    print(f"prompt tokens {min(lens)}-{max(lens)}; runner {engine_desc['runner']}")
    for k, vs in ms.items():
        if k == "warm-up" or not vs:
            continue
        print(f"{k:>18}: median {statistics.median(vs):7.2f} ms  ({min(vs):.2f}-{max(vs):.2f})")


if __name__ == "__main__":
    main()
