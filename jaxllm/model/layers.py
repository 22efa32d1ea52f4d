"""Building blocks as pure functions over parameter dicts: norms, RoPE, attention, feed-forward.

`attend` takes keys, values and a mask built from explicit query/key indices and segment ids,
apart from the projections, so cached keys can be fed to it; packed documents never attend to
each other.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

NEG_INF = -1e30  # finite, so fully masked rows give a uniform softmax instead of NaN


class Context(NamedTuple):
    """Per-sequence inputs every layer needs, computed once per forward pass."""

    rope: tuple[jax.Array, jax.Array]
    mask: jax.Array


def make_context(
    tokens: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None, head_dim: int, rope_theta: float
) -> Context:
    """RoPE tables and the causal, document-isolating mask; positions default to 0..seq-1 and all
    tokens to one document."""
    b, t = tokens.shape
    index = jnp.broadcast_to(jnp.arange(t), (b, t))
    positions = index if positions is None else positions
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    return Context(rope_tables(positions, head_dim, rope_theta), attention_mask(index, index, segment_ids, segment_ids))


def norm(x: jax.Array, p: dict, kind: str, eps: float) -> jax.Array:
    """RMSNorm or LayerNorm, computed in fp32 and returned in x's dtype."""
    xf = x.astype(jnp.float32)
    if kind == "layernorm":
        xf = xf - xf.mean(-1, keepdims=True)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps) * p["scale"].astype(jnp.float32)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [batch, seq, 1, head_dim] for the rotate-half (Llama) convention."""
    freqs = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


def attention_mask(q_index: jax.Array, k_index: jax.Array, q_segment: jax.Array, k_segment: jax.Array) -> jax.Array:
    """[batch, 1, q, k] boolean: causal by sequence index, and only within the same segment."""
    causal = k_index[:, None, :] <= q_index[:, :, None]
    same_doc = k_segment[:, None, :] == q_segment[:, :, None]
    return (causal & same_doc)[:, None]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention. q: [b, t, heads, d]; k, v: [b, s, kv_heads, d]. Softmax in fp32."""
    b, t, nh, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, nh // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    scores = jnp.where(mask[:, :, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, nh, d)


def attention(
    x: jax.Array, qkv: dict, o_proj: jax.Array, rope: tuple[jax.Array, jax.Array], mask: jax.Array
) -> jax.Array:
    """Self-attention on this device's heads; the caller sums partial outputs over `tensor`."""
    dt = x.dtype
    q = jnp.einsum("bte,ehd->bthd", x, qkv["q"].astype(dt))
    k = jnp.einsum("bte,ehd->bthd", x, qkv["k"].astype(dt))
    v = jnp.einsum("bte,ehd->bthd", x, qkv["v"].astype(dt))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    q, k, v = (checkpoint_name(a, "qkv_proj") for a in (q, k, v))
    ctx = checkpoint_name(attend(q, k, v, mask), "attn_out")
    return jnp.einsum("bthd,hde->bte", ctx, o_proj.astype(dt))


def feed_forward(x: jax.Array, p: dict, activation: str) -> jax.Array:
    """GLU (SwiGLU / GeGLU) or plain GELU MLP on this device's slice of `mlp`."""
    dt = x.dtype
    up = jnp.einsum("bte,em->btm", x, p["up"].astype(dt))
    if activation == "gelu":
        hidden = jax.nn.gelu(up)
    else:
        gate = jnp.einsum("bte,em->btm", x, p["gate"].astype(dt))
        act = jax.nn.silu if activation == "swiglu" else jax.nn.gelu
        hidden = act(gate) * up
    hidden = checkpoint_name(hidden, "mlp_in")
    return jnp.einsum("btm,me->bte", hidden, p["down"].astype(dt))
