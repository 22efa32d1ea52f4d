"""Fake CPU devices get four XLA threads each (jaxllm/__init__.py): with one each, a 1F1B run whose
token count's all-reduce and pipeline permutes were ready at once on some devices stopped at its
first step, every thread waiting in a rendezvous."""

import os
import subprocess
import sys

import pytest

# Counts XLA:CPU's pool threads by name; a thread may end between listing and reading.
_POOL = """import os, jaxllm, jax
jax.devices()
names = []
for task in os.listdir("/proc/self/task"):
    try:
        names.append(open(f"/proc/self/task/{task}/comm").read().strip())
    except FileNotFoundError:
        pass
print(names.count("tf_XLAEigen"))"""


@pytest.mark.parametrize("nproc, threads", [(None, 16), ("5", 16), ("20", 20)])
def test_importing_jaxllm_gives_fake_devices_four_xla_threads_each(nproc, threads):
    """4 fake devices: a pool of 16 threads, also where PJRT_NPROC asks for fewer; more are kept."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    env |= {} if nproc is None else {"PJRT_NPROC": nproc}
    out = subprocess.run([sys.executable, "-c", _POOL], env=env, capture_output=True, text=True, check=True).stdout
    assert int(out) == max(threads, os.cpu_count() or 1)
