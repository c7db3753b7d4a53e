"""Issue 15 item 3 on the GPU: the fused tree accept + K/V compaction, then trees vs the chain.

    PYTHONPATH=src python3 bench/tree_accept_gpu.py --out DIR           # one H200, < 3 minutes
    PYTHONPATH=src python3 bench/tree_accept_gpu.py --out DIR --tiny    # CPU smoke run (fp32)
    (on the CPU, TRITON_INTERPRET=1 adds the fused kernel, interpreted)

1. **accept** at the Llama-3-8B KV cache (32 layers, 8 KV heads, head dim 128, bf16, 1536
   committed tokens) and the block drafter's 5 hidden-state rows: the torch tree accept
   (``accepted_path`` + ``compact_kv``) against the fused kernel (``kernels/tree_accept.py``),
   for static trees of 16, 32 and 64 nodes (k = 15) whose accepted path leaves the first-choice
   chain (so rows really move), beside the chain's own accept. First both run on copies of the
   same state and must leave identical tokens, lengths, caches and hidden rows; then each is
   captured in a CUDA graph of ``reps`` calls and timed with CUDA events in interleaved rounds
   (µs per call: median and spread; a state reset that every graph carries is timed alone).
2. **end to end**, batch 1, through the composition root the commands use (``build_engine``:
   the ``block`` drafter with the DFlash shape's seeded random weights, ``tree-verify`` with its
   knobs, CUDA graphs) over a peaked random 8B target (``synthetic.make_peaked``) under
   **simulated acceptance**: an EAGLE-like profile (k = 7, every position 0.8) and a DFlash-like
   one (``tau=6.5,block=16``), both with ``sibling=0.5`` (after a first-choice miss the true token
   is the second choice with probability 0.5: an assumption, not a measured drafter property).
   AR, the chain, trees of 16 / 32 / 48 nodes and one tree with the torch accept; a warm-up run
   each (graph capture; its tokens compared with AR's), then interleaved rounds; ratios to AR and
   to the chain per round (median, spread); every output token-forced.

JSON goes to ``DIR/tree_accept_gpu.json`` after each part; a short table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.protocol import interleave
from specpilot.bench.records import git_rev
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
from specpilot.synthetic import TARGET_SHAPES, build_target, make_peaked

PROFILES = {
    "eagle-like": "rates=0.8,block=8,sibling=0.5",
    "dflash-like": "tau=6.5,block=16,sibling=0.5",
}
TINY_PROFILES = {"eagle-like": "rates=0.8,block=6,sibling=0.5", "dflash-like": "tau=3.5,block=9,sibling=0.5"}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU (smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="part 1 rounds (default 15 / 3)")
    ap.add_argument("--e2e-rounds", type=int, default=None, help="part 2 rounds (default 6 / 2)")
    ap.add_argument("--reps", type=int, default=None, help="accept calls per graph (default 20)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 12)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 192 (tiny 16)")
    ap.add_argument("--nodes", default=None, help="tree sizes of part 2 (default 16,32,48)")
    ap.add_argument(
        "--budget-s", type=float, default=140.0, help="part 2 starts no round it cannot end by then"
    )
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
    the budget, as the issue 6 bench built them)."""
    depth = min(k, nodes)
    return {
        "depth": depth,
        "width": min(8, max(2, -(-2 * nodes // depth))),
        "branch": 2,
        "max_nodes": nodes,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "lo": min(values), "hi": max(values)}


# ---------------------------------------------------------------------- part 1: the accept alone
def _path(tree: StaticTree, i: int) -> list[int]:
    """Nodes from the root's child down to node ``i``."""
    out = []
    while i >= 0:
        out.append(i)
        i = tree.parents[i]
    return out[::-1]


def off_chain_case(
    tree: StaticTree, vocab: int, seed: int
) -> tuple[list[int], list[int], list[int]]:
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


def accept_section(args: argparse.Namespace, dev: torch.device, out: dict[str, Any]) -> None:
    out["accept"] = [accept_case(args, dev, n) for n in ((6, 10) if args.tiny else (16, 32, 64))]


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
        rec["fused_equal_torch"] = all(
            torch.equal(a, b) for a, b in zip(after[False], after[True], strict=True)
        )
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
    timers = {name: _timer(fn, args.reps, graphs, dev) for name, fn in steps.items()}
    per_call: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            per_call[name].append(timers[name]() * 1e6 / args.reps)
    rec["us_per_call"] = {name: spread(v) for name, v in per_call.items()}
    return rec


def _timer(
    fn: Callable[[], None], reps: int, graphs: bool, dev: torch.device
) -> Callable[[], float]:
    """Seconds for ``reps`` calls of ``fn``: one CUDA-graph replay of ``reps`` captured calls
    timed by CUDA events, or (CPU) eager calls between synchronised clock reads."""
    if not graphs:

        def eager() -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return time.perf_counter() - t0

        eager()
        return eager
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return replay


# ---------------------------------------------------------------------- part 2: end to end
def variant_configs(
    label: str, profile: str, k: int, nodes: list[int], args: argparse.Namespace, dev: torch.device
) -> list[tuple[str, EngineConfig, bool | None]]:
    """(name, engine config, fused accept: None = the engine's choice) of the chain, the trees,
    and one tree with the torch accept."""
    dep = DeploymentSpec(
        target=label,
        drafter="block",
        dtype="fp32" if args.tiny else "bf16",
        device=dev.type,
        simulate_acceptance=profile,
    )
    knobs = {"layers": 1, "context_layers": 2} if args.tiny else {}

    def config(mechanisms: dict[str, dict[str, int]]) -> EngineConfig:
        # the gate off: every variant drafts every cycle, so trees and chain meet on equal terms
        return EngineConfig(
            dep, k=k, drafter_knobs=knobs, mechanisms=mechanisms, gate={"enabled": False}
        )

    out: list[tuple[str, EngineConfig, bool | None]] = [("chain", config({}), None)]
    for n in nodes:
        out.append((f"tree{n}", config({"tree-verify": tree_knobs(n, k)}), None))
    if triton_usable(dev):  # the same tree with the torch accept: the fused kernel's gain
        mid = nodes[len(nodes) // 2]
        out.append((f"tree{mid} torch accept", config({"tree-verify": tree_knobs(mid, k)}), False))
    return out


def e2e_section(
    args: argparse.Namespace,
    dev: torch.device,
    out: dict[str, Any],
    deadline: float,
    save: Callable[[], None],
) -> None:
    shape = "tiny-llama" if args.tiny else "llama3-8b"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    max_pos = args.prompt_len + args.new_tokens + 512
    model = make_peaked(build_target(shape, dev, dtype, seed=0, max_positions=max_pos))
    label = f"{shape} (seeded random {str(dtype).removeprefix('torch.')} weights, peaked)"
    loaded = LoadedModel(spec=label, model=model, tokenizer=None)
    rng = random.Random(0)
    prompt = [rng.randrange(model.cfg.vocab_size) for _ in range(args.prompt_len)]
    encoded, n_new = [("p0", prompt)], args.new_tokens
    ar: Engine | None = None
    ar_tokens: list[int] = []
    out["e2e"] = runs = []
    profiles = TINY_PROFILES if args.tiny else PROFILES
    for i, (pname, profile) in enumerate(profiles.items()):
        k = int(profile.split("block=")[1].split(",")[0]) - 1
        builds = {
            name: (build_engine(cfg, max_pos, target=loaded), fused)
            for name, cfg, fused in variant_configs(label, profile, k, args.nodes, args, dev)
        }
        engines: dict[str, Engine] = {}
        for name, (build, fused) in builds.items():
            eng = build.engine()
            if isinstance(eng.plan, TreePlan):
                eng.plan.fused_accept = fused  # read when the engine opens its rows
            engines[name] = eng
        if ar is None:
            ar = next(iter(builds.values()))[0].stock_engine()
            ar_tokens = run_prompts(ar, encoded, n_new, ()).payload[0].result.tokens
        arms = {"ar": ar, **engines}
        warm = {name: run_prompts(e, encoded, n_new, ()).payload[0] for name, e in engines.items()}
        equal = {name: run.result.tokens == ar_tokens for name, run in warm.items()}
        left = (deadline - time.perf_counter()) / (len(profiles) - i)
        meas = interleave(
            {name: (lambda e=e: run_prompts(e, encoded, n_new, ())) for name, e in arms.items()},
            rounds=args.e2e_rounds,
            warmup=0,
            deadline=time.perf_counter() + left,
        )
        for name, eng in arms.items():
            samples = meas.samples[name]
            last = samples[-1].payload[0]
            forced = force_tokens(model, [(name, prompt, last.result.tokens)])
            stats = [s.payload[0].result.stats for s in samples]
            rec: dict[str, Any] = {
                "profile": pname,
                "simulate_acceptance": profile,
                "variant": name,
                "k": k,
                "tau": stats[-1].mean_accepted_len,
                "cycle_ms": spread([1e3 * s.seconds / max(st.cycles, 1) for s, st in zip(samples, stats, strict=True)]),
                "tok_s": spread([s.tok_s for s in samples]),
                "x_ar": meas.ratio(name, "ar").to_dict(),
                "rounds": len(samples),
                "warmup_tokens_equal_ar": equal.get(name, True),
                "tokens_equal_ar": last.result.tokens == ar_tokens,
                "forcing": {"ok": forced.ok, "near_ties": forced.near_ties, "mismatches": forced.mismatches},
                "graph_captures": eng.runner.captures,
            }  # fmt: skip
            if name != "ar":
                rec["x_chain"] = meas.ratio(name, "chain").to_dict()
                drafter = builds[name][0].drafter
                rec["oracle_divergences"] = getattr(drafter, "divergences", None)
                rec["fused_accept"] = eng.plan.fused if isinstance(eng.plan, TreePlan) else None
                rec["mechanisms"] = builds[name][0].config.mechanisms
                rec["label"] = builds[name][0].label
            runs.append(rec)
        del builds, engines, arms, meas
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()  # a timeout keeps the profiles that finished


# ---------------------------------------------------------------------- report
def table(out: dict[str, Any]) -> str:
    lines = [f"tree_accept_gpu · {out['device']} · {out['label']}"]
    if out.get("accept"):
        lines.append("accept, µs per call (median lo-hi): nodes depth n moved | variant ...")
        for r in out["accept"]:
            cells = "  ".join(
                f"{name} {v['median']:.1f} ({v['lo']:.1f}-{v['hi']:.1f})"
                for name, v in r["us_per_call"].items()
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
            x_chain = r.get("x_chain")
            xc = (
                f"{x_chain['median']:.3f} ({x_chain['lo']:.3f}-{x_chain['hi']:.3f})"
                if x_chain
                else "-"
            )
            ok = r["tokens_equal_ar"] and r["warmup_tokens_equal_ar"] and r["forcing"]["ok"]
            lines.append(
                f"  {r['profile']:11s} {r['variant']:20s} | {r['tau']:5.2f} | {r['cycle_ms']['median']:6.2f} | "
                f"{r['tok_s']['median']:7.1f} | {r['x_ar']['median']:5.2f}x | {xc} | {'ok' if ok else 'CHECK'}"
            )  # fmt: skip
    return "\n".join(lines)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(0)

    profiles = TINY_PROFILES if args.tiny else PROFILES
    out: dict[str, Any] = {
        "label": f"{SIM_LABEL} in part 2: " + "; ".join(f"{k} {v}" for k, v in profiles.items()),
        "note": "part 2 drafts with the block drafter (DFlash shape, seeded random weights) under "
        "both profiles; the profiles, sibling included, are assumptions, not measured drafters",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fused_available": triton_usable(dev),
        "commit": git_rev(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    path = args.out / "tree_accept_gpu.json"

    def save() -> None:
        out["total_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(out, indent=1) + "\n")

    with torch.inference_mode():
        if not args.skip_accept:
            accept_section(args, dev, out)
            synchronize(dev)
            save()
        if not args.skip_e2e:
            e2e_section(args, dev, out, t0 + args.budget_s, save)
    print(table(out))
    return out


if __name__ == "__main__":
    main()
