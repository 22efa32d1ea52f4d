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


def beat(step: int, process: int) -> None:
    """This process is alive at `step` (nothing happens unless a launcher watches)."""
    if path := _file(process):
        path.write_text(f"{step} {time.time()}\n")


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


def silent_for(directory: pathlib.Path, process: int) -> float | None:
    """Seconds since process `process` last beat, or None if it never has."""
    try:
        return time.time() - (directory / str(process)).stat().st_mtime
    except OSError:
        return None
