"""The tensor-core W12 kernel (``kernels/w12_mma.py``) and layout v4: round trips, the interpreter
against the fp64 product (escapes in every position class, split-K, masks, bias), and on a GPU the
PTX decode against the plain-op decode and a one-hot probe that must return the weights bit for
bit; the sm_90 build keeps the decoded operand in registers (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specpilot.mechanisms.w12_format import decode, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import run_interpreted
from test_w12 import _error_ratio, _positioned_escapes, bits_of

CASES = (  # (M, N, K, config kwargs, bias)
    (1, 64, 128, {"block_r": 64, "block_k": 64, "num_warps": 4}, False),
    (5, 80, 200, {"block_r": 64, "block_k": 128, "num_warps": 4, "split_k": 2}, True),
    (16, 128, 256, {"block_r": 128, "block_k": 64, "num_warps": 8, "split_k": 3}, False),
    (20, 64, 192, {"block_r": 64, "block_k": 64, "num_warps": 4}, True),
    (33, 64, 128, {"block_r": 64, "block_k": 64, "num_warps": 4, "block_m": 16}, False),
    (3, 130, 320, {"block_r": 64, "block_k": 64, "num_warps": 4, "stream_k": 2}, True),
    (16, 256, 192, {"block_r": 128, "block_k": 64, "num_warps": 8, "stream_k": 3}, False),
    (40, 64, 256, {"block_r": 64, "block_k": 64, "num_warps": 4, "stream_k": 1}, True),
    # two warp groups per row tile, each on half of every K step (inner_split)
    (1, 64, 256, {"block_r": 64, "block_k": 128, "num_warps": 8, "inner_split": 2}, False),
    (7, 130, 448, {"block_k": 128, "num_warps": 8, "inner_split": 2, "split_k": 2}, True),
    (20, 64, 384, {"block_k": 256, "num_warps": 8, "inner_split": 2}, False),
    (3, 130, 320, {"block_k": 128, "num_warps": 8, "inner_split": 2, "stream_k": 2}, True),
    (16, 128, 512, {"block_r": 128, "block_k": 128, "num_warps": 8, "inner_split": 2}, False),
)


@pytest.mark.parametrize("seed", [0, 1])
def test_v4_round_trip_and_byte_order(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 16, (24, 200), generator=g, dtype=torch.int32)
    w = bits.to(torch.int16).view(torch.bfloat16)
    t4 = encode(w, "v4")
    assert torch.equal(bits_of(decode(t4)), bits_of(w))
    # byte 4w + q of a group: column c = 16q + w, mantissa << 1 | the sign of column c ^ 16
    b = bits_of(w).to(torch.int32)
    b = torch.nn.functional.pad(b, (0, 256 - 200)).view(24, 4, 4, 16)  # [N, group, q, w]
    sign, mant = (b >> 15) & 1, b & 0x7F
    want = (mant << 1) | sign[:, :, [1, 0, 3, 2]]
    assert torch.equal(t4.sm.to(torch.int32).view(24, 4, 16, 4), want.transpose(2, 3))
    # code half-word w: quarters 0, 2, 1, 3 in nibbles 0..3 (bits 0-3, 4-7, 8-11, 12-15)
    half = t4.codes.view(torch.int16).to(torch.int32).view(24, 4, 16) & 0xFFFF
    exp = (b >> 7) & 0xFF
    code = torch.where((exp - t4.base >= 1) & (exp - t4.base <= 15), exp - t4.base, 0)
    for q, shift in enumerate((0, 8, 4, 12)):
        assert torch.equal((half >> shift) & 0xF, code[:, :, q]), q


def test_mma_matches_reference_in_interpreter() -> None:
    assert "mma ok" in run_interpreted([str(Path(__file__).resolve()), "mma"], timeout=180)


def _group_mma() -> None:
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.kernels.w12_mma import MmaConfig, w12_mma

    for i, (m, n, k, kw, has_bias) in enumerate(CASES):
        w = _positioned_escapes(n, k, i)
        t = encode(w, "v4")
        g = torch.Generator().manual_seed(300 + i)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
        counters = counter_buffer(n, x.device)
        y = w12_mma(x, t, counters, bias, cfg=MmaConfig(**kw))
        assert int(counters.abs().sum()) == 0, "split-K counters must reset themselves"
        z = x.double() @ w.double().T
        finite = z.isfinite().all(dim=0)
        assert y.shape == (m, n) and torch.equal(y.double().isinf(), z.isinf()), i
        r = _error_ratio(y[:, finite], x, w[finite], None if bias is None else bias[finite])
        assert r <= 1.0, (i, r)
    # a tile with more escapes than one chunk (4 * block_r): the list is read in two chunks
    g = torch.Generator().manual_seed(9)
    w = torch.randn(64, 128, generator=g)
    w = torch.where(torch.rand(64, 128, generator=g) < 0.06, w * 2.0**-40, w).to(torch.bfloat16)
    t = encode(w, "v4")
    assert t.list_records is not None and t.list_records.shape[1] > 256, t.tile_escapes
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    for kw in ({"block_k": 64, "split_k": 2}, {"block_k": 64, "stream_k": 2}):
        y = w12_mma(x, t, counter_buffer(64, x.device), cfg=MmaConfig(**kw))
        assert _error_ratio(y, x, w, None) <= 1.0, kw
    with pytest.raises(ValueError, match="layout v4"):
        w12_mma(x, encode(w), counters)
    # the mechanism's linear: v4 + this kernel up to max_m rows, tiled by a searched table
    from specpilot.kernels.w12_tilings import MmaTilings
    from specpilot.mechanisms.w12 import W12Linear

    w = _positioned_escapes(64, 128, 7)
    tilings = MmaTilings(by_shape={(64, 128, 4): MmaConfig(block_k=64, split_k=2)}, source="t")
    lin = W12Linear(w, max_m=4, prmt=True, kernel="mma", tilings=tilings)
    assert lin.w12.layout == "v4"
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    y = lin(x)  # [2, 3, 64]: 6 rows > max_m, F.linear; then 3 rows through the kernel
    assert y.shape == (2, 3, 64)
    y3 = lin(x[0])
    finite = (x[0].double() @ w.double().T).isfinite().all(dim=0)
    assert _error_ratio(y3[:, finite], x[0], w[finite], None) <= 1.0
    with pytest.raises(ValueError, match="block_k"):
        MmaConfig(block_k=96)
    with pytest.raises(ValueError, match="inner split"):
        MmaConfig(block_k=64, inner_split=2)
    with pytest.raises(ValueError, match="num_warps"):
        MmaConfig(num_warps=8)  # 64 rows, one group: 16 rows per warp at most
    print("mma ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PTX decode needs a CUDA GPU")
def test_mma_on_gpu() -> None:
    """The PTX decode and the plain-op decode within the bound, and a one-hot x returns the
    weights themselves (escapes included) bit for bit through either."""
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.kernels.w12_mma import MmaConfig, w12_mma

    dev = torch.device("cuda")
    for i, (m, n, k, kw, has_bias) in enumerate((*CASES, (16, 4096, 4096, {}, False))):
        w = _positioned_escapes(n, k, i).to(dev)
        t = encode(w, "v4")
        g = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
        bias = torch.randn(n, generator=g).to(torch.bfloat16).to(dev) if has_bias else None
        counters = counter_buffer(n, dev)
        cfg = MmaConfig(**kw)
        y = w12_mma(x, t, counters, bias, cfg=cfg)
        y_ops = w12_mma(x, t, counters, bias, cfg=cfg, ptx=False)
        z = x.double().cpu() @ w.double().cpu().T
        finite = z.isfinite().all(dim=0)
        b = None if bias is None else bias.cpu()[finite]
        for name, out in (("ptx", y), ("ops", y_ops)):
            r = _error_ratio(out.cpu()[:, finite], x.cpu(), w.cpu()[finite], b)
            assert r <= 1.0, (i, name, r)
        # (PTX and ops builds may sum in different orders: equal bits are not promised; on the
        # 8B shapes they were equal, bench/w12_mma_gpu.py "ptx_equals_ops")
        cols = torch.arange(min(16, k), device=dev)
        eye = torch.zeros(len(cols), k, dtype=torch.bfloat16, device=dev)
        eye[torch.arange(len(cols)), cols] = 1.0
        if w[:, cols].float().isfinite().all():  # 0 * inf is NaN: finite columns return themselves
            for ptx in (True, False):
                got = w12_mma(eye, t, counters, cfg=cfg, ptx=ptx)
                assert torch.equal(bits_of(got), bits_of(w[:, cols].T)), (i, ptx)


def _group_sm90() -> None:
    """Compile for sm_90 (ptxas, no GPU): every wgmma's A operand is a register tensor."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specpilot.kernels.w12_mma import _mma_kernel

    ptrs = ("x_ptr", "*bf16"), ("sm_ptr", "*i32"), ("cb_ptr", "*i16"), ("lrec_ptr", "*i32")
    ptrs += ("lval_ptr", "*bf16"), ("bias_ptr", "*bf16"), ("y_ptr", "*bf16")
    ptrs += ("part_ptr", "*fp32"), ("count_ptr", "*i32")
    ints = ("M", "N", "K", "stride_xm", "stride_ym", "row_words", "k_split", "split", "cap")
    sig = dict(ptrs) | dict.fromkeys(ints, "i32")
    names = _mma_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in ("M", "split")}
    # the split-K and the stream-K grid; two warp groups on the halves of a 64-row tile's steps
    for stream, rows, halves in ((False, 128, 1), (True, 128, 1), (False, 64, 2)):
        const = dict(BASE=110, HAS_BIAS=False, EVEN=True, PTX=True, BLOCK_R=rows, BLOCK_K=256,
                     HALVES=halves, BLOCK_M=16, ESC_STEP=32, ESCAPES=True, MAX_SPLIT=16,
                     STREAM=stream, INTERPRET=False)  # fmt: skip
        src = ASTSource(_mma_kernel, sig | dict.fromkeys(const, "constexpr"), const, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ttgir = kernel.asm["ttgir"]
        dots = [ln for ln in ttgir.splitlines() if "warp_group_dot " in ln]
        # the K loop's dots: every dot but the escape dots, whose A is [BR, ESC_STEP = 32] and
        # may go through shared memory (built by a select). Triton 3.9 keeps a K step's dot
        # whole (A [BR, 256]); 3.6 splits it into dots of A [BR, 16] in the TTGIR
        k_of = [re.search(r"<(\d+)x(\d+)xbf16", ln) for ln in dots]
        main = [ln for ln, k in zip(dots, k_of, strict=True) if k and int(k.group(2)) != 32]
        assert main, dots
        for ln in main:  # A from registers, not shared memory
            assert "dot_op<{opIdx = 0" in ln.split("*")[0], (stream, halves, ln)
        assert "async_copy_global_to_local" in ttgir, (stream, halves)  # the loads pipelined
        try:
            sass = kernel.asm["sass"]  # disassembled on first use (cuobjdump)
        except Exception:  # no disassembler in this Triton
            sass = ""
        if sass:  # not serialized by ptxas (C7515): far fewer full wgmma waits than wgmmas (a
            # serialized loop waits for zero groups after every HGMMA; Triton 3.6's pipelined one
            # waits for "at most 7 in flight" after each, which does not serialize)
            waits = len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", sass))
            mmas = sass.count("HGMMA.")
            assert mmas and waits * 3 < mmas, (stream, halves, waits, mmas)
    print("sm90 ok")


def test_mma_keeps_the_decoded_operand_in_registers_on_sm90(tmp_path: Path) -> None:
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("no bundled ptxas in this triton")
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
           "TRITON_CACHE_DIR": str(tmp_path)}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "sm90"], env=env,
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    if "has no attribute" in out.stderr or "ImportError" in out.stderr:
        pytest.skip("this Triton cannot compile for sm_90 here")
    assert "sm90 ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


if __name__ == "__main__":
    {"mma": _group_mma, "sm90": _group_sm90}[sys.argv[1]]()
