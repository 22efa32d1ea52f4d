"""Signals in and out of a training process: preemption requests, liveness heartbeats, and the
fault injection that tests use to kill a run at a chosen point."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import jax
from jax.experimental import multihost_utils

HEARTBEAT_ENV = "JAXLLM_HEARTBEAT_FILE"


class Preemption:
    """SIGTERM or SIGINT asks the run to save and stop at the next step boundary. With several
    processes, JAX's own preemption notifier (SIGTERM) and sync point make them agree on the step,
    so no Python handler may replace it there."""

    def __init__(self):
        self._requested = False
        signals = (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ()
        self._previous = {s: signal.signal(s, self._request) for s in signals}

    def _request(self, signum, frame) -> None:
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint and stopping after this step", flush=True)
        self._requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def heartbeat(step: int) -> None:
    """Touches the file the launcher watches, if there is one: this process is alive at `step`."""
    if path := os.environ.get(HEARTBEAT_ENV):
        pathlib.Path(path).write_text(f"{step} {time.time()}\n")


def kill_self() -> None:
    """An abrupt death, as from an OOM killer or a lost node (test fault injection)."""
    print("debug: killing this process with SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
