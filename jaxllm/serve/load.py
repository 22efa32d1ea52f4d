"""What a server starts from: a training run's latest readable checkpoint (from any training mesh
or pipeline), an export or a Hugging Face Llama directory; its config with overrides on top, its
tokenizer, and the params alone (a LoRA run's adapters merged into their weights), cast to the
serving dtype and read straight into the serving shardings."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import jax
from jax.sharding import Mesh

from jaxllm import logs
from jaxllm.checkpoint import load_params, stored_config
from jaxllm.checkpoint.hf.config import is_hf_dir
from jaxllm.config import ConfigError, LoraConfig, ModelConfig, require, validate_tensor
from jaxllm.data.tokenizer import Tokenizer, get_tokenizer, has_saved_tokenizer, load_saved_tokenizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.buckets import Buckets
from jaxllm.serve.constraints import mask_words
from jaxllm.serve.engine import Engine
from jaxllm.serve.generation import Limits
from jaxllm.serve.guards import PerplexityAlarm
from jaxllm.serve.mappings import MappingBudget
from jaxllm.serve.runner import Progress, Runner, no_progress
from jaxllm.serve.settings import ServeConfig, Serving, served_model, serving_config

log = logs.get(__name__)

SERVE = "serve."


def serving_setup(
    path: str | pathlib.Path, overrides: dict[str, Any] | None = None, tokenizer: str | None = None
) -> tuple[Serving, Tokenizer]:
    """The model, settings and tokenizer to serve the run or export at `path` (quick: reads no
    params). `overrides` are dotted fields: `serve.*` set the server, the others the stored config;
    `tokenizer` replaces the saved one, which it must match."""
    path, overrides = pathlib.Path(path), overrides or {}
    stored = stored_config(path)  # first: it says when `path` is no run at all
    if is_hf_dir(path):  # its tokenizer.json, if it has one, lies beside its config.json
        saved_tokenizer = get_tokenizer(tokenizer or path)
    else:
        saved_tokenizer = load_saved_tokenizer(path / "tokenizer", tokenizer)
    cfg = stored.overridden({k: v for k, v in overrides.items() if not k.startswith(SERVE)})
    cfg = cfg.updated(model=dict(lora=dict(rank=0)))  # LoRA adapters are folded into their weights at load
    if stored.model.quantize == "int8" and cfg.model.quantize != "int8":
        raise ConfigError(f"{path} holds int8 weights, which serve only as int8; drop the model.quantize override "
                          "or serve the training run it was exported from")  # fmt: skip
    settings = ServeConfig.from_dict({k[len(SERVE) :]: v for k, v in overrides.items() if k.startswith(SERVE)})
    # A draft model's adapters are folded into its weights, as the served model's are.
    draft = stored_config(settings.draft_model).model.replace(lora=LoraConfig()) if settings.draft_model else None
    serving = serving_config(cfg, settings, jax.local_device_count(), jax.default_backend(), draft)
    if draft is not None:
        serving = dataclasses.replace(serving, draft=draft_config(draft, serving.settings, saved_tokenizer))
    return serving, saved_tokenizer


def draft_config(model: ModelConfig, s: ServeConfig, tokenizer: Tokenizer) -> ModelConfig:
    """serve.draft_model's `model` as it computes beside the served one, refused if its tokenizer
    is another or its layout does not fit the serving mesh."""
    path = pathlib.Path(s.draft_model)
    if is_hf_dir(path):
        theirs = get_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    else:
        theirs = load_saved_tokenizer(path / "tokenizer") if has_saved_tokenizer(path / "tokenizer") else None
    require(
        theirs is None or theirs.fingerprint == tokenizer.fingerprint,
        f"serve.draft_model={path} has another tokenizer ({theirs and theirs.name}) than the served model "
        f"({tokenizer.name}); a draft proposes token ids, so pick a draft model trained with the same tokenizer",
    )
    require(
        model.vocab_size >= tokenizer.vocab_size,
        f"serve.draft_model={path} knows {model.vocab_size} token ids and the tokenizer has {tokenizer.vocab_size}; "
        "pick a draft model trained with the served model's tokenizer",
    )
    validate_tensor(model, s.tensor, "serve.tensor (the draft model's too)")
    return served_model(model, s)


def start_engine(
    path: str | pathlib.Path, serving: Serving, tokenizer: Tokenizer, progress: Progress = no_progress
) -> Engine:
    """Reads the params at `path` into the serving shardings and compiles every step (telling
    `progress` of each)."""
    s, model = serving.settings, serving.model
    mesh = make_mesh(serving.parallel, jax.local_devices()[: s.tensor])
    _, params, step = load_params(pathlib.Path(path), mesh, s.dtype, quantize=model.quantize)
    weights = f"int8 weights, {s.dtype} compute" if model.quantize else s.dtype
    log.info(f"serve: step {step} of {pathlib.Path(path).absolute()}, {weights}, {s.kv_dtype} KV cache, tensor "
             f"parallel over {s.tensor}")  # fmt: skip
    draft_params = None
    if serving.draft is not None:
        _, draft_params, draft_step = load_params(s.draft_model, mesh, s.dtype, quantize=serving.draft.quantize)
        log.info(f"serve: drafting with step {draft_step} of {pathlib.Path(s.draft_model).absolute()}")
    budget = MappingBudget(progress)  # XLA:CPU's programs against the kernel's limit on mappings
    started = time.perf_counter()
    engine = build_engine(params, serving, tokenizer, mesh, budget, draft_params)
    steps = len(engine.device.decode_steps) + len(engine.device.prefill_steps)
    log.info(f"serve: {steps} steps ready in {time.perf_counter() - started:.1f} s, {engine.device.steps_cached} of "
             f"them read from the compilation cache{budget.summary()}")  # fmt: skip
    return engine


def build_engine(
    params: dict,
    serving: Serving,
    tokenizer: Tokenizer,
    mesh: Mesh,
    progress: Progress = no_progress,
    draft_params: dict | None = None,
) -> Engine:
    """The engine's host side over a `Runner` of `params` (and the draft model's `draft_params`,
    all in `mesh`'s shardings), every step compiled."""
    s = serving.settings
    limits = Limits.of(serving, tokenizer)
    buckets = Buckets.of(s.slots, s.max_len, s.page_size, s.prefill_chunk)
    words = mask_words(tokenizer.vocab_size)
    runner = Runner(params, serving, mesh, buckets, limits.vocab_size, words, progress, draft_params)
    salt = f"{serving.model}|{s.dtype}|{s.kv_dtype}"  # pages are shared only within one model and dtype
    return Engine(runner, s, limits, tokenizer, PerplexityAlarm(s.ppl_alarm, s.ppl_reject), salt)


def load_engine(
    path: str | pathlib.Path, overrides: dict[str, Any] | None = None, tokenizer: str | None = None
) -> Engine:
    """An engine for the run or export at `path`, every step compiled (see `serving_setup`)."""
    return start_engine(path, *serving_setup(path, overrides, tokenizer))
