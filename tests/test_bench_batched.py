"""``bench --mode batched`` end to end on a tiny model: schedulers from the composition root,
the interleaved protocol (a warm-up, then rounds of both arms), every output token-forced and
equal to batched AR, the spread beside each speedup, simulated acceptance labelled."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.bench.batched import measure_stream, poisson_arrivals, request_stream
from specpilot.cli import main
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, Scheduler
from specpilot.engine.config import DeploymentSpec, EngineConfig


def test_bench_batched_end_to_end(model_dir, tmp_path, capsys):
    """Two concurrencies, Poisson arrivals, adaptive-block from an engine config; three counted
    rounds per concurrency, each a per-round ratio; every output token-forced and equal to AR."""
    engine = tmp_path / "engine.json"
    EngineConfig(
        DeploymentSpec(target=str(model_dir), drafter="ngram", device="cpu", mode="batched"),
        k=4,
        drafter_knobs={"max_n": 3, "min_n": 1},
        mechanisms={"adaptive-block": {}},
    ).save(engine)
    out = tmp_path / "runs.jsonl"
    argv = ["bench", "--mode", "batched", "--engine", str(engine), "--concurrency", "2,3"]
    argv += ["--requests", "5", "--limit", "3", "--max-new-tokens", "12", "--arrival-rate", "200"]
    code = main([*argv, "--segment-tokens", "7", "--json", "--out", str(out)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["rounds"] == 3 and result["simulated_acceptance"] is None
    assert [lv["concurrency"] for lv in result["levels"]] == [2, 3]
    assert result["identical_to_ar"] == "30/30"  # 2 concurrencies x 3 rounds x 5 requests
    assert result["forcing"]["ok"] and result["forcing"]["mismatches"] == 0
    assert result["forcing"]["matches"] > 0
    assert result["mechanisms"] == {"adaptive-block": {}}
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == 60  # 2 concurrencies x 3 rounds x 2 engines x 5 requests
    assert {ln["stats"]["round"] for ln in lines} == {0, 1, 2}
    for lv in result["levels"]:
        spread = lv["speedup_spread"]
        assert len(spread["rounds"]) == 3 and spread["lo"] <= lv["speedup"] <= spread["hi"]
        assert lv["verdict"] in ("faster", "slower", "within noise")
        assert lv["speedup_text"].startswith(f"{lv['speedup']:.2f}x (")
        assert lv["spec_latency_s"]["p50"] <= lv["spec_latency_s"]["p99"]


def test_bench_batched_simulated_acceptance_is_labelled(model_dir, tmp_path, capsys):
    argv = ["bench", "--mode", "batched", "--target", str(model_dir), "--device", "cpu"]
    argv += ["--drafter", "ngram", "--simulate-acceptance", "tau=3,block=5", "--concurrency", "2"]
    argv += ["--requests", "3", "--limit", "2", "--max-new-tokens", "10"]
    code = main([*argv, "--out", str(tmp_path / "runs.jsonl")])
    text = capsys.readouterr().out
    assert code == 0
    assert "simulated acceptance" in text and "tau=3,block=5" in text
    assert "(" in text.split("speedup")[-1]  # the spread is printed beside the speedup
    code = main([*argv, "--json", "--out", str(tmp_path / "runs2.jsonl")])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["simulated_acceptance"] == "tau=3,block=5"
    assert "simulated acceptance" in result["drafter"]
    assert result["identical_to_ar"] == "9/9" and result["forcing"]["mismatches"] == 0
    assert result["levels"][0]["tau_incl_bonus"] > 1.5


def test_measure_stream_alternates_and_reuses_the_schedulers():
    """A warm-up round then counted rounds; each arm's scheduler serves every round (rows all
    free again after a run) and gives the same tokens each time, equal across the arms."""
    target = tiny_model(tiny_config(vocab=41), 3)
    rng = random.Random(3)
    prompts = [(f"p{i}", [rng.randrange(41) for _ in range(rng.randint(2, 12))]) for i in range(3)]
    reqs = request_stream(prompts, 5, 9, frozenset())
    scheds = {
        "ar": Scheduler(Engine(target), slots=2, segment_tokens=4, max_context=40),
        "spec": Scheduler(
            Engine(target, NgramDrafter(k=3)), slots=2, segment_tokens=4, max_context=40
        ),
    }
    m = measure_stream(scheds, reqs, poisson_arrivals(5, 0.0), rounds=3, warmup=1)
    assert [len(m.samples[a]) for a in ("ar", "spec")] == [3, 3]
    tokens = {a: [[r.tokens for r in s.payload.results] for s in m.samples[a]] for a in m.samples}
    assert tokens["ar"][0] == tokens["ar"][1] == tokens["ar"][2] == tokens["spec"][2]
    assert all(s.tokens == sum(len(t) for t in tokens["ar"][0]) for s in m.samples["spec"])
    assert len(m.ratio("spec", "ar").values) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("sim", [False, True])
def test_bench_batched_on_cuda_graphs(sim, model_dir, tmp_path, capsys):
    """Both arms on CUDA graphs (the default on CUDA), fp32: identical to batched AR, forced."""
    argv = ["bench", "--mode", "batched", "--target", str(model_dir), "--device", "cuda", "-k", "4"]
    argv += ["--concurrency", "2,4", "--requests", "8", "--limit", "4", "--max-new-tokens", "24"]
    argv += ["--max-context", "1024", "--json", "--out", str(tmp_path / "runs.jsonl")]
    if sim:
        argv += ["--simulate-acceptance", "tau=3,block=5"]
    code = main(argv)
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["runner"] == "cuda-graphs"
    assert result["identical_to_ar"] == "48/48" and result["forcing"]["mismatches"] == 0
    assert ("simulated acceptance" in result["drafter"]) == sim
