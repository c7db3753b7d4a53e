"""What a run of ``specpilot tune --executor ray`` left, checked and compared (issue 17;
``bench/ray_scaling.py`` runs the tunes): its trials from the memory, whether a run measured every
config exactly once, the spread of a config's speedup, whether two runs' bests agree, and the
speedup the loop's order allows N workers."""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
from pathlib import Path
from typing import Any


def read_run(run_dir: Path) -> dict[str, Any]:
    """What the run left: run.json's search usage, every trial in its memory, its best config."""
    from specpilot.engine.config import EngineConfig
    from specpilot.tune.space import config_hash, describe

    out: dict[str, Any] = {"search": None, "trials": [], "best": None}
    run_json, tuned = run_dir / "run.json", run_dir / "tuned.json"
    if run_json.is_file():
        out["search"] = json.loads(run_json.read_text()).get("search")
    db_path = run_dir / "memory.sqlite"
    if db_path.is_file():
        db = sqlite3.connect(db_path)
        rows = db.execute(
            "SELECT round, explorer, config_hash, config, metrics FROM trials "
            "WHERE run = (SELECT max(id) FROM runs) ORDER BY id"
        ).fetchall()
        db.close()
        for round_, explorer, h, cfg, metrics in rows:
            m = json.loads(metrics)
            out["trials"].append(
                {
                    "round": round_,
                    "explorer": explorer,
                    "hash": h,
                    "config": describe(EngineConfig.from_dict(json.loads(cfg))),
                    "speedup_rounds": m.get("speedup_rounds") or [m.get("speedup", 0.0)],
                    "busy_seconds": m.get("busy_seconds", 0.0),
                    "worker": m.get("worker"),
                    "error": m.get("error"),
                }
            )
    if tuned.is_file():
        out["best"] = config_hash(EngineConfig.load(tuned))
    return out


def correctness(rec: dict[str, Any], reference: set[str] | None) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    bad = []
    hashes = [t["hash"] for t in rec["trials"]]
    if rec["rc"] != 0:
        bad.append(f"exit status {rec['rc']}")
    if not hashes:
        bad.append("no trial in its memory")
    if len(set(hashes)) != len(hashes):
        bad.append("a trial recorded twice")
    returned = sum(w["trials"] for w in (rec["search"] or {}).get("per_worker", {}).values())
    if rec["search"] is None or returned != len(hashes):
        bad.append(f"workers returned {returned} results, memory holds {len(hashes)}")
    failed = [t["config"] for t in rec["trials"] if t["error"]]
    if failed:
        bad.append(f"failed trials: {failed}")
    if reference is not None and set(hashes) != reference:
        bad.append(f"measured other configs than the first run ({len(set(hashes) ^ reference)})")
    return bad


def spread(rec: dict[str, Any], h: str | None) -> tuple[float, float, float] | None:
    """(lowest, median, highest) per-round speedup of config ``h`` in run ``rec``."""
    for t in rec["trials"]:
        if t["hash"] == h:
            v = t["speedup_rounds"]
            return min(v), statistics.median(v), max(v)
    return None


def agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``same``, ``within noise`` (each best within the other's range, measured in one run) or
    ``differ``."""
    if a["best"] == b["best"]:
        return "same"
    for run in (a, b):
        x, y = spread(run, a["best"]), spread(run, b["best"])
        if x is None or y is None or x[0] > y[2] or y[0] > x[2]:
            return "differ"
    return "within noise"


def schedule_bound(one: dict[str, Any], n: int) -> float:
    """Speedup the loop's order allows N workers, with the 1-worker run's per-trial seconds:
    each round's trials of every direction are one queue (round 1's led by the stock trial,
    unless a warm start ran in round 0), dealt in the order the loop sent them to the first free
    of N workers; a round's stacked (``integrate``) trial waits for its queue and runs alone;
    queues one after another (a round's decisions need all of its trials)."""
    warm = any(t["round"] == 0 and t["explorer"] == "memory" for t in one["trials"])
    batches: dict[tuple[int, str], list[float]] = {}
    for i, t in enumerate(one["trials"]):
        round_ = 1 if t["round"] == 0 and not warm else t["round"]
        if round_ == 0 or t["explorer"] in ("integrate", "confirm"):
            key = (round_, f"{t['explorer']}-{i}")  # alone
        else:
            key = (round_, "queue")
        batches.setdefault(key, []).append(t["busy_seconds"])
    total = makespan = 0.0
    for seconds in batches.values():
        free = [0.0] * n
        for s in seconds:
            i = free.index(min(free))
            free[i] += s
        total, makespan = total + sum(seconds), makespan + max(free)
    return total / makespan if makespan > 0 else 0.0


def wave_cap(n: int, queued: int, stacked: int) -> float:
    """The same bound with equal trials: ``queued`` trials in round 1's queue (the stock one
    included) take ceil(queued / n) waves, and each of ``stacked`` stacked trials one more."""
    return (queued + stacked) / (math.ceil(queued / n) + stacked) if queued else 0.0


def default_trials(n: int, directions: int) -> int:
    """The fewest trials per direction, at least ``n``, whose round 1 (with the stock trial)
    allows 0.8 N with equal trials and no stacked trial (``--trials N`` allows (3N + 1) / 4)."""
    t = n
    while wave_cap(n, directions * t + 1, 0) < 0.8 * n:
        t += 1
    return t


def summarize(
    n: int, records: list[dict[str, Any]], setting: str, trials: int | None
) -> dict[str, Any]:
    """The 1-worker and N-worker arms of ``records`` (one per tune run), their checks, the
    speedup against its target (0.8 N) and its bounds, and the kill drill's outcome."""
    reference = {t["hash"] for t in records[0]["trials"]}
    checks = {r["name"]: correctness(r, reference) for r in records}
    arms: dict[int, dict[str, Any]] = {}
    for w in (1, n):
        runs = [r for r in records if r["workers"] == w and not r["kill"]]
        search = [r["search"]["wall_seconds"] for r in runs if r["search"]]
        whole = [r["command_wall_s"] for r in runs]
        arms[w] = {
            "runs": len(runs),
            "search_wall_s": search,
            "command_wall_s": whole,
            "median_search_s": statistics.median(search) if search else None,
            "median_command_s": statistics.median(whole) if whole else None,
            "device_seconds": [r["search"]["device_seconds"] for r in runs if r["search"]],
            "trials": [len(r["trials"]) for r in runs],
            "best": [r["best"] for r in runs],
        }
    one, many = arms[1], arms[n]
    speedup = (
        one["median_search_s"] / many["median_search_s"]
        if one["median_search_s"] and many["median_search_s"]
        else None
    )
    first = {w: next(r for r in records if r["workers"] == w and not r["kill"]) for w in (1, n)}
    kill = next((r for r in records if r["kill"]), None)
    out = {
        "setting": setting,
        "workers": n,
        "trials_per_direction": trials,
        "correct": all(not v for v in checks.values()),
        "checks": checks,
        "arms": arms,
        "speedup_search": speedup,
        "speedup_command": (
            one["median_command_s"] / many["median_command_s"] if many["median_command_s"] else None
        ),
        "target": 0.8 * n,
        "met": speedup is not None and speedup >= 0.8 * n,
        "schedule_bound": schedule_bound(first[1], n),
        "wave_cap": wave_cap(n, *round_one(first[1])),
        "best_agree": agreement(first[1], first[n]),
        "best_config": {w: describe_best(first[w]) for w in (1, n)},
        "kill": None
        if kill is None
        else {
            "killed": kill["killed"],
            "rc": kill["rc"],
            "died_mid_trial": kill["died_mid_trial"],
            "resent": kill["resent"],
            "nothing_lost": not checks[kill["name"]],
        },
    }
    return out


def round_one(rec: dict[str, Any]) -> tuple[int, int]:
    """(trials in round 1's queue, the stock one included; stacked trials) of a run."""
    queued = sum(t["round"] in (0, 1) and t["explorer"] != "integrate" for t in rec["trials"])
    return queued, sum(t["explorer"] == "integrate" for t in rec["trials"])


def describe_best(rec: dict[str, Any]) -> str:
    s = spread(rec, rec["best"])
    name = next((t["config"] for t in rec["trials"] if t["hash"] == rec["best"]), "?")
    return name + (f" {s[1]:.2f}x ({s[0]:.2f}-{s[2]:.2f})" if s else "")


def print_table(out: dict[str, Any], n: int) -> None:
    print(f"\n{out['setting']}; {n} workers; {out['trials_per_direction']} trials per direction")
    for name, bad in out["checks"].items():
        print(f"  check {name}: {'ok' if not bad else '; '.join(bad)}")
    print(
        f"{'arm':<10} {'runs':>4} {'search s':>9} {'command s':>10} {'device-s':>9} {'trials':>6}"
    )
    for w, a in out["arms"].items():
        dev = statistics.median(a["device_seconds"]) if a["device_seconds"] else 0.0
        rng = f"{min(a['search_wall_s']):.0f}-{max(a['search_wall_s']):.0f}" if a["runs"] else "-"
        print(
            f"{f'{w} worker' + ('s' if w > 1 else ''):<10} {a['runs']:>4} "
            f"{a['median_search_s'] or 0:>9.1f} {a['median_command_s'] or 0:>10.1f} "
            f"{dev:>9.1f} {','.join(map(str, a['trials'])):>6}  (search {rng} s)"
        )
    sp = out["speedup_search"] or 0.0
    print(
        f"speedup (search wall): {sp:.2f}x, target >= {out['target']:.1f}x: "
        f"{'MET' if out['met'] else 'MISSED'}; the loop's order allows {out['schedule_bound']:.2f}x "
        f"(equal trials: {out['wave_cap']:.2f}x); whole command {out['speedup_command'] or 0:.2f}x"
    )
    print(f"best configs: {out['best_agree']} ({out['best_config']})")
    k = out["kill"]
    if k is not None:
        print(
            f"kill drill: {k['killed']}; exit {k['rc']}; died mid-trial {k['died_mid_trial']}; "
            f"trial re-sent {k['resent']}; nothing lost {k['nothing_lost']}"
        )
    print(f"correct: {out['correct']}")
