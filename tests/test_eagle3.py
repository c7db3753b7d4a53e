"""EAGLE-3 checkpoints: tiny ones written here in the published format (``LlamaForCausalLMEagle3``
config keys and tensor names, as SpecForge / SafeAILab / sglang use them) load, and the drafts the
engine's drafter makes equal those of an independent reference written below in plain torch from
the formulas; a drafter for another target is refused in one sentence; speculative output with it
equals plain AR in fp32."""

from __future__ import annotations

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
from specpilot.drafters.eagle3 import Eagle3Drafter
from specpilot.engine import Engine
from specpilot.errors import CheckpointError, IncompatibleDrafterError
from specpilot.models.eagle3 import default_aux_layers
from specpilot.models.transformer import Transformer

V = 89

# ---------------------------------------------------------------------- a published checkpoint


def write_checkpoint(
    root: Path,
    target: Transformer,
    seed: int = 0,
    draft_vocab: int | None = 40,
    extra: dict[str, Any] | None = None,
    prefix: str = "",
    drop: tuple[str, ...] = (),
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json + model.safetensors as SpecForge writes them (one midlayer, 2 heads of 32,
    one KV head, no head_dim key); ``shapes`` overrides a tensor's shape (random values)."""

    tc = target.cfg
    h, heads, kv, inter, vocab = tc.hidden_size, 2, 1, 48, tc.vocab_size
    d = h // heads
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": h,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, tc.num_layers - 1],
                         "use_aux_hidden_state": True},
    } | (extra or {})  # fmt: skip
    vd = draft_vocab or vocab
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.2) -> Tensor:
        return std * torch.randn(shape, generator=gen)

    def norm(n: int) -> Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    m, a = "midlayer.", "midlayer.self_attn."
    hot = torch.randperm(vocab, generator=gen)[:vd].sort().values  # the "most frequent" tokens
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    t: dict[str, Tensor] = {
        "fc.weight": rnd(h, 3 * h, std=0.1),
        m + "hidden_norm.weight": norm(h),
        m + "input_layernorm.weight": norm(h),
        m + "post_attention_layernorm.weight": norm(h),
        a + "q_proj.weight": rnd(heads * d, 2 * h),
        a + "k_proj.weight": rnd(kv * d, 2 * h),
        a + "v_proj.weight": rnd(kv * d, 2 * h),
        a + "o_proj.weight": rnd(h, heads * d),
        m + "mlp.gate_proj.weight": rnd(inter, h),
        m + "mlp.up_proj.weight": rnd(inter, h),
        m + "mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": rnd(vd, h, std=0.5),
        "d2t": hot - torch.arange(vd),
        "t2d": t2d,
        "embed_tokens.weight": rnd(vocab, h),  # SpecForge stores the target's; never read
    }
    for name, shape in (shapes or {}).items():
        t[name] = rnd(*shape)
    t = {n: v for n, v in t.items() if n not in drop}
    write_dir(root, cfg, t, prefix)
    return cfg, t


# ---------------------------------------------------------------------- the reference forward


def midlayer(
    target: Transformer, cfg: dict[str, Any], t: dict[str, Tensor], g: Tensor, toks: list[int]
) -> Tensor:
    """Rows (g_j, x_{j+1}) at positions 0..L-1 under causal attention; pre-norm outputs [L, H]."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, n = cfg["hidden_size"] // heads, g.shape[0]
    m, a = "midlayer.", "midlayer.self_attn."
    emb = target.embed[torch.tensor(toks)]  # [L, H]
    inp = torch.cat([rms(emb, t[m + "input_layernorm.weight"], eps), rms(g, t[m + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    pos = torch.arange(n)
    q = rope((inp @ t[a + "q_proj.weight"].T).view(n, heads, d), pos, theta)
    k = rope((inp @ t[a + "k_proj.weight"].T).view(n, kvh, d), pos, theta)
    v = (inp @ t[a + "v_proj.weight"].T).view(n, kvh, d)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    attn = torch.empty(n, heads, d)
    for hh in range(heads):
        kk, vv = k[:, hh // (heads // kvh)], v[:, hh // (heads // kvh)]
        s = (q[:, hh] @ kk.T) / math.sqrt(d)
        attn[:, hh] = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ vv
    x = g + attn.reshape(n, -1) @ t[a + "o_proj.weight"].T
    hn = rms(x, t[m + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(hn @ t[m + "mlp.gate_proj.weight"].T) * (hn @ t[m + "mlp.up_proj.weight"].T)) @ t[m + "mlp.down_proj.weight"].T  # fmt: skip
    return x + mlp


def reference_drafts(
    target: Transformer, cfg: dict[str, Any], t: dict[str, Tensor], context: list[int], k: int
) -> list[int]:
    """k greedy drafts after ``context`` (prompt + committed tokens, the last one pending)."""
    from specpilot.models.kv_cache import KVCache

    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    seen = context[:-1]  # the tokens whose target features exist
    cache = KVCache.allocate(target.cfg, 1, 256, torch.float32, "cpu")
    out = target.forward(torch.tensor([seen]), cache, hidden_layers=ids)
    g = torch.cat([out.hidden[i][0] for i in ids], dim=-1) @ t["fc.weight"].T  # [C-1, H]
    toks = list(context[1:])  # row j reads token j + 1
    head = t.get("lm_head.weight", target.lm_head)  # [Vd, H]: without one, the target's
    d2t = t.get("d2t", torch.zeros(head.shape[0], dtype=torch.int64))
    drafts: list[int] = []
    for _ in range(k):
        h = midlayer(target, cfg, t, g, toks)[-1]  # [H] the newest row's output
        scores = rms(h, t["norm.weight"], cfg["rms_norm_eps"]) @ head.T
        best = int(scores.argmax())
        drafts.append(best + int(d2t[best]))
        g, toks = torch.cat([g, h[None]]), [*toks, drafts[-1]]  # the output feeds the next row
    return drafts


# ---------------------------------------------------------------------- drafts equal the reference


@pytest.mark.parametrize("seed", range(3))
def test_drafts_equal_reference(tmp_path: Path, seed: int) -> None:
    """Two rows prefilled together (one padded forward; seed 2 in segments), drafts after the
    prompt and again after committed cycles, each equal to the reference on the context."""
    rng = random.Random(seed)
    target = tiny_model(tiny_config(layers=3, vocab=V), seed)
    full = seed == 1  # no lm_head / d2t / t2d: the full vocabulary and the target's head
    drop = ("lm_head.weight", "d2t", "t2d") if full else ()
    cfg, t = write_checkpoint(tmp_path / "d", target, seed, None if full else 40, prefix="model." * (seed % 2), drop=drop)  # fmt: skip
    k = rng.randint(2, 5)
    drafter = Eagle3Drafter.load(target, tmp_path / "d", k=k)
    assert drafter.k == k and drafter.hidden_layers == (0, 1, 2)
    prompts = [repetitive_prompt(rng, V, n) for n in (rng.randint(3, 20), rng.randint(3, 20))]
    engine = Engine(target, drafter)
    engine.open(2, 128)
    if seed == 2:  # the prompts in two segments each: the first segment's last row is redone
        cut = [len(p) // 2 for p in prompts]
        assert engine.prefill([0, 1], prompts, [0, 0], cut, [30, 30]) == [None, None]
        rest = [len(p) - c for p, c in zip(prompts, cut, strict=True)]
        engine.prefill([0, 1], prompts, cut, rest, [30, 30])
    else:
        engine.prefill([0, 1], prompts, [0, 0], [len(p) for p in prompts], [30, 30])
    for cycle in range(4):
        with torch.inference_mode():  # the engine's buffers are inference tensors
            drafter.propose(engine, drafter.attn_len(engine, max(engine.host.lens)))
        got = engine.state.drafts[:, :k].tolist()
        for row in range(2):
            want = reference_drafts(target, cfg, t, engine.host.contexts[row], k)
            assert got[row] == want, f"cycle {cycle} row {row}"
        engine.step()


def test_reference_sees_every_part(tmp_path: Path) -> None:
    """The reference is not blind: the embedding half of q/k/v, hidden_norm and d2t change it."""
    target = tiny_model(tiny_config(layers=3, vocab=V), 4)
    cfg, t = write_checkpoint(tmp_path / "d", target, 4)
    ctx = repetitive_prompt(random.Random(0), V, 14)
    base = reference_drafts(target, cfg, t, ctx, 4)
    a = "midlayer.self_attn."
    for name, edit in (
        ("embeds", lambda w: torch.cat([torch.zeros_like(w[:, :64]), w[:, 64:]], 1)),
        ("hidden_norm", lambda w: w * 3.0),
        ("d2t", lambda w: torch.zeros_like(w)),
    ):
        key = {"embeds": a + "q_proj.weight", "hidden_norm": "midlayer.hidden_norm.weight"}.get(name, name)  # fmt: skip
        changed = dict(t) | {key: edit(t[key])}
        if name == "embeds":
            for x in "kv":
                w = t[a + f"{x}_proj.weight"]
                changed[a + f"{x}_proj.weight"] = torch.cat([torch.zeros_like(w[:, :64]), w[:, 64:]], 1)  # fmt: skip
        assert reference_drafts(target, cfg, changed, ctx, 4) != base, name


# ---------------------------------------------------------------------- lossless in the engine


@pytest.mark.parametrize("seed", range(3))
def test_speculative_equals_ar(tmp_path: Path, seed: int) -> None:
    """fp32: batched, alone, through the scheduler (rows refilled, prompts in segments), and
    under a static tree, every request's output equals its plain AR output."""
    rng = random.Random(seed)
    target = tiny_model(tiny_config(arch=rng.choice(["llama", "qwen3"]), layers=3, vocab=V), seed)
    write_checkpoint(tmp_path / "d", target, seed)
    drafter = Eagle3Drafter.load(target, tmp_path / "d", k=rng.randint(2, 6))
    check_drafter_equals_ar(target, drafter, rng, V)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["cuda-eager", "cuda-graphs"])
def test_cuda_speculative_equals_ar(tmp_path: Path, graphs: bool) -> None:
    """fp32 on CUDA (the fused kernels; eagerly and from CUDA graphs): batched and through the
    scheduler, every request's output equals its AR output."""
    cfg = tiny_config(arch="llama", layers=3, vocab=V)
    cpu = tiny_model(cfg, 1)
    write_checkpoint(tmp_path / "d", cpu, 1)
    target = Transformer(cfg, dtype=torch.float32, device="cuda")
    target.init_random(1, std=0.15)  # the weights tiny_model gives on the CPU
    drafter = Eagle3Drafter.load(target, tmp_path / "d", k=4)
    check_cuda_drafter_equals_ar(target, drafter, graphs)


# ---------------------------------------------------------------------- refusals


def test_refuses_other_targets_and_bad_dirs(tmp_path: Path) -> None:
    target = tiny_model(tiny_config(layers=3, vocab=V), 0)
    ids = {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    for n, (kw, words) in enumerate(
        [
            (dict(extra={"vocab_size": 97}), "vocabulary of 97"),
            (dict(shapes={"t2d": (101,)}), "vocabulary of [101] tokens (t2d)"),
            (dict(shapes={"d2t": (39,)}), "d2t of shape [39]"),
            (dict(extra={"hidden_size": 32}), "hidden size 32"),
            (dict(extra={"target_hidden_size": 128}), "features of width 128"),
            (dict(extra={"eagle_config": ids}), "layers [3]"),
        ]
    ):
        bad = tmp_path / f"bad{n}"
        write_checkpoint(bad, target, **kw)  # type: ignore[arg-type]
        with pytest.raises(IncompatibleDrafterError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):  # fmt: skip
            Eagle3Drafter.load(target, bad)
    for n, (kw, words) in enumerate(
        [
            (dict(drop=("midlayer.hidden_norm.weight",)), r"no tensor midlayer\.hidden_norm"),
            (dict(drop=("d2t",)), "no tensor d2t"),
            (dict(shapes={"midlayer.self_attn.q_proj.weight": (64, 64)}), r"\[64, 128\]"),
            (dict(extra={"num_hidden_layers": 2}), "one midlayer"),
            (dict(extra={"architectures": ["LlamaForCausalLM"]}), "not an EAGLE-3 checkpoint"),
        ]
    ):
        bad = tmp_path / f"broken{n}"
        write_checkpoint(bad, target, **kw)  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match=words):
            Eagle3Drafter.load(target, bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        Eagle3Drafter.load(target, tmp_path / "nope")


def test_default_layers(tmp_path: Path) -> None:
    """Without layer ids, EAGLE-3's default: HF hidden_states [2, N//2, N-3] (layer outputs
    1, N//2 - 1, N - 4); SmolLM2's 30 layers give 1, 14, 26."""
    assert default_aux_layers(30) == (1, 14, 26)
    target = tiny_model(tiny_config(layers=8, vocab=V), 0)
    write_checkpoint(tmp_path / "d", target, extra={"eagle_config": {}})
    assert Eagle3Drafter.load(target, tmp_path / "d").hidden_layers == (1, 3, 4)


def test_commands_run_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--drafter eagle3 --draft-model DIR`` on a command, token-forced; a head for another
    target is one sentence, not a traceback."""
    from specpilot.cli import main
    from specpilot.runtime import load_model
    from test_cli import tiny_dir

    model = tiny_dir(tmp_path / "model", vocab=V)
    target = load_model(str(model)).model
    write_checkpoint(tmp_path / "head", target, draft_vocab=30)
    args = ["generate", "hello world", "--target", str(model), "--drafter", "eagle3",
            "--draft-model", str(tmp_path / "head"), "--max-new-tokens", "12", "--device", "cpu"]  # fmt: skip
    assert main([*args, "-k", "3"]) == 0
    assert "PASS" in capsys.readouterr().out
    write_checkpoint(tmp_path / "other", target, extra={"vocab_size": 97})
    assert main([*args[:-4], "--draft-model", str(tmp_path / "other"), "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "vocabulary of 97" in err and "Traceback" not in err


def test_tuner_searches_k_and_trees(tmp_path: Path) -> None:
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.tune.space import directions_for

    dep = DeploymentSpec(target="t", drafter="eagle3", draft_model=str(tmp_path / "d"))
    dirs = {d.name: d for d in directions_for(EngineConfig(dep, k=6), "cpu", "llama")}
    (knob,) = dirs["draft-length"].params
    assert (knob.low, knob.high, knob.default) == (1, 16, 6)
    assert "mechanism:tree-verify" in dirs
