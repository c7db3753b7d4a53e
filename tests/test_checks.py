"""Every argument is checked before anything is loaded: one sentence, exit status 2, no
traceback, and no model read (issue 16, items 4 and 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.cli import main
from test_cli import assert_one_line_error, raw_generate, run_cli


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model or tokenizer load fails the test: a bad argument must be found first."""

    def loaded(*a: object, **k: object) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    import specpilot.loading
    import specpilot.runtime

    monkeypatch.setattr(specpilot.runtime, "load_checkpoint", loaded)
    monkeypatch.setattr(specpilot.runtime, "load_tokenizer", loaded)
    monkeypatch.setattr(specpilot.loading, "load_tokenizer", loaded)
    monkeypatch.setattr(specpilot.loading.fetch, "fetch_wheel_member", loaded)


def engine_file(tmp_path: Path, target: Path, **fields: object) -> Path:
    path = tmp_path / "engine.json"
    cfg = {"deployment": {"target": str(target), "device": "cpu"}, "k": 4} | fields
    path.write_text(json.dumps(cfg))
    return path


BAD_GENERATE = [
    (["--max-new-tokens", "-5"], ["--max-new-tokens must be at least 1, got -5"]),
    (["-k", "1000"], ["-k 1000 is more than the 64 tokens", "verifies k + 1 tokens"]),
    (["-k", "-1"], ["-k must be at least 0"]),
    (["--simulate-acceptance", "tau=banana"], ["--simulate-acceptance"]),
    (["--simulate-acceptance", "tau=3,block=4", "-k", "5"], ["-k is 5"]),
    (["--drafter", "none", "--simulate-acceptance", "tau=3,block=4"], ["needs a drafter"]),
    (["--drafter", "draft-model"], ["--draft-model"]),
    (["--drafter", "draft-model", "--draft-model", "/no/such/dir"], ["draft model", "/no/such"]),
    (["--device", "gpu"], ["Unknown device 'gpu'"]),
    (["--device", "mps"], ["not on 'mps'"]),
    (["--dtype", "fp8"], ["Unknown dtype 'fp8'"]),
    (["--ngram-max", "1", "--ngram-min", "2"], ["--ngram-max (1) must be at least --ngram-min"]),
    (["--ngram-min", "0"], ["--ngram-min must be at least 1"]),
    (["--threads", "0"], ["--threads must be at least 1"]),
    (["--max-new-tokens", "9000"], ["does not fit --max-context 8192"]),
    (["--messages", "/no/such.json"], ["--messages"]),
    (["--engine", "/no/such.json"], ["Cannot read engine config"]),
]


@pytest.mark.parametrize(("argv", "fragments"), BAD_GENERATE)
def test_generate_rejects_bad_arguments_before_loading(
    model_dir, nothing_loads, capsys, argv, fragments
):
    code, _, err = run_cli(capsys, "generate", "--target", str(model_dir), "--device", "cpu", *argv)
    assert_one_line_error(code, err, *fragments)


def test_missing_target_and_files(nothing_loads, tmp_path, model_dir, capsys):
    code, _, err = run_cli(capsys, "generate", "--target", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "nope", "not a known name")

    code, _, err = run_cli(capsys, "generate", "--target", str(tmp_path / "weights.bin"))
    assert_one_line_error(code, err, "weights.bin")

    msgs = tmp_path / "m.json"
    msgs.write_text('[{"role": "user", "content": "hi"}]')
    code, _, err = run_cli(
        capsys, "generate", "hi", "--messages", str(msgs), "--target", str(model_dir)
    )
    assert_one_line_error(code, err, "not both")

    code, _, err = run_cli(capsys, "generate", "--target", str(model_dir), "--out", str(tmp_path))
    assert_one_line_error(code, err, "--out", "is a directory")

    # an engine config file is checked like the flags, and named in the message
    code, _, err = run_cli(
        capsys, "generate", "--engine", str(engine_file(tmp_path, model_dir, k=1000))
    )
    assert_one_line_error(code, err, "k = 1000 in", "engine.json", "64")
    code, _, err = run_cli(
        capsys,
        "generate",
        "--engine",
        str(engine_file(tmp_path, tmp_path / "gone", k=4)),
    )
    assert_one_line_error(code, err, "gone")


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["bench", "--rounds", "0"], ["--rounds must be at least 1"]),
        (["bench", "--prompts", "nope"], ["Unknown prompt set 'nope'"]),
        (["bench", "--prompts", "/no/such.jsonl"], ["does not exist"]),
        (["bench", "--limit", "0"], ["--limit must be at least 1"]),
        (["bench", "--mode", "batched", "--concurrency", "0"], ["--concurrency"]),
        (["bench", "--mode", "batched", "--resume"], ["--resume"]),
        (["bench", "--mode", "batched", "--arrival-rate", "-1"], ["--arrival-rate"]),
        (["bench", "--mode", "batched", "--segment-tokens", "0"], ["--segment-tokens"]),
        (["bench", "-k", "1000"], ["-k 1000"]),
        (["profile", "--repeats", "0"], ["--repeats must be at least 1"]),
        (["profile", "--clock", "process"], ["--threads 1"]),
        (["profile", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["serve", "--port", "70000"], ["--port must be between 0 and 65535"]),
        (["serve", "--default-max-tokens", "0"], ["--default-max-tokens"]),
        (["serve", "--audit-rate", "2"], ["--audit-rate"]),
        (["serve", "--max-concurrency", "0"], ["--max-concurrency"]),
        (["tune", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["tune", "-k", "1000"], ["-k 1000"]),
        (["tune", "--device", "gpu"], ["Unknown device"]),
        (["tune", "--budget", "0"], ["--budget must be more than 0 seconds"]),
        (["tune", "--trials", "0"], ["--trials must be at least 1"]),
        (["tune", "--compare-limit", "-1"], ["--compare-limit must be at least 0"]),
        (["tune", "--mode", "batched", "--requests", "0"], ["--requests must be at least 1"]),
    ],
)
def test_every_command_checks_before_loading(model_dir, nothing_loads, capsys, argv, fragments):
    code, _, err = run_cli(capsys, *argv, "--target", str(model_dir))
    assert_one_line_error(code, err, *fragments)


def test_verify_and_compare_check_before_loading(model_dir, nothing_loads, tmp_path, capsys):
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "none.jsonl"))
    assert_one_line_error(code, err, "does not exist")
    recs = tmp_path / "r.jsonl"
    recs.write_text("")
    code, _, err = run_cli(capsys, "verify", str(recs), "--dtype", "fp8")
    assert_one_line_error(code, err, "fp8")
    code, _, err = run_cli(capsys, "verify", str(recs), "--device", "gpu")
    assert_one_line_error(code, err, "gpu")
    code, _, err = run_cli(capsys, "verify", str(recs), "--target", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "nope")

    code, _, err = run_cli(capsys, "compare", "--engine", str(tmp_path / "none.json"))
    assert_one_line_error(code, err, "Cannot read engine config")
    engine = engine_file(tmp_path, model_dir, k=1000)
    code, _, err = run_cli(capsys, "compare", "--engine", str(engine))
    assert_one_line_error(code, err, "k = 1000")
    code, _, err = run_cli(
        capsys,
        "compare",
        "--engine",
        str(engine_file(tmp_path, model_dir)),
        "--max-new-tokens",
        "0",
    )
    assert_one_line_error(code, err, "--max-new-tokens")


def test_k_zero_says_it_is_plain_ar(model_dir, capsys):
    code, out, err = run_cli(
        capsys,
        *raw_generate(model_dir, "hello world hello"),
        "-k",
        "0",
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("specpilot: note:")]
    assert notes == [
        "specpilot: note: -k 0 drafts nothing, so this runs plain AR decoding (as --drafter none "
        "does)."
    ]
    assert json.loads(out)["drafter"] == "none"


def test_the_largest_k_still_runs(model_dir, capsys):
    code, out, _ = run_cli(
        capsys,
        *raw_generate(model_dir, "hello world hello world hello"),
        "-k",
        "64",
        "--max-new-tokens",
        "8",
        "--json",
    )
    assert code == 0 and json.loads(out)["identical_to_ar"] is True


def test_help_of_k_names_the_bound(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "0 to 64" in capsys.readouterr().out
