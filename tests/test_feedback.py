"""Feedback while commands work: phases on stderr, bench results as they come, no spinner thread
during a measured phase, and unwrapped tables off a terminal (issue 16, items 4 and 5)."""

from __future__ import annotations

import threading
import time

import pytest

from specpilot.commands import bench as bench_cmd
from specpilot.commands.feedback import Feedback
from specpilot.consoles import UNWRAPPED_WIDTH, result_console
from test_cli import raw_generate, run_cli


def phase_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("specpilot: [")]


def test_generate_says_each_phase(model_dir, capsys):
    """Not silent before the first token, nor during the AR and token-forcing passes."""
    code, _, err = run_cli(
        capsys,
        *raw_generate(model_dir, "hello world hello world"),
        "--max-new-tokens",
        "8",
    )
    assert code == 0
    phases = " | ".join(phase_lines(err))
    for step in (
        "reading model",
        "placing the weights (fp32, cpu)",
        "loading the tokenizer",
        "building the engine",
        "warming up the engine",
        "warming up plain AR",
        "plain AR on the same prompt, for the speedup",
        "token forcing the",
    ):
        assert step in phases, (step, phases)


def test_bench_prints_results_as_they_come(model_dir, capsys, monkeypatch, tmp_path):
    """The header and each round's line are on stdout before the run ends (token forcing is
    the last step); the phases are on stderr; the table is not wrapped at 80 columns."""
    seen_before_forcing: list[str] = []
    real_force = bench_cmd.force_records

    def force_records(*a, **k):
        out, err = capsys.readouterr()
        seen_before_forcing.append(out)
        print(err, end="", file=__import__("sys").stderr)  # keep stderr for the checks below
        return real_force(*a, **k)

    monkeypatch.setattr(bench_cmd, "force_records", force_records)
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target",
        str(model_dir),
        "--device",
        "cpu",
        "--limit",
        "2",
        "--rounds",
        "2",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path / "b.jsonl"),
    )
    assert code in (0, 1)
    (early,) = seen_before_forcing
    lines = early.splitlines()
    assert lines[0].startswith("bench copy-heavy: 2 prompts")
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["round 1/2", "round 2/2"]
    phases = " | ".join(phase_lines(err))
    assert "warming up ar, spec" in phases
    assert "round 1/2: ar, 2 prompts" in phases and "round 2/2: spec, 2 prompts" in phases
    assert "token forcing 2 speculative outputs" in phases
    # no wrapping off a terminal: the long lines stay whole
    assert any(
        line.startswith("mean accepted length τ =") and "identical to AR" in line
        for line in out.splitlines()
    )
    assert max(len(line) for line in out.splitlines()) > 80


def test_result_console_wraps_only_on_a_terminal():
    console = result_console()  # pytest's captured stdout is no terminal
    assert not console.is_terminal and console.width == UNWRAPPED_WIDTH


def spinner_threads(settle: int | None = None) -> int:
    """Threads besides this one; with ``settle``, waits (up to 1 s) for that count: a stopped
    spinner's refresh thread is told to stop and exits at its next wake-up, unjoined."""
    for _ in range(100):
        n = sum(1 for t in threading.enumerate() if t is not threading.current_thread())
        if settle is None or n == settle:
            return n
        time.sleep(0.01)
    return n


def test_no_spinner_thread_runs_during_a_timed_phase(capsys):
    with Feedback() as feedback:
        feedback._terminal = True  # as if stderr were a terminal
        before = spinner_threads()
        feedback.phase("loading")
        assert spinner_threads() == before + 1  # rich's refresh thread
        feedback.timed_phase("round 1/3: ar")
        assert spinner_threads(settle=before) == before
        feedback.detail("prompt 1/4")
        assert spinner_threads() == before
        feedback.phase("token forcing")
        assert spinner_threads() == before + 1
    assert spinner_threads(settle=before) == before
    err = capsys.readouterr().err
    assert "round 1/3: ar: prompt 1/4" in err


def test_off_a_terminal_phases_are_lines_and_details_are_dropped(capsys):
    with Feedback() as feedback:
        feedback.phase("dequantizing m.gguf")
        for i in range(3):
            feedback.detail(f"tensor {i + 1}/3")
        feedback.timed_phase("round 1/2: spec, 4 prompts")
        feedback.detail("prompt 1/4")
        feedback.note("fetching smollm2-135m")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert err[0].startswith("specpilot: [") and err[0].endswith("] dequantizing m.gguf ...")
    assert err[1].endswith("round 1/2: spec, 4 prompts ...")
    assert err[2] == "specpilot: fetching smollm2-135m"


@pytest.mark.parametrize("text", ["[#####.....] 50%", "[bold]not markup[/]"])
def test_spinner_text_is_not_markup(text, capsys):
    with Feedback() as feedback:
        feedback._terminal = True
        feedback.phase("downloading")
        feedback.detail(text)
        feedback.note(text)
    assert text in capsys.readouterr().err
