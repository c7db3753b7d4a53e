"""Two-level verification on the device (``mechanisms/two_level_device.py``): the block rule on
synthetic cases, spec == AR in fp32 over the draft model and the block drafter with good, perfect
and junk cheap levels, the cheap cache against a fresh prefill of the committed tokens (after
plain runs, gated AR stretches and continuous batching), no host sync in the draft step, and
the mechanism's dispatch (host wrapper for host drafters, device wrapper for graph-safe ones).
The step under emulated graph replay and the host-sync guard over every plan:
``tests/test_graphs.py`` (the ``two-level-dev`` cases of ``tests/engine_cases.py``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, tiny_config, tiny_model
from engine_cases import (
    ar_tokens,
    block_drafter,
    check_cuda_drafter_equals_ar,
    dflash_drafter,
    eagle3_drafter,
    repetitive_prompt,
    simulated,
    tokens,
)
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.base import Drafter, gateable
from specpilot.engine import Engine, Request, Scheduler, generate
from specpilot.engine.gate import GateSettings, SpecGate
from specpilot.mechanisms.int8_copy import cheap_model
from specpilot.mechanisms.two_level import TwoLevelDrafter, wrap
from specpilot.mechanisms.two_level_device import DeviceTwoLevelDrafter, corrected_block
from specpilot.models.forward import Forward
from specpilot.models.transformer import Transformer
from test_graphs import HostSyncError, no_host_sync


# ---------------------------------------------------------------- the block rule
def test_corrected_block_keeps_the_agreed_prefix_then_the_cheap_token() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])  # [B, k]
    greedy = torch.tensor(
        [
            [5, 6, 7, 8],  # agrees with all three: keeps them, adds the free next token 8
            [5, 9, 7, 8],  # disagrees at d_2: d_1, then the replacement 9
            [1, 6, 7, 8],  # disagrees at d_1: the replacement alone
            [5, 6, 7, 8],  # agrees, but only two drafts are valid
        ]
    )
    lens = torch.tensor([3, 3, 3, 2])
    block, n = corrected_block(drafts, lens, greedy)
    assert n.tolist() == [3, 1, 0, 2]
    assert block[0].tolist() == [5, 6, 7, 8]
    assert block[1, :2].tolist() == [5, 9]
    assert block[2, :1].tolist() == [1]
    assert block[3, :3].tolist() == [5, 6, 7]  # c_2 is 7: the cheap model's token after d_2


# ---------------------------------------------------------------- losslessness in fp32
def _junk_head(model: Transformer, seed: int) -> Transformer:
    """The INT8 copy answering random tokens (its K/V still real)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    junk = cheap_model(model)
    junk.argmax_head = lambda x: torch.randint(0, vocab, x.shape[:-1], generator=gen)
    return junk


def _inner(kind: str, target: Transformer, other: Transformer, rng: random.Random) -> Drafter:
    if kind == "draft":
        return DraftModelDrafter(other, k=rng.choice((1, 3, 5)))
    if kind == "block":
        return block_drafter(target, rng.randint(2, 7), seed=rng.randrange(100))
    if kind == "dflash":
        return dflash_drafter(target, rng)
    if kind == "eagle3":
        return eagle3_drafter(target, rng)
    return simulated(target, rng, rng.randint(3, 7))


@pytest.mark.parametrize("kind", ["draft", "block", "sim", "dflash", "eagle3"])
@pytest.mark.parametrize("seed", range(3))
def test_device_two_level_equals_ar(kind: str, seed: int) -> None:
    rng = random.Random(f"{kind}/{seed}")
    cfg = tiny_config(vocab=rng.choice((89, 97)), tie=seed == 1)
    target, other = tiny_model(cfg, seed), tiny_model(cfg, seed + 100)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
    max_new = rng.randint(16, 32)
    want = ar_tokens(target, prompts, max_new)
    cheaps = {
        "int8": cheap_model(target),
        "unrelated": tiny_model(cfg, seed + 77),
        "junk-head": _junk_head(target, seed),
    }
    for name, cheap in cheaps.items():
        ext = rng.choice((0, 0, 2))
        drafter = DeviceTwoLevelDrafter(_inner(kind, target, other, rng), cheap, ext)
        got = tokens(generate(Engine(target, drafter), prompts, max_new))
        assert got == want, f"{kind} cheap={name} ext={ext}"
        st = drafter.stats()
        assert st["rows"] > 0 and st["forwards"] >= st["rows"] / 3 * (1 + ext)


@pytest.mark.parametrize("ext", [0, 2])
def test_a_perfect_cheap_level_repairs_every_block(ext: int) -> None:
    """The target as its own cheap level: every cycle of a junk inner drafter commits the
    replacement, the extension and the bonus (2 + ext tokens) but where a row's limit cuts it."""
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, 0), tiny_model(cfg, 100)
    rng = random.Random(ext)
    prompts = [repetitive_prompt(rng, 97, rng.randint(2, 30)) for _ in range(3)]
    want = ar_tokens(target, prompts, 40)
    for inner in (DraftModelDrafter(other, k=3), block_drafter(target, 5)):
        drafter = DeviceTwoLevelDrafter(inner, target, ext)
        res = generate(Engine(target, drafter), prompts, 40)
        assert tokens(res) == want
        for r in res:
            short = sum(r.stats.accept_hist[: 1 + ext])  # cycles that accepted less than 1 + ext
            assert short <= 1, f"{inner.name}: {r.stats.accept_hist}"
    # a perfect inner drafter too (the target drafting itself): whole blocks, k + 1 + ext each,
    # so the inner drafter's own cache follows the extra committed tokens
    drafter = DeviceTwoLevelDrafter(DraftModelDrafter(target, k=3), target, ext)
    res = generate(Engine(target, drafter), prompts, 40)
    assert tokens(res) == want
    assert all(sum(r.stats.accept_hist[: 4 + ext]) <= 1 for r in res)


# ---------------------------------------------------------------- the cheap cache stays right
def _check_cheap_cache(engine: Engine, drafter: DeviceTwoLevelDrafter) -> int:
    """Every decoding row's cheap K/V below slot ``C - 2`` equals a fresh forward of its
    committed tokens there (the invariant of the module docstring); returns the rows checked."""
    st, fwd, cache = engine.state, Forward(drafter.cheap), drafter.cache
    assert cache is not None
    checked = 0
    for b, active in enumerate(engine.host.active):
        c = engine.host.lens[b]
        if not active or c < 3:
            continue
        ref = drafter.cheap.allocate_cache(1, c)
        start = torch.zeros(1, dtype=torch.int64)
        fwd.dense(st.tokens[b : b + 1, : c - 2], ref, start, c - 2)
        for got, want in zip([*cache.k, *cache.v], [*ref.k, *ref.v], strict=True):
            torch.testing.assert_close(got[b, :, : c - 2], want[0, :, : c - 2])
        checked += 1
    return checked


def _exact_cheap(target: Transformer) -> Transformer:
    """An INT8 copy that runs INT8 at every width, so that a prefill computes the same function
    as a decode step (the stock copy uses the exact weights past 64 rows)."""
    return cheap_model(target, max_m=1 << 20)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_cheap_cache_equals_a_fresh_prefill(seed: int, gated: bool) -> None:
    rng = random.Random(seed)
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, seed), tiny_model(cfg, seed + 100)
    prompts = [repetitive_prompt(rng, 97, rng.randint(3, 30)) for _ in range(3)]
    for ext in (0, 2):
        drafter = DeviceTwoLevelDrafter(DraftModelDrafter(other, k=3), _exact_cheap(target), ext)
        gate = None
        if gated:  # margin 1000: every verdict turns drafting off, probes resync the caches
            settings = GateSettings(margin=1000.0, warmup_cycles=2, probe_cycles=2, off_tokens=3)
            gate = SpecGate(settings)
        engine = Engine(target, drafter, gate=gate)
        engine.open(len(prompts), 100)
        n = len(prompts)
        engine.prefill(list(range(n)), prompts, [0] * n, [len(p) for p in prompts], [60] * n)
        checked = 0
        for _ in range(14):
            engine.step()
            if not engine.unsynced:  # rows paused by the gate catch up when they draft again
                checked += _check_cheap_cache(engine, drafter)
        assert checked > 0
        if gate is not None:
            assert gate.turned_off > 0 and gate.ar_steps > 0


def test_cheap_cache_under_continuous_batching() -> None:
    """More requests than rows, prompts in segments: each equals its AR output alone, and the
    rows that took a new sequence keep the cheap cache right."""
    rng = random.Random(3)
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, 3), tiny_model(cfg, 103)
    drafter = DeviceTwoLevelDrafter(DraftModelDrafter(other, k=2), _exact_cheap(target), 1)
    engine = Engine(target, drafter)
    prompts = [tuple(repetitive_prompt(rng, 97, rng.randint(2, 40))) for _ in range(5)]
    reqs = [Request(f"r{i}", p, rng.randint(5, 25), frozenset()) for i, p in enumerate(prompts)]
    sched = Scheduler(engine, slots=2, segment_tokens=7, max_context=80)
    for r in reqs:
        sched.submit(r)
    done, checked = {}, 0
    while sched.has_work:
        for res in sched.step().finished:
            done[res.id] = res.tokens
        checked += _check_cheap_cache(engine, drafter)
    for r in reqs:
        want = ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0]
        assert done[r.id] == want
    assert checked > 0


# ---------------------------------------------------------------- graph safety
def test_the_draft_step_never_syncs_with_the_host() -> None:
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, 0), tiny_model(cfg, 100)
    for inner in (DraftModelDrafter(other, k=3), block_drafter(target, 5)):
        drafter = DeviceTwoLevelDrafter(inner, cheap_model(target), 2)
        engine = Engine(target, drafter)
        engine.open(2, 64)
        engine.prefill([0, 1], [[1, 2, 3], [4, 5]], [0, 0], [3, 2], [20, 20])
        engine.step()
        saved = {n: getattr(torch.Tensor, n) for n in ("item", "cpu")}

        def refuse(self: torch.Tensor, *a: object, **kw: object) -> object:
            raise HostSyncError("the draft step read the device")

        try:
            for name in saved:
                setattr(torch.Tensor, name, refuse)
            with torch.inference_mode(), no_host_sync("draft"):
                drafter.propose(engine, drafter.attn_len(engine, max(engine.host.lens)))
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)

    class Peeking(DeviceTwoLevelDrafter):  # the guard can fail
        def propose(self, rows, attn_len):  # type: ignore[no-untyped-def]
            rows.state.draft_lens.tolist()
            super().propose(rows, attn_len)

    engine = Engine(target, Peeking(DraftModelDrafter(other, k=3), cheap_model(target)))
    engine.open(1, 32)
    engine.prefill([0], [[1, 2, 3]], [0], [3], [8])
    with torch.inference_mode(), pytest.raises(HostSyncError), no_host_sync("draft"):
        engine.drafter.propose(engine, 32)  # type: ignore[union-attr]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["cuda-eager", "cuda-graphs"])
@pytest.mark.parametrize("kind", ["draft", "block"])
def test_cuda_device_two_level_equals_ar(graphs: bool, kind: str) -> None:
    """fp32 on CUDA, eagerly and from captured graphs (the cheap forwards inside the draft
    graph): three prompts batched and through the scheduler equal eager AR."""
    cfg = tiny_config(vocab=97)
    target = Transformer(cfg, dtype=torch.float32, device="cuda")
    target.init_random(0, std=0.15)
    other = Transformer(cfg, dtype=torch.float32, device="cuda")
    other.init_random(100, std=0.15)
    inner = DraftModelDrafter(other, k=3) if kind == "draft" else block_drafter(target, 5)
    drafter = DeviceTwoLevelDrafter(inner, cheap_model(target, 256), 2)
    check_cuda_drafter_equals_ar(target, drafter, graphs)
    assert drafter.stats()["rows"] > 0


# ---------------------------------------------------------------- dispatch
def test_a_wrapped_draft_model_refeeds_what_the_wrapper_commits_past_its_drafts() -> None:
    inner = DraftModelDrafter(tiny_model(tiny_config(), 1), k=3)
    assert inner.refeed == 2
    DeviceTwoLevelDrafter(inner, tiny_model(tiny_config(), 0), 2)  # commits up to 3 + 1 + 2 + 1
    assert inner.refeed == 5  # d_3, the cheap token, two extension tokens and the bonus


def test_wrap_picks_the_device_path_for_graph_safe_drafters() -> None:
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, 0), tiny_model(cfg, 100)
    host = wrap(NgramDrafter(k=3), target, "correct-extend", 2)
    assert isinstance(host, TwoLevelDrafter) and not host.graph_safe and host.k == 6
    dev = wrap(DraftModelDrafter(other, k=3), target, "correct-extend", 2)
    assert isinstance(dev, DeviceTwoLevelDrafter) and dev.graph_safe and dev.k == 6
    assert gateable(dev)  # a draft model catches up after AR, and so does the cheap cache
    assert not gateable(wrap(block_drafter(target), target, "correct", 4))
    assert wrap(block_drafter(target, 5), target, "correct", 4).k == 5  # no extension
    with pytest.raises(ValueError, match="graph-safe"):
        DeviceTwoLevelDrafter(NgramDrafter(k=3), target)


def test_registered_for_graph_safe_drafters_and_screened_by_the_cost_model() -> None:
    from specpilot.drafters.simulated import AcceptanceProfile
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.mechanisms import MECHANISMS
    from specpilot.mechanisms.two_level_cost import screen
    from specpilot.tune.space import directions_for, skipped_mechanisms

    mech = MECHANISMS["two-level"]
    for drafter in ("ngram", "draft-model", "block", "dflash", "dflash2", "eagle3"):
        assert mech.applies.allows("cuda", "bf16", drafter, "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "block", "single", "llama")
    # the cheap block at 0.75 of an exact verify (H200): two-level pays only below tau ~1.3
    weak, mid, strong = (
        AcceptanceProfile.parse(f"tau={t},block=8").survival() for t in (1.2, 1.5, 3)
    )
    assert screen(weak) is None and screen(weak, extension=4) is None
    assert screen(mid) is not None and screen(mid, cheap_fraction=0.5) is None
    why = screen(strong)
    assert why is not None and "too good" in why and "tau 3.00" in why
    assert screen(strong, cheap_fraction=0.2) is None  # a cheaper level would pay there

    def config(profile: str | None) -> EngineConfig:
        dep = DeploymentSpec("unused", drafter="block", dtype="bf16", simulate_acceptance=profile)
        return EngineConfig(dep, k=7)

    def searched(cfg: EngineConfig) -> bool:
        return "mechanism:two-level" in {d.name for d in directions_for(cfg, "cuda", "llama")}

    assert searched(config("tau=1.2,block=8")) and searched(config(None))  # real: the trial says
    assert not searched(config("tau=3,block=8"))
    skipped = skipped_mechanisms(config("tau=3,block=8"), "cuda", "llama")
    assert any(s.startswith("two-level: the cost model predicts") for s in skipped)
    assert not any(s.startswith("two-level") for s in skipped_mechanisms(config(None), "cuda", ""))
    # the mechanism's apply hands a graph-safe drafter (here under simulated acceptance) to the
    # device wrapper, knobs as given
    import types

    target = tiny_model(tiny_config(vocab=97), 0)
    build = types.SimpleNamespace(
        target=types.SimpleNamespace(model=target), drafter=simulated(target, random.Random(0), 6)
    )
    knobs = mech.resolve_knobs({"variant": "correct-extend", "max_extension": 3})
    mech.apply(build, knobs)  # type: ignore[arg-type]
    assert isinstance(build.drafter, DeviceTwoLevelDrafter)
    assert build.drafter.k == 5 + 1 + 3 and build.drafter.graph_safe


# ---------------------------------------------------------------- interpreter (subprocess)
def test_triton_path_in_interpreter() -> None:
    """bf16 on the CPU with TRITON_INTERPRET=1: the INT8 Triton GEMM and the fused decode
    kernels run inside the draft step; a peaked target (clear margins) still equals AR."""
    assert "interpreted ok" in run_interpreted([str(Path(__file__).resolve()), "triton"])


def _group_triton() -> None:
    from specpilot.synthetic import build_target, make_peaked

    dev = torch.device("cpu")
    with torch.inference_mode():
        target = make_peaked(build_target("tiny-llama", dev, torch.bfloat16, max_positions=128))
        draft = build_target("tiny-llama", dev, torch.bfloat16, seed=5, max_positions=128)
        cheap = cheap_model(target, 256)
        assert cheap.layers[0].linear_fns["w_qkv"].use_triton  # type: ignore[union-attr]
        prompts = [[3, 17, 40, 2, 9, 61, 5]]
        want = tokens(generate(Engine(target), prompts, 8))
        drafter = DeviceTwoLevelDrafter(DraftModelDrafter(draft, k=3), cheap, 1)
        assert tokens(generate(Engine(target, drafter), prompts, 8)) == want
        assert drafter.stats()["rows"] > 0
    print("interpreted ok")


if __name__ == "__main__":
    {"triton": _group_triton}[sys.argv[1]]()
