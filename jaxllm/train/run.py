"""What a training run needs, built once from its config and mesh and passed down: the step, the
loop, checkpoints and the dry run share one `Run` instead of each rebuilding the schedule, the
parameter specs, the shardings and the optimizer."""

from __future__ import annotations

import dataclasses
import pathlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.checkpoint import Checkpointer
from jaxllm.config import ConfigError, RunConfig, Schedule
from jaxllm.model.decoder import Model
from jaxllm.model.lora import partition, trained_mask
from jaxllm.model.params import is_spec, storage_dtype
from jaxllm.parallel.rules import OPTIMIZER_RULES, RULES, logical_spec, tree_shardings
from jaxllm.train.optim import make_optimizer

State = dict[str, Any]  # {'step', 'params', 'opt_state'}: plain arrays, ready for Orbax
HOST = "pinned_host"  # the memory kind of host-offloaded arrays


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    cfg: RunConfig
    mesh: Mesh
    model: Model  # in the run's own (pipeline) view
    optimizer: optax.GradientTransformation
    state: State  # the train state's shapes, dtypes and shardings, in the run's own (pipeline) view
    # Which params train (all, or with LoRA adapters only those); the optimizer holds state for these alone.
    trained: dict
    # Of gradients summed over microsteps (of the trained params): as the optimizer moments lie (with
    # ZeRO-1, split over `data` too: each microstep's gradients are reduce-scattered into them).
    grad_shardings: dict
    batch_sharding: NamedSharding
    # The state as checkpoints hold it: canonical group order, each array split over the same
    # devices as in training (a pipeline's groups over `stage`), so a restore needs no more memory.
    canonical: State

    @property
    def schedule(self) -> Schedule | None:
        return self.model.schedule

    @property
    def shardings(self) -> State:
        return jax.tree.map(lambda s: s.sharding, self.state)

    def checkpointer(self, workdir: str | pathlib.Path) -> Checkpointer:
        return Checkpointer(workdir, self.cfg, self.mesh, self.canonical, self.shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over data-parallel replicas (`data` and `fsdp`)."""
    return NamedSharding(mesh, logical_spec(("batch", "seq")))


def build_run(cfg: RunConfig, mesh: Mesh) -> Run:
    schedule, p = cfg.parallel.pipeline, cfg.parallel
    model = Model(cfg.model, schedule)
    specs = model.specs
    trained = trained_mask(specs, cfg.model)
    trained_specs = partition(specs, trained)[0]
    optimizer = make_optimizer(cfg.train, trained_specs)
    dtype = jnp.dtype(cfg.model.param_dtype)
    if p.offload_optimizer:
        check_host_memory(mesh.devices.flat[0])
    state = partial(_abstract_state, optimizer=optimizer, mesh=mesh, zero1=p.zero1, offload=p.offload_optimizer,
                    dtype=dtype)  # fmt: skip
    own = state(specs, trained, rules=RULES)
    # Canonical [groups, ...] split in contiguous blocks over `stage`: the same bytes per device as
    # the pipeline view (exactly its layout when repeats = 1), resharded to it after the read.
    canonical_specs = specs if schedule is None else Model(cfg.model).specs
    canonical_rules = RULES if schedule is None else {**RULES, "layers": "stage"}
    canonical = state(canonical_specs, trained_mask(canonical_specs, cfg.model), rules=canonical_rules)
    return Run(
        cfg=cfg,
        mesh=mesh,
        model=model,
        optimizer=optimizer,
        state=own,
        trained=trained,
        grad_shardings=_moment_shardings(trained_specs, mesh, p.zero1, RULES),
        batch_sharding=batch_sharding(mesh),
        canonical=canonical,
    )


def check_host_memory(device) -> None:
    """Refuses optimizer offload on a backend whose devices have no pinned host memory."""
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST not in kinds:
        raise ConfigError(f"parallel.offload_optimizer needs {HOST!r} memory, and this backend's devices "
                          f"({device.platform}) have {kinds}; set parallel.offload_optimizer=False")  # fmt: skip


def on_device(shardings: State) -> State:
    """The same shardings in device memory (what a step computes on)."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def _moment_shardings(specs, mesh: Mesh, zero1: bool, rules: dict) -> dict:
    """Where optimizer moments live: beside their params and, with ZeRO-1, also split over `data`
    where the dim allows."""
    return tree_shardings(specs, mesh, {**rules, "embed": OPTIMIZER_RULES["embed"]} if zero1 else rules, fit=True)


def _abstract_state(
    specs, trained: dict, optimizer, mesh: Mesh, zero1: bool, offload: bool, rules: dict, dtype
) -> State:
    """Shapes, dtypes and shardings of the train state. Params follow `rules`; the optimizer's
    moments (of the `trained` params) follow `_moment_shardings`. With `offload`, the optimizer
    state lives in pinned host memory between steps."""
    params = tree_shardings(specs, mesh, rules)
    trained_specs = partition(specs, trained)[0]
    moments = _moment_shardings(trained_specs, mesh, zero1, rules)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, storage_dtype(s, dtype)), specs, is_leaf=is_spec)
    params_def = jax.tree.structure(moments)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(optimizer.init, partition(shapes, trained)[0])
    opt_shardings = jax.tree.map(
        lambda node: moments if jax.tree.structure(node) == params_def else replicated,
        opt_shapes,
        is_leaf=lambda node: jax.tree.structure(node) == params_def,
    )
    if offload:
        opt_shardings = jax.tree.map(lambda s: s.with_memory_kind(HOST), opt_shardings)
    state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": shapes, "opt_state": opt_shapes}
    shardings = {"step": replicated, "params": params, "opt_state": opt_shardings}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
