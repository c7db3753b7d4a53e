"""The evaluator measures candidates in groups that fit the device, freeing each group first.

Every candidate with mechanisms loads its own copy of the target; an 8B target on an 80 GB card
holds four such copies at most, and a chunk of three candidates beside the stock model ran the
tune out of memory on an H100 (2026-12-05) when the previous chunk's engines were not freed.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from specpilot.engine import Engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.tune.evaluate import Evaluator
from test_tune import tune_inputs


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory: pytest.TempPathFactory) -> Evaluator:
    model, _ = tune_inputs(tmp_path_factory.mktemp("tune_memory"))
    base = EngineConfig(deployment=DeploymentSpec(target=str(model), device="cpu"), k=0)
    return Evaluator(base, [[1, 2, 3, 4]], max_new_tokens=6, rounds=1)


def test_candidates_that_do_not_fit_are_measured_in_groups_each_freed_first(
    evaluator: Evaluator, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[weakref.ref[Engine]] = []
    alive_at_build: list[int] = []

    def make_candidate(config: EngineConfig) -> Engine:
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in built))
        engine = Engine(evaluator.stock.model, graphs=False)
        engine.cycle_ref = engine  # a reference cycle, as engines with runners and graphs have
        built.append(weakref.ref(engine))
        return engine

    room = iter([True, False, False, True])  # groups: [c0, c1], [c2], [c3, c4]
    monkeypatch.setattr(evaluator, "make_candidate", make_candidate)
    monkeypatch.setattr(evaluator, "_room_for", lambda config: next(room))
    said: list[str] = []
    monkeypatch.setattr(evaluator, "progress", said.append)
    configs = [EngineConfig(deployment=evaluator.base.deployment, k=k) for k in range(1, 6)]

    results = evaluator.evaluate_many(configs)

    assert [r.config.k for r in results] == [1, 2, 3, 4, 5]  # in the order asked
    assert all(r.error is None and r.forcing_ok for r in results), results
    assert alive_at_build == [0, 1, 0, 0, 1]  # a group's engines are gone before the next's
    assert sum("no device memory for another candidate" in s for s in said) == 2, said
    gc.collect()
    assert not any(r() for r in built)


def test_room_for_counts_a_target_copy_only_for_candidates_with_mechanisms(
    evaluator: Evaluator, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = evaluator.target_bytes
    assert size > 0
    free = {"bytes": 0}
    monkeypatch.setattr(evaluator, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 20)  # cached,
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)  # 2 MiB free
    plain = EngineConfig(deployment=evaluator.base.deployment, k=2)
    mech = EngineConfig(deployment=evaluator.base.deployment, k=2, mechanisms={"w12": {}})
    assert evaluator._room_for(plain)  # shares the stock target
    free["bytes"] = math.ceil(1.25 * size) + (2 << 30) - (2 << 20) - 1  # with the cache's 2 MiB
    assert not evaluator._room_for(mech)
    free["bytes"] += 1
    assert evaluator._room_for(mech)
