"""``tune --mode batched``: the search space, the gate, memory, and the tuned config in
``bench --mode batched`` and ``serve``, on tiny random models (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
import torch

from specpilot.cli import build_parser, main
from specpilot.engine import generate
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig, resolve_segment_tokens
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.memory import fingerprint_deployment
from specpilot.tune.space import config_hash, directions_for, skipped_mechanisms
from test_tune import FAULTY, tune_argv, tune_inputs

BATCHED_ONLY = ("adaptive-block", "ragged-verify", "row-block-len", "tiered-budget")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random model and three repetitive prompts (as in test_tune)."""
    return tune_inputs(tmp_path_factory.mktemp("tune-batched"))


def _config(mode: str, target: str = "m", **kw: object) -> EngineConfig:
    dep = DeploymentSpec(target=target, drafter="ngram", device="cpu", mode=mode)
    return EngineConfig(dep, k=4, drafter_knobs={"max_n": 3, "min_n": 1}, **kw)  # type: ignore[arg-type]


def test_every_mechanism_that_applies_is_searched_and_the_others_are_named_with_why():
    names = {d.name for d in directions_for(_config("batched"), "cpu", "llama", num_layers=4)}
    assert {"draft-length", "ngram-sizes", "segment-tokens"} <= names
    for name in (*BATCHED_ONLY, "exact-argmax", "tree-verify"):
        assert f"mechanism:{name}" in names  # one engine: the scheduler runs every plan
    skipped = "\n".join(skipped_mechanisms(_config("batched"), "cpu", "llama"))
    assert "w12: not for device cpu (it applies to cuda)" in skipped
    assert "ragged-trees: not for drafter ngram" in skipped
    searched = {n.removeprefix("mechanism:") for n in names if n.startswith("mechanism:")}
    named = {line.split(":")[0] for line in skipped.splitlines()}
    assert searched | named == set(MECHANISMS) and not searched & named
    # single mode: no scheduler knob, no batched-only mechanism, and each says why
    single = {d.name for d in directions_for(_config("single"), "cpu", "llama", num_layers=4)}
    assert "segment-tokens" not in single and "mechanism:tree-verify" in single
    single_skipped = "\n".join(skipped_mechanisms(_config("single"), "cpu", "llama"))
    for name in BATCHED_ONLY:
        assert f"mechanism:{name}" not in single
        assert f"{name}: not for mode single (it applies to batched)" in single_skipped


def test_simulated_acceptance_searches_mechanisms_only():
    dep = DeploymentSpec(
        target="m", drafter="block", mode="batched", simulate_acceptance="tau=3,block=5"
    )
    base = EngineConfig(dep, k=4)
    names = {d.name for d in directions_for(base, "cpu", "llama", num_layers=4)}
    assert "draft-length" not in names and "early-exit-drafter" not in names
    assert "mechanism:ragged-trees" in names and "segment-tokens" in names


def test_segment_tokens_direction_and_engine_config_field(tmp_path):
    base = _config("batched")
    seg = next(d for d in directions_for(base, "cpu", "llama") if d.name == "segment-tokens")
    assert seg.params[0].default == 256
    assert seg.derive(base, {"segment_tokens": 256}) == base  # the default is the stock config
    cfg = seg.derive(base, {"segment_tokens": 32})
    assert cfg.segment_tokens == 32 and config_hash(cfg) != config_hash(base)
    # unset, the JSON (and so every stored config hash) is what it was before the field existed
    assert "segment_tokens" not in base.to_json()
    cfg.save(tmp_path / "e.json")
    assert EngineConfig.load(tmp_path / "e.json") == cfg
    assert resolve_segment_tokens(cfg, None) == 32
    assert resolve_segment_tokens(cfg, 7) == 7  # a command-line flag wins
    assert resolve_segment_tokens(base, None) == 256
    with pytest.raises(SpecPilotError, match="segment_tokens must be at least 1"):
        dataclasses.replace(base, segment_tokens=0)


def test_fingerprints_distinguish_modes():
    cpu = torch.device("cpu")
    single = fingerprint_deployment("tiny-x", "ngram", None, cpu, "fp32", "single")
    batched = fingerprint_deployment("tiny-x", "ngram", None, cpu, "fp32", "batched")
    assert single.key != batched.key and batched.mode == "batched"
    assert batched.similarity(single) < batched.similarity(batched)


def test_the_scheduler_runs_the_batched_plans_losslessly(tiny):
    model, _ = tiny
    from specpilot.engine import Request

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 3, 9, 9, 3, 9], [4, 2, 4, 2, 4, 2, 4, 2, 4]]
    want = None
    for mechs in ({}, {"tiered-budget": {}}, {"ragged-verify": {}}, {"row-block-len": {}}):
        build = build_engine(_config("batched", str(model), mechanisms=mechs), 256)
        sched = build.scheduler(2, segment_tokens=3, max_context=64)
        reqs = [Request(f"r{i}", tuple(p), 12) for i, p in enumerate(prompts)]
        got = [r.tokens for r in sched.run(reqs)]
        if want is None:
            stock = build.scheduler(2, segment_tokens=3, max_context=64, stock=True)
            want = [r.tokens for r in stock.run(reqs)]
        assert got == want, mechs


def test_batched_tune_end_to_end(tiny, tmp_path, capsys, monkeypatch):
    """A batched tune inside a small budget: every trial token-forced, a lossy candidate
    rejected and quarantined, the report and memory say batched; the tuned config then loads in
    ``bench --mode batched --engine`` and ``serve --engine``."""
    model, prompts = tiny
    monkeypatch.setitem(MECHANISMS, FAULTY.name, FAULTY)
    out, memory = tmp_path / "out", tmp_path / "mem.sqlite"
    argv = tune_argv(model, prompts, out, memory, "--mode", "batched", "--concurrency", "2")
    argv += ["--requests", "4", "--rounds", "1", "--directions", "12", "--budget", "300"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "batched AR (4 requests at concurrency 2" in log
    assert "REJECTED by token forcing" in log and "+test-faulty-verify" in log
    assert "quarantined" in log and "not searched: w12: not for device cpu" in log
    assert "[segment-tokens]" in log

    tuned = json.loads((out / "tuned.json").read_text())
    assert tuned["deployment"]["mode"] == "batched"
    assert FAULTY.name not in tuned["mechanisms"]
    report = (out / "report.md").read_text()
    assert "batched" in report.splitlines()[0] and "## Scope" in report
    assert "Mode: batched" in report and "concurrency 2" in report
    assert "w12: not for device cpu" in report

    db = sqlite3.connect(memory)
    fps = [json.loads(r[0]) for r in db.execute("SELECT fingerprint FROM deployments")]
    assert [fp["mode"] for fp in fps] == ["batched"]
    rows = db.execute("SELECT explorer, forcing_ok, forcing FROM trials").fetchall()
    assert len(rows) >= 6
    for explorer, ok, forcing in rows:  # only the planted fault fails the gate
        assert ok == (explorer != f"mechanism:{FAULTY.name}"), (explorer, forcing)
        assert json.loads(forcing)["matches"] > 0 or not ok
    faulty = [r for r in rows if r[0] == f"mechanism:{FAULTY.name}"]
    assert len(faulty) == 1 and "first_mismatch" in json.loads(faulty[0][2])

    # The tuned config in bench --mode batched, with a scheduler knob it must pick up.
    engine = tmp_path / "tuned7.json"
    cfg = EngineConfig.load(out / "tuned.json")
    dataclasses.replace(cfg, segment_tokens=7).save(engine)
    bench = ["bench", "--mode", "batched", "--engine", str(engine), "--concurrency", "2"]
    bench += ["--prompts", str(prompts), "--limit", "3", "--max-new-tokens", "12", "--json"]
    assert main([*bench, "--out", str(tmp_path / "b.jsonl")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["segment_tokens"] == 7 and result["forcing"]["ok"]
    same, total = map(int, result["identical_to_ar"].split("/"))
    assert same == total and total % 4 == 0  # 4 requests, every round

    # ... and in serve (app factory, no network): the worker runs the tuned engine's knobs.
    from fastapi.testclient import TestClient

    from specpilot.commands.serve import build_app

    app = build_app(build_parser().parse_args(["serve", "--engine", str(engine)]))
    worker = app.state.worker
    sched = worker.scheduler
    assert sched.segment_tokens == 7 and sched.engine.drafter.k == cfg.k
    policy = getattr(sched.engine.plan, "caps", None)
    has_adaptive = policy is not None and type(policy.policy).__name__ == "AdaptiveBlock"
    assert has_adaptive == ("adaptive-block" in cfg.mechanisms)
    with TestClient(app) as http:
        body = {"model": str(model), "prompt": "hello world hi", "max_tokens": 8}
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    build = build_engine(dataclasses.replace(cfg, segment_tokens=None), 256)
    tok = build.target.tokenizer
    assert tok is not None
    ids = tok.encode("hello world hi")
    want = generate(build.stock_engine(), [ids], 8, tok.eos_token_ids)[0].tokens
    assert served == tok.decode(want, skip_special_tokens=True)
