"""gguf-blocks: the kernels' weights are gguf's dequantized weights bit for bit, per block type
and on every tensor of the real SmolLM2 GGUF; products match fp32 at widths 1..17; the engine
with the mechanism decodes the same tokens speculatively as autoregressively."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specpilot.kernels.gguf_dequant import dequant_q4, dequant_q8
from specpilot.loading.gguf_blocks import Packed, unpack
from specpilot.mechanisms.gguf_blocks import BlockLinear

SIZES = {
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
F16_AT = {"Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks with finite f16 scales (exponent below all-ones)."""
    bs, ts = SIZES[name]
    raw = np.random.default_rng(seed).integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for at in F16_AT[name]:
        raw[:, at + 1] &= 0x3B
    return raw.reshape(n, -1)


def _weights(p: Packed) -> np.ndarray:
    if p.kind == "q4":
        return dequant_q4(p.codes, p.sc, p.mn)
    return dequant_q8(p.codes, p.sc, p.mn, p.has_min)


@pytest.mark.parametrize("name", list(SIZES))
def test_dequant_is_ggufs_bit_for_bit(name: str):
    n, k = 16, 512
    raw = _blocks(name, n, k, 1)
    ref = dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).astype(np.float32)
    w = _weights(unpack(raw, name, n, k))
    assert np.array_equal(w.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", list(SIZES))
def test_kernel_multiplies_exactly_those_weights(name: str):
    """x = identity: every output is one weight times 1 plus zeros, so it is that weight."""
    n, k = 8, 256
    raw = _blocks(name, n, k, 2)
    p = unpack(raw, name, n, k)
    ref = torch.from_numpy(_weights(p))  # [N, K]
    out = BlockLinear([p], k)(torch.eye(k))  # [K, N]
    assert torch.equal(out.t(), ref)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_products_match_fp32_at_every_verify_width(name: str):
    n, k = 63, 512  # odd: the second 32-row task ends on a single weight row
    p = unpack(_blocks(name, n, k, 3), name, n, k)
    w = torch.from_numpy(_weights(p)).double()
    lin = BlockLinear([p, p], k)  # two row segments: columns [0, N) and [N, 2N)
    for m in range(1, 18):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = lin(x)
        ref = (x.double() @ w.t()).float()
        bound = 1e-5 * (x.double().abs() @ w.abs().t()).float() + 1e-30
        assert ((y[:, :n] - ref).abs() <= bound).all() and torch.equal(y[:, :n], y[:, n:])
        assert torch.equal(y[:1], lin(x[:1]))  # the same row sums alike at every width
    x = torch.randn(2, 3, 2 * k)[..., ::2]  # [2, 3, K], strided: reshaped to [6, K] first
    assert torch.equal(lin(x), lin(x.reshape(6, k).contiguous()).view(2, 3, 2 * n))
    bias = torch.randn(2 * n)
    assert torch.equal(lin(x[0], bias), lin(x[0].contiguous()) + bias)
    # a prefill-wide product (more than max_m rows) runs on the fp32 weights: the stock path's
    w32 = torch.cat([w, w]).float()  # [2N, K]: the same values as the blocks
    wide = BlockLinear([p, p], k, w32, max_m=8)
    x = torch.randn(9, k)
    assert torch.equal(wide(x, bias), torch.nn.functional.linear(x, w32, bias))
    assert torch.equal(wide(x[:8]), lin(x[:8]))  # up to max_m rows: the blocks


@pytest.mark.slow
def test_every_tensor_of_the_real_gguf():
    from gguf import GGUFReader

    from specpilot.loading.fetch import resolve_model
    from specpilot.loading.gguf_blocks import SUPPORTED

    reader = GGUFReader(str(resolve_model("smollm2-135m")), "r")
    seen = 0
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED:
            continue
        k, n = (int(v) for v in t.shape.tolist())
        raw = np.asarray(t.data).reshape(n, -1)
        ref = dequantize(raw, t.tensor_type).reshape(n, k).astype(np.float32)
        w = _weights(unpack(raw, t.tensor_type.name, n, k))
        assert np.array_equal(w.view(np.uint32), ref.view(np.uint32)), t.name
        seen += 1
    assert seen == 211


def test_small_ops_are_the_torch_paths():
    """RoPE in one numba call is the torch path's, bit for bit (strided K/V views too); RMSNorm
    differs only through the sum of squares (fp64 there, fp32 in torch): a few ulps at most,
    and never in the rounding steps around it (a constant row: exact)."""
    from specpilot.config import ModelConfig
    from specpilot.kernels import reference
    from specpilot.mechanisms.gguf_blocks import NumbaSmallOps
    from specpilot.models.transformer import Transformer

    cfg = ModelConfig(
        arch="llama", vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1,
        num_heads=3, num_kv_heads=1, head_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    model = Transformer(cfg, dtype=torch.float32, max_positions=64)
    fwd = model.stock_forward()
    ops = NumbaSmallOps()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 5 * 32, generator=g)  # [M, q + 2kv]
    pos = torch.tensor([0, 3, 7, 20, 63])
    cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]  # [M, 1, D]
    for x in (qkv[:, :96].reshape(5, 3, 32), qkv[:, 96:128].reshape(5, 1, 32)):
        got = ops.rope(x, cos, sin)
        assert got is not None and torch.equal(got, fwd._rope(x, cos, sin, None))
    # RoPE + K/V write of a one-row eager step (slots 9 .. 13): q, K and V as the torch path's
    from specpilot.models.layout import DenseLayout

    lay = DenseLayout.build(torch.tensor([9]), 5, 14, 3, torch.float32, host_start=9)
    kv = torch.randn(2, 1, 1, 64, 32, generator=g)  # K, V caches [1, H_kv, S, D]
    caches = [kv.clone(), kv.clone()]
    qs = []
    for small, (kc, vc) in zip((None, ops), caches, strict=True):
        model.small_ops = small
        qs.append(fwd.rope_write(model.layers[0], qkv, kc, vc, lay, cfg.num_heads))
    model.small_ops = None
    assert torch.equal(qs[0], qs[1]) and torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0][:, :, :, 9:14], kv[:, :, :, 9:14])  # written there
    assert torch.equal(caches[0][:, :, :, 14:], kv[:, :, :, 14:])  # and nowhere else
    x, w = 3 * torch.randn(7, 96, generator=g), 1 + 0.1 * torch.randn(96, generator=g)
    got, want = ops.rms_norm(x, w, 1e-5), reference.rms_norm_ref(x, w, 1e-5)
    assert got is not None
    assert int((got.view(torch.int32) - want.view(torch.int32)).abs().max()) <= 4
    flat = torch.full((2, 96), 0.75)
    assert torch.equal(ops.rms_norm(flat, w, 1e-5), reference.rms_norm_ref(flat, w, 1e-5))
    assert ops.rms_norm(x.to(torch.bfloat16), w, 1e-5) is None  # fp32 only: torch runs others
    # parameters' numpy views are kept: each norm reads its own weight, updates in place included
    layer = model.layers[0]
    with torch.no_grad():
        layer.input_norm.copy_(w)
        layer.post_attn_norm.copy_(2 * w)
    for _ in range(2):
        for nw in (layer.input_norm, layer.post_attn_norm):
            got, want = ops.rms_norm(x, nw, 1e-5), reference.rms_norm_ref(x, nw, 1e-5)
            assert got is not None
            assert int((got.view(torch.int32) - want.view(torch.int32)).abs().max()) <= 4
        with torch.no_grad():
            layer.post_attn_norm.mul_(-1)
    assert ops.rms_norm(x.requires_grad_(), w, 1e-5) is None  # training: torch's ops (autograd)


def test_rope_write_attend_is_the_torch_paths_and_rows_are_ar_steps():
    """RoPE, K/V write and causal attention in one numba call: q/K/V bit for bit the torch
    path's, attention within a few ulps of SDPA's (summation order, exp); each row of a
    verify block equals the one-row step at its position bit for bit (spec == AR in fp32)."""
    from specpilot.config import ModelConfig
    from specpilot.mechanisms.gguf_blocks import NumbaSmallOps
    from specpilot.models.layout import DenseLayout
    from specpilot.models.transformer import Transformer

    cfg = ModelConfig(
        arch="llama", vocab_size=64, hidden_size=192, intermediate_size=64, num_layers=1,
        num_heads=6, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
    )  # fmt: skip
    model = Transformer(cfg, dtype=torch.float32, max_positions=512)
    fwd, ops, layer = model.stock_forward(), NumbaSmallOps(), model.layers[0]
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 1, 2, 512, 32, generator=g)  # K, V caches [1, H_kv, S, D]

    def dense(start: int, m: int, **kw: bool) -> DenseLayout:
        return DenseLayout.build(torch.tensor([start]), m, start + m, 3, torch.float32, **kw)

    for start, m in ((0, 1), (0, 4), (200, 1), (200, 9)):
        qkv = torch.randn(m, 10 * 32, generator=g)  # [M, q + 2kv]
        lay = dense(start, m, host_start=start)
        caches = [(kv[0].clone(), kv[1].clone()) for _ in range(3)]
        model.small_ops = None
        assert fwd.rope_write_attend(layer, qkv, *caches[0], lay) is None
        q = fwd.rope_write(layer, qkv, *caches[0], lay, cfg.num_heads)
        want = fwd.attend(q, *caches[0], lay)  # [M, H*D]
        model.small_ops = ops
        got = fwd.rope_write_attend(layer, qkv, *caches[1], lay)
        assert got is not None and got.shape == want.shape
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        rows = []
        for i in range(m):  # the same rows as AR steps, one at a time
            one = dense(start + i, 1, host_start=start + i)
            rows.append(fwd.rope_write_attend(layer, qkv[i : i + 1], *caches[2], one))
        assert torch.equal(torch.cat(rows), got)
    # not served (torch's path runs): a non-causal block, a layout without a host start, a
    # block wider than the rows the attention is set to serve (SDPA for every row of it)
    qkv = torch.randn(2, 10 * 32, generator=g)
    model.small_ops = NumbaSmallOps(attend_rows=1)
    assert fwd.rope_write_attend(layer, qkv, kv[0], kv[1], dense(4, 2, host_start=4)) is None
    assert (
        fwd.rope_write_attend(layer, qkv[:1], kv[0], kv[1], dense(4, 1, host_start=4)) is not None
    )
    model.small_ops = ops
    block = dense(4, 2, causal=False, host_start=4)
    assert fwd.rope_write_attend(layer, qkv, kv[0], kv[1], block) is None
    assert fwd.rope_write_attend(layer, qkv, kv[0], kv[1], dense(4, 2)) is None


def test_attention_choice_by_the_widest_block():
    """ "auto": the numba attention where every block is narrow enough for it to win (AR, k <= 2),
    SDPA otherwise; one choice per engine, so that AR and verify rows take the same kernel."""
    from specpilot.mechanisms.gguf_blocks import ATTEND_ROWS, attend_rows

    assert attend_rows("auto", 1, 32) == 32 and attend_rows("auto", ATTEND_ROWS, 32) == 32
    assert attend_rows("auto", ATTEND_ROWS + 1, 32) == 0 and attend_rows("auto", 9, 16) == 0
    assert attend_rows("numba", 9, 16) == 16 and attend_rows("sdpa", 1, 32) == 0


def test_tune_searches_the_draft_length_with_the_blocks():
    """gguf-blocks makes the verify cheap, so its direction carries ``k`` too where the
    deployment drafts (and only its own knobs where it does not)."""
    from specpilot.engine.config import EngineConfig
    from specpilot.engine.deployment import DeploymentSpec
    from specpilot.tune.space import _mechanism_direction

    base = EngineConfig(DeploymentSpec("smollm2-135m", drafter="ngram", device="cpu"), k=8)
    d = _mechanism_direction("gguf-blocks", "cpu", base)
    assert [p.name for p in d.params][-1] == "k" and d.params[-1].default == 8
    cfg = d.derive(base, {"threads": 0, "max_m": 32, "attention": "auto", "k": 12})
    assert cfg.k == 12 and cfg.mechanisms["gguf-blocks"] == {
        "threads": 0, "max_m": 32, "attention": "auto",
    }  # fmt: skip
    dflash = dataclasses.replace(base, deployment=DeploymentSpec("smollm2-135m", drafter="dflash"))
    assert d.derive(dataclasses.replace(dflash, k=3), {"k": 12}).k == 3  # its block fixes k
    ar = EngineConfig(DeploymentSpec("smollm2-135m", drafter="none", device="cpu"), k=0)
    assert "k" not in [p.name for p in _mechanism_direction("gguf-blocks", "cpu", ar).params]


@pytest.mark.slow
def test_engine_with_blocks_speculative_equals_ar():
    from specpilot.drafters import make_drafter
    from specpilot.engine import Engine, generate
    from specpilot.loading.fetch import resolve_model
    from specpilot.mechanisms.gguf_blocks import install
    from specpilot.runtime import load_model

    loaded = load_model("smollm2-135m", torch.float32, "cpu")
    tok = loaded.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "List three colors of the rainbow."}]
    )
    stock = generate(Engine(loaded.model), [ids], 32)[0].tokens
    # more threads than cores (the tuner's knob reaches 256): as many as there are
    stats = install(loaded.model, str(resolve_model("smollm2-135m")), threads=999)
    assert stats["bits_per_weight"] < 9 and loaded.model.small_ops is not None
    ar = generate(Engine(loaded.model), [ids], 32)[0].tokens
    spec = generate(Engine(loaded.model, drafter=make_drafter("ngram", k=4)), [ids], 32)[0].tokens
    assert ar == spec
    assert ar == stock  # same weights; a near-tie flip here would need token forcing's count
