"""What a server starts from: a training run's latest readable checkpoint (from any training mesh
or pipeline), an export or a Hugging Face Llama directory; its config with `serve.*` overrides on
top, its tokenizer, and the params alone, cast to the serving dtype and read straight into the
serving shardings."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import ml_collections

from jaxllm.checkpoint import load_params, stored_config
from jaxllm.config import ConfigError, apply_overrides
from jaxllm.data.tokenizer import Tokenizer, get_tokenizer, load_saved_tokenizer
from jaxllm.hf.config import is_hf_dir
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.engine import Engine
from jaxllm.serve.settings import serving_config


def serving_setup(
    path: str | pathlib.Path, overrides: dict[str, Any] | None = None, tokenizer: str | None = None
) -> tuple[ml_collections.ConfigDict, Tokenizer]:
    """The config and tokenizer to serve the run or export at `path` (quick: reads no params).
    `overrides` are dotted config fields; `tokenizer` replaces the saved one, which it must match."""
    path = pathlib.Path(path)
    if is_hf_dir(path):  # its tokenizer.json, if it has one, lies beside its config.json
        saved_tokenizer = get_tokenizer(tokenizer or path)
    else:
        saved_tokenizer = load_saved_tokenizer(path / "tokenizer", tokenizer)
    cfg = stored_config(path)
    stored_int8 = cfg.model.quantize == "int8"
    apply_overrides(cfg, overrides or {})
    if stored_int8 and cfg.model.quantize != "int8":
        raise ConfigError(f"{path} holds int8 weights, which serve only as int8; drop the model.quantize override "
                          "or serve the training run it was exported from")  # fmt: skip
    return serving_config(cfg, jax.local_device_count()), saved_tokenizer


def start_engine(path: str | pathlib.Path, cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Engine:
    """Reads the params at `path` into the serving shardings and compiles every step."""
    mesh = make_mesh(cfg.parallel, jax.local_devices()[: cfg.serve.tensor])
    _, params, step = load_params(pathlib.Path(path), mesh, cfg.serve.dtype, quantize=cfg.model.quantize)
    weights = f"int8 weights, {cfg.serve.dtype} compute" if cfg.model.quantize else cfg.serve.dtype
    print(f"serve: step {step} of {pathlib.Path(path).absolute()}, {weights}, {cfg.serve.kv_dtype} KV cache, tensor "
          f"parallel over {cfg.serve.tensor}", flush=True)  # fmt: skip
    return Engine(params, cfg, tokenizer, mesh)


def load_engine(
    path: str | pathlib.Path, overrides: dict[str, Any] | None = None, tokenizer: str | None = None
) -> Engine:
    """An engine for the run or export at `path`, every step compiled (see `serving_setup`)."""
    return start_engine(path, *serving_setup(path, overrides, tokenizer))
