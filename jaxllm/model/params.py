"""Parameters as the modules declare them, and the plain dicts that every JAX boundary sees.

A module declares each weight once (`declare`: shape, logical axis names, initialiser, and its
policy: whether weight decay applies, whether it stays fp32 where the compute is bf16, whether int8
serving quantizes it); the rest is derived: `specs_of` (a view of the modules' state that the
rules table, optimizer, pipeline and planner read), `params_of` (the plain dict of arrays that jit,
scan, shard_map and Orbax see) and `init_params`. Initial values are a pure function of
(seed, parameter path), never of the mesh, RNG counters or construction order, so every layout
starts from bit-identical weights; init runs under `jit` with sharded outputs, so no device ever
materialises a whole parameter.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # 'normal' | 'ones' | 'zeros'
    std: float = 0.0
    dtype: str | None = None  # a storage dtype of its own (int8 weights, their scales); None: the param dtype
    decay: bool = True  # AdamW's weight decay applies
    keep_fp32: bool = False  # computes in fp32 whatever the compute dtype (a norm's own arithmetic)
    quantizable: bool = False  # a projection's weight: int8 serving stores it in int8
    adapter: bool = False  # a LoRA adapter: with adapters, only these train


def declare(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype: Any,
    init: str = "normal",
    std: float = 0.0,
    own_dtype: bool = False,
    decay: bool = True,
    keep_fp32: bool = False,
    quantizable: bool = False,
    adapter: bool = False,
) -> nnx.Param:
    """A parameter with its logical axis names, initialiser and policy (see `ParamSpec`), holding
    only its shape until the decoder gives every parameter its value by path. No eager sharding:
    placement comes from the rules table through `jit(out_shardings)`. With `own_dtype`, it keeps
    `dtype` whatever dtype the other params are cast to (int8 weights and their scales)."""
    fixed = jnp.dtype(dtype).name if own_dtype else None
    return nnx.Param(
        jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
        out_sharding=axes, init=init, std=std, own_dtype=fixed, decay=decay, keep_fp32=keep_fp32,
        quantizable=quantizable, adapter=adapter, eager_sharding=False,
    )  # fmt: skip


def _param_tree(module: nnx.Module, leaf: Callable[[nnx.Param], Any]) -> dict:
    """`leaf(param)` for every parameter of `module`, nested by attribute name (the checkpoint schema)."""
    tree: dict = {}
    for path, param in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf(param)
    return tree


def params_of(module: nnx.Module) -> Params:
    """The module's parameters as a plain dict of arrays (a lone parameter's value as is)."""
    if isinstance(module, nnx.Param):
        return module.get_value()
    return _param_tree(module, lambda p: p.get_value())


def specs_of(module: nnx.Module) -> dict[str, Any]:
    """The module's parameters as ParamSpecs (shape, logical axes, initialiser, policy)."""
    return _param_tree(module, lambda p: ParamSpec(tuple(p.shape), tuple(p.out_sharding), p.init, p.std, p.own_dtype,
                                                   p.decay, p.keep_fp32, p.quantizable, p.adapter))  # fmt: skip


def value_axes(param: nnx.Param | nnx.Module) -> Any:
    """Logical axes of the dims a parameter's value has now. A stacked module applied to one slice
    (a group, a layer) holds values without the leading stack dims its declaration names."""
    if isinstance(param, nnx.Module):
        return _param_tree(param, value_axes)
    axes = tuple(param.out_sharding)
    return axes[len(axes) - param.ndim :]


def storage_dtype(spec: ParamSpec, dtype: Any) -> jnp.dtype:
    """What a parameter is stored in when the params are in `dtype`."""
    return jnp.dtype(spec.dtype or dtype)


def at_path(tree: dict, path: tuple[str, ...]) -> Any:
    """The subtree of a nested dict at `path` (e.g. ("groups", "qkv", "q"))."""
    for key in path:
        tree = tree[key]
    return tree


def holds(tree: dict, path: tuple[str, ...]) -> bool:
    """Whether a nested dict has something at `path`."""
    try:
        at_path(tree, path)
    except (KeyError, TypeError):
        return False
    return True


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def path_key(key: jax.Array, path: tuple) -> jax.Array:
    """A key that depends only on the base key and the parameter's path."""
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    return jax.random.fold_in(key, zlib.crc32(name.encode()))


@partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    """One compiled program per weight, run eagerly or inlined in the trainer's jit alike: XLA's
    fusion moves the last bit of `std * normal(...)`, so op-by-op it would differ by an ulp."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def init_params(specs: dict[str, Any], key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Initial values from the base `key` (`jax.random.key(seed)`) and each parameter's path, in
    `dtype` unless a parameter has its own."""

    def init(path: tuple, spec: ParamSpec) -> jax.Array:
        stored = storage_dtype(spec, dtype)
        if spec.init == "ones":
            return jnp.ones(spec.shape, stored)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, stored)
        return _normal(path_key(key, path), spec.shape, spec.std, stored)

    return jax.tree_util.tree_map_with_path(init, specs, is_leaf=is_spec)


def count(specs: dict[str, Any]) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))
