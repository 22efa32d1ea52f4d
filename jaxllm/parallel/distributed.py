"""A process's start-up: one JAX process per host (or per GPU), found from the environment, the
checks that the processes of one job see the same files, and the compilation cache that spares a
restart its compiling."""

from __future__ import annotations

import os
import pathlib
import secrets
import socket

import jax
import numpy as np
from jax._src.lib import xla_client  # the topology fingerprint that JAX's cache keys hold
from jax.experimental import multihost_utils

from jaxllm import logs
from jaxllm.config import ConfigError

log = logs.get(__name__)


def initialize_from_environment() -> None:
    """Joins the JAX distributed system when launched as one of several processes.

    Explicit: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    Automatic: SLURM (srun) and Open MPI (mpirun) environments. A single process does nothing.
    CPU devices talk through gloo, JAX's default for CPU collectives across processes.
    """
    if address := os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize(local_device_ids=slurm_local_devices(os.environ))
    elif int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()


def tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed count of tasks on each node: '2(x3),1' → [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def slurm_local_devices(environ) -> list[int] | None:
    """The GPUs a SLURM task uses: every GPU of its node (those CUDA_VISIBLE_DEVICES lists, else
    each /dev/nvidiaN) when it is its node's only task. Otherwise None, and JAX gives each task the
    GPU of its SLURM_LOCALID; JAX would do that to a lone task too, leaving it one GPU of eight."""
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not per_node or tasks_per_node(per_node)[int(environ.get("SLURM_NODEID", "0"))] != 1:
        return None
    if visible := environ.get("CUDA_VISIBLE_DEVICES"):
        return list(range(len(visible.split(","))))
    gpus = [p for p in pathlib.Path("/dev").glob("nvidia*") if p.name.removeprefix("nvidia").isdigit()]
    return list(range(len(gpus))) or None


def check_shared(directory: str | pathlib.Path, name: str) -> None:
    """Raises ConfigError on every process unless all of them see the file that process 0 writes in
    `directory`: a job's processes share checkpoints, prepared data and heartbeats through it."""
    if jax.process_count() == 1:
        return
    directory = pathlib.Path(directory).absolute()
    token = np.frombuffer(secrets.token_bytes(16), np.uint8) if jax.process_index() == 0 else np.zeros(16, np.uint8)
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))
    probe = directory / f".shared-{token.tobytes().hex()}"
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(token.tobytes())
    multihost_utils.sync_global_devices(f"wrote {probe}")
    try:
        seen = probe.read_bytes() == token.tobytes()
    except OSError:
        seen = False
    blind = np.flatnonzero(~np.asarray(multihost_utils.process_allgather(np.asarray(seen))))
    multihost_utils.sync_global_devices(f"read {probe}")
    if jax.process_index() == 0:
        probe.unlink()
    if blind.size:
        raise ConfigError(
            f"{name}={directory} is not shared: process{'es' if blind.size > 1 else ''} {', '.join(map(str, blind))} "
            f"(this one is {jax.process_index()} on {socket.gethostname()}) cannot see what process 0 wrote there; "
            f"put {name} on storage that every node of the job mounts at the same path (a parallel file system or NFS)"
        )


def use_compile_cache(setting: str | None, workdir: str | pathlib.Path | None) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at `setting`'s directory (train.compile_cache,
    serve.compile_cache; by default $JAX_COMPILATION_CACHE_DIR, else `workdir`/xla-cache, else
    ~/.cache/jaxllm/xla-cache), keeping every executable however quick it compiles: a server
    compiles a hundred small ones. A restart reads them back instead of compiling. None if 'off',
    or if the job's processes would not share what it holds (`cache_keys_agree`)."""
    if setting == "off":
        return None
    if not cache_keys_agree():
        log.warning(
            "compilation cache off: on this backend JAX keys a program differently in each process and only "
            "process 0 writes, so process 0 would read back what the others compile again, and run ahead of "
            "them past the 30 s gloo allows a collective's first meeting (JAX on CPU)"
        )
        return None
    default = pathlib.Path(workdir) / "xla-cache" if workdir else pathlib.Path.home() / ".cache/jaxllm/xla-cache"
    directory = pathlib.Path(setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def cache_keys_agree() -> bool:
    """Whether every process of the job computes the same compilation-cache key for a program. JAX's
    key holds the devices' topology fingerprint, which on CPU differs from process to process."""
    if jax.process_count() == 1:
        return True
    try:
        fingerprint = xla_client.get_topology_for_devices(jax.devices()).fingerprint()
    except jax.errors.JaxRuntimeError:  # JAX then keys by device ids, the same in every process
        return True
    mine = np.frombuffer(fingerprint.to_bytes(8, "big"), np.uint8)
    return bool((np.asarray(multihost_utils.process_allgather(mine)) == mine).all())


class CacheCounts:
    """While open: the programs read back from the compilation cache, and those compiled because it
    did not hold them (JAX's monitoring events: a request to the cache that was not a hit compiled;
    JAX counts a miss only where it writes, in process 0)."""

    HIT, REQUEST = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/compile_requests_use_cache"

    def __init__(self) -> None:
        self.read = self.compiled = 0

    def _count(self, event: str, **_) -> None:
        self.read += event == self.HIT
        self.compiled += (event == self.REQUEST) - (event == self.HIT)

    def __enter__(self) -> CacheCounts:
        jax.monitoring.register_event_listener(self._count)
        return self

    def __exit__(self, *exc) -> None:  # a failed compile leaves no listener behind
        jax.monitoring.unregister_event_listener(self._count)
