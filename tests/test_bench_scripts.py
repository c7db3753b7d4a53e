"""The GPU bench scripts end to end on tiny CPU shapes (moved here, unchanged, from the test files
of their mechanisms when those were ported to the one engine).

What each script must still show: every variant lossless (tokens equal AR, forcing clean) and
labelled "simulated acceptance" where the acceptance was simulated. (The scripts of the drivers
that the one engine replaced were removed with them.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str, monkeypatch):  # bench/<name>.py as a module, undone after the test
    import importlib.util as iu

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the scripts import their siblings
    spec = iu.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = iu.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gpu_suite_tiny_end_to_end(tmp_path: Path) -> None:
    from specpilot.bench.gpu_suite import main

    args = ["--out", str(tmp_path), "--tiny", "--target-shape", "tiny-llama", "--no-assisted"]
    results = main([*args, "--device", "cpu", "--new-tokens", "16", "--verify-widths", "1,9"])
    saved = json.loads((tmp_path / "results.json").read_text())
    shape = saved["shapes"]["tiny-llama"]
    for run in ("spec_block", "spec_k8"):
        assert shape[run]["label"] == "simulated acceptance"
        assert shape[run]["tokens_equal_ar"] and shape[run]["forcing"]["ok"]
    assert shape["ar"]["tok_s"] > 0 and shape["hf"]["eager_agree_prefix_with_ours"] == 8
    assert "simulated acceptance" in saved["note"] and results["targets"]


def test_mechanisms_gpu_script_runs_tiny_on_the_cpu(tmp_path, monkeypatch):
    mod = _load_script("mechanisms_gpu", monkeypatch)
    out = mod.main(["--tiny", "--out", str(tmp_path), "--iters", "1"])
    assert not out.get("errors"), out.get("errors")
    saved = json.loads((tmp_path / "mechanisms_gpu.json").read_text())
    assert all(r["mismatches"] == 0 for r in saved["lm_head"])
    assert {r["tokens"] for r in saved["verify"] if "chain_ms" in r} == {1, 4, 8}


def test_tree_accept_gpu_script_runs_tiny_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    """Part 1 checks the torch accept against the path it planted (and the fused kernel where
    Triton runs); part 2 runs AR, the chain and trees through ``build_engine`` under both
    simulated profiles, every output equal to AR and token-forced."""
    mod = _load_script("tree_accept_gpu", monkeypatch)
    mod.main(["--tiny", "--out", str(tmp_path), "--rounds", "1", "--e2e-rounds", "1"])
    saved = json.loads((tmp_path / "tree_accept_gpu.json").read_text())
    assert [r["nodes"] for r in saved["accept"]] == [6, 10]
    assert all(
        r["rows_moved"] > 0 and r["us_per_call"]["tree torch"]["median"] > 0
        for r in saved["accept"]
    )
    runs = saved["e2e"]
    assert {r["profile"] for r in runs} == {"eagle-like", "dflash-like"}
    assert {r["variant"] for r in runs} >= {"ar", "chain", "tree6", "tree10"}
    assert all(
        r["tokens_equal_ar"] and r["warmup_tokens_equal_ar"] and r["forcing"]["ok"] for r in runs
    )
    trees = [r for r in runs if r["variant"].startswith("tree")]
    assert all("simulated acceptance" in r["label"] and "sibling=0.5" in r["label"] for r in trees)
    assert all(r["mechanisms"]["tree-verify"]["max_nodes"] in (6, 10) for r in trees)
    assert "simulated acceptance" in saved["label"]


def test_l2_prefetch_gpu_script_runs_tiny_on_the_cpu(tmp_path, monkeypatch):
    mod = _load_script("l2_prefetch_gpu", monkeypatch)
    mod.main(["--tiny", "--out", str(tmp_path), "--rounds", "2", "--mib", "2"])
    saved = json.loads((tmp_path / "l2_prefetch_gpu.json").read_text())["sections"]
    assert not [name for name, sec in saved.items() if isinstance(sec, dict) and "error" in sec]
    assert saved["micro"] and all(pair["outputs_equal"] for pair in saved["micro"].values())
    assert saved["best"]["knobs"] is not None
    runs = [v for k, v in saved["e2e"].items() if k not in ("shape", "assumptions")]
    assert runs and all(r["tokens_equal"] for r in runs)
    assert all(arm["issued"] > 0 for r in runs for arm in r["arms"].values())


def test_two_level_graph_gpu_script_runs_tiny_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    """Every arm equals AR (warm-up and timed runs), the cheap level corrects (τ per exact verify
    rises by the replacement, more with the extension) and each two-level arm has a prediction."""
    mod = _load_script("two_level_graph_gpu", monkeypatch)
    mod.main(["--tiny", "--out", str(tmp_path), "--rounds", "1", "--new-tokens", "24"])
    saved = json.loads((tmp_path / "two_level_graph_gpu.json").read_text())
    assert saved["agreement"] > 0.9  # the INT8 copy of the peaked target agrees with it
    assert len(saved["profiles"]) == 2 and not [p for p in saved["profiles"] if "error" in p]
    for prof in saved["profiles"]:
        arms = prof["arms"]
        assert set(arms) == {"ar", "one-level", "correct", "extend"}
        assert all(a["tokens_equal_ar"] and a["warmup_tokens_equal_ar"] for a in arms.values())
        assert arms["one-level"]["tau"] < arms["correct"]["tau"] < arms["extend"]["tau"]
        for name in ("correct", "extend"):
            assert arms[name]["predicted"]["tau_two"] > arms["one-level"]["tau"]
            assert arms[name]["cheap_counts"]["rows"] > 0
    assert "simulated acceptance" in saved["label"]


def test_ar_stack_script_runs_tiny_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    """Every arm built by build_engine over its own model copy, token-forced, timed."""
    mod = _load_script("ar_stack_gpu", monkeypatch)
    args = ["ar_stack_gpu.py", "--out", str(tmp_path), "--tiny", "--rounds", "2", "--context", "40"]
    monkeypatch.setattr(sys, "argv", args)
    mod.main()
    saved = json.loads((tmp_path / "ar_stack_gpu.json").read_text())
    assert set(saved["arms"]) == set(mod.DEFAULT_ARMS)
    for arm in saved["arms"].values():
        assert arm["forcing"]["ok"] and arm["forcing"]["matches"] == 32
        assert arm["step_s"]["n"] == 2 and arm["decode_tok_s"]["median"] > 0


def test_gemv_sweep_grid_keys_round_trip() -> None:
    """The sweep's tiling names parse back to the same tiling (the JSON and the workers use them).
    In a subprocess: without a GPU the script turns on the Triton interpreter as it imports, which
    would leave this process's kernels interpreted for the tests after this one."""
    import os
    import subprocess

    code = (
        "import gemv_sweep_gpu as m; g = m.grid(tiny=False); "
        # 3*3*3 tile shapes x 2 stages x 5 splits = 270, less the 4 shapes that spill (x10)
        "assert len(g) == len({m.key(c) for c in g}) == 230; "
        "assert (64, 1024, 4) not in {(c.block_n, c.block_k, c.num_warps) for c in g}; "
        "assert all(m.from_key(m.key(c)) == c for c in g); print('grid ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "bench", env=env, capture_output=True, text=True
    )
    assert "grid ok" in out.stdout, out.stderr[-2000:]
