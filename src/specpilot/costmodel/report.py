"""Reports of a :class:`~specpilot.costmodel.model.Prediction`: terminal table, JSON, PNG chart.

rich and matplotlib are imported inside the functions that use them (core imports stay light).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specpilot.costmodel.model import CYCLE_ORDER, Prediction

COLORS = {
    "draft": "#8e6bbf",
    "embedding": "#9e9e9e",
    "attn_proj": "#4e79a7",
    "attn_kv": "#76b7b2",
    "mlp": "#2f5d8a",
    "lm_head": "#f28e2b",
    "argmax": "#e15759",
    "accept_commit": "#59a14f",
    "overhead": "#bab0ac",
}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _tag(pred: Prediction) -> str:
    """`` · simulated acceptance`` for a prediction from simulated acceptance, else ``""``:
    every figure of such a run says so where it is printed."""
    from specpilot.drafters.simulated import SIM_LABEL

    return f" · {SIM_LABEL}" if pred.acceptance.source == "simulated" else ""


def _component_cells(pred: Prediction) -> list[tuple[str, ...]]:
    """Per component of the cycle: its name, AR roofline and measured ms per step, cycle roofline
    and measured ms, ms lost per generated token (``-``: no gap)."""
    gaps = {g.component: g for g in pred.gaps()}
    rows = []
    for comp in CYCLE_ORDER:
        st, at = pred.spec.term(comp), pred.ar.term(comp)
        if st is None or at is None:
            continue
        g = gaps.get(comp)
        lost = "-" if g is None else f"{g.lost_s_per_token * 1e3:.3f}"
        times = (at.roofline_s, at.measured_s, st.roofline_s, st.measured_s)
        rows.append((comp, *map(_ms, times), lost))
    return rows


def _total_cells(pred: Prediction) -> tuple[str, ...]:
    """The whole step and cycle: ``total``, then the four columns of ms."""
    ar, spec = pred.ar, pred.spec
    return ("total", *map(_ms, (ar.roofline_s, ar.measured_s, spec.roofline_s, spec.measured_s)))


def print_report(pred: Prediction, header: dict[str, Any] | None = None) -> None:
    """A rich table of the cycle (roofline vs measured per component) and the speedups."""
    from rich.table import Table

    from specpilot.consoles import result_console

    console = result_console()
    tag = _tag(pred)

    def tagged(line: str) -> str:  # every figure line of a simulated run says so
        return line + tag if tag and tag.removeprefix(" · ") not in line else line

    def say(line: str) -> None:
        console.print(tagged(line))

    e = pred.expected_tokens
    title = f"profile · {pred.label} · ms per AR step / per cycle, lost ms per token"
    table = Table(title=title, title_justify="left")
    meas = "measured" if pred.measured_speedup is not None else "predicted"
    for col, just in (
        ("component", "left"),
        ("AR roof", "right"),
        (f"AR {meas[:4]}", "right"),
        ("cycle roof", "right"),
        (f"cycle {meas[:4]}", "right"),
        ("lost/tok", "right"),
    ):
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for cells in _component_cells(pred):
        table.add_row(*cells)
    table.add_row("[bold]total[/]", *_total_cells(pred)[1:], "", end_section=True)
    console.print(table)
    src = pred.acceptance.source
    say(
        f"E[tokens/cycle] = {e:.3f} (bonus included; {src} acceptance, "
        f"k = {pred.acceptance.k}, mean draft length {pred.acceptance.expected_draft_len():.2f})"
    )
    line = f"speedup over AR: predicted {_x(pred.predicted_speedup)}, ceiling {_x(pred.ceiling_speedup)}"
    if pred.measured_speedup is not None:
        err = pred.prediction_error
        line += (
            f", measured {_x(pred.measured_speedup)} (prediction error {err:+.1%})"
            if err is not None
            else ""
        )
    say(line)
    ts = pred.tok_s()
    say(
        "tok/s: AR "
        + (f"{ts['ar_predicted']:.1f}" if ts["ar_predicted"] else "-")
        + f" (ceiling {ts['ar_ceiling']:.1f}), speculative "
        + (f"{ts['spec_predicted']:.1f}" if ts["spec_predicted"] else "-")
        + f" (ceiling {ts['spec_ceiling']:.1f})"
    )
    ranked = pred.gaps()[:5]
    if ranked:
        say(f"largest gaps (time lost per generated token{tag.replace(' ·', ';')}):")
        for i, g in enumerate(ranked, 1):
            names = ", ".join(f"{m.name} ({m.status})" for m in g.mechanisms[:3]) or "none known"
            say(
                f"  {i}. {g.component:<13} {g.lost_s_per_token * 1e3:8.3f} ms ({g.share:5.1%})  → {names}"
            )
    for key, val in (header or {}).items():
        console.print(f"[dim]{key}: {val}[/]")  # inputs (prompts, hardware), not run figures
    for note in pred.notes:
        console.print(f"[dim]{note}[/]")


def write_json(path: Path, pred: Prediction, extra: dict[str, Any] | None = None) -> None:
    data = {"prediction": pred.to_dict(), **(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def draw_chart(path: Path, pred: Prediction, subtitle: str = "") -> None:
    """PNG: per-component roofline vs measured (left), the stacked cycle and AR step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = [c for c in CYCLE_ORDER if pred.spec.term(c) is not None]
    roof = [pred.spec.term(c).roofline_s * 1e3 for c in comps]  # type: ignore[union-attr]
    meas = [(pred.spec.term(c).measured_s or 0.0) * 1e3 for c in comps]  # type: ignore[union-attr]
    kind = "measured" if pred.measured_speedup is not None else "predicted"
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.5, 1]}, constrained_layout=True
    )
    ys = list(range(len(comps)))[::-1]
    h = 0.38
    ax.barh(
        [y + h / 2 for y in ys], roof, h, color="#dde5f0", edgecolor="#4e79a7", label="roofline"
    )
    ax.barh(
        [y - h / 2 for y in ys], meas, h, color=[COLORS.get(c, "#777") for c in comps], label=kind
    )
    top = max([*roof, *meas, 1e-9])
    for y, r, m in zip(ys, roof, meas, strict=True):
        ax.text(m + top * 0.01, y - h / 2, f"{m:.3g}", va="center", fontsize=8)
        ax.text(r + top * 0.01, y + h / 2, f"{r:.3g}", va="center", fontsize=8, color="#4e79a7")
    ax.set_yticks(ys, comps)
    ax.set_xlabel("ms per speculative cycle")
    ax.set_xlim(0, top * 1.18)
    ax.set_title(f"one speculative cycle, per component: roofline vs {kind}", fontsize=11)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(facecolor="#dde5f0", edgecolor="#4e79a7", label="roofline"),
            Patch(facecolor="#555555", label=f"{kind} (colour = component)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=2,
        fontsize=9,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)

    # Right: time per generated token (AR step; speculative cycle ÷ E), stacked by component,
    # so the bars' heights compare directly and their ratio is the speedup.
    e = pred.expected_tokens
    bars = [
        ("AR\nroofline", pred.ar, "roofline_s", 1.0),
        (f"AR\n{kind}", pred.ar, "measured_s", 1.0),
        ("spec\nroofline", pred.spec, "roofline_s", e),
        (f"spec\n{kind}", pred.spec, "measured_s", e),
    ]
    height = 0.0
    for i, (_, cyc, attr, per) in enumerate(bars):
        bottom = 0.0
        for c in comps:
            t = cyc.term(c)
            val = 0.0 if t is None else (getattr(t, attr) or 0.0) * 1e3 / per
            ax2.bar(
                i, val, 0.6, bottom=bottom, color=COLORS.get(c, "#777"), label=c if i == 0 else None
            )
            bottom += val
        height = max(height, bottom)
        ax2.text(i, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylim(0, height * 1.12)
    ax2.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=9)
    ax2.set_ylabel("ms per generated token (cycle ÷ E)")
    lines = [f"E[tokens/cycle] = {e:.2f} (bonus incl., {pred.acceptance.source} acceptance)"]
    lines.append(
        f"speedup: predicted {_x(pred.predicted_speedup)}, ceiling {_x(pred.ceiling_speedup)}"
        + _tag(pred)
    )
    if pred.measured_speedup is not None and pred.prediction_error is not None:
        lines.append(
            f"measured {_x(pred.measured_speedup)} (error {pred.prediction_error:+.1%})"
            + _tag(pred)
        )
    ax2.set_title("\n".join(lines), fontsize=10)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{pred.label}" + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plain_table(pred: Prediction) -> str:
    """The cycle and the speedups as plain text (for machines without rich)."""
    kind = "meas" if pred.measured_speedup is not None else "pred"
    rows = [
        f"{'component':<14}{'AR roof':>9}{'AR ' + kind:>9}{'cyc roof':>10}{'cyc ' + kind:>10}"
        f"{'lost/tok':>10}  (ms)"
    ]
    for cells in [*_component_cells(pred), _total_cells(pred)]:
        name, *rest = cells
        widths = (9, 9, 10, 10, 10)
        rows.append(
            f"{name:<14}" + "".join(f"{c:>{w}}" for c, w in zip(rest, widths, strict=False))
        )
    line = (
        f"E = {pred.expected_tokens:.2f} ({pred.acceptance.source}); speedup predicted "
        f"{_x(pred.predicted_speedup)}, ceiling {_x(pred.ceiling_speedup)}"
    )
    if pred.measured_speedup is not None and pred.prediction_error is not None:
        line += f", measured {_x(pred.measured_speedup)}, error {pred.prediction_error:+.1%}"
    rows.append(line + _tag(pred))
    top = pred.gaps()[:3]
    if top:
        rows.append(
            "top gaps: "
            + "; ".join(
                f"{g.component} {g.lost_s_per_token * 1e3:.3f} ms/tok → "
                + ", ".join(m.name for m in g.mechanisms[:2])
                for g in top
            )
            + _tag(pred)
        )
    rows.append(pred.label)
    return "\n".join(rows)
