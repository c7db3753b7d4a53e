"""The main job's pieces: early-exit drafter, local-search proposer, wall-clock budget, compare at
the end, and the grid/warm-start bench on tiny shapes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import repetitive_prompt
from specpilot.cli import main
from specpilot.drafters import DraftModelDrafter
from specpilot.drafters.early_exit import early_exit_model
from specpilot.engine import Engine, generate
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import Knob
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.runtime import LoadedModel, build_drafter
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.explorers import Explorer, make_explorer
from specpilot.tune.local_search import LocalSearchExplorer
from specpilot.tune.loop import TuneLoop, TuneOutcome, TuneSettings
from specpilot.tune.space import Direction, directions_for, early_exit_layers
from test_tune import tiny, tune_argv  # noqa: F401  (tiny is a fixture)

BASE = EngineConfig(deployment=DeploymentSpec(target="t"), k=4, drafter_knobs={"a": 1})


# ----------------------------------------------------------------------------- early exit
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("exit_layers,k", [(1, 2), (2, 4), (3, 5)])
def test_early_exit_drafter_output_equals_ar(seed, exit_layers, k):
    target = tiny_model(tiny_config(layers=4, vocab=89), seed)
    rng = random.Random(seed)
    prompts = [repetitive_prompt(rng, 89, n) for n in (9, 17)]
    ar = [r.tokens for r in generate(Engine(target), prompts, 40, [])]
    drafter = DraftModelDrafter(early_exit_model(target, exit_layers), k=k, target_vocab_size=89)
    spec = generate(Engine(target, drafter), prompts, 40, [])
    assert [r.tokens for r in spec] == ar
    assert all(r.stats.mean_accepted_len >= 1.0 for r in spec)


def test_early_exit_shares_the_targets_weights_and_rejects_bad_depths():
    target = tiny_model(tiny_config(layers=3), 0)
    draft = early_exit_model(target, 2)
    assert draft.cfg.num_layers == 2 and draft.layers[1] is target.layers[1]
    assert draft.lm_head is target.lm_head
    loaded = LoadedModel(spec="tiny", model=target, tokenizer=None)
    d = build_drafter("draft-model", loaded, 3, None, {"exit_layers": 2})
    assert isinstance(d, DraftModelDrafter) and d.model.cfg.num_layers == 2
    for bad in (0, 3):
        with pytest.raises(SpecPilotError, match="early-exit drafter needs 1 to 2 layers"):
            build_drafter("draft-model", loaded, 3, None, {"exit_layers": bad})


def test_directions_offer_the_early_exit_drafter_to_an_ngram_deployment():
    base = EngineConfig(deployment=DeploymentSpec(target="t", drafter="ngram"), k=8)
    names = [d.name for d in directions_for(base, "cpu", "llama", num_layers=30)]
    assert "early-exit-drafter" in names
    assert "early-exit-drafter" not in [d.name for d in directions_for(base, "cpu", "llama")]
    assert early_exit_layers(30) == (8, 12, 16, 20)
    ee = next(d for d in directions_for(base, "cpu", "llama", 30) if d.name == "early-exit-drafter")
    cfg = ee.derive(base, {"exit_layers": 12, "k": 3})
    assert cfg.deployment.drafter == "draft-model" and cfg.deployment.draft_model is None
    assert cfg.k == 3 and cfg.drafter_knobs == {"exit_layers": 12}
    ngram = next(d for d in directions_for(base, "cpu", "llama", 30) if d.name == "ngram-sizes")
    assert ngram.derive(cfg, {"max_n": 4, "min_n": 2}) == cfg  # n-gram sizes mean nothing here


# ----------------------------------------------------------------------------- local search
def _set(base: EngineConfig, p: dict) -> EngineConfig:
    k, a = int(p.get("k", base.k)), int(p.get("a", base.drafter_knobs["a"]))
    return dataclasses.replace(base, k=k, drafter_knobs={"a": a})


DIRECTION = Direction(
    "d", ("draft",), (Knob("k", 4, choices=(1, 2, 4, 6, 8)), Knob("a", 1, low=0, high=3)), _set
)


def test_local_search_never_repeats_skips_the_base_and_climbs():
    ex = LocalSearchExplorer(DIRECTION, seed=0)
    seen: set[tuple[int, int]] = set()
    base = BASE
    score = lambda c: -abs(c.k - 8) - abs(c.drafter_knobs["a"] - 3)  # noqa: E731
    for _ in range(12):
        props = ex.propose(base, 2)
        for p in props:
            key = (p.config.k, p.config.drafter_knobs["a"])
            assert key not in seen and p.config != base
            seen.add(key)
            ex.tell(p.trial_number, score(p.config))
            if score(p.config) > score(base):
                base = p.config
    assert (base.k, base.drafter_knobs["a"]) == (8, 3)  # the optimum of the 5 x 4 space
    assert len(seen) <= 20


def test_local_search_exhausts_a_space_then_proposes_nothing():
    d = Direction("d", ("draft",), (Knob("k", 4, choices=(2, 4)),), _set_k)
    ex = LocalSearchExplorer(d, seed=0)
    first = ex.propose(BASE, 5)
    assert [p.config.k for p in first] == [2]  # k=4 is the base itself
    assert ex.propose(BASE, 5) == []


@pytest.mark.parametrize("kind", ["local", "tpe"])
def test_both_explorers_propose_the_defaults_then_the_seeds(kind):
    if kind == "tpe":
        pytest.importorskip("optuna")
    seeded = dataclasses.replace(DIRECTION, seeds=({"k": 8, "a": 3}, {"k": 1, "a": 0}))
    ex = make_explorer(seeded, 0, kind)
    base = dataclasses.replace(BASE, k=2, drafter_knobs={"a": 2})
    first = [(p.config.k, p.config.drafter_knobs["a"]) for p in ex.propose(base, 3)]
    assert first == [(4, 1), (8, 3), (1, 0)]


def test_tree_verify_is_seeded_with_the_measured_trees_on_cuda_only():
    base = EngineConfig(deployment=DeploymentSpec(target="t", drafter="block"), k=7)
    by_dev = {
        dev: next(
            d for d in directions_for(base, dev, "llama") if d.name == "mechanism:tree-verify"
        )
        for dev in ("cpu", "cuda")
    }
    assert by_dev["cpu"].seeds == ()
    nodes = [s["max_nodes"] for s in by_dev["cuda"].seeds]
    assert nodes == [48, 32] and all(
        set(s) == {"depth", "width", "branch", "max_nodes"} for s in by_dev["cuda"].seeds
    )


@pytest.mark.parametrize("kind", ["local", "tpe"])
def test_w12_is_tried_at_the_verify_width_first(kind):
    """W12's default serves width 1 only (max_m 1): a drafting deployment first measures the
    tensor-core kernel at k + 1 rows, the width its verify runs at, then the default (the
    2026-12-05 tunes on the H200 tried max_m 1 and 2 only, with k 15 and 7)."""
    if kind == "tpe":
        pytest.importorskip("optuna")
    dep = DeploymentSpec(target="t", drafter="block", device="cuda", dtype="bf16")
    for k, width in ((15, 16), (7, 8), (80, 64)):
        base = EngineConfig(deployment=dep, k=k)
        w12 = next(d for d in directions_for(base, "cuda", "llama") if d.name == "mechanism:w12")
        first = make_explorer(w12, 0, kind).propose(base, 2)
        knobs = [p.config.mechanisms["w12"] for p in first]
        assert [(c["kernel"], c["max_m"]) for c in knobs] == [("mma", width), ("table", 1)]
    # once a 48-node tree is the best, the seed lands on it at the tree's verify width
    base = EngineConfig(deployment=dep, k=7)
    tree = {"depth": 16, "width": 7, "branch": 2, "max_nodes": 48}
    best = dataclasses.replace(base, mechanisms={"tree-verify": tree})
    w12 = next(d for d in directions_for(base, "cuda", "llama") if d.name == "mechanism:w12")
    on_tree = make_explorer(w12, 0, kind).propose(best, 2)
    assert [p.config.mechanisms["w12"]["max_m"] for p in on_tree] == [49, 1]
    assert all(p.config.mechanisms["tree-verify"] == tree for p in on_tree)
    ar = EngineConfig(deployment=DeploymentSpec(target="t", drafter="none", dtype="bf16"), k=0)
    w12 = next(d for d in directions_for(ar, "cuda", "llama") if d.name == "mechanism:w12")
    assert w12.seeds == ()  # plain AR runs width 1: the default is its width


def test_a_simulated_profile_fixes_k_for_joint_mechanisms(tmp_path):
    """gguf-blocks searches k with its knobs, except where a simulated profile fixes the draft
    length (a trial at another k failed: 'the profile has 7 draft positions')."""
    pytest.importorskip("numba")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # the screen reads the path's suffix only
    dep = DeploymentSpec(target=str(gguf), drafter="ngram", device="cpu", dtype="fp32")
    real = EngineConfig(deployment=dep, k=7)
    sim = EngineConfig(
        deployment=dataclasses.replace(dep, simulate_acceptance="tau=3,block=8"), k=7
    )
    for base, joint in ((real, True), (sim, False)):
        gguf = next(
            d for d in directions_for(base, "cpu", "llama") if d.name == "mechanism:gguf-blocks"
        )
        assert ("k" in {p.name for p in gguf.params}) == joint
        ks = {p.config.k for p in make_explorer(gguf, 0, "local").propose(base, 6)}
        assert ks == {7} if not joint else len(ks) > 1, ks


def test_a_seed_with_an_unknown_knob_is_refused_at_registration():
    from specpilot.mechanisms.registry import Mechanism

    with pytest.raises(ValueError, match="no knob"):
        Mechanism(
            "m",
            "verify",
            "verify_strategy",
            "-",
            lambda b, k: None,
            (),
            seeds={"cuda": ({"nodes": 4},)},
        )


def _set_path(base: EngineConfig, p: dict) -> EngineConfig:
    return dataclasses.replace(base, drafter_knobs=dict(p))


PATHS = Direction(
    "p",
    ("argmax",),
    (
        Knob("path", "auto", choices=("auto", "graph", "host")),
        Knob("c", 8, low=1, high=64, when=(("path", ("auto", "graph")),)),
        Knob("r", 4096, low=64, high=65536, when=(("path", ("auto", "host")),)),
    ),
    _set_path,
)


@pytest.mark.parametrize("kind", ["local", "tpe"])
def test_a_knob_that_does_nothing_for_the_chosen_path_stays_at_its_default(kind):
    """``Knob.when``: on the host path ``c`` does nothing, on the graph path ``r`` does nothing;
    neither explorer varies them there, nor proposes two points that differ only in them."""
    if kind == "tpe":
        pytest.importorskip("optuna")
    ex = make_explorer(PATHS, 0, kind)
    seen: set[tuple] = set()
    for _ in range(12):
        for p in ex.propose(BASE, 4):
            kn = p.config.drafter_knobs
            if kn["path"] == "host":
                assert kn["c"] == 8
            if kn["path"] == "graph":
                assert kn["r"] == 4096
            key = tuple(sorted(kn.items()))
            assert key not in seen
            seen.add(key)
            ex.tell(p.trial_number, {"auto": 0, "graph": 5, "host": 10}[kn["path"]] + kn["c"] / 100)
    assert {k[1][1] for k in seen} >= {"graph", "host"}  # both paths were explored


def test_canonical_and_a_dependency_on_an_unknown_knob():
    from specpilot.mechanisms import canonical
    from specpilot.mechanisms.registry import Mechanism

    knobs = PATHS.params
    assert canonical(knobs, {"path": "host", "c": 3, "r": 99}) == {"path": "host", "c": 8, "r": 99}
    assert canonical(knobs, {"path": "auto", "c": 3, "r": 99}) == {"path": "auto", "c": 3, "r": 99}
    for when in ((("mode", ("x",)),), (("path", ("gpu",)),)):
        with pytest.raises(ValueError, match=r"depends on|has no values"):
            Mechanism(
                "m", "verify", "verify_strategy", "-", lambda b, k: None,
                (Knob("path", "auto", choices=("auto", "host")), Knob("c", 1, low=0, high=2, when=when)),
            )  # fmt: skip


def test_winners_of_two_directions_are_stacked_one_direction_is_not():
    from specpilot.tune.integrate import per_direction, stacked
    from specpilot.tune.proposal import Proposal

    def win(explorer: str, params: dict, sp: float) -> tuple[Proposal, TrialResult]:
        r = TrialResult(BASE, 10 * sp, sp, 2.0, [], True, {}, 0.0, 0.0, rounds=[sp] * 3)
        return Proposal(explorer, params, BASE, 0), r

    derive = {
        "k": lambda c, p: dataclasses.replace(c, k=p["k"]),
        "a": lambda c, p: dataclasses.replace(c, drafter_knobs={**c.drafter_knobs, "a": p["a"]}),
    }
    one = [win("k", {"k": 6}, 1.2), win("k", {"k": 8}, 1.3)]
    assert stacked(BASE, one, derive) is None
    assert per_direction(one)["k"][0].params == {"k": 8}  # the direction's fastest
    both = [*one, win("a", {"a": 3}, 1.1)]
    cfg = stacked(BASE, both, derive)
    assert cfg is not None and cfg.k == 8 and cfg.drafter_knobs == {"a": 3}


def _set_k(base: EngineConfig, p: dict) -> EngineConfig:
    return dataclasses.replace(base, k=int(p["k"]))


def test_make_explorer_falls_back_without_optuna(monkeypatch):
    assert isinstance(make_explorer(DIRECTION, 0, "local"), LocalSearchExplorer)
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    assert isinstance(make_explorer(DIRECTION, 0, "auto"), LocalSearchExplorer)
    with pytest.raises(ValueError, match="Unknown explorer kind"):
        make_explorer(DIRECTION, 0, "grid")


def test_make_explorer_prefers_tpe_when_installed():
    pytest.importorskip("optuna")
    assert isinstance(make_explorer(DIRECTION, 0, "auto"), Explorer)


# ----------------------------------------------------------------------------- budget
class SlowExecutor:
    """Each candidate takes ``seconds`` and scores by a fixed function of its knobs."""

    width = 1
    ar_tok_s = 10.0

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        out = []
        for c in configs:
            time.sleep(self.seconds)
            self.calls += 1
            tok_s = 10.0 + c.k + c.drafter_knobs["a"]
            sp = tok_s / 10  # the same in every round: an exact, noise-free measurement
            out.append(
                TrialResult(c, tok_s, sp, 2.0, [], True, {}, 0.0, self.seconds, rounds=[sp] * 3)
            )
        return out

    def close(self) -> None:
        pass


def _fingerprint(tag: str) -> Fingerprint:
    return Fingerprint("t", tag, "cpu", "", "", torch.__version__, "fp32", "single")


@pytest.mark.parametrize("explorer", ["local", "tpe"])
def test_the_loop_stops_inside_its_wall_clock_budget(tmp_path, explorer):
    if explorer == "tpe":
        pytest.importorskip("optuna")
    ex = SlowExecutor(0.05)
    settings = TuneSettings(
        rounds=100, trials_per_direction=3, budget_seconds=1.5, explorer=explorer, min_gain=-1.0
    )  # 1.5 s: the loop's own bookkeeping leaves room for 3 trials on a loaded 2-core machine
    with MemoryStore(tmp_path / "m.sqlite") as store:
        loop = TuneLoop(BASE, [DIRECTION], ex, store, _fingerprint("a"), "a", settings, log=print)
        t0 = time.perf_counter()
        out = loop.run()
        wall = time.perf_counter() - t0
        assert wall <= 1.5 + 0.05 + 0.1  # at most one slowest trial late (plus bookkeeping)
        assert out.rounds_run >= 1 and ex.calls >= 3
        assert len(store.trials(run=loop.run_id)) == ex.calls  # every finished trial is kept
        assert all(t.elapsed <= wall for t in out.trials)


def test_a_round_without_a_winner_moves_on_to_untried_directions(tmp_path):
    flat = Direction("flat", ("lm_head",), (Knob("a", 1, low=0, high=0),), _set)
    steep = Direction("steep", ("draft",), (Knob("k", 4, choices=(4, 8)),), _set_k)
    settings = TuneSettings(rounds=5, directions_per_round=1, explorer="local")
    logs: list[str] = []
    with MemoryStore(tmp_path / "m.sqlite") as store:
        # "flat" ranks first (lm_head) and cannot win; "steep" must still get its turn.
        loop = TuneLoop(
            BASE,
            [flat, steep],
            SlowExecutor(0.0),
            store,
            _fingerprint("b"),
            "b",
            settings,
            gap_order=("lm_head", "draft"),
            log=logs.append,
        )
        out = loop.run()
    assert out.best.config.k == 8
    assert any("next: steep" in m for m in logs)


class NoisyStockExecutor:
    """Shares rounds (so the loop confirms head to head). The stock config's first measurement
    has one noisy round (its spread reaches above the candidate); in a head-to-head chunk every
    config is steady, the candidate ``true_gain`` times the stock."""

    width = 1
    ar_tok_s = 10.0
    shares_rounds = True

    def __init__(self, true_gain: float) -> None:
        self.true_gain, self.chunks = true_gain, 0

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        self.chunks += 1
        out = []
        for c in configs:
            stock = c.k == 4
            if len(configs) == 2:  # the head-to-head chunk: steady rounds
                rounds = [1.40] * 3 if stock else [1.40 * self.true_gain] * 3
            else:
                rounds = [1.36, 1.64, 1.41] if stock else [1.46, 1.57, 1.59]
            sp = sorted(rounds)[1]
            out.append(TrialResult(c, 10 * sp, sp, 2.0, [], True, {}, 0.0, 0.0, rounds=rounds))
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("true_gain", [1.12, 1.0])
def test_a_contender_inside_the_bests_spread_is_confirmed_head_to_head(tmp_path, true_gain):
    d = Direction("d", ("draft",), (Knob("k", 8, choices=(8,)),), _set_k)
    settings = TuneSettings(rounds=2, explorer="local", min_gain=0.02)
    logs: list[str] = []
    ex = NoisyStockExecutor(true_gain)
    with MemoryStore(tmp_path / "m.sqlite") as store:
        loop = TuneLoop(BASE, [d], ex, store, _fingerprint("c"), "c", settings, log=logs.append)
        out = loop.run()
    assert any("head to head" in m for m in logs), logs
    assert ex.chunks >= 3  # stock, the candidate, then the two together
    assert (out.best.config.k == 8) == (true_gain > 1.0)  # adopted only if it wins there


def test_with_no_time_left_an_interval_winner_is_taken_and_a_contender_is_not(tmp_path):
    ex = NoisyStockExecutor(1.12)
    d = Direction("d", ("draft",), (Knob("k", 8, choices=(8,)),), _set_k)
    logs: list[str] = []
    with MemoryStore(tmp_path / "m.sqlite") as store:
        loop = TuneLoop(
            BASE, [d], ex, store, _fingerprint("e"), "e", TuneSettings(), log=logs.append
        )
        best, cand = ex.map([BASE])[0], ex.map([dataclasses.replace(BASE, k=8)])[0]
        outcome = TuneOutcome(stock=best, best=best, ar_tok_s=10.0)
        loop._time_left = lambda: False  # type: ignore[method-assign]
        assert loop._confirm(1, outcome, cand, interval_ok=True) is cand
        assert loop._confirm(1, outcome, cand, interval_ok=False) is None
    assert ex.chunks == 2  # no head-to-head chunk was run
    assert "taken on the interval rule" in logs[0] and "not taken" in logs[1]


# ----------------------------------------------------------------------------- the command
def test_tune_ends_with_a_compare_on_held_out_prompts(tiny, tmp_path, capsys):  # noqa: F811
    model, prompts = tiny
    out = tmp_path / "out"
    argv = tune_argv(model, prompts, out, tmp_path / "m.sqlite", "--rounds", "1")
    argv += ["--limit", "2", "--compare-limit", "1", "--rank-gaps", "static"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "search budget" in log and "kept for the final compare" in log
    assert "compare on 1 held-out prompts" in log and "tuned over stock speculative" in log
    assert json.loads((out / "stock.json").read_text())["k"] == 2
    lines = (out / "compare.jsonl").read_text().splitlines()
    assert len(lines) == 3  # ar, stock, tuned on the one held-out prompt


def test_tune_budget_too_small_still_measures_stock_and_writes_outputs(tiny, tmp_path, capsys):  # noqa: F811
    model, prompts = tiny
    out = tmp_path / "out"
    argv = tune_argv(model, prompts, out, tmp_path / "m.sqlite", "--budget", "0.001")
    argv += ["--rank-gaps", "static", "--compare-limit", "0"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "time budget spent" in log, log
    assert (out / "tuned.json").exists() and (out / "report.md").exists()


# ----------------------------------------------------------------------------- the bench
def test_tune_targets_bench_tiny_end_to_end(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "tune_targets.py"
    spec = importlib.util.spec_from_file_location("tune_targets", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tune_targets"] = mod
    spec.loader.exec_module(mod)
    res = mod.main(["--tiny", "--explorer", "local", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "tune_targets.json").read_text())
    for s in ("cpu", "gpu"):
        r = data[s]
        assert r["grid"]["all_lossless"] and r["grid"]["configs"] == len(r["grid"]["table"])
        assert r["loop"]["trials"] >= 1 and 0 < r["loop"]["cost_fraction_of_grid"] < 1.5
        assert r["proposer"] == "local"
        assert r["warm_start"]["warm_reused"]  # the warm run re-measured deployment A's best
    assert data["gpu"]["label"] == "simulated acceptance"
    assert res["cpu"]["grid"]["configs"] == 3 * 5  # k x the 5 distinct (min_n, max_n) pairs


@pytest.mark.slow
def test_smollm2_early_exit_drafter_equals_ar():
    from specpilot.bench.prompts import load_prompt_set
    from specpilot.runtime import load_model

    smol = load_model("smollm2-135m", torch.float32, "cpu", 2048)
    tok = smol.tokenizer
    assert tok is not None
    prompts = [tok.apply_chat_template(p.messages) for p in load_prompt_set("copy-heavy", 2)]
    eos = list(tok.eos_token_ids)
    ar = [r.tokens for r in generate(Engine(smol.model), prompts, 24, eos)]
    for layers in early_exit_layers(smol.model.cfg.num_layers)[1:2]:  # 12 of 30
        drafter = build_drafter("draft-model", smol, 4, None, {"exit_layers": layers})
        spec = generate(Engine(smol.model, drafter), prompts, 24, eos)
        assert [r.tokens for r in spec] == ar
        assert all(r.stats.mean_accepted_len > 1.0 for r in spec)
