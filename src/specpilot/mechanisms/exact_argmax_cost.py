"""Cost model of the graph-safe exact-argmax head (``exact_argmax_graph.py``) against the stock head.

Per verify of ``R`` rows over a head ``V × H`` (model dtype of ``e`` bytes, HBM bandwidth ``BW``):

* stock: ``V·H·e`` bytes of weights read once (the logits ``R·V·e`` are small beside them);
* graph head: the INT8 copy ``V·H`` bytes (+ ``4V`` of scales and ``8V`` of bound terms), the
  bound pass over the fp32 cheap logits (``passes × R·V·4`` bytes: written by the GEMM, read by
  the epilogue ops), the refine gather ``R·C·block·H·e`` bytes (the stock rows of the C
  candidate blocks of every row), and ``kernels × kernel_s`` of small launches inside the graph;
* abstains: with probability ``p`` per verify, the host redoes the whole verify with the stock
  head (``p × t_verify`` plus one more read-back, ``readback_s``).

``saved = t_stock − t_graph − p·(t_verify + readback_s)``. It pays where the head's bytes are a
large part of the step: small targets with big vocabularies (Qwen-0.5B: the 151936 × 896 head is
~27% of its weights; Llama-3-8B: 128256 × 4096 is 7%), few rows per verify (the gather grows with
``R·C``) and peaked (confident) logits (few abstains). A drafter's LM head is not this case: it
may be lossy, so an exact argmax buys it nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.mechanisms.saving import StepSaving

ASSUMPTIONS = (
    "bandwidth-bound passes at the measured copy bandwidth; small kernels at kernel_s each "
    "inside a CUDA graph; an abstain costs one more verify and read-back"
)


@dataclass(frozen=True, slots=True)
class ExactHeadPrediction(StepSaving):
    stock_s: float
    """The stock head (bytes / BW)."""
    cheap_s: float
    """INT8 pass + bound terms + bound epilogue passes."""
    refine_s: float
    """The refine gather of ``R·C·block`` stock rows."""
    launch_s: float
    """Small kernels of the certificate."""
    abstain_s: float
    """Expected redo time per verify."""

    @property
    def graph_s(self) -> float:
        return self.cheap_s + self.refine_s + self.launch_s + self.abstain_s

    @property
    def saved_s(self) -> float:
        return self.stock_s - self.graph_s


def predict(
    vocab: int,
    hidden: int,
    rows: int,
    candidates: int,
    block: int = 64,
    dtype_bytes: int = 2,
    bandwidth_Bps: float = 4.3e12,
    abstain_rate: float = 0.0,
    verify_s: float = 0.0,
    readback_s: float = 20e-6,
    kernels: int = 140,
    kernel_s: float = 1.5e-6,
    epilogue_passes: int = 8,
) -> ExactHeadPrediction:
    """Seconds of each part (module docstring). ``kernels``: small launches of the certificate
    (the torch epilogue counts ~140 on the CPU trace); ``epilogue_passes``: ``[R, V]`` fp32 reads
    and writes of the bound epilogue."""
    stock = vocab * hidden * dtype_bytes / bandwidth_Bps
    cheap_bytes = vocab * hidden + 12 * vocab + epilogue_passes * rows * vocab * 4
    refine_bytes = rows * candidates * block * hidden * dtype_bytes
    return ExactHeadPrediction(
        stock_s=stock,
        cheap_s=cheap_bytes / bandwidth_Bps,
        refine_s=refine_bytes / bandwidth_Bps,
        launch_s=kernels * kernel_s,
        abstain_s=abstain_rate * (verify_s + readback_s),
    )


__all__ = ["ASSUMPTIONS", "ExactHeadPrediction", "predict"]
