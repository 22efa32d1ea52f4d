"""The decoder: embedding → scanned stack of shared-QKV layer groups → final norm → LM head.

Tensor parallelism is Megatron-style and explicit: each attention and feed-forward block runs in a
`shard_map` over the `tensor` axis on its own heads / mlp slice (QKV, gate, up column-parallel;
out, down row-parallel) and ends in one all-reduce. Data and FSDP sharding stay automatic.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxllm.config import head_dim, padded_vocab
from jaxllm.model import layers
from jaxllm.model.params import is_norm, param_specs
from jaxllm.parallel.collectives import all_reduce_sum, to_varying
from jaxllm.parallel.pipeline import Schedule, pipeline_stack
from jaxllm.parallel.rules import constrain, manual_spec

# Activations that the 'selective' policy keeps (and 'offload' moves to host) instead of recomputing.
SAVED_NAMES = ("layer_input", "qkv_proj", "attn_out", "mlp_in", "mlp_out")


class Context(NamedTuple):
    """Per-sequence inputs every layer needs, computed once per forward pass."""

    rope: tuple[jax.Array, jax.Array]
    mask: jax.Array


def _tensor_parallel(fn: Callable, *in_specs) -> Callable:
    """Runs `fn` on each `tensor` shard and all-reduces its partial outputs. Built per trace, as
    shard_map binds the mesh in context at its first call. Inside a region already manual over
    `tensor` (the pipeline) it needs no shard_map; without tensor parallelism `fn` runs as is."""

    def summed(x, *args):
        return all_reduce_sum(fn(to_varying(x, "tensor"), *args), "tensor")

    mesh = jax.sharding.get_abstract_mesh()
    if "tensor" in mesh.manual_axes:
        return summed
    if mesh.shape.get("tensor", 1) == 1:
        return fn
    return jax.shard_map(summed, in_specs=in_specs, out_specs=P(), axis_names={"tensor"})


_QKV_SPECS = {
    "q": manual_spec("embed", "heads", "head_dim"),
    "k": manual_spec("embed", "kv_heads", "head_dim"),
    "v": manual_spec("embed", "kv_heads", "head_dim"),
}


def _attention() -> Callable:
    return _tensor_parallel(layers.attention, P(), _QKV_SPECS, manual_spec("heads", "head_dim", "embed"), P(), P())


def _feed_forward(activation: str) -> Callable:
    specs = {"up": manual_spec("embed", "mlp"), "down": manual_spec("mlp", "embed")}
    if activation != "gelu":
        specs["gate"] = manual_spec("embed", "mlp")
    return _tensor_parallel(partial(layers.feed_forward, activation=activation), P(), specs)


def layer_forward(x: jax.Array, qkv: dict, p: dict, ctx: Context, model: ml_collections.ConfigDict) -> jax.Array:
    """One pre-norm layer using its group's shared QKV weights."""
    x = checkpoint_name(x, "layer_input")
    h = layers.norm(x, p["attn_norm"], model.norm, model.norm_eps)
    x = x + _attention()(h, qkv, p["o_proj"], ctx.rope, ctx.mask)
    h = layers.norm(x, p["mlp_norm"], model.norm, model.norm_eps)
    x = x + checkpoint_name(_feed_forward(model.mlp_activation)(h, p["mlp"]), "mlp_out")
    return constrain(x, "batch", "seq", "act_embed")


def _remat_wrappers(policy: str) -> tuple[Callable, Callable]:
    """(layer wrapper, group wrapper) implementing a named remat policy."""
    cp = jax.checkpoint_policies
    layer_policies = {
        "full": cp.nothing_saveable,
        "selective": cp.save_only_these_names(*SAVED_NAMES),
        "dots": cp.checkpoint_dots,
        "offload": cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        ),
    }

    def keep(f):
        return f

    if policy == "none":
        return keep, keep
    if policy == "group":
        return keep, partial(jax.checkpoint, policy=cp.nothing_saveable)
    return partial(jax.checkpoint, policy=layer_policies[policy]), keep


def group_forward(x: jax.Array, group: dict, ctx: Context, model: ml_collections.ConfigDict) -> jax.Array:
    """The `qkv_share_every` layers of one group, all applying the group's QKV projection."""
    wrap_layer, _ = _remat_wrappers(model.remat)
    step = wrap_layer(partial(layer_forward, model=model))
    for i in range(model.qkv_share_every):
        x = step(x, group["qkv"], jax.tree.map(lambda a, i=i: a[i], group["layers"]), ctx)
    return x


def decoder_stack(groups: dict, x: jax.Array, ctx: Context, model: ml_collections.ConfigDict) -> jax.Array:
    """Scans over the stacked groups, so compile time does not grow with depth."""
    _, wrap_group = _remat_wrappers(model.remat)
    body = wrap_group(partial(group_forward, model=model))
    x, _ = jax.lax.scan(lambda carry, g: (body(carry, g, ctx), None), x, groups)
    return x


def make_context(
    model: ml_collections.ConfigDict, tokens: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None
) -> Context:
    b, t = tokens.shape
    index = jnp.broadcast_to(jnp.arange(t), (b, t))
    positions = index if positions is None else positions
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    rope = layers.rope_tables(positions, head_dim(model), model.rope_theta)
    return Context(rope, layers.attention_mask(index, index, segment_ids, segment_ids))


def forward(
    params: dict,
    tokens: jax.Array,
    model: ml_collections.ConfigDict,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    schedule: Schedule | None = None,
) -> jax.Array:
    """fp32 logits [batch, seq, padded_vocab]; padded vocab entries are masked to NEG_INF.
    With a pipeline `schedule`, params hold the groups in its view (see `param_specs`)."""
    dt = jnp.dtype(model.dtype)
    ctx = make_context(model, tokens, segment_ids, positions)
    # Gather the table's FSDP shards first (as for any weight), then look up vocab-sharded rows.
    table = constrain(params["embed"], "vocab", None).astype(dt)
    x = constrain(jnp.take(table, tokens, axis=0), "batch", "seq", "act_embed")
    if schedule is None:
        x = decoder_stack(params["groups"], x, ctx, model)
    else:  # cast before the pipeline's one FSDP gather, so it moves compute-dtype bytes
        groups = jax.tree_util.tree_map_with_path(lambda p, a: a if is_norm(p) else a.astype(dt), params["groups"])
        specs = param_specs(model, schedule)["groups"]
        x = pipeline_stack(groups, specs, x, ctx, model, schedule, decoder_stack)
    x = layers.norm(x, params["final_norm"], model.norm, model.norm_eps)
    head = params["embed"].T if model.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("bte,ev->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
    logits = constrain(logits, "batch", "seq", "vocab")
    return jnp.where(jnp.arange(padded_vocab(model)) < model.vocab_size, logits, layers.NEG_INF)
