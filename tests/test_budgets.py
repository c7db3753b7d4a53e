"""Budgets that hold and verdicts that say when the machine was too noisy (issue 16, 1-2)."""

from __future__ import annotations

import time

from specpilot.bench.protocol import Measurement, Sample, interleave
from specpilot.commands.tune_compare import compare_fit, compare_reserve_s


def _arm(seconds: float, tokens: int = 10):  # type: ignore[no-untyped-def]
    def run() -> Sample:
        time.sleep(seconds)
        return Sample(tokens, seconds)

    return run


def test_a_round_starts_only_if_it_ends_before_the_deadline() -> None:
    arms = {"ar": _arm(0.05), "spec": _arm(0.05)}
    t0 = time.perf_counter()
    # a round takes 0.1 s; with 0.25 s left after the warm-up the third round would end late
    m = interleave(arms, rounds=10, warmup=1, deadline=t0 + 0.1 + 0.25)
    assert len(m.samples["ar"]) == 2
    assert time.perf_counter() - t0 < 0.1 + 0.25 + 0.02
    one = interleave(arms, rounds=5, warmup=0, deadline=t0)  # already late: one round anyway
    assert len(one.samples["ar"]) == 1


def test_a_busy_machine_is_named_and_a_steady_one_is_not() -> None:
    steady = Measurement({"ar": [Sample(100, 1.0), Sample(100, 1.05), Sample(100, 0.97)]})
    assert steady.noise_note() is None and steady.drift("ar") < 1.1
    busy = Measurement({"ar": [Sample(100, 1.0), Sample(100, 2.0), Sample(100, 1.1)]})
    note = busy.noise_note()
    assert note is not None and "busy" in note and "50.0-100.0 tok/s" in note
    assert abs(busy.drift("ar") - 2.0) < 1e-9


def test_the_compare_is_cut_to_what_fits() -> None:
    per = compare_reserve_s(1, 64, 32.0, 3)
    assert compare_fit(10 * per, 4, 64, 32.0, 3) == 4
    assert compare_fit(compare_reserve_s(2, 64, 32.0, 3) + 0.1, 4, 64, 32.0, 3) == 2
    assert compare_fit(per / 2, 4, 64, 32.0, 3) == 0


def test_compare_repeats_what_the_tune_measured_unless_told_otherwise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from specpilot.commands.compare import resolve_defaults
    from specpilot.commands.tune_compare import write_run

    write_run(tmp_path, "mt-bench", 3, 4, 96, 5)
    engine = tmp_path / "tuned.json"
    args = argparse.Namespace(
        engine=engine, prompts=None, skip=None, limit=None, max_new_tokens=None, rounds=None
    )
    assert set(resolve_defaults(args)) == {"prompts", "skip", "limit", "max_new_tokens", "rounds"}
    assert (args.prompts, args.skip, args.limit, args.max_new_tokens, args.rounds) == (
        "mt-bench", 3, 4, 96, 5,
    )  # fmt: skip
    given = argparse.Namespace(
        engine=engine, prompts="humaneval", skip=0, limit=None, max_new_tokens=None, rounds=None
    )
    resolve_defaults(given)
    assert (given.prompts, given.skip, given.limit) == ("humaneval", 0, 4)
    alone = argparse.Namespace(
        engine=tmp_path / "x" / "e.json", prompts=None, skip=None, limit=None,
        max_new_tokens=None, rounds=None,
    )  # fmt: skip
    assert resolve_defaults(alone) == [] and (alone.skip, alone.limit) == (4, 6)


def test_compare_of_a_tune_without_winner_gives_no_verdict(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from specpilot.cli import main
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from test_tune import tune_inputs

    model, prompts = tune_inputs(tmp_path)
    cfg = EngineConfig(DeploymentSpec(target=str(model), drafter="ngram", device="cpu"), k=2)
    cfg.save(tmp_path / "tuned.json")
    cfg.save(tmp_path / "stock.json")
    argv = ["compare", "--engine", str(tmp_path / "tuned.json"), "--stock"]
    argv += [str(tmp_path / "stock.json"), "--prompts", str(prompts), "--skip", "0"]
    argv += ["--limit", "1", "--max-new-tokens", "8", "--rounds", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the tuned config is the stock config" in out and "no verdict" in out
    assert "in every round" not in out.split("tuned over stock")[1]
