"""The tune report: markdown with the price of the search, and PNG charts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specpilot.tune.evaluate import TrialResult
from specpilot.tune.outcome import TuneOutcome
from specpilot.tune.space import config_hash, describe


def break_even_tokens(
    search_seconds: float, stock_tok_s: float, tuned_tok_s: float
) -> float | None:
    """Generated tokens after which the tuned engine has paid back the search (None: never)."""
    saved_per_token = (
        1.0 / stock_tok_s - 1.0 / tuned_tok_s if stock_tok_s > 0 and tuned_tok_s > 0 else 0.0
    )
    return search_seconds / saved_per_token if saved_per_token > 0 else None


PHASES = ("draft_s", "verify_s", "accept_s", "other_s")
"""The cycle's phases in the engine's timers (``engine/types.CycleTimes``)."""


def per_token_phases(r: TrialResult) -> dict[str, float]:
    """Milliseconds per generated token in each phase of the decode loop (engine timers)."""
    ph = {k[:-2]: r.phase_seconds[k] for k in PHASES if r.phase_seconds.get(k, 0.0) > 0}
    tokens = r.tok_s * r.phase_seconds.get("wall_s", 0.0)
    if tokens <= 0 or not ph:
        return {}
    return {k: 1e3 * v / tokens for k, v in ph.items()}


def measured_text(outcome: TuneOutcome) -> str:
    """How many configurations this run measured: the trials ``memory list`` counts for it (a
    configuration listed under several directions is measured once; a head-to-head
    confirmation re-measures one already counted)."""
    fresh = [t for t in outcome.trials if t.result.wall_seconds > 0]
    configs = len({config_hash(t.result.config) for t in fresh})
    again = len(fresh) - configs
    return f"{configs} trials" + (f" (+{again} re-measured head to head)" if again else "")


def verdict_lines(outcome: TuneOutcome) -> list[str]:
    """What the search found, said only as far as the measured spreads allow."""
    stock, best = outcome.stock, outcome.best
    if best is stock:
        lines = [
            f"No candidate beat the stock engine by more than the noise: stock "
            f"{stock.spread_text()} over AR; a winner must beat it by more than both spreads, "
            "then again head to head."
        ]
    else:
        lines = [
            f"Tuned {best.spread_text()} over AR against stock {stock.spread_text()}, and faster "
            "than the stock engine head to head in every round."
        ]
    if best.ratio.verdict() != "faster":
        lines.append(
            f"No speculative engine beat plain AR by more than the noise here (best "
            f"{best.spread_text()}): serve this deployment without a drafter (--drafter none)."
        )
    if best.tau < 1.05:
        lines.append(
            f"The drafter's mean accepted length is τ = {best.tau:.2f}: its drafts are (almost) "
            "never accepted, so no speculative engine can beat AR here (random weights accept "
            "nothing; time such a deployment with --simulate-acceptance)."
        )
    return lines


def agent_price_lines(outcome: TuneOutcome, stock_tok_s: float, tuned_tok_s: float) -> list[str]:
    """The agents' price, beside the device-seconds: model, calls, tokens, seconds waited, and
    the break-even counting the seconds the search stood still waiting for them."""
    a = outcome.agent
    if a is None:
        return []
    held = outcome.usage.busy_seconds + a.blocked_seconds
    be = break_even_tokens(held, stock_tok_s, tuned_tok_s)
    return [
        f"- Agents: {a.summary()}.",
        f"- Break-even counting the {a.blocked_seconds:.1f} s the search waited on the agents as "
        "device time too: "
        + (f"{be:,.0f} generated tokens." if be else "never (no gain).")
        + " The agents' tokens are the endpoint's to price.",
    ]


def agent_proposal_lines(outcome: TuneOutcome) -> list[str]:
    """Every validated agent proposal, its hypothesis and what measuring it found."""
    if outcome.agent is None:
        return []
    found = {config_hash(t.result.config): t.result for t in outcome.trials}
    lines = [
        "",
        "## Agent proposals",
        "| round | direction | config | hypothesis | measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rec in outcome.agent_records:
        r = found.get(rec.config_hash)
        measured = "not run (budget)" if r is None else f"{r.spread_text()}, {r.verdict()}"
        lines.append(
            f"| {rec.round} | {rec.direction} | {rec.config} | {rec.hypothesis or '—'} | {measured} |"
        )
    if not outcome.agent_records:
        lines.append("| — | — | no proposal passed validation | — | — |")
    return lines


def write_report(
    outcome: TuneOutcome,
    label: str,
    out_dir: Path,
    tuned_path: Path,
    notes: Sequence[str] = (),
) -> Path:
    """``notes``: what the tune measured and what it left out (e.g. a batched tune's stream and
    the mechanisms its engine cannot carry out), listed under "Scope"."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = _charts(outcome, out_dir)
    stock, best = outcome.stock, outcome.best
    failed = [t for t in outcome.trials if t.result.error is not None]
    rejected = [t for t in outcome.trials if t.result.rejected]
    anomalies = [t for t in outcome.trials if t.result.anomaly]
    usage = outcome.usage
    be = break_even_tokens(usage.busy_seconds, stock.tok_s, best.tok_s)
    lines = [
        f"# SpecPilot tune report — {label}",
        "",
        "| engine | config | tok/s | speedup vs AR | τ (bonus incl.) |",
        "| --- | --- | ---: | ---: | ---: |",
        f"| plain AR (stock path) | — | {outcome.ar_tok_s:.1f} | 1.00× | 1.00 |",
        f"| stock speculative | {describe(stock.config)} | {stock.tok_s:.1f} | {stock.spread_text()} | {stock.tau:.2f} |",
        f"| **tuned** | {describe(best.config)} | {best.tok_s:.1f} | **{best.spread_text()}** | {best.tau:.2f} |",
        "",
        "Speedups: median over interleaved rounds against AR in the same process (lowest–highest "
        "round in brackets).",
        "",
        "## Verdict",
        *[f"- {v}" for v in verdict_lines(outcome)],
        f"- Tuned engine config: `{tuned_path}`.",
        "- Every trial below was token-forced against the stock target; a rejected trial, or one "
        "whose speedup the cost model cannot explain (an anomaly), is never integrated.",
        "",
        "## Price of the search",
        f"- {usage.busy_seconds:.1f} {usage.unit} summed over {len(usage.workers)} worker(s); "
        f"{outcome.wall_seconds:.1f} s wall time; {measured_text(outcome)} in "
        f"{outcome.rounds_run} round(s); {len(rejected)} rejected by token forcing; "
        f"{len(failed)} failed (not run to the end); {len(anomalies)} anomalies.",
        f"- Workers: {usage.summary(outcome.wall_seconds)}.",
        *[f"  - {line}" for line in usage.per_worker()],
        "- Break-even (against the device-seconds): "
        + (
            f"{be:,.0f} generated tokens until the search has paid for itself."
            if be
            else "never (no gain)."
        ),
        *agent_price_lines(outcome, stock.tok_s, best.tok_s),
    ]
    scope = list(notes)
    if outcome.unexplored:
        scope.append(
            "not measured, the time budget ran out first (raise --budget): "
            + ", ".join(outcome.unexplored)
        )
    if scope:
        lines += ["", "## Scope", *[f"- {n}" for n in scope]]
    if outcome.reused:
        lines += ["", "## Reused from memory", *[f"- {r}" for r in outcome.reused]]
    lines += [
        "",
        "## Trials",
        "| round | explorer | config | worker | tok/s | speedup | bound | τ | forcing |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for t in outcome.trials:
        r = t.result
        if r.error is not None:
            verdict = f"**FAILED** {r.error}"
        elif not r.forcing_ok:
            verdict = f"**REJECTED** {r.forcing.get('first_mismatch', r.forcing)}"
        elif r.anomaly:
            verdict = f"pass; **ANOMALY** {r.anomaly}"
        else:
            verdict = "pass"
        bound = f"{r.bound:.2f}×" if r.bound is not None else "—"
        lines.append(
            f"| {t.round} | {t.explorer} | {describe(r.config)} | {r.worker} | {r.tok_s:.1f} | {r.spread_text()} | {bound} | {r.tau:.2f} | {verdict} |"
        )
    lines += agent_proposal_lines(outcome)
    lines += ["", *[f"![{name}]({name})" for name in charts]]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _charts(outcome: TuneOutcome, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    # Speed versus search time: every trial, the best so far, rejected trials marked.
    fig, ax = plt.subplots(figsize=(7, 4))
    elapsed, best, xs, ys, bx, by, rx, ry = 0.0, 0.0, [], [], [], [], [], []
    for t in outcome.trials:
        elapsed += t.result.wall_seconds
        if t.result.forcing_ok:
            xs.append(elapsed)
            ys.append(t.result.speedup)
            best = max(best, t.result.speedup)
        else:
            rx.append(elapsed)
            ry.append(t.result.speedup)
        bx.append(elapsed)
        by.append(best)
    ax.scatter(xs, ys, s=18, label="trial (token forcing passed)")
    if rx:
        ax.scatter(rx, ry, marker="x", color="red", label="rejected by token forcing")
    ax.step(bx, by, where="post", color="black", label="best so far")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("speedup over plain AR")
    names.append(
        _finish(
            plt,
            fig,
            ax,
            out_dir / "speed_vs_search.png",
            "speed vs price of the search",
            "search wall time (s)",
        )
    )
    # Cycle breakdown per generated token, stock vs tuned (absent where the engine measured
    # has no phase timers: the continuous-batching scheduler of a batched tune).
    if per_token_phases(outcome.stock) or per_token_phases(outcome.best):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, r in enumerate((outcome.stock, outcome.best)):
            left = 0.0
            for j, (phase, ms) in enumerate(sorted(per_token_phases(r).items())):
                ax.barh(i, ms, left=left, color=f"C{j}", label=phase if i == 0 else None)
                left += ms
        ax.set_yticks([0, 1], ["stock", "tuned"])
        names.append(
            _finish(
                plt,
                fig,
                ax,
                out_dir / "cycle_breakdown.png",
                "where the time goes",
                "ms per generated token",
            )
        )
    # Acceptance by draft position.
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in (("stock", outcome.stock), ("tuned", outcome.best)):
        ax.plot(range(1, len(r.acceptance) + 1), r.acceptance, marker="o", label=name)
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    names.append(
        _finish(plt, fig, ax, out_dir / "acceptance.png", "acceptance histogram", "draft position")
    )
    return names


def _finish(plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str) -> str:
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
