"""jaxllm: train and serve large decoder-only language models with JAX SPMD sharding."""

import os
import re

__version__ = "0.2.0"


def _threads_for_fake_devices() -> None:
    """XLA:CPU runs N fake devices on one pool of max(cores, N) threads (PJRT_NPROC in place of
    the cores when set). A device whose program has two collectives ready at once (a pipeline
    loop's permutes, an all-reduce that does not wait for them) queues one on that pool; when all N
    threads wait in rendezvous, it never starts and every device waits forever. A compiled GPipe
    step has three such collectives ready at once; four threads per device leave room for them.
    The pool is sized when JAX starts its backend."""
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    nproc = os.environ.get("PJRT_NPROC", "")
    if counts and int(nproc if nproc.isdigit() else 0) < 4 * int(counts[-1]):
        os.environ["PJRT_NPROC"] = str(max(os.cpu_count() or 1, 4 * int(counts[-1])))


_threads_for_fake_devices()
