"""Parameters alone, from a training run's checkpoint, an export or a Hugging Face Llama directory,
straight into any mesh's shardings (by the rules table) in any dtype, reading no optimizer state:
the entry point for serving, export, conversion and fine-tuning.

An export is a directory with `params/` (an Orbax checkpoint of the params dict, groups in
canonical order) and `config.json` (the run's own config), written by `write_export`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxllm import logs
from jaxllm.checkpoint.hf.config import is_hf_dir
from jaxllm.checkpoint.hf.directory import read_hf_params, stored_hf_config
from jaxllm.checkpoint.manager import UNREADABLE, CheckpointError, check_checksums, saved_config, saved_meta
from jaxllm.config import ModelConfig, ParallelConfig, RunConfig
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import int8_model, quantize_tree
from jaxllm.model.lora import merge_adapters
from jaxllm.model.params import at_path, is_spec, storage_dtype
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import tree_shardings

log = logs.get(__name__)


def abstract_params(specs: dict, mesh: Mesh, dtype: Any) -> dict:
    """Abstract canonical params of `specs`, sharded on `mesh` by the rules table."""
    shardings = tree_shardings(specs, mesh, fit=True)  # any mesh: axes that do not divide a dim are left out

    def target(spec, sharding):
        return jax.ShapeDtypeStruct(spec.shape, storage_dtype(spec, dtype), sharding=sharding)

    return jax.tree.map(target, specs, shardings, is_leaf=is_spec)


def quantize_params(params: dict, model: ModelConfig, mesh: Mesh, dtype: Any) -> dict:
    """`params` with each quantizable parameter (a dense projection's weight) in int8 (see
    `model/int8.py`; one already in int8 is kept) and the rest cast to `dtype`, placed on `mesh` by
    the rules table."""
    full, int8 = Model(model.replace(quantize=None)).specs, Model(int8_model(model)).specs
    target = abstract_params(int8, mesh, dtype)

    def quantize(p: dict) -> dict:
        return jax.tree.map(lambda want, w: w.astype(want.dtype), target, quantize_tree(p, full, int8))

    quantize = jax.jit(quantize, out_shardings=jax.tree.map(lambda t: t.sharding, target))
    return quantize(params)


def _is_export(path: pathlib.Path) -> bool:
    return (path / "config.json").exists() and not is_hf_dir(path)


def _steps(path: pathlib.Path, step: int | None) -> list[int]:
    """`step`, or every checkpoint step of a run, newest first; refuses a path that has none."""
    if not path.is_dir():  # before the manager, which would create it
        raise CheckpointError(f"{path} does not exist: no such run or export; pass the --workdir of a training run, "
                              "an export directory or a Hugging Face directory")  # fmt: skip
    directory = path / "checkpoints"
    manager = ocp.CheckpointManager(directory, item_names=("state",))
    steps = sorted(manager.all_steps(), reverse=True) if step is None else [step]
    manager.close()
    if not steps or not (directory / str(steps[0]) / "state").is_dir():
        raise CheckpointError(f"{path} holds no export and no checkpoint{'' if step is None else f' {step}'}; "
                              "pass an export directory or the --workdir of a training run")  # fmt: skip
    return steps


def _export_config(path: pathlib.Path) -> tuple[RunConfig, int]:
    """An export's config, and the step it was exported from."""
    stored = json.loads((path / "config.json").read_text())
    return RunConfig.from_dict({k: v for k, v in stored.items() if k != "export_step"}), stored.get("export_step", -1)


def stored_config(path: str | pathlib.Path) -> RunConfig:
    """The config of an export, a Hugging Face Llama, or a training run's latest checkpoint whose
    metadata reads."""
    path = pathlib.Path(path).absolute()
    if is_hf_dir(path):
        return stored_hf_config(path)
    if _is_export(path):
        return _export_config(path)[0]
    steps = _steps(path, None)
    for step in steps:
        try:
            return saved_config(path, step)
        except UNREADABLE:
            continue
    raise CheckpointError(f"no checkpoint of {path} has readable metadata ({steps}); pass an export or another run")


def load_params(
    path: str | pathlib.Path,
    mesh: Mesh | None = None,
    dtype: Any = None,
    step: int | None = None,
    quantize: str | None = None,
    only: tuple[str, ...] | None = None,
) -> tuple[RunConfig, dict, int]:
    """(config, params, step) from an export directory, a Hugging Face Llama directory (step 0)
    or a training run's workdir (its latest checkpoint that reads back, or `step`). Params land
    in `mesh`'s shardings (default: the first device), cast to `dtype` (default: the config's
    param_dtype); a checkpoint's optimizer state is never read. With `quantize="int8"`,
    full-precision params are quantized from their stored dtype (an int8 export's weights are
    read as they are) and the config says so. LoRA adapters are folded into their base weights
    (W + a·b·alpha/rank, quantized again on an int8 base) and the config has none. With `only`
    (a parameter's path, e.g. ("embed",)), the params hold that one parameter as stored (not with
    `quantize`)."""
    path = pathlib.Path(path).absolute()
    mesh = mesh or make_mesh(ParallelConfig(data=1), jax.devices()[:1])
    if quantize is not None and only is not None:
        raise ValueError("load_params reads one parameter (only=) in full precision; drop quantize")

    def target_of(cfg: RunConfig) -> dict:
        target = abstract_params(Model(cfg.model).specs, mesh, (quantize is None and dtype) or cfg.model.param_dtype)
        if only is None:
            return target
        part = at_path(target, only)
        for key in reversed(only):
            part = {key: part}
        return part

    cfg, params, step = _read_params(path, target_of, step)
    if only is not None:
        return cfg, params, step
    if cfg.model.lora.rank:
        params, model = merge_adapters(params, cfg.model)
        cfg = cfg.updated(model=model.to_dict())
        quantize = quantize or model.quantize  # an int8 base's merged weights are quantized again
    if quantize is None:
        return cfg, params, step
    params = quantize_params(params, cfg.model, mesh, dtype or cfg.model.param_dtype)
    return cfg.updated(model=dict(quantize=quantize)), params, step


def read_into(path: str | pathlib.Path, target: dict) -> dict:
    """The params of the export, Hugging Face Llama or training run (its latest readable
    checkpoint) at `path`, read straight into `target`'s shapes, dtypes and shardings (a run's
    canonical layout, say): how fine-tuning starts."""
    return _read_params(pathlib.Path(path).absolute(), lambda cfg: target, None)[1]


def _read_params(
    path: pathlib.Path, target_of: Callable[[RunConfig], dict], step: int | None
) -> tuple[RunConfig, dict, int]:
    """(config, params laid out as `target_of(config)`, step) of whatever is at `path`."""
    if is_hf_dir(path):
        cfg = stored_config(path)
        return cfg, read_hf_params(path, cfg.model, target_of(cfg)), 0
    if _is_export(path):
        cfg, step = _export_config(path)
        return cfg, _restore(path / "params", target_of(cfg)), step
    steps = _steps(path, step)
    for step in steps:
        try:
            meta = saved_meta(path, step)
            cfg = RunConfig.from_dict(meta["config"])
            state = _restore(path / "checkpoints" / str(step) / "state", {"params": target_of(cfg)})
            check_checksums(meta, state)
            return cfg, state["params"], step
        except UNREADABLE as e:
            cause = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            log.warning(f"checkpoint: step {step} of {path} cannot be read ({cause})")
    raise CheckpointError(f"no checkpoint of {path} can be read ({steps}; see above); pass an export or another run")


def _restore(directory: pathlib.Path, target: dict) -> dict:
    """The arrays of `target` (a part of what `directory` holds, if it likes) as it lays them out."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(directory, args=args)


def write_export(out: str | pathlib.Path, cfg: RunConfig, params: dict, step: int) -> None:
    """Saves `params` one array at a time and uncompressed: each array in flight holds a copy in
    host memory until written (all of them at once, by default), and weights barely compress."""
    out = pathlib.Path(out).absolute()
    one_at_a_time = (max(a.nbytes for a in jax.tree.leaves(params)) + 1) / 1e9
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, save_concurrent_gb=one_at_a_time)
    ocp.Checkpointer(handler).save(out / "params", args=ocp.args.PyTreeSave(params), force=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict() | {"export_step": step}, indent=2))
