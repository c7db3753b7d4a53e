"""tune/scaling.py: the checks and bounds of a Ray scaling study, on hand-made run records."""

from __future__ import annotations

from specpilot.tune.scaling import (
    agreement,
    correctness,
    default_trials,
    schedule_bound,
    summarize,
    wave_cap,
)


def trial(h: str, round_: int, explorer: str, rounds: list[float], busy: float = 1.0) -> dict:
    return {
        "hash": h, "round": round_, "explorer": explorer, "config": h, "speedup_rounds": rounds,
        "busy_seconds": busy, "worker": "w0", "error": None,
    }  # fmt: skip


def run(workers: int, trials: list[dict], best: str, wall: float, rc: int = 0) -> dict:
    search = {"wall_seconds": wall, "device_seconds": wall * workers,
              "per_worker": {"w0": {"trials": len(trials)}}}  # fmt: skip
    return {
        "name": f"w{workers}", "workers": workers, "kill": False, "rc": rc, "trials": trials,
        "best": best, "search": search, "command_wall_s": wall + 5,
    }  # fmt: skip


def test_wave_cap_and_the_default_trials() -> None:
    assert wave_cap(2, 5, 0) == 5 / 3  # ceil(5 / 2) = 3 waves
    assert wave_cap(4, 8, 1) == 9 / 3
    assert wave_cap(2, 0, 0) == 0.0
    assert default_trials(4, 3) == 4  # 13 trials in 4 waves: 3.25 >= 0.8 x 4 already
    assert default_trials(4, 2) == 5  # 9 in 3 waves is 3.0; 11 in 3 waves is 3.67


def test_schedule_bound_deals_each_round_to_the_free_workers() -> None:
    one = run(1, [trial("s", 0, "stock", [1.0]), *(trial(f"t{i}", 1, "tpe", [1.1]) for i in range(3)),
                  trial("i", 1, "integrate", [1.2])], "i", 10.0)  # fmt: skip
    # round 1's queue: stock + 3 trials of 1 s on 2 workers = 2 s; the stacked one 1 s alone
    assert schedule_bound(one, 2) == 5 / 3


def test_correctness_and_agreement() -> None:
    ts = [trial("a", 1, "tpe", [1.0, 1.2]), trial("b", 1, "tpe", [1.1, 1.3])]
    good = run(1, ts, "a", 10.0)
    assert correctness(good, {"a", "b"}) == []
    assert "exit status 1" in correctness(run(1, ts, "a", 10.0, rc=1), None)
    assert any("twice" in m for m in correctness(run(1, ts + ts[:1], "a", 10.0), None))
    assert any("other configs" in m for m in correctness(good, {"a", "c"}))
    assert agreement(good, run(2, ts, "a", 5.0)) == "same"
    assert agreement(good, run(2, ts, "b", 5.0)) == "within noise"  # ranges overlap
    far = [trial("a", 1, "tpe", [1.0, 1.05]), trial("b", 1, "tpe", [2.0, 2.1])]
    assert agreement(run(1, far, "a", 10.0), run(2, far, "b", 5.0)) == "differ"


def test_summarize_states_the_speedup_against_its_target() -> None:
    ts = [trial("a", 1, "tpe", [1.0]), trial("b", 1, "tpe", [1.1])]
    out = summarize(2, [run(1, ts, "b", 10.0), run(2, ts, "b", 6.0)], "test", 2)
    assert out["correct"] and out["speedup_search"] == 10.0 / 6.0
    assert out["target"] == 1.6 and out["met"] and out["best_agree"] == "same"
    assert out["kill"] is None
