"""Generation by full recomputation over a fixed-size buffer (one compile): the sample printed
after training. Greedy at temperature 0, else temperature and top-k sampling from a seed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxllm.model.decoder import forward


def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """Argmax at temperature 0; otherwise a draw from the top-k (0 = all) tokens at `temperature`."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature, axis=-1)


def generate(
    params: dict,
    model: ml_collections.ConfigDict,
    prompt: list[int],
    length: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Continues `prompt` up to `length` tokens in total (prompt included)."""
    if not 0 < len(prompt) < length:
        raise ValueError(f"prompt of {len(prompt)} tokens must be non-empty and shorter than length={length}")
    model = model.copy_and_resolve_references()
    model.attention = "xla"  # any length on any backend; the fused kernels want block-sized ones

    @jax.jit
    def run(params, buffer):
        def step(i, buf):
            logits = forward(params, buf[None], model)[0, i - 1]
            token = sample_token(logits, jax.random.fold_in(jax.random.key(seed), i), temperature, top_k)
            return buf.at[i].set(token.astype(buf.dtype))

        return jax.lax.fori_loop(len(prompt), length, step, buffer)

    buffer = np.zeros(length, np.int32)
    buffer[: len(prompt)] = prompt
    return [int(t) for t in run(params, jnp.asarray(buffer))]
