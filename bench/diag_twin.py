"""Diagnose the twin-draft-model acceptance on CUDA: eager vs graphs, with and without the gate.
python3 bench/diag_twin.py"""

import random

import torch

from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.gate import GateSettings, SpecGate
from specpilot.synthetic import build_target


def prompt(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    unit = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
    return tuple((unit * (n // len(unit) + 1))[:n])


def run(graphs: bool, gated: bool, slots: int, twin_same: bool) -> str:
    rng = random.Random(5)
    model = build_target("tiny-llama", "cuda", torch.float32, seed=2, max_positions=1024)
    twin = (
        model
        if twin_same
        else build_target("tiny-llama", "cuda", torch.float32, seed=2, max_positions=1024)
    )
    gate = (
        SpecGate(GateSettings(margin=1000.0, warmup_cycles=2, probe_cycles=2, off_tokens=3))
        if gated
        else None
    )
    engine = Engine(
        model, DraftModelDrafter(twin, k=4), graphs=graphs, attn_bucket=32, sync_every=4, gate=gate
    )
    vocab = model.cfg.vocab_size
    prompts = [prompt(rng, vocab, rng.randint(4, 40)) for _ in range(6)]
    reqs = [Request(f"r{i}", p, 40, frozenset()) for i, p in enumerate(prompts)]
    res = Scheduler(engine, slots=slots, segment_tokens=16, max_context=100).run(reqs)
    acc = [f"{r.stats.accepted}/{r.stats.drafted}" for r in res]
    return " ".join(acc)


for graphs in (False, True):
    for gated in (False, True):
        for slots in (1, 3):
            for same in (False, True):
                try:
                    out = run(graphs, gated, slots, same)
                except Exception as e:
                    out = f"ERROR {type(e).__name__}: {e}"
                print(
                    f"graphs={graphs!s:5} gate={gated!s:5} slots={slots} same={same!s:5}: {out}",
                    flush=True,
                )
