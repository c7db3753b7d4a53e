"""Train a learned drafter (DFlash or EAGLE-3) for a target: regenerate responses, then the
kind's loss on online target features, under a wall-clock budget, resumable, with a progress
line and held-out τ.

Phases (each bounded, each resumable after a kill):

1. **responses** — ShareGPT's first human turns through the target's chat template, answered by
   the target greedily in batches (``train/data.py``), into ``<out>/responses`` until the
   generation budget or the prompt limit is reached; then the recipe fits what the data decides
   (EAGLE-3: its draft vocabulary), kept in ``<out>``;
2. **training** — per step a batch of prompt+response sequences; the target runs once over them
   (no grad) for the hidden states of the layers the recipe reads; the recipe's loss (DFlash's
   block loss, ``train/dflash_loss.py``; EAGLE-3's TTT loss, ``train/eagle3_recipe.py``) under
   bf16 autocast on a GPU; AdamW, warm-up then cosine decay over the step or time budget,
   gradient clipping. Every ``checkpoint_s`` an atomic checkpoint (``train/checkpoint.py``:
   weights, optimizer, step, epoch and position in the epoch);
3. **result** — ``<out>/drafter`` in the kind's published format (config.json + safetensors,
   bf16), loaded back by the loader the commands use, and its τ on the held-out sets measured
   by the real engine (``train/evaluate.py``); ``<out>/report.json``.

What is particular to a drafter kind (its network, loss and format) is its recipe
(``train/recipe.py``); data, features, schedule, checkpoints, budget and τ are shared.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specpilot.errors import SpecPilotError
from specpilot.models.kv_cache import KVCache
from specpilot.train import data as D
from specpilot.train.checkpoint import load_checkpoint, save_checkpoint
from specpilot.train.kinds import recipes
from specpilot.train.recipe import Recipe
from specpilot.train.settings import TrainSettings

if TYPE_CHECKING:
    from torch import nn

    from specpilot.models.transformer import Transformer


@dataclass(slots=True)
class Progress:
    """One status line, rewritten in place on a terminal, printed as lines otherwise."""

    t0: float = field(default_factory=time.monotonic)
    tty: bool = field(default_factory=lambda: sys.stderr.isatty())
    last: float = 0.0

    def __call__(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        stamp = f"[{int(now - self.t0) // 60:02d}:{int(now - self.t0) % 60:02d}] "
        if self.tty and not final:
            print("\r" + stamp + text[:150].ljust(150), end="", file=sys.stderr, flush=True)
        elif final or now - self.last >= 10.0:
            print(stamp + text, file=sys.stderr, flush=True)
            self.last = now


def train(settings: TrainSettings, log: Callable[..., None] | None = None) -> dict[str, Any]:
    """Run the three phases; returns the report (also written to ``<out>/report.json``)."""
    from specpilot.engine import Engine
    from specpilot.runtime import load_model, parse_device, parse_dtype
    from specpilot.train.evaluate import TauMeter

    s = settings
    show = log or Progress()
    start = time.monotonic()
    budget = None if s.minutes is None else s.minutes * 60.0
    device, dtype = parse_device(s.device), parse_dtype(s.dtype)
    graphs = device.type == "cuda" if s.graphs is None else s.graphs
    torch.manual_seed(s.seed)
    s.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(s.target, dtype, device, max_context=4096)
    target, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise SpecPilotError(f"{s.target} has no tokenizer; train-drafter needs one.")
    eos = tok.eos_token_ids
    recipe = recipes()[s.kind]
    net = recipe.create(target, tok, s, s.out)

    # ---------------------------------------------------------------- prompts and responses
    prompts = D.split_prompts(D.read_sharegpt(s.data))
    texts = prompts.train[s.first_prompt :]
    limit = len(texts) if s.train_prompts is None else min(s.train_prompts, len(texts))

    def encode(text: str) -> list[int] | None:
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        return list(ids) if len(ids) <= s.max_prompt else None

    store = D.ResponseStore(s.out / "responses", target.cfg.vocab_size)
    gen_deadline = start + (budget * s.gen_fraction if budget is not None else math.inf)
    if store.next_prompt < limit and time.monotonic() < gen_deadline:
        cap = s.max_prompt + s.max_new + 64
        D.generate_responses(
            lambda: Engine(target, graphs=graphs, capacity=cap), store, texts[:limit],
            encode, eos, s.max_new, s.gen_batch, gen_deadline, show,
        )  # fmt: skip
    samples = store.load()
    if not samples:
        raise SpecPilotError("No responses were generated; give more --minutes.")
    tokens_total = sum(len(x.tokens) for x in samples)
    show(f"{len(samples):,} training sequences, {tokens_total:,} tokens", True)
    fitted = recipe.fit(net, samples, s.out)
    if fitted:
        show(fitted, True)

    def held_out(n: int) -> dict[str, list[list[int]]]:
        from specpilot.bench.prompts import load_prompt_set

        out = {}
        for name in s.eval_sets:
            texts = prompts.held_out if name == "sharegpt" else [p.messages[0]["content"] for p in load_prompt_set(name)]  # fmt: skip
            out[name] = [e for e in (encode(t) for t in texts) if e is not None][:n]
        return out

    # ---------------------------------------------------------------- training
    drafter = recipe.eval_drafter(target, net)
    meter = TauMeter(target, drafter, held_out(s.eval_prompts), s.eval_new, eos, s.eval_prompts, graphs)  # fmt: skip
    reserve = 0.0 if budget is None else max(20.0, 0.1 * budget)  # saving and the final τ
    until = None if budget is None else start + budget - reserve
    state = _train_steps(s, recipe, net, target, samples, until, show, lambda: meter.measure(lambda: recipe.sync(drafter, net)))  # fmt: skip

    # ---------------------------------------------------------------- the result
    drafter_dir = recipe.save(net, s.out / "drafter")
    check = recipe.load(target, drafter_dir)  # loaded as the commands load it
    n = max(1, min(s.final_eval_prompts, 32))
    tau = TauMeter(target, check, held_out(s.final_eval_prompts), s.eval_new, eos, n, graphs).measure()  # fmt: skip
    report = {
        "drafter": str(drafter_dir),
        "kind": s.kind,
        "params": sum(p.numel() for p in net.parameters()),
        "bytes": sum(f.stat().st_size for f in drafter_dir.glob("*.safetensors")),
        "steps": state["step"],
        "epochs": state["epoch"] + state["pos"] / max(1, len(samples)),
        "sequences": len(samples),
        "tokens": tokens_total,
        "loss": state.get("loss"),
        "acc1": state.get("acc1"),
        "tau_periodic": state.get("tau", {}),
        "tau_final": tau,
        "eval": {"prompts_per_set": s.final_eval_prompts, "max_new_tokens": s.eval_new},
        "wall_s": time.monotonic() - start,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
    }
    (s.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    taus = " ".join(f"{k} {v:.2f}" for k, v in tau.items())
    show(f"wrote {drafter_dir} ({report['bytes'] / 1e6:.1f} MB, loads); held-out τ {taus}", True)
    return report


def _train_steps(
    s: TrainSettings,
    recipe: Recipe,
    net: nn.Module,
    target: Transformer,
    samples: list[D.Sample],
    until: float | None,
    show: Callable[..., None],
    measure: Callable[[], dict[str, float]],
) -> dict[str, Any]:
    """Optimizer steps until ``--steps`` or the monotonic time ``until``; checkpoints on the
    way and at the end; returns the training state."""
    device = target.device
    autocast = device.type == "cuda" and target.dtype != torch.float32
    layers = recipe.hidden_layers(net)
    peak = recipe.default_lr if s.lr is None else s.lr
    opt = torch.optim.AdamW(net.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.01)
    ckpts = s.out / "checkpoints"
    state = load_checkpoint(ckpts, net, opt) or {"step": 0, "epoch": 0, "pos": 0, "tau": {}}
    if state["step"]:
        show(f"resumed at step {state['step']} (epoch {state['epoch']}, sequence {state['pos']})", True)  # fmt: skip
    cache = KVCache.allocate(target.cfg, s.batch, s.seq_len, target.dtype, device)
    gen = torch.Generator().manual_seed(s.seed * 7919 + state["step"])
    t0 = last_ckpt = last_eval = time.monotonic()
    loss_avg, acc_avg = math.nan, math.nan

    def time_frac() -> float:
        return 0.0 if until is None else (time.monotonic() - t0) / max(until - t0, 1e-9)

    def finished() -> bool:
        return (s.steps is not None and state["step"] >= s.steps) or time_frac() >= 1.0

    # The cosine follows the steps when they are given (one schedule across resumed runs; the
    # minutes only stop a run), else this run's share of the time budget.
    while not finished():
        for pos, tokens, mask in D.batches(samples, s.batch, s.seq_len, s.seed, state["epoch"], state["pos"]):  # fmt: skip
            if finished():
                break
            frac = state["step"] / s.steps if s.steps is not None else time_frac()
            warm = min(1.0, (state["step"] + 1) / max(1, s.warmup))
            lr = peak * warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr
            tokens, mask = tokens.to(device), mask.to(device)
            with torch.no_grad():  # the target's features, online
                rows = torch.zeros(tokens.shape[0], 1, dtype=torch.int64, device=device)
                out = target.forward(tokens, cache.slice(0, tokens.shape[0]), logits_rows=rows, hidden_layers=layers)  # fmt: skip
                hidden = torch.stack([out.hidden[i] for i in layers])  # [n, b, S, H]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                res = recipe.loss(net, hidden, tokens, mask, gen)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), recipe.max_grad_norm)
            opt.step()
            state["step"], state["pos"] = state["step"] + 1, pos
            lv, acc1 = float(res.loss.detach()), (res.accuracy[0] if res.accuracy else math.nan)
            loss_avg = lv if math.isnan(loss_avg) else 0.95 * loss_avg + 0.05 * lv
            if not math.isnan(acc1):
                acc_avg = acc1 if math.isnan(acc_avg) else 0.95 * acc_avg + 0.05 * acc1
            state["loss"], state["acc1"] = loss_avg, acc_avg
            if time.monotonic() - last_eval >= s.eval_every_s:
                state["tau"] = measure()
                last_eval = time.monotonic()
            if time.monotonic() - last_ckpt >= s.checkpoint_s:
                save_checkpoint(ckpts, net, opt, state)
                last_ckpt = time.monotonic()
            taus = " ".join(f"{k} {v:.2f}" for k, v in state["tau"].items())
            steps = f"/{s.steps}" if s.steps else ""
            show(f"step {state['step']}{steps} epoch {state['epoch']} loss {loss_avg:.3f} "
                 f"acc@1 {acc_avg:.3f} lr {lr:.1e}" + (f" | τ {taus}" if taus else ""))  # fmt: skip
        else:
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
    save_checkpoint(ckpts, net, opt, state)
    return state
