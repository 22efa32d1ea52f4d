"""Orbax checkpoints of a run: the sharded train state, the data iterator's position, metadata.

Parameters and optimizer moments are saved in the canonical, mesh-independent group order, so a
checkpoint restores onto any layout, with or without a pipeline. Saves are asynchronous (training
continues while arrays are written) and atomic (Orbax writes into a temporary directory and renames
it when complete, so a crash mid-save leaves nothing that looks finished). A latest checkpoint that
cannot be read is reported and passed over for the one before it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from functools import partial

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import jaxllm
from jaxllm.config import ConfigError
from jaxllm.parallel.pipeline import canonical_view, pipeline_view, schedule_of
from jaxllm.train.step import State, init_state, state_shardings


def _map_groups(fn, tree):
    """Applies `fn` to every subtree stored under a 'groups' key: the params and their moments."""
    if isinstance(tree, dict):
        return {k: fn(v) if k == "groups" else _map_groups(fn, v) for k, v in tree.items()}
    if hasattr(tree, "_fields"):  # optax states are NamedTuples
        return type(tree)(*(_map_groups(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_groups(fn, v) for v in tree)
    return tree


def to_canonical(state: State, cfg: ml_collections.ConfigDict) -> State:
    """The state with layer groups in canonical order (a free reshape; identity without a pipeline)."""
    return state if schedule_of(cfg) is None else _map_groups(canonical_view, state)


def from_canonical(state: State, cfg: ml_collections.ConfigDict) -> State:
    schedule = schedule_of(cfg)
    return state if schedule is None else _map_groups(partial(pipeline_view, schedule=schedule), state)


def _canonical_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    plain = cfg.copy_and_resolve_references()
    plain.parallel.update(stage=1, repeats=1)
    return plain


def _model_fields(cfg: ml_collections.ConfigDict) -> dict:
    """What makes parameters compatible: the model's shape (not dtype or remat)."""
    keep = (
        "num_layers",
        "hidden",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp",
        "vocab_size",
        "vocab_pad_multiple",
        "qkv_share_every",
        "norm",
        "mlp_activation",
        "tie_embeddings",
    )
    return {k: cfg.model[k] for k in keep}


def saved_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config stored with the latest checkpoint of `workdir`."""
    manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", item_names=("meta",))
    step = manager.latest_step()
    if step is None:
        raise ConfigError(f"{workdir} has no checkpoints; pass the --workdir of a training run")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    manager.close()
    return ml_collections.ConfigDict(meta["config"])


@dataclasses.dataclass
class Restored:
    state: State
    step: int
    data_state: dict


class Checkpointer:
    """Saves every `checkpoint.every_steps` steps and/or `every_minutes` minutes, keeps the last
    `keep` plus every `keep_every`-th step for good."""

    def __init__(self, workdir: str | pathlib.Path, cfg: ml_collections.ConfigDict, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
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
            "model": _model_fields(self.cfg),
            "config": json.loads(self.cfg.to_json_best_effort()),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(to_canonical(state, self.cfg)),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self._last_save = time.monotonic()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def _abstract_canonical_state(self) -> State:
        plain = _canonical_config(self.cfg)
        shardings = state_shardings(plain, self.mesh)
        shapes = jax.eval_shape(lambda: init_state(plain, self.mesh))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def restore_latest(self) -> Restored | None:
        """The newest checkpoint that reads back whole, on this run's mesh and layout; None if none."""
        self.manager.wait_until_finished()
        want = _model_fields(self.cfg)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                if meta["model"] != want:
                    changed = {k: (v, want.get(k)) for k, v in meta["model"].items() if want.get(k) != v}
                    raise ConfigError(
                        f"the checkpoint at step {step} in {self.directory} is for another model shape "
                        f"(saved vs configured: {changed}); use a new --workdir or the original model settings"
                    )
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(self._abstract_canonical_state()),
                        data=ocp.args.JsonRestore(),
                    ),
                )
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is passed over
                print(
                    f"checkpoint: step {step} is unreadable ({type(e).__name__}: {str(e)[:300]}); trying an earlier one"
                )
                continue
            state = jax.jit(lambda s: from_canonical(s, self.cfg), out_shardings=state_shardings(self.cfg, self.mesh))(
                restored["state"]
            )
            print(f"checkpoint: restored step {step} from {self.directory} (saved on mesh {meta['mesh']})")
            return Restored(state, step, restored["data"])
        if self.manager.all_steps():
            raise ConfigError(
                f"none of the checkpoints {sorted(self.manager.all_steps())} in {self.directory} can be read (see "
                "above); move that directory aside to start afresh, or fix what the errors name"
            )
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
