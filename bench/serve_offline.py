"""The offline side of bench/serve_latency.py: the same engine in its own process, over a pipe.

    python3 bench/serve_offline.py <serve engine flags>     # e.g. --target smollm2-135m --threads 1

It builds the engine from exactly the flags the server gets (``specpilot serve``'s parser, so the
config cannot drift), warms it up, then answers one JSON request per stdin line with one JSON line:

- ``{"op": "encode", "messages": [...]}`` -> ``{"prompt_ids": [...]}`` (the chat template);
- ``{"op": "generate", "prompt_ids": [...], "max_tokens": N}`` -> ``{"tokens", "text",
  "stop_reason", "seconds", "ttft"}``: one single-request ``specpilot.engine.generate`` on the
  composition root's engine, timed in process (what a user of the offline engine waits for:
  generate plus the final decode), and the time to its first committed token.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from specpilot.bench.runner import synchronize, warm_up
from specpilot.cli import build_parser
from specpilot.commands.common import Deployment, build_deployment
from specpilot.engine import Engine, generate


def timed(dep: Deployment, engine: Engine, prompt_ids: list[int], max_tokens: int) -> dict:
    tok = dep.target.tokenizer
    assert tok is not None
    first: list[float] = []

    def on_commit(_row: int, tokens: list[int]) -> None:
        if tokens and not first:
            first.append(time.perf_counter())

    synchronize(engine.target.device)
    t0 = time.perf_counter()
    res = generate(engine, [prompt_ids], max_tokens, dep.eos_ids, on_commit)[0]
    synchronize(engine.target.device)
    text = tok.decode(res.tokens, skip_special_tokens=True)
    seconds = time.perf_counter() - t0
    return {
        "tokens": list(res.tokens),
        "text": text,
        "stop_reason": res.stop_reason,
        "seconds": seconds,
        "ttft": (first[0] - t0) if first else seconds,
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(["serve", *argv])
    dep = build_deployment(args)
    tok = dep.target.tokenizer
    assert tok is not None, "the offline reference needs the target's tokenizer"
    engine = dep.build.engine()
    warm_up([engine], [("warm", tok.encode("Hello, world. Hello, world."))], 8, dep.eos_ids)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req: dict[str, Any] = json.loads(line)
        if req["op"] == "encode":
            out: dict[str, Any] = {"prompt_ids": tok.apply_chat_template(req["messages"])}
        else:
            out = timed(dep, engine, req["prompt_ids"], req["max_tokens"])
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
