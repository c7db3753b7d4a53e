"""The graph-safe certified exact-argmax head on the H200 (issue 15 item 4): is it correct, how fast
is it beside the stock LM head inside CUDA graphs, and what does it do to AR and chain decode?

    PYTHONPATH=src python3 bench/exact_head_gpu.py --out DIR            # one H200, < 3 minutes
    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/exact_head_gpu.py --out DIR --tiny  # CPU

1. ``checks``: device copy bandwidth (the cost model's BW).
2. ``correct``: Llama-3-8B and Qwen2.5-0.5B heads, random and peaked rows (1-16): the fused head
   (``GraphArgmaxHead``) and its torch epilogue never certify a wrong id (``wrong`` = 0).
3. ``micro``: stock, fused and torch-epilogue heads in CUDA graphs, interleaved rounds, beside
   the cost model (``mechanisms/exact_argmax_cost.py``).
4. ``e2e``: a peaked random 8B target, AR and n-gram chain verify without and with the head,
   interleaved: tok/s, tokens equal, abstain and spared rates, predicted tok/s; ``idle_slots``
   (untimed): four slots, two requests, chain and packed: tokens equal AR.
JSON to DIR/exact_head_gpu.json (rewritten after each section); a short table is printed last.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.gpu_ceilings import copy_bandwidth
from specpilot.bench.protocol import Sample, interleave
from specpilot.bench.script import (
    BenchScript,
    decode_sample,
    peaked_target,
    script_parser,
    spread_text,
)
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.plans import PackedPlan
from specpilot.mechanisms.exact_argmax_cost import ASSUMPTIONS, predict
from specpilot.mechanisms.exact_argmax_graph import GraphArgmaxHead
from specpilot.models.transformer import Transformer
from specpilot.synthetic import head_only_model
from specpilot.timing import interleaved_rounds, spread

FUSED_KERNELS = 8
"""Launches of the fused certificate (row terms, INT8 GEMM, bounds, amax, topk (1–2), refine,
finish with the flag and counters; counted on a CPU trace): the prediction's ``kernels``."""
FUSED_PASSES = 2
"""``[R, V]`` fp32 passes of the fused epilogue: the GEMM writes the cheap logits, one kernel
reads them."""
TORCH_KERNELS = 140
HEADS = {"llama3-8b": (128256, 4096), "qwen2.5-0.5b": (151936, 896)}
TINY_HEADS = {"tiny-a": (3000, 64), "tiny-b": (5000, 32)}
"""The same for the torch epilogue (counted on a CPU trace of the ops)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, 170.0, "CPU smoke run at tiny shapes")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--candidates", type=int, default=8, help="blocks refined per row (C)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--trials", type=int, default=6, help="calls per (head, rows, kind)")
    p.add_argument("--new-tokens", type=int, default=0, help="e2e tokens (default 160)")
    return p.parse_args(argv)


class Bench(BenchScript):
    def __init__(self, args: argparse.Namespace) -> None:
        dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
        super().__init__(dev, args.out, "exact_head_gpu.json", args.budget_s, args=vars(args))
        self.out["assumptions"] = ASSUMPTIONS
        self.args, self.tiny = args, args.tiny
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.rows = [int(r) for r in args.rows.split(",")] if not self.tiny else [1, 4]
        self.heads = TINY_HEADS if self.tiny else HEADS

    def hidden(self, model: Transformer, rows: int, kind: str, seed: int) -> torch.Tensor:
        """``[1, rows, H]`` final-normed-like rows: random, or near a vocabulary row."""
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        h = model.cfg.hidden_size
        x = torch.randn(rows, h, generator=gen, device=self.dev)
        if kind == "peaked":
            w = model.lm_head.float()
            pick = torch.randint(0, w.shape[0], (rows,), generator=gen, device=self.dev)
            x = 6.0 * w[pick] / w[pick].norm(dim=1, keepdim=True) + 0.3 * x / h**0.5
            x = x * h**0.5 / 6.0
        return x.to(self.dtype)[None]

    def heads_of(self, model: Transformer) -> dict[str, GraphArgmaxHead]:
        c, b = self.args.candidates, self.args.block
        fused = {"fused": None, "torch-epilogue": False}  # None: fused where Triton runs
        return {h: GraphArgmaxHead(model, block=b, candidates=c, fused=f) for h, f in fused.items()}

    def checks(self) -> dict[str, Any]:
        if not self.cuda:
            return {"copy_bandwidth_Bps": 4.3e12, "note": "CPU: the H200's measured value"}
        return {"copy_bandwidth_Bps": copy_bandwidth(self.dev, 1 << 30)}

    def correct(self) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for name, (vocab, hidden) in self.heads.items():
            model = head_only_model(vocab, hidden, self.dev, self.dtype, 0)
            heads = self.heads_of(model)
            for r in self.rows:
                for kind in ("random", "peaked"):
                    row = {h: {"ok": 0, "wrong": 0, "calls": 0} for h in heads}
                    for t in range(self.args.trials):
                        x = self.hidden(model, r, kind, 100 * r + t)
                        want = F.linear(x[0], model.lm_head).argmax(dim=-1)
                        for h, head in heads.items():
                            ids = head.abstaining(x)[0]
                            ok = int(head.abstain_flag[0]) == 0
                            row[h]["calls"] += 1
                            row[h]["ok"] += ok
                            row[h]["wrong"] += ok and not torch.equal(ids, want)
                    res[f"{name} r{r} {kind}"] = row
            del model, heads
        res["all_correct"] = all(
            v[h]["wrong"] == 0 for k, v in res.items() if isinstance(v, dict) for h in v
        )
        return res

    def micro(self, bw: float) -> dict[str, Any]:
        res: dict[str, Any] = {}
        rounds = 2 if self.tiny else 5
        for name, (vocab, hidden) in self.heads.items():
            model = head_only_model(vocab, hidden, self.dev, self.dtype, 1)
            heads, w = self.heads_of(model), model.lm_head
            for r in self.rows:
                if self.left() < (0 if self.tiny else 70):  # keep time for e2e
                    res[f"{name} r{r}"] = "skipped: budget"
                    continue
                x = self.hidden(model, r, "peaked", r)
                fns: dict[str, Callable[[], object]] = {
                    "stock": self.graph(lambda x=x, w=w: F.linear(x[0], w).argmax(dim=-1))
                }
                for h, head in heads.items():
                    fns[h] = self.graph(lambda head=head, x=x: head.abstaining(x))
                times = interleaved_rounds(fns, self.dev, rounds, iters=20)
                row: dict[str, Any] = {n: spread(t) for n, t in times.items()}
                for h, kern, passes in (("fused", FUSED_KERNELS, FUSED_PASSES),
                                        ("torch-epilogue", TORCH_KERNELS, 8)):  # fmt: skip
                    p = predict(vocab, hidden, r, self.args.candidates, self.args.block,
                                model.lm_head.element_size(), bw, kernels=kern,
                                epilogue_passes=passes)  # fmt: skip
                    row[h]["predicted_s"] = p.graph_s
                    row[h]["ratio_to_stock"] = row["stock"]["median"] / row[h]["median"]
                row["stock"]["predicted_s"] = predict(vocab, hidden, r, 1).stock_s
                row["ok_last"] = {h: int(head.abstain_flag[0]) == 0 for h, head in heads.items()}
                res[f"{name} r{r}"] = row
            del model, heads, w
        return res

    def e2e(self, bw: float) -> dict[str, Any]:
        new = self.args.new_tokens or (12 if self.tiny else 160)
        model, shape = peaked_target(self.tiny, self.dev, 2048)
        vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
        ramp = [(7 + i) % vocab for i in range(new + 64)]  # the peaked target's own continuation
        prompt = ramp + ramp[:16]  # an n-gram drafter finds every next token in the prompt
        head = GraphArgmaxHead(model, block=self.args.block, candidates=self.args.candidates)
        k = 7
        engines = {
            "ar": (Engine(model, graphs=self.cuda), None),
            "ar+head": (Engine(model, graphs=self.cuda), head),
            "chain": (Engine(model, NgramDrafter(k=k), graphs=self.cuda), None),
            "chain+head": (Engine(model, NgramDrafter(k=k), graphs=self.cuda), head),
        }
        cycles: dict[str, int] = {}

        def run(label: str) -> Sample:
            engine, plug = engines[label]
            model.argmax_head = plug
            c0 = engine.times.cycles
            try:
                sample = decode_sample(engine, prompt, new)
            finally:
                model.argmax_head = None
            cycles[label] = engine.times.cycles - c0
            return sample

        arms = {label: (lambda label=label: run(label)) for label in engines}
        until = time.perf_counter() + max(self.left() - (5 if self.tiny else 35), 10)  # idle_slots
        m = interleave(arms, rounds=2 if self.tiny else 4, warmup=1, deadline=until)
        stats = head.stats()
        abstain = stats["abstained_calls"] / max(stats["calls"], 1)
        out: dict[str, Any] = {
            "shape": shape, "new_tokens": new,
            "tokens_equal": m.last("ar").payload == m.last("ar+head").payload
            == m.last("chain").payload == m.last("chain+head").payload,
            "head_stats": stats, "abstain_rate": abstain,
            "spared_rate": stats["spared_calls"] / max(stats["calls"], 1),
            "engine_abstains": {lab: e.abstains for lab, (e, _) in engines.items()},
            "arms": {},
        }  # fmt: skip
        for base, rows in (("ar", 1), ("chain", k + 1)):
            for label in (base, base + "+head"):
                out["arms"][label] = {
                    "tok_s": m.tok_s(label), "rounds": len(m.samples[label]),
                    "verifies_last": cycles.get(label, 0),
                }  # fmt: skip
            s = m.last(base)
            verify_s = s.seconds / max(cycles.get(base, 1), 1)
            p = predict(vocab, hidden, rows, self.args.candidates, self.args.block,
                        model.lm_head.element_size(), bw, abstain_rate=abstain,
                        verify_s=verify_s, kernels=FUSED_KERNELS,
                        epilogue_passes=FUSED_PASSES)  # fmt: skip
            saved = cycles.get(base, 0) * p.saved_s
            out["arms"][base + "+head"]["predicted_tok_s"] = s.tokens / max(s.seconds - saved, 1e-9)
            out["arms"][base + "+head"]["ratio"] = m.ratio(base + "+head", base).to_dict()
        if self.left() > (0 if self.tiny else 30):
            out["idle_slots"] = self.idle_slots(model, head, prompt, new, k, m.last("ar").payload)
        return out

    def idle_slots(self, model: Transformer, head: GraphArgmaxHead, prompt: list[int], new: int,
                   k: int, want: list[int]) -> dict[str, Any]:  # fmt: skip
        """Chain and packed verify with the head over 4 slots and 2 requests (the same prompt,
        ``new`` and ``new // 2`` tokens): idle rows all along, packed padding; untimed."""
        res: dict[str, Any] = {}
        for label, plan in (("chain", None), ("packed", PackedPlan(bucket=4))):
            engine = Engine(model, NgramDrafter(k=k), plan=plan, graphs=self.cuda)
            before = head.stats()
            model.argmax_head = head
            try:
                sched = Scheduler(engine, slots=4, max_context=len(prompt) + new)
                for i, n in enumerate((new, max(new // 2, 1))):
                    sched.submit(Request(str(i), tuple(prompt), n))
                done: dict[str, list[int]] = {}
                while sched.has_work:
                    for r in sched.step().finished:
                        done[r.id] = r.tokens
            finally:
                model.argmax_head = None
            after = head.stats()
            delta = {key: after[key] - before[key] for key in after}
            res[label] = {
                "tokens_equal": done["0"] == want and done["1"] == want[: len(done["1"])]
                and len(done["1"]) == max(new // 2, 1),
                "engine_abstains": engine.abstains, "head_stats": delta,
                "abstain_rate": delta["abstained_calls"] / max(delta["calls"], 1),
                "spared_rate": delta["spared_calls"] / max(delta["calls"], 1),
            }  # fmt: skip
        return res


def table(out: dict[str, Any]) -> str:
    lines = ["", "exact-argmax graph head (" + out["device"] + ")"]
    sec = out["sections"]
    corr = sec.get("correct", {})
    if isinstance(corr, dict) and "all_correct" in corr:
        lines.append(f"correct: never a wrong certified id = {corr['all_correct']}")
        for key, row in corr.items():
            if isinstance(row, dict):
                f, t = row["fused"], row["torch-epilogue"]
                lines.append(
                    f"  {key:28s} ok fused {f['ok']}/{f['calls']}  torch {t['ok']}/{t['calls']}"
                )
    micro = sec.get("micro", {})
    if isinstance(micro, dict) and micro and "error" not in micro:
        lines.append("micro (µs per call, median [min-max]; predicted):")
        for key, row in micro.items():
            if not isinstance(row, dict):
                lines.append(f"  {key:24s} {row}")
                continue
            cells = [
                f"{n} {spread_text(row[n], '.1f', 1e6)} p{row[n]['predicted_s'] * 1e6:.0f}"
                for n in ("stock", "fused", "torch-epilogue")
            ]
            lines.append(f"  {key:24s} " + " | ".join(cells))
    e2e = sec.get("e2e", {})
    if isinstance(e2e, dict) and "arms" in e2e:
        rates = f"abstain rate {e2e['abstain_rate']:.3f}, spared rate {e2e['spared_rate']:.3f}"
        lines.append(f"e2e {e2e['shape']}: tokens equal {e2e['tokens_equal']}, {rates}")
        for label, a in e2e["arms"].items():
            pred = f" (predicted {a['predicted_tok_s']:.1f})" if "predicted_tok_s" in a else ""
            lines.append(f"  {label:12s} {a['tok_s']:8.1f} tok/s{pred}")
        for label, a in e2e.get("idle_slots", {}).items():
            lines.append(f"  idle slots {label:7s} tokens equal {a['tokens_equal']}, "
                         f"redone {a['engine_abstains']}, abstain rate {a['abstain_rate']:.3f}, "
                         f"spared rate {a['spared_rate']:.3f}")  # fmt: skip
    for name, v in sec.items():
        if isinstance(v, dict) and "error" in v:
            lines.append(f"{name}: ERROR {v['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    b = Bench(args)
    with torch.inference_mode():
        bw = b.section("checks", b.checks).get("copy_bandwidth_Bps", 4.3e12)
        b.section("correct", b.correct)
        b.section("micro", lambda: b.micro(bw))
        b.section("e2e", lambda: b.e2e(bw))
    print(table(b.out))
    return b.out


if __name__ == "__main__":
    main()
