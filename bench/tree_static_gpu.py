"""Issues 6 + 8 on the GPU: static tree verify in CUDA graphs, chain vs trees, ragged trees.

    PYTHONPATH=src python3 bench/tree_static_gpu.py --out DIR            # H200, < 4 minutes
    PYTHONPATH=src python3 bench/tree_static_gpu.py --out DIR --tiny     # CPU smoke run (fp32)

Llama-3-8B shape with seeded random bf16 weights (``specpilot.synthetic``), the DFlash-like block
drafter ``dflash-b16`` (real compute) under **simulated acceptance**: the chain profile (default
``tau=5,block=16``) on the first branch, and on a first-branch miss the true token on the second
branch with probability ``p_sibling`` (default 0.5; ``drafters/simulated.py``). Verification is
real. All engines are the static engine with CUDA graphs; candidates and baselines share the
process and the weights.

* (a) verify time vs nodes T (batch 1; T = 8..64): the stock chain verify forward of T + 1
  tokens (causal, padded) vs the tree verify of a T-node tree (packed, tree mask), graph replays,
  median of 3 × ``iters``; plus, for T <= k, the chain of T through the tree path (the tree
  machinery's own overhead: packing, tree mask, depth positions);
* (b) batch 1: AR; stock chain k = 15; trees of 16, 24, 32 nodes (depth 15): τ, decode tok/s,
  speedup, token equality with AR (rows that differ are token-forced);
* (c) batch 16 with per-row profiles τ = 2, 4, 6.5 (heterogeneous requests): AR; stock chain
  (16 verify tokens per row); a uniform 15-node tree (16 per row); ragged trees (chain 11 for
  confident rows, a 27-node tree for the least confident, 16 per row on average) — equal total
  verify tokens.

Each engine runs once to warm up (graph capture) and once timed. JSON goes to
``DIR/tree_static_gpu.json`` after every part; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from specpilot.bench.static_runs import (
    add_simulation_options,
    check_rows,
    run_header,
    run_twice,
    simulation_label,
    synthetic_deployment,
)
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine.static_engine import StaticEngine
from specpilot.engine.tree_policy import FixedTree, RaggedTrees, TreePolicy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (smoke test)")
    ap.add_argument("--profile", default=None, help="chain profile (default tau=5,block=16)")
    ap.add_argument("--p-sibling", type=float, default=0.5)
    ap.add_argument("--taus", default=None, help="per-row τ cycle of part c (default 2,4,6.5)")
    ap.add_argument("--nodes", default=None, help="part a node counts (default 8,16,24,32,48,64)")
    ap.add_argument("--batch", type=int, default=None, help="part c batch (default 16)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="replays per verify-cost point")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip part c after this")
    ap.add_argument("--seed", type=int, default=0)
    add_simulation_options(ap)
    args = ap.parse_args(argv)
    t = args.tiny
    args.profile = args.profile or ("tau=3,block=9" if t else "tau=5,block=16")
    args.taus = args.taus or ("1.5,3,5" if t else "2,4,6.5")
    args.nodes = args.nodes or ("4,8,12" if t else "8,16,24,32,48,64")
    args.batch = args.batch or (4 if t else 16)
    args.prompt_len = args.prompt_len or (10 if t else 128)
    args.new_tokens = args.new_tokens or (24 if t else 256)
    args.iters = args.iters or (2 if t else 20)
    return args


def tree_of(nodes: int, depth: int) -> StaticTree:
    """A static tree of ``nodes`` nodes at most ``depth`` deep (widths grow with the budget)."""
    depth = min(depth, nodes)
    width = max(2, -(-2 * nodes // depth))
    return build_static_tree(TreeShape.uniform(depth, width, nodes, branch=2))


def spec_row(
    part: str,
    name: str,
    engine: StaticEngine,
    sim: SimulatedAcceptance,
    prompts: list[list[int]],
    ref: list[list[int]],
    ar_tok_s: float,
    n: int,
    verify_tokens: float,
    steady: bool = False,
) -> dict[str, Any]:
    res, tok_s = run_twice(engine, prompts, n, steady)
    cycles = max(engine.times.cycles, 1)
    row_cycles = sum(r.stats.cycles for r in res)
    return {
        "part": part,
        "batch": len(prompts),
        "variant": name,
        "tok_s": tok_s,
        "speedup": tok_s / ar_tok_s,
        "tau": sum(r.stats.committed for r in res) / max(row_cycles, 1),
        "verify_tokens_per_row": verify_tokens,
        "verify_ms": 1e3 * engine.times.verify / cycles,
        "cycle_ms": 1e3 * engine.times.wall / cycles,
        "cycles": cycles,
        "oracle_divergences": sim.divergences,
        "graph_captures": engine.runner.captures,
        **check_rows(engine.target, prompts, ref, [r.tokens for r in res]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dep = synthetic_deployment(args.tiny, args.seed, args.peaked, max_positions=2048)
    target, block, dev = dep.target, dep.block, dep.target.device
    k = block.k
    profile = AcceptanceProfile.parse(args.profile)
    label = (
        f"{dep.label()} · {SIM_LABEL} "
        f"(chain profile {args.profile}, p_sibling {args.p_sibling:g})" + simulation_label(args)
    )
    result: dict[str, Any] = {
        **run_header(label, args, dev),
        "verify_cost": [],
        "runs": [],
    }
    out_file = args.out / "tree_static_gpu.json"

    def save() -> None:
        result["total_s"] = time.perf_counter() - t_start
        out_file.write_text(json.dumps(result, indent=1) + "\n")

    def sim_for(seed: int, row_profiles: tuple[AcceptanceProfile, ...] = ()) -> SimulatedAcceptance:
        return SimulatedAcceptance(
            block, profile, seed=seed, row_profiles=row_profiles, p_sibling=args.p_sibling
        )

    rng = random.Random(args.seed)
    vocab = target.cfg.vocab_size
    one = [[rng.randrange(vocab) for _ in range(args.prompt_len)]]

    # ---------------------------------------------------------------- (a) verify cost vs nodes
    for nodes in (int(x) for x in args.nodes.split(",")):
        shapes = [("tree", tree_of(nodes, k))]
        if nodes <= k:  # the same token count as a chain, through the tree path
            shapes.append(("tree-path chain", StaticTree.chain(nodes)))
        for kind, shape_t in shapes:
            eng = StaticEngine(target, sim_for(args.seed), tree_policy=FixedTree(shape_t))
            eng.prefill(one, 64)
            row: dict[str, Any] = {"nodes": shape_t.nodes, "kind": kind, "shape": shape_t.label()}
            row["verify_ms"] = 1e3 * eng.time_tree_verify(args.iters)
            if kind == "tree":  # the stock padded chain verify of the same token count
                row["stock_chain_ms"] = 1e3 * eng.time_forward(nodes + 1, args.iters)
            result["verify_cost"].append(row)
            print(f"[tree_static] verify cost {row}", flush=True)
            del eng
    save()

    # ---------------------------------------------------------------- (b) batch 1
    ar = StaticEngine(target)
    ar_res, ar_tok_s = run_twice(ar, one, args.new_tokens, args.steady)
    ref = [r.tokens for r in ar_res]
    result["runs"].append({"part": "b", "batch": 1, "variant": "ar", "tok_s": ar_tok_s})
    print(f"[tree_static] b=1 ar {ar_tok_s:.1f} tok/s", flush=True)
    sizes = [k + 1, (3 * (k + 1)) // 2, 2 * (k + 1)]  # 16, 24, 32 at k = 15
    b1: list[tuple[str, TreePolicy | None, float]] = [
        (f"stock chain{k}", None, k + 1.0),
        (f"tree-path chain{k}", FixedTree(StaticTree.chain(k)), k + 1.0),
    ]
    b1 += [(tree_of(n, k).label(), FixedTree(tree_of(n, k)), n + 1.0) for n in sizes]
    for name, policy, vt in b1:
        sim = sim_for(args.seed)
        eng = StaticEngine(target, sim, profile=True, tree_policy=policy)
        row = spec_row("b", name, eng, sim, one, ref, ar_tok_s, args.new_tokens, vt, args.steady)
        result["runs"].append(row)
        print(f"[tree_static] b=1 {name} {row}", flush=True)
        del eng, sim
    save()

    # ---------------------------------------------------------------- (c) batch B, ragged
    if time.perf_counter() - t_start > args.budget_s:
        print("[tree_static] budget spent: part c skipped", flush=True)
        result["skipped"] = ["c"]
    else:
        bsz = args.batch
        taus = [float(x) for x in args.taus.split(",")]
        rows = tuple(AcceptanceProfile.constant(tau, k) for tau in taus)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(bsz)]
        n_c = max(args.new_tokens // 2, 8)
        ar = StaticEngine(target)
        ar_res, ar_tok_s = run_twice(ar, prompts, n_c, args.steady)
        ref = [r.tokens for r in ar_res]
        result["runs"].append({"part": "c", "batch": bsz, "variant": "ar", "tok_s": ar_tok_s})
        confident = StaticTree.chain(max(1, (3 * k) // 4))  # chain 11 at k = 15
        # a quarter of the rows can afford it at k + 1 tokens per row on average
        wide = tree_of(confident.nodes + 4 * (k - confident.nodes), k)  # 27 nodes at k = 15
        bc: list[tuple[str, TreePolicy | None, float]] = [
            (f"stock chain{k}", None, k + 1.0),
            (f"uniform {tree_of(k, k).label()}", FixedTree(tree_of(k, k)), k + 1.0),
            (
                f"ragged chain{confident.nodes}/{wide.label()}",
                RaggedTrees(confident, wide, budget=k + 1.0),
                k + 1.0,
            ),
        ]
        for name, policy, vt in bc:
            sim = sim_for(args.seed, rows)
            eng = StaticEngine(target, sim, profile=True, tree_policy=policy)
            row = spec_row("c", name, eng, sim, prompts, ref, ar_tok_s, n_c, vt, args.steady)
            if policy is not None:
                row["packed_rows_per_cycle"] = eng.rows_verified / max(eng.times.cycles, 1)
            result["runs"].append(row)
            print(f"[tree_static] b={bsz} {name} {row}", flush=True)
            del eng, sim
        save()

    print(f"\n{label}; decode tok/s, prefill excluded")
    print(f"{'T':>3} {'stock chain ms':>14} {'tree ms':>8} {'tree-path chain ms':>18}")
    chains = {r["nodes"]: r["verify_ms"] for r in result["verify_cost"] if r["kind"] != "tree"}
    for r in result["verify_cost"]:
        if r["kind"] == "tree":
            tail = f"{chains[r['nodes']]:>18.3f}" if r["nodes"] in chains else f"{'-':>18}"
            print(f"{r['nodes']:>3} {r['stock_chain_ms']:>14.3f} {r['verify_ms']:>8.3f} {tail}")
    head = f"{'part':>4} {'B':>3} {'variant':<26} {'tok/s':>8} {'vs AR':>6} {'τ':>5}"
    print(head + f" {'verify ms':>9} {'tok/row':>7} {'=AR':>6} {'near-tie':>8} {'mism':>4}")
    for r in result["runs"]:
        if r["variant"] == "ar":
            print(f"{r['part']:>4} {r['batch']:>3} {'ar':<26} {r['tok_s']:>8.1f} {'1.00x':>6}")
            continue
        print(
            f"{r['part']:>4} {r['batch']:>3} {r['variant']:<26} {r['tok_s']:>8.1f} "
            f"{r['speedup']:>5.2f}x {r['tau']:>5.2f} {r['verify_ms']:>9.2f} "
            f"{r['verify_tokens_per_row']:>7.1f} {r['rows_equal_ar']:>3}/{r['rows']:<2} "
            f"{r['near_ties']:>8} {r['mismatches']:>4}"
        )
    print(f"total {time.perf_counter() - t_start:.0f}s")
    save()
    return result


if __name__ == "__main__":
    main()
