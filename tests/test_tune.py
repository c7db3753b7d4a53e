"""The tune loop end to end on a tiny model: gate, integration, memory, resume, warm start (Ray:
tests/test_ray_executor.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specpilot.cli import main
from specpilot.mechanisms import MECHANISMS, Mechanism
from test_cli import tiny_dir

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tune_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny random model directory and three repetitive prompts under ``root``."""
    model = tiny_dir(root / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (model / "config.json").write_text(json.dumps(cfg))
    prompts = root / "prompts.jsonl"
    lines = [
        {"id": f"p{i}", "prompt": " ".join(["hello world hi user"] * (3 + i))} for i in range(3)
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return model, prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tune_inputs(tmp_path_factory.mktemp("tune"))


def tune_argv(model: Path, prompts: Path, out: Path, memory: Path, *extra: str) -> list[str]:
    return [
        "tune",
        "--target",
        str(model),
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "--limit",
        "3",
        "--max-new-tokens",
        "24",
        "--rounds",
        "2",
        "--trials",
        "2",
        "--directions",
        "2",
        "--out",
        str(out),
        "--memory",
        str(memory),
        "-k",
        "2",
        *extra,
    ]


def _install_faulty_head(build, knobs) -> None:
    """An LM-head argmax plug that answers the token after the argmax (every row, every call)."""
    model = build.target.model
    fwd, vocab = model.stock_forward(), model.cfg.vocab_size

    def head(x: torch.Tensor) -> torch.Tensor:  # [B, R, H] -> [B, R]
        b, r, h = x.shape
        ids = fwd.logits_normed(x.reshape(b * r, h)).argmax(dim=-1).view(b, r)
        return (ids + 1) % vocab

    model.argmax_head = head


FAULTY = Mechanism(
    name="test-faulty-verify",
    component="lm_head",
    plug_point="lm_head_argmax",
    lossless="it is not: a planted fault that the gate must reject",
    apply=_install_faulty_head,
)


def test_tune_end_to_end_rejects_a_faulty_mechanism(tiny, tmp_path, capsys, monkeypatch):
    model, prompts = tiny
    monkeypatch.setitem(MECHANISMS, FAULTY.name, FAULTY)
    out, memory = tmp_path / "out", tmp_path / "mem.sqlite"
    assert (
        # every direction in round 1: a round-1 winner (timing noise) would otherwise send round
        # 2 back to the winner's directions before the faulty one is reached
        main(tune_argv(model, prompts, out, memory, "--directions", "8", "--rank-gaps", "static"))
        == 0
    )
    log = capsys.readouterr().out
    tuned = json.loads((out / "tuned.json").read_text())
    assert FAULTY.name not in tuned["mechanisms"]
    assert "REJECTED by token forcing" in log and "+test-faulty-verify" in log
    # progress as it happens: every candidate built and every round measured gets a line
    assert "built and warmed up k=" in log and "timing round 1/" in log and "timing round 2/" in log
    report = (out / "report.md").read_text()
    assert "Price of the search" in report and "Break-even" in report and "REJECTED" in report
    for png in ("speed_vs_search.png", "cycle_breakdown.png", "acceptance.png"):
        assert (out / png).stat().st_size > 1000
    db = sqlite3.connect(memory)
    rows = db.execute("SELECT explorer, forcing_ok, forcing FROM trials").fetchall()
    faulty = [r for r in rows if r[0] == f"mechanism:{FAULTY.name}"]
    # rejected once (with its first mismatch logged), then quarantined: never tried again
    assert len(faulty) == 1 and faulty[0][1] == 0 and "first_mismatch" in json.loads(faulty[0][2])
    assert "quarantined" in log
    assert any(r[1] == 1 for r in rows)
    assert db.execute("SELECT COUNT(*) FROM validated").fetchone()[0] >= 1
    # the tuned engine loads in generate and is lossless
    assert (
        main(
            [
                "generate",
                "hello world",
                "--raw",
                "--engine",
                str(out / "tuned.json"),
                "--max-new-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    gen = json.loads(capsys.readouterr().out)
    tuned = json.loads((out / "tuned.json").read_text())
    assert gen["forcing"]["ok"] and gen["mechanisms"] == tuned["mechanisms"]  # shown as run
    # compare: tuned vs stock vs AR on held-out prompts, all token-forced
    assert (
        main(
            [
                "compare",
                "--engine",
                str(out / "tuned.json"),
                "--prompts",
                str(prompts),
                "--skip",
                "1",
                "--limit",
                "2",
                "--max-new-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    cmp = json.loads(capsys.readouterr().out)
    assert cmp["prompts"] == 2 and all(cmp[n]["forcing_ok"] for n in ("ar", "stock", "tuned"))
    assert cmp["ar"]["vs_ar"]["median"] == 1.0 and cmp["tuned_vs_stock"]["median"] > 0
    assert cmp["rounds"] >= 1 and len(cmp["tuned"]["vs_ar"]["rounds"]) == cmp["rounds"]
    # memory CLI
    assert main(["memory", "--memory", str(memory), "list"]) == 0
    listing = capsys.readouterr().out
    key = listing.split()[0]
    # memory list and the report count the same trials (one run so far)
    counted = re.search(r"; (\d+) trials", report)
    assert counted is not None and f" {counted.group(1)} trials in 1 run(s)" in listing
    assert main(["memory", "--memory", str(memory), "show", key[:6]]) == 0
    assert "REJECTED" in capsys.readouterr().out
    assert (
        main(["memory", "--memory", str(memory), "export", "--out", str(tmp_path / "m.json")]) == 0
    )
    exported = json.loads((tmp_path / "m.json").read_text())
    assert exported["trials"] and exported["deployments"][0]["fingerprint"]["dtype"] == "fp32"


def test_sigkill_then_resume_loses_no_finished_trial(tiny, tmp_path):
    model, prompts = tiny
    out, memory = tmp_path / "out", tmp_path / "mem.sqlite"
    argv = tune_argv(  # never stops early; what follows the search is tested elsewhere
        model, prompts, out, memory, "--compare-limit", "0", "--rank-gaps", "static",
        "--min-gain", "-1",
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specpilot.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    finished = 0
    while finished < 3:
        assert proc.poll() is None, "tune ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
        if memory.exists():
            with contextlib.suppress(sqlite3.Error):
                finished = (
                    sqlite3.connect(memory).execute("SELECT COUNT(*) FROM trials").fetchone()[0]
                )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = (
        sqlite3.connect(memory).execute("SELECT id, config_hash FROM trials ORDER BY id").fetchall()
    )
    assert len(before) >= 3
    res = subprocess.run(
        [sys.executable, "-m", "specpilot.cli", *argv[:-2], "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert f"{len(before)} finished trials are reused" in res.stdout
    after = (
        sqlite3.connect(memory).execute("SELECT id, config_hash FROM trials ORDER BY id").fetchall()
    )
    assert after[: len(before)] == before  # nothing lost, nothing re-run
    hashes = [h for _, h in after]
    assert len(hashes) == len(set(hashes))


def test_warm_start_reuses_validated_results_of_a_similar_deployment(tiny, tmp_path, capsys):
    model, prompts = tiny
    memory = tmp_path / "mem.sqlite"
    assert main(tune_argv(model, prompts, tmp_path / "a", memory, "--rounds", "1")) == 0
    capsys.readouterr()
    # Same target and device, another drafter setting: a similar deployment.
    assert (
        main(tune_argv(model, prompts, tmp_path / "b", memory, "--rounds", "1", "--dtype", "bf16"))
        == 0
    )
    log = capsys.readouterr().out
    assert "reused from memory:" in log
    assert "gaps ranked by a profile of the stock engine: " in log  # the default ranking
    assert "Reused from memory" in (tmp_path / "b" / "report.md").read_text()
