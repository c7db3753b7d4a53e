"""Streaming detokenization (serve/detok.py, serve/worker.py ``_Stream``): the streamed text
equals the full decode, byte-split emoji and CJK and stop strings across tokens included, and
each step decodes a short window, not the whole response."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from byte_model import CORPUS, SPECIALS, byte_ids, byte_model_dir, write_byte_tokenizer
from specpilot.engine import Request
from specpilot.loading import TextTokenizer, load_tokenizer
from specpilot.serve.detok import MAX_WINDOW, IncrementalDetokenizer
from specpilot.serve.worker import Job, _Stream
from test_cli import tiny_dir
from test_loading import write_tiny_tokenizer


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return load_tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("bytes") / "tok"))


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("words") / "tok"))


def chunked(ids: list[int], rng: random.Random, most: int = 6) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i : i + n])
        i += n
    return out


def streamed(tok: TextTokenizer, chunks: list[list[int]]) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok)
    parts = [d.push(c) for c in chunks] + [d.flush()]
    return "".join(parts), parts


TRICKY = ["😀", "中文", "a😀b", "👍🏽", "🇫🇷", "❤️", " 你好，世界", "x 中 y 😀😀 z"]


@pytest.mark.parametrize("text", TRICKY)
def test_a_character_split_into_byte_tokens_comes_out_whole(byte_tok, text):
    """One byte per token: nothing is shown until a character is complete, never U+FFFD."""
    ids = byte_ids(byte_tok._tok, text)
    assert len(ids) == len(text.encode())
    out, parts = streamed(byte_tok, [[i] for i in ids])
    assert out == text == byte_tok.decode(ids)
    assert all("\ufffd" not in p for p in parts)
    if text == "😀":
        assert parts == ["", "", "", "😀", ""]


def test_the_trained_merges_split_characters_across_tokens(byte_tok):
    """The fixture is tricky indeed: some tokens hold part of a character."""
    partial = [i for i in range(byte_tok.vocab_size) if "\ufffd" in byte_tok.decode([i]) and i > 2]
    assert len(partial) > 50
    ids = byte_tok.encode(CORPUS[2] + CORPUS[3])
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids)


@pytest.mark.parametrize("which", ["bytes", "words"])
def test_streamed_text_equals_the_full_decode(which, byte_tok, word_tok):
    """Random token sequences (specials, invalid UTF-8 and half characters included) and real
    text, in random chunks: the pieces join to ``decode(ids, skip_special_tokens=True)``."""
    tok = byte_tok if which == "bytes" else word_tok
    rng = random.Random(0)
    texts = [*CORPUS, *TRICKY, "hello world hi user"]
    for seed in range(300):
        rng.seed(seed)
        if seed % 3 == 0:
            ids = tok.encode(rng.choice(texts))
        else:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 80))]
        want = tok.decode(ids, skip_special_tokens=True)
        out, _ = streamed(tok, chunked(ids, rng))
        assert out == want, (seed, ids)


def test_garbage_bytes_keep_the_window_short(byte_tok):
    """Text that keeps ending in undecodable bytes is still decoded in a bounded window, and
    still equals the full decode."""
    lone = byte_ids(byte_tok._tok, "中")[1]  # a continuation byte: never a character alone
    calls: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return byte_tok.decode(ids, skip_special_tokens)

    ids = [lone] * 500 + byte_ids(byte_tok._tok, "中") + [lone] * 3
    d = IncrementalDetokenizer(Spy())
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert out == byte_tok.decode(ids)
    assert max(calls) <= MAX_WINDOW + 2


class _Loop:
    """Stands in for the request's event loop: ``send`` lands in a list at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def call_soon_threadsafe(self, fn, item) -> None:
        self.sent.append(item)


def run_stream(tok, ids, chunks, stops, stream=True):
    loop = _Loop()
    job = Job(list(ids), 10_000, stops, loop, asyncio.Queue(), stream=stream)  # type: ignore[arg-type]
    s = _Stream(job, Request("r", (1,), 10_000, frozenset()), IncrementalDetokenizer(tok))
    ended = False
    for c in chunks:
        if s.feed(c):
            ended = True
            break
    outcome = s.finish("length")
    deltas = "".join(p[0] for kind, p in loop.sent if kind == "delta")
    return outcome, deltas, ended


STOP_TEXT = "hello 😀 world 中文 end and more 😀"
STOPS = [["😀 w"], ["中文"], ["end", "文 e"], ["zzz"], ["o"], ["hel"], ["more 😀"], ["😀"]]


@pytest.mark.parametrize("stops", STOPS)
@pytest.mark.parametrize("split", ["merges", "bytes"])
def test_stop_strings_across_tokens_cut_the_stream_like_the_full_text(byte_tok, stops, split):
    """A stop string spanning tokens (and half characters) cuts the streamed text where it cuts
    the full decode, in every chunking; the deltas join to the outcome's text."""
    ids = byte_tok.encode(STOP_TEXT) if split == "merges" else byte_ids(byte_tok._tok, STOP_TEXT)
    full = byte_tok.decode(ids, skip_special_tokens=True)
    cuts = [full.find(s) for s in stops if s in full]
    want = full[: min(cuts)] if cuts else full
    rng = random.Random(1)
    for _ in range(30):
        outcome, deltas, ended = run_stream(byte_tok, ids, chunked(ids, rng), stops)
        assert outcome.text == want and deltas == want
        assert ended == bool(cuts) and outcome.finish_reason == ("stop" if cuts else "length")
    plain, deltas, _ = run_stream(byte_tok, ids, chunked(ids, rng), stops, stream=False)
    assert plain.text == want and deltas == ""  # a plain job gets its text once, at the end


def _stream_through_worker(model: Path, prompts: list[str], max_tokens: int):
    """Each prompt streamed through the engine thread: (deltas joined, outcome, the lengths of
    the token lists the worker decoded for it)."""
    from test_serve_worker import Jobs, worker_for

    worker, _ = worker_for(model, "cpu", "-k", "4")
    tok = worker.tokenizer
    seen: list[int] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, skip_special_tokens=False):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    worker.tokenizer = Spy()  # type: ignore[assignment]
    jobs = Jobs(worker)
    worker.start()
    out = []
    try:
        for text in prompts:
            seen.clear()
            job = jobs.submit(tok.encode(text), max_tokens)
            parts = []
            while True:
                kind, payload = jobs.loop.run_until_complete(asyncio.wait_for(job.out.get(), 60))
                if kind != "delta":
                    break
                parts.append(payload[0])
            assert kind == "done", payload
            out.append(("".join(parts), payload, list(seen)))
    finally:
        jobs.close()
    return tok, out


def test_the_worker_decodes_a_window_per_step_not_the_whole_list(tmp_path: Path):
    """A 200-token stream through the engine thread: no decode call sees more than two steps'
    tokens (it used to decode the whole list at every step), and the text is the full decode."""
    tok, out = _stream_through_worker(tiny_dir(tmp_path / "model"), ["hello", "world hi"], 200)
    for text, outcome, seen in out:
        assert text == outcome.text == tok.decode(outcome.tokens, True)
        assert len(outcome.tokens) > 100 and max(seen) <= 2 * 5


def test_byte_level_streams_through_the_worker_equal_the_full_decode(tmp_path: Path):
    """A random model over byte-level BPE: half characters, invalid UTF-8, emoji and CJK in
    its output; every stream equals the full decode of its tokens."""
    prompts = ["你好，世界", "emoji 😀 🎉 and", "def add(a, b):\n" * 3, "hello", "🇫🇷 中"]
    tok, out = _stream_through_worker(byte_model_dir(tmp_path / "model"), prompts, 200)
    assert sum(len(o.tokens) for _, o, _ in out) > 400
    assert any("\ufffd" in o.text for _, o, _ in out)  # the output is tricky indeed
    for text, outcome, _ in out:
        assert text == outcome.text == tok.decode(outcome.tokens, True)


def test_specials_are_skipped_inside_split_characters(byte_tok):
    """A special token between the bytes of one character is dropped, as the full decode does."""
    eos = byte_tok.vocab()[SPECIALS[0]]
    b = byte_ids(byte_tok._tok, "中")
    ids = [b[0], eos, b[1], b[2]]
    out, _ = streamed(byte_tok, [[i] for i in ids])
    assert out == "中" == byte_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_tokenizer_streams_equal_the_full_decode():
    """The embedded default's real byte-level tokenizer (49k merges): random ids and
    multilingual text, in random chunks, stream to exactly the full decode."""
    from specpilot.loading import resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    rng = random.Random(0)
    texts = [*CORPUS, *TRICKY, "Ünïcödé, ﬁ ligatures, ZWJ 👩‍👩‍👧‍👦, math ∮ E⋅da = Q."]
    for seed in range(300):
        rng.seed(seed)
        if seed % 2:
            ids = tok.encode(rng.choice(texts))
        else:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        out, _ = streamed(tok, chunked(ids, rng, most=3))
        assert out == tok.decode(ids, skip_special_tokens=True), (seed, ids)
