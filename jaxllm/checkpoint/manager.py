"""Orbax checkpoints of a training run: the sharded train state, the data iterator's position,
metadata (config, mesh, step, version).

Saves are asynchronous (training continues while arrays are written) and atomic (Orbax writes into
a temporary directory and renames it when complete, so a crash mid-save leaves nothing that looks
finished). A restore reads straight into the run's own layout: the canonical state is split over
the same devices as in training, then resharded to the pipeline view. A step that cannot be read
is reported in one line and moved aside (renamed, never deleted), so the resumed run can save that
step again; every process skips the same steps. So is one whose arrays read back with other bits
than were saved: the metadata holds a checksum of each array, checked at every restore.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import jaxllm
from jaxllm import logs
from jaxllm.checkpoint.layout import check_same_shape, from_canonical, to_canonical
from jaxllm.checkpoint.local import LocalTier
from jaxllm.config import ModelConfig, RunConfig
from jaxllm.errors import JaxllmError

log = logs.get(__name__)

State = dict[str, Any]
# What a damaged or partial checkpoint raises while being read (TensorStore and JSON decoding,
# missing files); anything else, such as running out of memory, stops the run with its own cause.
UNREADABLE = (ValueError, OSError, KeyError)


class CheckpointError(JaxllmError):
    """Checkpoints that cannot serve this run; the message says which and what to do."""


def saved_meta(workdir: str | pathlib.Path, step: int | None = None) -> dict:
    """The metadata stored with checkpoint `step` (default: the latest) of `workdir`."""
    manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", item_names=("meta",))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{workdir} has no checkpoints; pass the --workdir of a training run")
    try:
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        manager.close()


def saved_config(workdir: str | pathlib.Path, step: int | None = None) -> RunConfig:
    """The config stored with checkpoint `step` (default: the latest) of `workdir`."""
    return RunConfig.from_dict(saved_meta(workdir, step)["config"])


@jax.jit
def _bit_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    """Per array, the sum of its elements' bits times odd weights that follow their positions, mod
    2**32: exact in any order, so the same on every mesh and layout, and any one changed element
    changes it (an odd weight is invertible mod 2**32)."""

    def bit_sum(x):
        bits = x if x.dtype == bool else jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        index = jnp.zeros(x.shape, jnp.uint32)  # the flat position, mod 2**32
        for axis in range(x.ndim):
            stride = np.uint32(math.prod(x.shape[axis + 1 :]) % 2**32)
            index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * stride
        return jnp.sum(bits.astype(jnp.uint32) * (2 * index + 1), dtype=jnp.uint32)

    return [bit_sum(x) for x in leaves]


def _device_memory(x: jax.Array) -> str:
    return next(iter(x.sharding.device_set)).default_memory().kind


def _in_host_memory(x: jax.Array) -> bool:
    return x.sharding.memory_kind not in (None, _device_memory(x))


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, x.sharding.with_memory_kind(_device_memory(x)))


def checksums(state: State) -> dict[str, list]:
    """{path: [dtype, checksum]} of each array in `state`: saved in the metadata, so that arrays
    that read back silently changed (a flipped bit on disk or on the wire) are caught at restore."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [x for _, x in leaves]
    with jax.set_mesh(None):  # whatever mesh is current: the arrays say where they are
        # Arrays held in host memory (offloaded optimizer state) visit the device one at a time.
        on_device = iter(_bit_sums([x for x in arrays if not _in_host_memory(x)]))
        sums = [_bit_sums([_to_device(x)])[0] if _in_host_memory(x) else next(on_device) for x in arrays]
    return {
        jax.tree_util.keystr(path): [str(x.dtype), int(s.addressable_data(0))]
        for (path, x), s in zip(leaves, sums, strict=True)
    }


def check_checksums(meta: dict, state: State) -> None:
    """Raises ValueError (as for an unreadable checkpoint), once `state`'s arrays are freed, if any
    of them was read back with other bits than the checkpoint with `meta` saved. Arrays read into
    another dtype and checkpoints saved without checksums are not checked."""
    saved = meta.get("checksums", {})
    changed = [k for k, v in checksums(state).items() if k in saved and saved[k][0] == v[0] and saved[k] != v]
    if changed:
        for array in jax.tree.leaves(state):
            array.delete()
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        raise ValueError(f"checksum mismatch: {changed[0]}{more} read back other values than were saved")


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


class Cadence:
    """Due every `every_steps` steps and/or `every_minutes` minutes since the last save (0 turns
    either off); process 0's clock decides for every process, so all take the same decision."""

    def __init__(self, every_steps: int, every_minutes: float, clock: Callable[[], float]):
        self.every_steps, self.every_minutes, self.clock = every_steps, every_minutes, clock
        self._last = clock()

    def due(self, step: int) -> bool:
        if self.every_steps > 0 and step % self.every_steps == 0:
            return True
        if self.every_minutes <= 0:
            return False
        by_time = self.clock() - self._last >= 60 * self.every_minutes
        if jax.process_count() > 1:
            by_time = bool(multihost_utils.broadcast_one_to_all(np.asarray(by_time)))
        return by_time

    def saved(self) -> None:
        self._last = self.clock()


class Checkpointer:
    """Saves every `checkpoint.every_steps` steps and/or `every_minutes` minutes, keeps the last
    `keep` plus every `keep_every`-th step for good; with `checkpoint.local_dir`, also saves the fast
    tier (`jaxllm.checkpoint.local`) every `local_every_steps` and/or `local_every_minutes`.
    `canonical` is the state as checkpoints hold it (abstract arrays with the shardings to read
    into); `shardings` the run's own; `clock` gives the seconds that the minutes count."""

    def __init__(
        self,
        workdir: str | pathlib.Path,
        cfg: RunConfig,
        mesh: Mesh,
        canonical: State,
        shardings: State,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.mesh, self.canonical, self.shardings = cfg, mesh, canonical, shardings
        self.schedule = cfg.parallel.pipeline
        c = cfg.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.keep,
            keep_period=c.keep_every or None,
            enable_async_checkpointing=c.async_save,
            create=True,
        )
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        self.every = Cadence(c.every_steps, c.every_minutes, clock)
        self.local = LocalTier(c.local_dir, c.local_keep, mesh) if c.local_dir else None
        self.local_every = Cadence(c.local_every_steps, c.local_every_minutes, clock)

    def due(self, step: int) -> bool:
        return self.every.due(step)

    def due_local(self, step: int) -> bool:
        return self.local is not None and self.local_every.due(step)

    def _meta(self, step: int, canonical: State) -> dict:
        return {
            "step": step,
            "version": jaxllm.__version__,
            "mesh": dict(self.mesh.shape),
            "config": self.cfg.to_dict(),
            "checksums": checksums(canonical),
        }

    def save_local(self, step: int, state: State, data_state: dict) -> None:
        """Starts an asynchronous save of this process's shards of `state` to the fast tier."""
        canonical = to_canonical(state, self.schedule)
        self.local.save(step, canonical, data_state, self._meta(step, canonical))
        self.local_every.saved()

    def save(self, step: int, state: State, data_state: dict) -> None:
        """Starts an asynchronous save of `state` as it is now; returns once the arrays are copied."""
        canonical = to_canonical(state, self.schedule)
        meta = self._meta(step, canonical)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(canonical),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.every.saved()

    def wait(self) -> None:
        self.manager.wait_until_finished()
        if self.local is not None:
            self.local.wait()

    def _own_layout(self, canonical: State) -> State:
        to_own_layout = partial(from_canonical, schedule=self.schedule)
        return jax.jit(to_own_layout, out_shardings=self.shardings, donate_argnums=0)(canonical)

    def _restore_local(self) -> Restored | None:
        """The fast tier's newest step that every process holds, if it is newer than any persistent
        step and reads back whole everywhere; else None (the persistent tier is used)."""
        step = self.local.newest_common_step()
        if step is None or step <= max(self.manager.all_steps(), default=-1):
            return None
        state, error = None, None
        try:
            state, data, meta = self.local.restore(step, self.canonical)
            check_checksums(meta, state)
        except UNREADABLE as e:
            error = e
        if _everyone(error is not None):
            for array in jax.tree.leaves(state) if error is None else []:
                array.delete()
            cause = "another process could not read it" if error is None else f"{type(error).__name__}: {error}"
            log.warning(f"checkpoint: fast-tier step {step} is unreadable ({cause.splitlines()[0][:200]}); using "
                  "the persistent tier")  # fmt: skip
            return None
        log.info(f"checkpoint: restored step {step} from the fast tier in {self.local.directory.parent}")
        return Restored(self._own_layout(state), step, data)

    def restore_latest(self, before: int | None = None) -> Restored | None:
        """The newest checkpoint (saved before step `before`, if given) that reads back whole, in
        this run's layout; None if there is none. Unreadable newer steps are moved aside once an
        older one has been read; if none can be read, nothing is moved and the run stops. Fast-tier
        steps after the one restored are dropped: the run computes them anew."""
        self.manager.wait_until_finished()
        restored = self._restore_local() if before is None and self.local is not None else None
        restored = restored or self._restore_persistent(before)
        if self.local is not None:
            self.local.drop_after(0 if restored is None else restored.step)
        return restored

    def _restore_persistent(self, before: int | None) -> Restored | None:
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
                check_checksums(meta, restored["state"])
            except UNREADABLE as e:
                if isinstance(e, JaxllmError):
                    raise
                error = e
            if _everyone(error is not None):
                cause = "another process could not read it" if error is None else f"{type(error).__name__}: {error}"
                log.warning(f"checkpoint: step {step} is unreadable ({cause.splitlines()[0][:200]})")
                unreadable.append(step)
                continue
            for bad in unreadable:
                self._move_aside(bad)
            log.info(f"checkpoint: restored step {step} from {self.directory} (saved on mesh {meta['mesh']})")
            return Restored(self._own_layout(restored["state"]), step, restored["data"])
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
        log.warning(f"checkpoint: moved unreadable step {step} to {aside}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        if self.local is not None:
            self.local.close()
