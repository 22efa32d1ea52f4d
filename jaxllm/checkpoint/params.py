"""Parameters alone, from a training run's checkpoint or from an export, straight into any mesh's
shardings (by the rules table) in any dtype, reading no optimizer state: the entry point for
serving, export and conversion.

An export is a directory with `params/` (an Orbax checkpoint of the params dict, groups in
canonical order) and `config.json` (the run's own config), written by `write_export`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxllm.checkpoint.manager import UNREADABLE, CheckpointError, saved_config
from jaxllm.config import with_defaults
from jaxllm.model.decoder import param_specs
from jaxllm.model.params import is_spec
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import tree_shardings


def _target(model: ml_collections.ConfigDict, mesh: Mesh, dtype: Any) -> dict:
    """Abstract canonical params, sharded on `mesh` by the rules table."""
    specs = param_specs(model)
    shardings = tree_shardings(specs, mesh, fit=True)  # any mesh: axes that do not divide a dim are left out
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype), sharding=sh), specs, shardings, is_leaf=is_spec
    )


def load_params(
    path: str | pathlib.Path, mesh: Mesh | None = None, dtype: Any = None, step: int | None = None
) -> tuple[ml_collections.ConfigDict, dict, int]:
    """(config, params, step) from an export directory or a training run's workdir (its latest
    checkpoint, or `step`). Params land in `mesh`'s shardings (default: the first device), cast
    to `dtype` (default: the config's param_dtype); a checkpoint's optimizer state is never read."""
    path = pathlib.Path(path).absolute()
    mesh = mesh or make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, stage=1, tensor=1)), jax.devices()[:1])
    if (path / "config.json").exists():
        cfg = with_defaults(json.loads((path / "config.json").read_text()))
        target = _target(cfg.model, mesh, dtype or cfg.model.param_dtype)
        return cfg, ocp.StandardCheckpointer().restore(path / "params", target), cfg.get("export_step", -1)
    directory = path / "checkpoints"
    manager = ocp.CheckpointManager(directory, item_names=("state",))
    step = manager.latest_step() if step is None else step
    manager.close()
    if step is None or not (directory / str(step) / "state").is_dir():
        raise CheckpointError(f"{path} holds no export and no checkpoint{'' if step is None else f' {step}'}; "
                              "pass an export directory or the --workdir of a training run")  # fmt: skip
    cfg = saved_config(path, step)
    target = {"params": _target(cfg.model, mesh, dtype or cfg.model.param_dtype)}
    restore = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    try:
        state = ocp.PyTreeCheckpointer().restore(directory / str(step) / "state", args=restore)
    except UNREADABLE as e:
        cause = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        raise CheckpointError(f"step {step} of {path} cannot be read ({cause}); pass an earlier step") from None
    return cfg, state["params"], step


def write_export(out: str | pathlib.Path, cfg: ml_collections.ConfigDict, params: dict, step: int) -> None:
    out = pathlib.Path(out).absolute()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", params, force=True)
    checkpointer.wait_until_finished()
    exported = cfg.copy_and_resolve_references()
    exported.export_step = step
    (out / "config.json").write_text(exported.to_json_best_effort(indent=2))
