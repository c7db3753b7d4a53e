"""The real embedded default: SmolLM2-135M-Instruct (GGUF from PyPI), fp32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpilot.cli import main
from specpilot.config import ModelConfig
from specpilot.engine import Engine, generate
from specpilot.loading.fetch import fetch_model
from specpilot.loading.gguf_file import load_gguf
from specpilot.runtime import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence and then explain why.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three colors of the rainbow.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", torch.float32, "cpu")


def test_stock_path_equals_transformers(smollm2):
    """Our GGUF reader gives transformers' own GGUF loader's tensors bit for bit (the same
    dequantizer; the q/k permutation reversed), and our stock AR path and transformers'
    ``generate`` agree token for token (fp32, 40 tokens)."""
    from specpilot.bench.hf_baseline import HFBaseline

    path = fetch_model("smollm2-135m")
    cfg, ours = load_gguf(path)
    assert cfg == ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),  # <|im_end|>
    )
    hf = HFBaseline("smollm2-135m", torch.float32, torch.device("cpu"))
    theirs = hf.model.state_dict()
    assert len(ours) == 272 and set(ours) <= set(theirs) <= set(ours) | {"lm_head.weight"}
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == theirs[name].shape, name
        assert torch.equal(t, theirs[name]), name
    del ours, theirs
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model)
    for text in PROMPTS[:2]:  # prose and code
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        ours = generate(engine, [ids], 40)[0].tokens  # no EOS: compare the full 40 tokens
        theirs = hf.generate(ids, 40, [])
        assert len(ours) == 40
        assert ours == theirs[:40], text


def test_bench_copy_heavy_is_token_forcing_clean(tmp_path: Path, capsys):
    out = tmp_path / "bench.jsonl"
    code = main(
        [
            "bench",
            "--prompts",
            "copy-heavy",
            "--limit",
            "1",
            "--max-new-tokens",
            "32",
            "--rounds",
            "2",
            "--device",
            "cpu",
            "--json",
            "--out",
            str(out),
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["forcing"]["mismatches"] == 0 and result["forcing"]["near_ties"] == 0
    assert result["identical_to_ar"] == "1/1"
    assert result["acceptance"]["mean_accepted_len_incl_bonus"] > 1.5  # copying pays off
    assert len(out.read_text().splitlines()) == 2  # AR + spec per prompt (the last round)
    assert result["rounds"] == 2 and result["verdict"] == "undecided"  # a verdict needs 3 rounds


def test_readme_generate_command(capsys):
    code = main(["generate", "--max-new-tokens", "40", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "token forcing PASS" in out and "speedup" in out and "identical to AR" in out


def test_the_shipped_drafter_is_lossless_and_learned(smollm2):
    """``--drafter dflash`` without ``--draft-model`` takes the shipped SmolLM2 drafter; fp32
    output equals AR, and it is a trained drafter (τ well above a random one's 1.0)."""
    from specpilot.runtime import build_drafter

    drafter = build_drafter("dflash", smollm2, 4)
    assert drafter is not None and drafter.name == "dflash"
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS[:2]]
    want = [r.tokens for r in generate(Engine(smollm2.model), prompts, 40)]
    res = generate(Engine(smollm2.model, drafter), prompts, 40)
    assert [r.tokens for r in res] == want
    accepted = sum(sum(r.stats.accepted) for r in res)
    cycles = sum(r.stats.cycles for r in res)
    assert (accepted + cycles) / cycles > 1.3  # τ, bonus included


def test_cached_gguf_tokenizer_equals_fresh_conversion(tmp_path: Path, monkeypatch):
    from specpilot.loading import load_tokenizer, resolve_model

    gguf = resolve_model("smollm2-135m")
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    fresh = load_tokenizer(gguf)  # converted from the GGUF, then saved under tmp_path
    assert any((tmp_path / "tokenizers").iterdir())
    cached = load_tokenizer(gguf)  # read back from the saved files
    messages = [
        {
            "role": "user",
            "content": "Rename `lst` to `items`:\n\ndef f(lst):\n    return lst[0]  # ünïcode",
        }
    ]
    assert cached.apply_chat_template(messages) == fresh.apply_chat_template(messages)
    assert cached.eos_token_ids == fresh.eos_token_ids and cached.vocab() == fresh.vocab()
    ids = fresh.encode("Hello, world! 123 ünïcode\n\ttabs")
    assert cached.encode("Hello, world! 123 ünïcode\n\ttabs") == ids and cached.decode(
        ids
    ) == fresh.decode(ids)


def test_server_chat_equals_offline_engine(smollm2):
    """SmolLM2 behind the server: the openai client gets what the offline engine generates."""
    import openai

    from specpilot.cli import build_parser
    from specpilot.commands.serve import build_app
    from test_serve import RunningServer, free_port

    args = build_parser().parse_args(["serve", "--device", "cpu"])
    app = build_app(args)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    ids = smollm2.tokenizer.apply_chat_template(messages)
    want = generate(Engine(smollm2.model), [ids], 40, smollm2.tokenizer.eos_token_ids)[0].tokens
    with RunningServer(app, free_port()) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40)  # type: ignore[arg-type]
    assert r.choices[0].message.content == smollm2.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage is not None and r.usage.completion_tokens == len(want)
