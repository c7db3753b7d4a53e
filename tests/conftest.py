"""Shared fixtures: tiny random models built from a seed, in fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Idle OpenMP threads sleep instead of spinning (read when torch loads libgomp, so set before the
# import). On two cores shared with other jobs, spinning threads made the same test file run
# 7 to 70 times slower (6.5 s passive, 54 to 650 s spinning, tests/test_tree_verify.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from specpilot.config import ModelConfig
from specpilot.models import Transformer

ROOT = Path(__file__).resolve().parents[1]

# One intra-op thread: the test models are tiny, and a second thread only adds a hand-off per op.
# Measured on the 2-core CI machine (F.linear of [3, 64] x [64, 144]): 2.8 us with one thread,
# 4.3 us with two spinning threads, 104 us with two sleeping ones (OMP_WAIT_POLICY=PASSIVE); and
# with other jobs on the cores, spinning threads made tests/test_tree_verify.py take 54 to 650 s
# instead of 6. SPECPILOT_TEST_THREADS overrides it (e.g. for the real-model tests).
torch.set_num_threads(int(os.environ.get("SPECPILOT_TEST_THREADS", "1")))


def tiny_config(
    arch: str = "llama",
    vocab: int = 97,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    tie: bool = False,
    **kw: object,
) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 16,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        **kw,  # type: ignore[arg-type]
    )


def tiny_model(cfg: ModelConfig, seed: int, std: float = 0.15) -> Transformer:
    model = Transformer(cfg, dtype=torch.float32, device="cpu")
    model.init_random(seed, std=std)
    return model


@pytest.fixture
def make_tiny():
    return tiny_model


def run_interpreted(args: list[str], timeout: int = 240) -> str:
    """``python *args`` with ``TRITON_INTERPRET=1`` and the source tree on the path (the Triton
    kernels run on the CPU through the interpreter, which must be set before triton is
    imported, hence the subprocess; ``tests/interp`` speeds the interpreter up); asserts it exits
    0 and returns its stdout."""
    pytest.importorskip("triton")
    path = os.pathsep.join((str(ROOT / "src"), str(ROOT / "tests" / "interp")))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def torch_small_ops(engine: Any) -> Any:
    """``engine`` with its forward's RMSNorm, RoPE + K/V write and SiLU·mul on the torch
    references (the stock path's ops), for interpreter runs that test another kernel (the head,
    a weight format): interpreted, those small Triton kernels cost most of the run, and they
    have tests of their own (tests/test_gpu_path.py)."""
    engine.fwd._k = None  # the fused GEMVs a mechanism installed stay (``Forward.fused``)
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF model directory (vocabulary 10, seed 0), one per test module."""
    from test_cli import tiny_dir

    return tiny_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def two_slot_server(model_dir: Path) -> Iterator[Any]:
    """``specpilot serve`` (uvicorn on a free loopback port) over ``model_dir``, two slots."""
    from specpilot.commands.serve import build_app
    from test_serve import RunningServer, free_port, serve_args

    app = build_app(serve_args(model_dir, "--max-concurrency", "2"))
    with RunningServer(app, free_port()) as s:
        yield s
