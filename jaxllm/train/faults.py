"""What goes wrong in a training process and the signals around it: non-finite steps and
preemption requests."""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils

from jaxllm import logs

log = logs.get(__name__)


class NonFiniteSteps:
    """Counts skipped (non-finite) updates one step late: a step's flag is read once the next step
    is queued behind it, so the read never leaves the device idle and dispatch stays asynchronous."""

    def __init__(self, total: int, limit: int):
        self.total, self.limit, self.in_a_row = total, limit, 0
        self.pending: tuple[int, jax.Array] | None = None

    def push(self, step: int, flag: jax.Array) -> int | None:
        """Holds `step`'s flag (a device scalar, 1 if its update was skipped) and reads the previous
        step's. Returns the first step of the streak when that one makes `limit` in a row."""
        previous, self.pending = self.pending, (step, flag)
        return None if previous is None else self._read(*previous)

    def flush(self) -> int | None:
        """Reads the held flag (at the end of a run)."""
        previous, self.pending = self.pending, None
        return None if previous is None else self._read(*previous)

    def total_so_far(self) -> int:
        """Skipped updates including the held step's, for a checkpoint or log that waits for it anyway."""
        return self.total + (int(self.pending[1]) if self.pending else 0)

    def restart(self) -> None:
        """After a roll back: the streak is over, and the held step ran on the state left behind."""
        self.in_a_row, self.pending = 0, None

    def _read(self, step: int, flag: jax.Array) -> int | None:
        if not int(flag):
            self.in_a_row = 0
            return None
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        log.warning(f"step {step}: non-finite loss or gradients, update skipped ({self.in_a_row} in a row)")
        return step - self.in_a_row + 1 if self.in_a_row >= self.limit else None


class Preemption:
    """SIGTERM or SIGINT asks the run to save and stop at the next step boundary. With several
    processes, JAX's own preemption notifier (SIGTERM) and sync point make them agree on the step,
    so no Python handler may replace it there."""

    def __init__(self):
        self._requested = False
        signals = (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ()
        self._previous = {s: signal.signal(s, self._request) for s in signals}

    def _request(self, signum, frame) -> None:
        log.info(f"{signal.Signals(signum).name} received: saving a checkpoint and stopping after this step")
        self._requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
