"""Two-level verification on SmolLM2-135M with real acceptance: one-level vs ``correct`` vs
``correct-extend``, per drafter and prompt set, beside AR and the cost model's prediction.

    PYTHONPATH=src python3 bench/two_level_smollm2.py --out DIR                          # CPU, fp32
    PYTHONPATH=src python3 bench/two_level_smollm2.py --out DIR --device cuda --dtype bfloat16

(The defaults, 4 prompts x 64 new tokens x 3 repeats, fit in ~4 minutes on an H200; the CPU
needs far longer, or a smaller run. SmolLM2's GGUF, its tokenizer and MT-Bench's questions must be
in the cache, ``$SPECPILOT_CACHE`` or ``~/.cache/specpilot``.)

Drafters: n-gram k = 4 and k = 8 (``--ngram-k``), and an early-exit draft model (SmolLM2's first
``--draft-layers`` layers + its head, no training) k = 4. Prompt sets: copy-heavy and mt-bench.
Per drafter and set: one-level speculative, and two-level (``mechanisms/two_level.py``) with the
INT8 copy of ``mechanisms/int8_copy.py`` (the Triton kernel of ``kernels/int8_gemm.py`` on CUDA
bf16, the torch reference elsewhere) in its ``correct`` and ``correct-extend`` (``--max-extension``
cheap tokens) variants; AR once per set. Eager ``SpecEngine``, batch 1.

Conventions:

* **τ**: committed tokens per exact verify (target forward), bonus included (AR = 1).
* **verifies/token**: exact verify forwards per generated token (prefill not counted as a verify;
  its token counted as generated, so AR reads (n - 1)/n).
* **cheap/cycle**: INT8-model forwards per verify cycle (one for the block, one per extension).
* **agreement**: teacher-forced, per position: the INT8 copy's greedy token equals the exact
  target's, on each prompt + AR continuation fed at the verify width k + 1 (the prompt in one
  prefill), over the continuation's positions.
* **tok/s**: generated tokens over the wall time of ``generate`` (prefill included), device
  synchronised before each clock read; per prompt the median of ``--repeats`` timed runs, after one
  warm-up run per configuration; over prompts, Σ tokens / Σ median walls. x1L and xAR divide it by
  the one-level (same drafter and set) and AR tok/s.
* **equality**: every timed output is compared with AR's tokens. Where they differ, token forcing
  (``specpilot.forcing``) judges each token: a bf16 near-tie (two batch shapes rounding apart) is
  allowed, a mismatch is not. In fp32 any difference fails. Exit status 1 on a failure.
* **prediction**: ``two_level_cost.predict`` from the one-level run's acceptance survival and mean
  draft length, the agreement, the one-level draft time per cycle (one phase-timed run) and eager
  forward times at the mean block widths. It is decode-only and ignores engine overheads other
  than drafting, so compare τ and x1L with it, not absolute tok/s.

JSON: ``DIR/two_level_smollm2.json``, rewritten after every configuration. ``--budget-s``: no new
configuration starts after that many seconds from the start (default 180 on cuda, so the H200 run
ends within ~4 minutes; 1800 on the CPU); the table shows what was done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.prompts import load_prompt_set
from specpilot.bench.runner import timed_generate
from specpilot.bench.static_runs import check_rows, run_header
from specpilot.bench.two_level import agreement, forward_time, survival
from specpilot.drafters import Drafter, DraftModelDrafter, NgramDrafter
from specpilot.drafters.early_exit import early_exit_model
from specpilot.engine import AcceptanceStats, SpecEngine
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.int8_copy import cheap_model, int8_nbytes
from specpilot.mechanisms.two_level import TwoLevelDrafter, TwoLevelStats
from specpilot.mechanisms.two_level_cost import predict
from specpilot.models.transformer import Transformer
from specpilot.runtime import dtype_name, load_model, parse_device, parse_dtype

LABEL = "two-level verification, SmolLM2-135M, real acceptance (eager SpecEngine, batch 1)"
SETS = ("copy-heavy", "mt-bench")
VARIANTS = ("one-level", "correct", "correct-extend")
FORWARD_REPS = 5


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    name: str
    k: int
    make: Callable[[], Drafter]


@dataclass(slots=True)
class SetRun:
    """One prompt set: its prompts, AR's outputs and tok/s, and memoised measurements."""

    name: str
    prompts: list[list[int]]
    ar_tokens: list[list[int]] = field(default_factory=list)
    ar_tok_s: float = 0.0
    agreement: dict[int, float] = field(default_factory=dict)
    """k -> teacher-forced INT8 agreement at verify width k + 1."""
    times: dict[tuple[str, int], float] = field(default_factory=dict)
    """(model, width) -> seconds of one eager forward."""
    one_level: dict[str, dict[str, Any]] = field(default_factory=dict)
    """drafter -> what the prediction needs from its one-level run."""


@dataclass(slots=True)
class Measured:
    firsts: list[list[int]] = field(default_factory=list)
    """Per prompt: the tokens of its first timed run."""
    walls: list[float] = field(default_factory=list)
    """Per prompt: the median wall of the timed repeats."""
    outputs: list[tuple[int, list[int]]] = field(default_factory=list)
    """(prompt index, tokens) of every timed run."""
    acc: AcceptanceStats = field(default_factory=AcceptanceStats)
    two_level: TwoLevelStats = field(default_factory=TwoLevelStats)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.firsts)

    @property
    def tok_s(self) -> float:
        return self.tokens / sum(self.walls) if self.walls else 0.0


def measure(
    target: Transformer, drafter: Drafter | None, sr: SetRun, args: argparse.Namespace
) -> Measured:
    """One warm-up run, then ``--repeats`` timed runs per prompt (stats from the first)."""
    eos = list(target.cfg.eos_token_ids)
    engine = SpecEngine(target, drafter)
    engine.generate([sr.prompts[0]], args.max_new, eos)  # warm-up: allocator, kernels, Triton
    m = Measured()
    for i, prompt in enumerate(sr.prompts):
        walls = []
        for rep in range(args.repeats):
            if isinstance(drafter, TwoLevelDrafter):
                drafter.stats = TwoLevelStats()
            res, wall = timed_generate(engine, prompt, args.max_new, eos)
            walls.append(wall)
            m.outputs.append((i, res.tokens))
            if rep == 0:
                m.firsts.append(res.tokens)
                m.acc.merge(res.stats)
                if isinstance(drafter, TwoLevelDrafter):
                    m.two_level.merge(drafter.stats)
        m.walls.append(statistics.median(walls))
    return m


def draft_time_per_cycle(
    target: Transformer, drafter: Drafter, sr: SetRun, args: argparse.Namespace
) -> float:
    """The drafter's seconds per cycle, from one phase-timed run on the first prompt."""
    engine = SpecEngine(target, drafter, time_phases=True)
    res = engine.generate([sr.prompts[0]], args.max_new, list(target.cfg.eos_token_ids))[0]
    return engine.times.draft / max(res.stats.cycles, 1)


def set_agreement(target: Transformer, cheap: Transformer, sr: SetRun, k: int) -> float:
    """INT8 agreement over the set's prompts + AR continuations, weighted by positions."""
    if k not in sr.agreement:
        pairs = list(zip(sr.prompts, sr.ar_tokens, strict=True))
        num = sum(
            agreement(target, cheap, p + out, k + 1, prefix=len(p)) * len(out) for p, out in pairs
        )
        sr.agreement[k] = num / max(sum(len(out) for _, out in pairs), 1)
    return sr.agreement[k]


def fwd(models: dict[str, Transformer], sr: SetRun, name: str, width: float, prefix: int) -> float:
    w = max(1, round(width))
    if (name, w) not in sr.times:
        sr.times[(name, w)] = forward_time(models[name], prefix, w, FORWARD_REPS)
    return sr.times[(name, w)]


def prediction(
    models: dict[str, Transformer], sr: SetRun, spec: DrafterSpec, ext: int, prefix: int
) -> dict[str, Any] | None:
    """``two_level_cost.predict`` for ``spec``'s one-level run on this set (None without one)."""
    one = sr.one_level.get(spec.name)
    if one is None:
        return None
    d_mean = one["drafted_per_cycle"]
    inputs: dict[str, Any] = {
        "survival": one["survival"],
        "drafted_per_cycle": d_mean,
        "context": prefix,
        "draft_ms": one["t_draft"] * 1e3,
        "verify_one_ms": fwd(models, sr, "target", 1 + d_mean, prefix) * 1e3,
    }
    if ext < 0:
        tau = 1.0 + sum(one["survival"])
        tok_s = tau / (inputs["draft_ms"] + inputs["verify_one_ms"]) * 1e3
        return {"tau": tau, "tok_s_decode": tok_s, "x1L": 1.0, "inputs": inputs}
    inputs.update(
        agreement=set_agreement(models["target"], models["cheap"], sr, spec.k),
        verify_two_ms=fwd(models, sr, "target", 2 + d_mean + ext, prefix) * 1e3,
        cheap_block_ms=fwd(models, sr, "cheap", 1 + d_mean, prefix) * 1e3,
        cheap_step_ms=fwd(models, sr, "cheap", 1, prefix) * 1e3,
    )
    ms = ("draft_ms", "verify_one_ms", "verify_two_ms", "cheap_block_ms", "cheap_step_ms")
    p = predict(one["survival"], inputs["agreement"], ext, *(inputs[n] / 1e3 for n in ms))
    return {"tau": p.tau_two, "tok_s_decode": p.tok_s_two, "x1L": p.speedup, "inputs": inputs}


def config_row(
    target: Transformer,
    sr: SetRun,
    drafter_name: str,
    variant: str,
    m: Measured,
    one_level_tok_s: float | None,
) -> dict[str, Any]:
    ar_ref = [sr.ar_tokens[i] for i, _ in m.outputs]
    got = [toks for _, toks in m.outputs]
    check = check_rows(target, [sr.prompts[i] for i, _ in m.outputs], ar_ref, got)
    equal = sum(a == b for a, b in zip(ar_ref, got, strict=True))
    row: dict[str, Any] = {
        "set": sr.name,
        "drafter": drafter_name,
        "variant": variant,
        "tau": m.acc.mean_accepted_len,
        "verifies_per_token": m.acc.cycles / max(m.tokens, 1),
        "tok_s": m.tok_s,
        "tok_s_per_prompt": [len(t) / w for t, w in zip(m.firsts, m.walls, strict=True)],
        "x1L": m.tok_s / one_level_tok_s if one_level_tok_s else None,
        "xAR": m.tok_s / sr.ar_tok_s if sr.ar_tok_s else None,
        "outputs": len(got),
        "equal_to_ar": equal,
        "near_ties": check["near_ties"],
        "forcing_mismatches": check["mismatches"],
        "forcing_ok": check["forcing"],
        "acceptance": m.acc.to_dict(),
    }
    if m.two_level.rows:
        row["cheap_per_cycle"] = m.two_level.forwards / max(m.acc.cycles, 1)
        row["two_level_stats"] = m.two_level.as_dict()
    return row


def run(args: argparse.Namespace, result: dict[str, Any], path: Path) -> list[str]:
    """Every configuration within the budget; returns the failures (empty when all is lossless)."""
    started = time.perf_counter()
    dev, dtype = parse_device(args.device), parse_dtype(args.dtype)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", dtype=dtype, device=dev)
    target, tok = loaded.model, loaded.tokenizer
    assert tok is not None
    cheap = cheap_model(target)
    draft = early_exit_model(target, args.draft_layers)
    models = {"target": target, "cheap": cheap}
    result["int8_copy_MB"] = int8_nbytes(cheap) / 1e6
    specs = [
        DrafterSpec(f"ngram-k{k}", k, partial(NgramDrafter, k=k, max_n=3)) for k in args.ngram_k
    ]
    dk = args.draft_k
    specs.append(
        DrafterSpec(f"draft{args.draft_layers}L-k{dk}", dk, partial(DraftModelDrafter, draft, k=dk))
    )
    sets = {
        name: SetRun(
            name,
            [tok.apply_chat_template(p.messages) for p in load_prompt_set(name, args.prompts)],
        )
        for name in args.sets
    }
    failures: list[str] = []
    strict = dtype == torch.float32  # fp32: any difference from AR is a failure

    def record(row: dict[str, Any]) -> None:
        result["rows"].append(row)
        path.write_text(json.dumps(result, indent=1))
        fails = not row["forcing_ok"] or (strict and row["equal_to_ar"] < row["outputs"])
        if fails:
            failures.append(f"{row['set']} {row['drafter']} {row['variant']}")
        print(short(row), flush=True)

    def spent(what: str) -> bool:
        if time.perf_counter() - started <= args.budget_s:
            return False
        result["skipped"].append(what)
        print(f"  {what}: skipped (budget of {args.budget_s:.0f} s spent)", flush=True)
        return True

    for sr in sets.values():  # AR first: every other row is compared with it
        if spent(f"{sr.name} ar"):
            continue
        m = measure(target, None, sr, args)
        sr.ar_tokens = m.firsts
        sr.ar_tok_s = m.tok_s
        record(config_row(target, sr, "-", "ar", m, None))
    for spec in specs:
        for sr in sets.values():
            if not sr.ar_tokens:
                continue
            prefix = round(statistics.fmean(len(p) for p in sr.prompts)) + args.max_new // 2
            one_tok_s: float | None = None
            for variant in VARIANTS:
                if spent(f"{sr.name} {spec.name} {variant}"):
                    continue
                t0 = time.perf_counter()
                ext = {"one-level": -1, "correct": 0, "correct-extend": args.max_extension}[variant]
                inner = spec.make()
                drafter = inner if ext < 0 else TwoLevelDrafter(inner, cheap, ext)
                m = measure(target, drafter, sr, args)
                if ext < 0:
                    one_tok_s = m.tok_s
                    sr.one_level[spec.name] = {
                        "survival": survival(m.acc),
                        "drafted_per_cycle": sum(m.acc.drafted) / max(m.acc.cycles, 1),
                        "t_draft": draft_time_per_cycle(target, inner, sr, args),
                    }
                else:
                    set_agreement(target, cheap, sr, spec.k)
                    result["agreement"].setdefault(sr.name, {})[str(spec.k)] = sr.agreement[spec.k]
                row = config_row(target, sr, spec.name, variant, m, one_tok_s)
                row["prediction"] = prediction(models, sr, spec, ext, prefix)
                row["config_s"] = time.perf_counter() - t0
                record(row)
    result["seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(result, indent=1))
    return failures


def short(row: dict[str, Any]) -> str:
    """One table line."""

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    pred = row.get("prediction") or {}
    cheap = row.get("cheap_per_cycle")
    return (
        f"{row['set']:10s} {row['drafter']:13s} {row['variant']:14s} {row['tau']:5.2f} "
        f"{row['verifies_per_token']:7.3f} {num(cheap, '5.2f'):>5s} {row['tok_s']:8.1f} "
        f"{num(row['x1L'], '5.2f'):>5s} {num(row['xAR'], '5.2f'):>5s} | "
        f"{num(pred.get('tau'), '5.2f'):>5s} {num(pred.get('x1L'), '5.2f'):>5s} | "
        f"{row['equal_to_ar']}/{row['outputs']} {'ok' if row['forcing_ok'] else 'FAIL'}"
        + (f" ({row['near_ties']} near-ties)" if row["near_ties"] else "")
    )


HEADER = (
    f"{'set':10s} {'drafter':13s} {'variant':14s} {'tau':>5s} {'ver/tok':>7s} {'cheap':>5s} "
    f"{'tok/s':>8s} {'x1L':>5s} {'xAR':>5s} | {'p.tau':>5s} {'p.x1L':>5s} | equal forcing"
)


def table(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"== {LABEL} ==",
        f"{result['machine']['device']}, {result['dtype']}, {a['prompts']} prompts x {a['max_new']}"
        f" new tokens, median of {a['repeats']}; commit {result['commit']}, {result['date']}",
        "INT8 agreement with the exact target (teacher-forced, width k+1): "
        + "; ".join(
            f"{s} " + ", ".join(f"k={k} {v:.4f}" for k, v in ks.items())
            for s, ks in result["agreement"].items()
        ),
        "cheap = INT8 forwards per cycle; p.tau, p.x1L = two_level_cost.predict",
        HEADER,
    ]
    lines += [short(r) for r in result["rows"]]
    if result["skipped"]:
        lines.append(f"skipped (budget): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (eager engine)")
    ap.add_argument("--dtype", default="fp32", help="fp32 or bf16 (bfloat16)")
    ap.add_argument("--prompts", type=int, default=4, help="first N prompts of each set")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt (median)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no configuration after this many seconds (default 180 on cuda, 1800 on cpu)",
    )
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=16, help="early-exit drafter depth")
    ap.add_argument("--max-extension", type=int, default=4, help="correct-extend's cheap tokens")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    args = ap.parse_args()
    if args.repeats < 1 or args.prompts < 1 or args.max_new < 1:
        sys.exit("--repeats, --prompts and --max-new must be at least 1.")
    if args.budget_s is None:
        args.budget_s = 180.0 if args.device.startswith("cuda") else 1800.0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "two_level_smollm2.json"
    try:
        dev = parse_device(args.device)
        result: dict[str, Any] = {
            **run_header(LABEL, args, dev),
            "dtype": dtype_name(parse_dtype(args.dtype)),
            "agreement": {},
            "rows": [],
            "skipped": [],
        }
        failures = run(args, result, path)
    except SpecPilotError as e:
        sys.exit(str(e))
    print(table(result))
    print(f"JSON: {path}")
    if failures:
        print("NOT LOSSLESS: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
