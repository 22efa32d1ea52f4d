"""Parameter counts by component, from the same declarations as the model, and the weights' bytes
at each width."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import int8_model
from jaxllm.model.params import is_spec, storage_dtype


def param_counts(model: ModelConfig) -> dict[str, int]:
    """Stored parameters by component (no biases; LayerNorm adds one bias per scale)."""
    s, h, nh, m, layers = model, model.hidden, model.num_heads, model.mlp, model.num_layers
    norm = h * (2 if model.norm == "layernorm" else 1)
    counts = {
        "embedding": s.padded_vocab * h,
        "lm_head": 0 if model.tie_embeddings else h * s.padded_vocab,
        "qkv (shared per group)": s.groups * h * (nh + 2 * s.num_kv_heads) * s.head_dim,
        "attention out": layers * nh * s.head_dim * h,
        "feed-forward": layers * s.ffn_matrices * h * m,
        "norms": (2 * layers + 1) * norm,
        "LoRA adapters": lora_count(model),
    }
    counts["total"] = sum(counts.values())
    return counts


def lora_count(model: ModelConfig, applied: bool = False) -> int:
    """The adapters' parameters: rank × (inputs + outputs) of each targeted projection, per group
    for the shared q/k/v (per layer that applies them, if `applied`), per layer for the others."""
    s, h, r = model, model.hidden, model.lora.rank
    q, kv, m = model.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, model.mlp
    qkv = s.num_layers if applied else s.groups
    sizes = {"q": (qkv, h + q), "k": (qkv, h + kv), "v": (qkv, h + kv), "o": (s.num_layers, q + h),
             "up": (s.num_layers, h + m), "down": (s.num_layers, m + h), "gate": (s.num_layers, h + m)}  # fmt: skip
    targets = [t for t in model.lora.target_names if t != "gate" or model.gated]
    return r * sum(sizes[t][0] * sizes[t][1] for t in targets)


def megatron_extras(model: ModelConfig, seq_len: int) -> dict[str, int]:
    """What the Megatron-LM paper's count (Narayanan et al. 2021) has that this model does not:
    learned position embeddings and a bias on every linear layer."""
    s, h = model, model.hidden
    per_layer = (model.num_heads + 2 * s.num_kv_heads) * s.head_dim + h + (s.ffn_matrices - 1) * model.mlp + h
    return {"learned positions": seq_len * h, "linear biases": model.num_layers * per_layer}


def megatron_formula(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021, eq. for GPT parameters: 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))


def applied_matmul_params(model: ModelConfig) -> int:
    """Weights each token is multiplied by: the shared QKV counts once per layer that applies it,
    and the LM head counts even when tied (the lookup table does not)."""
    s, h, nh = model, model.hidden, model.num_heads
    per_layer = h * (nh + 2 * s.num_kv_heads) * s.head_dim + nh * s.head_dim * h + s.ffn_matrices * h * model.mlp
    return model.num_layers * per_layer + h * s.padded_vocab


WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def weight_bytes(model: ModelConfig) -> dict[str, float]:
    """The weights' bytes at each width (every parameter), and as `--quantize int8` serves them:
    dense projections int8 with fp32 scales, the embedding, head and norms in bf16."""
    total = param_counts(model)["total"]
    out = {width: total * size for width, size in WEIGHT_BYTES.items()}
    specs = jax.tree.leaves(Model(int8_model(model)).specs, is_leaf=is_spec)
    out["int8 as served"] = sum(math.prod(s.shape) * storage_dtype(s, jnp.bfloat16).itemsize for s in specs)
    return out
