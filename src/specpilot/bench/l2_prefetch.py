"""For ``bench/l2_prefetch_gpu.py``: the micro grid's prefetch variants and the pick of the best
that the mechanism's knobs express; end to end, AR decode with mechanism ``l2-prefetch`` off and
on; and the script's printed table.

One target (the llama3-8b shape with random bf16 weights on CUDA; ``tiny-llama`` in fp32 on the
CPU) and one engine per arm, each built by ``build_engine`` — the composition root every command
uses — from an engine config that enables the mechanism with the arm's knobs (on the CPU, where
the registry does not offer it, ``install`` is called directly: the prefetch is a no-op there).
The arms share the target's weights, so each arm's hooks are attached only while that arm runs
(``L2Prefetch.attach`` / ``detach``): a graph captured during an arm holds exactly that arm's
prefetches. Arms run in interleaved rounds after a warm-up round (``bench/protocol.py``); the
rate is decode tokens per second after the first commit (prefill and the first read-back
excluded). Every arm's tokens must equal the off arm's: the kernels are the same.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specpilot.bench import script
from specpilot.bench.protocol import Sample, interleave
from specpilot.engine import Engine
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.kernels.l2_prefetch import PrefetchSpec
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.l2_prefetch import L2Prefetch, MiB, install, installed, l2_bytes
from specpilot.mechanisms.l2_prefetch_cost import ASSUMPTIONS, predict
from specpilot.runtime import LoadedModel
from specpilot.synthetic import build_target

NAME = "l2-prefetch"


@dataclass(frozen=True, slots=True)
class Variant:
    nbytes: int  # 0: no prefetch
    stream: str = "side"
    spec: PrefetchSpec = field(default_factory=PrefetchSpec)

    def knobs(self) -> dict[str, Any] | None:
        """The mechanism's knobs for this variant (None: not expressible, e.g. another chunk;
        the tiny sizes of ``--tiny`` map to 1 MiB)."""
        if not self.nbytes or self.spec.chunk:
            return None
        return {
            "phases": "all",
            "mb": max(1, round(self.nbytes / MiB)),
            "stream": self.stream,
            "instruction": self.spec.instruction,
            "programs": self.spec.programs,
        }

    @property
    def name(self) -> str:
        if not self.nbytes:
            return "none"
        s = self.spec
        chunk = f"/{s.chunk_bytes >> 10}K" if s.instruction == "bulk" else ""
        return f"{self.nbytes / MiB:g}M {self.stream} {s.instruction}{chunk} p{s.programs}"


def variants(tiny: bool, mibs: list[float]) -> list[Variant]:
    unit = 1024 if tiny else MiB
    out = [Variant(0)]
    for x in mibs:
        for stream in ("side", "same"):
            for instr in ("bulk", "line"):
                out.append(Variant(int(x * unit), stream, PrefetchSpec(instr, 8)))
    mid = int(16 * unit)
    out += [Variant(mid, "side", PrefetchSpec("bulk", p)) for p in (2, 32)]
    out += [Variant(mid, "side", PrefetchSpec("line", 32))]
    out += [Variant(mid, "side", PrefetchSpec("bulk", 8, chunk=c)) for c in (4096, 65536)]
    return out


def pick_best(micro: dict[str, Any], tiny: bool, mibs: list[float]) -> dict[str, Any]:
    """Of the variants the mechanism's knobs can express, the one with the largest median saving
    summed over the pairs, each weighted by how often a layer has it (attention → o once; a norm
    before a matrix three times: qkv, gate_up, and down after SiLU·mul)."""
    knobs = {v.name: v.knobs() for v in variants(tiny, mibs)}
    total: dict[str, float] = {}
    for pair, res in micro.items():
        if not isinstance(res, dict) or "variants" not in res:
            continue
        weight = 1.0 if pair.startswith("attention") else 1.5
        for name, row in res["variants"].items():
            if knobs.get(name) is not None:
                total[name] = total.get(name, 0.0) + weight * row["saved_s"]["median"]
    name = max(total, key=lambda n: total[n]) if total else None
    return {"name": name, "knobs": knobs.get(name) if name else None, "scores": total}


def arm_knobs(best: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Label → knobs: the mechanism's defaults, the micro-bench's best variant, and that variant
    on the other stream."""
    default = MECHANISMS[NAME].resolve_knobs({})
    out = {"defaults": default}
    if best:
        b = MECHANISMS[NAME].resolve_knobs(dict(best))
        other = {**b, "stream": "same" if b["stream"] == "side" else "side"}
        if b == default:
            b = {**b, "mb": min(2 * b["mb"], 48)}
        out["best micro"] = b
        out["best micro, other stream"] = other
    return {f"{label}: {_short(k)}": k for label, k in out.items()}


def _short(k: Mapping[str, Any]) -> str:
    return f"{k['phases']} {k['mb']}M {k['stream']} {k['instruction']} p{k['programs']}"


def _engine(
    loaded: LoadedModel, dep: DeploymentSpec, knobs: dict[str, Any] | None, cpu: bool
) -> tuple[Engine, L2Prefetch | None]:
    mechanisms = {NAME: knobs} if knobs is not None and not cpu else {}
    build = build_engine(EngineConfig(dep, k=0, mechanisms=mechanisms), target=loaded)
    pf = None
    if knobs is not None:
        pf = install(loaded.model, **knobs) if cpu else installed(loaded.model)
        assert pf is not None
    engine = build.engine()
    if pf is not None:
        pf.detach()
    return engine, pf


def run_e2e(
    device: torch.device,
    best: Mapping[str, Any] | None,
    contexts: list[int],
    new_tokens: int,
    rounds: int,
    deadline: float,
    bandwidth_Bps: float,
    launch_s: float,
    windows: Mapping[str, float],
) -> dict[str, Any]:
    """Per context: off vs each arm of :func:`arm_knobs`; ratios per round, predictions beside."""
    cpu = device.type == "cpu"
    shape, dtype = ("tiny-llama", torch.float32) if cpu else ("llama3-8b", torch.bfloat16)
    model = build_target(
        shape, device, dtype, seed=0, max_positions=max(contexts) + new_tokens + 64
    )
    loaded = LoadedModel(spec=f"{shape} (random weights)", model=model, tokenizer=None)
    dep = DeploymentSpec(
        target=shape, drafter="none", dtype="fp32" if cpu else "bf16", device=device.type
    )
    arms = arm_knobs(best)
    engines = {"off": _engine(loaded, dep, None, cpu)}
    engines |= {label: _engine(loaded, dep, k, cpu) for label, k in arms.items()}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"shape": shape, "assumptions": ASSUMPTIONS}
    for ctx in contexts:
        if time.perf_counter() > deadline:
            out[str(ctx)] = "skipped: budget"
            continue
        prompt = torch.randint(0, model.cfg.vocab_size, (ctx,), generator=gen).tolist()
        fns = {
            label: (lambda e=e, p=p, q=prompt: decode_sample(e, p, q, new_tokens))
            for label, (e, p) in engines.items()
        }
        m = interleave(fns, rounds=rounds, warmup=1, deadline=deadline)
        ref = m.last("off").payload
        res: dict[str, Any] = {
            "off_tok_s": m.tok_s("off"),
            "tokens_equal": all(m.last(a).payload == ref for a in engines),
            "rounds": len(m.samples["off"]),
            "arms": {},
        }
        step_s = 1.0 / m.tok_s("off")
        for label, knobs in arms.items():
            pred = predict(
                model.cfg, bandwidth_Bps, launch_s, knobs["phases"], knobs["mb"],
                knobs["stream"], context=ctx, l2_bytes=l2_bytes(device),
                dtype_bytes=model.embed.element_size(), windows=_windows(windows, ctx),
            )  # fmt: skip
            pf = engines[label][1]
            res["arms"][label] = {
                "knobs": knobs,
                "tok_s": m.tok_s(label),
                "ratio": m.ratio(label, "off").to_dict(),
                "predicted_saved_s_per_step": pred.saved_s,
                "predicted_speedup": pred.speedup(step_s),
                "issued": pf.issued if pf is not None else 0,
            }
        out[str(ctx)] = res
    return out


def decode_sample(
    engine: Engine, pf: L2Prefetch | None, prompt: list[int], new_tokens: int
) -> Sample:
    """:func:`~specpilot.bench.script.decode_sample` with the arm's hooks attached."""
    if pf is not None:
        pf.attach()
    try:
        return script.decode_sample(engine, prompt, new_tokens)
    finally:
        if pf is not None:
            pf.detach()


def _windows(measured: Mapping[str, float], ctx: int) -> dict[str, float]:
    """Idle windows by point from the micro-bench (its ``norm`` and ``attention`` phases); the
    attention window was measured at a 512-token cache, so it is used at that context only."""
    out: dict[str, float] = {}
    if "norm" in measured:
        out |= {p: measured["norm"] for p in ("input_norm", "post_attn_norm", "silu_mul")}
    if "attention" in measured and ctx <= 512:
        out["attention"] = measured["attention"]
    return out


def table(out: dict[str, Any]) -> str:
    """The short table ``bench/l2_prefetch_gpu.py`` prints last, from its JSON."""
    lines = []
    sec = out["sections"]
    c = sec.get("checks", {})
    if isinstance(c, dict) and c:
        lines.append(
            f"checks: ptx bulk {c['ptx_has_bulk']} line {c['ptx_has_line']}; copy "
            f"{c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; smallest prefetch launch "
            f"{c['launch_s'] * 1e6:.2f} us; L2 {c['l2_bytes'] / MiB:.0f} MiB"
        )
    for size, row in (sec.get("efficacy") or {}).items():
        if isinstance(row, dict):
            parts = [f"{n} {v['s'] * 1e6:.1f}us ({100 * v['l2_fraction']:.0f}% L2)"
                     for n, v in row.items() if isinstance(v, dict)]  # fmt: skip
            lines.append(
                f"efficacy {size}: cold {row['cold_s'] * 1e6:.1f}us warm "
                f"{row['warm_read_s'] * 1e6:.1f}us | " + "; ".join(parts)
            )
    for pair, res in (sec.get("micro") or {}).items():
        if not isinstance(res, dict):
            lines.append(f"micro {pair}: {res}")
            continue
        base = res["variants"]["none"]["segment_s"]["median"]
        lines.append(
            f"micro {pair}: none {base * 1e6:.2f}us/segment (idle {res['window_s'] * 1e6:.2f}us, "
            f"gemv {res['gemv_s']['median'] * 1e6:.2f}us), outputs equal {res['outputs_equal']}"
        )
        ranked = sorted(res["variants"].items(), key=lambda kv: -kv[1]["saved_s"]["median"])
        for name, row in ranked[:4]:
            s = row["saved_s"]
            lines.append(
                f"   {name:28s} saved {s['median'] * 1e6:+.2f}us ({s['lo'] * 1e6:+.2f}.."
                f"{s['hi'] * 1e6:+.2f}) predicted {row['predicted_saved_s'] * 1e6:+.2f}us"
            )
    best = sec.get("best")
    if best:
        lines.append(f"best micro variant: {best['name']}")
    for ctx, res in (sec.get("e2e") or {}).items():
        if ctx in ("shape", "assumptions"):
            continue
        if not isinstance(res, dict) or "arms" not in res:
            lines.append(f"e2e {ctx}: {res if not isinstance(res, dict) else res.get('error')}")
            continue
        lines.append(
            f"e2e ctx {ctx}: off {res['off_tok_s']:.1f} tok/s, tokens equal {res['tokens_equal']}"
        )
        for label, arm in res["arms"].items():
            lines.append(
                f"   {label:40s} {arm['tok_s']:.1f} tok/s  x{arm['ratio']['median']:.3f} "
                f"({arm['ratio']['lo']:.3f}-{arm['ratio']['hi']:.3f}) {arm['ratio']['verdict']}; "
                f"predicted x{arm['predicted_speedup']:.3f}; prefetches {arm['issued']}"
            )
    return "\n".join(lines)


__all__ = ["Variant", "arm_knobs", "decode_sample", "pick_best", "run_e2e", "table", "variants"]
