"""Orbax checkpoints of a training run: the sharded train state, the data iterator's position,
metadata (config, mesh, step, version).

Saves are asynchronous (training continues while arrays are written) and atomic (Orbax writes into
a temporary directory and renames it when complete, so a crash mid-save leaves nothing that looks
finished). A restore reads straight into the run's own layout: the canonical state is split over
the same devices as in training, then resharded to the pipeline view. A step that cannot be read
is reported in one line and moved aside (renamed, never deleted), so the resumed run can save that
step again; every process skips the same steps.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from functools import partial
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import jaxllm
from jaxllm.checkpoint.layout import check_same_shape, from_canonical, to_canonical
from jaxllm.config import ModelConfig, RunConfig
from jaxllm.errors import JaxllmError

State = dict[str, Any]
# What a damaged or partial checkpoint raises while being read (TensorStore and JSON decoding,
# missing files); anything else, such as running out of memory, stops the run with its own cause.
UNREADABLE = (ValueError, OSError, KeyError)


class CheckpointError(JaxllmError):
    """Checkpoints that cannot serve this run; the message says which and what to do."""


def saved_config(workdir: str | pathlib.Path, step: int | None = None) -> RunConfig:
    """The config stored with checkpoint `step` (default: the latest) of `workdir`."""
    manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", item_names=("meta",))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{workdir} has no checkpoints; pass the --workdir of a training run")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    manager.close()
    return RunConfig.from_dict(meta["config"])


@dataclasses.dataclass
class Restored:
    state: State
    step: int
    data_state: dict


def _everyone(flag: bool) -> bool:
    """True on every process if it is true on any: all processes take the same branch."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class Checkpointer:
    """Saves every `checkpoint.every_steps` steps and/or `every_minutes` minutes, keeps the last
    `keep` plus every `keep_every`-th step for good. `canonical` is the state as checkpoints hold
    it (abstract arrays with the shardings to read into); `shardings` the run's own."""

    def __init__(
        self,
        workdir: str | pathlib.Path,
        cfg: RunConfig,
        mesh: Mesh,
        canonical: State,
        shardings: State,
    ):
        self.cfg, self.mesh, self.canonical, self.shardings = cfg, mesh, canonical, shardings
        self.schedule = cfg.parallel.schedule
        c = cfg.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.keep,
            keep_period=c.keep_every or None,
            enable_async_checkpointing=c.async_save,
            create=True,
        )
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        self._last_save = time.monotonic()

    def due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        if c.every_steps > 0 and step % c.every_steps == 0:
            return True
        if c.every_minutes <= 0:
            return False
        by_time = time.monotonic() - self._last_save >= 60 * c.every_minutes
        if jax.process_count() > 1:  # every process must take the same decision: process 0's clock rules
            by_time = bool(multihost_utils.broadcast_one_to_all(np.asarray(by_time)))
        return by_time

    def save(self, step: int, state: State, data_state: dict) -> None:
        """Starts an asynchronous save of `state` as it is now; returns once the arrays are copied."""
        meta = {
            "step": step,
            "version": jaxllm.__version__,
            "mesh": dict(self.mesh.shape),
            "config": self.cfg.to_dict(),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(to_canonical(state, self.schedule)),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self._last_save = time.monotonic()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_latest(self, before: int | None = None) -> Restored | None:
        """The newest checkpoint (saved before step `before`, if given) that reads back whole, in
        this run's layout; None if there is none. Unreadable newer steps are moved aside once an
        older one has been read; if none can be read, nothing is moved and the run stops."""
        self.manager.wait_until_finished()
        steps = [s for s in sorted(self.manager.all_steps(), reverse=True) if before is None or s < before]
        unreadable = []
        for step in steps:
            error = None
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                where = f"the checkpoint at step {step} in {self.directory}"
                check_same_shape(ModelConfig.from_dict(meta["config"]["model"]), self.cfg.model, where)
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(self.canonical), data=ocp.args.JsonRestore()
                    ),
                )
            except UNREADABLE as e:
                if isinstance(e, JaxllmError):
                    raise
                error = e
            if _everyone(error is not None):
                cause = "another process could not read it" if error is None else f"{type(error).__name__}: {error}"
                print(f"checkpoint: step {step} is unreadable ({cause.splitlines()[0][:200]})")
                unreadable.append(step)
                continue
            for bad in unreadable:
                self._move_aside(bad)
            to_own_layout = partial(from_canonical, schedule=self.schedule)
            state = jax.jit(to_own_layout, out_shardings=self.shardings, donate_argnums=0)(restored["state"])
            print(f"checkpoint: restored step {step} from {self.directory} (saved on mesh {meta['mesh']})")
            return Restored(state, step, restored["data"])
        if unreadable:
            raise CheckpointError(
                f"none of the checkpoints {unreadable} in {self.directory} can be read (see above); move that "
                "directory aside to start afresh, or fix what the errors name"
            )
        return None

    def _move_aside(self, step: int) -> None:
        """Renames an unreadable step (process 0 only; never deleted) so the run can save it anew."""
        aside, n = self.directory / f"{step}.unreadable", 1
        while aside.exists():
            aside, n = self.directory / f"{step}.unreadable.{n}", n + 1
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint step {step} moved aside")
        self.manager.reload()
        print(f"checkpoint: moved unreadable step {step} to {aside}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
