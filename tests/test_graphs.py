"""Graph safety of the engine's steps, on the CPU, and CUDA graphs against eager runs on a GPU.

Every step the runner may capture in a CUDA graph (``Runner.run(key, fn, state, graph_safe=True)``:
the dense verify, the accept, a device drafter's draft step, the packed verify, the tree draft,
verify and accept) must not synchronise with the host: a captured graph replays the kernels it
recorded, so a value read back to the host during capture (``.item()``, ``.tolist()``,
``bool(t)``, a data-dependent shape such as ``nonzero`` or a boolean mask) is frozen into every
replay, or the capture fails. On the CPU the runner is patched so that graph-safe steps run under
a dispatch mode that raises on exactly those operations; a second test replays each key's first
step like a graph would (warm-up, state restored, then the recorded step on every later call),
so a step that depends on per-call host values or on buffers reallocated later diverges from AR.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Hashable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_config, tiny_model
from engine_cases import CASES, CONFIGS, ar_tokens, repetitive_prompt, tokens
from specpilot.drafters import DraftModelDrafter
from specpilot.engine import Engine, generate
from specpilot.engine import steps as engine_mod
from specpilot.engine.plans import PackedPlan, TreePlan
from specpilot.engine.rows import RowState
from specpilot.engine.runner import Runner
from specpilot.forcing import force_tokens
from specpilot.models.transformer import Transformer

aten = torch.ops.aten

READS_DEVICE_VALUES = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t), t[t[0]]
    aten.item.default,  # the same under inference mode (composite ops are not decomposed there)
    aten.is_nonzero.default,  # bool(t) under inference mode
    aten.equal.default,  # torch.equal returns a host bool
    aten.allclose.default,
    aten.nonzero.default,  # torch.where(cond), argwhere
    aten.nonzero_numpy.default,  # the same under inference mode
    aten.where.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
"""Operations whose result (or its shape) is only known after reading the device."""

INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises on any operation that reads device values on the host (see the module docstring)."""

    def __init__(self, where: object) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        bad = func in READS_DEVICE_VALUES and kwargs.get("output_size") is None
        if func in INDEXING:
            bad = any(i is not None and i.dtype == torch.bool for i in args[1])
        if func is aten.lift_fresh.default and args[0].dim() > 0:
            raise HostSyncError(f"{self.where}: host data copied into the step (torch.tensor)")
        if bad:
            raise HostSyncError(f"{self.where}: {func} reads device values on the host")
        return func(*args, **kwargs)


def _refuse(name: str, where: object) -> Callable[..., Any]:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HostSyncError(f"{where}: Tensor.{name}() reads device values on the host")

    return refuse


@contextlib.contextmanager
def no_host_sync(where: object) -> Iterator[None]:
    """The dispatch mode, plus ``tolist``/``numpy`` (which read the data without dispatching)."""
    saved = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "numpy")}
    for name in saved:
        setattr(torch.Tensor, name, _refuse(name, where))
    try:
        with NoHostSync(where):
            yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Run graph-safe steps under :func:`no_host_sync`; yields the step kinds that ran."""
    real = Runner.run
    kinds: set[str] = set()

    def run(
        self: Runner,
        key: Hashable,
        fn: Callable[[], None],
        state: RowState,
        graph_safe: bool = True,
    ) -> None:
        if not graph_safe:
            return real(self, key, fn, state, graph_safe)
        kinds.add(key[0] if isinstance(key, tuple) else str(key))
        with no_host_sync(key):
            real(self, key, fn, state, graph_safe)
        return None

    monkeypatch.setattr(Runner, "run", run)
    return kinds


# ---------------------------------------------------------------------- the detector itself
X = torch.arange(6)
SYNCING = {
    "item": lambda: X[0].item(),
    "int": lambda: int(X.sum()),
    "bool": lambda: bool(X[1] > 0),
    "if-tensor": lambda: 1 if X.max() > 2 else 0,
    "index-by-tensor": lambda: X[: X[2]],
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "bool-mask": lambda: X[X > 2],
    "bool-mask-assign": lambda: X.clone().__setitem__(X > 2, 0),
    "nonzero": lambda: torch.nonzero(X),
    "where-1-arg": lambda: torch.where(X > 2),
    "argwhere": lambda: torch.argwhere(X),
    "nonzero-tuple": lambda: X.nonzero(as_tuple=True),
    "masked_select": lambda: X.masked_select(X > 2),
    "unique": lambda: torch.unique(X),
    "equal": lambda: torch.equal(X, X),
    "repeat_interleave": lambda: torch.repeat_interleave(X, X),
    "tensor-from-list": lambda: torch.tensor([1, 2, 3]),
}
SAFE = {
    "arithmetic": lambda: (X * 2 + 1).cumsum(0).argmax(),
    "gather-scatter": lambda: X.clone().scatter_(0, X.flip(0), X.gather(0, X)),
    "where-3-arg": lambda: torch.where(X > 2, X, -X),
    "scalar-assign": lambda: X.clone().__setitem__((slice(None),), 7),
    "topk-index_select": lambda: X.index_select(0, X.float().topk(3).indices),
    "masked_fill": lambda: X.masked_fill(X > 2, 0),
    "repeat_interleave-sized": lambda: torch.repeat_interleave(X, X, output_size=15),
}


@pytest.mark.parametrize("inference", [False, True])  # the engine steps under inference mode
@pytest.mark.parametrize("name", list(SYNCING))
def test_detector_catches_host_syncs(name: str, inference: bool) -> None:
    with torch.inference_mode(inference):
        with pytest.raises(HostSyncError), no_host_sync(name):
            SYNCING[name]()
        SYNCING[name]()  # and the guard is gone afterwards


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", list(SAFE))
def test_detector_lets_device_work_through(name: str, inference: bool) -> None:
    with torch.inference_mode(inference), no_host_sync(name):
        SAFE[name]()


# ---------------------------------------------------------------------- the engine's steps
def _run_case(
    case: str, cfg_kw: dict, seed: int, engine_hook: Callable[[Engine], None] | None = None
) -> Engine:
    """The case batched (twice), alone, batched again on the same engine; each equals AR."""
    rng = random.Random(f"graphs/{case}/{seed}")
    cfg = tiny_config(**cfg_kw)
    target, other = tiny_model(cfg, seed), tiny_model(cfg, seed + 1000)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
    max_new = rng.randint(24, 48)
    eos = [rng.randrange(cfg.vocab_size)]
    want = ar_tokens(target, prompts, max_new, eos)
    engine = CASES[case](target, other, rng) if case != "ar" else Engine(target)
    if engine_hook is not None:
        engine_hook(engine)
    for batch in (prompts, prompts, prompts[1:2], prompts):  # graphs kept, then re-made
        got = tokens(generate(engine, batch, max_new, eos))
        assert got == [want[prompts.index(p)] for p in batch], f"{case} rows {len(batch)}"
    return engine


def _expected_kinds(engine: Engine) -> set[str]:
    d = engine.drafter
    if d is None:
        return {"verify", "accept"}
    if isinstance(engine.plan, TreePlan):
        kinds = {"tree_verify", "tree_accept"}
        return kinds | (
            {"tree_draft"} if engine.plan.policy is not None and d.graph_safe else set()
        )
    kinds = {"packed_verify" if isinstance(engine.plan, PackedPlan) else "verify", "accept"}
    return kinds | ({"draft"} if d.graph_safe else set())


def test_timed_forward_never_syncs(guarded: set[str]) -> None:
    """``Engine.time_forward`` replays a verify step like a cycle's (captured on CUDA)."""
    target = tiny_model(tiny_config(), 0)
    engine = Engine(target, DraftModelDrafter(target, k=3))
    engine.open(2, 64)
    engine.prefill([0, 1], [[1, 2, 3], [4, 5]], [0, 0], [3, 2], [8, 8])
    assert engine.time_forward(4, iters=1) > 0 and "time" in guarded


def test_a_step_that_syncs_fails_the_check(
    guarded: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device drafter that reads a length back, and an accept that reads the accepted
    lengths back: both are caught (so the test above can fail)."""

    class PeekingDrafter(DraftModelDrafter):
        def propose(self, rows: Any, attn_len: int) -> None:
            int(rows.state.committed_len.max())
            super().propose(rows, attn_len)

    target = tiny_model(tiny_config(), 0)
    with pytest.raises(HostSyncError, match="draft"):
        generate(Engine(target, PeekingDrafter(target, k=3)), [[1, 2, 3]], 8)
    real = engine_mod.accept_and_commit

    def peeking_accept(state: RowState, k: int, abstain: torch.Tensor | None = None) -> None:
        real(state, k, abstain)
        state.accepted.tolist()

    monkeypatch.setattr(engine_mod, "accept_and_commit", peeking_accept)
    with pytest.raises(HostSyncError, match="accept"):
        generate(Engine(target, DraftModelDrafter(target, k=3)), [[1, 2, 3]], 8)
    # the same engines without the faults pass the guard
    monkeypatch.setattr(engine_mod, "accept_and_commit", real)
    generate(Engine(target, DraftModelDrafter(target, k=3)), [[1, 2, 3]], 8)


@pytest.fixture
def emulated_graphs(monkeypatch: pytest.MonkeyPatch, guarded: set[str]) -> Callable[[Engine], None]:
    """Graph semantics on the CPU: the first call of a key runs the step, restores the small row
    state and records the step; every later call of that key replays the recorded step (the first
    closure, with the values and buffers it captured), as ``Runner`` does with CUDA graphs."""
    replays = {"n": 0}

    def capture(self: Runner, fn: Callable[[], None], state: RowState) -> SimpleNamespace:
        snap = state.snapshot()
        fn()
        state.restore(snap)
        self.captures += 1

        def replay() -> None:
            replays["n"] += 1
            fn()

        return SimpleNamespace(replay=replay)

    monkeypatch.setattr(Runner, "_capture", capture)

    def as_graphs(engine: Engine) -> None:
        engine.runner.use_graphs = True  # buckets, power-of-two widths, no host-known lengths
        engine.attn_bucket = 16  # small buckets: keys repeat within a request
        engine.replays = replays  # type: ignore[attr-defined]

    return as_graphs


@pytest.mark.parametrize("case", ["ar", *CASES])
def test_graph_steps_never_sync_and_their_replay_equals_ar(
    case: str, emulated_graphs: Callable[[Engine], None], guarded: set[str]
) -> None:
    """Every graph-safe step kind of the case runs under the host-sync guard, captured once per
    key and replayed after, and every request equals AR. The cases alternate between a tied GQA
    llama and qwen3 (q/k norms)."""
    cfg = CONFIGS[1] if ["ar", *CASES].index(case) % 2 == 0 else CONFIGS[4]
    engine = _run_case(case, cfg, seed=2, engine_hook=emulated_graphs)
    want = _expected_kinds(engine)
    assert want <= guarded, f"{case}: steps {sorted(want - guarded)} never ran"
    assert engine.runner.captures > 0
    assert engine.replays["n"] > engine.runner.captures  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- CUDA graphs (GPU only)
CUDA_CASES = [
    "ngram/chain",
    "ngram/packed+tiered",
    "ngram/tree-trie",
    "draft/chain",
    "perfect/packed",
    "draft/fixed-tree",
    "block/chain",
    "block/ragged-trees",
    "dflash/fixed-tree",
    "dflash2/chain",
    "sim/chain",
    "sim/packed+row-block-len",
    "sim/ragged-trees",
    "int8-drafter(block)/chain",
]


def _cuda_model(cfg: Any, seed: int, dtype: torch.dtype) -> Transformer:
    model = Transformer(cfg, dtype=dtype, device="cuda")
    model.init_random(seed, std=0.15)  # the weights tiny_model gives on the CPU
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", ["ar", *CUDA_CASES])
def test_cuda_graphs_equal_eager(case: str) -> None:
    """The same case eagerly and from CUDA graphs (re-used by a second run of the same batch,
    recaptured for another batch): fp32 tokens equal eager and AR; bf16 pass token forcing."""
    cfg = tiny_config(arch="qwen3", vocab=113, layers=3)
    for dtype in (torch.float32, torch.bfloat16):
        target, other = _cuda_model(cfg, 0, dtype), _cuda_model(cfg, 1000, dtype)
        rng = random.Random(f"cuda/{case}")
        prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(4)]
        batches = (prompts, prompts, prompts[1:2])
        want = [tokens(generate(Engine(target, graphs=False), b, 48)) for b in batches]
        outs = {}
        for graphs in (False, True):
            rng = random.Random(f"cuda/{case}/knobs")
            built = Engine(target) if case == "ar" else CASES[case](target, other, rng)
            engine = Engine(target, built.drafter, plan=built.plan, graphs=graphs)
            outs[graphs] = [tokens(generate(engine, b, 48)) for b in batches]
            assert engine.runner.captures > 0 or not graphs
        if dtype == torch.float32:
            assert outs[False] == want, f"{case} eager"
            assert outs[True] == want, f"{case} graphs"
            continue
        records = [
            (f"{i}.{j}", p, t)
            for i, (b, got) in enumerate(zip(batches, outs[True], strict=True))
            for j, (p, t) in enumerate(zip(b, got, strict=True))
        ]
        report = force_tokens(target, records)
        assert report.mismatches == 0, f"{case} bf16 graphs: {report.first_mismatch()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["cuda-eager", "cuda-graphs"])
def test_cuda_a_perfect_draft_model_accepts_every_draft(graphs: bool) -> None:
    """The target as its own draft model (fp32) must accept every draft, on CUDA eagerly and from
    graphs: equality with AR alone cannot see a drafter that drafts the wrong positions. (On the
    H200 on 2026-12-01 a twin draft model on graphs accepted 0 drafts in tests/test_gate.py; this
    test tells eager from graphs.)"""
    cfg = tiny_config(arch="llama", vocab=97, layers=2)
    target = _cuda_model(cfg, 0, torch.float32)
    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(4, 40)) for _ in range(3)]
    engine = Engine(target, DraftModelDrafter(target, k=4), graphs=graphs)
    results = generate(engine, prompts, 40)
    assert tokens(results) == tokens(generate(Engine(target, graphs=False), prompts, 40))
    for r in results:
        assert r.stats.accepted == r.stats.drafted, r.stats
