"""An independent plain-JAX decoder, written as a loop over layers with dense weights and no
sharding, scan, remat or shard_map: what jaxllm's model must compute."""

import jax
import jax.numpy as jnp
import numpy as np


def _norm(x, p, kind, eps):
    if kind == "layernorm":
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]
    return x / jnp.sqrt((x**2).mean(-1, keepdims=True) + eps) * p["scale"]


def _rope(x, positions, theta):
    """Rotates pairs (i, i + d/2) by angle position · theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(d // 2) * 2.0 / d)
    angle = positions[..., None, None] * inv  # [b, t, 1, d/2]
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate(
        [first * jnp.cos(angle) - second * jnp.sin(angle), second * jnp.cos(angle) + first * jnp.sin(angle)], -1
    )


def reference_logits(params, tokens, model, segment_ids=None, positions=None):
    """Logits over the real vocabulary, [batch, seq, vocab_size]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    groups = params["groups"]
    x = params["embed"][tokens]
    for layer in range(model.num_layers):
        g, i = divmod(layer, model.qkv_share_every)
        lp = jax.tree.map(lambda a, g=g, i=i: a[g, i], groups["layers"])
        h = _norm(x, lp["attn_norm"], model.norm, model.norm_eps)
        q, k, v = (jnp.einsum("bte,ehd->bthd", h, groups["qkv"][n][g]) for n in "qkv")
        q, k = _rope(q, positions, model.rope_theta), _rope(k, positions, model.rope_theta)
        repeat = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        scores = jnp.where(allowed[:, None], scores, -jnp.inf)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        x = x + jnp.einsum("bthd,hde->bte", ctx, lp["o_proj"])
        h = _norm(x, lp["mlp_norm"], model.norm, model.norm_eps)
        f = lp["mlp"]
        if model.mlp_activation == "gelu":
            hidden = jax.nn.gelu(h @ f["up"])
        elif model.mlp_activation == "geglu":
            hidden = jax.nn.gelu(h @ f["gate"]) * (h @ f["up"])
        else:
            hidden = jax.nn.silu(h @ f["gate"]) * (h @ f["up"])
        x = x + hidden @ f["down"]
    x = _norm(x, params["final_norm"], model.norm, model.norm_eps)
    head = params["embed"].T if model.tie_embeddings else params["lm_head"]
    return (x @ head)[..., : model.vocab_size]


def reference_loss(params, batch, model):
    logits = reference_logits(params, batch["inputs"], model, batch.get("segment_ids"), batch.get("positions"))
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch.get("loss_mask", jnp.ones_like(nll))
    return (nll * mask).sum() / mask.sum()
