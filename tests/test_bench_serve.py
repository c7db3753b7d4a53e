"""``specpilot bench --mode serve``: the serving benchmark against our own server on the CPU
(a real uvicorn server on loopback), its vLLM-named metrics, JSON and plot, and the one clear
error for a URL where nothing answers."""

from __future__ import annotations

import json

import pytest

from specpilot.cli import main
from test_serve import free_port


@pytest.fixture(scope="module")
def server(two_slot_server):
    return two_slot_server


def test_serving_benchmark_reports_vllm_metrics(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "--mode", "serve", "--url", server.url, "--prompts", "copy-heavy"]
    argv += ["--limit", "3", "--concurrency", "1,2", "--max-new-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["max_concurrency"] for r in data["runs"]] == [1, 2]
    for run in data["runs"]:
        reqs = run["requests"]
        n = max(2 * run["max_concurrency"], 3)  # every prompt once, at least 2 per slot
        assert run["completed"] == run["num_prompts"] == len(reqs) == n
        assert run["failed"] == 0 and run["errors"] == []
        assert run["total_output_tokens"] == sum(q["output_tokens"] for q in reqs)
        assert all(1 <= q["output_tokens"] <= 6 and q["prompt_tokens"] > 0 for q in reqs)
        assert all(0 < q["ttft"] <= q["latency"] for q in reqs)
        assert run["median_ttft_ms"] <= run["p99_ttft_ms"] <= 1e3 * max(q["latency"] for q in reqs)
        for key in ("request_throughput", "output_throughput", "mean_tpot_ms", "p90_itl_ms"):
            assert run[key] >= 0
    assert "concurrency   2: 4/4 ok" in capsys.readouterr().out


def test_nothing_at_the_url_is_one_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["bench", "--mode", "serve", "--url", url, "--out", str(tmp_path / "x.json")]
    assert main(argv) == 2
    assert "No OpenAI-compatible server answers" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_url_belongs_to_the_serve_mode(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:1"]) == 2
    assert "--url is for --mode serve" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--rounds", "3"], ["--hf"]])
def test_offline_flags_are_refused_in_the_serve_mode(flag, capsys):
    """Also ``--rounds 3``, the offline default: given at all, it was meant for another mode."""
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--mode", "serve", "--url", url, *flag]) == 2
    assert "are for the offline modes" in capsys.readouterr().err
