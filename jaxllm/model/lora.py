"""LoRA: low-rank adapters on the dense projections (`model.lora`).

A targeted weight W (its first `contracted` dims summed over) gains two small parameters beside it,
`{name}_lora` = {a: [*contracted dims, rank], b: [rank, *output dims]}, and its projection becomes
x·W + (x·a)·b · alpha/rank. `b` starts at zero, so a fresh adapter changes nothing. The base W keeps
its path, so base weights load from any checkpoint or Hugging Face directory as they are. Adapters
carry the logical axes of the dims they share with W (the rank dim is whole everywhere), so the rules
table shards them like their base on every layout, the pipeline included; they stay fp32 whatever
the base's dtype, and with adapters only they train (`trained_mask`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import LoraConfig, ModelConfig
from jaxllm.model.int8 import dequantize
from jaxllm.model.params import Params, declare, holds, is_spec
from jaxllm.parallel.collectives import varying_axes

SUFFIX = "_lora"


class Adapter(nnx.Module):
    """The adapter of a weight of `shape` behind the `stack` dims."""

    def __init__(self, stack, shape: tuple[int, ...], axes: tuple[str, ...], contracted: int, rank: int):
        lead, lead_axes = stack
        fan_in = math.prod(shape[:contracted])
        policy = dict(own_dtype=True, adapter=True)
        self.a = declare((*lead, *shape[:contracted], rank), (*lead_axes, *axes[:contracted], "lora_rank"),
                         jnp.float32, std=fan_in**-0.5, **policy)  # fmt: skip
        self.b = declare((*lead, rank, *shape[contracted:]), (*lead_axes, "lora_rank", *axes[contracted:]),
                         jnp.float32, "zeros", **policy)  # fmt: skip


def adapter(model: ModelConfig, target: str, stack, shape, axes, contracted: int) -> Adapter | None:
    """The adapter of projection `target` ('q', ..., 'down'), if `model.lora` adapts it."""
    lora = model.lora
    if lora.rank == 0 or target not in lora.target_names:
        return None
    return Adapter(stack, shape, axes, contracted, lora.rank)


class Adapted(NamedTuple):
    """A weight and its adapter's arrays, as the projection op takes them; `dropout`, a key while
    training with `model.lora.dropout`."""

    base: Any
    a: jax.Array
    b: jax.Array
    dropout: jax.Array | None = None


TARGET_IDS = {name: i for i, name in enumerate(("q", "k", "v", "o_proj", "gate", "up", "down"))}


def adapted(params: Params, name: str, dropout: jax.Array | None = None) -> Any:
    """`params[name]`, with its adapter if it has one (an `Adapted`), and with `dropout` (a layer's
    key, None when not training) the adapter's own key."""
    extra = params.get(name + SUFFIX)
    return params[name] if extra is None else Adapted(params[name], extra["a"], extra["b"], _own(dropout, name))


def with_dropout(weight: Any, dropout: jax.Array | None, name: str) -> Any:
    """An `Adapted` weight that arrived without a key, given its own (any other weight as it is)."""
    return weight._replace(dropout=_own(dropout, name)) if isinstance(weight, Adapted) else weight


def _own(dropout: jax.Array | None, name: str) -> jax.Array | None:
    return None if dropout is None else jax.random.fold_in(dropout, TARGET_IDS[name])


def with_adapters(project, scale: float, rate: float = 0.0):
    """The projection op `project` that also takes `Adapted` weights: x·W by `project` (plain, FP8
    or int8), plus the low-rank path in x's dtype, differentiated by JAX; with `rate`, on x with
    that fraction dropped (PEFT's `lora_dropout`) wherever the weight carries a key."""

    def run(x: jax.Array, weights: tuple, spec: str) -> tuple[jax.Array, ...]:
        bases = tuple(w.base if isinstance(w, Adapted) else w for w in weights)
        outs = project(x, bases, spec)
        pairs = zip(outs, weights, strict=True)
        return tuple(y + _low_rank(x, w, spec, scale, rate) if isinstance(w, Adapted) else y for y, w in pairs)

    return run


def dropped(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of `x`. Inside a manual region the key is folded with this device's index
    along each axis x varies over, so that every shard draws its own mask: the masks depend on the
    layout, their rate does not."""
    for axis in sorted(varying_axes(x)):
        key = jax.random.fold_in(key, jax.lax.axis_index(axis))
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _low_rank(x: jax.Array, w: Adapted, spec: str, scale: float, rate: float) -> jax.Array:
    """(x·a)·b·scale for the einsum `spec` of the base projection (e.g. "bte,ehd->bthd")."""
    (x_dims, w_dims), out_dims = spec.split("->")[0].split(","), spec.split("->")[1]
    kept = "".join(c for c in x_dims if c not in w_dims)
    w_out = "".join(c for c in w_dims if c not in x_dims)
    contracted = w_dims[: len(w_dims) - len(w_out)]
    a, b = w.a.astype(x.dtype), w.b.astype(x.dtype)
    if rate and w.dropout is not None:
        x = dropped(x, w.dropout, rate)
    down = jnp.einsum(f"{x_dims},{contracted}z->{kept}z", x, a)
    return (jnp.einsum(f"{kept}z,z{w_out}->{out_dims}", down, b) * scale).astype(x.dtype)


def adapter_mask(specs: dict) -> dict:
    """Which parameters are adapters."""
    return jax.tree.map(lambda s: s.adapter, specs, is_leaf=is_spec)


def trained_mask(specs: dict, model: ModelConfig) -> dict:
    """Which parameters train: every one, or with adapters only the adapters."""
    return jax.tree.map(lambda s: model.lora.rank == 0 or s.adapter, specs, is_leaf=is_spec)


def partition(tree: dict, mask: dict) -> tuple[dict, dict]:
    """(the leaves where `mask` is true, the others): two nested dicts, each holding only its own
    leaves, that `combine` puts back together."""
    chosen, rest = {}, {}
    for key, value in tree.items():
        if isinstance(mask[key], dict):
            yes, no = partition(value, mask[key])
            chosen.update({key: yes} if yes else {})
            rest.update({key: no} if no else {})
        else:
            (chosen if mask[key] else rest)[key] = value
    return chosen, rest


def combine(a: dict, b: dict) -> dict:
    """The union of two nested dicts with disjoint leaves (see `partition`)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = combine(out[key], value) if key in out else value
    return out


def adapter_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where the adapter of the weight at `path` lies in the params."""
    return (*path[:-1], path[-1] + SUFFIX)


def has_adapter(specs: dict, path: tuple[str, ...]) -> bool:
    return holds(specs, adapter_path(path))


def merge_adapters(params: Params, model: ModelConfig) -> tuple[Params, ModelConfig]:
    """(params with each adapter folded into its base weight, W + a·b·scale in W's dtype; the model
    config without adapters): what serving and a merged export use."""
    scale = model.lora.scale if model.lora.rank else 0.0

    def folded(tree: dict) -> dict:
        out = {}
        for key, value in tree.items():
            if key.endswith(SUFFIX):
                continue
            extra = tree.get(key + SUFFIX)
            if extra is not None:
                out[key] = fold(value, extra, scale)
            else:
                out[key] = folded(value) if isinstance(value, dict) else value
        return out

    return folded(params), model.replace(lora=LoraConfig())


def fold(w: jax.Array | dict, extra: dict, scale: float) -> jax.Array:
    """W + a·b·scale, in fp32, back in W's dtype (fp32 for an int8 W, {"q", "scale"}, which the sum
    no longer fits); a and b lead with the same stack dims as W."""
    a, b = extra["a"].astype(jnp.float32), extra["b"].astype(jnp.float32)
    # w: [*stack, *inputs, *outputs], a: [*stack, *inputs, rank], b: [*stack, rank, *outputs]
    lead = a.ndim + b.ndim - 2 - (w["q"] if isinstance(w, dict) else w).ndim
    letters = "abcdefghijklmnopqrstuvwxy"
    stack, ins, outs = letters[:lead], letters[lead : a.ndim - 1], letters[a.ndim - 1 : a.ndim - 1 + b.ndim - lead - 1]
    delta = jnp.einsum(f"{stack}{ins}z,{stack}z{outs}->{stack}{ins}{outs}", a, b)
    if isinstance(w, dict):
        return dequantize(w, range(lead, a.ndim - 1)) + delta * scale
    return (w.astype(jnp.float32) + delta * scale).astype(w.dtype)
