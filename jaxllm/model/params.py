"""Parameter table: every weight's shape, logical axis names and initialiser in one place.

Initial values are a pure function of (seed, parameter path), never of the mesh, so every
layout starts from bit-identical weights; init runs under `jit` with sharded outputs, so no
device ever materialises a whole parameter.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxllm.config import head_dim, num_kv_heads, padded_vocab
from jaxllm.parallel.pipeline import Schedule

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # 'normal' | 'ones' | 'zeros'
    std: float = 0.0


def _norm(model: ml_collections.ConfigDict, lead: tuple[int, ...], lead_axes: tuple) -> dict[str, ParamSpec]:
    spec = {"scale": ParamSpec((*lead, model.hidden), (*lead_axes, "embed"), "ones")}
    if model.norm == "layernorm":
        spec["bias"] = ParamSpec((*lead, model.hidden), (*lead_axes, "embed"), "zeros")
    return spec


def param_specs(model: ml_collections.ConfigDict, schedule: Schedule | None = None) -> dict[str, Any]:
    """Nested dict of ParamSpec. Layer groups are stacked on a leading `layers` dim (scanned), or
    with a pipeline `schedule` on [repeats, stage, layers] (the same values, reshaped); the layers of
    a group on a further `sublayers` dim. Each group owns one QKV projection."""
    h, nh, kv, hd, mlp = model.hidden, model.num_heads, num_kv_heads(model), head_dim(model), model.mlp
    k = model.qkv_share_every
    g = model.num_layers // k
    std = model.init_std
    out_std = std / (2 * model.num_layers) ** 0.5  # scaled residual-branch init (GPT-2)
    if schedule is None:
        gs, ga = (g,), ("layers",)
    else:
        r, s = schedule.repeats, schedule.stages
        gs, ga = (r, s, g // (r * s)), ("repeats", "stage", "layers")
    lg, la = (*gs, k), (*ga, "sublayers")

    ffn = {
        "up": ParamSpec((*lg, h, mlp), (*la, "embed", "mlp"), std=std),
        "down": ParamSpec((*lg, mlp, h), (*la, "mlp", "embed"), std=out_std),
    }
    if model.mlp_activation in ("swiglu", "geglu"):
        ffn["gate"] = ParamSpec((*lg, h, mlp), (*la, "embed", "mlp"), std=std)

    specs = {
        "embed": ParamSpec((padded_vocab(model), h), ("vocab", "embed"), std=std),
        "groups": {
            "qkv": {
                "q": ParamSpec((*gs, h, nh, hd), (*ga, "embed", "heads", "head_dim"), std=std),
                "k": ParamSpec((*gs, h, kv, hd), (*ga, "embed", "kv_heads", "head_dim"), std=std),
                "v": ParamSpec((*gs, h, kv, hd), (*ga, "embed", "kv_heads", "head_dim"), std=std),
            },
            "layers": {
                "attn_norm": _norm(model, lg, la),
                "o_proj": ParamSpec((*lg, nh, hd, h), (*la, "heads", "head_dim", "embed"), std=out_std),
                "mlp_norm": _norm(model, lg, la),
                "mlp": ffn,
            },
        },
        "final_norm": _norm(model, (), ()),
    }
    if not model.tie_embeddings:
        specs["lm_head"] = ParamSpec((h, padded_vocab(model)), ("embed", "vocab"), std=std)
    return specs


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def is_norm(path: tuple) -> bool:
    """Norm scales and biases: no weight decay, and kept in fp32 for the norm's own arithmetic."""
    return any("norm" in str(getattr(p, "key", "")) for p in path)


def path_key(seed: int, path: tuple) -> jax.Array:
    """A key that depends only on the seed and the parameter's path."""
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))


def init_params(specs: dict[str, Any], seed: int, dtype: Any = jnp.float32) -> Params:
    def init(path: tuple, spec: ParamSpec) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (spec.std * jax.random.normal(path_key(seed, path), spec.shape, jnp.float32)).astype(dtype)

    return jax.tree_util.tree_map_with_path(init, specs, is_leaf=is_spec)


def count(specs: dict[str, Any]) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))
