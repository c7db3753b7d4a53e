"""The graph-safe certified exact-argmax head on the H200 (issue 15 item 4): is it correct, how fast
is it beside the stock LM head inside CUDA graphs, and what does it do to AR and chain decode?

    PYTHONPATH=src python3 bench/exact_head_gpu.py --out DIR            # one H200, < 3 minutes
    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/exact_head_gpu.py --out DIR --tiny  # CPU

1. ``checks`` — device copy bandwidth (the cost model's BW).
2. ``correct`` — heads 128256 × 4096 (Llama-3-8B) and 151936 × 896 (Qwen2.5-0.5B), random bf16
   weights; rows 1/2/4/8/16; random and peaked hidden rows (near a vocabulary row's direction,
   like a confident LM). Per call: the fused head (``GraphArgmaxHead``) and its torch-epilogue
   form; ``wrong`` counts calls that said ok with ids ≠ the stock argmax (must be 0); ``ok`` the
   calls certified (the rest abstain: the engine redoes them with the stock head).
3. ``micro`` — per head and rows: the stock head (``F.linear`` + ``argmax``, what the engine
   runs), the fused graph head and the torch-epilogue graph head, each captured in a CUDA graph
   on peaked rows; interleaved rounds of bursts; median seconds per call with min–max spread,
   beside the cost model's prediction (``mechanisms/exact_argmax_cost.py``).
4. ``e2e`` — the llama3-8b shape, random bf16 weights made peaked (``synthetic.make_peaked``), on
   CUDA graphs: AR (16 steps per read-back) and a chain verify (n-gram drafter over a prompt that
   repeats the target's own continuation), each without and with the head; interleaved rounds;
   decode tok/s after the first commit, tokens must equal, the head's abstain rate (abstained
   calls / calls) and spared rate (calls that did not abstain only because every row that
   failed was an idle row or padding, outside the verify's live rows), and the predicted tok/s
   (the measured stock rate with the predicted saving per verify). Then, budget permitting,
   ``idle_slots``: chain and packed verify with the head over four slots and two requests (idle
   rows; packed bucket padding), untimed: tokens equal AR, verifies redone, spared calls.
JSON to DIR/exact_head_gpu.json (rewritten after each section); a short table is printed last.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.gpu_ceilings import copy_bandwidth
from specpilot.bench.protocol import Sample, interleave
from specpilot.bench.script import BenchScript
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, Request, Scheduler, generate
from specpilot.engine.plans import PackedPlan
from specpilot.mechanisms.exact_argmax_cost import ASSUMPTIONS, predict
from specpilot.mechanisms.exact_argmax_graph import GraphArgmaxHead
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_target, make_peaked
from specpilot.timing import spread, time_burst

FUSED_KERNELS = 8
"""Launches of the fused certificate (row terms, INT8 GEMM, bounds, amax, topk (1–2), refine,
finish with the flag and counters; counted on a CPU trace): the prediction's ``kernels``."""
FUSED_PASSES = 2
"""``[R, V]`` fp32 passes of the fused epilogue: the GEMM writes the cheap logits, one kernel
reads them."""
TORCH_KERNELS = 140
"""The same for the torch epilogue (counted on a CPU trace of the ops)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny shapes")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--candidates", type=int, default=8, help="blocks refined per row (C)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--trials", type=int, default=6, help="calls per (head, rows, kind)")
    p.add_argument("--new-tokens", type=int, default=0, help="e2e tokens (default 160)")
    p.add_argument("--budget-s", type=float, default=170.0)
    return p.parse_args(argv)


class Bench(BenchScript):
    def __init__(self, args: argparse.Namespace) -> None:
        cuda = torch.cuda.is_available() and not args.tiny
        super().__init__(
            torch.device("cuda" if cuda else "cpu"), args.out, "exact_head_gpu.json",
            args.budget_s, script="bench/exact_head_gpu.py", tiny=args.tiny,
            candidates=args.candidates, block=args.block, assumptions=ASSUMPTIONS,
        )  # fmt: skip
        self.args, self.tiny = args, args.tiny
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.rows = [int(r) for r in args.rows.split(",")] if not self.tiny else [1, 4]
        self.heads = {"llama3-8b": (128256, 4096), "qwen2.5-0.5b": (151936, 896)}
        if self.tiny:
            self.heads = {"tiny-a": (3000, 64), "tiny-b": (5000, 32)}

    def head_model(self, vocab: int, hidden: int, seed: int) -> Transformer:
        """A model used only for its LM head: a one-layer config of that head's shape."""
        from specpilot.config import ModelConfig

        cfg = ModelConfig(
            arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_layers=1, num_heads=max(1, hidden // 128), num_kv_heads=1,
            head_dim=min(128, hidden), max_position_embeddings=64,
        )  # fmt: skip
        model = Transformer(cfg, dtype=self.dtype, device=self.dev, max_positions=64)
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        with torch.no_grad():
            model.lm_head.normal_(0.0, 0.02, generator=gen)
        return model

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
        out = {"fused": GraphArgmaxHead(model, block=b, candidates=c)}
        out["torch-epilogue"] = GraphArgmaxHead(model, block=b, candidates=c, fused=False)
        return out

    # ------------------------------------------------------------------ sections
    def checks(self) -> dict[str, Any]:
        if not self.cuda:
            return {"copy_bandwidth_Bps": 4.3e12, "note": "CPU: the H200's measured value"}
        return {"copy_bandwidth_Bps": copy_bandwidth(self.dev, 1 << 30)}

    def correct(self) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for name, (vocab, hidden) in self.heads.items():
            model = self.head_model(vocab, hidden, 0)
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
            model = self.head_model(vocab, hidden, 1)
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
                times: dict[str, list[float]] = {n: [] for n in fns}
                names = list(fns)
                for k in range(rounds):
                    for n in names[k % len(names) :] + names[: k % len(names)]:
                        times[n].append(time_burst(fns[n], self.dev, 20))
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
        shape = "tiny-llama" if self.tiny else "llama3-8b"
        new = self.args.new_tokens or (12 if self.tiny else 160)
        model = make_peaked(build_target(shape, self.dev, self.dtype, seed=0, max_positions=2048))
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
            first: list[float] = []
            c0 = engine.times.cycles

            def mark(_i: int, toks: list[int]) -> None:
                if not first:
                    first.extend((time.perf_counter(), len(toks)))

            try:
                res = generate(engine, [prompt], new, on_commit=mark)[0]
                if self.cuda:
                    torch.cuda.synchronize(self.dev)
                end = time.perf_counter()
            finally:
                model.argmax_head = None
            cycles[label] = engine.times.cycles - c0
            return Sample(len(res.tokens) - int(first[1]), end - first[0], res.tokens)

        arms = {label: (lambda label=label: run(label)) for label in engines}
        deadline = time.perf_counter() + max(
            self.left() - (5 if self.tiny else 35), 10
        )  # idle_slots
        m = interleave(arms, rounds=2 if self.tiny else 4, warmup=1, deadline=deadline)
        stats = head.stats()
        abstain = stats["abstained_calls"] / max(stats["calls"], 1)
        out: dict[str, Any] = {
            "shape": f"{shape} (random {self.dtype} weights, make_peaked)", "new_tokens": new,
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

    def idle_slots(
        self, model: Transformer, head: GraphArgmaxHead, prompt: list[int], new: int, k: int,
        want: list[int],
    ) -> dict[str, Any]:  # fmt: skip
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
            cells = []
            for n in ("stock", "fused", "torch-epilogue"):
                v = row[n]
                cells.append(f"{n} {v['median'] * 1e6:7.1f} [{v['lo'] * 1e6:.1f}-{v['hi'] * 1e6:.1f}]"
                             f" p{v['predicted_s'] * 1e6:.0f}")  # fmt: skip
            lines.append(f"  {key:24s} " + " | ".join(cells))
    e2e = sec.get("e2e", {})
    if isinstance(e2e, dict) and "arms" in e2e:
        lines.append(f"e2e {e2e['shape']}: tokens equal {e2e['tokens_equal']}, "
                     f"abstain rate {e2e['abstain_rate']:.3f}, "
                     f"spared rate {e2e['spared_rate']:.3f}")  # fmt: skip
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

    def section(name: str, fn: Callable[[], Any]) -> Any:
        with torch.inference_mode():
            res = b.section(name, fn)
        if b.cuda:
            torch.cuda.empty_cache()
        return res

    bw = section("checks", b.checks).get("copy_bandwidth_Bps", 4.3e12)
    section("correct", b.correct)
    section("micro", lambda: b.micro(bw))
    section("e2e", lambda: b.e2e(bw))
    print(table(b.out))
    return b.out


if __name__ == "__main__":
    main()
