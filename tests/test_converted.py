"""The converted copy of a GGUF in the cache: used when valid, rebuilt when the source changes or
the copy is damaged, and never trusted half-written (issue 16, item 4)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specpilot.config import ModelConfig
from specpilot.loading import converted as conv
from specpilot.loading.converted import (
    MANIFEST,
    WEIGHTS,
    converted_dir,
    list_converted,
    load_with_converted_copy,
)
from specpilot.loading.gguf_file import load_gguf
from specpilot.progress import Progress
from specpilot.runtime import load_model
from test_loading import assert_same_tensors, random_tensors, tiny_hf_config, write_gguf


class Recorder:
    """A Progress that keeps what it was told."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.notes: list[str] = []

    def phase(self, text: str) -> None:
        self.phases.append(text)

    def timed_phase(self, text: str) -> None:
        self.phase(text)

    def detail(self, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        self.notes.append(text)


class CountingLoader:
    """load_gguf, counting how often it really runs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, path: Path, progress: Progress) -> Any:
        self.calls += 1
        return load_gguf(path, progress)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECPILOT_CACHE", str(root))
    return root


def tiny_gguf(path: Path, seed: int = 0) -> tuple[Path, ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))
    tensors = random_tensors(cfg, seed)
    return write_gguf(path, cfg, tensors), cfg, tensors


def test_second_load_reads_the_converted_copy(cache: Path, tmp_path: Path) -> None:
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    fresh_cfg, fresh = load_gguf(src)
    loader, rec = CountingLoader(), Recorder()
    cfg1, _ = load_with_converted_copy(src, loader, rec)
    entry = converted_dir(src)
    assert loader.calls == 1 and sorted(p.name for p in entry.iterdir()) == [MANIFEST, WEIGHTS]
    assert entry.is_relative_to(cache)
    cfg2, t2 = load_with_converted_copy(src, loader, rec)
    assert loader.calls == 1, "the second load dequantized the GGUF again"
    assert cfg1 == cfg2 == fresh_cfg
    assert_same_tensors(t2, fresh)  # bit-identical to a fresh dequantization
    assert rec.notes == []
    assert any("loading the converted copy" in p for p in rec.phases)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["source"]["path"] == str(src.resolve())
    assert manifest["source"]["size"] == src.stat().st_size
    assert list_converted() == [(entry, str(src.resolve()), (entry / WEIGHTS).stat().st_size)]


def test_load_model_maps_the_converted_network(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second load_model of a GGUF neither reads the GGUF nor copies the weights: the
    network's parameters are the cache file's memory-mapped tensors (fp32 on the CPU), equal to
    a fresh conversion bit for bit; another dtype is cast from them."""
    import gguf

    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    first = load_model(str(src), with_tokenizer=False)

    def no_reader(*a: object, **k: object) -> None:
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    second = load_model(str(src), with_tokenizer=False)
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # the CPU's [in, out] copies are kept (and mapped) too, equal to fresh transposes
    for name, w in second.model.weights().items():
        assert not w.untyped_storage().resizable(), f"{name} was copied, not mapped"
        assert w.data_ptr() % 64 == 0, name
        assert torch.equal(w, first.model.weights()[name]), name
    assert any(n.startswith("gemv.") for n in second.model.weights())
    half = load_model(str(src), torch.bfloat16, with_tokenizer=False)
    assert half.model.embed.dtype == torch.bfloat16
    assert torch.equal(half.model.embed, first.model.embed.to(torch.bfloat16))
    assert half.model.lm_head_in_out is not None
    assert torch.equal(half.model.lm_head_in_out, half.model.lm_head.t())


def test_save_aligned_writes_standard_aligned_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {
        "big": torch.randn(48, 16),  # 3072 bytes: a multiple of 64
        "odd": torch.randn(7),  # 28 bytes: stored last
        "half": torch.randn(32, 8).to(torch.bfloat16),
        "a.norm": torch.randn(16),
    }
    conv.save_aligned(tensors, tmp_path / "w.safetensors")
    got = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for name in ("big", "half", "a.norm"):
        assert got[name].data_ptr() % 64 == 0, name


def test_a_changed_source_is_converted_again(cache: Path, tmp_path: Path) -> None:
    src, _, _ = tiny_gguf(tmp_path / "m.gguf", seed=0)
    loader, rec = CountingLoader(), Recorder()
    load_with_converted_copy(src, loader, rec)
    tiny_gguf(src, seed=1)  # same path, other weights
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    _, got = load_with_converted_copy(src, loader, rec)
    assert loader.calls == 2
    assert any("changed since it was converted" in n for n in rec.notes)
    _, fresh = load_gguf(src)
    assert_same_tensors(got, fresh)
    # and the rebuilt copy is trusted again
    load_with_converted_copy(src, loader, rec)
    assert loader.calls == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupt_copy_is_detected_and_rebuilt(cache: Path, tmp_path: Path, damage: str) -> None:
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    loader, rec = CountingLoader(), Recorder()
    load_with_converted_copy(src, loader, rec)
    weights = converted_dir(src) / WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "flip":  # one bit in the middle of the tensor data: only the CRC sees it
        data[len(data) // 2] ^= 0x10
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "delete":
        weights.unlink()
    else:
        (converted_dir(src) / MANIFEST).write_text("{not json")
    _, got = load_with_converted_copy(src, loader, rec)
    assert loader.calls == 2
    assert len(rec.notes) == 1 and "rebuilding the converted copy" in rec.notes[0], rec.notes
    _, fresh = load_gguf(src)
    assert_same_tensors(got, fresh)
    load_with_converted_copy(src, loader, rec)
    assert loader.calls == 2 and len(rec.notes) == 1


def test_a_kill_while_writing_leaves_no_trusted_copy(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    real_save = conv.save_aligned

    def killed_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
        real_save(tensors, path)
        path.write_bytes(path.read_bytes()[:1000])  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "save_aligned", killed_save)
    loader = CountingLoader()
    with pytest.raises(KeyboardInterrupt):
        load_with_converted_copy(src, loader, Recorder())
    entry = converted_dir(src)
    assert not (entry / MANIFEST).exists() and not (entry / WEIGHTS).exists()
    assert list(entry.iterdir()) == []  # the temporary file is gone too
    monkeypatch.setattr(conv, "save_aligned", real_save)

    # Killed after the weights were renamed into place but before the manifest: an old valid
    # manifest must not vouch for the new weights (it is removed before anything is written).
    load_with_converted_copy(src, loader, Recorder())
    tiny_gguf(src, seed=3)
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))

    def killed_manifest(path: Path, text: str) -> None:
        raise KeyboardInterrupt

    real_write = conv._write_atomically
    monkeypatch.setattr(conv, "_write_atomically", killed_manifest)
    with pytest.raises(KeyboardInterrupt):
        load_with_converted_copy(src, loader, Recorder())
    assert not (entry / MANIFEST).exists()
    monkeypatch.setattr(conv, "_write_atomically", real_write)
    calls = loader.calls
    _, got = load_with_converted_copy(src, loader, Recorder())
    assert loader.calls == calls + 1
    assert_same_tensors(got, load_gguf(src)[1])


def test_an_unwritable_cache_costs_only_the_conversion(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    cache.mkdir()
    (cache / "converted").write_text("a file where the folder should be")
    rec = Recorder()
    _, got = load_with_converted_copy(src, CountingLoader(), rec)
    assert_same_tensors(got, load_gguf(src)[1])
    assert len(rec.notes) == 1 and "could not write a converted copy" in rec.notes[0]

    (cache / "converted").unlink()
    monkeypatch.setattr(
        conv.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000, "total": 1, "used": 0})()
    )
    rec = Recorder()
    load_with_converted_copy(src, CountingLoader(), rec)
    assert len(rec.notes) == 1 and "too little for a converted copy" in rec.notes[0]
    assert not (converted_dir(src) / MANIFEST).exists()


def test_a_damaged_converted_tokenizer_is_rebuilt(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer converted from a GGUF is cached too; a copy that no longer loads is rebuilt
    with a note instead of failing every later start."""
    import transformers

    from specpilot.loading import tokenizer as tok_mod

    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    built: list[str] = []

    class FakeTokenizer:
        def save_pretrained(self, where: str) -> None:
            Path(where).mkdir(parents=True)
            (Path(where) / "tokenizer.json").write_text('{"ok": true}')

    def from_pretrained(where: str, gguf_file: str | None = None, **kw: object) -> FakeTokenizer:
        if gguf_file is None and json.loads((Path(where) / "tokenizer.json").read_text()) != {
            "ok": True
        }:
            raise ValueError("tokenizer.json is damaged")
        built.append("gguf" if gguf_file else "saved")
        return FakeTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    rec = Recorder()
    tok_mod._gguf_tokenizer(src, rec)
    tok_mod._gguf_tokenizer(src, rec)
    assert built == ["gguf", "saved"] and rec.notes == []
    (saved,) = (cache / "tokenizers").iterdir()
    (saved / "tokenizer.json").write_text("{damaged")
    tok_mod._gguf_tokenizer(src, rec)
    assert built == ["gguf", "saved", "gguf"]
    assert len(rec.notes) == 1 and "rebuilding it" in rec.notes[0]
    tok_mod._gguf_tokenizer(src, rec)
    assert built[-1] == "saved" and [p.name for p in (cache / "tokenizers").iterdir()] == [
        saved.name
    ]


def test_a_copy_of_another_layout_is_used_only_where_accepted(cache: Path, tmp_path: Path) -> None:
    """A copy made for the CPU (with its [in, out] copies) serves a GPU load too; one made for
    a GPU is rebuilt once for the CPU, with a note."""
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    loader, rec = CountingLoader(), Recorder()
    load_with_converted_copy(src, loader, rec, layout="plain")
    load_with_converted_copy(src, loader, rec, layout="plain+cpu")
    assert loader.calls == 2 and "holds plain, this load needs plain+cpu" in rec.notes[0]
    load_with_converted_copy(src, loader, rec, layout="plain", also_accept=("plain+cpu",))
    assert loader.calls == 2 and len(rec.notes) == 1


def test_models_list_shows_the_converted_copies(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specpilot.cli import main

    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    load_model(str(src), with_tokenizer=False)
    assert main(["models", "list"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("converted copy")]
    assert (
        len(lines) == 1 and str(src.resolve()) in lines[0] and str(converted_dir(src)) in lines[0]
    )
