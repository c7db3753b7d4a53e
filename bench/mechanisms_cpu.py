"""Issue 6 on the CPU with SmolLM2-135M (fp32) and real prompts: tree vs chain, exact-argmax head.

    PYTHONPATH=src python3 bench/mechanisms_cpu.py --out DIR [--prompts 4] [--max-new 64]
    PYTHONPATH=src python3 bench/mechanisms_cpu.py --out DIR --device cuda --skip verify lm_head

(``--device cuda`` runs the same real-acceptance comparison on a GPU, eager engine.)

1. Tree vs chain at equal verify budget (1 + N tokens per target forward): n-gram chain k = N vs an
   n-gram tree of N nodes, and a draft model (SmolLM2's first --draft-layers layers + its head, an early-exit
   drafter that needs no training) chain k = N vs a tree of N nodes. Per set (copy-heavy, mt-bench):
   τ (committed tokens per verify, bonus included), tok/s, and equality with AR (must be 100%).
2. Verify cost vs tokens: one target forward of T tokens after a real prompt, chain vs tree mask.
3. LM head: stock (the [in, out] GEMV copy for 1 row, F.linear for more) vs the certified head
   (fp16 copy), on real final hidden states, with the certified fraction.
The CPU is shared with other work: every time is a median, and the spread is reported.
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
from specpilot.bench.records import git_rev
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.early_exit import early_exit_model
from specpilot.drafters.tree import TreeShape
from specpilot.engine import SpecEngine
from specpilot.mechanisms.exact_argmax import ExactArgmaxHead
from specpilot.mechanisms.tree_verify import TreeStrategy
from specpilot.models.transformer import Transformer, project
from specpilot.runtime import load_model


def run_set(target: Any, tok: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [tok.apply_chat_template(p.messages) for p in load_prompt_set(name, args.prompts)]
    eos = list(target.cfg.eos_token_ids)
    draft = early_exit_model(target, args.draft_layers)
    n = args.nodes
    configs: dict[str, Any] = {
        "ar": lambda: SpecEngine(target),
        f"ngram-chain-k{n}": lambda: SpecEngine(target, NgramDrafter(k=n, max_n=3)),
        **{
            f"ngram-tree-n{n}-d{d}w{w}": (
                lambda d=d, w=w: SpecEngine(
                    target,
                    NgramDrafter(k=n, max_n=3),
                    strategy=TreeStrategy(
                        TreeShape.uniform(depth=d, width=w, max_nodes=n, branch=w)
                    ),
                )
            )
            for d, w in args.ngram_trees
        },
        f"draft{args.draft_layers}L-chain-k{args.draft_k}": lambda: SpecEngine(
            target, DraftModelDrafter(draft, k=args.draft_k)
        ),
        f"draft{args.draft_layers}L-tree-n{n}": lambda: SpecEngine(
            target,
            DraftModelDrafter(draft, k=args.draft_k),
            strategy=TreeStrategy(
                TreeShape.uniform(depth=args.draft_k, width=3, max_nodes=n, branch=2)
            ),
        ),
    }
    out: dict[str, Any] = {}
    ar_tokens: list[list[int]] = []
    for cname, make in configs.items():
        rates, taus, same = [], [], 0
        for i, p in enumerate(prompts):
            engine = make()
            engine.generate([p], 4, eos)  # warm-up (CUDA kernels, allocator)
            t0 = time.perf_counter()
            res = engine.generate([p], args.max_new, eos)[0]
            dt = time.perf_counter() - t0
            rates.append(len(res.tokens) / dt)
            taus.append(res.stats.mean_accepted_len)
            if cname == "ar":
                ar_tokens.append(res.tokens)
            same += res.tokens == ar_tokens[i]
        out[cname] = {
            "tok_s_median": statistics.median(rates),
            "tok_s_min": min(rates),
            "tok_s_max": max(rates),
            "tau_median": statistics.median(taus),
            "tau_mean": statistics.fmean(taus),
            "equal_to_ar": f"{same}/{len(prompts)}",
        }
        print(name, cname, json.dumps(out[cname]), flush=True)
    return out


def verify_cost(target: Transformer, tok: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompt = tok.apply_chat_template(load_prompt_set("mt-bench", 1)[0].messages)
    cache = target.allocate_cache(1, len(prompt) + 80)
    with torch.inference_mode():
        target.forward_argmax(torch.tensor([prompt]), cache)
    cache.commit(0, len(prompt))
    recs = []
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 4, 8, 16, 24, 32):
        toks = torch.randint(0, target.cfg.vocab_size, (1, t), generator=gen)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        depth, mask = [0] * t, torch.eye(t, dtype=torch.bool)
        for i in range(1, t):
            depth[i] = depth[parents[i]] + 1
            mask[i] |= mask[parents[i]]
        pos = torch.tensor([[len(prompt) + d for d in depth]])

        def chain(toks: torch.Tensor = toks) -> None:
            target.forward_argmax(toks, cache)

        def tree(
            toks: torch.Tensor = toks, pos: torch.Tensor = pos, m: torch.Tensor = mask
        ) -> None:
            target.forward_argmax(toks, cache, positions=pos, tree_mask=m[None])

        with torch.inference_mode():
            recs.append({"tokens": t, "chain_ms": med(chain, 9), "tree_ms": med(tree, 9)})
        print("verify", recs[-1], flush=True)
    return recs


def med(fn: Any, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def lm_head(target: Transformer, tok: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = [tok.apply_chat_template(p.messages) for p in load_prompt_set("mt-bench", 8)]
    hidden = []
    with torch.inference_mode():
        for p in prompts:
            cache = target.allocate_cache(1, len(p) + 1)
            x, _ = target._final_hidden(torch.tensor([p]), cache, None, None, None, ())
            hidden.append(x[0])  # [T, H] real final-normed states
    states = torch.cat(hidden)  # [N, H]
    head = ExactArgmaxHead(target, fmt="fp16")
    recs = []
    for rows in (1, 9, 17):
        xs = [states[i : i + rows][None] for i in range(0, states.shape[0] - rows, rows)][:40]
        stock_t, exact_t = [], []
        before = (head.stats.rows, head.stats.certified_rows)
        mism = 0
        with torch.inference_mode():
            for x in xs:
                want = project(x, target.lm_head, None, target.lm_head_in_out).argmax(-1)
                mism += int((head(x) != want).sum())
                stock_t.append(
                    med(
                        lambda x=x: project(x, target.lm_head, None, target.lm_head_in_out).argmax(
                            -1
                        ),
                        3,
                    )
                )
                exact_t.append(med(lambda x=x: head(x), 3))
        n = head.stats.rows - before[0]
        recs.append(
            {
                "rows": rows,
                "calls": len(xs),
                "stock_ms": statistics.median(stock_t),
                "exact_ms": statistics.median(exact_t),
                "certified_frac": (head.stats.certified_rows - before[1]) / max(1, n),
                "mismatches": mism,
            }
        )
        print("lm_head", recs[-1], flush=True)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=8, help="verify budget N (drafted tokens)")
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=16, help="early-exit drafter depth")
    ap.add_argument(
        "--ngram-trees",
        type=lambda v: [tuple(int(a) for a in p.split("x")) for p in v.split(",")],
        default=[(8, 1), (6, 2), (4, 3)],
        help="n-gram tree shapes as depthxwidth,... (all with --nodes nodes)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (eager engine on the GPU)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--skip", nargs="*", default=[], help="sections to skip: spec verify lm_head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    loaded = load_model("smollm2-135m", dtype=dtype, device=args.device)
    target, tok = loaded.model, loaded.tokenizer
    out: dict[str, Any] = {
        "commit": git_rev(),
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "max_new": args.max_new,
        "note": "shared 2-core CPU: medians over prompts / repeats",
    }
    path = args.out / "mechanisms_cpu.json"
    if "lm_head" not in args.skip:
        out["lm_head"] = lm_head(target, tok, args)
        path.write_text(json.dumps(out, indent=2))
    if "verify" not in args.skip:
        out["verify"] = verify_cost(target, tok, args)
        path.write_text(json.dumps(out, indent=2))
    if "spec" not in args.skip:
        for name in ("copy-heavy", "mt-bench"):
            out[name] = run_set(target, tok, name, args)
            path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
