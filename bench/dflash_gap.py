"""Training-style per-row accuracy of the shipped DFlash drafter on AR continuations of prompts,
vs the engine's acceptance on the same prompts (CPU, fp32).
    python3 bench/dflash_gap.py mt-bench|humaneval|train|heldsg [N]"""

import os
import sys
from pathlib import Path

import torch

from specpilot.bench.prompts import load_prompt_set
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.stats import AcceptanceStats
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.runtime import load_model
from specpilot.train.dflash_loss import block_hidden, make_blocks

torch.manual_seed(0)
torch.set_num_threads(1)
lm = load_model("smollm2-135m")
target, tok = lm.model, lm.tokenizer
drafter = DFlashDrafter.load(
    target, str(Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-dflash")
)
net = drafter.net
spec = net.spec
print("spec", spec.target_layer_ids, spec.block_size, spec.mask_token_id, net.dtype)
setname = sys.argv[1] if len(sys.argv) > 1 else "mt-bench"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
if setname in ("train", "heldsg"):
    from specpilot.train.data import read_sharegpt, split_prompts

    sp = split_prompts(
        read_sharegpt(os.environ.get("SHAREGPT", ".carry/sg/sharegpt_human.json.gz"))
    )
    src = sp.train[:n] if setname == "train" else sp.held_out[:n]
    encs = [tok.apply_chat_template([{"role": "user", "content": t}])[:300] for t in src]
else:
    prompts = load_prompt_set(setname, limit=n)
    encs = [tok.apply_chat_template(p.messages) for p in prompts]
eos = frozenset(tok.eos_token_ids)
MAXNEW = 96
# AR responses and engine acceptance
ar = Scheduler(Engine(target, None, capacity=1024), slots=1, max_context=900)
seqs = []
for i, e in enumerate(encs):
    r = next(iter(ar.run([Request(f"ar{i}", tuple(e), MAXNEW, eos)])))
    seqs.append((list(e), list(r.tokens)))
eng = Engine(target, drafter, capacity=1024)
sch = Scheduler(eng, slots=1, max_context=900)
tot = AcceptanceStats()
for i, (e, resp) in enumerate(seqs):
    r = next(iter(sch.run([Request(f"s{i}", tuple(e), MAXNEW, eos)])))
    assert list(r.tokens) == resp, "spec != AR"
    tot.merge(r.stats)
print("engine tau", tot.mean_accepted_len)
# training-style: every response position as anchor
fwd = Forward(net, layers=net.decoder_layers(), use_triton=False, fuse_residual=False)
accs = []
taus = []
for e, resp in seqs:
    toks = torch.tensor([e + resp])
    S = toks.shape[1]
    mask = torch.zeros(1, S, dtype=torch.bool)
    mask[0, len(e) :] = True
    cache = KVCache.allocate(target.cfg, 1, S + 8, target.dtype, target.device)
    rows = torch.zeros(1, 1, dtype=torch.int64)
    with torch.no_grad():
        out = target.forward(toks, cache, logits_rows=rows, hidden_layers=spec.target_layer_ids)
        hidden = torch.stack([out.hidden[i] for i in spec.target_layer_ids])
        # anchors: the last prompt token too (the first block at inference starts at it)
        anc = torch.arange(len(e) - 1, S - 1)[None]
        keep = torch.ones_like(anc, dtype=torch.bool)
        m2 = mask.clone()
        m2[0, len(e) - 1] = True
        bl = make_blocks(toks, m2, anc, keep, spec.block_size, spec.mask_token_id, 7.0)
        h = block_hidden(net, fwd, hidden.to(net.dtype), bl, net.dtype)
        logits = net.logits(fwd, h).view(1, anc.shape[1], spec.block_size, -1)
        pred = logits.argmax(-1)[0]  # [N, B]
        lab = bl.labels[0]
        inside = bl.weights[0] > 0
        hit = (pred == lab) & inside
        accs.append(hit[:, 1:].float().sum(0) / inside[:, 1:].float().sum(0).clamp(min=1))
        # accept length per anchor
        run = torch.cumprod(hit[:, 1:].int(), dim=1).sum(1)
        taus.append(1 + run.float())
a = torch.stack(accs).mean(0)
print("train-style acc per row", [round(float(x), 3) for x in a[:8]])
print("train-style tau (all anchors)", float(torch.cat(taus).mean()))
