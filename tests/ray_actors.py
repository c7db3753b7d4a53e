"""A test-only Ray actor for tests/test_ray_executor.py (its workers import this module, so it
imports nothing the real actor does not).

Its behaviour is set per trial by the config's draft length and by files in a control folder,
the folder of the tune's target model (each test has its own):

* ``k == STALL_K``: waits until ``release`` exists in the folder (at most a minute);
* ``k == POISON_K``: the process exits at once, as a crash would, on every worker;
* ``die-once`` in the folder: the first trial started on any worker exits its process (the
  worker that creates ``died`` first; later trials run normally).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.ray_actor import EvalActor

STALL_K = 5
POISON_K = 7


class ScriptedActor(EvalActor):
    def _folder(self) -> Path:
        return Path(self.evaluator.base.deployment.target).parent

    def evaluate(self, config: EngineConfig) -> TrialResult:
        folder = self._folder()
        if config.k == POISON_K:
            os._exit(1)
        if (folder / "die-once").exists():
            try:
                os.close(os.open(folder / "died", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        if config.k == STALL_K:
            deadline = time.monotonic() + 60
            while not (folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().evaluate(config)

    def memory_state(self) -> dict[str, Any]:
        """What of the memory store this worker holds: modules imported, attributes kept."""
        return {
            "modules": sorted(m for m in sys.modules if m.startswith("specpilot.memory")),
            "attributes": {k: type(v).__name__ for k, v in vars(self).items()},
        }
