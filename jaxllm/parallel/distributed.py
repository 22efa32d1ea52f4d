"""Multi-process start-up: one JAX process per host (or per GPU), found from the environment."""

from __future__ import annotations

import os

import jax


def initialize_from_environment() -> None:
    """Joins the JAX distributed system when launched as one of several processes.

    Explicit: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    Automatic: SLURM (srun) and Open MPI (mpirun) environments. A single process does nothing.
    """
    if address := os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
