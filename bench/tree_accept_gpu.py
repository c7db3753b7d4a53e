"""Tree verification on the GPU (issue 15 item 3): the fused tree accept, then trees vs the chain.

    PYTHONPATH=src python3 bench/tree_accept_gpu.py --out DIR         # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/tree_accept_gpu.py --out DIR --tiny  # CPU (interpreter: +fused)

1. **accept** at the Llama-3-8B KV cache (bf16, 1536 tokens): torch tree accept vs the fused
   kernel vs the chain's accept, trees of 16/32/64 nodes whose accepted path leaves the chain;
   checked equal on copies of one state, then CUDA graphs of ``reps`` calls, interleaved rounds.
2. **end to end**, batch 1, via ``build_engine`` (``block`` drafter, random weights) over a peaked
   random 8B target under **simulated acceptance** (EAGLE- and DFlash-like, ``sibling=0.5``): AR,
   chain, trees of 16/32/48 nodes, one with the torch accept; every output equal to AR's, forced.

JSON goes to ``DIR/tree_accept_gpu.json`` after each part; a short table is printed last.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import torch

from specpilot.bench import script
from specpilot.bench.runner import run_prompts, synchronize
from specpilot.drafters.simulated import SIM_LABEL
from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine.accept import accept_and_commit, tree_accept_and_commit
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.plans import TreePlan
from specpilot.engine.rows import RowState
from specpilot.engine.trees import TreeBuffers
from specpilot.forcing import force_tokens
from specpilot.kernels import triton_usable
from specpilot.models.kv_cache import KVCache
from specpilot.runtime import LoadedModel
from specpilot.synthetic import TARGET_SHAPES
from specpilot.timing import interleaved_rounds, spread

PROFILES = {
    "eagle-like": "rates=0.8,block=8,sibling=0.5",
    "dflash-like": "tau=6.5,block=16,sibling=0.5",
}
TINY_PROFILES = {"eagle-like": "rates=0.8,block=6,sibling=0.5", "dflash-like": "tau=3.5,block=9,sibling=0.5"}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = script.script_parser(__doc__, 140.0, "tiny fp32 shapes on the CPU (smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="part 1 rounds (default 15 / 3)")
    ap.add_argument("--e2e-rounds", type=int, default=None, help="part 2 rounds (default 6 / 2)")
    ap.add_argument("--reps", type=int, default=None, help="accept calls per graph (default 20)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 12)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 192 (tiny 16)")
    ap.add_argument("--nodes", default=None, help="tree sizes of part 2 (default 16,32,48)")
    ap.add_argument("--skip-accept", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)
    t = args.tiny
    args.rounds = args.rounds or (3 if t else 15)
    args.e2e_rounds = args.e2e_rounds or (2 if t else 6)
    args.reps = args.reps or (2 if t else 20)
    args.prompt_len = args.prompt_len or (12 if t else 256)
    args.new_tokens = args.new_tokens or (16 if t else 192)
    args.nodes = [int(x) for x in (args.nodes or ("6,10" if t else "16,32,48")).split(",")]
    return args


def tree_knobs(nodes: int, k: int) -> dict[str, int]:
    """``tree-verify`` knobs for a tree of ``nodes`` nodes at most ``k`` deep (width grows with
    the budget)."""
    depth = min(k, nodes)
    width = min(8, max(2, -(-2 * nodes // depth)))
    return {"depth": depth, "width": width, "branch": 2, "max_nodes": nodes}


def _path(tree: StaticTree, i: int) -> list[int]:
    """Nodes from the root's child down to node ``i``."""
    return [*_path(tree, tree.parents[i]), i] if i >= 0 else []


def off_chain_case(tree: StaticTree, vocab: int, seed: int) -> tuple[list[int], ...]:
    """Node tokens and an argmax under which the deepest path through a rank-1 node is accepted
    and every other node rejected (so block rows move in the compaction); and that path."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab - 1) for _ in range(tree.nodes + 1)]
    argmax = [vocab - 1] * (tree.nodes + 1)  # never a node token
    leaves = [i for i in range(tree.nodes) if any(tree.ranks[j] for j in _path(tree, i))]
    path = _path(tree, max(leaves, key=lambda i: (tree.depths[i], -i)))
    for j in path:
        argmax[tree.parents[j] + 1] = tokens[j + 1]
    return tokens, argmax, path


_ACCEPTED = [f.name for f in fields(RowState)].index("accepted")


def _copy_state(state: RowState) -> RowState:
    return RowState(**{f.name: getattr(state, f.name).clone() for f in fields(RowState)})


def accept_case(args: argparse.Namespace, dev: torch.device, nodes: int) -> dict[str, Any]:
    """One static tree of ``nodes`` nodes at the cache shape: check, then time (module doc)."""
    cfg = TARGET_SHAPES["tiny-llama" if args.tiny else "llama3-8b"]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    k, context = (5, 40) if args.tiny else (15, 1536)
    capacity, n_sel = context + 128, 5
    fused_ok, graphs = triton_usable(dev), dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(nodes)
    tree = build_static_tree(TreeShape.uniform(k, max(2, -(-2 * nodes // k)), nodes, 2))
    hid_shape = (n_sel, cfg.hidden_size, dtype)
    bufs = TreeBuffers.allocate(1, tree.nodes + 1, k, 1 + tree.max_rank, hid_shape, dev)
    bufs.fill_static([tree])
    tokens, argmax, path = off_chain_case(tree, cfg.vocab_size, nodes)
    bufs.tokens.copy_(torch.tensor([tokens]))
    bufs.argmax.copy_(torch.tensor([argmax]))
    assert bufs.hidden is not None
    bufs.hidden.normal_(generator=gen)
    cache = KVCache.allocate(cfg, 1, capacity, dtype, dev)
    for t in cache.k + cache.v:
        t.normal_(generator=gen)
    state = RowState.allocate(1, capacity, 64, dev)
    state.committed_len.fill_(context)
    state.active.fill_(1)
    state.draft_lens.fill_(k)
    chain_hidden = torch.zeros(n_sel, 1, k + 1, cfg.hidden_size, dtype=dtype, device=dev)

    def tree_step(fused: bool, st: RowState, kv: KVCache, hid: torch.Tensor) -> None:
        tree_accept_and_commit(
            st, bufs.tokens, bufs.argmax, bufs.topo, bufs.visible, kv, k, bufs.hidden, hid, fused
        )

    # correctness first: both from copies of one state; everything they write must agree
    after = {}
    for fused in (False, True) if fused_ok else (False,):
        st, hid = _copy_state(state), chain_hidden.clone()
        kv = KVCache([t.clone() for t in cache.k], [t.clone() for t in cache.v], cache.lengths)
        tree_step(fused, st, kv, hid)
        after[fused] = [*(getattr(st, f.name) for f in fields(RowState)), *kv.k, *kv.v, hid]
    rec: dict[str, Any] = {"nodes": tree.nodes, "depth": tree.depth, "k": k, "graphs": graphs}
    rec["n"] = int(after[False][_ACCEPTED][0])
    rec["rows_moved"] = sum(j + 1 != d for d, j in enumerate(path, start=1))
    if rec["n"] != len(path):
        raise AssertionError(f"accepted {rec['n']} of the {len(path)}-node path at {tree.label()}")
    if fused_ok:
        pairs = zip(after[False], after[True], strict=True)
        rec["fused_equal_torch"] = all(torch.equal(a, b) for a, b in pairs)
        if not rec["fused_equal_torch"]:
            raise AssertionError(f"the fused tree accept differs from torch at {tree.label()}")
    del after
    base = state.committed_len.clone()

    def with_reset(fn: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            state.committed_len.copy_(base)  # every call accepts from the same state
            fn()

        return step

    steps = {
        "reset": with_reset(lambda: None),
        "chain accept": with_reset(lambda: accept_and_commit(state, k)),
        "tree torch": with_reset(lambda: tree_step(False, state, cache, chain_hidden)),
    }
    if fused_ok:
        steps["tree fused"] = with_reset(lambda: tree_step(True, state, cache, chain_hidden))
    bursts = {name: script.repeated(fn, args.reps, dev) for name, fn in steps.items()}
    per_call = interleaved_rounds(bursts, dev, args.rounds, per=args.reps, iters=1)
    rec["us_per_call"] = {name: spread([1e6 * t for t in v]) for name, v in per_call.items()}
    return rec


def variant_configs(
    label: str, profile: str, k: int, nodes: list[int], tiny: bool, dev: torch.device
) -> list[tuple[str, EngineConfig, bool | None]]:
    """(name, engine config, fused accept: None = the engine's choice) of the chain, the trees,
    and one tree with the torch accept (the fused kernel's gain)."""
    dtype = "fp32" if tiny else "bf16"
    dep = DeploymentSpec(label, "block", dtype=dtype, device=dev.type, simulate_acceptance=profile)
    knobs = {"layers": 1, "context_layers": 2} if tiny else {}
    variants = [("chain", {}, None)]
    variants += [(f"tree{n}", {"tree-verify": tree_knobs(n, k)}, None) for n in nodes]
    if triton_usable(dev):
        mid = nodes[len(nodes) // 2]
        variants.append((f"tree{mid} torch accept", {"tree-verify": tree_knobs(mid, k)}, False))
    gate = {"enabled": False}  # every variant drafts every cycle: trees and chain on equal terms
    return [
        (name, EngineConfig(dep, k=k, drafter_knobs=knobs, mechanisms=mech, gate=gate), fused)
        for name, mech, fused in variants
    ]


def e2e_profiles(args: argparse.Namespace, dev: torch.device, deadline: float) -> Iterator[Any]:
    """Part 2, one list of arm records per profile."""
    max_pos = args.prompt_len + args.new_tokens + 512
    model, label = script.peaked_target(args.tiny, dev, max_pos)
    loaded = LoadedModel(spec=label, model=model, tokenizer=None)
    prompt = script.random_prompts(model.cfg.vocab_size, args.prompt_len)[0]
    encoded, n_new = [("p0", prompt)], args.new_tokens
    ar: Engine | None = None
    profiles = TINY_PROFILES if args.tiny else PROFILES
    for i, (pname, profile) in enumerate(profiles.items()):
        k = int(profile.split("block=")[1].split(",")[0]) - 1
        builds, engines = {}, {}
        for name, cfg, fused in variant_configs(label, profile, k, args.nodes, args.tiny, dev):
            builds[name] = build = build_engine(cfg, max_pos, target=loaded)
            engines[name] = eng = build.engine()
            if isinstance(eng.plan, TreePlan):
                eng.plan.fused_accept = fused  # read when the engine opens its rows
        if ar is None:
            ar = builds["chain"].stock_engine()
            ar_tokens = script.prompt_tokens(run_prompts(ar, encoded, n_new, ()))
        arms = {"ar": ar, **engines}
        until = time.perf_counter() + (deadline - time.perf_counter()) / (len(profiles) - i)
        meas, warm = script.e2e_rounds(arms, encoded, n_new, args.e2e_rounds, until)
        runs, head = [], {"profile": pname, "simulate_acceptance": profile, "k": k}
        for name, eng in arms.items():
            samples = meas.samples[name]
            forced = force_tokens(model, [(name, prompt, script.prompt_tokens(samples[-1])[0])])
            stats = [s.payload[0].result.stats for s in samples]
            rec: dict[str, Any] = {
                **head,
                "variant": name,
                "tau": stats[-1].mean_accepted_len,
                **script.arm_row(meas, name, eng, [st.cycles for st in stats], ar_tokens, warm),
                "forcing": forced.totals(),
            }
            if name != "ar":
                rec["x_chain"] = meas.ratio(name, "chain").to_dict()
                rec["oracle_divergences"] = getattr(builds[name].drafter, "divergences", None)
                rec["fused_accept"] = eng.plan.fused if isinstance(eng.plan, TreePlan) else None
                rec["mechanisms"] = builds[name].config.mechanisms
                rec["label"] = builds[name].label
            runs.append(rec)
        del builds, engines, arms, meas
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        yield runs


def table(out: dict[str, Any]) -> str:
    lines = [f"tree_accept_gpu · {out['device']} · {out['label']}"]
    if out.get("accept"):
        lines.append("accept, µs per call (median lo-hi): nodes depth n moved | variant ...")
        for r in out["accept"]:
            cells = "  ".join(
                f"{n} {script.spread_text(v, '.1f')}" for n, v in r["us_per_call"].items()
            )
            same = r.get("fused_equal_torch", "n/a")
            lines.append(
                f"  {r['nodes']:3d} {r['depth']:3d} {r['n']:3d} {r['rows_moved']:3d} | {cells} | fused==torch {same}"
            )
    if out.get("e2e"):
        lines.append(
            f"end to end, batch 1 ({SIM_LABEL}): profile variant | tau | cycle ms | tok/s | x AR | x chain | ok"
        )
        for r in out["e2e"]:
            xc = script.spread_text(r["x_chain"]) if "x_chain" in r else "-"
            ok = r["tokens_equal_ar"] and r["warmup_tokens_equal_ar"] and r["forcing"]["ok"]
            lines.append(
                f"  {r['profile']:11s} {r['variant']:20s} | {r['tau']:5.2f} | {r['cycle_ms']['median']:6.2f} | "
                f"{r['tok_s']['median']:7.1f} | {r['x_ar']['median']:5.2f}x | {xc} | {'ok' if ok else 'CHECK'}"
            )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(0)
    profiles = TINY_PROFILES if args.tiny else PROFILES
    label = f"{SIM_LABEL} in part 2: " + "; ".join(f"{k} {v}" for k, v in profiles.items())
    note = "part 2 drafts with the block drafter (DFlash shape, seeded random weights) under both "
    note += "profiles; the profiles, sibling included, are assumptions, not measured drafters"
    b = script.BenchScript(dev, args.out, "tree_accept_gpu.json", args.budget_s, label=label)
    out = b.out
    del out["sections"]  # a flat record: accept, e2e
    out |= {"note": note, "fused_available": triton_usable(dev), "args": vars(args)}
    with torch.inference_mode():
        if not args.skip_accept:
            sizes = (6, 10) if args.tiny else (16, 32, 64)
            out["accept"] = [accept_case(args, dev, n) for n in sizes]
            synchronize(dev)
            b.save()
        if not args.skip_e2e:
            out["e2e"] = []
            for runs in e2e_profiles(args, dev, b.t0 + args.budget_s):
                out["e2e"] += runs
                b.save()  # a timeout keeps the profiles that finished
    print(table(out))
    return out


if __name__ == "__main__":
    main()
