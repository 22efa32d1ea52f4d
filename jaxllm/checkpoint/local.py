"""The fast tier under a run's persistent checkpoints: each process saves its own shards of the train
state to a directory on its own host (a local disk or a RAM disk), often and cheaply, with no traffic
to shared storage. After a failure the run resumes from the newest step that every process still
holds there, when that is newer than the persistent tier's newest.

Orbax writes it: one manager per process, each process the primary of its own directory, every
process's array shards in its own OCDBT files (the pattern of Orbax's emergency checkpointing).
Orbax's emergency `CheckpointManager` itself is not used: it rebuilds a lost host's data from the
replicas in other slices, which needs data-parallel replicas that each hold a whole copy of the
state, while here FSDP splits the state over every device. So a local step is restorable only by the
same processes on the same devices; any other layout resumes from the persistent tier.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

State = dict
MAX_STEPS = 64  # local steps a process reports when they are compared; more than any `local_keep`


def layout_of(mesh: Mesh) -> dict:
    """What must not change for a process's own shards to fit again: the mesh and its devices."""
    return {"mesh": dict(mesh.shape), "devices": [int(d.id) for d in mesh.devices.flat],
            "processes": jax.process_count()}  # fmt: skip


class LocalTier:
    """This process's local checkpoints under `directory`/process-<index>, the last `keep` kept."""

    def __init__(self, directory: str | pathlib.Path, keep: int, mesh: Mesh):
        self.layout = layout_of(mesh)
        self.directory = pathlib.Path(directory).absolute() / f"process-{jax.process_index()}"
        self.directory.mkdir(parents=True, exist_ok=True)  # Orbax creates no root for a subset of processes
        processes = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes=set(range(jax.process_count())), barrier_sync_key_prefix="local"
        )
        own_shards = type_handler_registry.create_type_handler_registry(
            (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=False,
            multiprocessing_options=processes,
            save_root_metadata=False,
            enable_per_process_directory_creation=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(
                    use_ocdbt=True, use_zarr3=True, multiprocessing_options=processes,
                    type_handler_registry=own_shards,
                ),
                "data": ocp.JsonCheckpointHandler(multiprocessing_options=processes),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=processes),
            },
        )  # fmt: skip

    def save(self, step: int, canonical: State, data_state: dict, meta: dict) -> None:
        """Starts an asynchronous save of this process's shards of `canonical`."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(canonical),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave({**meta, "layout": self.layout}),
            ),
            force=True,
        )

    def newest_common_step(self) -> int | None:
        """The newest step that every process holds, in this layout; None if there is none."""
        self.manager.wait_until_finished()
        own = [s for s in sorted(self.manager.all_steps(), reverse=True)[:MAX_STEPS] if self._fits(s)]
        steps = np.full(MAX_STEPS, -1, np.int64)
        steps[: len(own)] = own
        if jax.process_count() > 1:
            held = np.asarray(multihost_utils.process_allgather(steps)).reshape(jax.process_count(), MAX_STEPS)
        else:
            held = steps[None]
        common = set.intersection(*({int(s) for s in row if s >= 0} for row in held))
        return max(common, default=None)

    def _fits(self, step: int) -> bool:
        """Whether this process's step `step` was saved in this layout. Read from the file, not
        through the manager, whose restores wait for every process: the processes may hold other steps."""
        try:
            meta = json.loads((self.directory / str(step) / "meta" / "metadata").read_text())
        except (ValueError, OSError):
            return False
        return meta.get("layout") == self.layout

    def restore(self, step: int, canonical: State) -> tuple[State, dict, dict]:
        """(state, data state, meta) of local step `step`, read into `canonical`'s shardings."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(canonical)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=canonical, restore_args=restore_args),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], restored["data"], restored["meta"]

    def drop_after(self, step: int) -> None:
        """Deletes this process's steps after `step`, which the run will save anew (Orbax saves no
        step twice). By hand, not through the manager: the processes may hold other steps."""
        self.manager.wait_until_finished()
        for stale in [s for s in self.manager.all_steps() if s > step]:
            shutil.rmtree(self.directory / str(stale))
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
