"""The decoder's blocks as Flax NNX modules: `Norm`, `Attention` (a group's shared QKV projection),
`FeedForward` and `DecoderLayer`.

Each module declares its weights once (shape, logical axes, initialiser) and is built *stacked*:
the `stack` dims lead every weight, one per group and per layer of a group, so one module holds
the whole depth and the decoder scans over it. Applied to one slice (a group's or a layer's
values), a module computes that group or layer. The arithmetic lives in `layers` as functions over
arrays; tensor parallelism wraps those functions, so modules hand it arrays, never Variables.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.config import ModelConfig
from jaxllm.model import layers
from jaxllm.model.cache import AXES
from jaxllm.model.dense import dense_weight, projections
from jaxllm.model.lora import SUFFIX, adapted, adapter
from jaxllm.model.params import declare, params_of, value_axes
from jaxllm.parallel.rules import constrain
from jaxllm.parallel.tensor_parallel import RESIDUAL, tensor_parallel

ROPE_AXES = ("batch", "seq", None, None)  # a cos or sin table

Stack = tuple[tuple[int, ...], tuple[str, ...]]  # leading (sizes, logical axis names)
UNSTACKED: Stack = ((), ())


def _residual_std(model: ModelConfig) -> float:
    """Scaled init of the projections that write into the residual stream (GPT-2)."""
    return model.init_std / (2 * model.num_layers) ** 0.5


def _adapt(module: nnx.Module, model: ModelConfig, name: str, stack: Stack, shape, axes, contracted: int) -> None:
    """Gives `module`'s weight `name` its LoRA adapter, `{name}_lora`, if `model.lora` targets it."""
    target = "o" if name == "o_proj" else name
    if (extra := adapter(model, target, stack, shape, axes, contracted)) is not None:
        setattr(module, name + SUFFIX, extra)


class Norm(nnx.Module):
    """RMSNorm or LayerNorm (with a bias), computed in fp32."""

    def __init__(self, model: ModelConfig, stack: Stack = UNSTACKED):
        (lead, lead_axes), h = stack, model.hidden
        self.kind, self.eps = model.norm, model.norm_eps
        policy = dict(decay=False, keep_fp32=True)  # a norm computes in fp32, and decay would pull it to 0
        self.scale = declare((*lead, h), (*lead_axes, "embed"), model.param_dtype, "ones", **policy)
        if model.norm == "layernorm":
            self.bias = declare((*lead, h), (*lead_axes, "embed"), model.param_dtype, "zeros", **policy)

    def __call__(self, x: jax.Array) -> jax.Array:
        return layers.norm(x, params_of(self), self.kind, self.eps)


class Attention(nnx.Module):
    """A group's one QKV projection; every layer of the group applies it to its own input, then
    attends and projects out with the layer's own output projection."""

    def __init__(self, model: ModelConfig, stack: Stack = UNSTACKED):
        h, s, std = model.hidden, model, model.init_std
        hd, kv = s.head_dim, s.num_kv_heads
        self.implementation, self.project = model.attention, projections(model)
        for name, heads, head_axis in (("q", model.num_heads, "heads"), ("k", kv, "kv_heads"), ("v", kv, "kv_heads")):
            shape, axes = (h, heads, hd), ("embed", head_axis, "head_dim")
            setattr(self, name, dense_weight(model, stack, shape, axes, 1, std))
            _adapt(self, model, name, stack, shape, axes, 1)

    def __call__(self, x: jax.Array, out: dict, ctx: layers.Context, cached=None):
        """The attention block's output, projected out by `out` (the layer's output projection,
        {"o_proj": ..., and its adapter if any}); with `cached` (a `KVCache` and the layer's index
        in it), (output, keys, values): the cache's pools with this layer's new entries written."""
        project = self.project
        o_axes, o_proj = (adapted({k: f(v) for k, v in out.items()}, "o_proj") for f in (value_axes, params_of))
        if cached is not None:
            cache, layer = cached
            attend = tensor_parallel(
                partial(layers.cached_attention, project=project, implementation=self.implementation),
                value_axes(self), o_axes, (ROPE_AXES,) * 2, AXES, AXES, (), ("batch", None),
                ("batch", None), kept_axes=(AXES, AXES), split_batch=False,
            )  # fmt: skip
            rope, args = ctx.rope, (cache.keys, cache.values, layer, cache.table, ctx.positions)
            return attend(x, params_of(self), o_proj, rope, *args)
        attention = partial(layers.attention, implementation=self.implementation, project=project)
        segments = () if ctx.segment_ids is None else ("batch", "seq")
        attend = tensor_parallel(attention, value_axes(self), o_axes, (ROPE_AXES,) * 2, segments, ())
        return attend(x, params_of(self), o_proj, ctx.rope, ctx.segment_ids, ctx.dropout)


class FeedForward(nnx.Module):
    """GLU (SwiGLU / GeGLU) or plain GELU MLP."""

    def __init__(self, model: ModelConfig, stack: Stack = UNSTACKED):
        h, m = model.hidden, model.mlp
        self.activation, self.project = model.mlp_activation, projections(model)
        self.up = dense_weight(model, stack, (h, m), ("embed", "mlp"), 1, model.init_std)
        self.down = dense_weight(model, stack, (m, h), ("mlp", "embed"), 1, _residual_std(model))
        if model.gated:
            self.gate = dense_weight(model, stack, (h, m), ("embed", "mlp"), 1, model.init_std)
        for name in ("up", "down", "gate") if model.gated else ("up", "down"):
            shape, axes = ((m, h), ("mlp", "embed")) if name == "down" else ((h, m), ("embed", "mlp"))
            _adapt(self, model, name, stack, shape, axes, 1)

    def __call__(self, x: jax.Array, dropout: jax.Array | None = None) -> jax.Array:
        mlp = partial(layers.feed_forward, activation=self.activation, project=self.project)
        run = tensor_parallel(mlp, value_axes(self), ())
        return run(x, params_of(self), dropout)


class DecoderLayer(nnx.Module):
    """One pre-norm layer; its group's `Attention` comes in as an argument (shared by structure)."""

    def __init__(self, model: ModelConfig, stack: Stack = UNSTACKED):
        head_dims = (model.num_heads, model.head_dim)
        self.attn_norm = Norm(model, stack)
        o_shape, o_axes = (*head_dims, model.hidden), ("heads", "head_dim", "embed")
        self.o_proj = dense_weight(model, stack, o_shape, o_axes, 2, _residual_std(model))
        _adapt(self, model, "o_proj", stack, o_shape, o_axes, 2)
        self.mlp_norm = Norm(model, stack)
        self.mlp = FeedForward(model, stack)

    def __call__(self, x: jax.Array, qkv: Attention, ctx: layers.Context, cached=None):
        """The layer's output; with `cached` (see `Attention`), (output, (keys, values))."""
        x = checkpoint_name(x, "layer_input")
        out = {k: getattr(self, k) for k in ("o_proj", "o_proj" + SUFFIX) if hasattr(self, k)}
        attended = qkv(self.attn_norm(x), out, ctx, cached)
        out, new = (attended[0], attended[1:]) if cached is not None else (attended, None)
        x = x + out
        x = x + checkpoint_name(self.mlp(self.mlp_norm(x), ctx.dropout), "mlp_out")
        x = constrain(x, *RESIDUAL)
        return x if cached is None else (x, new)
