"""Trials on a Ray cluster: one evaluator actor per GPU, each trial handed to whichever actor is
idle, and a trial whose worker dies handed to another.

Placement: a CUDA deployment gets one actor per GPU (``num_gpus=1``; ``--workers`` may ask for
fewer), a CPU deployment ``--workers`` actors of one CPU each. Each actor builds its
:class:`Evaluator` once (loads the target, measures its own AR baseline) and reuses it for every
trial; a speedup stays a ratio measured in one process.

Dispatch: a trial goes to an actor as soon as one is idle (``ray.wait`` on what is in flight), so
a slow trial holds only its own worker; the loop's ``admit`` is asked before each new trial
starts (the time budget), and each result is passed on as it arrives.

Failures: an actor whose process dies (a crash, an OOM kill, ``kill -9``) is restarted by Ray
(``max_restarts``; its constructor loads the target again). The trial it was running is sent
again by the driver, to the next idle live actor, at most ``attempts`` times in all; Ray's own
task retries stay off (``max_task_retries=0``), so nothing is re-run but by that rule. A trial
lost on every attempt comes back as a failed result that names each death: recorded and
reported, never dropped. An actor that does not come back (no restart left, or not back within
``restart_timeout_s``) leaves the pool; with none left, :class:`WorkersLostError` says so (every
finished trial has been passed on by then, so ``tune --resume`` goes on from them).

One writer: an actor holds no memory store, nor its path; it returns :class:`TrialResult` objects
and the loop, in the driver, writes them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.runtime import parse_device
from specpilot.tune.evaluate import TrialResult, failed_trial
from specpilot.tune.evaluate_batched import BatchedStream
from specpilot.tune.ray_actor import EvalActor
from specpilot.tune.space import describe
from specpilot.tune.usage import Usage

MAX_RESTARTS = 1
"""Times Ray restarts a dead actor (each restart loads the target again)."""
ATTEMPTS = 2
"""Most times one trial is started: once, and once more after its worker died."""
RESTART_TIMEOUT_S = 900.0
"""An actor not back this long after its death is dropped (loading an 8B target takes ~1 min)."""
WAIT_S = 5.0
"""How often the dispatcher looks at restarting actors while it waits for results."""


class WorkersLostError(SpecPilotError):
    """Every worker of the pool died for good."""


def placement(device: str, resources: dict[str, float], workers: int | None) -> tuple[int, str]:
    """(actors, resource each holds) for a deployment on ``device`` and a cluster's resources."""
    if workers is not None and workers < 1:
        raise SpecPilotError(f"--workers must be at least 1, got {workers}.")
    if device == "cuda":
        gpus = int(resources.get("GPU", 0))
        if gpus == 0:
            raise SpecPilotError(
                "--executor ray on CUDA needs GPUs in the Ray cluster, and it has none: "
                "start the cluster on the GPU machine, or tune with --device cpu."
            )
        n = workers or gpus
        if n > gpus:
            raise SpecPilotError(
                f"--workers {n} asks for one GPU each, but the Ray cluster has {gpus}: "
                f"ask for at most {gpus}."
            )
        return n, "num_gpus"
    cpus = int(resources.get("CPU", 0))
    n = workers or 1
    if n > cpus:
        raise SpecPilotError(
            f"--workers {n} asks for one CPU each, but the Ray cluster has {cpus}: "
            f"ask for at most {cpus}."
        )
    return n, "num_cpus"


@dataclass(slots=True)
class _Worker:
    name: str
    actor: Any
    pid: int
    state: str = "idle"
    """``idle``, ``busy`` (a trial in flight), ``restarting`` (a ping in flight) or ``lost``."""
    since: float = 0.0
    """When its trial started, when it died, or when it fell idle."""
    death: str = ""
    """How it last died."""


class RayExecutor:
    """Spread trials over a Ray cluster (``address=None`` starts a local one)."""

    shares_rounds = False
    """Each trial has its own AR rounds on its own worker (no head-to-head chunk)."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        address: str | None = None,
        workers: int | None = None,
        stream: BatchedStream | None = None,
        graphs: bool | None = None,
        rounds: int = 3,
        progress: Callable[[str], None] | None = None,
        max_restarts: int = MAX_RESTARTS,
        attempts: int = ATTEMPTS,
        restart_timeout_s: float = RESTART_TIMEOUT_S,
        actor_cls: type | None = None,
    ) -> None:
        """``actor_cls``: the actor class (default :class:`EvalActor`; tests pass a subclass)."""
        import ray as ray_module

        ray: Any = ray_module  # its typed overloads do not take options built at run time
        device = parse_device(base.deployment.device)
        if device.type == "cuda" and device.index not in (None, 0):
            raise SpecPilotError(
                f"--executor ray gives each worker a GPU of its own: use --device cuda, not "
                f"{base.deployment.device}."
            )
        self._ray, self._progress = ray, progress
        self._owns_cluster = not ray.is_initialized()
        if self._owns_cluster:
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
        self.attempts, self.restart_timeout_s = attempts, restart_timeout_s
        self._workers: list[_Worker] = []
        self._flight: dict[Any, tuple[_Worker, int | None]] = {}
        """What is in flight: a trial (its index in the current ``stream`` call) or a ping."""
        try:
            n, resource = placement(device.type, ray.cluster_resources(), workers)
            remote = ray.remote(max_restarts=max_restarts, max_task_retries=0, **{resource: 1})(
                actor_cls or EvalActor
            )
            each = "one GPU each" if resource == "num_gpus" else "one CPU each"
            self._say(f"starting {n} Ray workers ({each}); each loads the target and measures AR")
            given = (base, list(prompts), max_new_tokens, stream, graphs, rounds)
            actors = [(f"w{i}", remote.remote(f"w{i}", *given)) for i in range(n)]
            ready = self._start(actors)
        except BaseException:
            self.close()
            raise
        self.ar_tok_s = sum(i["ar_tok_s"] for i in ready) / len(ready)
        self.arch, self.num_layers = str(ready[0]["arch"]), int(ready[0]["num_layers"])
        self.usage = Usage.of("ray", device.type, [w.name for w in self._workers])

    def _start(self, actors: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        """Wait for every actor to load its target; keep those that did (none: an error)."""
        ray, ready, failures = self._ray, [], []
        for name, actor in actors:
            try:
                info = ray.get(actor.ready.remote(), timeout=self.restart_timeout_s)
            except ray.exceptions.RayError as e:
                failures.append(f"{name}: {_short(e)}")
                self._say(f"worker {name} did not start: {_short(e)}")
                ray.kill(actor, no_restart=True)
                continue
            self._workers.append(_Worker(name, actor, int(info["pid"])))
            ready.append(info)
            self._say(f"worker {name} ready (pid {info['pid']}): AR {info['ar_tok_s']:.1f} tok/s")
        if not self._workers:
            raise SpecPilotError(
                f"No Ray worker started ({'; '.join(failures)}): the workers' logs are under "
                "Ray's session_latest/logs."
            )
        return ready

    # ------------------------------------------------------------------ the executor
    @property
    def width(self) -> int:
        """Live workers (what a caller of ``map`` may send at once to keep every one busy)."""
        return len(self._live())

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        return self.stream(configs)

    def stream(
        self,
        configs: Sequence[EngineConfig],
        admit: Callable[[], bool] | None = None,
        on_result: Callable[[TrialResult], None] | None = None,
    ) -> list[TrialResult]:
        """Results of the configs that ran, in the order given (``StreamingExecutor``)."""
        return _Dispatch(self, configs, admit, on_result).run()

    def pids(self) -> dict[str, int]:
        """Process id of every live worker, by name (to kill one in a drill)."""
        return {w.name: w.pid for w in self._workers if w.state != "lost"}

    def close(self) -> None:
        for w in self._workers:
            self._ray.kill(w.actor, no_restart=True)
        self._workers, self._flight = [], {}
        if self._owns_cluster:
            self._ray.shutdown()

    # ------------------------------------------------------------------ workers
    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(f"  [ray] {message}")

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w.state != "lost"]

    def _died(self, w: _Worker, error: BaseException) -> None:
        """A worker's process died: count it, and ask whether Ray brings it back (the ping is
        answered once the restarted actor has loaded its target)."""
        w.state, w.since, w.death = "restarting", time.perf_counter(), _death(error)
        self.usage.workers[w.name].deaths += 1
        self._flight[w.actor.ready.remote()] = (w, None)

    def _ping_failed(self, w: _Worker, error: BaseException) -> None:
        """The ping of a restarting worker failed: dead for good, or not back yet (ask again;
        ``_overdue`` gives up on it)."""
        if isinstance(error, self._ray.exceptions.ActorDiedError):
            self._lose(w, w.death)
        else:
            self._flight[w.actor.ready.remote()] = (w, None)

    def _back(self, w: _Worker, info: dict[str, Any]) -> None:
        pid = int(info["pid"])
        how = f"pid {w.pid} -> {pid}" if pid != w.pid else "the same process"
        self._say(f"worker {w.name} restarted ({how}; target loaded again)")
        self.usage.workers[w.name].restarts += 1
        w.state, w.pid, w.since = "idle", pid, time.perf_counter()

    def _lose(self, w: _Worker, why: str) -> None:
        w.state = "lost"
        self.usage.workers[w.name].lost = True
        self._ray.kill(w.actor, no_restart=True)
        self._say(f"worker {w.name} lost for good ({why}): {len(self._live())} workers left")

    def _overdue(self) -> None:
        """Drop restarting workers that are not back within the restart timeout."""
        now = time.perf_counter()
        for ref, (w, i) in list(self._flight.items()):
            if i is None and now - w.since > self.restart_timeout_s:
                del self._flight[ref]
                self._lose(w, f"not back {self.restart_timeout_s:.0f}s after it died")

    def _pool_lost(self, left: int) -> WorkersLostError:
        deaths = "; ".join(f"{w.name}: {w.death or 'did not come back'}" for w in self._workers)
        return WorkersLostError(
            f"Every Ray worker died for good ({deaths}); {left} trials were not run. Every "
            "finished trial is in the memory: fix the cause (the workers' logs are under Ray's "
            "session_latest/logs) and continue with the same command and --resume."
        )


class _Dispatch:
    """One ``stream`` call: a queue of trials, their attempts, and the results so far."""

    def __init__(
        self,
        ex: RayExecutor,
        configs: Sequence[EngineConfig],
        admit: Callable[[], bool] | None,
        on_result: Callable[[TrialResult], None] | None,
    ) -> None:
        self.ex, self.configs, self.admit, self.on_result = ex, list(configs), admit, on_result
        self.queue: deque[int] = deque(range(len(self.configs)))
        """Trials to start: retries first (they were started once), then new ones in order."""
        self.tries = [0] * len(self.configs)
        self.deaths: list[list[str]] = [[] for _ in self.configs]
        self.spent = [0.0] * len(self.configs)
        self.results: dict[int, TrialResult] = {}
        self.admitting = True

    def run(self) -> list[TrialResult]:
        ex = self.ex
        while True:
            self.dispatch()
            trials_flying = any(i is not None for _, i in ex._flight.values())
            if not self.queue and not trials_flying:
                return [self.results[i] for i in sorted(self.results)]
            if not ex._flight:  # work left and no worker alive to take it
                raise ex._pool_lost(len(self.queue))
            self.collect()

    def next_trial(self) -> int | None:
        while self.queue:
            i = self.queue[0]
            if self.tries[i] == 0 and self.admitting and self.admit is not None:
                self.admitting = self.admit()
            if self.tries[i] == 0 and not self.admitting:  # no new trial from now on
                self.queue = deque(j for j in self.queue if self.tries[j] > 0)
                continue
            return self.queue.popleft()
        return None

    def dispatch(self) -> None:
        # The longest idle first: trials spread over the workers even when fewer than they.
        idle = sorted((w for w in self.ex._workers if w.state == "idle"), key=lambda w: w.since)
        for w in idle:
            i = self.next_trial()
            if i is None:
                return
            self.tries[i] += 1
            w.state, w.since = "busy", time.perf_counter()
            self.ex._flight[w.actor.evaluate.remote(self.configs[i])] = (w, i)

    def collect(self) -> None:
        """Wait for the next thing in flight to come back, and act on it."""
        ex, ray = self.ex, self.ex._ray
        ready, _ = ray.wait(list(ex._flight), num_returns=1, timeout=WAIT_S)
        if not ready:
            ex._overdue()
            return
        w, i = ex._flight.pop(ready[0])
        try:
            value = ray.get(ready[0])
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
            if i is None:
                ex._ping_failed(w, e)
            else:
                self.trial_died(w, i, e)
            return
        except ray.exceptions.RayTaskError as e:  # raised in a live worker: a failed trial
            if i is None:
                ex._lose(w, f"it came back but cannot say so: {_short(e)}")
                return
            self.spent[i] += self.held(w)
            w.state, w.since = "idle", time.perf_counter()
            cause = _short(e.cause if e.cause is not None else e)
            ex._say(f"{describe(self.configs[i])} raised on worker {w.name}: {cause}")
            self.finish(i, failed_trial(self.configs[i], cause, self.spent[i], w.name))
            return
        if i is None:
            ex._back(w, value)
            return
        w.state, w.since = "idle", time.perf_counter()
        self.finish(i, value)

    def held(self, w: _Worker) -> float:
        """Seconds since ``w`` started its trial, counted busy (held, though nothing came of
        them; a result that comes back brings its own busy seconds instead)."""
        lasted = time.perf_counter() - w.since
        self.ex.usage.workers[w.name].busy_seconds += lasted
        return lasted

    def trial_died(self, w: _Worker, i: int, error: BaseException) -> None:
        ex, cfg = self.ex, self.configs[i]
        lasted = self.held(w)
        self.spent[i] += lasted
        death = f"worker {w.name} (pid {w.pid}) died after {lasted:.0f}s: {_death(error)}"
        self.deaths[i].append(death)
        ex._say(f"{death}, during {describe(cfg)}")
        ex._died(w, error)
        if self.tries[i] < ex.attempts:
            self.queue.appendleft(i)
            ex._say(
                f"{describe(cfg)} goes to the next free worker "
                f"(attempt {self.tries[i] + 1}/{ex.attempts})"
            )
            return
        why = f"lost on all {self.tries[i]} attempts: " + "; ".join(self.deaths[i])
        ex._say(f"{describe(cfg)} failed: {why}")
        self.finish(i, failed_trial(cfg, why, self.spent[i], w.name))

    def finish(self, i: int, r: TrialResult) -> None:
        self.results[i] = r
        self.ex.usage.record(r)
        if self.on_result is not None:
            self.on_result(r)


def _death(error: BaseException) -> str:
    """How a worker died, in words: Ray's unavailable-actor message names only a socket."""
    if type(error).__name__ == "ActorUnavailableError":
        return "its process exited or was killed (ActorUnavailableError)"
    return _short(error)


def _short(error: BaseException, limit: int = 160) -> str:
    """An exception's type and the first line of its message (at most ``limit`` characters)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    out = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."
