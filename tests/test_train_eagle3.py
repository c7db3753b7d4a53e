"""``specpilot train-drafter --kind eagle3``: the draft vocabulary, the TTT forward against the
loaded drafter's inference forward, a drafter that learns a sequence (τ by the real engine), and
the command end to end on the CPU: a loadable, lossless drafter, and a killed run resumed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import tiny_config, tiny_model
from engine_cases import ar_tokens
from specpilot.cli import main
from specpilot.drafters.eagle3 import Eagle3Drafter
from specpilot.engine import Engine, generate
from specpilot.models.eagle3 import Eagle3Net
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer
from specpilot.train.data import Sample
from specpilot.train.eagle3_recipe import (
    Eagle3Recipe,
    draft_vocab,
    new_spec,
    target_probs,
    ttt_hidden,
    ttt_loss,
)
from specpilot.train.evaluate import TauMeter
from test_cli import tiny_dir
from test_train_drafter import tiny_sharegpt


def greedy_sequence(target: Transformer, rng: random.Random, prompt_len: int, new: int) -> Sample:
    """A prompt and the target's own greedy continuation (what train-drafter trains on)."""
    prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(prompt_len)]
    return Sample(prompt + ar_tokens(target, [prompt], new)[0], prompt_len)


def features(target: Transformer, net: Eagle3Net, recipe: Eagle3Recipe, tokens: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """What the training loop hands the loss: ``[4, b, S, H]`` (aux layers, then the last)."""
    layers = recipe.hidden_layers(net)
    cache = KVCache.allocate(target.cfg, tokens.shape[0], tokens.shape[1], torch.float32, "cpu")
    with torch.no_grad():
        out = target.forward(tokens, cache, hidden_layers=layers)
    return torch.stack([out.hidden[i] for i in layers])


def training_fwd(recipe: Eagle3Recipe) -> Forward:
    """The Forward the recipe's loss runs (torch ops, stock rounding order)."""
    assert recipe._fwd is not None
    return recipe._fwd


def test_draft_vocab_is_the_most_frequent_response_tokens() -> None:
    samples = [Sample([9, 9, 9, 9, 5, 5, 7, 3], 4), Sample([9, 9, 7, 5, 7], 2)]
    # responses: 5 5 7 3 | 7 5 7 → 7: 3, 5: 3, 3: 1; the prompt's 9s do not count
    ids, share = draft_vocab(samples, 12, 2)
    assert ids.tolist() == [5, 7] and share == pytest.approx(6 / 7)
    ids, share = draft_vocab(samples, 12, 3)
    assert ids.tolist() == [3, 5, 7] and share == 1.0
    assert draft_vocab(samples, 12, 5)[0].tolist() == [0, 1, 3, 5, 7]  # then lowest unseen ids
    assert draft_vocab(samples, 12, 12)[0].tolist() == list(range(12))  # the full vocabulary


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ttt_steps_equal_the_loaded_drafters_inference_forward(tmp_path: Path, arch: str) -> None:
    """Step 0 of the training forward equals what the saved-then-loaded drafter computes in the
    engine after a prompt (the kept output and the first draft); step k equals its midlayer run
    k steps past a context, fed the true tokens (the drafts it would make if all were right)."""
    rng = random.Random(arch)
    target = tiny_model(tiny_config(arch=arch, layers=4, vocab=89), 3)
    seqs = [greedy_sequence(target, rng, 6, 24) for _ in range(2)]
    recipe = Eagle3Recipe()
    net = recipe.build(target, new_spec(target, 40, 48), 0)
    net.init_random(5, std=0.2)  # not the small init: every part must show
    with torch.no_grad():  # bf16-exact weights, so that the (bf16) save loads them unchanged
        for p in net.parameters():
            p.copy_(p.bfloat16().float())
    recipe.fit(net, seqs, tmp_path)
    assert net.t2d.sum() == 40 and (tmp_path / "draft_vocab.json").is_file()
    tokens = torch.tensor([s.tokens for s in seqs])  # [2, 30]
    hidden = features(target, net, recipe, tokens)
    with torch.no_grad():
        outs = ttt_hidden(net, training_fwd(recipe), hidden[:3], tokens, 4)  # 4 × [2*30, H]
    drafter = recipe.load(target, recipe.save(net, tmp_path / "drafter"))
    assert isinstance(drafter, Eagle3Drafter)
    dnet, s = drafter.net, tokens.shape[1]
    for row, seq in enumerate(seqs):
        for length in (7, 13, 22):
            engine = Engine(target, drafter)
            engine.open(1, 64)
            engine.prefill([0], [seq.tokens[:length]], [0], [length], [8])
            assert engine.host.contexts[0][-1] == seq.tokens[length]  # the target's greedy token
            want = outs[0][row * s + length - 1]  # row L-1 reads (g_{L-1}, x_L)
            assert drafter.out_tail is not None
            torch.testing.assert_close(drafter.out_tail[0], want, rtol=1e-4, atol=1e-5)
            with torch.inference_mode():
                drafter.propose(engine, drafter.attn_len(engine, max(engine.host.lens)))
            scores = net.draft_scores(training_fwd(recipe), want[None])
            assert int(engine.state.drafts[0, 0]) == int(net.to_target(scores.argmax(-1))[0])
            # steps 1..3: the loaded midlayer, one row per step past the context rows 0..L-1
            cache = KVCache.allocate(dnet.cfg, 1, 64, torch.float32, "cpu")
            g = dnet.features(hidden[:3, row : row + 1, :length])[0]  # [L, H]
            lay = DenseLayout.build(torch.tensor([0]), length, length, drafter.fwd.groups, torch.float32)  # fmt: skip
            nxt = torch.tensor(seq.tokens[1 : length + 1])
            h = dnet.step(drafter.fwd, g, nxt, cache, lay)[-1:]
            for k in range(1, 4):
                slot = torch.tensor([length - 1 + k])
                lay = DenseLayout.build(slot, 1, length + k, drafter.fwd.groups, torch.float32)
                h = dnet.step(drafter.fwd, h, torch.tensor([seq.tokens[length + k]]), cache, lay)
                # fp32 rounding compounds over the steps (two summation orders, std-0.2 weights):
                # CI saw 2.9e-5 at step 3; a wrong step differs by O(1)
                torch.testing.assert_close(h[0], outs[k][row * s + length - 1], rtol=1e-3, atol=1e-4)  # fmt: skip


def test_ttt_loss_falls_and_the_drafter_learns_a_sequence(tmp_path: Path) -> None:
    """A few dozen steps on one regenerated sequence: the TTT loss falls towards the target's
    entropy, and the real engine's τ on that prompt rises above 1.5 (about 1 untrained), its
    output still AR's."""
    target = tiny_model(tiny_config(layers=4, vocab=61), 0)
    seq = greedy_sequence(target, random.Random(0), 5, 40)
    recipe = Eagle3Recipe()
    net = recipe.build(target, new_spec(target, 32, 64), 0)
    recipe.fit(net, [seq], tmp_path)
    tokens = torch.tensor([seq.tokens] * 2)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, seq.prompt_len :] = True
    hidden = features(target, net, recipe, tokens)
    prompt = seq.tokens[: seq.prompt_len]

    def tau() -> float:
        drafter = recipe.eval_drafter(target, net)
        assert generate(Engine(target, drafter), [prompt], 40)[0].tokens == seq.tokens[seq.prompt_len :]  # fmt: skip
        return TauMeter(target, drafter, {"seq": [prompt]}, 40, (), 1, False).measure()["seq"]

    before = tau()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        res = ttt_loss(net, training_fwd(recipe), hidden, tokens, mask, 7)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    assert len(res.accuracy) == 7 and res.tokens > 0
    # The soft cross-entropy cannot fall below the target's own entropy: its excess (the KL to
    # the target) must halve.
    probs, _ = target_probs(target, net, hidden[3])  # [2*S, Vd]
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).view(2, -1)[:, seq.prompt_len :]
    floor = float(entropy.mean())
    first, last = sum(losses[:5]) / 5 - floor, sum(losses[-5:]) / 5 - floor
    assert 0 < last < 0.5 * first, (floor, losses)
    after = tau()
    assert before < 1.3 and after > 1.5, (before, after)


def run_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train-drafter", "--kind", "eagle3", "--target", str(model), "--data", str(data),
            "--out", str(out), "--smoke", "--eval-sets", "sharegpt", *extra]  # fmt: skip


def test_smoke_writes_a_loadable_lossless_drafter(tmp_path: Path) -> None:
    from specpilot.runtime import load_model

    model = tiny_dir(tmp_path / "model", vocab=10)
    data = tiny_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "run"
    assert main(run_args(model, data, out, "--draft-vocab", "6")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "eagle3" and report["steps"] == 3 and report["tau_final"]["sharegpt"] >= 1.0  # fmt: skip
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 6
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 10
    with safe_open(str(out / "drafter" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"} <= names
    assert "embed_tokens.weight" not in names
    chosen = json.loads((out / "draft_vocab.json").read_text())["target_ids"]
    assert (torch.arange(6) + d2t).tolist() == chosen and t2d.nonzero().flatten().tolist() == chosen  # fmt: skip
    target = load_model(str(model)).model
    drafter = Eagle3Drafter.load(target, out / "drafter")
    assert drafter.net.spec.aux_layer_ids == tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # fmt: skip
    rng = random.Random(1)
    prompts = [[rng.randrange(10) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    assert [r.tokens for r in generate(Engine(target, drafter), prompts, 24)] == ar_tokens(target, prompts, 24)  # fmt: skip
    code = main(["generate", "hello world", "--target", str(model), "--drafter", "eagle3",
                 "--draft-model", str(out / "drafter"), "--max-new-tokens", "8", "--device", "cpu"])  # fmt: skip
    assert code == 0


class Killed(Exception):
    pass


def test_a_killed_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    """Killed right after step 3's checkpoint, the same command continues from step 3 with the
    same draft vocabulary, and ends with the weights of a run that was never killed."""
    from specpilot.train.loop import train
    from specpilot.train.settings import TrainSettings, smoke

    model = tiny_dir(tmp_path / "model", vocab=10)
    data = tiny_sharegpt(tmp_path / "sharegpt.json")

    def settings(out: str) -> TrainSettings:
        base = TrainSettings(target=str(model), out=tmp_path / out, kind="eagle3", data=str(data),
                             steps=6, draft_vocab=7, eval_sets=("sharegpt",), checkpoint_s=0.0)  # fmt: skip
        return smoke(base)

    lines: list[str] = []

    def killer(text: str, final: bool = False) -> None:
        lines.append(text)
        if text.startswith("step 3/"):
            raise Killed

    with pytest.raises(Killed):
        train(settings("killed"), killer)
    assert not (tmp_path / "killed" / "drafter").exists()
    vocab = (tmp_path / "killed" / "draft_vocab.json").read_text()
    resumed = train(settings("killed"), lambda text, final=False: lines.append(text))
    assert resumed["steps"] == 6 and any(t.startswith("resumed at step 3") for t in lines)
    assert (tmp_path / "killed" / "draft_vocab.json").read_text() == vocab
    whole = train(settings("whole"), lambda text, final=False: None)
    assert whole["steps"] == 6
    files = [tmp_path / run / "drafter" / "model.safetensors" for run in ("killed", "whole")]
    with safe_open(str(files[0]), framework="pt") as a, safe_open(str(files[1]), framework="pt") as b:  # fmt: skip
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():  # noqa: SIM118
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
