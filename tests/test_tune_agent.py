"""``tune --agent``: LLM agents behind an OpenAI-compatible endpoint, against a scripted server.

The server (``agent_server.py``) is a real HTTP server on loopback answering from a script: a
good proposal, garbage and malformed ones, a lossy one (a planted faulty mechanism that token
forcing must catch), refusals, errors, a timeout, an endpoint that is down. Loop tests use a
fake executor (instant, noise-free); the end-to-end ones run ``specpilot tune`` on the tiny
model, one against the scripted server and one against ``specpilot serve`` itself (whose tiny
random model answers junk).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import pytest

from agent_server import Reply, free_port, proposals, scripted
from specpilot.cli import main
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.agent_brief import BriefContext
from specpilot.tune.agent_client import AgentClient, AgentFailure, connect
from specpilot.tune.agent_parse import extract_json, parse_answer
from specpilot.tune.agent_team import MAX_FAILURES, AgentTeam
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.loop import TuneLoop, TuneSettings
from specpilot.tune.space import config_hash, directions_for
from test_cli import assert_one_line_error
from test_tune import FAULTY, tiny, tune_argv  # noqa: F401  (tiny is a fixture)

BASE = EngineConfig(deployment=DeploymentSpec(target="t", drafter="ngram"), k=4)
DIRS = directions_for(BASE, "cpu", "llama", num_layers=2)
BY_NAME = {d.name: d for d in DIRS}
NAMES = list(BY_NAME)
NOT_HERE = {"w12": "not for device cpu (it applies to cuda)"}


def parse(text: str, direction: str = "draft-length", n: int = 3, seen: Sequence[str] = ()):
    return parse_answer(text, BY_NAME[direction], NAMES, NOT_HERE, BASE, seen, n)


# ------------------------------------------------------------------------ reading an answer
def test_a_good_answer_in_prose_or_a_code_fence_is_read():
    body = (
        '{"proposals": [{"direction": "draft-length", "knobs": {"k": 8}, "hypothesis": "longer"}]}'
    )
    for text in (
        body,
        f"Sure! Here you go:\n```json\n{body}\n```\nGood luck.",
        f"Answer: {body} ok",
    ):
        got = parse(text)
        assert not got.rejected and len(got.accepted) == 1
        assert got.accepted[0].config.k == 8 and got.accepted[0].hypothesis == "longer"
    one = parse('{"knobs": {"k": 2}, "hypothesis": "short"}')  # one bare proposal
    assert one.accepted[0].config.k == 2
    top = parse('{"proposals": [{"k": 6, "hypothesis": "h"}]}')  # draft length as its own field
    assert top.accepted[0].config.k == 6
    mech = parse(
        '{"proposals": [{"mechanism": "tree-verify", "knobs": {"depth": 4}}]}',
        "mechanism:tree-verify",
    )
    assert mech.accepted[0].config.mechanisms["tree-verify"]["depth"] == 4


@pytest.mark.parametrize(
    "text,reason",
    [
        ("I'm sorry, I can't help with that.", "holds no JSON object"),
        ('{"proposals": [{"knobs": {"k": 8}', "does not parse"),
        ('{"ideas": "faster"}', 'not {"proposals"'),
        ('{"proposals": [7]}', "must be an object"),
        (
            '{"proposals": [{"direction": "warp-drive", "knobs": {}}]}',
            "unknown direction 'warp-drive'",
        ),
        (
            '{"proposals": [{"direction": "ngram-sizes", "knobs": {"max_n": 4}}]}',
            "works draft-length this round",
        ),
        (
            '{"proposals": [{"direction": "w12", "knobs": {}}]}',
            "w12 does not apply here: not for device cpu",
        ),
        ('{"proposals": [{"knobs": {"k": 99}}]}', "must be in [1, 16], got 99"),
        ('{"proposals": [{"knobs": {"k": "eight"}}]}', "must be a number"),
        ('{"proposals": [{"knobs": {"k": 2.5}}]}', "must be an integer"),
        ('{"proposals": [{"knobs": {"k": 8, "turbo": true}}]}', "no knob(s) turbo (it has: k)"),
        ('{"proposals": [{"knobs": {"k": 4}}]}', "the current best config itself"),
        ('{"proposals": [{"knobs": "fast"}]}', "knobs must be an object"),
        ('{"proposals": []}', "holds no proposal"),
    ],
)
def test_bad_answers_are_rejected_with_a_reason(text, reason):
    got = parse(text)
    assert not got.accepted and len(got.rejected) == 1 and reason in got.rejected[0], got.rejected


def test_repeats_and_proposals_beyond_the_count_are_rejected():
    seen = [config_hash(dataclasses.replace(BASE, k=8))]
    items = [{"knobs": {"k": v}} for v in (8, 2, 2, 3, 5)]
    got = parse(json.dumps({"proposals": items}), n=2, seen=seen)
    assert [a.config.k for a in got.accepted] == [2, 3]
    assert [r.split(": ", 1)[1] for r in got.rejected] == [
        "repeated, this config was already measured or proposed",
        "repeated, this config was already measured or proposed",
        "beyond the 2 proposals asked for",
    ]
    with pytest.raises(ValueError, match="holds no JSON"):
        extract_json("no braces here")


# ---------------------------------------------------------------------------- the endpoint
def test_an_unusable_endpoint_is_one_clear_error_before_anything_loads():
    t0 = time.perf_counter()
    with pytest.raises(SpecPilotError, match="Cannot reach the agent endpoint"):
        connect(f"http://127.0.0.1:{free_port()}/v1", None, 5.0, 64)
    assert time.perf_counter() - t0 < 5
    with (
        scripted([Reply("x")], key="right") as srv,
        pytest.raises(SpecPilotError, match="refused the key: set SPECPILOT_AGENT_KEY"),
    ):
        connect(srv.url, None, 5.0, 64)
    with (
        scripted([Reply("x")], models=()) as srv,
        pytest.raises(SpecPilotError, match="--agent-model"),
    ):
        connect(srv.url, None, 5.0, 64)


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPECPILOT_AGENT_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "openai-key")
    with scripted([Reply("hi")], key="openai-key", models=("m1", "m2")) as srv:
        assert connect(srv.url, None, 5.0, 64).model == "m1"  # the first listed
        monkeypatch.setenv("SPECPILOT_AGENT_KEY", "wrong")  # the project's variable wins
        with pytest.raises(SpecPilotError, match="refused the key"):
            connect(srv.url, "m2", 5.0, 64)


def test_every_failure_of_a_call_is_a_reason_not_an_exception():
    script = [
        Reply("fine", usage=(7, 3)),
        Reply("late", sleep=1.5),
        Reply("overloaded", status=503),
        Reply(raw=b"<html>502 Bad Gateway</html>"),
        Reply(refusal="I cannot help with kernels"),
        Reply(""),
    ]
    with scripted(script) as srv:
        client = AgentClient(srv.url, "scripted", 0.5, 64)
        got = [client.chat([{"role": "user", "content": "hi"}]) for _ in script]
    assert got[0].text == "fine" and (got[0].prompt_tokens, got[0].completion_tokens) == (7, 3)
    reasons = [g.reason for g in got[1:] if isinstance(g, AgentFailure)]
    assert len(reasons) == 5
    for r, want in zip(
        reasons,
        [
            "no answer within 0.5 s",
            "HTTP 503: overloaded",
            "unusable answer",
            "refused: I cannot help",
            "empty answer",
        ],
        strict=True,
    ):
        assert want in r, r


# ------------------------------------------------------------------------ the loop, faked
class FakeExecutor:
    """Instant, noise-free trials: speed grows with k; the faulty mechanism fails the gate."""

    width = 3
    ar_tok_s = 10.0

    def __init__(self, seconds: float = 0.0) -> None:
        self.configs: list[EngineConfig] = []
        self.seconds = seconds

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        out = []
        for c in configs:
            time.sleep(self.seconds)
            self.configs.append(c)
            ok = FAULTY.name not in c.mechanisms
            sp = 1.0 + 0.05 * c.k
            forcing = {} if ok else {"mismatches": 1, "first_mismatch": {"position": 3}}
            out.append(
                TrialResult(c, 10 * sp, sp, 2.0, [], ok, forcing, 0.0, 0.01, rounds=[sp] * 3)
            )
        return out

    def close(self) -> None:
        pass


def _team(client: AgentClient, directions, agents: int = 2, trials: int = 2) -> AgentTeam:
    ctx = BriefContext(
        "t on cpu (fp32, single); stock AR 10.0 tok/s",
        ("verify 3.10 ms/token (60%)",),
        (),
        NOT_HERE,
    )
    return AgentTeam(client, ctx, agents, directions, trials, log=print)


def _loop(tmp_path, team, directions, ex=None, **settings):
    s = TuneSettings(
        **(
            {
                "rounds": 2,
                "trials_per_direction": 2,
                "directions_per_round": 2,
                "explorer": "local",
                "min_gain": 0.0,
            }
            | settings
        )
    )
    store = MemoryStore(tmp_path / "m.sqlite")
    fp = Fingerprint("t", "ngram", "cpu", "", "", "x", "fp32", "single")
    loop = TuneLoop(
        BASE,
        directions,
        ex or FakeExecutor(),
        store,
        fp,
        "t",
        s,
        gap_order=("verify", "lm_head", "draft"),
        log=print,
        planner=team,
    )
    return loop, store


def test_agent_proposals_are_measured_and_gated_like_tpes(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(MECHANISMS, FAULTY.name, FAULTY)
    base = dataclasses.replace(BASE)
    dirs = [
        d
        for d in directions_for(base, "cpu", "llama", 2)
        if d.name in ("draft-length", f"mechanism:{FAULTY.name}")
    ]

    def script(body, direction):
        if direction == "draft-length":
            return proposals(
                {
                    "direction": "draft-length",
                    "knobs": {"k": 12},
                    "hypothesis": "long drafts pay on repeats",
                },
                {"direction": "draft-length", "knobs": {"k": 99}, "hypothesis": "garbage"},
            )
        return proposals(
            {"direction": f"mechanism:{FAULTY.name}", "knobs": {}, "hypothesis": "lossy"}
        )

    with scripted(script) as srv:
        team = _team(AgentClient(srv.url, "scripted", 5.0, 256), dirs)
        loop, store = _loop(tmp_path, team, dirs)
        out = loop.run()
        team.close()
        store.close()
    log = capsys.readouterr().out
    assert out.best.config.k >= 12  # the agent's good proposal won (and TPE may have gone on)
    assert any(r.config_hash == config_hash(dataclasses.replace(BASE, k=12)) for r in team.records)
    faulty = [t for t in out.trials if FAULTY.name in t.result.config.mechanisms]
    assert len(faulty) == 1 and not faulty[0].result.forcing_ok  # token forcing caught it, once
    assert f"mechanism:{FAULTY.name} quarantined" in log
    assert "rejected: " in log and "must be in [1, 16], got 99" in log
    # the second round's brief tells the agent why, and what was measured
    second = [
        json.dumps(b)
        for b in srv.requests
        if "Your direction this round: draft-length" in json.dumps(b)
    ]
    assert len(second) == 2 and "must be in [1, 16], got 99" in second[1]
    assert "REJECTED by token forcing (first mismatch at 3)" in second[1]
    assert "verify 3.10 ms/token (60%)" in second[0] and "Lossless:" in second[0]
    p = out.agent or team.price
    assert p.calls == len(srv.requests) >= 3 and p.failed_calls == 0
    assert (p.prompt_tokens, p.completion_tokens) == (100 * p.calls, 20 * p.calls)
    assert p.rejected >= 1 and p.measured >= 2 and p.wait_seconds > 0


def test_a_slow_agent_times_out_and_tpe_proposes(tmp_path, capsys):
    dirs = [BY_NAME["draft-length"], BY_NAME["ngram-sizes"]]
    with scripted([Reply(json.dumps({"proposals": [{"knobs": {"k": 9}}]}), sleep=3.0)]) as srv:
        team = _team(AgentClient(srv.url, "scripted", 0.3, 64), dirs)
        loop, store = _loop(tmp_path, team, dirs, rounds=1)
        t0 = time.perf_counter()
        out = loop.run()
        wall = time.perf_counter() - t0
        team.close()
        store.close()
    log = capsys.readouterr().out
    assert "no answer within" in log and "TPE proposes for draft-length" in log
    assert wall < 2.5  # the search did not wait for the slow answer
    assert len([t for t in out.trials if t.round == 1]) >= 2  # TPE's proposals ran instead
    assert not team.records


def test_a_bad_agent_stands_down_and_the_search_goes_on(tmp_path, capsys):
    dirs = [BY_NAME["draft-length"], BY_NAME["ngram-sizes"]]
    team = _team(AgentClient(f"http://127.0.0.1:{free_port()}/v1", "gone", 2.0, 64), dirs)
    loop, store = _loop(tmp_path, team, dirs, rounds=4, patience=9)
    out = loop.run()
    team.close()
    store.close()
    log = capsys.readouterr().out
    assert "cannot reach the endpoint" in log
    assert team.stood_down is not None and f"{MAX_FAILURES * 2} agent calls in a row" in log
    # two agents, so six failed calls in a row, then none
    assert team.price.calls == 2 * MAX_FAILURES < 2 * out.rounds_run
    assert out.rounds_run >= 3 and len(out.trials) > 4


def test_the_budget_holds_while_agents_answer_slowly(tmp_path):
    dirs = [BY_NAME["draft-length"], BY_NAME["ngram-sizes"]]
    with scripted([Reply(json.dumps({"proposals": [{"knobs": {"k": 9}}]}), sleep=0.4)]) as srv:
        team = _team(AgentClient(srv.url, "scripted", 30.0, 64), dirs)
        loop, store = _loop(
            tmp_path, team, dirs, FakeExecutor(0.05), rounds=50, budget_seconds=1.5, patience=99
        )
        t0 = time.perf_counter()
        loop.run()
        assert time.perf_counter() - t0 < 1.5 + 0.5
        team.close()
        store.close()


# ---------------------------------------------------------------------------- end to end
def test_tune_checks_the_agent_options_before_loading(tiny, tmp_path, capsys):  # noqa: F811
    model, prompts = tiny
    argv = tune_argv(model, prompts, tmp_path / "o", tmp_path / "m.sqlite")
    for extra, want in (
        (["--agents", "2"], "--agents need --agent URL"),
        (["--kernel-agent", "1"], "--kernel-agent need --agent URL"),
        (["--agent", "localhost:8000"], "must be an http(s) URL"),
        (["--agent", "http://x/v1", "--agent-timeout", "0"], "--agent-timeout must be more than 0"),
        (["--agent", f"http://127.0.0.1:{free_port()}/v1"], "Cannot reach the agent endpoint"),
    ):
        code = main([*argv, *extra])
        assert_one_line_error(code, capsys.readouterr().err, want)
    assert not (tmp_path / "o").exists()


def _e2e_argv(model, prompts, tmp_path, url, *extra):
    return tune_argv(
        model, prompts, tmp_path / "out", tmp_path / "m.sqlite",
        "--agent", url, "--agents", "2", "--rank-gaps", "static", "--compare-limit", "0",
        "--measure-rounds", "2", "--max-new-tokens", "16", *extra,
    )  # fmt: skip


def test_tune_with_scripted_agents_end_to_end(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    model, prompts = tiny
    monkeypatch.setitem(MECHANISMS, FAULTY.name, FAULTY)

    def script(body, direction):
        replies = {
            "draft-length": proposals({"knobs": {"k": 3}, "hypothesis": "one more draft token"}),
            "ngram-sizes": Reply('{"proposals": [{"knobs": {"max_n": 4,}]'),  # malformed
            "early-exit-drafter": Reply("late", sleep=5.0),  # past the timeout
            "spec-gate": proposals({"knobs": {"margin": -3, "off_tokens": 7}}),  # garbage knobs
            "mechanism:tree-verify": Reply("As an AI model I cannot tune decoders."),
            "mechanism:exact-argmax": Reply("overloaded", status=500),
        }
        lossy = proposals({"direction": direction, "knobs": {}, "hypothesis": "a lossy head"})
        return replies.get(direction, lossy)

    with scripted(script) as srv:
        extra = ["--directions", "8", "--agents", "8", "--agent-timeout", "2"]
        argv = _e2e_argv(model, prompts, tmp_path, srv.url, *extra)
        assert main(argv) == 0
    log = capsys.readouterr().out
    assert "agents: 8 x scripted at" in log
    assert "REJECTED by token forcing" in log and f"+{FAULTY.name}" in log
    for why in (
        "does not parse",
        "no answer within 2 s",
        "must be in [0.0, 0.3], got -3",
        "holds no JSON object",
        "HTTP 500: overloaded",
    ):
        assert why in log, why
    assert "standing down" not in log
    tuned = json.loads((tmp_path / "out" / "tuned.json").read_text())
    assert FAULTY.name not in tuned["mechanisms"]
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    agent = run["search"]["agent"]
    assert agent["model"] == "scripted" and agent["calls"] >= 3
    assert agent["prompt_tokens"] == 100 * (
        agent["calls"] - agent["failed_calls"] - agent["calls_without_usage"]
    )
    assert run["search"]["device_seconds"] > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- Agents: agent scripted at" in report and "Break-even counting the" in report
    assert (
        "## Agent proposals" in report
        and "one more draft token" in report
        and "a lossy head" in report
    )


def test_tune_against_specpilot_serve_survives_junk_answers(tiny, tmp_path, capsys):  # noqa: F811
    """The tiny random model behind ``specpilot serve`` answers junk: every answer is rejected
    with a reason, TPE searches, the tune finishes and prices the calls."""
    from specpilot.commands.serve import build_app
    from test_serve import RunningServer, serve_args

    model, prompts = tiny
    app = build_app(serve_args(model, "--default-max-tokens", "16"))
    with RunningServer(app, free_port()) as srv:
        argv = _e2e_argv(
            model, prompts, tmp_path, srv.url + "/v1", "--agent-max-tokens", "16", "--rounds", "1"
        )
        assert main(argv) == 0
    log = capsys.readouterr().out
    assert "[agent:" in log and "the answer holds no JSON object" in log
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    agent = run["search"]["agent"]
    assert agent["calls"] >= 1 and agent["measured"] == 0
    assert (tmp_path / "out" / "tuned.json").exists()


@pytest.mark.slow
def test_tune_with_smollm2_behind_specpilot_serve_as_the_agent(tiny, tmp_path, capsys):  # noqa: F811
    """A real (small) model as the agent: SmolLM2-135M served by ``specpilot serve``. Its
    answers are not usable proposals; each is rejected with a reason and the tune goes on."""
    from specpilot.cli import build_parser
    from specpilot.commands.serve import build_app
    from test_serve import RunningServer

    model, prompts = tiny
    args = build_parser().parse_args(["serve", "--target", "smollm2-135m", "--device", "cpu"])
    with RunningServer(build_app(args), free_port()) as srv:
        extra = ["--agent-max-tokens", "48", "--rounds", "1", "--agents", "1"]
        argv = _e2e_argv(model, prompts, tmp_path, srv.url + "/v1", *extra)
        assert main(argv) == 0
    log = capsys.readouterr().out
    assert "agents: 1 x smollm2-135m" in log and "[agent:" in log
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    agent = run["search"]["agent"]
    assert agent["calls"] >= 1 and agent["prompt_tokens"] > 300 and agent["wait_seconds"] > 0
    assert agent["measured"] <= agent["proposals"] - agent["rejected"]  # only validated ones ran
