"""AR windows with a lookahead step (``engine/cycles.ar_window(lookahead=True)``): the next
window's first step is queued behind the read-back, so a row's device state runs one step past
the host mirror between scheduler steps (``Engine.ahead``).

Every request must still equal its single-request AR output token for token (fp32): rows that
join (their prefill lands behind the step ahead), leave by EOS, by length or by a cancel while a
step ahead is queued, one row (the eager path writes K/V by a host-known slice: its offset must
count the step ahead), windows of 1 to 5 steps, segments, and emulated CUDA graphs (buckets).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from conftest import tiny_config, tiny_model
from engine_cases import make_requests, single_ar
from specpilot.engine import Engine, Request, Scheduler
from test_graphs import emulated_graphs, guarded  # noqa: F401  (fixtures)


def _drive(
    sched: Scheduler, reqs: list[Request], rng: random.Random, cancel: str | None
) -> tuple[dict[str, list[int]], int, str | None]:
    """Arrivals at random steps, one cancellation; the tokens per request, the steps that left
    a step ahead queued, and the cancelled request's id if it was cut."""
    pending, got, ahead_steps, cut = list(reqs), {}, 0, None
    step = 0
    while pending or sched.has_work:
        while pending and rng.random() < 0.5:
            sched.submit(pending.pop(0))
        if step == 5 and cancel is not None:
            res = sched.cancel(cancel)
            if res is not None and res.stop_reason == "cancelled":
                got[cancel], cut = res.tokens, cancel
        for res in sched.step().finished:
            got[res.id] = res.tokens
        ahead_steps += bool(sched.engine.ahead)
        step += 1
        assert step < 3000, "the scheduler made no progress"
    return got, ahead_steps, cut


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("slots", "sync_every", "window", "segment"),
    [(1, 1, None, None), (1, 4, 3, 8), (3, 1, None, 6), (3, 5, None, None), (4, 4, 2, 16)],
)
def test_lookahead_equals_single_ar(
    seed: int, slots: int, sync_every: int, window: int | None, segment: int | None
) -> None:
    rng = random.Random(f"lookahead/{seed}/{slots}/{sync_every}")
    target = tiny_model(tiny_config(vocab=73), seed)
    reqs = make_requests(rng, target.cfg.vocab_size, 8, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    engine = Engine(target, sync_every=sync_every)
    sched = Scheduler(
        engine, slots=slots, segment_tokens=segment, max_context=120, window=window, lookahead=True
    )
    got, ahead_steps, cut = _drive(sched, reqs, rng, reqs[2].id)
    for rid, toks in got.items():
        assert toks == (want[rid][: len(toks)] if rid == cut else want[rid]), rid
    assert set(got) == set(want)
    assert ahead_steps > 0, "no window left a step ahead"
    assert not engine.ahead or sched.running == 0


def test_lookahead_off_keeps_the_mirror_exact() -> None:
    target = tiny_model(tiny_config(vocab=73), 0)
    reqs = make_requests(random.Random(0), target.cfg.vocab_size, 4, target)
    sched = Scheduler(Engine(target, sync_every=3), slots=2, max_context=120)
    got, ahead_steps, _ = _drive(sched, reqs, random.Random(1), None)
    assert ahead_steps == 0
    assert got == {r.id: single_ar(target, r) for r in reqs}


def test_lookahead_on_emulated_graphs(emulated_graphs: Callable[[Engine], None]) -> None:  # noqa: F811
    """Graph semantics (attention buckets, steps replayed from their first recording)."""
    rng = random.Random(5)
    target = tiny_model(tiny_config(vocab=73), 5)
    reqs = make_requests(rng, target.cfg.vocab_size, 8, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    engine = Engine(target, sync_every=4)
    emulated_graphs(engine)
    sched = Scheduler(engine, slots=3, max_context=120, window=4, lookahead=True)
    got, ahead_steps, _ = _drive(sched, reqs, rng, None)
    assert got == want and ahead_steps > 0


def test_decode_steps_cover_only_the_rows_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone request in a 4-row scheduler decodes in one-row forwards; with rows 0..2 in use
    the steps cover the first 4 (a power of two); tokens equal single AR either way."""
    from specpilot.models.forward import Forward

    target = tiny_model(tiny_config(vocab=73), 1)
    rng = random.Random(4)
    reqs = make_requests(rng, target.cfg.vocab_size, 3)
    reqs = [Request(r.id, r.prompt_ids, 30, frozenset()) for r in reqs]
    real, rows_seen = Forward.run_layers, []

    def run_layers(self: Forward, x: object, cache: object, lay: object, *a: object) -> object:
        if lay.width == 1:  # type: ignore[attr-defined]  # an AR step (prompts here are longer)
            rows_seen.append(lay.batch)  # type: ignore[attr-defined]
        return real(self, x, cache, lay, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Forward, "run_layers", run_layers)
    for look in (False, True):
        engine = Engine(target, sync_every=4)
        sched = Scheduler(engine, slots=4, max_context=120, window=4, lookahead=look)
        rows_seen.clear()
        assert {r.id: r.tokens for r in sched.run(reqs[:1])} == {"r0": single_ar(target, reqs[0])}
        assert rows_seen and set(rows_seen) == {1}
        rows_seen.clear()
        got = {r.id: r.tokens for r in sched.run(reqs)}
        assert got == {r.id: single_ar(target, r) for r in reqs}
        assert 4 in rows_seen
