"""The liveness signal between `jaxllm.launch` and the processes it runs: the launcher names a
directory in an environment variable (on storage every node shares, under SLURM), and each training
process writes its own file there: its step after every step, and at the end how it stopped. No JAX
here: the launcher imports this alone."""

from __future__ import annotations

import os
import pathlib
import time

ENV = "JAXLLM_HEARTBEAT_DIR"
FINISHED, PREEMPTED = "finished", "preempted"  # how a process stopped, written last


def _file(process: int) -> pathlib.Path | None:
    directory = os.environ.get(ENV)
    return pathlib.Path(directory) / str(process) if directory else None


def beat(step: int, process: int, slow: str = "") -> None:
    """This process is alive at `step` (nothing happens unless a launcher watches). `slow` names the
    work besides steps it starts now, which may compile (an evaluation, the last save and the
    sample): the launcher then allows it the start-up timeout rather than a step's."""
    if path := _file(process):
        path.write_text(f"{step} {time.time()} {slow}".rstrip() + "\n")


def stopped(outcome: str, step: int, process: int) -> None:
    """This process is stopping after `step`: FINISHED its steps, or PREEMPTED (saved, to be resumed)."""
    if path := _file(process):
        path.write_text(f"{outcome} {step}\n")


def outcome(directory: pathlib.Path, process: int) -> str | None:
    """FINISHED, PREEMPTED, or None if process `process` has not said how it stopped."""
    try:
        word = (directory / str(process)).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return word if word in (FINISHED, PREEMPTED) else None


def overdue(
    directory: pathlib.Path, process: int, started: float, step_timeout: float, startup_timeout: float
) -> str | None:
    """Why process `process` counts as hung, or None: silent for `step_timeout` seconds since its
    last step, or for `startup_timeout` before its first step (since `started`) or in slow work it
    announced."""
    path = directory / str(process)
    try:
        last, said = path.stat().st_mtime, path.read_text().split()[2:]
    except OSError:  # no beat yet
        since = time.time() - started
        return f"made no progress for {since:.0f} s since start (no step yet)" if since > startup_timeout else None
    since, limit = time.time() - last, startup_timeout if said else step_timeout
    return f"made no progress for {since:.0f} s since {' '.join(said) or 'its last step'}" if since > limit else None
