"""A LoRA run's adapters as a Hugging Face PEFT adapter directory (`adapter_config.json` and
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the
Llama the run started from.

PEFT's adapter of a Linear [out, in] is lora_A [rank, in] and lora_B [out, rank], scaled by
lora_alpha / r: ours are a [*inputs, rank] and b [rank, *outputs] with the same scale, so the
tensors are reshaped and transposed, never rescaled. A shared QKV's adapter goes into every layer
of its group, as its weight does (`--expand-shared-qkv`)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

import jax
import numpy as np

from jaxllm.checkpoint.hf.files import write_weights
from jaxllm.checkpoint.hf.tensors import rules
from jaxllm.config import ModelConfig
from jaxllm.model.decoder import Model
from jaxllm.model.lora import adapter_path, has_adapter

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."  # PeftModelForCausalLM's path to the Llama's modules


def write_peft(
    out: pathlib.Path, model: ModelConfig, parameter: Callable[[tuple[str, ...]], dict], base: str | None, dtype: str
) -> pathlib.Path:
    """Writes the adapters of `model` (each asked of `parameter(path)` once, {a, b}) in `dtype`,
    and the config naming `base`, the model they adapt; returns the weights' file."""
    specs, lora, share = Model(model).specs, model.lora, model.qkv_share_every
    adapted = [rule for rule in rules(model) if rule.stack and has_adapter(specs, rule.ours)]
    tensors, producers, current = [], {}, {}
    for rule in adapted:
        module = rule.hf.removesuffix(".weight")
        out_dim, in_dim = rule.hf_shape
        for layer in range(model.num_layers):
            index = (layer // share,) if rule.stack == "groups" else (layer // share, layer % share)
            for part, shape in (("lora_A", (lora.rank, in_dim)), ("lora_B", (out_dim, lora.rank))):
                name = PREFIX + module.format(layer=layer) + f".{part}.weight"
                tensors.append((name, shape))
                producers[name] = (rule.ours, index, part)

    def produce(name: str) -> np.ndarray:
        path, index, part = producers[name]
        if path not in current:
            current.clear()
            current[path] = parameter(adapter_path(path))
        ab = current[path]
        if part == "lora_A":  # a [*inputs, rank] → [rank, in]
            a = np.asarray(jax.device_get(ab["a"][index]))
            return a.reshape(-1, lora.rank).T
        b = np.asarray(jax.device_get(ab["b"][index]))  # b [rank, *outputs] → [out, rank]
        return b.reshape(lora.rank, -1).T

    out.mkdir(parents=True, exist_ok=True)
    (written,) = write_weights(out, tensors, produce, dtype, max_shard_bytes=1 << 62)
    os.replace(written, out / ADAPTER_FILE)
    modules = sorted({rule.hf.removesuffix(".weight").rsplit(".", 1)[-1] for rule in adapted})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
        "modules_to_save": None,
    }  # fmt: skip
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out / ADAPTER_FILE
