"""A tiny seeded model with a byte-level BPE tokenizer (GPT-2 / SmolLM2 style), built offline.

Its merges are trained on a few lines of English, Chinese and emoji, so tokens split CJK
characters and emoji into bytes, some tokens join a space to the first bytes of a character,
and a random model's output is often not valid UTF-8 until a later token completes it: what the
server's streaming detokenizer must get right.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.config import ModelConfig
from test_loading import CHATML, random_tensors, tiny_hf_config, write_hf_dir

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "你好，世界。中文的字符每个占三个字节。我们今天学习中文。",
    "emoji 😀 🎉 👍🏽 🇫🇷 ❤️ and more 😀😀",
    "日本語のテキストも少し。한국어 텍스트.",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (the ByteLevel alphabet's ids)."""
    table, vocab = bytes_to_unicode(), tok.get_vocab()
    return [vocab[table[b]] for b in text.encode()]


def write_byte_tokenizer(root: Path, vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(root))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return root


def byte_model_dir(root: Path, seed: int = 0, scale: float = 0.3) -> Path:
    """A 2-layer seeded llama over the byte-level tokenizer (fp32, context 256)."""
    write_byte_tokenizer(root)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(root), local_files_only=True))
    cfg = tiny_hf_config() | {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 0}
    tensors = random_tensors(ModelConfig.from_hf(cfg), seed)
    write_hf_dir(root, cfg, {k: v * scale for k, v in tensors.items()}, shards=1)
    return root
