"""The CLI end to end on a tiny HF directory: outputs, records, verify, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.config import ModelConfig
from test_loading import random_tensors, tiny_hf_config, write_hf_dir, write_tiny_tokenizer


def tiny_dir(root: Path, vocab: int = 10, seed: int = 0) -> Path:
    cfg_dict = tiny_hf_config() | {"vocab_size": vocab}
    tensors = {k: v * 0.3 for k, v in random_tensors(ModelConfig.from_hf(cfg_dict), seed).items()}
    write_hf_dir(root, cfg_dict, tensors, shards=1)
    write_tiny_tokenizer(root)
    return root


def raw_generate(model: Path, prompt: str) -> tuple[str, ...]:
    """``generate PROMPT --raw --target MODEL --device cpu``: the start of most CLI calls here."""
    return ("generate", prompt, "--raw", "--target", str(model), "--device", "cpu")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("specpilot: error:")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0]


def test_generate_json_records_and_verify(model_dir, tmp_path, capsys):
    recs = tmp_path / "runs.jsonl"
    code, out, _ = run_cli(
        capsys,
        "generate",
        "hello world hello world hello",
        "--raw",
        "--target",
        str(model_dir),
        "--max-new-tokens",
        "24",
        "-k",
        "4",
        "--device",
        "cpu",
        "--json",
        "--out",
        str(recs),
    )
    assert code == 0
    result = json.loads(out)
    assert result["forcing"]["ok"] and result["forcing"]["mismatches"] == 0
    assert result["identical_to_ar"] is True
    lines = [json.loads(x) for x in recs.read_text().splitlines()]
    assert [r["engine"] for r in lines] == ["spec", "ar"]
    assert lines[0]["tokens"] == lines[1]["tokens"]

    code, out, _ = run_cli(capsys, "verify", str(recs), "--device", "cpu")
    assert code == 0 and "PASS" in out

    # Corrupt one committed token: verify must fail with exit status 1 and show the mismatch.
    bad = dict(lines[0])
    toks = bad["tokens"]
    toks[min(3, len(toks) - 1)] = (toks[min(3, len(toks) - 1)] + 1) % 10
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    code, out, _ = run_cli(capsys, "verify", str(tmp_path / "bad.jsonl"), "--device", "cpu")
    assert code == 1 and "first mismatch" in out and "top-5" in out and "FAIL" in out


def test_bad_inputs_give_one_clear_sentence(model_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "generate", "--target", str(tmp_path / "nope"), "--device", "cpu"
    )
    assert_one_line_error(code, err, "nope")

    code, _, err = run_cli(
        capsys,
        "generate",
        "--target",
        str(model_dir),
        "--drafter",
        "draft-model",
        "--device",
        "cpu",
    )
    assert_one_line_error(code, err, "--draft-model")

    other = tiny_dir(tmp_path / "other", vocab=12)
    code, _, err = run_cli(
        capsys,
        "generate",
        "hi",
        "--target",
        str(model_dir),
        "--drafter",
        "draft-model",
        "--draft-model",
        str(other),
        "--device",
        "cpu",
    )
    assert_one_line_error(code, err, "vocabulary")

    code, _, err = run_cli(
        capsys,
        "generate",
        " ".join(["hello"] * 300),
        "--raw",
        "--target",
        str(model_dir),
        "--device",
        "cpu",
    )
    assert_one_line_error(code, err, "context")

    msgs = tmp_path / "m.json"
    msgs.write_text("{not json")
    code, _, err = run_cli(
        capsys, "generate", "--messages", str(msgs), "--target", str(model_dir), "--device", "cpu"
    )
    assert_one_line_error(code, err, "--messages")

    code, _, err = run_cli(capsys, "verify", str(tmp_path / "missing.jsonl"))
    assert_one_line_error(code, err, "does not exist")

    code, _, err = run_cli(
        capsys, "generate", "--target", str(model_dir), "--dtype", "fp8", "--device", "cpu"
    )
    assert_one_line_error(code, err, "dtype")


def test_draft_model_drafter_through_the_cli(model_dir, capsys):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "hello world",
        "--raw",
        "--target",
        str(model_dir),
        "--drafter",
        "draft-model",
        "--draft-model",
        str(model_dir),
        "-k",
        "3",
        "--max-new-tokens",
        "20",
        "--device",
        "cpu",
        "--json",
    )
    assert code == 0
    r = json.loads(out)
    assert r["identical_to_ar"] and r["forcing"]["ok"]
    # The target drafting for itself accepts everything it proposes.
    assert r["tokens"] < 4 or r["mean_accepted_len_incl_bonus"] > 2.0


@pytest.mark.parametrize(
    "cmd",
    ["generate", "bench", "verify", "models", "serve", "profile", "tune", "memory", "compare"],
)
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: specpilot " + cmd in capsys.readouterr().out
