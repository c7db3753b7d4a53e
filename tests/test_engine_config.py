"""Engine configs round-trip, refuse what the registry does not know, and drive the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import Applicability, Knob, Mechanism


def test_round_trip(tmp_path: Path) -> None:
    cfg = EngineConfig(
        DeploymentSpec(target="x", drafter="ngram", dtype="bf16"), k=5, drafter_knobs={"max_n": 2}
    )
    cfg.save(tmp_path / "e.json")
    assert EngineConfig.load(tmp_path / "e.json") == cfg


def test_unknown_mechanism_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SpecPilotError, match="not registered"):
        EngineConfig(DeploymentSpec(target="x"), mechanisms={"warp-drive": {}})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SpecPilotError, match="Cannot read"):
        EngineConfig.load(tmp_path / "bad.json")
    with pytest.raises(SpecPilotError, match="malformed"):
        EngineConfig.from_dict({"k": 3})
    with pytest.raises(SpecPilotError, match="mode"):
        DeploymentSpec(target="x", mode="sideways")


def test_knobs_and_applicability() -> None:
    k = Knob("depth", 4, low=1, high=8)
    assert k.validate(6) == 6
    with pytest.raises(ValueError, match="depth"):
        k.validate(9)
    c = Knob("layout", "a", choices=("a", "b"))
    with pytest.raises(ValueError):
        c.validate("z")
    m = Mechanism(
        name="demo",
        component="lm_head",
        plug_point="lm_head_argmax",
        lossless="exact",
        apply=lambda build, knobs: None,
        knobs=(k,),
        applies=Applicability(devices=("cuda",)),
    )
    assert m.resolve_knobs({}) == {"depth": 4}
    with pytest.raises(ValueError, match="no knob"):
        m.resolve_knobs({"width": 2})
    assert not m.applies.allows("cpu", "bf16", "ngram", "single", "llama")
    assert m.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    with pytest.raises(ValueError, match="component"):
        Mechanism(
            name="x", component="warp", plug_point="runtime", lossless="", apply=lambda b, k: None
        )


def test_generate_reads_engine_file(model_dir: Path, tmp_path: Path, capsys) -> None:
    cfg = EngineConfig(DeploymentSpec(target=str(model_dir), drafter="ngram", device="cpu"), k=3)
    cfg.save(tmp_path / "tuned.json")
    code = main(
        [
            "generate",
            "hello world hello",
            "--raw",
            "--engine",
            str(tmp_path / "tuned.json"),
            "--max-new-tokens",
            "12",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["drafter"] == "ngram(k=3)" and out["forcing"]["ok"]
