"""Greedy generation by full recomputation: a short sample after training, one compile.
(The KV-cached engine for serving lives in `jaxllm.serve`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxllm.model.transformer import forward


def greedy_generate(params: dict, model: ml_collections.ConfigDict, prompt: list[int], length: int) -> list[int]:
    """Continues `prompt` greedily up to `length` tokens in total (prompt included)."""
    if not 0 < len(prompt) < length:
        raise ValueError(f"prompt of {len(prompt)} tokens must be non-empty and shorter than length={length}")

    @jax.jit
    def run(params, buffer):
        def step(i, buf):
            logits = forward(params, buf[None], model)[0, i - 1]
            return buf.at[i].set(jnp.argmax(logits).astype(buf.dtype))

        return jax.lax.fori_loop(len(prompt), length, step, buffer)

    buffer = np.zeros(length, np.int32)
    buffer[: len(prompt)] = prompt
    return [int(t) for t in run(params, jnp.asarray(buffer))]
