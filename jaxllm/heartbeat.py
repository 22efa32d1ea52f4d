"""The liveness signal between `jaxllm.launch` and the processes it runs: the launcher names a file
in an environment variable, and a training process touches it after every step. No JAX here: the
launcher imports this alone."""

from __future__ import annotations

import os
import pathlib
import time

ENV = "JAXLLM_HEARTBEAT_FILE"


def beat(step: int) -> None:
    """Touches the file the launcher watches, if there is one: this process is alive at `step`."""
    if path := os.environ.get(ENV):
        pathlib.Path(path).write_text(f"{step} {time.time()}\n")
