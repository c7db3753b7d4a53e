"""llama.cpp's AR beside ours on the same GGUF, prompts and threads, in one process (issue 27).

    pip install llama-cpp-python      # in a venv of its own or beside ours: the benchmark only
    PYTHONPATH=src python3 bench/llamacpp_peer.py --threads 2 --out DIR

llama-cpp-python (built from its registry sdist on this machine) is never a dependency of the
product: this script imports it only here. Ours is the engine the commands build
(``engine/build.build_engine``) from ``--engine`` (an engine config JSON, e.g. the tune's
``runs/tune/tuned.json``) or, by default, plain AR with gguf-blocks; fp32 activations.

Both arms get the same prompt token ids (the target's chat template, our tokenizer), greedy, a
fixed number of new tokens (no stop), and are timed in ``--rounds`` interleaved rounds (arm
order alternating) after a warm-up, prefill included in both: tok/s per round, medians with the
lowest and highest round, and ours over llama.cpp per round. llama.cpp rounds the activations to
8 bits inside its dot products, so its greedy tokens may part from the fp32 ones; the share of
tokens equal to ours is reported beside the speed, not as a check. JSON to ``DIR/peer.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.prompts import load_prompt_set
from specpilot.engine import generate
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.loading.fetch import fetch_model
from specpilot.timing import spread


def our_config(args: argparse.Namespace) -> EngineConfig:
    if args.engine is not None:
        return EngineConfig.load(Path(args.engine))
    dep = DeploymentSpec(target=args.target, drafter="none", dtype="fp32", device="cpu")
    return EngineConfig(deployment=dep, k=0, mechanisms={"gguf-blocks": {"threads": 0}})


def llama_arm(path: Path, threads: int, n_ctx: int) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: pip install llama-cpp-python (the benchmark only)"
        ) from None
    return Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
        n_batch=512, verbose=False, logits_all=False,
    )  # fmt: skip


def llama_greedy(llm: Any, ids: list[int], n: int) -> list[int]:
    llm.reset()
    out: list[int] = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", default="smollm2-135m", help="a known GGUF model or a .gguf file")
    p.add_argument(
        "--engine", default=None, help="our engine config JSON (default: AR + gguf-blocks)"
    )
    p.add_argument("--prompts", default="copy-heavy")
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/peer"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = our_config(args)
    gguf = fetch_model(cfg.deployment.target) if not cfg.deployment.target.endswith(".gguf") else Path(cfg.deployment.target)  # fmt: skip
    build = build_engine(cfg, max_context=2048)
    engine, tok = build.engine(), build.target.tokenizer
    assert tok is not None
    prompts = [
        tok.apply_chat_template(q.messages) for q in load_prompt_set(args.prompts, args.limit)
    ]
    llm = llama_arm(gguf, args.threads, 2048)
    n = args.max_new_tokens

    def ours() -> list[list[int]]:
        return [generate(engine, [ids], n)[0].tokens for ids in prompts]

    def theirs() -> list[list[int]]:
        return [llama_greedy(llm, ids, n) for ids in prompts]

    arms = {"ours": ours, "llama.cpp": theirs}
    tokens = {name: fn() for name, fn in arms.items()}  # warm-up (numba compiles, caches fill)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            t0 = time.perf_counter()
            tokens[name] = arms[name]()
            rates[name].append(sum(len(t) for t in tokens[name]) / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()))
    ratio = [a / b for a, b in zip(rates["ours"], rates["llama.cpp"], strict=True)]
    pairs = zip(tokens["ours"], tokens["llama.cpp"], strict=True)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=False))
    total = sum(len(x) for x in tokens["ours"])
    result = {
        "target": str(gguf), "engine": json.loads(cfg.to_json()), "prompts": args.prompts, "limit": args.limit,
        "max_new_tokens": n, "threads": args.threads, "rounds": args.rounds,
        "tok_s": {k: spread(v) for k, v in rates.items()}, "ours_over_llamacpp": spread(ratio),
        "tokens_equal": f"{same}/{total}", "notes": build.notes,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer.json").write_text(json.dumps(result, indent=2))
    for k, v in rates.items():
        print(f"{k:10s} {statistics.median(v):7.1f} tok/s ({min(v):.1f}-{max(v):.1f})")
    r = result["ours_over_llamacpp"]
    print(f"ours over llama.cpp: {r['median']:.2f}x ({r['lo']:.2f}-{r['hi']:.2f}); greedy tokens "
          f"equal to ours: {same}/{total}; {args.threads} threads, {len(prompts)} prompts x {n}")  # fmt: skip


if __name__ == "__main__":
    main()
