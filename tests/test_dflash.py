"""DFlash / DFlash2 checkpoints: tiny ones written here in the published format (z-lab's
config.json keys and tensor names) load, and the drafts the engine's drafter makes equal those of
an independent reference forward written below in plain torch from the formulas; a drafter for
another target is refused in one sentence; speculative output with it equals plain AR in fp32."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from conftest import tiny_config, tiny_model
from engine_cases import (
    check_cuda_drafter_equals_ar,
    check_drafter_equals_ar,
    repetitive_prompt,
)
from reference_ops import rms, rope, write_dir
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.engine import Engine
from specpilot.errors import CheckpointError, IncompatibleDrafterError
from specpilot.models.transformer import Transformer

# ---------------------------------------------------------------------- a published checkpoint

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


def write_checkpoint(
    root: Path,
    target: Transformer,
    kind: str = "dflash",
    seed: int = 0,
    layers: int = 2,
    block: int = 6,
    layer_types: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    prefix: str = "",
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json + model.safetensors as z-lab writes them; heads differ from the target's."""

    tc = target.cfg
    h, heads, kv, d, inter = tc.hidden_size, 2, 1, 16, 48
    ids = [0, tc.num_layers - 1]
    inner: dict[str, Any] = {"mask_token_id": 3, "target_layer_ids": ids, "block_size": block}
    if kind == "dflash2":
        inner |= DFLASH2 | {"output_multiplier": 0.7, "final_logit_softcapping": 9.0}
    cfg: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        "max_position_embeddings": 512,
        "vocab_size": tc.vocab_size,
        "num_target_layers": tc.num_layers,
        "layer_types": layer_types or ["full_attention"] * layers,
        "sliding_window": 4,
        "use_sliding_window": layer_types is not None,
        "dflash_config": inner,
        "torch_dtype": "float32",
    } | (extra or {})
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.2) -> Tensor:
        return std * torch.randn(shape, generator=gen)

    def norm(n: int) -> Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t: dict[str, Tensor] = {"fc.weight": rnd(h, len(ids) * h, std=0.1), "hidden_norm.weight": norm(h),
                            "norm.weight": norm(h)}  # fmt: skip
    for i in range(layers):
        p = f"layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": rnd(heads * d, h),
            p + "self_attn.k_proj.weight": rnd(kv * d, h),
            p + "self_attn.v_proj.weight": rnd(kv * d, h),
            p + "self_attn.o_proj.weight": rnd(h, heads * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
        if kind == "dflash2":
            g = h // DFLASH2["conv_group_size"]
            for c in ("attention_conv", "mlp_conv"):
                t[p + f"{c}.base_kernel"] = 0.5 + rnd(2, 2, h, std=0.3)
                t[p + f"{c}.kernel_projection.weight"] = rnd(2 * 2 * g, h)
    if kind == "dflash2":
        r = DFLASH2["selector_rank"]
        t["candidate_selector.hidden_projection.weight"] = rnd(r, h)
        t["candidate_selector.predecessor_codebook"] = rnd(tc.vocab_size, r, std=1.0)
        t["candidate_selector.successor_codebook"] = rnd(tc.vocab_size, r, std=1.0)
    write_dir(root, cfg, t, prefix)
    return cfg, t


# ---------------------------------------------------------------------- the reference forward


def conv(x: Tensor, dyn: Tensor, base: Tensor, group: int) -> Tensor:
    """y_t = sum_o (base[o] + dyn_t[o, g]) * x_{t-o}, zero before the block; x [L, H]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                gain = base[o] + dyn[t, o].repeat_interleave(group)  # [H]
                out[t] += gain * x[t - o]
    return out


def reference_drafts(
    target: Transformer, cfg: dict[str, Any], t: dict[str, Tensor], context: list[int], pending: int
) -> list[int]:
    """The block [pending, mask x (B-1)] after ``context`` (every committed token before it)."""
    from specpilot.models.kv_cache import KVCache

    inner = cfg["dflash_config"]
    ids, block, mask = inner["target_layer_ids"], inner["block_size"], inner["mask_token_id"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    heads, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_ctx = len(context)
    out = target.forward(torch.tensor([context]), KVCache.allocate(target.cfg, 1, 256, torch.float32, "cpu"), hidden_layers=ids)  # fmt: skip
    feats = torch.cat([out.hidden[i][0] for i in ids], dim=-1)  # [T, n*H]
    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"], eps)  # [T, H]
    x = target.embed[torch.tensor([pending] + [mask] * (block - 1))]  # [L, H]
    pos_q = torch.arange(n_ctx, n_ctx + block)
    pos_k = torch.arange(n_ctx + block)
    window = cfg["sliding_window"]
    conv_g = inner.get("conv_group_size")
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        hn = rms(x, t[p + "input_layernorm.weight"], eps)
        if conv_g:
            dyn = (hn @ t[p + "attention_conv.kernel_projection.weight"].T).view(block, 2, 2, -1)
            hn = conv(hn, dyn[:, 0], t[p + "attention_conv.base_kernel"][0], conv_g)
        q = rms((hn @ t[p + "self_attn.q_proj.weight"].T).view(block, heads, d), t[p + "self_attn.q_norm.weight"], eps)  # fmt: skip
        src = torch.cat([ctx, hn])  # context rows (no input norm) then the block's
        k = rms((src @ t[p + "self_attn.k_proj.weight"].T).view(-1, kvh, d), t[p + "self_attn.k_norm.weight"], eps)  # fmt: skip
        v = (src @ t[p + "self_attn.v_proj.weight"].T).view(-1, kvh, d)
        q, k = rope(q, pos_q, theta), rope(k, pos_k, theta)
        seen = torch.ones(block, len(pos_k), dtype=torch.bool)
        if kind == "sliding_attention":
            diff = pos_q[:, None] - pos_k[None, :]
            causal = cfg.get("is_causal", True)
            seen = (diff >= 0) & (diff < window) if causal else diff.abs() < window
        attn = torch.empty(block, heads, d)
        for hh in range(heads):
            kk, vv = k[:, hh // (heads // kvh)], v[:, hh // (heads // kvh)]
            s = (q[:, hh] @ kk.T) / math.sqrt(d)
            attn[:, hh] = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ vv
        o = attn.reshape(block, -1) @ t[p + "self_attn.o_proj.weight"].T
        if conv_g:
            o = conv(o, dyn[:, 1], t[p + "attention_conv.base_kernel"][1], conv_g)
        x = x + o
        hn = rms(x, t[p + "post_attention_layernorm.weight"], eps)
        if conv_g:
            dyn = (hn @ t[p + "mlp_conv.kernel_projection.weight"].T).view(block, 2, 2, -1)
            hn = conv(hn, dyn[:, 0], t[p + "mlp_conv.base_kernel"][0], conv_g)
        m = (F.silu(hn @ t[p + "mlp.gate_proj.weight"].T) * (hn @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T  # fmt: skip
        if conv_g:
            m = conv(m, dyn[:, 1], t[p + "mlp_conv.base_kernel"][1], conv_g)
        x = x + m
    h = rms(x, t["norm.weight"], eps)[1:]  # rows 1..B-1
    logits = (h @ target.lm_head.T) * inner.get("output_multiplier", 1.0)
    cap = inner.get("final_logit_softcapping")
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if not conv_g:
        return logits.argmax(-1).tolist()
    proj = h @ t["candidate_selector.hidden_projection.weight"].T  # [B-1, r]
    pred_cb, succ_cb = t["candidate_selector.predecessor_codebook"], t["candidate_selector.successor_codebook"]  # fmt: skip
    prev, path = pending, []
    for j in range(block - 1):
        top = logits[j].topk(inner["selector_top_k"])
        score = [float(top.values[c]) + float((pred_cb[prev] * proj[j]) @ succ_cb[int(b)]) for c, b in enumerate(top.indices)]  # fmt: skip
        prev = int(top.indices[max(range(len(score)), key=score.__getitem__)])
        path.append(prev)
    return path


# ---------------------------------------------------------------------- drafts equal the reference

TYPES = {
    "full": None,
    "sliding-causal": ["sliding_attention", "full_attention"],
    "sliding-bidirectional": ["full_attention", "sliding_attention"],
}


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("types", list(TYPES))
@pytest.mark.parametrize("seed", range(2))
def test_drafts_equal_reference(tmp_path: Path, kind: str, types: str, seed: int) -> None:
    """Two rows prefilled together (one padded forward), drafts after the prompt and again after
    a cycle committed tokens, each equal to the reference forward on the committed context."""
    rng = random.Random(seed)
    target = tiny_model(tiny_config(layers=3, vocab=89), seed)
    extra = {"is_causal": False} if types == "sliding-bidirectional" else None
    cfg, t = write_checkpoint(tmp_path / "d", target, kind, seed, layer_types=TYPES[types], extra=extra, prefix="model." * (seed % 2))  # fmt: skip
    drafter = DFlashDrafter.load(target, tmp_path / "d", kind=kind)
    assert drafter.k == 5 and drafter.hidden_layers == (0, 2)
    prompts = [repetitive_prompt(rng, 89, n) for n in (rng.randint(3, 20), rng.randint(3, 20))]
    engine = Engine(target, drafter)
    engine.open(2, 128)
    firsts = engine.prefill([0, 1], prompts, [0, 0], [len(p) for p in prompts], [30, 30])
    for cycle in range(3):
        with torch.inference_mode():  # the engine's buffers are inference tensors
            drafter.propose(engine, drafter.attn_len(engine, max(engine.host.lens)))
        got = engine.state.drafts[:, : drafter.k].tolist()
        for row in range(2):
            ctx = engine.host.contexts[row]
            want = reference_drafts(target, cfg, t, ctx[:-1], ctx[-1])
            assert got[row] == want, f"cycle {cycle} row {row}"
        if cycle == 0:
            assert [c[-1] for c in engine.host.contexts] == firsts
        engine.step()


def test_dflash2_conv_and_selector_matter(tmp_path: Path) -> None:
    """The reference is not blind to DFlash2's parts: without them the drafts differ."""
    target = tiny_model(tiny_config(layers=3, vocab=89), 5)
    cfg, t = write_checkpoint(tmp_path / "d", target, "dflash2", 5)
    ctx = repetitive_prompt(random.Random(0), 89, 12)
    full = reference_drafts(target, cfg, t, ctx, 7)
    plain = {
        **cfg,
        "dflash_config": {k: v for k, v in cfg["dflash_config"].items() if k not in DFLASH2},
    }
    assert reference_drafts(target, plain, t, ctx, 7) != full


# ---------------------------------------------------------------------- lossless in the engine


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("seed", range(3))
def test_speculative_equals_ar(tmp_path: Path, kind: str, seed: int) -> None:
    """fp32: batched, alone, through the scheduler (rows refilled, prompts in segments), and
    under a static tree, every request's output equals its plain AR output."""
    rng = random.Random(seed)
    target = tiny_model(tiny_config(arch=rng.choice(["llama", "qwen3"]), layers=3, vocab=89), seed)
    write_checkpoint(tmp_path / "d", target, kind, seed, layer_types=TYPES["sliding-causal"] if seed else None)  # fmt: skip
    drafter = DFlashDrafter.load(target, tmp_path / "d", k=rng.randint(2, 5), kind=kind)
    check_drafter_equals_ar(target, drafter, rng, 89)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["cuda-eager", "cuda-graphs"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_cuda_speculative_equals_ar(tmp_path: Path, kind: str, graphs: bool) -> None:
    """fp32 on CUDA (the fused kernels; eagerly and from CUDA graphs): batched and through the
    scheduler, every request's output equals its AR output."""
    cfg = tiny_config(arch="llama", layers=3, vocab=89)
    cpu = tiny_model(cfg, 1)
    write_checkpoint(tmp_path / "d", cpu, kind, 1)
    target = Transformer(cfg, dtype=torch.float32, device="cuda")
    target.init_random(1, std=0.15)  # the weights tiny_model gives on the CPU
    drafter = DFlashDrafter.load(target, tmp_path / "d", k=4, kind=kind)
    check_cuda_drafter_equals_ar(target, drafter, graphs)


# ---------------------------------------------------------------------- refusals


def test_refuses_other_targets_and_bad_dirs(tmp_path: Path) -> None:
    target = tiny_model(tiny_config(layers=3, vocab=89), 0)
    root = tmp_path / "d"
    write_checkpoint(root, target)
    for edit, words in (
        ({"vocab_size": 97}, "vocabulary of 97"),
        ({"hidden_size": 32}, "hidden size 32"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 3]}}, "layers [3]"),
        ({"num_target_layers": 30}, "30 layers"),
    ):
        bad = tmp_path / f"bad{len(words)}"
        write_checkpoint(bad, target, extra=edit)
        with pytest.raises(
            IncompatibleDrafterError, match=words.replace("[", r"\[").replace("]", r"\]")
        ):
            DFlashDrafter.load(target, bad)
    with pytest.raises(CheckpointError, match="select it with --drafter dflash"):
        DFlashDrafter.load(target, root, kind="dflash2")
    with pytest.raises(ValueError, match="trained with blocks of 6"):
        DFlashDrafter.load(target, root, k=6)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a DFlash checkpoint"):
        DFlashDrafter.load(target, root)
    with pytest.raises(CheckpointError, match="does not exist"):
        DFlashDrafter.load(target, tmp_path / "nope")
    short = tmp_path / "short"
    _, t = write_checkpoint(short, target)
    from safetensors.torch import save_file

    save_file({n: v for n, v in t.items() if n != "norm.weight"}, str(short / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no tensor norm\.weight"):
        DFlashDrafter.load(target, short)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_writer_round_trips_in_shards(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What train-drafter writes (here in several shards) loads back to the same weights, and
    its config reads like a published one."""
    import specpilot.loading.dflash_save as save_mod
    from specpilot.loading.dflash import load_dflash
    from specpilot.models.dflash import DFlashNet, spec_for_target

    target = tiny_model(tiny_config(layers=3, vocab=89), 0)
    spec = spec_for_target(target.cfg, 2, 5, 7, 48, (0, 2), kind, **(DFLASH2 if kind == "dflash2" else {}))  # fmt: skip
    net = DFlashNet(spec, target)
    net.init_random(4)
    monkeypatch.setattr(save_mod, "SHARD_BYTES", 20_000)
    root = save_mod.save_dflash(net, tmp_path / "out", torch.float32)
    assert (
        len(list(root.glob("model-*.safetensors"))) > 1
        and (root / "model.safetensors.index.json").is_file()
    )
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["num_target_layers"] == 3
    back = load_dflash(root, target, kind)
    for (name, a), b in zip(net.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b), name
    monkeypatch.setattr(save_mod, "SHARD_BYTES", 10**9)  # re-saved in one file: the shards go
    save_mod.save_dflash(net, root, torch.float32)
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "model.safetensors"]


def test_tuner_searches_the_block_length(tmp_path: Path) -> None:
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.tune.space import directions_for

    target = tiny_model(tiny_config(layers=3, vocab=89), 0)
    write_checkpoint(tmp_path / "d", target, block=8)
    dep = DeploymentSpec(target="t", drafter="dflash", draft_model=str(tmp_path / "d"))
    dirs = {d.name: d for d in directions_for(EngineConfig(dep, k=7), "cpu", "llama")}
    (knob,) = dirs["draft-length"].params
    assert (knob.low, knob.high, knob.default) == (1, 7, 7)
    assert "mechanism:tree-verify" in dirs


def test_the_shipped_drafter_is_found_and_searched(tmp_path: Path) -> None:
    """SmolLM2's shipped DFlash drafter: found by target name (and by kind), a tune direction of
    its n-gram deployment (and of no other target's), giving a config the commands can build."""
    import dataclasses

    from specpilot.drafters.shipped import shipped_drafter
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.loading.dflash import block_size_of
    from specpilot.tune.space import directions_for

    path = shipped_drafter("smollm2-135m")
    assert path is not None and (path / "config.json").is_file()
    assert shipped_drafter("smollm2-135m", "eagle3") is None and shipped_drafter("other") is None
    base = EngineConfig(DeploymentSpec(target="smollm2-135m"), k=8)
    dirs = {d.name: d for d in directions_for(base, "cpu", "llama", 30)}
    learned = dirs["learned-drafter"]
    (knob,) = learned.params
    assert knob.high == block_size_of(path) - 1
    cfg = learned.derive(base, {"k": 4})
    assert (cfg.deployment.drafter, cfg.deployment.draft_model, cfg.k) == ("dflash", str(path), 4)
    assert not cfg.drafter_knobs
    other = dataclasses.replace(base, deployment=DeploymentSpec(target="elsewhere"))
    assert "learned-drafter" not in {d.name for d in directions_for(other, "cpu", "llama", 30)}
    # a deployment already on a draft model (or the learned one) gets no second switch
    assert "learned-drafter" not in {d.name for d in directions_for(cfg, "cpu", "llama", 30)}


def test_the_argument_check_takes_the_shipped_drafter_for_its_target() -> None:
    """``--drafter dflash`` without ``--draft-model``: accepted for SmolLM2 (its drafter ships),
    one clear error for another target, before anything loads."""
    from specpilot.commands.common import check_engine_config
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.errors import SpecPilotError

    check_engine_config(EngineConfig(DeploymentSpec(target="smollm2-135m", drafter="dflash"), k=4))
    with pytest.raises(SpecPilotError, match="needs --draft-model DIR"):
        check_engine_config(EngineConfig(DeploymentSpec(target="smollm2-135m", drafter="eagle3"), k=4))  # fmt: skip
