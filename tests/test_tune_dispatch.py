"""The loop on a pool that streams results (``tune/dispatch.py``), with fake executors: a round's
trials of every direction go out as one queue (the stock trial leading round 1's), results that
come back out of order change nothing the search decides (the same trials, the same best, as in
order and as the local chunked path given the same per-config results), and the time budget
still holds (trials started finish and are kept; trials not started are counted)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import pytest

from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.mechanisms import Knob
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.evaluate import TrialResult, failed_trial
from specpilot.tune.executors import StreamingExecutor
from specpilot.tune.loop import TuneLoop, TuneOutcome, TuneSettings
from specpilot.tune.space import Direction, config_hash

BASE = EngineConfig(deployment=DeploymentSpec(target="t"), k=2, drafter_knobs={"a": 0, "b": 0})


def _knobs(base: EngineConfig, p: dict) -> EngineConfig:
    knobs = {**base.drafter_knobs, **{n: int(v) for n, v in p.items() if n != "k"}}
    return dataclasses.replace(base, k=int(p.get("k", base.k)), drafter_knobs=knobs)


# Three directions; "ka" overlaps "k" and "a", so one config may come from two directions.
DIRECTIONS = [
    Direction("k", ("draft",), (Knob("k", 2, choices=(1, 2, 3, 4, 6)),), _knobs),
    Direction("a", ("verify",), (Knob("a", 0, low=0, high=3),), _knobs),
    Direction("b", ("lm_head",), (Knob("b", 0, low=0, high=2),), _knobs),
    Direction("ka", ("mlp",), (Knob("k", 2, choices=(2, 3)), Knob("a", 0, low=0, high=1)), _knobs),
]


def score(c: EngineConfig) -> TrialResult:
    """A fixed, noise-free result per config (the same however and wherever it runs)."""
    a, b = c.drafter_knobs["a"], c.drafter_knobs["b"]
    sp = 1.0 + 0.1 * min(c.k, 4) - 0.02 * max(c.k - 4, 0) + 0.07 * a - 0.05 * (a == 3) + 0.04 * b
    return TrialResult(c, 10 * sp, sp, 2.0, [], True, {}, 0.0, 0.01, rounds=[sp] * 3)


class SerialExecutor:
    """The local path's shape: chunks of ``width`` through ``map``, no head-to-head rounds."""

    ar_tok_s, width, shares_rounds = 10.0, 3, False

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        return [score(c) for c in configs]

    def close(self) -> None:
        pass


class FakePool:
    """A pool of ``workers`` that streams: admits trials in order while a worker is free, and
    finishes them in ``order`` (``fifo``, or ``lifo``: the latest started first, out of order).
    Each result carries a copy of its config, as one sent back by another process would."""

    ar_tok_s = 10.0

    def __init__(self, workers: int = 3, order: str = "fifo", seconds: float = 0.0) -> None:
        self.workers, self.order, self.seconds = workers, order, seconds
        self.queues: list[list[str]] = []
        """The config hashes of every ``stream`` call, in the order given."""
        self.completed: list[str] = []

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        return self.stream(configs)

    def stream(
        self,
        configs: Sequence[EngineConfig],
        admit: Callable[[], bool] | None = None,
        on_result: Callable[[TrialResult], None] | None = None,
    ) -> list[TrialResult]:
        self.queues.append([config_hash(c) for c in configs])
        pending, flying, results = list(range(len(configs))), [], {}
        while pending or flying:
            while pending and len(flying) < self.workers:
                if admit is not None and not admit():
                    pending = []
                    break
                flying.append(pending.pop(0))
            if not flying:
                break
            i = flying.pop() if self.order == "lifo" else flying.pop(0)
            time.sleep(self.seconds)
            r = score(dataclasses.replace(configs[i]))
            r.worker, r.busy_seconds = f"w{i % self.workers}", self.seconds
            results[i] = r
            self.completed.append(config_hash(configs[i]))
            if on_result is not None:
                on_result(r)
        return [results[i] for i in sorted(results)]

    def close(self) -> None:
        pass


def tune(tmp_path, executor, tag: str, **settings: object) -> tuple[TuneOutcome, list, list[str]]:
    fp = Fingerprint("t", tag, "cpu", "", "", "", "fp32", "single")
    given = {"rounds": 3, "trials_per_direction": 3, "explorer": "local", "min_gain": 0.01}
    logs: list[str] = []
    with MemoryStore(tmp_path / f"{tag}.sqlite") as store:
        loop = TuneLoop(
            BASE,
            DIRECTIONS,
            executor,
            store,
            fp,
            tag,
            TuneSettings(**(given | settings)),  # type: ignore[arg-type]
            log=logs.append,
        )
        out = loop.run()
        rows = sorted((r.round, r.explorer, r.config_hash) for r in store.trials(run=loop.run_id))
    return out, rows, logs


def trial_set(out: TuneOutcome) -> list[tuple[int, str, str]]:
    return [(t.round, t.explorer, config_hash(t.result.config)) for t in out.trials]


def test_out_of_order_results_change_nothing_the_search_decides(tmp_path):
    serial, serial_rows, _ = tune(tmp_path, SerialExecutor(), "serial")
    fifo_pool, lifo_pool = FakePool(order="fifo"), FakePool(order="lifo")
    fifo, fifo_rows, _ = tune(tmp_path, fifo_pool, "fifo")
    lifo, lifo_rows, logs = tune(tmp_path, lifo_pool, "lifo")
    assert isinstance(lifo_pool, StreamingExecutor) and not isinstance(
        SerialExecutor(), StreamingExecutor
    )
    first = lifo_pool.queues[0]
    assert lifo_pool.completed[: len(first)] != first  # round 1 came back out of order
    assert fifo_pool.completed[: len(first)] == first
    # The search went somewhere: several rounds, winners stacked, a duplicate read from memory.
    assert serial.rounds_run >= 2 and any(t.explorer == "integrate" for t in serial.trials)
    hashes = [h for _, _, h in trial_set(serial)]
    assert len(hashes) > len(set(hashes))  # a config two directions proposed, run once
    assert config_hash(serial.best.config) != config_hash(BASE)
    for got, rows in ((fifo, fifo_rows), (lifo, lifo_rows)):
        assert trial_set(got) == trial_set(serial)
        assert config_hash(got.best.config) == config_hash(serial.best.config)
        assert got.best.speedup == serial.best.speedup and got.rounds_run == serial.rounds_run
        assert rows == serial_rows  # the memory holds the same trials, each once
    # Round 1 is one queue, led by the stock trial; the stock is still recorded as round 0.
    round1 = [h for r, _, h in trial_set(lifo) if r == 1 and _ != "integrate"]
    assert first[0] == config_hash(BASE) and len(first) == 1 + len(set(round1))
    assert trial_set(lifo)[0] == (0, "stock", config_hash(BASE))
    assert "round 1: directions k, a, b (best so far the stock engine" in "\n".join(logs)


def test_a_warm_start_keeps_the_stock_trial_alone(tmp_path):
    """A remembered config may become round 1's base, so round 0 runs before round 1 then."""
    pool = FakePool()
    fp = Fingerprint("t", "other", "cpu", "", "", "", "fp32", "single")
    with MemoryStore(tmp_path / "m.sqlite") as store:
        dep = store.add_deployment(fp, "other")
        good = dataclasses.replace(BASE, k=4)
        run = store.start_run(dep, {})
        args = ("h", {}, score(good).metrics(), True, {}, 0.0, 0.0)
        store.add_trial(run, dep, 1, "k", *args)
        store.validate(dep, "h", json.loads(good.to_json()), 1.4, 1)
        settings = TuneSettings(rounds=1, explorer="local")
        me = Fingerprint("t", "me", "cpu", "", "", "", "fp32", "single")
        loop = TuneLoop(BASE, DIRECTIONS, pool, store, me, "me", settings, log=lambda _: None)
        out = loop.run()
    assert pool.queues[0] == [config_hash(BASE)]  # alone
    assert pool.queues[1] == [config_hash(good)]  # the remembered config
    assert any(t.explorer == "memory" for t in out.trials)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_the_budget_holds_on_a_pool_and_loses_no_started_trial(tmp_path, order):
    pool = FakePool(workers=2, order=order, seconds=0.04)
    out, rows, logs = tune(tmp_path, pool, order, budget_seconds=0.25, rounds=5)
    assert out.wall_seconds <= 0.25 + 2 * 0.04 + 0.1  # at most the trials in flight late
    started = len(pool.completed)
    assert len(rows) == started  # every trial that started was recorded, none twice
    assert sum(len(q) for q in pool.queues) > started  # the budget kept some from starting
    text = "\n".join(logs)
    assert "time budget reached:" in text and "candidates not run" in text
    assert out.stock.config == BASE and rows[0][:2] == (0, "stock")


@pytest.mark.parametrize("make", [SerialExecutor, FakePool], ids=["local", "pool"])
def test_a_probe_direction_tries_its_defaults_alone_first(tmp_path, make) -> None:
    """A drafter switch (``Direction.probe``) proposes one trial (its defaults) the first time,
    then full rounds (later rounds may run fewer: configs already measured are not re-run); the
    other directions propose their full rounds from the start."""
    probe = dataclasses.replace(DIRECTIONS[2], probe=True)
    fp = Fingerprint("t", "probe", "cpu", "", "", "", "fp32", "single")
    with MemoryStore(tmp_path / "p.sqlite") as store:
        settings = TuneSettings(rounds=3, trials_per_direction=3, explorer="local", min_gain=0.01)  # type: ignore[call-arg]
        loop = TuneLoop(BASE, [DIRECTIONS[0], probe], make(), store, fp, "p", settings, log=lambda _: None)  # fmt: skip
        loop.run()
        rows = [(r.round, r.explorer) for r in store.trials(run=loop.run_id)]
    first = {name: min(r for r, e in rows if e == name) for name in ("k", "b")}
    per_round = {(r, e): sum(1 for x in rows if x == (r, e)) for r, e in rows}
    assert per_round[(first["b"], "b")] == 1  # the probe: its defaults alone
    assert per_round[(first["k"], "k")] > 1
    assert loop._trials(probe) == 3  # proposed once: full rounds from now on


@pytest.mark.parametrize("fault", ["build", "forcing"])
def test_only_a_token_forcing_failure_quarantines_a_mechanism(tmp_path, fault) -> None:
    """A mechanism's candidate that fails to build (a knob value the kernel refuses) is reported
    as failed and the direction keeps its turn; one that ran and failed token forcing proves the
    mechanism lossy here, and the direction is never tried again."""
    mech = dataclasses.replace(DIRECTIONS[2], name="mechanism:m")

    class Faulty(SerialExecutor):
        def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
            out = []
            for c in configs:
                if c.drafter_knobs["b"] != 1:
                    out.append(score(c))
                elif fault == "build":
                    out.append(failed_trial(c, "RuntimeError: no such tiling", 0.01))
                else:
                    out.append(dataclasses.replace(score(c), forcing_ok=False))
            return out

    fp = Fingerprint("t", fault, "cpu", "", "", "", "fp32", "single")
    logs: list[str] = []
    with MemoryStore(tmp_path / "q.sqlite") as store:
        settings = TuneSettings(rounds=3, trials_per_direction=3, explorer="local", min_gain=0.01)  # type: ignore[call-arg]
        loop = TuneLoop(BASE, [mech], Faulty(), store, fp, "q", settings, log=logs.append)
        loop.run()
    text = "\n".join(logs)
    assert ("mechanism:m quarantined" in text) == (fault == "forcing")
    assert ("round 2: directions mechanism:m" in text) == (fault == "build")
