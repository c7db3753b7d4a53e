"""Issue 8, FP8 pre-filter: the continuous-batching scheduler with and without the FP8 pre-filter.

    PYTHONPATH=src python3 bench/fp8_prefilter_gpu.py --out DIR            # H200, ~1-3 minutes
    PYTHONPATH=src python3 bench/fp8_prefilter_gpu.py --out DIR --smoke    # CPU, tiny, fp32

Target: the Llama-3-8B shape with seeded random bf16 weights made peaked (``synthetic.make_peaked``:
clear top-1 margins, so bf16 verify widths do not flip near-ties), **reduced to ``--layers``
decoder layers** (default 8 of 32, to keep the run short; every layer has the 8B shapes, so
per-layer GEMM costs are the 8B's, and the LM head is full). Drafter: **simulated acceptance**,
an oracle that proposes the target's own batched-AR continuation except at seeded wrong
positions (each position wrong with probability ``1 - alpha``, alpha from a per-request τ cycling
over ``--taus`` at block ``k + 1``), so acceptance depends on positions only and both variants
commit the same tokens in the same steps; the oracle costs no device time (drafter compute is not
in these numbers).

At each concurrency (16, 20, 24 requests arriving at once, slots = concurrency), in one process:
batched AR (the reference tokens and the oracle), then ``off`` (the BatchScheduler as is) and
``on`` (the same with ``Fp8Prefilter``: an FP8 e4m3 copy of the target scores every row's drafts
in one batched forward; each row's block is cut to the agreed prefix + ``--margin``), each warmed
up once and then timed ``--reps`` times (median; ``torch.cuda.synchronize`` before every clock
read). Reported: tok/s, on/off ratio, exact verify tokens per decode step (padded ``B x width``,
and real ``rows + drafts``), steps, the FP8 copy's agreement with the exact target (teacher-forced
on the AR texts, per position), the pre-filter's stats (rows scored, drafts in the agreed prefix,
drafts cut), and token equality of on vs off and of each vs AR (differing rows are token-forced). JSON goes to
``DIR/fp8_prefilter_gpu.json`` after every concurrency; a short table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.static_runs import check_rows, run_header
from specpilot.drafters.base import DraftProposal
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile
from specpilot.engine.batching import BatchScheduler, Request, RequestResult
from specpilot.mechanisms.fp8_copy import Fp8Linear, fp8_model, fp8_nbytes, use_scaled_mm
from specpilot.mechanisms.fp8_prefilter import Fp8Prefilter
from specpilot.models.transformer import DecoderLayer, Transformer
from specpilot.synthetic import TARGET_SHAPES, init_random_on_device, make_peaked


class PositionOracle:
    """Eager drafter of simulated acceptance for many rows: proposes the target's AR continuation
    of the row's prompt, wrong at seeded positions (the same positions in every run)."""

    def __init__(
        self, texts: dict[tuple[int, ...], list[int]], wrong: dict[tuple[int, ...], list[bool]],
        k: int, vocab: int, prompt_len: int,
    ) -> None:  # fmt: skip
        self.name = f"oracle ({SIM_LABEL})"
        self.k = k
        self.texts, self.wrong = texts, wrong
        self.vocab, self.prompt_len = vocab, prompt_len
        self.divergences = 0

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        pass

    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        rows: list[list[int]] = []
        for ctx, m in zip(contexts, max_lens, strict=True):
            n = max(0, min(self.k, m))
            key = tuple(ctx[: self.prompt_len])
            if n == 0 or key not in self.texts:
                rows.append([])
                continue
            text, wrong, at = self.texts[key], self.wrong[key], len(ctx)
            if list(ctx) != text[:at]:
                self.divergences += 1  # a near-tie left the oracle: drafts are then just wrong
            window = (text[at : at + n] + [0] * n)[:n]
            rows.append(
                [(t + 1) % self.vocab if wrong[at + i] else t for i, t in enumerate(window)]
            )
        width = max((len(r) for r in rows), default=0)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
        return DraftProposal(tokens=tokens, lengths=[len(r) for r in rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU")
    ap.add_argument("--concurrency", default=None, help="comma list (default 16,20,24; smoke 2,3)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8 of 32)")
    ap.add_argument("--k", type=int, default=None, help="drafts per row (default 15; smoke 4)")
    ap.add_argument("--taus", default=None, help="per-request τ cycle (2,4,6.5; smoke 1.5,3,4.5)")
    ap.add_argument("--margin", type=int, default=1, help="pre-filter margin")
    ap.add_argument("--min-batch", type=int, default=None, help="pre-filter min_batch (8; smoke 1)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="timed runs per variant (median)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no concurrency after")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    s = args.smoke
    args.concurrency = args.concurrency or ("2,3" if s else "16,20,24")
    args.k = args.k or (4 if s else 15)
    args.taus = args.taus or ("1.5,3,4.5" if s else "2,4,6.5")
    args.min_batch = args.min_batch or (1 if s else 8)
    args.prompt_len = args.prompt_len or (8 if s else 64)
    args.new_tokens = args.new_tokens or (16 if s else 128)
    args.reps = args.reps or (1 if s else 3)
    return args


@torch.inference_mode()
def teacher_forced_agreement(
    target: Transformer, cheap: Transformer, texts: list[list[int]], start: int
) -> float:
    """Fraction of positions from ``start`` on where the FP8 copy's greedy token equals the exact
    target's, both fed the same texts (the AR outputs) in one forward per group of rows."""
    same = total = 0
    for i in range(0, len(texts), 8):
        seqs = torch.tensor(texts[i : i + 8], device=target.device)  # [b, T]
        b, t = seqs.shape
        exact = target.forward_argmax(seqs, target.allocate_cache(b, t))[:, start:-1]  # [b, T']
        got = cheap.forward_argmax(seqs, cheap.allocate_cache(b, t))[:, start:-1]
        same += int((exact == got).sum())
        total += exact.numel()
    return same / max(total, 1)


def build(args: argparse.Namespace, dev: torch.device) -> tuple[Transformer, str]:
    shape = "tiny-llama" if args.smoke else "llama3-8b"
    full = TARGET_SHAPES[shape]
    layers = args.layers or (full.num_layers if args.smoke else 8)
    cfg = dataclasses.replace(full, num_layers=layers)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    target = Transformer(cfg, dtype=dtype, device=dev, max_positions=1024)
    init_random_on_device(target, args.seed)
    make_peaked(target)
    label = f"{shape} shape with {layers} of {full.num_layers} layers, {str(dtype)[6:]}, peaked"
    return target, label


def serve(
    sched: BatchScheduler, reqs: list[Request], dev: torch.device
) -> tuple[list[RequestResult], float, dict[str, float]]:
    """All requests at once, stepped to the end; results in request order, wall s, step counts."""
    for r in reqs:
        sched.submit(r)
    done: dict[str, RequestResult] = {}
    steps = padded = real = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while sched.has_work:
        rep = sched.step()
        if rep.rows_prefilling == 0 and rep.rows_decoding > 0:  # a decode step
            steps += 1
            padded += rep.forward_tokens
            real += rep.rows_decoding + rep.drafted
        done.update({res.id: res for res in rep.finished})
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    per = {
        "decode_steps": steps,
        "verify_tokens_padded": padded / max(steps, 1),
        "verify_tokens_real": real / max(steps, 1),
    }
    return [done[r.id] for r in reqs], wall, per


def timed(
    make: Any, reqs: list[Request], reps: int, dev: torch.device, pre: Fp8Prefilter | None
) -> tuple[list[RequestResult], float, dict[str, float]]:
    """One warm-up run, then ``reps`` timed runs of a fresh scheduler each; the median's tok/s."""
    walls: list[float] = []
    res: list[RequestResult] = []
    per: dict[str, float] = {}
    for i in range(reps + 1):
        sched = make()
        if pre is not None:  # forget every row: each run prefills the cheap cache as served
            pre.reset()
        res, wall, per = serve(sched, reqs, dev)
        if i > 0:
            walls.append(wall)
    tokens = sum(len(r.tokens) for r in res)
    return res, tokens / statistics.median(walls), per


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.smoke:  # tiny GEMMs: one thread, no oversubscription on a shared CPU
        torch.set_num_threads(1)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    target, tlabel = build(args, dev)
    cheap = fp8_model(target)
    vocab, k = target.cfg.vocab_size, args.k
    probe = torch.zeros(16, target.cfg.hidden_size, dtype=target.dtype, device=dev)
    layer = cheap.layers[0]
    assert isinstance(layer, DecoderLayer)
    qkv = layer.linear_fns["w_qkv"]
    assert isinstance(qkv, Fp8Linear)
    fp8_path = (
        "torch._scaled_mm (FP8 GEMM)"
        if use_scaled_mm(probe, qkv.fp8, qkv.scaled_mm)
        else "dequantized weights (FP8 emulated)"
    )
    taus = [float(x) for x in args.taus.split(",")]
    alphas = [AcceptanceProfile.constant(t, k).rates[0] for t in taus]
    label = (
        f"fp8 pre-filter · {tlabel} · oracle drafter k={k} ({SIM_LABEL}, per-request τ cycling "
        f"{{{', '.join(f'{t:g}' for t in taus)}}}, drafter compute excluded) · margin "
        f"{args.margin}, min_batch {args.min_batch} · FP8 path: {fp8_path}"
    )
    print(f"[fp8_prefilter] {label}", flush=True)
    result: dict[str, Any] = {
        **run_header(label, args, dev),
        "fp8_copy_GB": fp8_nbytes(cheap) / 1e9,
        "fp8_path": fp8_path,
        "runs": [],
    }
    rng = random.Random(args.seed)
    max_context = args.prompt_len + args.new_tokens + 1
    for conc in (int(x) for x in args.concurrency.split(",")):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"[fp8_prefilter] budget spent: concurrency {conc} skipped", flush=True)
            result.setdefault("skipped", []).append(conc)
            continue
        prompts = [tuple(rng.randrange(vocab) for _ in range(args.prompt_len)) for _ in range(conc)]
        reqs = [Request(f"r{i}", p, args.new_tokens) for i, p in enumerate(prompts)]

        def make_ar(conc: int = conc) -> BatchScheduler:
            return BatchScheduler(target, slots=conc, max_context=max_context)

        ar_res, ar_tok_s, _ = timed(make_ar, reqs, args.reps, dev, None)
        ref = [r.tokens for r in ar_res]
        texts = {p: [*p, *r] for p, r in zip(prompts, ref, strict=True)}
        wrong = {
            p: [rng.random() > alphas[i % len(alphas)] for _ in range(max_context + k)]
            for i, p in enumerate(prompts)
        }
        agree = teacher_forced_agreement(
            target, cheap, [texts[p] for p in prompts], args.prompt_len - 1
        )
        row: dict[str, Any] = {
            "concurrency": conc,
            "ar_tok_s": ar_tok_s,
            "cheap_agreement_teacher_forced": agree,
        }
        out: dict[str, list[RequestResult]] = {}
        for variant in ("off", "on"):
            oracle = PositionOracle(texts, wrong, k, vocab, args.prompt_len)
            pre = Fp8Prefilter(cheap, args.margin, args.min_batch) if variant == "on" else None

            def make(
                oracle: PositionOracle = oracle, pre: Any = pre, conc: int = conc
            ) -> BatchScheduler:
                return BatchScheduler(
                    target, oracle, slots=conc, max_context=max_context, prefilter=pre
                )

            res, tok_s, per = timed(make, reqs, args.reps, dev, pre)
            out[variant] = res
            cycles = sum(r.stats.cycles for r in res)
            row[variant] = {
                "tok_s": tok_s,
                "speedup_vs_ar": tok_s / ar_tok_s,
                "tau": sum(r.stats.committed for r in res) / max(cycles, 1),
                **per,
                "oracle_divergences": oracle.divergences,
                **check_rows(target, list(prompts), ref, [r.tokens for r in res]),
            }
            if pre is not None:
                row["prefilter"] = pre.stats.as_dict()
            print(
                f"[fp8_prefilter] B={conc} {variant}: {tok_s:.1f} tok/s "
                f"({row[variant]['speedup_vs_ar']:.2f}x AR), verify tokens/step "
                f"{per['verify_tokens_padded']:.0f} padded / {per['verify_tokens_real']:.0f} real, "
                f"{per['decode_steps']} steps, {time.perf_counter() - t_start:.0f}s",
                flush=True,
            )
        row["on_vs_off"] = row["on"]["tok_s"] / row["off"]["tok_s"]
        row["tokens_equal"] = [r.tokens for r in out["on"]] == [r.tokens for r in out["off"]]
        result["runs"].append(row)
        result["total_s"] = time.perf_counter() - t_start
        (args.out / "fp8_prefilter_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{label}\ntok/s over all requests (prefill included); verify tokens per decode step")
    print(
        f"{'B':>3} {'AR tok/s':>9} {'off tok/s':>9} {'on tok/s':>9} {'on/off':>6} "
        f"{'vtok off':>8} {'vtok on':>8} {'steps':>9} {'agree':>6} {'cut':>5} {'on=off':>6} "
        f"{'=AR off/on':>10} {'mism':>4}"
    )
    for r in result["runs"]:
        off, on, p = r["off"], r["on"], r["prefilter"]
        print(
            f"{r['concurrency']:>3} {r['ar_tok_s']:>9.1f} {off['tok_s']:>9.1f} {on['tok_s']:>9.1f} "
            f"{r['on_vs_off']:>5.2f}x {off['verify_tokens_padded']:>8.0f} "
            f"{on['verify_tokens_padded']:>8.0f} {off['decode_steps']:>4}/{on['decode_steps']:<4} "
            f"{r['cheap_agreement_teacher_forced']:>6.3f} {p['cut_frac']:>5.2f} {r['tokens_equal']!s:>6} "
            f"{off['rows_equal_ar']:>4}/{on['rows_equal_ar']:<4}  "
            f"{off['mismatches'] + on['mismatches']:>4}"
        )
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return result


if __name__ == "__main__":
    main()
