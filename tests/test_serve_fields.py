"""The request fields clients send, through the official openai client against a real server:
the usage chunk of a stream, logprobs equal to a direct forward's log-softmax, speculation off
or capped per request giving the same tokens, fields accepted and ignored."""

from __future__ import annotations

import openai
import pytest
import torch

from specpilot.commands.common import build_deployment
from test_serve import RunningServer, serve_args


@pytest.fixture(scope="module")
def server(two_slot_server):
    return two_slot_server


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_stream_ends_with_a_usage_chunk(server):
    msgs = [{"role": "user", "content": "hi hello world"}]
    chunks = list(
        client(server).chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=msgs,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    full = client(server).chat.completions.create(model=None, messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_equal_a_direct_forward(server, model_dir):
    dep = build_deployment(serve_args(model_dir))
    target, tok = dep.target.model, dep.target.tokenizer
    prompt = "hello world hello"
    r = client(server).completions.create(
        model=None,
        prompt=prompt,
        max_tokens=10,
        logprobs=3,
        seed=7,
        user="x",  # type: ignore[arg-type]
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    c = client(server).chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": prompt}],
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == c.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in content)
    # the direct forward over a prompt sent as token ids and its AR continuation
    ids = tok.encode(prompt)
    r = client(server).completions.create(model=None, prompt=ids, max_tokens=10, logprobs=2)  # type: ignore[arg-type]
    from specpilot.engine import Engine, generate

    toks = generate(Engine(target), [ids], 10, dep.eos_ids)[0].tokens
    seq = torch.tensor([ids + toks], dtype=torch.int64)
    logits = target.forward(seq, target.allocate_cache(1, seq.shape[1] + 1)).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    ref = want.gather(1, torch.tensor(toks)[:, None])[:, 0]
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == [tok.decode([t]) for t in toks]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref, atol=1e-4, rtol=0)
    top = [max(d.values()) for d in lp.top_logprobs or []]
    assert top == pytest.approx(ref.tolist(), abs=1e-4)  # the committed token is the argmax


def test_speculation_off_or_capped_gives_the_same_tokens(server):
    c = client(server)
    prompt = "hello world hello world hello"
    outs = [
        c.completions.create(
            model=None,
            prompt=prompt,
            max_tokens=24,
            extra_body=extra,  # type: ignore[arg-type]
        )
        .choices[0]
        .text
        for extra in ({}, {"speculative": False}, {"num_speculative_tokens": 1}, {"foo": 1})
    ]
    assert len(set(outs)) == 1
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=21,
        )


def test_streamed_completion_logprobs_continue_their_text_offsets(server):
    """Each chunk's ``text_offset`` continues from the chunks before, so the stream's logprobs
    put together equal the plain answer's."""
    kw = dict(model=None, prompt="hello world hello", max_tokens=10, logprobs=2)
    plain = client(server).completions.create(**kw).choices[0].logprobs  # type: ignore[call-overload]
    tokens, offsets = [], []
    for chunk in client(server).completions.create(stream=True, **kw):  # type: ignore[call-overload]
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
    assert plain is not None and len(tokens) > 1
    assert tokens == plain.tokens and offsets == plain.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
