"""The GPU suite's report (``bench/gpu_suite.py``): the per-shape table and the issue's targets
judged from one run's numbers."""

from __future__ import annotations

from typing import Any

from specpilot.drafters.simulated import SIM_LABEL


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, int | float) else "-"


def table(results: dict[str, Any]) -> str:
    rows = [
        "shape         AR tok/s  roofline  tV16/tAR  spec tok/s*  tau*   spec/pred  other@k8  "
        "HF eager  HF static+compile  HF assisted",
    ]
    for name, r in results["shapes"].items():
        if "error" in r:
            rows.append(f"{name:<13} error: {r['error'][:80]}")
            continue
        hf, sb, k8 = r.get("hf", {}), r.get("spec_block", {}), r.get("spec_k8", {})
        v16 = r["verify_curve"].get(str(sb.get("k", 15) + 1), {}).get("ratio_to_ar")
        pred = sb.get("fraction_of_predicted")
        other = k8.get("other_fraction")
        rows.append(
            f"{name:<13} {_fmt(r['ar']['tok_s'], '8.1f')}  {_fmt(100 * r['ar']['roofline_fraction'], '6.1f')}%"
            f"  {_fmt(v16, '8.3f')}  {_fmt(sb.get('tok_s'), '10.1f')}  {_fmt(sb.get('tau_measured'), '5.2f')}"
            f"  {_fmt(None if pred is None else 100 * pred, '8.1f')}%"
            f"  {_fmt(None if other is None else 100 * other, '7.2f')}%"
            f"  {_fmt(hf.get('eager_tok_s'), '8.1f')}  {_fmt(hf.get('static_compile_tok_s'), '17.1f')}"
            f"  {_fmt(hf.get('assisted_tok_s_incl_prefill'), '11.1f')}"
        )
    c = results["ceilings"]
    rows.append(
        f"* {SIM_LABEL} ({results['args']['sim_accept']}, block drafter); "
        f"copy {c['copy_bandwidth_Bps'] / 1e12:.3f} TB/s, read {c['read_bandwidth_Bps'] / 1e12:.3f} TB/s, "
        f"matmul {c['matmul_flops'] / 1e12:.0f} TFLOP/s; commit {results['commit']}, {results['date']}"
    )
    return "\n".join(rows)


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's four targets, judged from this run's numbers."""
    out: dict[str, Any] = {}
    llama = results["shapes"].get("llama3-8b")
    if llama and "ar" in llama:
        f = llama["ar"]["roofline_fraction"]
        out["ar_llama3_8b_roofline>=0.92"] = {"value": f, "met": f >= 0.92}
    for name in ("llama3-8b", "qwen3-8b"):
        r = results["shapes"].get(name)
        if r and "verify_curve" in r and "16" in r["verify_curve"]:
            v = r["verify_curve"]["16"]["ratio_to_ar"]
            out[f"tverify16/tAR_{name}<=1.15"] = {"value": v, "met": v <= 1.15}
    for name, r in results["shapes"].items():
        if "other_fraction" in r.get("spec_k8", {}):
            v = r["spec_k8"]["other_fraction"]
            out[f"other_fraction_k8_{name}<=0.05"] = {"value": v, "met": v <= 0.05}
        if "fraction_of_predicted" in r.get("spec_block", {}):
            v = r["spec_block"]["fraction_of_predicted"]
            out[f"spec_vs_predicted_{name}>=0.90 ({SIM_LABEL})"] = {"value": v, "met": v >= 0.90}
    return out
