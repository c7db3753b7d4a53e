"""bench/serve_latency.py --quick end to end: real server, offline engine, load test, audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_passes_every_check(tmp_path: Path):
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "serve_latency.py"),
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "serve_latency.json").read_text())
    checks = report["checks"]
    assert checks and all(checks.values()), checks
    lat, load = report["latency"], report["load"]
    assert len(lat["per_prompt"]) == 2 and not lat["mismatches"]
    assert all(p["completion_tokens"] > 0 for p in lat["per_prompt"])
    # the load test really ran every kind of request and the audit really looked at them
    kinds = {r["kind"] for r in load["results"]}
    assert kinds == {"plain", "stream", "stop", "stop-stream", "cancel"}
    assert load["equal_to_offline"] == load["expected_arrivals"] == 5
    assert load["cancelled"] == 1 and load["audited"] == 5
    assert load["audit_match_tokens"] > 0 and load["audit_mismatch_tokens"] == 0
    for r in load["results"]:  # a stop string comes from the output itself, so it cut it
        if r["kind"].startswith("stop"):
            assert r["stop"] and r["stop"] not in r["got"] and r["got"] == r["expected"]
    assert "check audit_zero_mismatches: PASS" in out.stdout
