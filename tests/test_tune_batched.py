"""``tune --mode batched``: the search space, the gate, memory, and the tuned config in
``bench --mode batched`` and ``serve``, on tiny random models (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
import torch

from specpilot.cli import build_parser, main
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig, resolve_segment_tokens
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.memory import fingerprint_deployment
from specpilot.tune.space import config_hash, directions_for, skipped_mechanisms
from test_tune import FAULTY, tune_argv, tune_inputs

STATIC_ONLY = (
    "ragged-trees",
    "ragged-verify",
    "row-block-len",
    "static-tree-verify",
    "tiered-budget",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random model and three repetitive prompts (as in test_tune)."""
    return tune_inputs(tmp_path_factory.mktemp("tune-batched"))


def _config(mode: str, target: str = "m", **kw: object) -> EngineConfig:
    dep = DeploymentSpec(target=target, drafter="ngram", device="cpu", mode=mode)
    return EngineConfig(dep, k=4, drafter_knobs={"max_n": 3, "min_n": 1}, **kw)  # type: ignore[arg-type]


def test_batched_space_searches_only_what_the_scheduler_carries_out():
    names = {d.name for d in directions_for(_config("batched"), "cpu", "llama", num_layers=4)}
    assert {"draft-length", "ngram-sizes", "segment-tokens", "mechanism:adaptive-block"} <= names
    assert "mechanism:exact-argmax" in names  # the LM-head argmax runs in the scheduler's forward
    for name in (*STATIC_ONLY, "tree-verify"):
        assert f"mechanism:{name}" not in names
    skipped = "\n".join(skipped_mechanisms(_config("batched"), "cpu", "llama"))
    for name in (*STATIC_ONLY, "tree-verify"):
        assert f"{name}: carried out only by the" in skipped
    assert "block drafter" in skipped and "adaptive-block" not in skipped
    # single mode: no scheduler knob, no batched mechanism, tree verify searched as before
    single = {d.name for d in directions_for(_config("single"), "cpu", "llama", num_layers=4)}
    assert "segment-tokens" not in single and "mechanism:adaptive-block" not in single
    assert "mechanism:tree-verify" in single
    single_skipped = skipped_mechanisms(_config("single"), "cpu", "llama")
    assert [x.split(":")[0] for x in single_skipped] == ["static-tree-verify"]
    # every registered engine name is known; the static-engine ones say so
    assert all(not MECHANISMS[n].runs_on("scheduler") for n in STATIC_ONLY)


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


def test_scheduler_refuses_static_engine_mechanisms(tiny):
    model, _ = tiny
    cfg = _config("batched", str(model), mechanisms={"tiered-budget": {}})
    build = build_engine(cfg, 256)
    with pytest.raises(SpecPilotError, match="static-engine mechanisms \\(tiered-budget\\)"):
        build.scheduler(2)


def test_batched_tune_end_to_end(tiny, tmp_path, capsys, monkeypatch):
    """A batched tune inside a small budget: every trial token-forced, a lossy candidate
    rejected and quarantined, the report and memory say batched; the tuned config then loads in
    ``bench --mode batched --engine`` and ``serve --engine``."""
    model, prompts = tiny
    monkeypatch.setitem(MECHANISMS, FAULTY.name, FAULTY)
    out, memory = tmp_path / "out", tmp_path / "mem.sqlite"
    argv = tune_argv(model, prompts, out, memory, "--mode", "batched", "--concurrency", "2")
    argv += ["--requests", "4", "--rounds", "1", "--directions", "9", "--budget", "300"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "batched AR (4 requests at concurrency 2" in log
    assert "REJECTED by token forcing" in log and "+test-faulty-verify" in log
    assert "quarantined" in log and "skipped: tiered-budget" in log
    assert "[segment-tokens]" in log and "[mechanism:adaptive-block]" in log

    tuned = json.loads((out / "tuned.json").read_text())
    assert tuned["deployment"]["mode"] == "batched"
    assert FAULTY.name not in tuned["mechanisms"]
    report = (out / "report.md").read_text()
    assert "batched" in report.splitlines()[0] and "## Scope" in report
    assert "Mode: batched" in report and "concurrency 2" in report
    assert "tiered-budget: carried out only by the static engine" in report

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
    assert result["identical_to_ar"] == "4/4"

    # ... and in serve (app factory, no network): the worker runs the tuned engine's knobs.
    from fastapi.testclient import TestClient

    from specpilot.commands.serve import build_app

    app = build_app(build_parser().parse_args(["serve", "--engine", str(engine)]))
    worker = app.state.worker
    assert worker.segment_tokens == 7 and worker.engine.drafter.k == cfg.k
    assert (worker.block_policy is None) == ("adaptive-block" not in cfg.mechanisms)
    with TestClient(app) as http:
        body = {"model": str(model), "prompt": "hello world hi", "max_tokens": 8}
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    build = build_engine(dataclasses.replace(cfg, segment_tokens=None), 256)
    tok = build.target.tokenizer
    assert tok is not None
    ids = tok.encode("hello world hi")
    want = build.stock_engine().generate([ids], 8, tok.eos_token_ids)[0].tokens
    assert served == tok.decode(want, skip_special_tokens=True)


def test_serve_refuses_a_static_engine_config(tiny, tmp_path):
    from specpilot.commands.serve import build_app

    model, _ = tiny
    engine = tmp_path / "static.json"
    _config("batched", str(model), mechanisms={"ragged-verify": {}}).save(engine)
    with pytest.raises(SpecPilotError, match="ragged-verify"):
        build_app(build_parser().parse_args(["serve", "--engine", str(engine)]))
