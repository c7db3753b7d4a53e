"""The Ray executor on a local Ray cluster (CPU, tiny model): trials go to whichever worker is
idle, a worker killed mid-trial loses no trial, a trial lost on every attempt is reported, a lost
pool is a clear error, workers hold no memory store, and the report states the workers, the
device-seconds summed over them and the wall time."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from ray_actors import POISON_K, STALL_K, ScriptedActor
from specpilot.cli import main
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.memory import MemoryStore, fingerprint_deployment
from specpilot.runtime import parse_device
from specpilot.tune.executors import LocalExecutor
from specpilot.tune.loop import TuneLoop, TuneSettings
from specpilot.tune.ray_actor import EvalActor
from specpilot.tune.ray_executor import RayExecutor, WorkersLostError, placement
from specpilot.tune.report import write_report
from specpilot.tune.space import config_hash, directions_for
from test_tune import tune_argv, tune_inputs

ray = pytest.importorskip("ray")

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
PROMPTS = [[1, 2, 3, 4] * 5, [2, 3, 4, 5] * 5]


@pytest.fixture(scope="module")
def cluster():
    """One local cluster of two CPUs for the module; its workers import specpilot and this
    folder's test actor."""
    env = {"PYTHONPATH": f"{SRC}{os.pathsep}{TESTS}", "OMP_WAIT_POLICY": "PASSIVE"}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    yield
    ray.shutdown()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A tiny model in this test's own folder (the scripted actor's control folder)."""
    return tune_inputs(tmp_path)[0]


def base_of(model: Path) -> EngineConfig:
    return EngineConfig(DeploymentSpec(target=str(model), device="cpu", dtype="fp32"), k=2)


def with_k(model: Path, *ks: int) -> list[EngineConfig]:
    return [dataclasses.replace(base_of(model), k=k) for k in ks]


def executor(model: Path, log: list[str], workers: int = 2, **kw: object) -> RayExecutor:
    return RayExecutor(
        base_of(model),
        PROMPTS,
        12,
        workers=workers,
        rounds=1,
        progress=log.append,
        actor_cls=ScriptedActor,
        **kw,  # type: ignore[arg-type]
    )


def test_placement_one_gpu_per_worker_and_clear_errors():
    assert placement("cuda", {"GPU": 4.0, "CPU": 64.0}, None) == (4, "num_gpus")
    assert placement("cuda", {"GPU": 4.0}, 2) == (2, "num_gpus")
    assert placement("cpu", {"CPU": 2.0, "GPU": 8.0}, None) == (1, "num_cpus")
    assert placement("cpu", {"CPU": 2.0}, 2) == (2, "num_cpus")
    for device, resources, workers, words in (
        ("cuda", {"GPU": 2.0}, 3, "the Ray cluster has 2"),
        ("cuda", {"CPU": 8.0}, None, "has none"),
        ("cpu", {"CPU": 2.0}, 3, "ask for at most 2"),
        ("cpu", {"CPU": 2.0}, 0, "at least 1"),
    ):
        with pytest.raises(SpecPilotError, match=words):
            placement(device, resources, workers)


def test_local_executor_reports_the_same_usage_fields(model):
    ex = LocalExecutor(base_of(model), PROMPTS, 12, rounds=1, width=2)
    got = ex.map(with_k(model, 2, 3))
    assert [r.worker for r in got] == ["local", "local"]
    assert all(r.busy_seconds > 0 for r in got)
    assert list(ex.usage.workers) == ["local"] and ex.usage.workers["local"].trials == 2
    assert ex.usage.busy_seconds == pytest.approx(sum(r.busy_seconds for r in got))
    assert "1 worker (this process, no GPU used)" in ex.usage.summary(1.0)


def test_trials_go_to_whichever_worker_is_idle(cluster, model):
    """The first trial stalls until the other three are back: a dispatcher that hands trials
    out by index would give the stalled worker one of them; an idle-first one gives it none."""
    log: list[str] = []
    ex = executor(model, log)
    try:
        configs = with_k(model, STALL_K, 2, 3, 4)
        arrived = []

        def on_result(r):
            arrived.append(r.config.k)
            if len(arrived) == 3:
                (model.parent / "release").touch()

        got = ex.stream(configs, on_result=on_result)
        assert [r.config.k for r in got] == [STALL_K, 2, 3, 4]
        assert arrived[-1] == STALL_K and all(r.error is None for r in got)
        stalled = got[0].worker
        assert {r.worker for r in got[1:]} == {"w0", "w1"} - {stalled}
        assert Counter(w.trials for w in ex.usage.workers.values()) == Counter({1: 1, 3: 1})
        state = ray.get(ex._workers[0].actor.memory_state.remote())
    finally:
        ex.close()
    # One writer: a worker imported nothing of the memory store and holds nothing of it.
    assert state["modules"] == []
    assert set(state["attributes"]) == {"name", "evaluator"}
    assert "store" not in " ".join(EvalActor.__init__.__code__.co_varnames).lower()
    assert "memory" not in " ".join(EvalActor.__init__.__code__.co_varnames).lower()


def test_a_killed_worker_is_restarted_and_its_trial_run_again(cluster, model):
    log: list[str] = []
    (model.parent / "die-once").touch()
    ex = executor(model, log, workers=1)
    try:
        before = ex.pids()["w0"]
        got = ex.map(with_k(model, 3))
        after = ex.pids()["w0"]
    finally:
        ex.close()
    assert len(got) == 1 and got[0].error is None and got[0].worker == "w0"
    assert after != before
    text = "\n".join(log)
    assert f"worker w0 (pid {before}) died" in text and "attempt 2/2" in text
    assert f"worker w0 restarted (pid {before} -> {after}" in text
    w0 = ex.usage.workers["w0"]
    assert (w0.deaths, w0.restarts, w0.lost, w0.trials) == (1, 1, False, 1)
    line = ex.usage.per_worker()[0]
    assert line.startswith("w0: 1 trials") and line.endswith("died 1x, restarted 1x")


def test_a_worker_killed_mid_run_loses_no_trial(cluster, model, tmp_path):
    """A whole tune on two workers, one of which dies in the first trial: every trial has a
    result, the memory holds each exactly once, and the report says what it cost."""
    log: list[str] = []
    (model.parent / "die-once").touch()
    base = base_of(model)
    ex = executor(model, log)
    store = MemoryStore(tmp_path / "mem.sqlite")
    fp = fingerprint_deployment(str(model), "ngram", None, parse_device("cpu"), "fp32", "single")
    settings = TuneSettings(rounds=1, trials_per_direction=2, directions_per_round=2)
    directions = directions_for(base, "cpu", ex.arch, ex.num_layers)
    loop = TuneLoop(base, directions, ex, store, fp, "tiny", settings, log=log.append)
    try:
        outcome = loop.run()
    finally:
        ex.close()
    hashes = {config_hash(t.result.config) for t in outcome.trials}
    assert len(hashes) >= 3 and all(t.result.error is None for t in outcome.trials)
    rows = store.trials(run=loop.run_id)
    assert sorted(r.config_hash for r in rows) == sorted(hashes)  # each once, none missing
    store.close()
    assert sum(w.deaths for w in outcome.usage.workers.values()) == 1
    assert "died after" in "\n".join(log) and "goes to the next free worker" in "\n".join(log)
    report = write_report(outcome, "tiny", tmp_path / "out", tmp_path / "tuned.json")
    text = report.read_text()
    assert "summed over 2 worker(s)" in text and "s wall time" in text
    assert "died 1x" in text


def test_a_trial_lost_on_every_attempt_is_reported_and_a_lost_pool_is_an_error(cluster, model):
    log: list[str] = []
    ex = executor(model, log, max_restarts=0)
    arrived = []
    try:
        got = ex.stream(with_k(model, POISON_K, 2), on_result=arrived.append)
        with pytest.raises(WorkersLostError, match=r"Every Ray worker died for good.*--resume"):
            ex.map(with_k(model, 3))
    finally:
        ex.close()
    assert [r.config.k for r in got] == [POISON_K, 2] and len(arrived) == 2
    lost, ok = got
    assert ok.error is None
    assert not lost.forcing_ok and lost.error is not None
    assert "lost on all 2 attempts" in lost.error
    assert "worker w0" in lost.error and "worker w1" in lost.error
    assert all(w.lost for w in ex.usage.workers.values())
    assert "lost for good" in "\n".join(log)


def test_tune_command_reports_workers_device_seconds_and_wall_time(cluster, tmp_path, capsys):
    model, prompts = tune_inputs(tmp_path)
    out, memory = tmp_path / "out", tmp_path / "mem.sqlite"
    argv = tune_argv(model, prompts, out, memory, "--rounds", "1", "--executor", "ray")
    assert main([*argv, "--workers", "2"]) == 0
    log = capsys.readouterr().out
    assert "search: 2 workers (Ray actors, on the CPU, no GPU used)" in log
    assert "tuned:" in log and (out / "tuned.json").is_file()
    assert "worker w0 ready" in log and "worker w1 ready" in log
    search = json.loads((out / "run.json").read_text())["search"]
    assert search["executor"] == "ray" and search["workers"] == 2
    assert search["device_seconds"] > 0 and search["wall_seconds"] > 0
    rows = sqlite3.connect(memory).execute("SELECT metrics FROM trials").fetchall()
    workers = Counter(json.loads(m)["worker"] for (m,) in rows)
    assert set(workers) == {"w0", "w1"}  # both used, each trial stamped with its worker
    assert {k: v["trials"] for k, v in search["per_worker"].items()} == dict(workers)
    report = (out / "report.md").read_text()
    assert "summed over 2 worker(s)" in report and "wall time" in report
    assert "| worker |" in report and "| w1 |" in report


def test_workers_that_cannot_load_the_target_are_a_clear_error(cluster, tmp_path):
    log: list[str] = []
    with pytest.raises(SpecPilotError, match=r"No Ray worker started \(w0: .*; w1: "):
        executor(tmp_path / "missing-model", log)
    assert "worker w0 did not start" in "\n".join(log)
