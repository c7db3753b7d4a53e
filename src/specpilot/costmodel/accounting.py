"""Bytes, FLOPs and kernel launches per component of a forward, and their roofline times.

A forward feeds ``T`` new tokens per row (batch ``B``, ``M = B·T`` rows) at a committed context
of ``L`` tokens and projects ``R`` rows to logits. With ``e`` bytes per element (weights,
activations, KV cache and logits all in the model dtype), ``h`` hidden, ``q = heads·head_dim``,
``kv = kv_heads·head_dim``, ``I`` intermediate, ``V`` vocab and ``N`` layers:

=========== ================================================ ========================== ========
component   bytes                                            FLOPs                      launches
=========== ================================================ ========================== ========
embedding   2·M·h·e (gather rows, write them)                0                          1
attn_proj   N·[(h(q+2kv) + qh + h)·e + M·(5h+4q+4kv)·e]      N·2M·(h(q+2kv) + qh)       4N
attn_kv     N·[2·B·(L+T)·kv·e + 2·M·kv·e + 2·M·q·e]          N·4·B·P·q                  N
mlp         N·[(3hI + h)·e + M·(5h + 6I)·e]                  N·6·M·h·I                  4N
lm_head     (V·h + h)·e + R·(3h + V)·e                       2·R·h·V                    2
argmax      R·V·e + 8·R                                      R·V                        1
=========== ================================================ ========================== ========

(plus the bias ``(q+2kv)·e`` and the q/k-norm weights ``2·head_dim·e`` per layer where the
architecture has them). ``P`` is the number of (query, key) pairs attended: ``T·L + T(T+1)/2``
for a causal chain, ``T·(L+T)`` for a block that sees itself whole, or given for a tree.
Activation bytes count each op's inputs and outputs once: attention side = norm (2h), QKV GEMM
(h + q + 2kv), RoPE (reads q, k, v; writes q), O GEMM with residual (q + 2h); MLP side = norm
(2h), gate/up (h + 2I), SiLU·mul (3I), down with residual (I + 2h); the KV write and attention's
q read / output write are in ``attn_kv``. Element-wise FLOPs are ignored next to the GEMMs.
Launch counts are the kernels of the static (CUDA-graph) path: norm, fused QKV GEMM, RoPE+KV
write, O GEMM with residual; norm, gate/up GEMM, SiLU·mul, down GEMM with residual.

Roofline time of a component = max(bytes / bandwidth, FLOPs / matmul rate) + launches × launch
latency. Weight bytes are kept apart (``weight_bytes``) because weight-format mechanisms attack
exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.config import ModelConfig
from specpilot.costmodel.hardware import Ceilings
from specpilot.costmodel.shapes import BlockDrafterSpec

TARGET_COMPONENTS = ("embedding", "attn_proj", "attn_kv", "mlp", "lm_head", "argmax")
"""Components of one target forward (names from ``specpilot.mechanisms.COMPONENTS``)."""


@dataclass(frozen=True, slots=True)
class Work:
    """What one component moves and computes."""

    weight_bytes: float = 0.0
    other_bytes: float = 0.0
    """Activations, KV cache and logits."""
    flops: float = 0.0
    launches: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.other_bytes

    def __add__(self, other: Work) -> Work:
        return Work(
            self.weight_bytes + other.weight_bytes,
            self.other_bytes + other.other_bytes,
            self.flops + other.flops,
            self.launches + other.launches,
        )

    def scaled(self, factor: float) -> Work:
        return Work(
            self.weight_bytes * factor,
            self.other_bytes * factor,
            self.flops * factor,
            self.launches * factor,
        )

    def roofline_s(self, c: Ceilings) -> float:
        """max(bytes / bandwidth, FLOPs / rate) + launches × launch latency."""
        return max(self.bytes / c.bandwidth_Bps, self.flops / c.matmul_flops) + (
            self.launches * c.launch_s
        )

    def bound(self, c: Ceilings) -> str:
        """``memory``, ``compute`` or ``launch``: the largest of the three terms."""
        terms = {
            "memory": self.bytes / c.bandwidth_Bps,
            "compute": self.flops / c.matmul_flops,
            "launch": self.launches * c.launch_s,
        }
        return max(terms, key=lambda k: terms[k])

    def to_dict(self) -> dict[str, float]:
        return {
            "weight_bytes": self.weight_bytes,
            "other_bytes": self.other_bytes,
            "bytes": self.bytes,
            "flops": self.flops,
            "launches": self.launches,
        }


Breakdown = dict[str, Work]
"""Component name → work."""


def add(a: Breakdown, b: Breakdown) -> Breakdown:
    return {k: a.get(k, Work()) + b.get(k, Work()) for k in {**a, **b}}


def scale(a: Breakdown, factor: float) -> Breakdown:
    return {k: w.scaled(factor) for k, w in a.items()}


def total(a: Breakdown) -> Work:
    out = Work()
    for w in a.values():
        out = out + w
    return out


def causal_pairs(tokens: int, context: int) -> int:
    """(query, key) pairs of a causal block of ``tokens`` after ``context`` committed keys."""
    return tokens * context + tokens * (tokens + 1) // 2


def forward_work(
    cfg: ModelConfig,
    tokens: int,
    context: int,
    elem_bytes: float,
    logits_rows: int | None = None,
    batch: int = 1,
    attended_pairs: int | None = None,
    layers: int | None = None,
    with_head: bool = True,
) -> Breakdown:
    """Work of one forward of ``tokens`` new tokens per row at ``context`` committed tokens.

    ``logits_rows`` defaults to ``tokens`` (verify projects every row); ``attended_pairs`` per row
    defaults to a causal chain; ``layers`` overrides ``cfg.num_layers`` (drafters reuse the
    target's layer shape); ``with_head=False`` leaves out the LM head and argmax.
    """
    e, h, q, kv = elem_bytes, cfg.hidden_size, cfg.q_size, cfg.kv_size
    i, v = cfg.intermediate_size, cfg.vocab_size
    n = cfg.num_layers if layers is None else layers
    m = batch * tokens
    r = batch * (tokens if logits_rows is None else logits_rows)
    pairs = batch * (causal_pairs(tokens, context) if attended_pairs is None else attended_pairs)

    proj_w = h * (q + 2 * kv) + q * h + h
    if cfg.attention_bias:
        proj_w += q + 2 * kv
    if cfg.qk_norm:
        proj_w += 2 * cfg.head_dim
    out: Breakdown = {
        "embedding": Work(other_bytes=2 * m * h * e, launches=1),
        "attn_proj": Work(
            weight_bytes=n * proj_w * e,
            other_bytes=n * m * (5 * h + 4 * q + 4 * kv) * e,
            flops=n * 2 * m * (h * (q + 2 * kv) + q * h),
            launches=4 * n,
        ),
        "attn_kv": Work(
            other_bytes=n * (2 * batch * (context + tokens) * kv + 2 * m * kv + 2 * m * q) * e,
            flops=n * 4 * pairs * q,
            launches=n,
        ),
        "mlp": Work(
            weight_bytes=n * (3 * h * i + h) * e,
            other_bytes=n * m * (5 * h + 6 * i) * e,
            flops=n * 6 * m * h * i,
            launches=4 * n,
        ),
    }
    if with_head:
        out["lm_head"] = Work(
            weight_bytes=(v * h + h) * e,
            other_bytes=r * (3 * h + v) * e,
            flops=2 * r * h * v,
            launches=2,
        )
        out["argmax"] = Work(other_bytes=r * v * e + 8 * r, flops=r * v, launches=1)
    return out


def ar_step(cfg: ModelConfig, context: int, elem_bytes: float, batch: int = 1) -> Breakdown:
    """One plain AR step: a forward of one token, one logits row."""
    return forward_work(cfg, 1, context, elem_bytes, batch=batch)


def chain_verify(cfg: ModelConfig, k: int, context: int, elem_bytes: float) -> Breakdown:
    """Verify of a chain of ``k`` drafted tokens: one causal forward of ``k + 1`` tokens."""
    return forward_work(cfg, k + 1, context, elem_bytes)


def tree_verify(
    cfg: ModelConfig,
    nodes: int,
    context: int,
    elem_bytes: float,
    depths: list[int] | None = None,
) -> Breakdown:
    """Verify of a draft tree of ``nodes`` nodes (root = the pending token, depth 0).

    Each node attends the context and its ancestors (``depth + 1`` block keys); without
    ``depths`` the whole ``nodes × nodes`` block is counted, as a dense masked kernel computes it.
    """
    pairs = (
        nodes * context + sum(d + 1 for d in depths)
        if depths is not None
        else nodes * (context + nodes)
    )
    return forward_work(cfg, nodes, context, elem_bytes, attended_pairs=pairs)


def draft_model_work(
    draft: ModelConfig, k: int, context: int, elem_bytes: float, catch_up: int = 1
) -> Breakdown:
    """A draft model drafting ``k`` tokens: one forward of ``catch_up`` tokens (the committed
    tail it has not seen: the bonus, or the last draft and the bonus) then ``k - 1`` one-token
    steps, each projecting one row."""
    first = forward_work(draft, catch_up, context, elem_bytes, logits_rows=1)
    rest = [forward_work(draft, 1, context + catch_up + s, elem_bytes) for s in range(k - 1)]
    out = first
    for step in rest:
        out = add(out, step)
    return out


def block_drafter_work(
    target: ModelConfig,
    spec: BlockDrafterSpec,
    context: int,
    elem_bytes: float,
    context_rows: int | None = None,
) -> Breakdown:
    """A DFlash-like block drafter's cycle, as the components of its own forward.

    1. Context: the last verify's ``context_rows`` rows (default ``block``) of
       ``num_context_layers`` target hidden states go through ``fc`` (``n_ctx·h → h``), a norm,
       and each drafter layer's K/V projection; their K/V are written (counted in ``attn_proj``).
    2. The block ``[bonus, mask × (block-1)]`` runs through the layers, attending to the context
       and to the whole block (non-causal); the target's LM head projects ``block - 1`` rows.
    """
    e, h, kv = elem_bytes, target.hidden_size, target.kv_size
    rows = spec.block if context_rows is None else context_rows
    n = spec.num_layers
    ctx_in = spec.num_context_layers * h
    ctx = Work(
        weight_bytes=(ctx_in * h + h + n * 2 * kv * h) * e,
        other_bytes=rows * (ctx_in + 3 * h + n * (h + 4 * kv)) * e,
        flops=2 * rows * (ctx_in * h + n * 2 * kv * h),
        launches=2 + 2 * n,
    )
    block = forward_work(
        target,
        spec.block,
        context,
        e,
        logits_rows=spec.block - 1,
        attended_pairs=spec.block * (context + spec.block),
        layers=n,
    )
    return add(block, {"attn_proj": ctx})


def accept_work(k: int, batch: int = 1, launches: float = 10) -> Work:
    """Greedy accept + commit on the device: a few small kernels (compare, cumprod, gather,
    scatter, copies) over ``k + 1`` tokens; ``launches`` counts those of ``accept_and_commit``."""
    return Work(other_bytes=8 * batch * (4 * (k + 1) + 8), launches=launches)


def roofline(b: Breakdown, c: Ceilings) -> dict[str, float]:
    """Roofline seconds per component."""
    return {name: w.roofline_s(c) for name, w in b.items()}
